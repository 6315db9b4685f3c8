"""lab/results.md's reference comparison in bf16 on one GPU, in about four minutes: `make
compare-gpu`, and `make check-gpu`'s compare-bf16 step.

    python scripts/gpu/reference_bf16.py                      # lab/results/runs/bf16, lab/results/bf16
    python scripts/gpu/reference_bf16.py --records R --out O --runs D --timeout 200
    python scripts/gpu/reference_bf16.py --steps 8 model=gpt_tiny eval.interval=4   # the plumbing, in minutes on a CPU

The runs behind lab/results.md's headline (`+experiment=reference_cpu_setup`: gpt_small on
corpus 07fe11cb26fb, 8 x 256 tokens a step, 240 steps) with `trainer.precision=bf16
optim.muon.ns_dtype=bf16` added, at the lrs the fp32 protocol found best: no bf16 lr sweep fits
in four minutes, so these are the fp32 optima, not re-tuned in bf16. Muon at lr 1e-2 and AdamW
at 1e-3 for 240 steps (--steps), and AdamW with 1.25x, 1.5x and 2x the steps at its best fp32
lr for each length (7e-4, 7e-4, 1e-3), each with seeds 0, 1 and 2: 15 runs, as five Hydra
sweeps (`train.py -m`, SWEEPS below) side by side on the one device; each sweep's output goes
to <runs>/<sweep>.log. Sweeps still going after --timeout seconds are stopped, and only the
runs that finished are recorded.

Then scripts/record_runs.py records the runs into --records (committed records, the form of
lab/results/runs/: metrics.jsonl gzipped, the configs, environment.json) and
scripts/compare_runs.py compares the records into --out: Muon against AdamW, with the longer
AdamW schedules, so its summary.md holds the honest ratio with its intervals (the "Schedule
ratio" table) as lab/results/summary.md does for fp32. The run dirs (their checkpoints are
large) stay in --runs, outside the records. --records must be empty or absent, unless
--replace, which empties it first: records of two invocations must not mix.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Optional

from scripts import REPO
from scripts.gpu.process_group import start, wait_all, wait_or_stop
from scripts.refuse import refuse

# name: (optimizer overrides, steps as a multiple of --steps). The lrs are the fp32 protocol's
# best at each length (lab/results.md, "Longer schedules").
SWEEPS: dict[str, tuple[list[str], float]] = {
    "muon": (["optim=muon", "optim.lr=1e-2"], 1.0),
    "adamw": (["optim=adamw", "optim.lr=1e-3"], 1.0),
    "adamw_1.25x": (["optim=adamw", "optim.lr=7e-4"], 1.25),
    "adamw_1.5x": (["optim=adamw", "optim.lr=7e-4"], 1.5),
    "adamw_2x": (["optim=adamw", "optim.lr=1e-3"], 2.0),
}
LONGER = ("adamw_1.25x", "adamw_1.5x", "adamw_2x")
BF16 = ["trainer.precision=bf16", "optim.muon.ns_dtype=bf16"]
SEEDS = "seed=0,1,2"
# Each sweep is one process on a GPU: a few CPU threads each leave the cores to the others.
THREADS = "2"


def sweep_argv(py: str, name: str, steps: int, runs: Path, extra: list[str]) -> list[str]:
    """The train.py command of one sweep: lab/results.md's, in bf16, into <runs>/<name>."""
    overrides, scale = SWEEPS[name]
    return [py, str(REPO / "train.py"), "-m", "+experiment=reference_cpu_setup", *BF16, *overrides,
            f"trainer.max_steps={round(steps * scale)}", SEEDS, "logger.wandb.mode=disabled", "logger.progress=none",
            f"hydra.sweep.dir={runs / name}", *extra]


def run_sweeps(py: str, steps: int, runs: Path, extra: list[str], timeout_s: float) -> dict[str, str]:
    """Every sweep at once, each in its own process group; {name: how it ended}."""
    runs.mkdir(parents=True, exist_ok=True)
    logs = {name: open(runs / f"{name}.log", "w") for name in SWEEPS}
    try:
        procs = {}
        for name in SWEEPS:
            argv = sweep_argv(py, name, steps, runs, extra)
            logs[name].write(f"$ {' '.join(argv)}\n")
            logs[name].flush()
            procs[name] = start(argv, logs[name], REPO, {"OMP_NUM_THREADS": THREADS})
            print(f"started {name}: {' '.join(argv[2:])}", flush=True)
        ended = wait_all(procs, timeout_s)
    finally:
        for f in logs.values():
            f.close()
    return {name: "stopped at --timeout" if timed_out else ("ok" if rc == 0 else f"failed (exit code {rc})")
            for name, (rc, timed_out) in ended.items()}


def tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def run_tool(argv: list[str], timeout_s: float) -> int:
    """A project script in the foreground, its output into ours; its exit code (124: stopped)."""
    sys.stdout.flush()
    proc = start(argv, sys.stdout, REPO)
    rc, timed_out = wait_or_stop(proc, timeout_s)
    return 124 if timed_out else (rc or 0)


def prepare_records(records: Path, replace: bool) -> None:
    """Refuse (exit 2) to mix the records of two invocations; with --replace, start from an empty dir."""
    if records.exists() and any(records.iterdir()):
        if not replace:
            refuse(f"--records {records} already holds records; pass --replace to replace them")
        shutil.rmtree(records)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=Path, default=REPO / "lab" / "results" / "runs" / "bf16",
                    help="where the runs are recorded (default: lab/results/runs/bf16)")
    ap.add_argument("--out", type=Path, default=REPO / "lab" / "results" / "bf16",
                    help="compare_runs.py's output: summary.md and its figures (default: lab/results/bf16)")
    ap.add_argument("--runs", type=Path, default=None,
                    help="the run dirs (default: outputs/reference_bf16/<date-time>)")
    ap.add_argument("--steps", type=int, default=240, help="Muon's and AdamW's 1x steps (the longer runs scale)")
    ap.add_argument("--timeout", type=float, default=200, help="seconds for the runs, all sweeps together")
    ap.add_argument("--replace", action="store_true", help="empty --records first")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("overrides", nargs="*", help="more Hydra overrides for every run (a quick look: model=gpt_tiny)")
    args = ap.parse_args(argv)
    prepare_records(args.records, args.replace)
    runs = args.runs or REPO / "outputs" / "reference_bf16" / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")

    t0 = time.monotonic()
    ended = run_sweeps(args.python, args.steps, runs.resolve(), args.overrides, args.timeout)
    print(f"\nsweeps after {time.monotonic() - t0:.0f} s: " + ", ".join(f"{k} {v}" for k, v in ended.items()))
    for name, how in ended.items():
        if how != "ok":
            print(f"\nthe end of {runs / name}.log:\n{tail(runs / f'{name}.log')}")
    sources = [str(runs / name) for name in SWEEPS if (runs / name).is_dir()]
    if not sources:
        print("no run to record")
        return 1
    recorded = run_tool([args.python, str(REPO / "scripts" / "record_runs.py"), *sources, "--into", str(args.records),
                         "--skip-unfinished"], 120)
    arms = [str(args.records / name) for name in ("muon", "adamw") if (args.records / name).is_dir()]
    longer = [str(args.records / name) for name in LONGER if (args.records / name).is_dir()]
    if recorded != 0 or len(arms) < 2:
        print(f"\nrecording ended with exit code {recorded}; arms recorded: {arms or 'none'}: no comparison")
        return 1
    compared = run_tool([args.python, str(REPO / "scripts" / "compare_runs.py"), *arms,
                         *(["--longer", *longer] if longer else []), "--out", str(args.out)], 120)
    print(f"\nreference_bf16: runs {runs}, records {args.records}, comparison {args.out}; "
          f"{time.monotonic() - t0:.0f} s in all")
    return 0 if compared == 0 and all(v == "ok" for v in ended.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
