"""Training throughput and MFU of our trainer against a plain-PyTorch reference, side by side.

    python lab/tools/bench/bench_train.py                     # gpt_small, moe_small; eager, compiled; fp32, bf16
    python lab/tools/bench/bench_train.py --models gpt_small --modes eager --precisions fp32 --rounds 5
    python lab/tools/bench/bench_train.py --batch-size 8 --seq-len 512 --optims adamw muon
    python lab/tools/bench/bench_train.py --census ...        # + ops/kernels, host syncs, GPU busy, memory
    python lab/tools/bench/bench_train.py --batch-size 16 --seq-len 1024 --tokens-per-step 16384 524288
    make bench-gpu                                    # the GPU benchmark: gpt_124m and moe_1b
    python lab/tools/bench/bench_train.py --models gpt_1b --precisions bf16 --fp8 none tensorwise \
        --batch-size plan --seq-len 4096 --one-at-a-time --no-reference --modes compiled

Every configuration runs the real Trainer's train step (forward, backward, clip, optimizer;
no logging statistics) on the embedded corpus. Beside each dense model runs
lab/tools/bench/reference_gpt.py's minimal model of the same shape, with the same batch, sequence
length, precision and mode (eager or torch.compile), so `ours / reference` shows what the
trainer costs on top of the bare model. Ours uses optim=adamw by default, as the reference
does, so the ratio compares like with like; `--optims adamw muon` adds our Muon step beside it
(its ratio then includes Muon's extra work).

--tokens-per-step sets the tokens of one optimizer step, reached by gradient accumulation:
grad_accum = tokens / (batch size x sequence length) micro-batches, in ours
(trainer.grad_accum) and in the reference alike; a target that is not a whole number of
micro-batches is refused. Several targets run side by side in one run. tokens/s counts every
micro-batch. With both optimizers, a last table sets the measured Muon / AdamW tokens/s
against the FLOP count's prediction: Newton-Schulz's FLOPs are fixed per optimizer step, the
model's grow with its tokens, so accumulation amortises Muon's extra work.

--census profiles 3 more steps of each configuration (eval/step_census.py) and adds: top-level
aten ops per step (CPU) or device kernels per step (CUDA), host syncs per step, the fraction
of the step the GPU was busy, and peak memory (parameters and optimizer state, plus the most
one step allocated on top of them).

--fp8 RECIPE... runs ours with trainer.fp8=<recipe> too (none, rowwise, tensorwise: torchao's
float8 matmuls in the blocks' linears, model/fp8.py); its rows read `bf16+fp8 <recipe>` in the
precision column, and their MFU divides by the same bf16 peak, so an FP8 row's MFU over its
bf16 row's is its speed-up. The reference has no FP8: ours / reference of an FP8 row is
against the bf16 reference.

--batch-size plan takes the micro-batch the planner picks for one GPU: the largest whose
planned peak (planning/memory_plan.planned_memory, the rule of scripts/plan/plan_scale.py) fits in the
memory of the GPU's conf/hardware profile (--hardware, by default the one named after the CUDA
device) or in --memory-gb, for every optimizer and precision of the run.

--one-at-a-time builds, warms up, times and measures each configuration alone and frees it
before the next: for models two of which do not fit in memory at once (gpt_1b at the planned
batch). Its rounds are then not interleaved with the other configurations'. It adds a `peak
GiB` column (without --census): the most memory allocated during the timed steps, the
parameters and optimizer state included.

--losses adds a table of each of our configurations' losses once timed: the steps it trained
(warm-up, rounds and census steps alike), the last step's train loss and the val losses of
Trainer.evaluate(). Every configuration starts from the same seed and sees the same batches,
so at equal steps two rows differ only by their arithmetic (FP8 against bf16); pass
trainer.max_steps=<steps> to give the lr schedule that length.

How each configuration is built, warmed up, timed and measured: lab/tools/bench/bench_train_runs.py.

MFU = tokens/s x model FLOPs per token (eval/flops.py) / the matmul peak of this machine,
measured in this run: F.linear on square operands in the same precision, before and after
the training rounds (the higher of the two counts). All configurations are interleaved
round by round (drifting machine load hits them alike; not under --one-at-a-time) and
reported as medians; the CPU
time other processes used meanwhile is reported too.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from datetime import date
from pathlib import Path
from typing import Optional

import torch

from planning.scale_plan import Hardware
from eval.step_census import fmt
from lab.tools.bench.bench_common import (
    hardware_for_device, linear_peak, machine_info, peak_size, percent_of_peak, planned_batch,
)
from lab.tools.bench.bench_train_runs import (
    Contender, compose_config, plan_contenders, run_interleaved, run_one_at_a_time,
)
from scripts.refuse import refuse
from trainer.config import register_configs

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def grad_accum_for(tokens_per_step: int, batch_size: int, seq_len: int) -> int:
    """Micro-batches of batch_size x seq_len tokens that make one optimizer step of
    tokens_per_step tokens; ValueError (one line, naming the flag) unless that is a whole number."""
    micro = batch_size * seq_len
    if tokens_per_step < micro or tokens_per_step % micro:
        raise ValueError(
            f"--tokens-per-step {tokens_per_step} is not a whole number of micro-batches of "
            f"--batch-size {batch_size} x --seq-len {seq_len} = {micro} tokens"
        )
    return tokens_per_step // micro


def plan_batch_size(args: argparse.Namespace) -> str:
    """--batch-size plan: set args.batch_size to the planner's micro-batch for one GPU (one for
    every model, optimizer and precision of the run: the smallest of theirs); the line that
    says so. Refuses (exit 2) where no profile or memory is known, or not one sequence fits."""
    try:
        if args.memory_gb:
            memory_gb, source = args.memory_gb, "--memory-gb"
        else:
            hardware = args.hardware or hardware_for_device(
                torch.cuda.get_device_name() if args.device == "cuda" else args.device)
            memory_gb, source = Hardware.load(hardware).hbm_gb, f"conf/hardware/{hardware}.yaml"
    except (ValueError, FileNotFoundError) as err:
        refuse(f"--batch-size plan: {err}")
    optims = sorted({compose_config([f"optim={o}", *args.overrides]).optim.name for o in args.optims})
    picks = []
    for model in args.models:
        base = compose_config([f"model={model}", f"trainer.seq_len={args.seq_len}", *args.overrides])
        for precision in args.precisions:
            try:
                batch, peaks = planned_batch(replace(base.model, vocab_size=base.data.vocab_size), optims, args.seq_len,
                                             memory_gb * 1e9, base.trainer.activation_checkpointing,
                                             base.model.loss_chunks, precision)
            except ValueError as err:  # an optimizer or precision the planner has no formula for
                refuse(f"--batch-size plan: {err}")
            picks.append((batch, model, precision, peaks))
    batch, model, precision, peaks = min(picks, key=lambda p: p[0])
    if batch == 0:
        refuse(f"--batch-size plan: not one sequence of {args.seq_len} tokens of {model} fits in {memory_gb:g} GB "
               f"(planned peak {max(peaks.values()) / 1e9:.1f} GB)")
    args.batch_size = batch
    return (f"Micro-batch from the planner: {batch} x {args.seq_len} tokens, the largest whose planned peak on one "
            f"GPU (planning/memory_plan.planned_memory) fits in {memory_gb:g} GB ({source}) "
            f"for {model} {precision}: planned peak " + ", ".join(f"{o} {v / 1e9:.1f} GB" for o, v in peaks.items())
            + ".")


def measure_peaks(precisions: list[str], args: argparse.Namespace) -> dict[str, float]:
    """GFLOP/s per precision (medians of load-filtered interleaved calls)."""
    return {p: linear_peak(DTYPES[p], torch.device(args.device), args.peak_size, 2, args.peak_repeats)
            for p in precisions}


def print_muon_vs_adamw(contenders: list[Contender], rate: dict[tuple, float]) -> None:
    """Measured Muon / AdamW tokens/s beside the FLOP count's prediction, per row pair of ours.

    Muon's Newton-Schulz FLOPs are fixed per optimizer step and the model's grow with the
    step's tokens; if Newton-Schulz ran at the training step's own FLOP rate, Muon's tokens/s
    would be AdamW's times model / (model + Newton-Schulz). The optimizers' elementwise work
    (AdamW's moments, Muon's momentum) is left out: small beside either, and fixed per step too."""
    rows = []
    for c in contenders:
        if c.impl != "ours" or c.optim != "muon" or c.key not in rate:
            continue
        adamw = rate.get((c.model, "ours", "adamw", c.mode, c.arithmetic, c.grad_accum))
        if adamw is None:
            continue
        model_flops = c.flops_per_token * c.tokens_per_step
        share = c.ns_flops / model_flops
        rows.append(f"| {c.model} | {c.mode} | {c.arithmetic} | {c.tokens_per_step} | {c.grad_accum} "
                    f"| {c.ns_flops / 1e9:.1f} | {model_flops / 1e9:.1f} | {100 * share:.1f}% "
                    f"| {1 / (1 + share):.3f} | {rate[c.key] / adamw:.3f} |")
    if rows:
        print("\nMuon / AdamW tokens/s (ours), measured against the FLOP count's prediction "
              "(model / (model + Newton-Schulz) FLOPs per optimizer step):\n")
        print("| model | mode | precision | tokens/step | micro-batches | Newton-Schulz GFLOP/step "
              "| model GFLOP/step | NS / model | predicted | measured |")
        print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        print("\n".join(rows))


def batch_size_arg(text: str) -> int:
    """--batch-size: a positive number of sequences, or `plan` (0 until main() asks the planner)."""
    if text == "plan":
        return 0
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a positive number of sequences nor plan")
    return int(text)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The command line, with --tokens-per-step turned into args.grad_accums (one per target).
    A target that is not a whole number of micro-batches exits here, before any work."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["gpt_small", "moe_small"])
    ap.add_argument("--modes", nargs="+", choices=("eager", "compiled"), default=["eager", "compiled"])
    ap.add_argument("--precisions", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"])
    ap.add_argument("--batch-size", type=batch_size_arg, default=2,
                    help="sequences per micro-batch, or `plan`: the planner's for one GPU (--hardware, --memory-gb)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--tokens-per-step", type=int, nargs="+", default=None,
                    help="tokens per optimizer step, reached by gradient accumulation over micro-batches "
                         "of --batch-size x --seq-len; several run side by side (default: one micro-batch)")
    ap.add_argument("--optims", nargs="+", default=["adamw"],
                    help="our trainer's optimizers (the reference's is AdamW)")
    ap.add_argument("--fp8", nargs="+", default=["none"],
                    help="trainer.fp8 recipes of ours (none, rowwise, tensorwise); each runs beside the others")
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="build, time and free each configuration alone (models two of which do not fit at once)")
    ap.add_argument("--losses", action="store_true",
                    help="also print each of our configurations' steps trained, last train loss and val losses")
    ap.add_argument("--hardware", default=None,
                    help="conf/hardware profile for --batch-size plan (default: the one named after the CUDA device)")
    ap.add_argument("--memory-gb", type=float, default=0.0,
                    help="GPU memory for --batch-size plan (default: the hardware profile's hbm_gb)")
    ap.add_argument("--census", action="store_true",
                    help="also count ops/kernels, host syncs, GPU busy time and peak memory per step")
    ap.add_argument("--no-reference", action="store_true", help="skip the plain-PyTorch reference")
    ap.add_argument("--warmup", type=int, default=2, help="untimed interleaved rounds (compilation)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds")
    ap.add_argument("--steps", type=int, default=1, help="timed steps per configuration per round")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--peak-size", type=int, default=None,
                    help="side of the square peak matmul (default: 8192 on CUDA, 1024 on CPU)")
    ap.add_argument("--peak-repeats", type=int, default=5)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for our trainer")
    args = ap.parse_args(argv)
    if args.batch_size == 0:  # plan: main() asks the planner once the configs can be composed
        if args.tokens_per_step:
            refuse("--tokens-per-step needs a --batch-size in sequences, not plan")
        args.grad_accums = [1]
        return args
    try:
        args.grad_accums = sorted({grad_accum_for(t, args.batch_size, args.seq_len)
                                   for t in args.tokens_per_step or [args.batch_size * args.seq_len]})
    except ValueError as err:
        refuse(str(err))
    if any(o.split("=", 1)[0].lstrip("+") == "trainer.grad_accum" for o in args.overrides):
        refuse("set the accumulation with --tokens-per-step, not trainer.grad_accum")
    return args


def extra_cells(c: Contender, args: argparse.Namespace) -> str:
    """The census columns (--census), or --one-at-a-time's peak GiB, of one row."""
    if args.census:
        if c.census is None:
            return " | | | |"
        n = c.census
        work_count = n.kernels if args.device == "cuda" else n.aten_ops
        busy = f"{100 * n.busy_fraction:.0f}%" if n.busy_fraction is not None else "-"
        peak = None if n.transient_peak_bytes is None else (c.resident() + n.transient_peak_bytes) / 2**30
        return f" {fmt(work_count)} | {fmt(n.host_syncs, '.1f')} | {busy} | {fmt(peak, '.2f')} |"
    if args.one_at_a_time:
        return f" {fmt(None if c.peak_bytes is None else c.peak_bytes / 2**30, '.2f')} |"
    return ""


def print_table(contenders: list[Contender], args: argparse.Namespace, peaks: dict[str, float]) -> dict[tuple, float]:
    """The result table; tokens/s by configuration key."""
    work = "kernels/step" if args.device == "cuda" else "aten ops/step"
    extra_head = ([work, "host syncs/step", "GPU busy", "peak GiB"] if args.census
                  else ["peak GiB"] if args.one_at_a_time else [])
    print("\n| model | impl | optim | mode | precision | tokens/step | step s | tokens/s | model GFLOP/s | MFU "
          f"| ours / reference |{''.join(f' {h} |' for h in extra_head)} notes |")
    print("| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
          + " ---: |" * len(extra_head) + " --- |")
    rate = {c.key: c.tokens_per_step / statistics.median(c.times) for c in contenders if c.times}
    refused = False
    for c in contenders:
        cells = [c.model, c.impl, c.optim, c.mode, c.arithmetic]
        if c.key not in rate:
            if c.error != "-":
                print("| " + " | ".join(cells) + f" | {c.tokens_per_step} | | | | | |" + " |" * len(extra_head)
                      + f" {c.error} |")
            continue
        tps = rate[c.key]
        gflops = tps * c.flops_per_token / 1e9
        ref = rate.get((c.model, "reference", "adamw", c.mode, c.precision, c.grad_accum))
        ratio = f"{tps / ref:.2f}" if c.impl == "ours" and ref else ""
        print("| " + " | ".join(cells) + f" | {c.tokens_per_step} | {statistics.median(c.times):.3f} "
              f"| {tps:,.0f} | {gflops:.1f} | {percent_of_peak(gflops, peaks[c.precision])} | {ratio} |"
              f"{extra_cells(c, args)} {c.notes} |")
        refused |= gflops > peaks[c.precision]
    if refused:
        print(f"\nMFU above 100% is not printed: training outran the measured peak, so the peak is "
              f"wrong (too small a matmul for this device?); re-run with a larger --peak-size than {args.peak_size}.")
    return rate


def print_losses(contenders: list[Contender]) -> None:
    """--losses: each of our configurations' steps trained, last train loss and val losses."""
    rows = [c for c in contenders if c.losses]
    if not rows:
        return
    names = list(dict.fromkeys(k for c in rows for k in c.losses))
    print("\nLosses once timed (the same seed and batches for every row):\n")
    print("| model | optim | mode | precision | tokens/step | " + " | ".join(names) + " |")
    print("| --- | --- | --- | --- | ---: |" + " ---: |" * len(names))
    for c in rows:
        cells = [f"{c.losses[k]:.0f}" if k == "steps trained" else f"{c.losses[k]:.4f}" if k in c.losses else ""
                 for k in names]
        print(f"| {c.model} | {c.optim} | {c.mode} | {c.arithmetic} | {c.tokens_per_step} | " + " | ".join(cells) + " |")


def main() -> None:
    args = parse_args()
    args.peak_size = args.peak_size or peak_size(torch.device(args.device))
    register_configs()
    started = time.perf_counter()

    print(f"# Training throughput and MFU ({date.today().isoformat()})\n")
    for k, v in machine_info().items():
        print(f"- {k}: {v}")
    print(f"- command: {' '.join(sys.argv)}")
    if args.batch_size == 0:
        print("\n" + plan_batch_size(args))
    peaks_before = measure_peaks(args.precisions, args)

    contenders = plan_contenders(args)
    with tempfile.TemporaryDirectory() as tmp:
        run = run_one_at_a_time if args.one_at_a_time else run_interleaved
        foreign = run(contenders, args, Path(tmp))
    peaks_after = measure_peaks(args.precisions, args)
    peaks = {p: max(peaks_before[p], peaks_after[p]) for p in args.precisions}

    per_step = ", ".join(f"{a * args.batch_size * args.seq_len} ({a} micro-batch{'es' if a > 1 else ''})"
                         for a in args.grad_accums)
    rounds = "rounds, each configuration alone," if args.one_at_a_time else "interleaved rounds"
    print(f"\nMicro-batch {args.batch_size} x {args.seq_len} tokens; tokens per optimizer step: {per_step}; "
          f"ours: optim={'/'.join(args.optims)}"
          f"{'; fp8=' + '/'.join(args.fp8) if args.fp8 != ['none'] else ''}"
          f"{' ' + ' '.join(args.overrides) if args.overrides else ''}; reference: AdamW, the same micro-batches. "
          f"{args.warmup} warm-up + {args.rounds} {rounds} x {args.steps} optimizer step(s), median.\n")
    print(f"| precision | F.linear {args.peak_size}^2 GFLOP/s, before | after | peak used |")
    print("| --- | ---: | ---: | ---: |")
    for p in args.precisions:
        print(f"| {p} | {peaks_before[p]:.1f} | {peaks_after[p]:.1f} | {peaks[p]:.1f} |")

    rate = print_table(contenders, args, peaks)
    print_muon_vs_adamw(contenders, rate)
    print_losses(contenders)
    per_model = {c.model: c.flops_per_token for c in contenders if c.impl == "ours" and c.flops_per_token}
    if per_model:
        print("\nModel FLOPs per trained token (eval/flops.py: 6 x active matmul weights + causal "
              f"attention, seq_len {args.seq_len}): "
              + ", ".join(f"{m} {f / 1e6:.1f} M" for m, f in per_model.items()) + ".")
    if foreign:
        print(f"Other processes' CPU use during the timed rounds: {statistics.mean(foreign):.2f} cores "
              f"on average (max {max(foreign):.2f}); this process runs {torch.get_num_threads()} torch threads.")
    print(f"Wall time: {time.perf_counter() - started:.0f} s.")


if __name__ == "__main__":
    main()
