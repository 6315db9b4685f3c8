"""Memory and time of one training step (forward + backward) under each
trainer.activation_checkpointing mode, side by side in one process.

    python lab/tools/bench/bench_activation_memory.py                      # gpt_small, 4 x 256, fp32, CPU
    python lab/tools/bench/bench_activation_memory.py --model gpt_124m --batch 8 --seq-len 1024 \\
        --precision bf16 --compile                                  # on CUDA

Each mode trains its own copy of the model (same seed) on the same batch.

- kept: bytes still allocated when the forward returns, above what was allocated before the
  step: what the forward keeps for the backward (the loss's graph).
- peak: the most allocated at any moment of forward + backward, above the same baseline
  (gradients included: they are freed before every step, so every mode allocates them).

On CUDA both come from the caching allocator (memory_allocated, max_memory_allocated; the
peak reserved is shown too). On the CPU there is no such counter: the step runs once under
torch.profiler with profile_memory=True, whose allocation and free events, summed in time
order, give the same two figures. Step times are medians of interleaved rounds without the
profiler (lab/tools/bench/bench_common.py); the ratios are to `none`, measured in the same run.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from dataclasses import dataclass, replace
from datetime import date
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from model.activation_checkpoint import apply_activation_checkpointing
from model.config import CHECKPOINTING_MODES
from model.gpt import GPT
from model.presets import preset_config
from lab.tools.bench.bench_common import interleaved_times, machine_info, paired_ratio

FORWARD_MARK = "bench/forward"
MIB = 2**20


@dataclass
class StepMemory:
    kept: int  # bytes allocated when the forward returns, above the step's start
    peak: int  # most bytes allocated during forward + backward, above the step's start
    reserved: int = 0  # CUDA: the caching allocator's peak reservation (the whole process's)


def build(cfg, mode: str, device: torch.device, compiled: bool) -> GPT:
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    apply_activation_checkpointing(model, mode)
    if compiled:  # block by block, as the trainer compiles a checkpointed model
        for block in model.blocks:
            block.compile()
    return model


def step_fn(model: GPT, x: torch.Tensor, autocast: Callable) -> Callable[[], None]:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        with autocast(), record_function(FORWARD_MARK):
            loss = model(x[:, :-1], x[:, 1:])
        loss.backward()

    return step


def cuda_memory(model: GPT, x: torch.Tensor, autocast: Callable) -> StepMemory:
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # so that the reserved peak is this step's, not an earlier mode's cache
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with autocast():
        loss = model(x[:, :-1], x[:, 1:])
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - base
    loss.backward()
    torch.cuda.synchronize()
    return StepMemory(kept, torch.cuda.max_memory_allocated() - base, torch.cuda.max_memory_reserved())


def cpu_memory(step: Callable[[], None]) -> StepMemory:
    """From the profiler's CPU allocation events (+bytes allocated, -bytes freed), in time order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = prof.profiler.kineto_results.events()
    forward_end = max(e.end_ns() for e in events if e.name() == FORWARD_MARK)
    memory = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    total = peak = kept = 0
    for event in memory:
        total += event.nbytes()
        peak = max(peak, total)
        if event.start_ns() <= forward_end:
            kept = total
    return StepMemory(kept, peak)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt_small")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compile", action="store_true", help="compile block by block, as the trainer does")
    ap.add_argument("--modes", nargs="+", default=list(CHECKPOINTING_MODES), choices=CHECKPOINTING_MODES)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if "none" not in args.modes:
        ap.error("--modes must include none: the ratios are to it")

    device = torch.device(args.device)
    cfg = replace(preset_config(args.model, args.vocab), max_seq_len=max(args.seq_len, 1))
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), generator=gen).to(device)

    def autocast():
        if args.precision == "bf16":
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    models = {mode: build(cfg, mode, device, args.compile) for mode in args.modes}
    steps = {mode: step_fn(model, x, autocast) for mode, model in models.items()}
    for step in steps.values():  # compile, and the allocator's first growth, before any measurement
        step()
    if device.type == "cuda":
        memory = {mode: cuda_memory(models[mode], x, autocast) for mode in args.modes}
    else:
        memory = {mode: cpu_memory(steps[mode]) for mode in args.modes}
    times = interleaved_times(steps, args.warmup, args.repeats, device)

    print(f"# Activation checkpointing: memory and time of one step ({date.today().isoformat()})\n")
    for key, value in machine_info().items():
        print(f"- {key}: {value}")
    print(f"- command: {' '.join(sys.argv)}")
    params = sum(p.numel() for p in models["none"].parameters())
    print(f"\nmodel={args.model} ({params / 1e6:.1f}M parameters), batch {args.batch} x {args.seq_len}, "
          f"{args.precision} on {device.type}{', compiled per block' if args.compile else ''}; forward + backward; "
          f"time: medians of {args.repeats} interleaved rounds; memory: "
          f"{'torch.cuda allocator' if device.type == 'cuda' else 'profiler allocation events'}.\n")
    reserved = device.type == "cuda"
    print("| mode | step ms | time vs none | kept MiB | kept vs none | peak MiB | peak vs none |"
          + (" peak reserved MiB |" if reserved else ""))
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if reserved else ""))
    base = memory["none"]
    for mode in args.modes:
        m = memory[mode]
        ratio = paired_ratio(times, mode, "none") if mode != "none" else 1.0
        row = (f"| {mode} | {1e3 * statistics.median(times[mode]):.1f} | {ratio:.2f}x | {m.kept / MIB:.1f} | "
               f"{m.kept / base.kept:.2f}x | {m.peak / MIB:.1f} | {m.peak / base.peak:.2f}x |")
        print(row + (f" {m.reserved / MIB:.0f} |" if reserved else ""))


if __name__ == "__main__":
    main()
