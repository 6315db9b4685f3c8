"""Standard against Gram Newton-Schulz (optim.muon.ns_method), side by side in one run.

    .venv/bin/python lab/tools/bench/bench_ns_method.py                       # CPU: fp32, per-shape stacks
    python3 lab/tools/bench/bench_ns_method.py --dtype bf16 --stack 0         # on a GPU: whole stacks

For each model (gpt_124m and moe_1b by default), every distinct Muon matrix shape of the real
model (built on the meta device) gets a row: Newton-Schulz of a stack of `--stack` matrices of
that shape (0: as many as the model has), standard and Gram timed in interleaved rounds, the
ratio the median of the per-round ratios. The multiply-add ratio of optim/muon/newton_schulz.py's
cost model stands beside it, and a shape Gram does not pay for (square) runs standard either
way, which shows as a ratio of about 1.

The "auto picks" column is what optim.muon.ns_method=auto chooses for that shape on this
device: the start-up measurement of optim/muon/ns_choice.py (a small stack, a few repeats), with
the speed-up it measured. Compare it with the interleaved speed-up beside it: auto should
never pick the method that loses there by more than noise.

Then the whole Muon optimizer step (momentum, Newton-Schulz, update) on every hidden matrix of
`--step-model` (default gpt_124m) with ns_method standard, gram and auto: the figure a user
sees. auto can become the default where it never loses to the better of the other two.
"""
from __future__ import annotations

import argparse
import collections

import torch

from planning.scale_plan import local_params
from optim.muon import ns_choice
from optim.muon.optimizer import Muon
from optim.muon.newton_schulz import newton_schulz
from optim.muon.ns_method import NSShape, gram_macs, gram_pays, standard_macs
from model.presets import preset_config
from lab.tools.bench.bench_common import ROUND_STATS, interleaved_times, machine_info, paired_ratio

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
STEPS = 5


def muon_shapes(model: str) -> collections.Counter:
    """{(rows, cols): how many such matrices Muon steps} for a conf/model preset."""
    counts: collections.Counter = collections.Counter()
    for p in local_params(preset_config(model, vocab_size=32768), tp=1):
        if p.muon:
            counts.update(p.matrices)
    return counts


def auto_picks(counts: collections.Counter, dtype: torch.dtype, device: torch.device) -> ns_choice.Measured:
    """What ns_method=auto chooses on this device for these shapes, measured as at start-up."""
    timer = ns_choice.device_timer(device, dtype, STEPS, "polar_express", 1e-7, counts)
    return ns_choice.choose(counts, timer)


def shape_rows(model: str, stack: int, dtype: torch.dtype, device: torch.device, warmup: int,
               repeats: int) -> list[str]:
    rows = []
    shapes = muon_shapes(model)
    auto = auto_picks(collections.Counter({NSShape(r, c): n for (r, c), n in shapes.items()}), dtype, device)
    for (r, c), count in sorted(shapes.items()):
        n = count if stack == 0 else min(stack, count)
        G = torch.randn(n, r, c, device=device)
        fns = {m: (lambda m=m: newton_schulz(G, STEPS, "polar_express", dtype, method=m)) for m in ("standard", "gram")}
        times = interleaved_times(fns, warmup, repeats, device)
        small, large = min(r, c), max(r, c)
        predicted = standard_macs(small, large, STEPS) / gram_macs(small, large, STEPS)
        med = {m: sorted(t)[len(t) // 2] for m, t in times.items()}
        rows.append(f"| {model} | {r} x {c} | {count} | {n} | {'gram' if gram_pays(small, large, STEPS) else 'standard'} "
                    f"| {med['standard'] * 1e3:.1f} | {med['gram'] * 1e3:.1f} | "
                    f"**{paired_ratio(times, 'standard', 'gram'):.2f}x** | {predicted:.2f}x "
                    f"| {auto.by_shape[f'{r}x{c}']} ({auto.speedups[f'{r}x{c}']:.2f}x) |")
    return rows


def step_row(model: str, dtype: torch.dtype, device: torch.device, warmup: int, repeats: int) -> str:
    params = [torch.nn.Parameter(torch.randn(n_rows, n_cols, device=device) * 0.02)
              for (n_rows, n_cols), count in sorted(muon_shapes(model).items()) for _ in range(count)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opts = {m: Muon([{"params": params}], lr=1e-3, weight_decay=0.1, ns_dtype=dtype, coefficients="polar_express",
                    ns_method=m) for m in ("standard", "gram", "auto")}
    picked = auto_picks(opts["auto"].ns_shapes(), dtype, device)
    opts["auto"].set_ns_by_shape(picked.by_shape)
    times = interleaved_times({m: opt.step for m, opt in opts.items()}, warmup, repeats, device)
    med = {m: sorted(t)[len(t) // 2] for m, t in times.items()}
    best = min(("standard", "gram"), key=lambda m: med[m])
    digits = 2 if med["standard"] < 0.1 else 0  # GPU steps take milliseconds
    return (f"| {model} | whole Muon step, {len(params)} matrices | {med['standard'] * 1e3:.{digits}f} | "
            f"{med['gram'] * 1e3:.{digits}f} | {med['auto'] * 1e3:.{digits}f} | "
            f"**{paired_ratio(times, 'standard', 'gram'):.2f}x** | {paired_ratio(times, best, 'auto'):.2f}x ({best}) | "
            f"{', '.join(f'{k}: {v}' for k, v in sorted(picked.by_shape.items()))} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["gpt_124m", "moe_1b"])
    ap.add_argument("--step-model", default="gpt_124m", help="'' to skip the whole-step row")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--stack", type=int, default=None, help="matrices per shape; 0: all (default 0 on CUDA, 4 on CPU)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    stack = args.stack if args.stack is not None else (0 if device.type == "cuda" else 4)
    torch.manual_seed(0)
    for key, value in machine_info().items():
        print(f"{key}: {value}")
    print(f"device {device}; Newton-Schulz in {dtype}, 5 Polar Express steps; {args.repeats} interleaved rounds")
    print("\n| model | matrix | in model | timed stack | gram path | standard ms | gram ms | speed-up (standard / gram) "
          "| multiply-add ratio | auto picks (its start-up speed-up) |")
    print("| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- |")
    for model in args.models:
        for row in shape_rows(model, stack, dtype, device, args.warmup, args.repeats):
            print(row, flush=True)
    if args.step_model:
        print("\n| model | what | standard ms | gram ms | auto ms | speed-up (standard / gram) "
              "| auto vs the faster of the two (its time / auto's) | auto's choice |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
        print(step_row(args.step_model, dtype, device, args.warmup, args.repeats), flush=True)
    print(f"\nrounds kept {ROUND_STATS['kept']}, redone for foreign CPU load {ROUND_STATS['redone']}")


if __name__ == "__main__":
    main()
