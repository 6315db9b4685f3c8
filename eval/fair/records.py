"""The records of a fair study (scripts/fair_compare.py): what is committed, and everything its
report is made from, with no run dir present.

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
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from data.atomic import atomic_output
from data.hashing import digest

RECORDS, RUNS, REPORT = "records", "runs", "report"
PLAN_FILE, INDEX_FILE = "plan.json", "index.jsonl"
STAGES = ("tune", "retune", "final")
OK, DIVERGED, CRASHED = "ok", "diverged", "crashed"
# What the tuning runs are scored on (eval.objective): the tuning split, never a reported figure.
TUNE_KEY = "val/tune/loss"


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

    @property
    def score(self) -> float:
        """The objective, +inf for a run that diverged or crashed (never chosen)."""
        return self.objective if self.status == OK and self.objective is not None else math.inf

    def to_line(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def run_id(overrides: list[str]) -> str:
    """The identity of a run: its train.py overrides but the run dir's, in any order."""
    return digest(sorted(o for o in overrides if not o.startswith("hydra.")))[:8]


def read_index(records: Path) -> list[Entry]:
    path = records / INDEX_FILE
    if not path.exists():
        return []
    entries = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entries.append(Entry(**json.loads(line)))
        except (ValueError, TypeError) as err:
            raise StudyError(f"{path}:{number}: not an index line ({err})") from err
    return entries


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


@dataclass
class StudyData:
    """A study as its records give it: the plan (plan.json as a dict), the index, and each
    final run's metrics, {metric: (steps, values)}, by record name."""

    plan: dict[str, Any]
    entries: list[Entry]
    series: dict[str, dict[str, tuple[list[int], list[float]]]]

    def of(self, stage: str, side: Optional[str] = None, budget: Optional[float] = None) -> list[Entry]:
        return [e for e in self.entries if e.stage == stage and (side is None or e.side == side)
                and (budget is None or e.budget == budget)]


def load_study(study: Path) -> StudyData:
    """The study's records, checked: every index line has its record, every record one corpus
    and one model, and both sides the same number of runs and planned tokens per stage."""
    from eval.compare import load_run

    records = records_dir(study)
    plan = json.loads((records / PLAN_FILE).read_text())
    entries = read_index(records)
    series: dict[str, dict[str, tuple[list[int], list[float]]]] = {}
    corpora: dict[str, str] = {}
    models: dict[str, str] = {}
    for e in entries:
        record = records / e.name
        if not record.is_dir():
            raise StudyError(f"records: index.jsonl names {e.name}, which is not in {records}")
        run = load_run(record)
        corpus = run.corpus_id
        if corpus:
            corpora.setdefault(corpus, e.name)
        model = json.dumps((run.config.get("model") or {}), sort_keys=True) if run.config else ""
        if model:
            models.setdefault(model, e.name)
        if e.stage == "final":
            series[e.name] = run.series
    if len(corpora) > 1:
        named = ", ".join(f"{c} ({name})" for c, name in sorted(corpora.items()))
        raise StudyError(f"records mix corpora: {named}")
    if len(models) > 1:
        names = sorted(models.values())
        raise StudyError(f"records mix models: {names[0]} and {names[1]} have different model.* settings")
    data = StudyData(plan, entries, series)
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
