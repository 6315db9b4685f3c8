"""A Muon-vs-AdamW comparison that is fair by construction: tune, compare, report.

    python scripts/fair_compare.py --dry-run                      # the plan at once, then its time here
    python scripts/fair_compare.py --out outputs/fair/small       # the study (run again: it resumes)
    python scripts/fair_compare.py --smoke --out /tmp/smoke       # the whole machinery on gpt_tiny, a minute
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
data.*, trainer.*, +experiment=), and hydra/launcher=... picks where runs go. The study lives in
study/ (its driver: study/driver.py). Every run is recorded under STUDY/records/ as it ends; a
study run again takes what is recorded and runs the rest. Bad input is one line and exit 2,
before anything trains; Ctrl-C stops the study and prints the line that resumes it.
"""
from __future__ import annotations

import sys
import time

STARTED = time.monotonic()  # the dry run counts this command's own start in the study's time

from trainer.run.interrupts import install_start_up_handler  # noqa: E402

install_start_up_handler()  # Ctrl-C while torch loads or the plan is built: exit 130, no traceback

# The imports below come after the handler: importing torch alone takes seconds.
import argparse  # noqa: E402
import os  # noqa: E402
import runpy  # noqa: E402
import shlex  # noqa: E402
from pathlib import Path  # noqa: E402

from data.quiet_imports import quiet_library_noise  # noqa: E402
from scripts import REPO  # noqa: E402
from scripts.refuse import refuse  # noqa: E402
from study.checks import PlanError, compose_study, route  # noqa: E402
from study.driver import check_out, report, run_study  # noqa: E402
from study.plan import build_plan, plan_lines  # noqa: E402
from study.records import StudyError  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="study keys (tuning.trials=64) and train.py overrides")
    parser.add_argument("--out", type=Path, help="the study dir (default outputs/fair/<date-time>, in the working dir)")
    parser.add_argument("--smoke", action="store_true", help="conf/study/smoke.yaml: gpt_tiny, a few steps a run")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, then time a run here; train nothing "
                        "of the study")
    parser.add_argument("--rerun", type=Path, metavar="STUDY", help="run STUDY's chosen settings again on fresh "
                        "seeds (compare.seeds=[...]) with the overrides given, finals only (study/rerun.py)")
    parser.add_argument("--report", type=Path, metavar="STUDY", help="make STUDY's report again from its records "
                        "(a dir of studies: every report, and the ladder across them: study/ladder.py)")
    parser.add_argument("--page", type=Path, action="append", default=[], metavar="FILE",
                        help="with --report on a ladder: rewrite FILE's ladder block with its headline table")
    return parser.parse_intermixed_args(argv)


def resume_command(argv: list[str], out: Path) -> str:
    """The command that resumes this study: the one given, with its dir pinned by --out."""
    args, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--out":
            skip = True
        elif not arg.startswith("--out="):
            args.append(arg)
    return shlex.join(["python", sys.argv[0] if sys.argv[0].endswith(".py") else "scripts/fair_compare.py",
                       *args, "--out", str(out)])


def main(argv: list[str] | None = None) -> int:
    quiet_library_noise()
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        if args.page and args.report is None:
            raise PlanError("--page needs --report DIR, DIR a dir of studies")
        if args.report is not None:
            return report(args.report, args.out, args.page)
        out = (args.out or Path("outputs") / "fair" / time.strftime("%Y-%m-%d_%H-%M-%S")).absolute()
        if not args.dry_run:
            check_out(out)
        name = "smoke" if args.smoke else "fair"
        study_overrides, train_overrides = route(args.overrides)
        launch = [o for o in train_overrides if o.lstrip("+~").startswith("hydra")]
        if args.rerun is not None:
            from study.rerun import rerun_plan

            if args.smoke:
                raise PlanError("--smoke and --rerun: a rerun takes everything but its seeds from the study it reruns")
            plan = rerun_plan(args.rerun, study_overrides, [o for o in train_overrides if o not in launch])
        else:
            plan = build_plan(name, compose_study(name, study_overrides), [o for o in train_overrides if o not in launch])
        if args.dry_run:
            return dry_run(plan, launch)
        return run_study(plan, out, launch, run_train_py, resume_command(argv, out), args.rerun)
    except (PlanError, StudyError, FileNotFoundError) as err:
        refuse(str(err))


def dry_run(plan, launch: list[str]) -> int:
    """The plan at once; then its time here, from real runs where the runs would run here."""
    from study.estimate import dry_run_lines

    print("\n".join(plan_lines(plan)), flush=True)
    start_s = time.monotonic() - STARTED
    remote = any(o.split("=", 1)[0] == "hydra/launcher" and not o.endswith("=local") for o in launch)
    lines = dry_run_lines(plan, None if remote else run_train_py, lambda line: print(f"[dry run] {line}", flush=True),
                          start_s)
    print("\n".join(lines))
    return 0


def run_train_py(argv: list[str]) -> int:
    """train.py as `python train.py <argv>` would run it, in this process: its checks, then the
    run or the sweep. Returns its exit code."""
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


if __name__ == "__main__":
    sys.exit(main())
