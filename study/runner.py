"""The stages of a fair study, each spending the same runs and tokens on both sides, by
construction; the runs go through a `Launch` callable (Hydra's launchers: hydra_plugins/):

1. tune: one coordinate descent per side (study/coordinate_descent.py), in lockstep, each of
   exactly tuning.trials trials at the 1x budget, scored on the tuning split (val/tune/loss) on
   the tuning seeds;
2. retune: each side's lr searched again around its choice at every budget but 1x, with the
   same number of trials on both sides;
3. final: each side's choice at every budget, once per fresh seed, reported on val and OOD.

Every run is recorded (records/, study/records.py) as it ends, whether it finished, diverged
or crashed. The engines are deterministic, so a study run again replays them: a run already
recorded, or finished in its run dir, is taken from there, and only the rest is launched.

A run's overrides are its identity (what decides its numbers: the plan's base, the trial's
values, its steps and seed; digested into its run id) followed by how it is run: its wandb
name, group and config, the eval sets a trial needs, the measured peak FLOP/s. Only the first
part must match a record for the record to be taken.

Ctrl-C or SIGTERM stops the study wherever it lands: a run being trained checkpoints and
stops; between runs, the next one is not started (trainer/run/interrupts.py).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional, Protocol, Sequence

from eval.run_records import compress, write_record
from study.coordinate_descent import CoordinateDescent
from study.plan import Plan, planned_runs
from study.runs import given, run_overrides, run_steps
from study.progress import StudyProgress, say
from study.records import (CRASHED, DIVERGED, OK, PLAN_FILE, TUNE_KEY, VAL_KEY, Entry, StudyError, check_belongs,
                           load_record, read_index, run_id, write_index)
from study.screen import descent_node, full_space, screen_result, screen_trials
from study.search_space import trial_overrides
from study.search_state import study_states, write_states
from study.space_config import lr_space, parse_space


@dataclass(frozen=True)
class Job:
    name: str              # its record's path below records/, and its run dir's below runs/
    overrides: list[str]   # train.py's overrides of the run


@dataclass(frozen=True)
class Outcome:
    value: Optional[float]        # what the run returned: its eval.objective at the last step
    error: Optional[str] = None   # the first line of what stopped a run that failed


class Launch(Protocol):
    """Runs a batch of jobs and returns their outcomes in order. `in_flight`: how many run at
    once (1: one after another, each recorded as it ends; None: the whole batch); `local`:
    they run on this machine (its measured peak FLOP/s holds for them)."""

    in_flight: Optional[int]
    local: bool

    def __call__(self, jobs: Sequence[Job]) -> list[Outcome]: ...


def quoted(text: str) -> str:
    """A Hydra override value that holds any text (spaces, '=', ',')."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


# Where a run's entry came from, when it was not trained now (its line says so).
FROM_RECORDS = "from the records"
FROM_RUN_DIR = "finished before the stop; recorded now"
FROM_RECORD = "from its record; its index line was lost"


class StudyRunner:
    def __init__(self, records: Path, runs: Path, launch: Launch) -> None:
        self.records = records
        self.plan = Plan.from_json((records / PLAN_FILE).read_text())
        self.runs = runs
        self.launch = launch
        self.spaces = {side: parse_space(side, self.plan.spaces[side]) for side in self.plan.sides}
        self.recorded = {e.name: e for e in read_index(records)}
        self.index: list[Entry] = []  # this pass's runs, in launch order
        self.launched = 0
        self.progress = StudyProgress(*planned_runs(self.plan))
        self.settings = run_settings(self.plan, records.parent, launch.local)

    # ---- the stages ----

    def run(self) -> None:
        per_side = self.progress.total // 2
        say(f"{self.progress.total} runs planned, {per_side} a side; "
            + (f"{self.launch.in_flight} at a time" if self.launch.in_flight else "each batch at once"))
        if self.recorded:
            say(f"the records hold {len(self.recorded)} runs: each one this plan asks for is taken from there, "
                "not trained again")
        if self.plan.chosen:  # a rerun of a tuned study's choice (study/rerun.py): finals only
            chosen = {side: by_budget["1"] for side, by_budget in self.plan.chosen.items()}
            lrs = {(side, float(b)): values["lr"] for side, by_budget in self.plan.chosen.items()
                   for b, values in by_budget.items()}
            say(f"the tuned settings of {self.plan.tuning.get('chosen_from')}: "
                + "; ".join(f"{side} {values_text(values)}" for side, values in chosen.items()))
        else:
            self.screen()
            chosen = self.tune()
            lrs = self.retune(chosen)
            write_states(self.records, study_states(self.plan.as_dict(), self.merged_index()))
        self.final(chosen, lrs)
        reused = sum(1 for e in self.index if e.name in self.recorded)
        say(f"done: {len(self.index)} runs, {self.launched} trained now, {reused} taken from the records")

    def screen(self) -> None:
        """Every setting of both sides one grid step either side of the start, and the start on
        the noise seeds (study/screen.py); the held settings that gain more than the seed noise
        join the descent: each side's space becomes its descent space."""
        if not self.plan.tuning.get("screen"):
            return
        seeds, noise = self.plan.tuning["seeds"], self.plan.tuning.get("noise_seeds") or []
        per_side = {}
        for side in self.plan.sides:
            space = full_space(self.plan.as_dict(), side)
            per_side[side] = [self.screen_entry(side, space, trial, seed) for trial in screen_trials(space)
                              for seed in (seeds + noise if trial.dim is None else seeds)]
        # In lockstep, the sides' trials alternating, as the descent's do.
        self.execute([run for pair in zip(*per_side.values()) for run in pair])
        result = screen_result(self.plan.as_dict(), self.index)
        for line in result.lines():
            say(f"screen: {line}")
        self.spaces = {side: parse_space(side, descent_node(self.plan.as_dict(), side, result.joined))
                       for side in self.plan.sides}

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
            say(f"tune {side}: chose {values_text(dict(engine.incumbent.values))} ({when})")
        tokens = sum(e.tokens_planned for e in self.index if e.stage == "tune" and e.side == self.plan.target)
        say(f"tune done: {counts[self.plan.target]} runs and {tokens:,} tokens per side (equal)")
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

    def screen_entry(self, side: str, space: Any, trial: Any, seed: int) -> tuple[Entry, list[str]]:
        steps, tokens = run_steps(self.plan, space, trial.values, 1.0)
        overrides = run_overrides(self.plan.train, trial_overrides(space, trial.values),
                                  self.plan.tuning["split_fraction"], steps, seed, TUNE_KEY)
        rid = run_id(overrides)
        entry = Entry(stage="screen", side=side, budget=1.0, name=f"screen/{side}/{trial.ordinal:03d}-{rid}-seed{seed}",
                      run_id=rid, seed=seed, steps=steps, tokens_planned=tokens, status="", objective=None,
                      ordinal=trial.ordinal, reason=trial.reason, dim=trial.dim, values=dict(trial.values),
                      study=self.plan.study_id)
        return entry, overrides

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
                      reason=proposal.reason, dim=proposal.dim, values=values, study=self.plan.study_id)
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
                      ordinal=proposal.ordinal, round=proposal.round, reason=proposal.reason, dim="lr", values=values,
                      study=self.plan.study_id)
        return entry, overrides

    def final_entry(self, side: str, budget: float, values: dict[str, float], seed: int) -> tuple[Entry, list[str]]:
        steps, tokens = run_steps(self.plan, self.spaces[side], values, budget)
        interval = max(1, steps // self.plan.compare["eval_points"])
        overrides = run_overrides(self.plan.train, trial_overrides(self.spaces[side], values),
                                  self.plan.tuning["split_fraction"], steps, seed, None, interval)
        rid = run_id(overrides)
        entry = Entry(stage="final", side=side, budget=budget, name=f"final/{side}/{budget:g}x/seed{seed}", run_id=rid,
                      seed=seed, steps=steps, tokens_planned=tokens, status="", objective=None, values=values,
                      study=self.plan.study_id)
        return entry, overrides

    def execute(self, wanted: list[tuple[Entry, list[str]]]) -> list[Entry]:
        """Each wanted run's entry: from the records, from a finished run dir or an unindexed
        record (recorded now), or trained (one at a time where the launcher runs one at a time,
        so that each is recorded as it ends; else the whole batch at once)."""
        done: dict[int, Entry] = {}
        to_launch: list[int] = []
        for i, (entry, overrides) in enumerate(wanted):
            known = self.recorded.get(entry.name)
            if known is not None:
                if known.run_id != entry.run_id:
                    raise StudyError(f"records/{entry.name} was made with other settings than this plan's "
                                     "(another base override, grid or seed): give this study another --out")
                check_belongs(self.plan.as_dict(), known, load_record(self.records, known))
                done[i] = self.add(known, FROM_RECORDS)
                continue
            found = self.from_disk(entry)
            if found is not None:
                done[i] = self.add(*found)
                continue
            to_launch.append(i)
        at_once = self.launch.in_flight == 1
        batches = [[i] for i in to_launch] if at_once else ([to_launch] if to_launch else [])
        for batch in batches:
            stop_if_asked()
            seeds_shown = len(self.plan.tuning["seeds"]) > 1
            jobs = [Job(wanted[i][0].name, [*wanted[i][1], *how(wanted[i][0], self.settings, seeds_shown)])
                    for i in batch]
            start = time.monotonic()
            outcomes = self.launch(jobs)
            seconds = (time.monotonic() - start) / len(batch)
            stop_if_asked()
            self.launched += len(jobs)
            for i, outcome in zip(batch, outcomes):
                done[i] = self.add(self.finish(wanted[i][0], outcome), f"{seconds:.0f}s", seconds)
        return [done[i] for i in range(len(wanted))]

    def add(self, entry: Entry, source: str, seconds: Optional[float] = None) -> Entry:
        """`entry` into this pass's index, written at once (a study stopped at any moment keeps
        every run it recorded), and its line; `source`: where it came from, or for a run trained
        now what it took ("12s", `seconds`)."""
        if all(e.name != entry.name for e in self.index):
            self.index.append(entry)
            write_index(self.records, self.merged_index())
            self.tell(entry, source, seconds)
        return entry

    def merged_index(self) -> list[Entry]:
        """This pass's entries, then any recorded earlier that this pass has not reached yet (a
        raised budget, removed seeds): nothing recorded is dropped."""
        names = {e.name for e in self.index}
        return self.index + [e for name, e in self.recorded.items() if name not in names]

    def finish(self, entry: Entry, outcome: Outcome) -> Entry:
        """The launched run's entry, recorded: ok, diverged (a non-finite return) or crashed."""
        value = outcome.value if outcome.error is None else None
        ok = value is not None and math.isfinite(value)
        status = OK if ok else (CRASHED if outcome.error else DIVERGED)
        return self.record(replace(entry, status=status, objective=float(value) if ok else None, error=outcome.error))

    def from_disk(self, entry: Entry) -> Optional[tuple[Entry, str]]:
        """A run that finished without its index line, and where it was: in its run dir (the study
        stopped between its end and its record: recorded now), or as a record whose line was lost
        (a torn index). None if neither holds it finished."""
        from eval.compare import load_run

        for where, is_record in ((self.runs / entry.name, False), (self.records / entry.name, True)):
            if not ((where / "metrics.jsonl").is_file() or (is_record and (where / "metrics.jsonl.gz").is_file())):
                continue
            if is_record:
                run = load_record(self.records, entry)
            else:
                try:
                    run = load_run(where)
                except (OSError, ValueError):  # a row cut short by a kill: not finished
                    continue
            if run.unfinished() is not None:
                continue
            key = TUNE_KEY if entry.stage != "final" else VAL_KEY
            steps, values = run.series.get(key, ([], []))
            value = values[-1] if steps and steps[-1] == entry.steps else math.nan
            status = OK if math.isfinite(value) else DIVERGED
            found = replace(entry, status=status, objective=value if status == OK else None)
            if is_record:
                check_belongs(self.plan.as_dict(), found, run)
                logged = run.series.get("train/loss", ([], []))[0]
                per_step = entry.tokens_planned // max(entry.steps, 1)
                return replace(found, tokens_seen=logged[-1] * per_step if logged else 0), FROM_RECORD
            return self.record(found), FROM_RUN_DIR
        return None

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
        return entry

    def mean_score(self, entries: list[Entry]) -> float:
        """A proposal's objective over the tuning seeds: their mean, +inf if any diverged or crashed."""
        scores = sorted(e.score for e in entries)
        return math.inf if not scores or any(math.isinf(s) for s in scores) else math.fsum(scores) / len(scores)

    # ---- what it says ----

    def tell(self, entry: Entry, source: str, seconds: Optional[float]) -> None:
        """One line per run: run k of N, what it was, how it ended, and where it came from (or,
        trained now, what it took and the study's clock)."""
        what = f"{entry.stage} {entry.side} {entry.budget:g}x"
        if entry.stage == "final":
            what += f" seed {entry.seed}"
        elif entry.stage == "screen":
            what += f" #{entry.ordinal} {entry.reason}" + (f" {entry.dim}={entry.values[entry.dim]:.4g}" if entry.dim
                                                           else f" seed {entry.seed}")
        else:
            what += f" #{entry.ordinal} {entry.reason}" + (f" {entry.dim}={entry.values[entry.dim]:.4g}" if entry.dim else "")
        if entry.status == OK:
            outcome = f"{TUNE_KEY if entry.stage != 'final' else VAL_KEY} {entry.objective:.4f}"
        else:
            outcome = f"{entry.status} (recorded, counted)" + (f": {entry.error}" if entry.error else "")
        count = self.progress.count(entry.steps, seconds)
        say(f"{count}: {what}: {outcome} ({source if seconds is None else f'{source}; {self.progress.clock()}'})")


def run_settings(plan: Plan, out: Path, local: bool) -> list[str]:
    """How every run of a study's pass is run, beside what it is: no resume line of its own (the
    study prints its own), one wandb group for the study, and, for runs on this machine
    (`local`), its peak FLOP/s measured once (perf/mfu's denominator; a trial has no other use
    for it, and each run would otherwise measure it again)."""
    settings = ["logger.resume_hint=false"]
    if not given(plan.train, "logger.wandb.group"):
        group = f"{out.name}-{plan.study_id[:6]}" if plan.study_id else out.name
        settings.append(f"logger.wandb.group={quoted(group)}")
    if local and not given(plan.train, "trainer.peak_tflops"):
        peak = measured_peak_tflops(plan.train)
        if peak:
            settings.append(f"trainer.peak_tflops={peak:.6g}")
    return settings


def how(entry: Entry, settings: list[str], seeds_shown: bool) -> list[str]:
    """The overrides that say how `entry` is run (after its identity): the study's `settings`,
    its wandb name and config (the study, stage, side, budget, trial); a trial evaluates only the
    set it is scored on and keeps no end checkpoint (a final run keeps its weights)."""
    trial = entry.ordinal if entry.stage != "final" else -1
    info = {"study": entry.study or "none", "stage": entry.stage, "side": entry.side,
            "budget": f"{entry.budget:g}x", "trial": trial, "seed": entry.seed}
    cells = ",".join(f"{k}:{quoted(v) if isinstance(v, str) else v}" for k, v in info.items())
    extra = [*settings, f"logger.wandb.name={quoted(run_name(entry, seeds_shown))}", f"++logger.run_info={{{cells}}}"]
    if entry.stage != "final":  # scored on val/tune/loss alone; its weights are not kept
        extra += ["eval.sets=[tune]", "checkpoint.at_end=false"]
    return extra


def stop_if_asked() -> None:
    """Before and after each launch: a Ctrl-C or SIGTERM whose SystemExit was lost on its way
    (trainer/run/interrupts.py) still stops the study before its next run."""
    from trainer.run.interrupts import interrupted

    code = interrupted()
    if code:
        raise SystemExit(code)


def measured_peak_tflops(train: list[str]) -> float:
    """This machine's matmul TFLOP/s for the study's base device and precision, measured once
    (runs in this process find it measured: eval/flops.py keeps it); 0 where it cannot be."""
    from eval.flops import device_peak_flops
    from study.runs import CONF
    from trainer.config import to_dataclass
    from trainer.device import resolve_device
    from trainer.run.preflight import compose

    try:
        t = to_dataclass(compose(train, str(CONF))).trainer
        if t.precision not in ("fp32", "bf16"):
            return 0.0
        return device_peak_flops(resolve_device(t.device, 0), t.precision) / 1e12
    except Exception:  # noqa: BLE001 - a run that cannot use this machine measures its own
        return 0.0


def run_name(entry: Entry, seeds_shown: bool = False) -> str:
    """The run's name in wandb: "tune muon 1x #3 lr=0.01", "final adamw 2x seed 4"."""
    head = f"{entry.stage} {entry.side} {entry.budget:g}x"
    if entry.stage == "final":
        return f"{head} seed {entry.seed}"
    varied = f" {entry.dim}={entry.values[entry.dim]:.4g}" if entry.dim else " init"
    return f"{head} #{entry.ordinal}{varied}" + (f" seed {entry.seed}" if seeds_shown or entry.stage == "screen" else "")


def first_line(err: Any) -> str:
    """A failed run's error as one line: its type and the first line of its message."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def values_text(values: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.4g}" for k, v in values.items())


def last_tokens(metrics: Path) -> int:
    import json

    lines = [line for line in metrics.read_text().splitlines() if line.strip()]
    if not lines:
        return 0
    try:
        return int(json.loads(lines[-1]).get("tokens", 0))
    except ValueError:
        return 0
