"""ZeRO-1 parameter all-gather: one all-gather after the whole step vs bucketed asynchronous
all-gathers that overlap the Newton-Schulz of later buckets (optim.gather_buckets).

    python lab/tools/bench/bench_zero_overlap.py                         # gpt_small, Muon, DP=2: 1 vs 4 vs 8 buckets
    python lab/tools/bench/bench_zero_overlap.py --dp 2 --tp 2 --buckets 1 4 --model gpt_tiny

Every rank builds the real ZeroOptimizer once per bucket setting (same model, same seed) on
gloo. A round gives every setting one step, in turn: random gradients, prepare_grads (the
reduce-scatter, untimed), a barrier, then the timed optimizer step including its parameter
all-gather. A step's time is the slowest rank's. Reported: the median per setting, the
median over rounds of the per-round ratio to one bucket (robust to drifts that hit a whole
round), and the time ranks spent blocked in collectives during the step (parallel/comm.py).
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.distributed as dist

from model.presets import preset_config
from lab.tools.spawn import run_ranks


def _worker(rank: int, world: int, preset: str, vocab: int, tp: int, buckets: list[int],
            ns_dtype: str, warmup: int, rounds: int) -> dict[int, tuple[list[float], list[float]]]:
    from dataclasses import replace

    from parallel.comm import COUNTER
    from model.gpt import GPT
    from model.parallelize import parallelize_tp
    from optim.config import OptimConfig
    from optim.muon.options import MuonOptions
    from optim.zero import ZeroOptimizer
    from parallel.mesh import build_mesh

    cfg = preset_config(preset, vocab)
    mesh = build_mesh(tp)
    setups = {}
    for b in buckets:
        torch.manual_seed(0)
        model = parallelize_tp(GPT(cfg), mesh.tp_group)
        ocfg = OptimConfig(name="muon", gather_buckets=b, muon=replace(MuonOptions(), ns_dtype=ns_dtype))
        setups[b] = (model, ZeroOptimizer(model, ocfg, cfg, mesh))
    gen = torch.Generator().manual_seed(1 + rank)
    times: dict[int, tuple[list[float], list[float]]] = {b: ([], []) for b in buckets}
    for i in range(warmup + rounds):
        for b, (model, opt) in setups.items():
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen) * 1e-3
            opt.prepare_grads(1.0)
            dist.barrier()
            COUNTER.reset()
            start = time.perf_counter()
            opt.step()
            took = torch.tensor([time.perf_counter() - start])
            blocked = COUNTER.seconds
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            opt.zero_grad()
            if i >= warmup:
                times[b][0].append(took.item())
                times[b][1].append(blocked)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt_small")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--buckets", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--ns-dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    if 1 not in args.buckets:
        args.buckets = [1, *args.buckets]

    per_rank = run_ranks(_worker, args.dp * args.tp, args.model, args.vocab, args.tp, args.buckets,
                               args.ns_dtype, args.warmup, args.rounds)
    step = {b: per_rank[0][b][0] for b in args.buckets}  # already the max over ranks
    blocked = {b: [statistics.median(r[b][1]) for r in per_rank] for b in args.buckets}
    print(f"- torch {torch.__version__}, python {platform.python_version()}, gloo, "
          f"{args.dp * args.tp} processes x 1 thread")
    print(f"- {args.model} (vocab {args.vocab}), optim=muon, Newton-Schulz {args.ns_dtype}, "
          f"DP={args.dp} x TP={args.tp}; {args.warmup} warmup + {args.rounds} interleaved rounds\n")
    print("| gather buckets | optimizer step ms (median, slowest rank) | vs 1 bucket (paired) "
          "| blocked in collectives ms (median, per rank) |")
    print("| ---: | ---: | ---: | --- |")
    for b in args.buckets:
        ratio = statistics.median(x / y for x, y in zip(step[b], step[1]))
        ranks = " / ".join(f"{1e3 * s:.1f}" for s in blocked[b])
        print(f"| {b} | {1e3 * statistics.median(step[b]):.1f} | {ratio:.3f} | {ranks} |")


if __name__ == "__main__":
    main()
