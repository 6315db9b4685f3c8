"""A Muon-vs-AdamW comparison that is fair by construction: tune, compare, report.

    python scripts/fair_compare.py --dry-run                      # the plan and its time, nothing run
    python scripts/fair_compare.py --out outputs/fair/small       # the study (run again: it resumes)
    python scripts/fair_compare.py --smoke --out /tmp/smoke       # the whole machinery on gpt_tiny, minutes
    python scripts/fair_compare.py --report outputs/fair/small    # the report again, from records/ alone
    python scripts/fair_compare.py --report lab/results/fair --page lab/results.md   # a ladder of studies
    python scripts/fair_compare.py model=moe_small tuning.trials=64 hydra/launcher=slurm
    python scripts/fair_compare.py --rerun lab/results/fair/gpt_small 'compare.seeds=[10,11,12]' trainer.precision=bf16

1. tune: both optimizers by coordinate descent (conf/tuning/<side>.yaml, the same families and
   shape on both sides), each with exactly tuning.trials trials of the same tokens, scored on the
   tuning split (data.tune_fraction: held out from train, val and OOD) on the tuning seeds;
2. compare: each side's choice at every budget (compare.budgets x the 1x steps; its lr searched
   again at the longer ones), once per fresh seed, reported on val and OOD;
3. report: the speedup (the tokens the baseline needs to reach the target's final loss over the
   target's), from end-of-schedule points only, with a 95% interval from a bootstrap over the
   paired seeds that also redoes the selection, and one-sided p-values (stats.thresholds).

Overrides of the study's keys (target, baseline, train, tuning, compare, stats, spaces: see
conf/study/fair.yaml) configure the study; any other goes to every run, as to train.py (model=,
data.*, trainer.*, +experiment=), and hydra/launcher=... picks where runs go. Every run is
recorded under STUDY/records/ (scripts/record_runs.py's format, to commit) as it ends; a study
run again takes what is recorded and runs the rest. Bad input is one line and exit 2, before
anything trains.
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys
import time
from pathlib import Path

from data.quiet_imports import quiet_library_noise
from scripts import REPO
from scripts.fair.plan import (PlanError, Plan, build_plan, compose_study, estimate_seconds, plan_lines,
                               probe_step_seconds, route)
from scripts.fair.rerun import copy_choice_records, rerun_plan
from scripts.refuse import refuse

# What a study must share with the records already in its dir to go on there: changed, the runs
# recorded would not be the runs this plan asks for.
IDENTITY = ("target", "baseline", "train", "spaces", "tokens_per_step", "model", "data")
# Each run's INFO lines go to its train.log only; the terminal gets a line per run ([fair]) and
# the runs' warnings.
QUIET = ["+hydra.job_logging.handlers.console.level=WARNING", "hydra.hydra_logging.root.level=WARNING"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="study keys (tuning.trials=64) and train.py overrides")
    parser.add_argument("--out", type=Path, help="the study dir (default outputs/fair/<date-time>)")
    parser.add_argument("--smoke", action="store_true", help="conf/study/smoke.yaml: gpt_tiny, a few steps a run")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and its time here; run nothing")
    parser.add_argument("--rerun", type=Path, metavar="STUDY", help="run STUDY's chosen settings again on fresh "
                        "seeds (compare.seeds=[...]) with the overrides given, finals only (scripts/fair/rerun.py)")
    parser.add_argument("--report", type=Path, metavar="STUDY", help="make STUDY's report again from its records "
                        "(a dir of studies: every report, and the ladder across them: scripts/fair/ladder.py)")
    parser.add_argument("--page", type=Path, action="append", default=[], metavar="FILE",
                        help="with --report on a ladder: rewrite FILE's ladder block with its headline table")
    return parser.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    quiet_library_noise()
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.page and args.report is None:
        refuse("--page needs --report DIR, DIR a dir of studies")
    if args.report is not None:
        return report(args.report, args.out, args.page)
    name = "smoke" if args.smoke else "fair"
    study_overrides, train_overrides = route(args.overrides)
    launch = [o for o in train_overrides if o.lstrip("+~").startswith("hydra")]
    try:
        if args.rerun is not None:
            if args.smoke:
                raise PlanError("--smoke and --rerun: a rerun takes everything but its seeds from the study it reruns")
            plan = rerun_plan(args.rerun, study_overrides, [o for o in train_overrides if o not in launch])
        else:
            study = compose_study(name, study_overrides)
            plan = build_plan(name, study, [o for o in train_overrides if o not in launch])
    except PlanError as err:
        refuse(str(err))
    if args.dry_run:
        seconds = estimate_seconds(plan, {side: probe_step_seconds(plan, side) for side in plan.sides})
        print("\n".join(plan_lines(plan, seconds)))
        return 0
    out = args.out or REPO / "outputs" / "fair" / time.strftime("%Y-%m-%d_%H-%M-%S")
    return run_study(plan, out.resolve(), launch, args.rerun)


def run_study(plan: Plan, out: Path, launch: list[str], rerun_of: Path | None = None) -> int:
    """Train (or resume) the study in `out` through train.py's Hydra sweep, then report."""
    from eval.fair.records import PLAN_FILE, RECORDS, RUNS, write_plan
    from trainer.run.lock import RunLocked, claim

    records = out / RECORDS
    earlier = records / PLAN_FILE
    if earlier.is_file():
        old = Plan.from_json(earlier.read_text())
        changed = next((key for key in IDENTITY if getattr(old, key) != getattr(plan, key)), None)
        if changed is not None:
            refuse(f"{out} holds a study with another {changed}; give this one another --out")
    try:
        lock = claim(out)
    except RunLocked as err:
        refuse(str(err))
    try:
        print("\n".join(plan_lines(plan)), flush=True)
        write_plan(records, plan.to_json())
        if rerun_of is not None:
            copy_choice_records(rerun_of, records)
        argv = ["train.py", "-m", "hydra/sweeper=fair", f"hydra.sweeper.plan={earlier}",
                f"hydra.sweep.dir={out / RUNS}", *QUIET, *launch, *plan.train]
        code = run_train_py(argv)
    finally:
        if lock is not None:
            lock.release()
    if code:
        print(f"training stopped (exit {code}); run the same command to resume: recorded runs are not run again",
              file=sys.stderr)
        return code
    return report(out, None)


def run_train_py(argv: list[str]) -> int:
    """train.py as `python train.py <argv>` would run it, in this process: its checks, then the
    sweep. Returns its exit code."""
    saved = sys.argv
    sys.argv = argv
    cwd = os.getcwd()
    try:
        runpy.run_path(str(REPO / "train.py"), run_name="__main__")
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 1
    finally:
        sys.argv = saved
        os.chdir(cwd)
    return 0


def report(study: Path, out: Path | None, pages: list[Path] = ()) -> int:
    from eval.fair.records import REPORT, StudyError, load_study
    from scripts.fair.ladder import is_ladder, write_ladder
    from scripts.fair.report import write_report

    if is_ladder(study):
        if out is not None:
            refuse(f"--out: a ladder's reports go beside their records, under {study}")
        try:
            lines = write_ladder(study, list(pages))
        except (StudyError, FileNotFoundError) as err:
            refuse(str(err))
        print("\n".join(lines))
        return 0
    if pages:
        refuse(f"--page: {study} is one study, not a dir of studies; only a ladder has a block to write")
    try:
        data = load_study(study)
    except (StudyError, FileNotFoundError) as err:
        refuse(str(err))
    target = out or (study.parent if study.name == "records" else study) / REPORT
    for line in write_report(data, target):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
