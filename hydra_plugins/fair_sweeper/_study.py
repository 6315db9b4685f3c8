"""The stages of a fair study, run by hydra/sweeper=fair (fair_sweeper.py) through Hydra's
launcher. Each stage spends the same runs and tokens on both sides, by construction:

1. tune: one coordinate descent per side (eval/fair/coordinate_descent.py), in lockstep, each of
   exactly tuning.trials trials at the 1x budget, scored on the tuning split (val/tune/loss) on
   the tuning seeds;
2. retune: each side's lr searched again around its choice at every budget but 1x, with the
   same number of trials on both sides;
3. final: each side's choice at every budget, once per fresh seed, reported on val and OOD.

Every run is recorded (records/, eval/fair/records.py) as it ends, whether it finished, diverged
or crashed. The engines are deterministic, so a study run again replays them: a run already
recorded, or finished in its run dir, is taken from there, and only the rest is launched.
"""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional

from eval.fair.coordinate_descent import CoordinateDescent
from eval.fair.records import CRASHED, DIVERGED, OK, TUNE_KEY, Entry, StudyError, read_index, run_id, write_index
from eval.run_records import compress, write_record
from eval.fair.search_space import trial_overrides
from eval.fair.space_config import lr_space, parse_space
from scripts.fair.plan import Plan, run_overrides, run_steps

class StudyRunner:
    def __init__(self, plan_path: str, config: Any, launcher: Any) -> None:
        self.records = Path(plan_path).parent
        self.plan = Plan.from_json(Path(plan_path).read_text())
        self.runs = Path(str(config.hydra.sweep.dir))
        self.launcher = launcher
        self.spaces = {side: parse_space(side, self.plan.spaces[side]) for side in self.plan.sides}
        self.recorded = {e.name: e for e in read_index(self.records)}
        self.index: list[Entry] = []  # this pass's runs, in launch order
        self.job = 0
        self.started = time.monotonic()
        self.launched = 0
        self.one_at_a_time = type(launcher).__name__ == "BasicLauncher"

    # ---- the stages ----

    def run(self) -> list[Any]:
        if self.plan.chosen:  # a rerun of a tuned study's choice (scripts/fair/rerun.py): finals only
            chosen = {side: by_budget["1"] for side, by_budget in self.plan.chosen.items()}
            lrs = {(side, float(b)): values["lr"] for side, by_budget in self.plan.chosen.items()
                   for b, values in by_budget.items()}
            self.say(f"the tuned settings of {self.plan.tuning.get('chosen_from')}: "
                     + "; ".join(f"{side} {values_text(values)}" for side, values in chosen.items()))
        else:
            chosen = self.tune()
            lrs = self.retune(chosen)
        self.final(chosen, lrs)
        reused = sum(1 for e in self.index if e.name in self.recorded)
        self.say(f"done: {len(self.index)} runs, {self.launched} trained now, {reused} taken from the records")
        return []

    def tune(self) -> dict[str, dict[str, float]]:
        """Each side's chosen values: the argmin of its tuning trials."""
        trials = self.plan.tuning["trials"]
        engines = {side: CoordinateDescent(space, trials, self.plan.tuning["extend_max"])
                   for side, space in self.spaces.items()}
        self.descend(engines, self.tune_entry)
        for side, engine in engines.items():
            if engine.incumbent is None:
                raise StudyError(f"every tuning trial of {side} diverged or crashed: there is nothing to choose "
                                 f"(records/tune/{side}/ says how; lower spaces.{side}.lr's grid)")
        counts = {side: sum(1 for e in self.index if e.stage == "tune" and e.side == side) for side in engines}
        if len(set(counts.values())) != 1:  # the engines spend exactly their budget: a bug otherwise
            raise StudyError(f"tuning ran unequal budgets: {counts}")
        for side, engine in engines.items():
            when = (f"converged at trial {engine.converged_at}" if engine.converged_at is not None
                    else "did not converge (the budget ran out)")
            self.say(f"tune {side}: chose {values_text(dict(engine.incumbent.values))} ({when})")
        tokens = sum(e.tokens_planned for e in self.index if e.stage == "tune" and e.side == self.plan.target)
        self.say(f"tune done: {counts[self.plan.target]} runs and {tokens:,} tokens per side (equal)")
        return {side: dict(engine.incumbent.values) for side, engine in engines.items()}

    def retune(self, chosen: dict[str, dict[str, float]]) -> dict[tuple[str, float], float]:
        """The lr of each side at each budget: its 1x choice, searched again around it at every
        longer budget with compare.retune.trials trials per side and budget."""
        lrs = {(side, 1.0): values["lr"] for side, values in chosen.items()}
        retune = self.plan.compare["retune"]
        for budget in self.plan.compare["budgets"][1:]:
            if not retune["trials"]:
                lrs.update({(side, budget): values["lr"] for side, values in chosen.items()})
                continue
            engines = {side: CoordinateDescent(lr_space(self.spaces[side], chosen[side]["lr"], retune["step"]),
                                               retune["trials"], self.plan.tuning["extend_max"])
                       for side in chosen}
            self.descend(engines, lambda side, p, seed: self.retune_entry(side, budget, chosen[side], p, seed))
            for side, engine in engines.items():
                lrs[(side, budget)] = dict(engine.incumbent.values)["lr"]
        return lrs

    def descend(self, engines: dict[str, CoordinateDescent],
                entry: Callable[[str, Any, int], tuple[Entry, list[str]]]) -> None:
        """Ask every side's engine for its next batch, run each proposal on every tuning seed
        (`entry` makes its record and overrides), tell each engine its scores; until all are done."""
        while True:
            asked = {side: engine.ask() for side, engine in engines.items()}
            if not any(asked.values()):
                return
            wanted = [(side, p, seed) for side, proposals in asked.items() for p in proposals
                      for seed in self.plan.tuning["seeds"]]
            done = self.execute([entry(side, p, seed) for side, p, seed in wanted])
            for side, proposals in asked.items():
                engines[side].tell([(p, self.mean_score([e for (s, q, _), e in zip(wanted, done)
                                                          if s == side and q is p])) for p in proposals])

    def final(self, chosen: dict[str, dict[str, float]], lrs: dict[tuple[str, float], float]) -> None:
        wanted = [self.final_entry(side, budget, {**chosen[side], "lr": lrs[(side, budget)]}, seed)
                  for side in self.plan.sides for budget in self.plan.compare["budgets"]
                  for seed in self.plan.compare["seeds"]]
        self.execute(wanted)

    # ---- runs ----

    def tune_entry(self, side: str, proposal: Any, seed: int) -> tuple[Entry, list[str]]:
        values = dict(proposal.values)
        steps, tokens = run_steps(self.plan, self.spaces[side], values, 1.0)
        overrides = run_overrides(self.plan.train, trial_overrides(self.spaces[side], values),
                                  self.plan.tuning["split_fraction"], steps, seed, TUNE_KEY)
        rid = run_id(overrides)
        seed_part = f"-seed{seed}" if len(self.plan.tuning["seeds"]) > 1 else ""
        entry = Entry(stage="tune", side=side, budget=1.0, name=f"tune/{side}/{proposal.ordinal:03d}-{rid}{seed_part}",
                      run_id=rid, seed=seed, steps=steps, tokens_planned=tokens,
                      status="", objective=None, ordinal=proposal.ordinal, round=proposal.round,
                      reason=proposal.reason, dim=proposal.dim, values=values)
        return entry, overrides

    def retune_entry(self, side: str, budget: float, chosen: dict[str, float], proposal: Any,
                     seed: int) -> tuple[Entry, list[str]]:
        values = {**chosen, "lr": dict(proposal.values)["lr"]}
        steps, tokens = run_steps(self.plan, self.spaces[side], values, budget)
        overrides = run_overrides(self.plan.train, trial_overrides(self.spaces[side], values),
                                  self.plan.tuning["split_fraction"], steps, seed, TUNE_KEY)
        rid = run_id(overrides)
        seed_part = f"-seed{seed}" if len(self.plan.tuning["seeds"]) > 1 else ""
        entry = Entry(stage="retune", side=side, budget=budget,
                      name=f"retune/{side}/{budget:g}x/{proposal.ordinal:02d}-{rid}{seed_part}", run_id=rid, seed=seed,
                      steps=steps, tokens_planned=tokens, status="", objective=None,
                      ordinal=proposal.ordinal, round=proposal.round, reason=proposal.reason, dim="lr", values=values)
        return entry, overrides

    def final_entry(self, side: str, budget: float, values: dict[str, float], seed: int) -> tuple[Entry, list[str]]:
        steps, tokens = run_steps(self.plan, self.spaces[side], values, budget)
        interval = max(1, steps // self.plan.compare["eval_points"])
        overrides = run_overrides(self.plan.train, trial_overrides(self.spaces[side], values),
                                  self.plan.tuning["split_fraction"], steps, seed, None, interval)
        rid = run_id(overrides)
        entry = Entry(stage="final", side=side, budget=budget, name=f"final/{side}/{budget:g}x/seed{seed}", run_id=rid,
                      seed=seed, steps=steps, tokens_planned=tokens, status="",
                      objective=None, values=values)
        return entry, overrides

    def execute(self, wanted: list[tuple[Entry, list[str]]]) -> list[Entry]:
        """Each wanted run's entry: from the records, from a finished run dir (recorded now), or
        trained (the basic launcher one run at a time, so that each is recorded as it ends;
        another launcher the whole batch at once)."""
        done: dict[int, Entry] = {}
        to_launch: list[int] = []
        for i, (entry, overrides) in enumerate(wanted):
            known = self.recorded.get(entry.name)
            if known is not None:
                if known.run_id != entry.run_id:
                    raise StudyError(f"records/{entry.name} was made with other settings than this plan's "
                                     "(another base override, grid or seed): give this study another --out")
                done[i] = self.add(known)
                continue
            found = self.from_run_dir(entry)
            if found is not None:
                done[i] = self.add(found)
                continue
            to_launch.append(i)
        batches = [[i] for i in to_launch] if self.one_at_a_time else ([to_launch] if to_launch else [])
        for batch in batches:
            jobs = [[*wanted[i][1], f"hydra.sweep.subdir={wanted[i][0].name}"] for i in batch]
            results = self.launcher.launch(jobs, initial_job_idx=self.job)
            self.job += len(jobs)
            self.launched += len(jobs)
            for i, result in zip(batch, results):
                done[i] = self.add(self.finish(wanted[i][0], result))
        return [done[i] for i in range(len(wanted))]

    def add(self, entry: Entry) -> Entry:
        """`entry` into this pass's index, written at once: a study stopped at any moment keeps
        every run it recorded."""
        if all(e.name != entry.name for e in self.index):
            self.index.append(entry)
            write_index(self.records, self.merged_index())
        return entry

    def merged_index(self) -> list[Entry]:
        """This pass's entries, then any recorded earlier that this pass has not reached yet (a
        raised budget, removed seeds): nothing recorded is dropped."""
        names = {e.name for e in self.index}
        return self.index + [e for name, e in self.recorded.items() if name not in names]

    def finish(self, entry: Entry, result: Any) -> Entry:
        """The launched run's entry, recorded: ok, diverged (a non-finite return) or crashed."""
        from hydra.core.utils import JobStatus

        error = None
        value: Optional[float] = None
        if result.status == JobStatus.COMPLETED:
            value = result.return_value
        else:
            error = first_line(result._return_value)
        status = OK if value is not None and math.isfinite(value) else (CRASHED if error else DIVERGED)
        done = replace(entry, status=status, objective=float(value) if status == OK else None, error=error)
        return self.record(done)

    def from_run_dir(self, entry: Entry) -> Optional[Entry]:
        """A run that finished in its run dir without being recorded (the study stopped between
        its end and its record): its entry, recorded now; None if it has not finished."""
        from eval.compare import load_run

        run_dir = self.runs / entry.name
        if not (run_dir / "metrics.jsonl").is_file():
            return None
        run = load_run(run_dir)
        if run.unfinished() is not None:
            return None
        key = TUNE_KEY if entry.stage != "final" else "val/val/loss"
        steps, values = run.series.get(key, ([], []))
        value = values[-1] if steps and steps[-1] == entry.steps else math.nan
        status = OK if math.isfinite(value) else DIVERGED
        return self.record(replace(entry, status=status, objective=value if status == OK else None))

    def record(self, entry: Entry) -> Entry:
        run_dir = self.runs / entry.name
        target = self.records / entry.name
        if (run_dir / "metrics.jsonl").is_file() and (run_dir / ".hydra" / "config.yaml").is_file():
            write_record(run_dir, target)
            entry = replace(entry, tokens_seen=last_tokens(run_dir / "metrics.jsonl"))
        else:  # crashed before its first row: its configs, and an empty metrics file, say what it was
            target.mkdir(parents=True, exist_ok=True)
            (target / "metrics.jsonl.gz").write_bytes(compress(b""))
            for name in (".hydra/config.yaml", ".hydra/overrides.yaml"):
                if (run_dir / name).is_file():
                    (target / name).parent.mkdir(parents=True, exist_ok=True)
                    (target / name).write_bytes((run_dir / name).read_bytes())
        self.progress(entry)
        return entry

    def mean_score(self, entries: list[Entry]) -> float:
        """A proposal's objective over the tuning seeds: their mean, +inf if any diverged or crashed."""
        scores = sorted(e.score for e in entries)
        return math.inf if not scores or any(math.isinf(s) for s in scores) else math.fsum(scores) / len(scores)

    # ---- what it says ----

    def progress(self, entry: Entry) -> None:
        what = f"{entry.stage} {entry.side} {entry.budget:g}x"
        if entry.stage == "final":
            what += f" seed {entry.seed}"
        else:
            what += f" #{entry.ordinal} {entry.reason}" + (f" {entry.dim}={entry.values[entry.dim]:.4g}" if entry.dim else "")
        if entry.status == OK:
            outcome = f"{'val/tune/loss' if entry.stage != 'final' else 'val/val/loss'} {entry.objective:.4f}"
        else:
            outcome = f"{entry.status} (recorded, counted)" + (f": {entry.error}" if entry.error else "")
        self.say(f"{what}: {outcome} ({minutes(time.monotonic() - self.started)} in)")

    def say(self, line: str) -> None:
        print(f"[fair] {line}", flush=True)


def values_text(values: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.4g}" for k, v in values.items())


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def first_line(err: Any) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def last_tokens(metrics: Path) -> int:
    lines = [line for line in metrics.read_text().splitlines() if line.strip()]
    if not lines:
        return 0
    try:
        return int(json.loads(lines[-1]).get("tokens", 0))
    except ValueError:
        return 0


if __name__ == "__main__":  # pragma: no cover - a module of the sweeper, not a command
    sys.exit("run scripts/fair_compare.py")
