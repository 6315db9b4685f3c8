"""The records of a fair study: what is committed, and everything its report is made from, with
no run dir present; each one checked as it is read.

A study dir:

    STUDY/runs/      the run dirs, as train.py writes them (not committed: checkpoints)
    STUDY/records/   plan.json, index.jsonl, and one record per run in scripts/record_runs.py's
                     format (eval/run_records.py): tune/<side>/<NNN>-<id>, retune/<side>/<b>x/<NN>-<id>,
                     final/<side>/<b>x/seed<s>
    STUDY/report/    comparison.md and .json, trials.md, chosen.md, loss_vs_tokens.png: made from records/

index.jsonl has one line per run, in launch order: its stage, side, budget, ordinal, what the
search proposed (round, reason, dimension, values), seed, steps, planned and seen tokens, and
how it ended (ok, diverged or crashed) with its objective. A run that diverged or crashed is
recorded and counted like any other.

A study's plan.json names the study (`study_id`, made when it is first written), and every run
carries that id in its config (logger.run_info.study) and its index line: a record of another
study merged in is refused by name, never pooled. Older studies have no id; their records are
still checked against the plan (its sides, budgets and seeds, one record per trial and seed).
"""
from __future__ import annotations

import gzip
import json
import math
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from data.atomic import atomic_output
from data.hashing import digest

RECORDS, RUNS, REPORT = "records", "runs", "report"
PLAN_FILE, INDEX_FILE = "plan.json", "index.jsonl"
STAGES = ("screen", "tune", "retune", "final")
OK, DIVERGED, CRASHED = "ok", "diverged", "crashed"
# What the tuning runs are scored on (eval.objective): the tuning split, never a reported figure.
TUNE_KEY = "val/tune/loss"
VAL_KEY = "val/val/loss"
# What to do with a record that cannot be used: nothing is deleted, and the study trains it again.
MOVE_ASIDE = "move it out of records/ (nothing is lost) and run the study's command again: it trains that run anew"


class StudyError(ValueError):
    """Records that cannot make one report, in one line."""


@dataclass
class Entry:
    """One run of the study, as index.jsonl holds it."""

    stage: str
    side: str
    budget: float
    name: str                 # its record's path below records/, and its run dir's below runs/
    run_id: str               # a digest of its overrides: the same run, whatever the order it came in
    seed: int
    steps: int
    tokens_planned: int
    status: str               # ok | diverged | crashed
    objective: Optional[float]  # what the run returned (val/tune/loss when tuning); None unless ok
    ordinal: int = 0
    round: int = 0
    reason: str = ""
    dim: Optional[str] = None
    values: dict[str, float] = field(default_factory=dict)
    tokens_seen: int = 0
    error: Optional[str] = None
    study: str = ""           # the study's id ("" in studies made before ids)

    @property
    def score(self) -> float:
        """The objective, +inf for a run that diverged or crashed (never chosen)."""
        return self.objective if self.status == OK and self.objective is not None else math.inf

    def to_line(self) -> str:
        fields = asdict(self)
        if not fields["study"]:  # the lines of a study without an id stay as they were written
            del fields["study"]
        return json.dumps(fields, sort_keys=True)


def run_id(overrides: list[str]) -> str:
    """The identity of a run: its train.py overrides but the run dir's, in any order."""
    return digest(sorted(o for o in overrides if not o.startswith("hydra.")))[:8]


def _entry(path: Path, number: int, line: str) -> Entry:
    try:
        return Entry(**json.loads(line))
    except (ValueError, TypeError) as err:
        raise StudyError(f"{path}:{number}: not an index line ({err})") from err


def read_index(records: Path) -> list[Entry]:
    """index.jsonl's entries; StudyError in one line for a line that is not one. A last line
    cut short (a copy or a disk that failed mid-write) is named as such: the study's command
    repairs it (repair_index)."""
    path = records / INDEX_FILE
    if not path.exists():
        return []
    lines = [(n, line) for n, line in enumerate(path.read_text(errors="replace").splitlines(), start=1)
             if line.strip()]
    entries = []
    for i, (number, line) in enumerate(lines):
        try:
            entries.append(_entry(path, number, line))
        except StudyError as err:
            if i == len(lines) - 1:
                raise StudyError(f"{path}:{number}: its last line is cut short; the study's command repairs it "
                                 "(the run it named is taken from its record, or trained again)") from err
            raise
    return entries


def repair_index(records: Path) -> Optional[str]:
    """Drop a last line of index.jsonl that is cut short, rewriting the file whole; what was
    done, in one line, or None if there was nothing to repair. Any other bad line is an error."""
    path = records / INDEX_FILE
    try:
        read_index(records)
        return None
    except StudyError as err:
        if "its last line is cut short" not in str(err):
            raise
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    kept = [_entry(path, n, line) for n, line in enumerate(lines[:-1], start=1)]
    write_index(records, kept)
    return (f"{path}: its last line was cut short ({lines[-1][:40]}...); dropped it: that run is taken from its "
            "record where it has one, or trained again")


def chosen_settings(entries: list[Entry], side: str) -> dict[float, dict[str, float]]:
    """The settings `side` chose at each budget, as its final runs used them (its 1x tuning's
    choice, with the lr retuned at each longer budget); a budget with no final run yet is absent."""
    chosen: dict[float, dict[str, float]] = {}
    for e in entries:
        if e.stage == "final" and e.side == side:
            chosen.setdefault(e.budget, dict(e.values))
    return chosen


def write_index(records: Path, entries: list[Entry]) -> None:
    """index.jsonl rewritten whole (temp file + rename): an interrupted write keeps the old one."""
    records.mkdir(parents=True, exist_ok=True)
    with atomic_output(records / INDEX_FILE) as f:
        f.write("".join(e.to_line() + "\n" for e in entries).encode())


def write_plan(records: Path, text: str) -> None:
    records.mkdir(parents=True, exist_ok=True)
    with atomic_output(records / PLAN_FILE) as f:
        f.write(text.encode())


def records_dir(study: Path) -> Path:
    """STUDY/records, or STUDY itself when it is a records dir (holds plan.json)."""
    if (study / PLAN_FILE).is_file():
        return study
    if (study / RECORDS / PLAN_FILE).is_file():
        return study / RECORDS
    raise StudyError(f"{study}: no {RECORDS}/{PLAN_FILE}: not a study made by scripts/fair_compare.py")


def read_plan(records: Path) -> dict[str, Any]:
    path = records / PLAN_FILE
    try:
        plan = json.loads(path.read_text())
    except ValueError as err:
        raise StudyError(f"{path}: not a study plan ({err}); restore it from where the study was made") from err
    if not isinstance(plan, dict) or "target" not in plan:
        raise StudyError(f"{path}: not a study plan; restore it from where the study was made")
    return plan


def load_record(records: Path, entry: Entry) -> Any:
    """The record of `entry` as eval.compare.load_run reads it (its metrics decompressed and
    parsed, its config); StudyError in one line naming the record when it cannot be read."""
    from eval.compare import load_run

    record = records / entry.name
    if not record.is_dir():
        raise StudyError(f"{records / INDEX_FILE} names {entry.name}, which is not in {records}: restore it, or run "
                         "the study's command again (it trains that run anew)")
    try:
        return load_run(record)
    except (OSError, EOFError, zlib.error, ValueError, KeyError, TypeError) as err:
        what = "unreadable" if isinstance(err, (OSError, EOFError, zlib.error, gzip.BadGzipFile)) else "not metrics"
        return_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise StudyError(f"{record}/metrics.jsonl.gz: {what} ({type(err).__name__}: {return_line}); "
                         f"{MOVE_ASIDE}") from err


def record_study(run: Any) -> str:
    """The study id a run's config carries ("" for a run made before ids)."""
    info = ((run.config or {}).get("logger") or {}).get("run_info") or {}
    return str(info.get("study", "")) if isinstance(info, dict) else ""


def check_belongs(plan: dict[str, Any], entry: Entry, run: Any = None) -> None:
    """StudyError in one line when `entry` (and its record, when given) is not a run of this
    study: another study's id, or a side, budget or seed the plan does not have."""
    where = f"records/{entry.name}"
    ours = plan.get("study_id", "")
    adopted = set(plan.get("adopted", []))
    if ours:
        allowed = {ours} | (adopted if entry.stage != "final" else set())
        for said, what in ((entry.study, "its index line"), (record_study(run) if run is not None else None,
                                                            "its config (logger.run_info.study)")):
            if said is not None and said not in allowed:
                named = f"study {said}" if said else "a study without an id"
                raise StudyError(f"{where}: {what} says it is a run of {named}, not of this one ({ours}): "
                                 f"records of another study mixed in; {MOVE_ASIDE}")
    sides = (plan["target"], plan["baseline"])
    if entry.side not in sides:
        raise StudyError(f"{where}: side {entry.side} is not one of this study's ({', '.join(sides)}): "
                         f"records of another study mixed in; {MOVE_ASIDE}")
    if entry.stage == "final":
        seeds, key = plan["compare"]["seeds"], "compare.seeds"
        if entry.budget not in plan["compare"]["budgets"]:
            raise StudyError(f"{where}: budget {entry.budget:g}x is not one of this study's compare.budgets "
                             f"{plan['compare']['budgets']}: records of another study mixed in; {MOVE_ASIDE}")
    elif entry.stage == "screen":
        seeds, key = [*plan["tuning"]["seeds"], *(plan["tuning"].get("noise_seeds") or [])], "tuning seeds and noise_seeds"
    else:
        seeds, key = plan["tuning"]["seeds"], "tuning.seeds"
    if entry.seed not in seeds and not (entry.stage != "final" and plan.get("chosen")):
        raise StudyError(f"{where}: seed {entry.seed} is not one of this study's {key} {seeds}: "
                         f"records of another study mixed in; {MOVE_ASIDE}")


def check_unique(entries: list[Entry]) -> None:
    """One record per run: two index lines for one trial and seed (or one final seed) are two
    studies' records mixed together, which would otherwise be pooled as if they were seeds."""
    seen: dict[tuple, str] = {}
    for e in entries:
        key = (e.stage, e.side, e.budget, e.seed, e.ordinal if e.stage != "final" else 0)
        if key in seen or e.name in seen.values():
            first = seen.get(key, e.name)
            raise StudyError(f"records/{INDEX_FILE}: {first} and {e.name} are both {e.stage} run "
                             f"{'#' + str(e.ordinal) + ' ' if e.stage != 'final' else ''}of {e.side} at "
                             f"{e.budget:g}x, seed {e.seed}: records of another study mixed in; move the "
                             "foreign ones out of records/ and drop their index lines")
        seen[key] = e.name


@dataclass
class StudyData:
    """A study as its records give it: the plan (plan.json as a dict), the index, and each
    final run's metrics, {metric: (steps, values)}, environment.json and config, by record name."""

    plan: dict[str, Any]
    entries: list[Entry]
    series: dict[str, dict[str, tuple[list[int], list[float]]]]
    environments: dict[str, dict[str, Any]] = field(default_factory=dict)
    configs: dict[str, dict[str, Any]] = field(default_factory=dict)

    def of(self, stage: str, side: Optional[str] = None, budget: Optional[float] = None) -> list[Entry]:
        return [e for e in self.entries if e.stage == stage and (side is None or e.side == side)
                and (budget is None or e.budget == budget)]


def load_study(study: Path) -> StudyData:
    """The study's records, checked: every index line has its record, readable and of this
    study, every record one corpus and one model, and both sides the same number of runs and
    planned tokens per stage."""
    records = records_dir(study)
    plan = read_plan(records)
    entries = read_index(records)
    check_unique(entries)
    series: dict[str, dict[str, tuple[list[int], list[float]]]] = {}
    environments: dict[str, dict[str, Any]] = {}
    configs: dict[str, dict[str, Any]] = {}
    corpora: dict[str, str] = {}
    models: dict[str, str] = {}
    for e in entries:
        run = load_record(records, e)
        check_belongs(plan, e, run)
        corpus = run.corpus_id
        if corpus:
            corpora.setdefault(corpus, e.name)
        model = json.dumps((run.config.get("model") or {}), sort_keys=True) if run.config else ""
        if model:
            models.setdefault(model, e.name)
        if e.stage == "final":
            series[e.name] = run.series
            environments[e.name] = run.environment or {}
            configs[e.name] = run.config or {}
    if len(corpora) > 1:
        named = ", ".join(f"{c} ({name})" for c, name in sorted(corpora.items()))
        raise StudyError(f"records mix corpora: {named}")
    if len(models) > 1:
        names = sorted(models.values())
        raise StudyError(f"records mix models: {names[0]} and {names[1]} have different model.* settings")
    data = StudyData(plan, entries, series, environments, configs)
    check_equal_budgets(data)
    return data


def check_equal_budgets(data: StudyData) -> None:
    """Both sides: the same number of runs and of planned tokens in every stage."""
    target, baseline = data.plan["target"], data.plan["baseline"]
    for stage in STAGES:
        a, b = data.of(stage, target), data.of(stage, baseline)
        if len(a) != len(b):
            raise StudyError(f"records: {target} has {len(a)} {stage} runs, {baseline} {len(b)}: the budgets differ")
        ta, tb = sum(e.tokens_planned for e in a), sum(e.tokens_planned for e in b)
        if ta != tb:
            raise StudyError(f"records: {target}'s {stage} runs plan {ta:,} tokens, {baseline}'s {tb:,}: "
                             "the budgets differ")


def final_loss(series: dict[str, tuple[list[int], list[float]]], key: str, steps: int) -> float:
    """`key`'s value at the run's last step (its end of schedule), +inf if it has none there (a
    run that diverged or crashed before its final evaluation)."""
    logged_steps, values = series.get(key, ([], []))
    if not logged_steps or logged_steps[-1] != steps:
        return math.inf
    return values[-1] if math.isfinite(values[-1]) else math.inf
