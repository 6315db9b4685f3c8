"""The pipeline bubble, measured: step time at pp 1 and pp 2 for several micro-batch counts,
next to the planner's bubble fraction (planning/pipeline_plan.py), and Muon's share of the step on each stage.

    python lab/tools/bench/bench_pipeline.py                        # gpt_small, 1f1b and gpipe, m = 2 4 8
    python lab/tools/bench/bench_pipeline.py --model gpt_tiny --steps 6 --microbatches 2 4

Each configuration is a real training run (train.py; pp 2 under torchrun, each rank one CPU
thread, the pp 1 run one thread too), timed by its own perf/step_s over the steps after the
first two. With pp ranks working in turn on a machine with a core per rank, the ideal pp-2
step is half the pp-1 step; the measured bubble is 1 - T(pp 1) / (pp x T(pp)). It includes the
sends and receives, which over gloo on one machine are copies through the loopback.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

from planning.pipeline_plan import bubble_fraction
from scripts import REPO
from lab.tools.bench.bench_common import machine_info


def run(run_dir: Path, pp: int, overrides: list[str]) -> dict[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "train.py", *overrides, f"hydra.run.dir={run_dir}"]
    if pp > 1:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={pp}", *argv[1:]]
    subprocess.run(argv, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if r["step"] > 2 and "perf/step_s" in r]
    out = {"step_s": statistics.median(r["perf/step_s"] for r in timed)}
    for rank in range(pp):
        key = f"perf/optim_step_s/pp_rank_{rank}" if pp > 1 else "perf/optim_step_s"
        out[f"optim_share_{rank}"] = statistics.median(r[key] / r["perf/step_s"] for r in timed)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt_small")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "gpipe"])
    parser.add_argument("--layers-per-stage", type=int, nargs="*", default=[],
                        help="parallel.pp_layers_per_stage (default: the even split)")
    args = parser.parse_args()
    common = [f"model={args.model}", "optim=muon", "trainer.device=cpu", "trainer.precision=fp32",
              f"trainer.batch_size={args.batch_size}", f"trainer.seq_len={args.seq_len}",
              f"trainer.max_steps={args.steps}", "logger.interval=1", "eval.interval=0", "eval.batches=1",
              f"eval.batch_size={args.batch_size}", "checkpoint.interval=0", "logger.wandb.mode=disabled",
              "logger.tensorboard=false", "logger.progress=none", "trainer.peak_tflops=1"]
    with tempfile.TemporaryDirectory() as tmp:
        base = run(Path(tmp) / "pp1", 1, common)
        print(f"# {machine_info()}; {date.today()}; {args.model}, batch {args.batch_size} x {args.seq_len}, Muon, fp32, "
              f"blocks per stage {args.layers_per_stage or 'even'}")
        print(f"pp 1: {base['step_s']:.3f} s per step, Muon {100 * base['optim_share_0']:.1f}% of it")
        print("| schedule | micro-batches | step s (pp 2) | measured bubble | planned bubble | Muon share, stage 0 | "
              "Muon share, stage 1 |")
        print("|---|---|---|---|---|---|---|")
        for schedule in args.schedules:
            for m in args.microbatches:
                name = f"pp2_{schedule}_{m}"
                split = f"parallel.pp_layers_per_stage=[{','.join(map(str, args.layers_per_stage))}]"
                got = run(Path(tmp) / name, 2, common + ["parallel.pp=2", f"parallel.pp_schedule={schedule}",
                                                        f"parallel.pp_microbatches={m}", f"eval.batch_size={m}", split])
                measured = 1 - base["step_s"] / (2 * got["step_s"])
                print(f"| {schedule} | {m} | {got['step_s']:.3f} | {100 * measured:.1f}% | "
                      f"{100 * bubble_fraction(schedule, 2, m):.1f}% | {100 * got['optim_share_0']:.1f}% | "
                      f"{100 * got['optim_share_1']:.1f}% |", flush=True)


if __name__ == "__main__":
    main()
