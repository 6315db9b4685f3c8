"""The fair study's tuned choice, rerun in bf16 on one GPU: `make compare-gpu`, and `make
check-gpu`'s compare-bf16 step.

    python lab/tools/gpu/reference_bf16.py                    # the largest dense rung of lab/results/fair
    python lab/tools/gpu/reference_bf16.py --study S --out O --seeds 100,101,102 --jobs 4 --timeout 200
    python lab/tools/gpu/reference_bf16.py --study lab/results/fair_smoke --out /tmp/o --jobs 1   # the plumbing, a CPU minute

`scripts/fair_compare.py --rerun STUDY` with `trainer.precision=bf16 optim.muon.ns_dtype=bf16`:
each side runs the settings the fp32 study chose at every budget (tuned on a CPU, not re-tuned
in bf16), on fresh seeds, through the same final stage, into a study dir whose report is the
same as the fp32 one's: the speedup with its 95% interval and p-values, the budgets both sides
spent (the tuning records are copied from STUDY), the losses. --jobs runs that many runs at a
time on the one device (hydra/launcher=local; 1: one at a time). A rerun stopped at --timeout
keeps what it recorded; the same command trains the rest.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional

from scripts import REPO
from lab.tools.gpu.process_group import start, wait_or_stop
from scripts.refuse import refuse

LADDER = REPO / "lab" / "results" / "fair"
BF16 = ["trainer.precision=bf16", "optim.muon.ns_dtype=bf16"]
QUIET = ["logger.wandb.mode=disabled", "logger.progress=none"]


def largest_dense_rung(root: Path = LADDER) -> Optional[Path]:
    """The ladder's dense study with the most non-embedding parameters, None if it has none."""
    import json

    from study.ladder import study_dirs
    from study.analysis import model_params

    dense = []
    for path in study_dirs(root):
        model = json.loads((path / "records" / "plan.json").read_text())["model"]
        if not model.get("n_experts"):
            dense.append((model_params(model)[0], path))
    return max(dense)[1] if dense else None


def rerun_argv(py: str, study: Path, out: Path, seeds: list[int], jobs: int, extra: list[str]) -> list[str]:
    """fair_compare.py's command line: the rerun in bf16, extra overrides last (they win)."""
    launcher = ["hydra/launcher=local", f"hydra.launcher.n_jobs={jobs}"] if jobs > 1 else []
    return [py, str(REPO / "scripts" / "fair_compare.py"), "--rerun", str(study), "--out", str(out),
            f"compare.seeds=[{','.join(str(s) for s in seeds)}]", *BF16, *QUIET, *launcher, *extra]


def speedup_section(report: Path) -> str:
    """comparison.md's speedup table, as the report wrote it (check-gpu's summary quotes it)."""
    text = report.read_text() if report.is_file() else ""
    if "## Speedup" not in text:
        return ""
    return text.split("## Speedup", 1)[1].split("\n## ", 1)[0].strip()


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", type=Path, default=None,
                    help="the tuned study to rerun (default: the largest dense rung under lab/results/fair)")
    ap.add_argument("--out", type=Path, default=None, help="the rerun's study dir (default: lab/results/fair_bf16/<rung>)")
    ap.add_argument("--seeds", default="100,101,102", help="fresh seeds, none of the study's (default 100,101,102)")
    ap.add_argument("--jobs", type=int, default=4, help="runs at a time on the one device (default 4)")
    ap.add_argument("--timeout", type=float, default=None, help="stop after this many seconds (it resumes)")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("overrides", nargs="*", help="more train.py overrides for every run")
    args = ap.parse_intermixed_args(argv)
    study = args.study or largest_dense_rung()
    if study is None:
        refuse(f"no dense study under {LADDER} to rerun; name one with --study")
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        refuse(f"--seeds {args.seeds}: integers separated by commas")
    if args.jobs < 1:
        refuse(f"--jobs {args.jobs}: at least 1")
    out = args.out or REPO / "lab" / "results" / "fair_bf16" / study.name
    argv_ = rerun_argv(args.python, study, out, seeds, args.jobs, args.overrides)
    print(f"$ {' '.join(argv_)}", flush=True)
    t0 = time.monotonic()
    proc = start(argv_, sys.stdout, REPO)
    rc, timed_out = wait_or_stop(proc, args.timeout if args.timeout is not None else 1e9)
    print(f"\nreference_bf16: {study} rerun in bf16 into {out}; {time.monotonic() - t0:.0f} s"
          + (" (stopped at --timeout: the same command trains the rest)" if timed_out else ""))
    section = speedup_section(out / "report" / "comparison.md")
    if section and not timed_out and rc == 0:
        print(f"\n{section}")
    return 124 if timed_out else (rc or 0)


if __name__ == "__main__":
    sys.exit(main())
