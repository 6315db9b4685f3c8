"""Benchmark optim.muon.Muon against torch.optim.Muon on the hidden matrices of a model.

    .venv/bin/python lab/tools/bench/bench_optimizer.py [--repeats 15] [--warmup 3] [--threads N]
    python3 lab/tools/bench/bench_optimizer.py --model gpt_124m --dtypes bf16     # on a GPU

gpt_small: 6 layers, d_model 384, 6 heads of 64, 6 KV heads, ffn_hidden 1024; per layer
wq, wk, wv, wo [384, 384], w_gate, w_up [1024, 384], w_down [384, 1024] (42 matrices).
gpt_124m: 12 layers, d_model 768, 12 heads of 64, ffn_hidden 2048 (84 matrices).

On CUDA more contenders of ours run: with compile_updates (the elementwise work as fused
compiled kernels, what trainer.compile=true uses there), with cuda_graphs (each stack's
Newton-Schulz replayed as a CUDA graph, optim.muon.cuda_graphs), both, both with
ns_method=auto (Gram where it measured faster on this GPU, optim/muon/ns_choice.py), and
compile_updates with ns_method=auto but no graphs (compile_updates' compiled normalisation
runs only without graphs), and that with inductor's combo kernels (several of the compiled
elementwise kernels per launch: optim/muon/fused.py); each step time
is set against the Newton-Schulz FLOPs at the measured matmul peak: the floor any Muon step has.

Measured in one run, all timings interleaved (every round steps each contender once, in
turn, so slow drifts hit them alike; rounds during which other processes used the CPU are
redone, see interleaved_times) and reported as medians:
  * optimizer step time, ours vs torch.optim.Muon, with Newton-Schulz in bf16 and in fp32.
    torch.optim.Muon always runs its iteration in bf16 (it calls grad.bfloat16()); its fp32
    row runs torch's own code with that one cast made an fp32 copy instead (see _Fp32Instead).
  * optimizer state bytes, Muon vs torch.optim.AdamW on the same matrices.
  * Newton-Schulz GFLOP/s against the matmul peak of this machine, measured on a large
    square matmul in the same run.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
from typing import Callable

import torch

import importlib

import torch.optim._muon as torch_muon_module

from optim.muon import ns_choice
from optim.muon.optimizer import Muon
from optim.muon.newton_schulz import coefficients_for, newton_schulz
from lab.tools.bench.bench_common import (
    FOREIGN_LIMIT, ROUND_STATS, interleaved_times, machine_info, matmul_peak, paired_ratio, peak_size,
    percent_of_peak, tensor_bytes,
)

ns_module = importlib.import_module("optim.muon.newton_schulz")
ns_buffers = importlib.import_module("optim.muon.buffers")

MODELS = {
    "gpt_small": dict(n_layers=6, d_model=384, n_heads=6, head_dim=64, n_kv_heads=6, ffn_hidden=1024),
    "gpt_124m": dict(n_layers=12, d_model=768, n_heads=12, head_dim=64, n_kv_heads=12, ffn_hidden=2048),
}
LR, WD = 3e-3, 0.1


def model_shapes(model: str) -> list[tuple[str, tuple[int, int]]]:
    c = MODELS[model]
    d, kv = c["d_model"], c["n_kv_heads"] * c["head_dim"]
    per_layer = [
        ("wq", (c["n_heads"] * c["head_dim"], d)),
        ("wk", (kv, d)),
        ("wv", (kv, d)),
        ("wo", (d, c["n_heads"] * c["head_dim"])),
        ("w_gate", (c["ffn_hidden"], d)),
        ("w_up", (c["ffn_hidden"], d)),
        ("w_down", (d, c["ffn_hidden"])),
    ]
    return [(f"layers.{i}.{n}", s) for i in range(c["n_layers"]) for n, s in per_layer]


# ----------------------------------------------------------------------------- contenders


class _Fp32Instead(torch.Tensor):
    """torch.optim.Muon's Newton-Schulz starts with grad.bfloat16(); on this subclass that one
    call returns a plain fp32 copy, so the rest of torch's own code runs in fp32."""

    def bfloat16(self, memory_format=torch.preserve_format):  # noqa: ARG002
        return self.as_subclass(torch.Tensor).clone()


_torch_ns = torch_muon_module._zeropower_via_newtonschulz


def _torch_ns_fp32(grad, *args, **kwargs):
    return _torch_ns(grad.as_subclass(_Fp32Instead), *args, **kwargs)


class TorchMuonFp32(torch.optim.Muon):
    """torch.optim.Muon with its Newton-Schulz in fp32 (patched only during step)."""

    def step(self, closure=None):  # type: ignore[override]
        torch_muon_module._zeropower_via_newtonschulz = _torch_ns_fp32
        try:
            return super().step(closure)
        finally:
            torch_muon_module._zeropower_via_newtonschulz = _torch_ns


class OneStackPerShape(Muon):
    """Our Muon without the CPU cache-sized runs: one stack and one call per shape."""

    def step(self, closure=None):  # type: ignore[override]
        saved, ns_buffers.CPU_WORKING_SET_BYTES = ns_buffers.CPU_WORKING_SET_BYTES, None
        try:
            return super().step(closure)
        finally:
            ns_buffers.CPU_WORKING_SET_BYTES = saved


class PerMatrix:
    """Our Muon, one optimizer per matrix: the same math without cross-matrix batching."""

    def __init__(self, params, **kw):
        self.opts = [Muon([p], **kw) for p in params]

    def step(self):
        for o in self.opts:
            o.step()


def make_params(shapes, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter((torch.randn(s, generator=g) * 0.02).to(device)) for _, s in shapes]
    grads = [(torch.randn(s, generator=g) * 1e-3).to(device) for _, s in shapes]
    for p, gr in zip(params, grads):
        p.grad = gr
    return params


def state_bytes(opt: torch.optim.Optimizer, min_numel: int = 0) -> int:
    return tensor_bytes(v for st in opt.state.values() for v in st.values()
                        if torch.is_tensor(v) and v.numel() > min_numel)


# ----------------------------------------------------------------------------- FLOPs


def ns_flops(m: int, n: int, steps: int) -> int:
    """FLOPs of `steps` quintic iterations on one wide m x n matrix (m <= n).

    Per step: X X^T 2m^2n, A A 2m^3 (+2m^2 for b*A + c*(.)), B X 2m^2n (+2mn for a*X + (.)).
    Plus the normalisation: norm 2mn, division mn.
    """
    per_step = 2 * m * m * n + 2 * m**3 + 2 * m * m + 2 * m * m * n + 2 * m * n
    return steps * per_step + 3 * m * n


def shape_stacks(shapes) -> dict[tuple[int, int], int]:
    """{(rows, cols): count}: the stacks our Muon forms."""
    out: dict[tuple[int, int], int] = {}
    for _, rc in shapes:
        out[rc] = out.get(rc, 0) + 1
    return out


# ----------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt_small")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--peak-size", type=int, default=None,
                    help="side of the peak matmul (default: 8192 on CUDA, 2048 on CPU)")
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"],
                    help="Newton-Schulz dtypes to time (bf16 is very slow on CPUs without bf16 matmul units)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    args.peak_size = args.peak_size or peak_size(device, on_cpu=2048)
    shapes = model_shapes(args.model)
    steps = 5

    print("## Machine\n")
    for k, v in machine_info().items():
        print(f"- {k}: {v}")
    n_params = sum(r * c for _, (r, c) in shapes)
    print(f"\n{args.model} Muon matrices: {len(shapes)} ({n_params / 1e6:.2f}M parameters), "
          f"stacks {shape_stacks(shapes)}; lr {LR}, weight decay {WD}, "
          f"momentum 0.95 Nesterov, {steps} classic Newton-Schulz steps, adjust_lr match_rms_adamw.")
    print(f"Timings: {args.warmup} warmup + {args.repeats} interleaved repeats, median.\n")

    # --- step time ---------------------------------------------------------------------
    contenders: dict[str, Callable[[], object]] = {}
    kw_ours = dict(lr=LR, weight_decay=WD, momentum=0.95, nesterov=True, ns_steps=steps,
                   coefficients="classic", adjust_lr="match_rms_adamw", eps=1e-7)
    kw_torch = dict(lr=LR, weight_decay=WD, momentum=0.95, nesterov=True, ns_steps=steps,
                    eps=1e-7, adjust_lr_fn="match_rms_adamw")
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    for label, ns in ((k, dtypes[k]) for k in args.dtypes):
        contenders[f"ours {label}"] = Muon(make_params(shapes, device), ns_dtype=ns, **kw_ours).step
        if device.type == "cuda":
            contenders[f"ours {label} compiled"] = Muon(make_params(shapes, device), ns_dtype=ns,
                                                        compile_updates=True, **kw_ours).step
            contenders[f"ours {label} graphs"] = Muon(make_params(shapes, device), ns_dtype=ns,
                                                      cuda_graphs=True, **kw_ours).step
            contenders[f"ours {label} compiled graphs"] = Muon(make_params(shapes, device), ns_dtype=ns,
                                                               compile_updates=True, cuda_graphs=True, **kw_ours).step
            auto = Muon(make_params(shapes, device), ns_dtype=ns, compile_updates=True, cuda_graphs=True,
                        ns_method="auto", **kw_ours)
            # Timed as it runs, through the graph path; the timing's graphs go before the steps'.
            timer = ns_choice.device_timer(device, ns, steps, kw_ours["coefficients"], kw_ours["eps"],
                                           auto.ns_shapes(), graphs=True)
            picked = ns_choice.choose(auto.ns_shapes(), timer)
            timer.release()
            auto.set_ns_by_shape(picked.by_shape)
            print(f"ns_method=auto on this device ({label}): " + ", ".join(
                f"{k} {v} ({picked.speedups[k]:.2f}x)" for k, v in sorted(picked.by_shape.items())))
            contenders[f"ours {label} compiled graphs auto"] = auto.step
            # compile_updates' compiled normalisation is off under CUDA graphs (optim/muon/optimizer.py):
            # this one has it, and auto's choice, without graphs.
            fused = Muon(make_params(shapes, device), ns_dtype=ns, compile_updates=True, ns_method="auto",
                         ns_by_shape=picked.by_shape, **kw_ours)
            contenders[f"ours {label} compiled auto"] = fused.step
            combo = Muon(make_params(shapes, device), ns_dtype=ns, compile_updates=True, combo_kernels=True,
                         ns_method="auto", ns_by_shape=picked.by_shape, **kw_ours)
            contenders[f"ours {label} compiled combo auto"] = combo.step
        contenders[f"ours {label} one-stack"] = OneStackPerShape(make_params(shapes, device), ns_dtype=ns, **kw_ours).step
        contenders[f"ours {label} per-matrix"] = PerMatrix(make_params(shapes, device), ns_dtype=ns, **kw_ours).step
        torch_cls = torch.optim.Muon if ns == torch.bfloat16 else TorchMuonFp32
        contenders[f"torch {label}"] = torch_cls(make_params(shapes, device), **kw_torch).step
    times = interleaved_times(contenders, args.warmup, args.repeats, device)
    t = {k: statistics.median(v) for k, v in times.items()}

    print(f"## Optimizer step ({len(shapes)} matrices)\n")
    print("| NS dtype | torch.optim.Muon ms | ours ms | ours / torch | same, paired per round "
          "| ours, one stack per shape ms | ours, one matrix at a time ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label in args.dtypes:
        tt, to = t[f"torch {label}"], t[f"ours {label}"]
        t1, tp = t[f"ours {label} one-stack"], t[f"ours {label} per-matrix"]
        pr = paired_ratio(times, f"ours {label}", f"torch {label}")
        print(f"| {label} | {tt * 1e3:.1f} | {to * 1e3:.1f} | **{to / tt:.3f}** | {pr:.3f} "
              f"| {t1 * 1e3:.1f} | {tp * 1e3:.1f} |")
    print("\n(ours: one stack per (rows, cols), processed in cache-sized runs on CPU; "
          "'one stack per shape' switches the runs off; 'one matrix at a time' is one Muon per matrix.)")
    if device.type == "cuda":
        print("\n| NS dtype | ours eager ms | CUDA graphs ms | compile_updates ms | compile_updates + CUDA graphs ms "
              "| + ns_method=auto ms | eager / graphs, paired | compiled / compiled + graphs, paired |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for label in args.dtypes:
            cells = " | ".join(f"{t[f'ours {label}{suffix}'] * 1e3:.2f}"
                               for suffix in ("", " graphs", " compiled", " compiled graphs", " compiled graphs auto"))
            print(f"| {label} | {cells} | {paired_ratio(times, f'ours {label}', f'ours {label} graphs'):.2f}x "
                  f"| {paired_ratio(times, f'ours {label} compiled', f'ours {label} compiled graphs'):.2f}x |")

    # --- state bytes ---------------------------------------------------------------------
    muon_p, adamw_p = make_params(shapes, device), make_params(shapes, device)
    muon = Muon(muon_p, **kw_ours)
    adamw = torch.optim.AdamW(adamw_p, lr=LR, weight_decay=WD)
    muon.step()
    adamw.step()
    mb, ab = state_bytes(muon), state_bytes(adamw)
    ab_moments = state_bytes(adamw, min_numel=1)  # exp_avg + exp_avg_sq, without step counters
    print("\n## Optimizer state\n")
    print("| optimizer | state bytes | per parameter | Muon / this |")
    print("|---|---:|---:|---:|")
    print(f"| Muon (momentum buffer) | {mb:,} | {mb / n_params:.2f} | 1 |")
    print(f"| AdamW (exp_avg, exp_avg_sq, step) | {ab:,} | {ab / n_params:.2f} | {mb / ab:.6f} |")
    print(f"| AdamW moments only | {ab_moments:,} | {ab_moments / n_params:.2f} | {mb / ab_moments:.6f} |")
    print(f"\n(AdamW's per-parameter `step` counters are {ab - ab_moments} bytes of 0-d tensors.)")

    # --- Newton-Schulz throughput ----------------------------------------------------------
    print(f"\n## Newton-Schulz throughput (all {len(shapes)} {args.model} matrices)\n")
    stacks = shape_stacks(shapes)
    flops = sum(cnt * ns_flops(min(rc), max(rc), steps) for rc, cnt in stacks.items())
    g = torch.Generator().manual_seed(1)
    batches = {rc: torch.randn(cnt, *rc, generator=g).to(device) for rc, cnt in stacks.items()}
    singles = [(torch.randn(r, c, generator=g) * 1e-3).to(device) for _, (r, c) in shapes]
    coeffs = coefficients_for("classic", steps)[0]

    def ours(dtype):
        return lambda: [newton_schulz(b, steps, "classic", dtype, out_dtype=dtype) for b in batches.values()]

    def theirs(fn):
        return lambda: [fn(x, coeffs, steps, 1e-7) for x in singles]

    torch_ns = {"bf16": _torch_ns, "fp32": _torch_ns_fp32}
    fns = {}
    for label in args.dtypes:
        fns[f"ours {label}"] = ours(dtypes[label])
        fns[f"torch {label}"] = theirs(torch_ns[label])
    ns_times = interleaved_times(fns, args.warmup, args.repeats, device)
    tn = {k: statistics.median(v) for k, v in ns_times.items()}
    peak = {label: matmul_peak(dtypes[label], device, args.peak_size, args.warmup, max(5, args.repeats // 2))
            for label in args.dtypes}
    print(f"FLOPs per optimizer step: {flops / 1e9:.2f} GFLOP "
          f"(per step and m x n wide matrix: 4m^2n + 2m^3 + elementwise; {steps} steps)")
    print("GFLOP/s below are effective: those FLOPs over the time, also for our fp32 path on "
          "CPU, which computes only the upper block triangle of the symmetric A and B.\n")
    print(f"| NS dtype | matmul peak GFLOP/s ({args.peak_size}^2) | impl | NS ms | NS GFLOP/s | % of peak | ours / torch, paired |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for label in args.dtypes:
        for impl in ("ours", "torch"):
            secs = tn[f"{impl} {label}"]
            gf = flops / secs / 1e9
            pr = f"{paired_ratio(ns_times, f'ours {label}', f'torch {label}'):.3f}" if impl == "ours" else ""
            print(f"| {label} | {peak[label]:.0f} | {impl} | {secs * 1e3:.1f} | {gf:.0f} | {percent_of_peak(gf, peak[label])} | {pr} |")

    print("\n## Optimizer step against its Newton-Schulz FLOP floor\n")
    print("The floor: this step's Newton-Schulz FLOPs at the measured matmul peak.\n")
    variants = [("ours", "")] + ([("ours, compile_updates", " compiled"), ("ours, CUDA graphs", " graphs"),
                                  ("ours, compile_updates + CUDA graphs", " compiled graphs"),
                                  ("ours, all three + ns_method=auto", " compiled graphs auto"),
                                  ("ours, compile_updates + ns_method=auto", " compiled auto"),
                                  ("ours, the same with combo kernels", " compiled combo auto")]
                                 if device.type == "cuda" else [])
    print("| NS dtype | floor ms | " + " | ".join(f"{name} ms | x floor" for name, _ in variants) + " |")
    print("|---|---:|" + "---:|---:|" * len(variants))
    for label in args.dtypes:
        floor = flops / (peak[label] * 1e9)
        cells = " | ".join(f"{t[f'ours {label}{suffix}'] * 1e3:.2f} | {t[f'ours {label}{suffix}'] / floor:.2f}"
                           for _, suffix in variants)
        print(f"| {label} | {floor * 1e3:.2f} | {cells} |")
    print(f"\nTiming rounds kept: {ROUND_STATS['kept']}; thrown away and redone because other "
          f"processes used > {FOREIGN_LIMIT:.0%} of a core meanwhile: {ROUND_STATS['redone']}.")
    with contextlib.suppress(OSError):
        print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
