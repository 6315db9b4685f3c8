"""Expert parallelism against TP-split experts on as many ranks: tokens/s and bytes per step.

    python lab/tools/bench/bench_expert_parallel.py                   # moe_small, 2 and 4 ranks, fp32
    python lab/tools/bench/bench_expert_parallel.py --nprocs 2 --steps 6
    python lab/tools/bench/bench_expert_parallel.py optim.muon.ns_dtype=fp32   # trailing: Hydra overrides

For each rank count N it runs, one after the other, the same global batch through:

    parallel.ep=N                   every rank holds E / N whole experts; tokens go to them
                                    by all-to-all (data parallel over the N ranks otherwise)
    parallel.tp=T (dp = N / T)      every rank holds a 1 / T slice of every expert's hidden
                                    units (T = 2: the widest TP that divides the model's heads)

and reads perf/step_s, the tokens per step and the counted bytes of every collective
(comm/<group>/<op>_bytes, rank 0's) from each run's metrics.jsonl: medians over the steps
after --warmup. The ratio is EP's tokens/s over the TP layout's, measured in one invocation.
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


def layouts(nproc: int, tp: int, global_batch: int) -> dict[str, list[str]]:
    """The two layouts on `nproc` ranks, each with the per-rank batch that keeps the global one."""
    dp_tp = nproc // tp
    return {
        f"ep {nproc} (dp {nproc})": [f"parallel.ep={nproc}", f"trainer.batch_size={global_batch // nproc}"],
        f"tp {tp} x dp {dp_tp}": [f"parallel.tp={tp}", f"trainer.batch_size={global_batch // dp_tp}"],
    }


def summarise(records: list[dict], warmup: int) -> dict[str, float]:
    steps = [r for r in records if "perf/step_s" in r and r["step"] > warmup]
    if not steps:
        raise SystemExit(f"no step after --warmup {warmup} logged perf/step_s")
    out = {
        "tokens_per_step": steps[0]["tokens"] / steps[0]["step"],
        "step_s": statistics.median(r["perf/step_s"] for r in steps),
    }
    for key in sorted({k for r in steps for k in r if k.startswith("comm/") and k.endswith("_bytes")}):
        out[key] = statistics.median(r.get(key, 0) for r in steps)
    out["tokens_s"] = out["tokens_per_step"] / out["step_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="moe_small")
    ap.add_argument("--optim", default="muon")
    ap.add_argument("--nprocs", type=int, nargs="+", default=[2, 4], help="rank counts to compare at")
    ap.add_argument("--tp", type=int, default=2, help="TP size of the TP-split layout")
    ap.add_argument("--global-batch", type=int, default=4, help="sequences per step, all ranks together")
    ap.add_argument("--seq-len", type=int, default=128)
    add_run_arguments(ap)
    args = parse_run_arguments(ap)

    cores = os.cpu_count() or 1
    print(f"# Expert parallelism vs TP-split experts ({date.today().isoformat()})\n")
    if max(args.nprocs) > cores:
        print(f"**Oversubscribed: up to {max(args.nprocs)} processes (1 thread each) on {cores} logical CPUs.** "
              "Ranks wait on each other's time slices; compare the layouts, not the numbers with a cluster.\n")
    for k, v in machine_info().items():
        print(f"- {k}: {v}")
    print(f"- command: {' '.join(sys.argv)}")
    common = [f"model={args.model}", f"optim={args.optim}", f"trainer.max_steps={args.steps}",
              f"trainer.seq_len={args.seq_len}", f"trainer.precision={args.precision}", *args.overrides]
    extra = f", {' '.join(args.overrides)}" if args.overrides else ""
    print(f"\nmodel={args.model}, optim={args.optim}, global batch {args.global_batch} x {args.seq_len} tokens, "
          f"{args.precision}{extra}; {args.steps} steps per run, medians over steps {args.warmup + 1}-{args.steps}; "
          "bytes per step are rank 0's, as parallel/comm.py counts them.\n")
    print("| ranks | layout | tokens/s | step s | tokens/s vs TP | bytes per step (rank 0) |")
    print("| ---: | --- | ---: | ---: | ---: | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in args.nprocs:
            results = {}
            for name, layout in layouts(nproc, args.tp, args.global_batch).items():
                run_dir = Path(tmp) / f"{nproc}_{len(results)}"
                results[name] = summarise(torchrun_train(nproc, common + layout, run_dir, args.timeout,
                                                         f"{nproc} ranks, {name}"), args.warmup)
            tp_rate = next(r["tokens_s"] for n, r in results.items() if n.startswith("tp"))
            for name, r in results.items():
                traffic = ", ".join(f"{k[len('comm/'):-len('_bytes')]} {v / 1e6:.2f} MB"
                                    for k, v in r.items() if k.startswith("comm/") and v)
                print(f"| {nproc} | {name} | {r['tokens_s']:,.0f} | {r['step_s']:.3f} | "
                      f"{r['tokens_s'] / tp_rate:.2f}x | {traffic} |")


if __name__ == "__main__":
    main()
