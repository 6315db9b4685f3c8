"""Calibrate the scale planner on this machine: its predicted times against measured ones.

    python lab/tools/bench/calibrate_plan.py                          # gpt_small; DP 2, DP 4, TP 2
    python lab/tools/bench/calibrate_plan.py --model gpt_tiny --layouts 2x1

For each layout, spawned gloo ranks (one intra-op thread each) first measure this machine's
rates the way planning/scale_plan.py's hardware profile states them, all ranks at once so that
they share the cores as they will in training, each as a throughput over a window: a fp32
matmul rate (F.linear of --matmul-size squares), a memory bandwidth (a large copy), and the link between ranks (all-gathers
of 4 bytes for the latency, of 16 MB for the bandwidth). Then they time, as medians over
--steps repeats on random gradients:
  - forward + backward of one micro-batch (--batch x --seq-len tokens per rank);
  - the optimizer step with its DP/TP traffic (prepare_grads + step), for AdamW ZeRO-1 and Muon.
The planner, given those rates, predicts the same three times; the table shows both and the
error. On one CPU "intra-node" is the only link, so every collective uses the measured one.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from datetime import date

import torch

from planning.scale_plan import Hardware, predict
from model.config import ModelConfig
from lab.tools.bench.bench_common import machine_info
from model.presets import preset_config


def _throughput(fn, seconds: float) -> float:
    """Calls per second of `fn` over a window: with several ranks per core, the rate each
    rank really gets (a single short call, shorter than a scheduler slice, would not see the
    sharing)."""
    fn()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        calls += 1
    return calls / (time.perf_counter() - start)


def _median_s(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _worker(rank: int, world: int, cfg: ModelConfig, tp: int, batch: int, seq_len: int, steps: int,
            matmul_size: int) -> dict[str, float]:
    import torch.distributed as dist

    import torch.nn.functional as F
    from parallel.comm import all_gather_into
    from model.gpt import GPT
    from model.parallelize import parallelize_tp
    from optim.builder import build_optimizer
    from optim.config import OptimConfig
    from parallel.mesh import build_mesh

    torch.set_num_threads(1)
    mesh = build_mesh(tp)
    out: dict[str, float] = {}
    a, w = torch.randn(matmul_size, matmul_size), torch.randn(matmul_size, matmul_size)
    dist.barrier()
    out["matmul_flops"] = 2 * matmul_size**3 * _throughput(lambda: F.linear(a, w), 2.0)
    big = torch.randn(2**23)
    copy_into = torch.empty_like(big)
    dist.barrier()
    out["mem_bytes_s"] = 2 * big.numel() * 4 * _throughput(lambda: copy_into.copy_(big), 1.0)
    for nbytes, key in ((4, "small"), (2**24, "large")):
        x = torch.zeros(nbytes // 4)
        gathered = torch.empty(world * x.numel())
        dist.barrier()
        out[f"gather_{key}_s"] = _median_s(lambda: all_gather_into(gathered, x, dist.group.WORLD), 21)

    torch.manual_seed(0)
    model = parallelize_tp(GPT(cfg), mesh.tp_group)
    x = torch.randint(0, cfg.vocab_size, (batch, seq_len))

    def forward_backward() -> None:
        model(x, x).backward()

    forward_backward()
    dist.barrier()
    out["compute_s"] = _median_s(forward_backward, steps)
    for name in ("adamw", "muon"):
        opt_cfg = OptimConfig(name=name)
        opt_cfg.muon.ns_dtype = "fp32"
        opt = build_optimizer(model, opt_cfg, cfg, mesh)

        def optimizer_step() -> None:
            for p in model.parameters():
                p.grad = torch.randn_like(p) * 1e-3
            t0 = time.perf_counter()
            opt.prepare_grads(1.0)
            opt.step()
            optimizer_step.elapsed = time.perf_counter() - t0  # random gradients are not timed

        optimizer_step()
        dist.barrier()
        samples = []
        for _ in range(steps):
            optimizer_step()
            samples.append(optimizer_step.elapsed)
        out[f"{name}_s"] = statistics.median(samples)
    return out


def measured_hardware(results: list[dict[str, float]]) -> Hardware:
    """This machine as a hardware profile: the ranks' median rates; the link's latency and
    bandwidth from the two all-gather sizes over all ranks (ring model:
    (p-1) alpha + (p-1)/p S / beta)."""
    med = lambda key: statistics.median(r[key] for r in results)  # noqa: E731
    p = len(results)
    latency = med("gather_small_s") / (p - 1)
    large = 2**24 * p  # the gathered buffer
    bandwidth = (p - 1) / p * large / max(1e-9, med("gather_large_s") - (p - 1) * latency)
    return Hardware(name="this CPU", matmul_tflops=med("matmul_flops") / 1e12, hbm_gb=1e9,
                    hbm_tb_s=med("mem_bytes_s") / 1e12, nvlink_gb_s=bandwidth / 1e9,
                    nvlink_latency_us=latency * 1e6, ib_gb_s=bandwidth / 1e9, ib_latency_us=latency * 1e6,
                    gpus_per_node=10**6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt_small")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--layouts", nargs="+", default=["2x1", "4x1", "1x2"], help="DPxTP")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--matmul-size", type=int, default=384, help="side of the timed matmul (the model's width)")
    args = parser.parse_args()
    for layout in args.layouts:  # refuse a bad layout before any rank is started
        dims = layout.split("x")
        if len(dims) != 2 or not all(d.isdigit() and int(d) > 0 for d in dims):
            parser.error(f"--layouts: {layout!r} is not DPxTP (e.g. 2x1)")
        if int(dims[0]) * int(dims[1]) < 2:
            parser.error(f"--layouts: {layout} has one rank; the link's latency and bandwidth are "
                         "measured between ranks, so every layout needs at least 2")
    from lab.tools.spawn import run_ranks

    cfg = preset_config(args.model, args.vocab)
    print(f"{machine_info()}; {date.today()}; model {args.model}, {args.batch} x {args.seq_len} tokens per rank, "
          "fp32, one thread per rank")
    print("| DPxTP | measured rates | time | measured ms | predicted ms | error |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for layout in args.layouts:
        dp, tp = (int(v) for v in layout.split("x"))
        results = run_ranks(_worker, dp * tp, cfg, tp, args.batch, args.seq_len, args.steps, args.matmul_size)
        hw = measured_hardware(results)
        tokens = args.batch * args.seq_len * dp
        steps = predict(replace(cfg), hw, dp, tp, tokens, args.seq_len, args.batch)
        rates = (f"matmul {hw.matmul_tflops * 1e3:.1f} GFLOP/s, memory {hw.hbm_tb_s * 1e3:.1f} GB/s, "
                 f"link {hw.nvlink_gb_s:.2f} GB/s + {hw.nvlink_latency_us:.0f} us")
        measured = {
            "forward + backward": statistics.median(r["compute_s"] for r in results),
            "AdamW ZeRO-1 step": max(r["adamw_s"] for r in results),
            "Muon step (ours)": max(r["muon_s"] for r in results),
        }
        predicted = {
            "forward + backward": steps["adamw-zero1"].times["compute"] + steps["adamw-zero1"].times["tp_activations"],
            "AdamW ZeRO-1 step": steps["adamw-zero1"].optimizer_s,
            "Muon step (ours)": steps["muon-ours"].optimizer_s,
        }
        for i, (what, m) in enumerate(measured.items()):
            p = predicted[what]
            print(f"| {layout if i == 0 else ''} | {rates if i == 0 else ''} | {what} | {m * 1e3:.1f} | "
                  f"{p * 1e3:.1f} | {100 * (p - m) / m:+.0f}% |")


if __name__ == "__main__":
    main()
