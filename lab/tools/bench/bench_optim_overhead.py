"""Optimizer overhead of a full training step at data parallelism 4: Muon vs AdamW.

    python lab/tools/bench/bench_optim_overhead.py                        # gpt_small, DP=4, fp32
    python lab/tools/bench/bench_optim_overhead.py --model gpt_tiny --steps 12 --nproc 2
    python lab/tools/bench/bench_optim_overhead.py optim.muon.ns_dtype=fp32   # trailing: Hydra overrides

Launches real training runs, one per optimizer, one after the other:

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=4 train.py \\
        model=gpt_small optim=<muon|adamw> logger.interval=1 eval.interval=0 ...

and reads perf/step_s and perf/optim_step_s (rank 0's optimizer step: ZeRO-1 update,
Newton-Schulz for Muon, parameter all-gather) from each run's metrics.jsonl. Overhead =
optimizer-step time / full step time, the median over the steps after --warmup. With
logger.interval=1 every step also pays the logging statistics (update RMS snapshot, output
RMS), which the step time includes and the optimizer time does not.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from datetime import date
from pathlib import Path

from lab.tools.bench.bench_common import add_run_arguments, machine_info, parse_run_arguments, torchrun_train


def run(optim: str, args: argparse.Namespace, run_dir: Path) -> list[dict]:
    return torchrun_train(args.nproc, [
        f"model={args.model}", f"optim={optim}", f"trainer.max_steps={args.steps}",
        f"trainer.batch_size={args.batch_size}", f"trainer.seq_len={args.seq_len}",
        f"trainer.precision={args.precision}", *args.overrides], run_dir, args.timeout, optim)


def summarise(records: list[dict], warmup: int) -> dict[str, float]:
    steps = [r for r in records if "perf/optim_step_s" in r and r["step"] > warmup]
    if not steps:
        raise SystemExit(f"no step after --warmup {warmup} logged perf/optim_step_s")
    return {
        "steps": len(steps),
        "tokens_per_step": steps[0]["tokens"] / steps[0]["step"],
        "step_s": statistics.median(r["perf/step_s"] for r in steps),
        "optim_s": statistics.median(r["perf/optim_step_s"] for r in steps),
        "overhead": statistics.median(r["perf/optim_step_s"] / r["perf/step_s"] for r in steps),
        "mfu": statistics.median(r.get("perf/mfu", float("nan")) for r in steps),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt_small")
    ap.add_argument("--optims", nargs="+", default=["muon", "adamw"])
    ap.add_argument("--nproc", type=int, default=4, help="data-parallel ranks (processes)")
    ap.add_argument("--batch-size", type=int, default=2, help="sequences per rank per step")
    ap.add_argument("--seq-len", type=int, default=256)
    add_run_arguments(ap)
    args = parse_run_arguments(ap)

    cores = os.cpu_count() or 1
    print(f"# Optimizer overhead at DP={args.nproc} ({date.today().isoformat()})\n")
    if args.nproc > cores:
        print(f"**Oversubscribed: {args.nproc} processes (1 thread each) on {cores} logical CPUs.** "
              "Ranks wait on each other's time slices, so absolute times are inflated and "
              "collectives include that waiting; compare the two optimizers, not the numbers "
              "with a real cluster.\n")
    for k, v in machine_info().items():
        print(f"- {k}: {v}")
    print(f"- command: {' '.join(sys.argv)}")

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for optim in args.optims:
            results[optim] = summarise(run(optim, args, Path(tmp) / optim), args.warmup)

    extra = f", {' '.join(args.overrides)}" if args.overrides else ""
    print(f"\nmodel={args.model}, DP={args.nproc} (OMP_NUM_THREADS=1 per rank), "
          f"{args.batch_size} x {args.seq_len} tokens per rank, {args.precision}{extra}; "
          f"{args.steps} steps per run, medians over steps {args.warmup + 1}-{args.steps}.\n")
    print("| optimizer | tokens/step (global) | step s | optimizer-step s | overhead % | MFU |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for optim, r in results.items():
        print(f"| {optim} | {r['tokens_per_step']:,.0f} | {r['step_s']:.3f} | {r['optim_s']:.3f} "
              f"| {100 * r['overhead']:.1f}% | {100 * r['mfu']:.2f}% |")
    if "muon" in results and "adamw" in results:
        m, a = results["muon"], results["adamw"]
        print(f"\nMuon's optimizer step costs {m['optim_s'] / a['optim_s']:.2f}x AdamW's; "
              f"the full step {m['step_s'] / a['step_s']:.2f}x.")


if __name__ == "__main__":
    main()
