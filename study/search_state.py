"""How well each side of a fair study was searched, from its records alone.

The tuner is deterministic (study/coordinate_descent.py): telling it the recorded objectives
replays the study's search exactly, so its state at the end (converged or not, the grids as
extended) comes back from index.jsonl and plan.json, for studies made before this was recorded
too. Per side:

- converged: a round of the descent changed nothing, and no chosen value sits at an edge of the
  grid searched that the grid could have gone past (an edge at a hard bound is an answer), nor
  the lr chosen at a longer budget at an edge of its retune;
- the last round's gain: how much the best tuning loss fell in the last round run;
- each setting's state: tuned here or held (tuning.dims), swept by a trial or not, at an edge,
  and for a value no trial here varied, where it was last swept: a study below on the ladder
  (tuning.start_from, followed down), or nowhere (the init of conf/tuning/).

A side that did not converge leaves its study unresolved: the report prints its figures with that
word and no bare p-value, and a ladder leaves it out of the trend.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from study.coordinate_descent import CoordinateDescent, Proposal, drive
from study.records import Entry
from study.search_space import Space, extension_point

SEARCH_FILE = "search.json"
INIT = "its init (conf/tuning)"


class _Unrecorded(Exception):
    """The replay reached a trial with no record: a study still running."""


@dataclass
class DimState:
    name: str
    value: float
    tuned: bool            # in this study's search (tuning.dims, or every dim)
    swept: bool            # a trial here varied it
    edge: str = ""         # "low" / "high": the choice sits there and the grid could go further
    origin: str = "here"   # where its value was last swept: "here", a study's name, or INIT
    screen_gain: Optional[float] = None  # its better screen step's gain over the start (study/screen.py)

    def text(self) -> str:
        return f"{self.name}={self.value:.4g}"


@dataclass
class SearchState:
    side: str
    trials: int                       # tuning trials run (per tuning seed)
    budget: int                       # tuning.trials
    converged_at: Optional[int]       # the trial at which a round first changed nothing
    rounds: int
    last_gain: Optional[float]        # the best tuning loss's fall in the last round run (nats)
    dims: list[DimState]
    retune_edges: list[str] = field(default_factory=list)  # "2x lr at its low edge"

    @property
    def never_swept(self) -> list[DimState]:
        return [d for d in self.dims if d.tuned and not d.swept]

    @property
    def at_edge(self) -> list[DimState]:
        return [d for d in self.dims if d.edge]

    @property
    def inherited(self) -> list[DimState]:
        """The settings no trial here varied: held ones and tuned ones the budget never reached."""
        return [d for d in self.dims if not d.swept]

    @property
    def converged(self) -> bool:
        return (self.converged_at is not None and not self.at_edge and not self.retune_edges
                and self.trials >= self.budget)

    def summary(self) -> str:
        """The report's search cell: "converged at trial 20" or why not, in a few words."""
        if self.converged:
            return f"converged at trial {self.converged_at} of {self.budget}"
        why = []
        if self.trials < self.budget:
            why.append(f"{self.trials} of {self.budget} trials run")
        elif self.converged_at is None:
            why.append(f"not converged in {self.budget} trials (round {self.rounds})")
        if self.never_swept:
            why.append("never swept: " + ", ".join(d.name for d in self.never_swept))
        if self.at_edge:
            why.append("at an edge: " + ", ".join(f"{d.text()} ({d.edge})" for d in self.at_edge))
        why += self.retune_edges
        return "; ".join(why)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "converged": self.converged}


def _recorded(entries: list[Entry], names: tuple[str, ...]) -> dict[int, tuple[dict[str, float], float]]:
    """{ordinal: (values of `names`, objective)}: each trial's mean over the tuning seeds, +inf
    if any seed diverged or crashed (the runner's own rule)."""
    by: dict[int, list[Entry]] = {}
    for e in entries:
        by.setdefault(e.ordinal, []).append(e)
    out = {}
    for ordinal, runs in by.items():
        scores = [e.score for e in runs]
        objective = math.inf if any(math.isinf(s) for s in scores) else math.fsum(scores) / len(scores)
        out[ordinal] = ({k: v for k, v in runs[0].values.items() if k in names}, objective)
    return out


def replay(space: Space, trials: int, extend_max: int, entries: list[Entry]) -> CoordinateDescent:
    """The tuner as the study left it: every recorded trial told back, in its order."""
    engine = CoordinateDescent(space, trials, extend_max)

    def unrecorded(batch: list[Proposal]) -> list[float]:
        raise _Unrecorded()

    try:
        drive(engine, unrecorded, _recorded(entries, space.names))
    except _Unrecorded:
        pass
    return engine


def _edge(dim: Any, grid: list[float], x: float) -> str:
    if len(dim.grid) < 2:
        return ""
    for side, end in (("low", grid[0]), ("high", grid[-1])):
        if x == end and extension_point(dim, grid, side) is not None:
            return side
    return ""


def last_round_gain(engine: CoordinateDescent) -> Optional[float]:
    history = engine.history
    last = max((p.round for p, _ in history), default=0)
    if last < 1:
        return None
    before = min((v for p, v in history if p.round < last), default=math.inf)
    after = min((v for p, v in history if p.round <= last), default=math.inf)
    return before - after if math.isfinite(before) and math.isfinite(after) else None


def held_values(plan: dict[str, Any], side: str) -> dict[str, float]:
    """The dims `side` held at a value (tuning.dims left them out), read from its fixed overrides
    through the dims' keys in the side's full space (conf/tuning/)."""
    names = plan["tuning"].get("dims")
    if not names:
        return {}
    from study.checks import compose_study
    from study.space_config import parse_space

    full = parse_space(side, compose_study("fair", [])["spaces"][plan["spaces"][side]["optimizer"]])
    fixed = {o.lstrip("+").split("=", 1)[0]: o.split("=", 1)[1] for o in plan["spaces"][side].get("fixed", [])}
    return {d.name: float(fixed[d.keys[0]]) for d in full.dims if d.name not in names and d.keys[0] in fixed}


def side_state(plan: dict[str, Any], entries: list[Entry], side: str, lineage: "Lineage") -> SearchState:
    """`side`'s search state from the study's plan and index (see the module docstring)."""
    from study.screen import descent_space
    from study.space_config import lr_space

    space = descent_space(plan, entries, side)
    tuning, compare = plan["tuning"], plan["compare"]
    tuned = [e for e in entries if e.stage == "tune" and e.side == side]
    engine = replay(space, tuning["trials"], tuning["extend_max"], tuned)
    chosen = dict(engine.incumbent.values) if engine.incumbent is not None else space.initial()
    swept = {e.dim for e in tuned if e.dim}
    dims = [DimState(d.name, chosen[d.name], True, d.name in swept, _edge(d, engine.grid(d.name), chosen[d.name]))
            for d in space.dims]
    dims += [DimState(name, value, False, False) for name, value in held_values(plan, side).items()
             if name not in space.names]
    from study.screen import screen_result

    screened = screen_result(plan, entries)
    for d in dims:
        if not d.swept:
            d.origin = lineage.origin(plan, side, d.name)
        if screened is not None:
            d.screen_gain = screened.gains[side].get(d.name)
    edges = []
    retune = compare.get("retune", {})
    if retune.get("trials") and engine.incumbent is not None:
        for budget in compare["budgets"][1:]:
            runs = [e for e in entries if e.stage == "retune" and e.side == side and e.budget == budget]
            lr_engine = replay(lr_space(space, chosen["lr"], retune["step"]), retune["trials"],
                               tuning["extend_max"], runs)
            if lr_engine.incumbent is None:
                continue
            lr = lr_engine.incumbent.value("lr")
            edge = _edge(lr_engine.space.dim("lr"), lr_engine.grid("lr"), lr)
            if edge:
                edges.append(f"the lr at {budget:g}x ({lr:.4g}) at its retune's {edge} edge")
    trials = len({e.ordinal for e in tuned})
    return SearchState(side, trials, tuning["trials"], engine.converged_at, engine.round, last_round_gain(engine),
                       dims, edges)


class Lineage:
    """Where a value no trial varied came from: the studies a study started from
    (tuning.start_from), followed down until one swept that setting. Each is read once."""

    def __init__(self) -> None:
        self.swept: dict[str, dict[str, set[str]]] = {}   # study path -> side -> dims swept there
        self.plans: dict[str, dict[str, Any]] = {}

    def _read(self, source: str) -> bool:
        if source in self.plans:
            return True
        from study.records import StudyError, read_index, read_plan, records_dir

        try:
            records = records_dir(Path(source))
            plan, entries = read_plan(records), read_index(records)
        except (StudyError, OSError):
            return False
        self.plans[source] = plan
        self.swept[source] = {side: {e.dim for e in entries if e.stage == "tune" and e.side == side and e.dim}
                              for side in (plan["target"], plan["baseline"])}
        return True

    def origin(self, plan: dict[str, Any], side: str, name: str) -> str:
        source = plan["tuning"].get("start_from")
        seen = set()
        while source and source not in seen:
            seen.add(source)
            if not self._read(source):
                return f"{Path(source).name} (not found here)"
            if name in self.swept[source].get(side, set()):
                return Path(source).name
            source = self.plans[source]["tuning"].get("start_from")
        return INIT


def study_states(plan: dict[str, Any], entries: list[Entry]) -> dict[str, SearchState]:
    """Each side's SearchState; a rerun's (plan["chosen"]) is its source's, whose records it copied."""
    lineage = Lineage()
    return {side: side_state(plan, entries, side, lineage) for side in (plan["target"], plan["baseline"])}


def write_states(records: Path, states: dict[str, SearchState]) -> None:
    from data.atomic import atomic_output

    with atomic_output(records / SEARCH_FILE) as f:
        f.write((json.dumps({side: s.to_dict() for side, s in states.items()}, indent=1, sort_keys=True) + "\n").encode())
