"""What expert parallelism's dispatch costs by itself: one process, the EP code path on and off.

    python lab/tools/bench/bench_ep_dispatch.py                                # moe_1b, 8 x 2048, bf16, on CUDA
    python lab/tools/bench/bench_ep_dispatch.py --model moe_small --batch 2 --seq-len 256 --precision fp32

With an EP group of one rank (parallel/expert_parallel.py runs on a group of one: its
all-to-alls are copies), every MoE layer still does all an EP rank does: the counts'
exchange, the host sync that reads them, the rows' all-to-all out and back, the regrouping by
local expert. Against the same model with the path off, forward + backward of one batch,
interleaved rounds; the ratio is the dispatch's overhead at world size 1, without any
communication. On CUDA the host sync is part of what it measures.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import replace
from datetime import date

import torch
import torch.distributed as dist

from model.gpt import GPT
from model.moe import moe_layers
from model.presets import preset_config
from lab.tools.bench.bench_common import interleaved_times, machine_info, paired_ratio


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="moe_1b")
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()

    device = torch.device(args.device)
    cfg = replace(preset_config(args.model, args.vocab), max_seq_len=max(args.seq_len, 1))
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{tmp}/store",
                                rank=0, world_size=1)
        try:
            torch.manual_seed(0)
            model = GPT(cfg).to(device)
            layers = [layer for _, layer in moe_layers(model)]
            x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), device=device)
            autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")

            def step(ep_group) -> None:
                for layer in layers:
                    layer.set_ep_group(ep_group)
                with autocast:
                    loss = model(x[:, :-1], x[:, 1:])
                loss.backward()
                model.zero_grad(set_to_none=True)

            times = interleaved_times({"off": lambda: step(None), "on": lambda: step(dist.group.WORLD)},
                                      args.warmup, args.repeats, device)
        finally:
            dist.destroy_process_group()

    print(f"# EP dispatch at world size 1 ({date.today().isoformat()})\n")
    for k, v in machine_info().items():
        print(f"- {k}: {v}")
    print(f"- command: {' '.join(sys.argv)}")
    print(f"\nmodel={args.model} ({len(layers)} MoE layers), batch {args.batch} x {args.seq_len}, {args.precision} on "
          f"{device.type}; forward + backward, medians of {args.repeats} interleaved rounds.\n")
    print("| EP path | ms | ratio |")
    print("| --- | ---: | ---: |")
    ratio = paired_ratio(times, "on", "off")
    for name in ("off", "on"):
        median = sorted(times[name])[len(times[name]) // 2]
        print(f"| {name} | {1e3 * median:.1f} | {ratio if name == 'on' else 1.0:.3f} |")


if __name__ == "__main__":
    main()
