"""The driver of a fair study: the process that lives for the whole study (scripts/fair_compare.py).

It checks the study dir (--out) before anything else, writes the plan, enters training through
a callable (`python train.py -m hydra/sweeper=fair ...` in this process: the sweeper runs
study/runner.py over Hydra's launcher), and then reports. Stopped by Ctrl-C or SIGTERM, a
failed run's crash, or bad records, it says what is recorded and prints one line that resumes
the study: its own command, which takes the runs recorded and trains the rest.
"""
from __future__ import annotations

import os
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Callable, Optional

from study.checks import PlanError
from study.plan import Plan, planned_runs, plan_lines
from study.records import (INDEX_FILE, PLAN_FILE, RECORDS, REPORT, RUNS, StudyError, check_belongs, check_unique,
                           load_record, read_index, repair_index, write_index, write_plan)

# What a study must share with the records already in its dir to go on there: changed, the runs
# recorded would not be the runs this plan asks for.
IDENTITY = ("target", "baseline", "train", "spaces", "tokens_per_step", "model", "data")
# Each run's INFO lines go to its train.log only; the terminal gets a line per run ([fair]) and
# the runs' warnings.
QUIET = ["+hydra.job_logging.handlers.console.level=WARNING", "hydra.hydra_logging.root.level=WARNING"]
# What a study dir may hold besides its own parts: anything else is not a study's dir.
STUDY_PARTS = {RECORDS, RUNS, REPORT, ".lock", ".lock.takeover"}
SIGNALS = {130: "Ctrl-C", 143: "SIGTERM"}

Train = Callable[[list[str]], int]  # train.py's command line -> its exit code, as `python train.py` gives it


def check_out(out: Path) -> None:
    """--out, before any plan is built: a dir this study can write, not a file, not another
    study's while that one runs, not a dir of something else. PlanError in one line naming it."""
    from trainer.run.lock import LOCK_NAME, read_holder, stale_reason, this_process

    if out.exists() and not out.is_dir():
        raise PlanError(f"--out {out}: a file, not a dir; give the study a dir of its own")
    if out.is_dir():
        holder = read_holder(out / LOCK_NAME)
        if holder is not None and stale_reason(holder, this_process(os.environ)) is None:
            raise PlanError(f"--out {out}: another study is running there ({holder.describe()}); give this one "
                            "another --out, or wait for that one to end")
        other = sorted(p.name for p in out.iterdir() if p.name not in STUDY_PARTS)
        if other:
            shown = ", ".join(other[:3]) + (", ..." if len(other) > 3 else "")
            raise PlanError(f"--out {out}: not a study's dir (it holds {shown}); give the study a dir of its own")
    ancestor = out
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise PlanError(f"--out {out}: {ancestor} is a file, so the dir cannot be made")
    try:  # writable, as the study will find it: a dir made and removed at once
        os.rmdir(tempfile.mkdtemp(dir=ancestor, prefix=".fair-check-"))
    except OSError as err:
        raise PlanError(f"--out {out}: cannot be written ({err.strerror or err}: {ancestor})") from err


def check_records(records: Path, plan: Plan) -> list[str]:
    """The records already in a study dir, before it resumes: a last index line cut short is
    repaired, and the lines of records moved aside are dropped (those runs are trained again);
    what was done, a line each, is returned. A line that is not one, a record that cannot be
    read, or one of another study is a StudyError in one line naming it."""
    done = [line for line in (repair_index(records),) if line]
    entries = read_index(records)
    gone = [e for e in entries if not (records / e.name).is_dir()]
    if gone:
        entries = [e for e in entries if e not in gone]
        write_index(records, entries)
        done.append(f"{len(gone)} index line(s) named records no longer in {records} ({gone[0].name}"
                    f"{', ...' if len(gone) > 1 else ''}): dropped; those runs are trained again")
    check_unique(entries)
    described = plan.as_dict()
    for entry in entries:
        check_belongs(described, entry, load_record(records, entry))
    return done


def carry_over(plan: Plan, out: Path) -> Plan:
    """The plan with the id of the study already in `out` (a new one for a new study), after
    checking that it is the same study; PlanError naming --out if it is another."""
    earlier = out / RECORDS / PLAN_FILE
    if not earlier.is_file():
        plan.study_id = plan.study_id or uuid.uuid4().hex[:12]
        return plan
    try:
        old = Plan.from_json(earlier.read_text())
    except (ValueError, TypeError) as err:
        raise PlanError(f"--out {out}: {earlier} is not a study plan ({err}); give this study another --out") from err
    changed = next((key for key in IDENTITY if getattr(old, key) != getattr(plan, key)), None)
    if changed is not None:
        raise PlanError(f"--out {out}: holds another study (its {changed} differs from this one's); give this one "
                        "another --out")
    plan.study_id = old.study_id  # "" for a study made before ids: its records carry none
    return plan


def run_study(plan: Plan, out: Path, launch: list[str], train: Train, resume: str,
              rerun_of: Optional[Path] = None) -> int:
    """Train (or resume) the study in `out` through train.py's Hydra sweep, then report.
    `resume`: the command that resumes it, printed if it stops."""
    from study.rerun import copy_choice_records
    from trainer.run.lock import RunLocked, claim

    plan = carry_over(plan, out)
    records = out / RECORDS
    try:
        repaired = check_records(records, plan) if (records / INDEX_FILE).is_file() else []
    except StudyError as err:
        raise PlanError(str(err)) from err
    try:
        lock = claim(out)
    except RunLocked as err:
        raise PlanError(f"--out {out}: another study is running there ({err}); give this one another --out") from err
    try:
        print("\n".join(plan_lines(plan)), flush=True)
        print(f"records: {records} (commit them; the same command resumes the study); report: {out / REPORT}",
              flush=True)
        for line in repaired:
            print(f"[fair] {line}", flush=True)
        write_plan(records, plan.to_json())
        if rerun_of is not None:
            copy_choice_records(rerun_of, records)
        argv = ["train.py", "-m", "hydra/sweeper=fair", f"hydra.sweeper.plan={records / PLAN_FILE}",
                f"hydra.sweep.dir={out / RUNS}", *QUIET, *launch, *plan.train]
        code = train(argv)
    finally:
        if lock is not None:
            lock.release()
    if code:
        for line in stop_lines(plan, records, code, resume):
            print(line, file=sys.stderr)
        return code
    result = report(out, None)
    print(f"report: {out / REPORT / 'comparison.md'}; records: {records}")
    return result


def stop_lines(plan: Plan, records: Path, code: int, resume: str) -> list[str]:
    """What a stopped study says: why, what is recorded, and the one line that resumes it."""
    try:
        entries = read_index(records)
    except StudyError:
        entries = []
    recorded = sum(1 for e in entries if not plan.chosen or e.stage == "final")
    total = planned_runs(plan)[0]
    why = f"stopped ({SIGNALS[code]})" if code in SIGNALS else f"training stopped (exit {code})"
    return [f"{why}: {recorded} of {total} runs are recorded in {records}; a run cut short is not (the same command "
            "takes it from its run dir if it finished, or trains it again, from its checkpoint where it saved one)",
            f"to resume: {resume}"]


def report(study: Path, out: Optional[Path], pages: list[Path] = ()) -> int:
    """The report of one study, or of a ladder of them (every study's, ladder.md and the pages'
    blocks); StudyError in one line for records that cannot make one."""
    from study.ladder import is_ladder, write_ladder
    from study.records import load_study
    from study.report import write_report

    if is_ladder(study):
        if out is not None:
            raise PlanError(f"--out: a ladder's reports go beside their records, under {study}")
        for line in write_ladder(study, list(pages)):
            print(line)
        return 0
    if pages:
        raise PlanError(f"--page: {study} is one study, not a dir of studies; only a ladder has a block to write")
    data = load_study(study)
    target = out or (study.parent if study.name == RECORDS else study) / REPORT
    for line in write_report(data, target):
        print(line)
    return 0
