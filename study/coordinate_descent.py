"""Coordinate descent with a fixed budget: the tuner of scripts/fair_compare.py, one engine per
optimizer, each spending exactly the same number of trials.

As in Wen et al. (2025), "Fantastic Pretraining Optimizers and Where to Find Them": sweep one
hyperparameter over its grid with the others at their current best, visit every one in turn,
and cycle until a round changes nothing. Two things make it fair between sides:
- a best value at the edge of its grid extends the grid one step (up to `extend_max` times a
  round, never past a hard bound), and every extension is a trial counted in the budget;
- a converged side does not stop early: it refines its grids around the incumbent (midpoints
  in scale units) and goes on, so both sides spend exactly `trials`. Convergence is recorded
  (`converged_at`) for the report, not used to stop.

The engine is ask/tell and deterministic: the proposals depend only on the space, the budget
and the objectives told back. That gives the two properties the study relies on:
- prefix: the first n trials of a budget-m run are the budget-n run, and the incumbent is always
  the argmin (earliest of ties) of the trials evaluated so far;
- replay: telling recorded objectives back reproduces the same proposals, so a resumed study
  (`drive` with `recorded`) evaluates only trials it has no record of.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Optional, Sequence

from study.search_space import Dim, Space, extension_point, format_value, refine_points, to_unit

REASONS = ("init", "sweep", "extend", "refine")


@dataclass(frozen=True)
class Proposal:
    ordinal: int                              # 0..trials-1: the trial's place in the sequence
    values: tuple[tuple[str, float], ...]     # every dim's value, in the space's dim order
    dim: Optional[str]                        # the coordinate being swept; None for the initial point
    round: int                                # 0 for the initial point, then 1, 2, ...
    reason: str                               # one of REASONS

    def as_dict(self) -> dict[str, float]:
        return dict(self.values)

    def value(self, name: str) -> float:
        return self.as_dict()[name]

    def label(self) -> str:
        """What the trial changes, for progress lines: "lr=0.003", or "init"."""
        return "init" if self.dim is None else f"{self.dim}={self.value(self.dim):.4g}"


class ReplayError(ValueError):
    """A recorded trial is not what this engine proposes at its ordinal: the plan changed."""


Config = tuple[float, ...]  # a trial's values alone, in dim order: what "already evaluated" compares


class CoordinateDescent:
    def __init__(self, space: Space, trials: int, extend_max: int = 3) -> None:
        if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
            raise ValueError(f"trials must be a whole number >= 1, got {trials!r}")
        if isinstance(extend_max, bool) or not isinstance(extend_max, int) or extend_max < 0:
            raise ValueError(f"extend_max must be a whole number >= 0, got {extend_max!r}")
        self.space = space
        self.trials = trials
        self.extend_max = extend_max
        # Each dim's grid grows with extensions and refinements, and stays grown for later rounds.
        self._grids: dict[str, list[float]] = {d.name: list(d.grid) for d in space.dims}
        self._evaluated: dict[Config, float] = {}
        self._history: list[tuple[Proposal, float]] = []
        self._issued = 0
        self._pending: dict[int, Proposal] = {}
        self._told: dict[int, float] = {}
        # The sweep centre: the incumbent's values, or the initial point until a trial is finite.
        self._centre: Config = tuple(d.init for d in space.dims)
        self._best: Optional[tuple[Proposal, float]] = None
        self._round = 0
        self._converged_at: Optional[int] = None
        self._exhausted = False
        self._notes: list[str] = []
        self._finished = False
        self._cut = False  # the last batch was cut short by the budget
        self._plan: Iterator[list[Proposal]] = self._search()
        self._next_batch()

    # ---- the public interface ----------------------------------------------------------

    def ask(self) -> list[Proposal]:
        """The current batch's proposals still waiting for a result, in ordinal order ([] once
        the budget is spent). Asking again before telling returns the same proposals."""
        return [p for o, p in sorted(self._pending.items()) if o not in self._told]

    def tell(self, results: Sequence[tuple[Proposal, float]]) -> None:
        """Objectives of asked proposals (any subset of the batch, in any order); math.inf (or
        nan) for a trial that diverged or crashed: it is counted and never chosen. When the whole
        batch has its results, the engine moves on to the next one."""
        for proposal, objective in results:
            if self._pending.get(proposal.ordinal) != proposal:
                raise ValueError(f"trial {proposal.ordinal} ({proposal.label()}) is not a proposal awaiting a result")
            if proposal.ordinal in self._told:
                raise ValueError(f"trial {proposal.ordinal} ({proposal.label()}) was told twice")
            value = float(objective)
            self._told[proposal.ordinal] = value if math.isfinite(value) else math.inf
        if self._pending and len(self._told) == len(self._pending):
            self._finish_batch()

    @property
    def incumbent(self) -> Optional[Proposal]:
        """The trial with the lowest finite objective (the earliest of equals); None while no
        trial has a finite one."""
        return None if self._best is None else self._best[0]

    @property
    def incumbent_objective(self) -> float:
        return math.inf if self._best is None else self._best[1]

    @property
    def done(self) -> bool:
        return self._finished and not self._pending

    @property
    def converged_at(self) -> Optional[int]:
        """The number of trials when a round first changed nothing; None if none has yet."""
        return self._converged_at

    @property
    def notes(self) -> list[str]:
        """What the report should state: bounds that stopped an extension, the extension limit,
        refinements, an early end."""
        return list(self._notes)

    @property
    def history(self) -> list[tuple[Proposal, float]]:
        """Every evaluated trial and its objective (inf: diverged or crashed), in ordinal order."""
        return list(self._history)

    @property
    def round(self) -> int:
        return self._round

    def grid(self, name: str) -> list[float]:
        """The points of dim `name` the search knows now: its grid, with every extension and
        refinement added so far."""
        return list(self._grids[name])

    def summary(self) -> str:
        """One line for the report: the trials spent and whether (and when) the side converged."""
        spent = f"{len(self._history)} of {self.trials} trials"
        if self._converged_at is not None:
            return f"{spent}; converged at trial {self._converged_at}, then refined its grids"
        if self._exhausted:
            return f"{spent}; stopped: every grid point was evaluated"
        return f"{spent}; not converged: the budget ran out in round {self._round}"

    # ---- the algorithm -------------------------------------------------------------------

    @property
    def _remaining(self) -> int:
        return self.trials - self._issued

    def _with(self, i: int, x: float) -> Config:
        return self._centre[:i] + (x,) + self._centre[i + 1:]

    def _batch(self, configs: list[Config], dim: Optional[str], reason: str) -> list[Proposal]:
        # Cut to the budget left: the cut keeps the first (nearest) points, which is what makes a
        # smaller budget's run a prefix of a larger one's.
        self._cut = len(configs) > self._remaining
        configs = configs[:self._remaining]
        names = self.space.names
        batch = [Proposal(self._issued + k, tuple(zip(names, c)), dim, self._round, reason)
                 for k, c in enumerate(configs)]
        self._issued += len(batch)
        return batch

    def _nearest_first(self, i: int, dim: Dim) -> list[float]:
        # Distances rounded to 1e-9 units, so points one step either side tie (and the lower goes
        # first) even when the 12-digit values make one gap a hair longer than the other.
        centre = to_unit(dim, self._centre[i])
        return sorted(self._grids[dim.name], key=lambda x: (round(abs(to_unit(dim, x) - centre), 9), x))

    def _note(self, text: str) -> None:
        if text not in self._notes:
            self._notes.append(text)

    def _search(self) -> Iterator[list[Proposal]]:
        """The whole descent as a generator of batches; each resumes once its batch is told."""
        yield self._batch([self._centre], None, "init")
        reason = "sweep"
        while True:
            self._round += 1
            start, proposed = self._centre, False
            for i, dim in enumerate(self.space.dims):
                configs = [self._with(i, x) for x in self._nearest_first(i, dim)]
                configs = [c for c in configs if c not in self._evaluated]
                if configs:
                    if not self._remaining:
                        return
                    yield self._batch(configs, dim.name, reason)
                    proposed = True
                for extended in range(self.extend_max + 1):
                    side = self._edge(i, dim)
                    if side is None:
                        break
                    if not self._remaining:
                        return
                    best = self._centre[i]
                    if extended == self.extend_max:
                        self._note(f"{dim.name}: best {best:.4g} is still at the {side} edge of its grid after "
                                   f"{self.extend_max} extensions in round {self._round}")
                        break
                    point = extension_point(dim, self._grids[dim.name], side)
                    if point is None:
                        bound = dim.lo_bound if side == "low" else dim.hi_bound
                        where = (f"its bound ({'min' if side == 'low' else 'max'} {bound:g})" if bound is not None
                                 else f"the {side} end of its {dim.scale} scale")
                        self._note(f"{dim.name}: best {best:.4g} is at {where}")
                        break
                    self._grids[dim.name] = sorted(self._grids[dim.name] + [point])
                    yield self._batch([self._with(i, point)], dim.name, "extend")
                    proposed = True
                    if self._centre[i] != point:
                        break  # the extension lost: the best is inside the grid again
            if self._cut:
                return  # the budget ended inside this round: it did not finish, so it says nothing
            if self._centre != start:
                reason = "sweep"
                continue
            # A round that changed nothing: converged. Refine every grid around the incumbent,
            # so the rest of the budget is spent where the optimum is, and go on.
            if self._converged_at is None:
                self._converged_at = self._issued
            added = 0
            for i, dim in enumerate(self.space.dims):
                new = refine_points(dim, self._grids[dim.name], self._centre[i])
                self._grids[dim.name] = sorted(self._grids[dim.name] + new)
                added += len(new)
            if not added and not proposed:
                # Only one-point (or exhausted integer) dims: nothing is left to try.
                self._exhausted = True
                self._note(f"every grid point has been evaluated: stopped after {self._issued} of "
                           f"{self.trials} trials")
                return
            self._note(f"round {self._round} changed nothing (trial {self._issued}): grids refined "
                       "around the incumbent")
            reason = "refine"

    def _edge(self, i: int, dim: Dim) -> Optional[str]:
        """The edge of the dim's grid its best value sits on, when it should extend there: only
        with a finite incumbent (all-inf trials say nothing about where to go) and a real grid."""
        if self._best is None or len(dim.grid) < 2:
            return None
        grid, x = self._grids[dim.name], self._centre[i]
        return "low" if x == grid[0] else "high" if x == grid[-1] else None

    def _finish_batch(self) -> None:
        # In ordinal order, and only a strictly lower objective moves the incumbent: ties keep
        # the earlier trial, so the incumbent is the earliest argmin of the trials so far.
        for ordinal in sorted(self._pending):
            proposal, objective = self._pending[ordinal], self._told[ordinal]
            config = tuple(v for _, v in proposal.values)
            self._evaluated[config] = objective
            self._history.append((proposal, objective))
            if objective < self.incumbent_objective:
                self._best = (proposal, objective)
                self._centre = config
        self._pending, self._told = {}, {}
        self._next_batch()

    def _next_batch(self) -> None:
        batch = next(self._plan, None)
        if batch:
            self._pending = {p.ordinal: p for p in batch}
        else:
            self._finished = True


def drive(engine: CoordinateDescent, evaluate: Callable[[list[Proposal]], list[float]],
          recorded: Optional[Mapping[int, tuple[Mapping[str, float], float]]] = None) -> list[tuple[Proposal, float]]:
    """Run `engine` to its end. `recorded` maps an ordinal to (its values, its objective) from an
    earlier, interrupted run: those trials are told back without evaluating, after checking the
    values are what the engine proposes there; `evaluate` gets only the rest, a batch at a time,
    and returns their objectives in order. Returns the engine's history."""
    recorded = recorded or {}
    while batch := engine.ask():
        known = []
        for proposal in batch:
            if proposal.ordinal in recorded:
                values, objective = recorded[proposal.ordinal]
                _check_replay(engine.space, proposal, values)
                known.append((proposal, math.inf if objective is None else objective))  # JSON null: inf
        engine.tell(known)
        fresh = [p for p in batch if p.ordinal not in recorded]
        if fresh:
            objectives = list(evaluate(fresh))
            if len(objectives) != len(fresh):
                raise ValueError(f"evaluate returned {len(objectives)} objectives for {len(fresh)} trials")
            engine.tell(list(zip(fresh, objectives)))
    return engine.history


def _check_replay(space: Space, proposal: Proposal, values: Mapping[str, float]) -> None:
    wanted = proposal.as_dict()
    if dict(values) == wanted:
        return
    differ = [d for d in space.dims if values.get(d.name) != wanted[d.name]]
    shown = ", ".join(f"{d.name}={format_value(d, values[d.name]) if d.name in values else 'missing'} "
                      f"(now {format_value(d, wanted[d.name])})" for d in differ[:3])
    extra = sorted(set(values) - set(wanted))
    raise ReplayError(f"trial {proposal.ordinal} was recorded with "
                      f"{shown or 'unknown dims ' + ', '.join(extra)}: the plan changed since it ran")
