"""Training throughput and MFU of our trainer against a plain-PyTorch reference, side by side.

    python scripts/bench_train.py                     # gpt_small, moe_small; eager, compiled; fp32, bf16
    python scripts/bench_train.py --models gpt_small --modes eager --precisions fp32 --rounds 5
    python scripts/bench_train.py --batch-size 8 --seq-len 512 --optims adamw muon
    python scripts/bench_train.py --census ...        # + ops/kernels, host syncs, GPU busy, memory
    python scripts/bench_train.py --batch-size 16 --seq-len 1024 --tokens-per-step 16384 524288
    make bench-gpu                                    # the GPU benchmark: gpt_124m and moe_1b

Every configuration runs the real Trainer's train step (forward, backward, clip, optimizer;
no logging statistics) on the embedded corpus. Beside each dense model runs
scripts/reference_gpt.py's minimal model of the same shape, with the same batch, sequence
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

MFU = tokens/s x model FLOPs per token (eval/flops.py) / the matmul peak of this machine,
measured in this run: F.linear on square operands in the same precision, before and after
the training rounds (the higher of the two counts). All configurations are interleaved
round by round (drifting machine load hits them alike) and reported as medians; the CPU
time other processes used meanwhile is reported too.
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Callable, Optional

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hydra import compose, initialize_config_dir  # noqa: E402

from eval.flops import train_flops_per_token  # noqa: E402
from eval.step_census import StepCensus, census, fmt  # noqa: E402
from scripts.bench_common import (  # noqa: E402
    cpu_snapshot, foreign_cores, linear_peak, machine_info, newton_schulz_flops, peak_size, percent_of_peak,
    tensor_bytes,
)
from scripts.reference_gpt import ReferenceConfig, ReferenceTrainer  # noqa: E402
from scripts.refuse import refuse  # noqa: E402
from trainer.config import register_configs, to_dataclass, validate  # noqa: E402
from trainer.loop import Trainer  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class Contender:
    model: str
    impl: str  # "ours" or "reference"
    mode: str  # "eager" or "compiled"
    precision: str
    optim: str  # ours: the optim config; the reference: always AdamW
    grad_accum: int = 1  # micro-batches per optimizer step
    tokens_per_step: int = 0
    flops_per_token: int = 0
    ns_flops: int = 0  # Newton-Schulz FLOPs per optimizer step (ours with Muon)
    step: Optional[Callable[[], object]] = None
    resident: Optional[Callable[[], int]] = None  # bytes of parameters + optimizer state
    error: str = ""
    notes: str = ""
    times: list[float] = field(default_factory=list)
    census: Optional[StepCensus] = None

    @property
    def key(self) -> tuple[str, str, str, str, str, int]:
        return self.model, self.impl, self.optim, self.mode, self.precision, self.grad_accum

    @property
    def label(self) -> str:
        return " ".join(map(str, self.key[:-1])) + (f" x{self.grad_accum}" if self.grad_accum > 1 else "")


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


def one_line(err: BaseException) -> str:
    """The error's first line, plus the underlying error torch.compile reports inside its
    message ("... got RuntimeError('...')"), which is the part that says what failed."""
    lines = str(err).strip().splitlines()
    text = f"{type(err).__name__}: {lines[0][:160] if lines else ''}"
    inner = re.search(r"got (\w+(?:Error|Exception)\(.{0,200}?\))", str(err))
    if inner:
        text += f" ({inner.group(1)})"
    return text.replace("|", "/")  # it goes into a Markdown table cell


def graph_breaks() -> int:
    """torch.compile graph breaks so far in this process (every compiled model's)."""
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def build_ours(c: Contender, args: argparse.Namespace, run_dir: Path) -> Trainer:
    overrides = [
        f"model={c.model}", f"trainer.precision={c.precision}",
        f"trainer.compile={str(c.mode == 'compiled').lower()}",
        f"trainer.batch_size={args.batch_size}", f"trainer.seq_len={args.seq_len}",
        f"trainer.grad_accum={c.grad_accum}",
        # The peak is measured by this script; a positive value spares each Trainer its own.
        "trainer.peak_tflops=1", "trainer.max_steps=100000", f"trainer.device={args.device}",
        "logger.wandb.mode=disabled", f"optim={c.optim}", *args.overrides,
    ]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = to_dataclass(compose("config", overrides))
    validate(cfg)
    return Trainer(cfg, run_dir)


def build_reference(ours: Trainer, c: Contender, args: argparse.Namespace) -> ReferenceTrainer:
    m = ours.model_cfg
    shape = ReferenceConfig(
        vocab_size=m.vocab_size, n_layers=m.n_layers, d_model=m.d_model, n_heads=m.n_heads,
        n_kv_heads=m.n_kv_heads, ffn_hidden=m.ffn_hidden, max_seq_len=m.max_seq_len,
        rope_theta=m.rope_theta, norm_eps=m.norm_eps,
    )
    ref = ReferenceTrainer(shape, args.batch_size, args.seq_len, c.precision,
                           compile=c.mode == "compiled", device=args.device, grad_accum=c.grad_accum)
    n_ours, n_ref = ours.model.num_params(), sum(p.numel() for p in ref.model.parameters())
    if n_ours != n_ref:
        raise RuntimeError(f"reference has {n_ref} parameters, ours {n_ours}: not the same shape")
    return ref


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
        adamw = rate.get((c.model, "ours", "adamw", c.mode, c.precision, c.grad_accum))
        if adamw is None:
            continue
        model_flops = c.flops_per_token * c.tokens_per_step
        share = c.ns_flops / model_flops
        rows.append(f"| {c.model} | {c.mode} | {c.precision} | {c.tokens_per_step} | {c.grad_accum} "
                    f"| {c.ns_flops / 1e9:.1f} | {model_flops / 1e9:.1f} | {100 * share:.1f}% "
                    f"| {1 / (1 + share):.3f} | {rate[c.key] / adamw:.3f} |")
    if rows:
        print("\nMuon / AdamW tokens/s (ours), measured against the FLOP count's prediction "
              "(model / (model + Newton-Schulz) FLOPs per optimizer step):\n")
        print("| model | mode | precision | tokens/step | micro-batches | Newton-Schulz GFLOP/step "
              "| model GFLOP/step | NS / model | predicted | measured |")
        print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        print("\n".join(rows))


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The command line, with --tokens-per-step turned into args.grad_accums (one per target).
    A target that is not a whole number of micro-batches exits here, before any work."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["gpt_small", "moe_small"])
    ap.add_argument("--modes", nargs="+", choices=("eager", "compiled"), default=["eager", "compiled"])
    ap.add_argument("--precisions", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"])
    ap.add_argument("--batch-size", type=int, default=2, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--tokens-per-step", type=int, nargs="+", default=None,
                    help="tokens per optimizer step, reached by gradient accumulation over micro-batches "
                         "of --batch-size x --seq-len; several run side by side (default: one micro-batch)")
    ap.add_argument("--optims", nargs="+", default=["adamw"],
                    help="our trainer's optimizers (the reference's is AdamW)")
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
    try:
        args.grad_accums = sorted({grad_accum_for(t, args.batch_size, args.seq_len)
                                   for t in args.tokens_per_step or [args.batch_size * args.seq_len]})
    except ValueError as err:
        refuse(str(err))
    if any(o.split("=", 1)[0].lstrip("+") == "trainer.grad_accum" for o in args.overrides):
        refuse("set the accumulation with --tokens-per-step, not trainer.grad_accum")
    return args


def main() -> None:
    args = parse_args()
    args.peak_size = args.peak_size or peak_size(torch.device(args.device))
    register_configs()
    started = time.perf_counter()

    print(f"# Training throughput and MFU ({date.today().isoformat()})\n")
    for k, v in machine_info().items():
        print(f"- {k}: {v}")
    print(f"- command: {' '.join(sys.argv)}")
    peaks_before = measure_peaks(args.precisions, args)

    contenders: list[Contender] = []
    for model in args.models:
        for mode in args.modes:
            for precision in args.precisions:
                for accum in args.grad_accums:
                    tokens = accum * args.batch_size * args.seq_len
                    contenders.extend(Contender(model, "ours", mode, precision, optim, accum, tokens)
                                      for optim in args.optims)
                    contenders.append(Contender(model, "reference", mode, precision, "adamw", accum, tokens))

    with tempfile.TemporaryDirectory() as tmp:
        built: dict[tuple[str, str, str, int], Trainer] = {}
        for c in contenders:
            try:
                if c.impl == "ours":
                    trainer = build_ours(c, args, Path(tmp) / "_".join(map(str, c.key)))
                    built[c.model, c.mode, c.precision, c.grad_accum] = trainer
                    c.step = lambda t=trainer: t.train_step(measure=False)
                    c.resident = lambda t=trainer: tensor_bytes(t.model.parameters()) + t.optimizer.state_bytes()
                    c.tokens_per_step = trainer.tokens_per_step
                    c.flops_per_token = trainer.flops_per_token
                    if trainer.cfg.optim.name == "muon":
                        c.ns_flops = newton_schulz_flops(trainer.model, trainer.cfg.optim.muon)
                else:
                    ours = built.get((c.model, c.mode, c.precision, c.grad_accum))
                    if ours is None or args.no_reference or ours.model_cfg.n_experts > 0:
                        c.error = "-"  # the reference is a dense model only
                        continue
                    ref = build_reference(ours, c, args)
                    c.step = ref.step
                    c.resident = lambda r=ref: tensor_bytes(r.model.parameters()) + tensor_bytes(
                        v for state in r.opt.state.values() for v in state.values() if torch.is_tensor(v)
                    )
                    c.tokens_per_step = ref.tokens_per_step
                    c.flops_per_token = train_flops_per_token(ours.model_cfg, args.seq_len)
            except Exception as err:  # report it in the table; the other rows still run
                c.error = one_line(err)
        live = [c for c in contenders if c.step is not None and not c.error]

        # Warm-up: compilation, first-touch allocations, kernel choice. Interleaved like the
        # timed rounds, because compiled models of one class share torch.compile's code
        # cache: compiling one can make another recompile at its next call.
        breaks = {c.key: 0 for c in live}
        for w in range(args.warmup):
            for c in live:
                if c.step is None:
                    continue
                t0, before = time.perf_counter(), graph_breaks()
                try:
                    c.step()
                except Exception as err:
                    c.error = ("compile failed: " if c.mode == "compiled" else "") + one_line(err)
                    c.step = None
                breaks[c.key] += graph_breaks() - before
                print(f"  warm-up {w + 1}/{args.warmup} {c.label}: {time.perf_counter() - t0:.1f} s",
                      file=sys.stderr, flush=True)
        live = [c for c in live if c.step is not None]
        for c in live:
            if breaks[c.key]:
                c.notes = f"{breaks[c.key]} graph break(s) while compiling"

        foreign: list[float] = []
        for r in range(args.rounds):
            before, t_round = cpu_snapshot(), time.perf_counter()
            for c in live:
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    c.step()
                if args.device == "cuda":
                    torch.cuda.synchronize()
                c.times.append((time.perf_counter() - t0) / args.steps)
            t_round = time.perf_counter() - t_round
            load = foreign_cores(before, cpu_snapshot(), t_round)
            if load is not None:
                foreign.append(load)
            print(f"  round {r + 1}/{args.rounds}: {t_round:.1f} s", file=sys.stderr, flush=True)
        if args.census:
            for c in live:
                try:
                    c.census = census(c.step, torch.device(args.device))
                except Exception as err:  # the table still prints; this row says why it has no census
                    c.notes = (c.notes + "; " if c.notes else "") + "census failed: " + one_line(err)
    peaks_after = measure_peaks(args.precisions, args)
    peaks = {p: max(peaks_before[p], peaks_after[p]) for p in args.precisions}

    per_step = ", ".join(f"{a * args.batch_size * args.seq_len} ({a} micro-batch{'es' if a > 1 else ''})"
                         for a in args.grad_accums)
    print(f"\nMicro-batch {args.batch_size} x {args.seq_len} tokens; tokens per optimizer step: {per_step}; "
          f"ours: optim={'/'.join(args.optims)}"
          f"{' ' + ' '.join(args.overrides) if args.overrides else ''}; reference: AdamW, the same micro-batches. "
          f"{args.warmup} warm-up + {args.rounds} interleaved rounds x {args.steps} optimizer step(s), median.\n")
    print(f"| precision | F.linear {args.peak_size}^2 GFLOP/s, before | after | peak used |")
    print("| --- | ---: | ---: | ---: |")
    for p in args.precisions:
        print(f"| {p} | {peaks_before[p]:.1f} | {peaks_after[p]:.1f} | {peaks[p]:.1f} |")

    work = "kernels/step" if args.device == "cuda" else "aten ops/step"
    census_head = f" {work} | host syncs/step | GPU busy | peak GiB |" if args.census else ""
    print("\n| model | impl | optim | mode | precision | tokens/step | step s | tokens/s | model GFLOP/s | MFU "
          f"| ours / reference |{census_head} notes |")
    print("| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
          + (" ---: | ---: | ---: | ---: |" if args.census else "") + " --- |")
    rate: dict[tuple[str, str, str, str, str, int], float] = {}
    refused = False
    for c in contenders:
        if c.times:
            rate[c.key] = c.tokens_per_step / statistics.median(c.times)
    for c in contenders:
        cells = [c.model, c.impl, c.optim, c.mode, c.precision]
        if c.key not in rate:
            if c.error != "-":
                print("| " + " | ".join(cells) + f" | {c.tokens_per_step} | | | | | |"
                      + (" | | | |" if args.census else "") + f" {c.error} |")
            continue
        tps = rate[c.key]
        gflops = tps * c.flops_per_token / 1e9
        ref = rate.get((c.model, "reference", "adamw", c.mode, c.precision, c.grad_accum))
        ratio = f"{tps / ref:.2f}" if c.impl == "ours" and ref else ""
        extra = ""
        if args.census and c.census is None:
            extra = " | | | |"
        elif args.census:
            n = c.census
            work_count = n.kernels if args.device == "cuda" else n.aten_ops
            busy = f"{100 * n.busy_fraction:.0f}%" if n.busy_fraction is not None else "-"
            peak = None if n.transient_peak_bytes is None else (c.resident() + n.transient_peak_bytes) / 2**30
            extra = f" {fmt(work_count)} | {fmt(n.host_syncs, '.1f')} | {busy} | {fmt(peak, '.2f')} |"
        print("| " + " | ".join(cells) + f" | {c.tokens_per_step} | {statistics.median(c.times):.3f} "
              f"| {tps:,.0f} | {gflops:.1f} | {percent_of_peak(gflops, peaks[c.precision])} | {ratio} |{extra} {c.notes} |")
        refused |= gflops > peaks[c.precision]
    if refused:
        print(f"\nMFU above 100% is not printed: training outran the measured peak, so the peak is "
              f"wrong (too small a matmul for this device?); re-run with a larger --peak-size than {args.peak_size}.")
    print_muon_vs_adamw(contenders, rate)
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
