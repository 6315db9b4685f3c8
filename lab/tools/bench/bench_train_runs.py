"""The run of lab/tools/bench/bench_train.py: its configurations (Contender), how each is built (our
Trainer from the composed config, or lab/tools/bench/reference_gpt.py's model of the same shape),
warmed up, timed and measured, interleaved round by round or one at a time. The tables are
bench_train.py's."""
from __future__ import annotations

import argparse
import gc
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from hydra import compose, initialize_config_dir

from eval.flops import train_flops_per_token
from eval.step_census import StepCensus, census
from model.config import ModelConfig
from lab.tools.bench.bench_common import REPO, cpu_snapshot, foreign_cores, tensor_bytes
from planning.newton_schulz_cost import newton_schulz_flops
from lab.tools.bench.reference_gpt import ReferenceConfig, ReferenceTrainer
from trainer.config import TrainConfig, to_dataclass, validate
from trainer.loop import Trainer


@dataclass
class Contender:
    model: str
    impl: str  # "ours" or "reference"
    mode: str  # "eager" or "compiled"
    precision: str
    optim: str  # ours: the optim config; the reference: always AdamW
    grad_accum: int = 1  # micro-batches per optimizer step
    tokens_per_step: int = 0
    fp8: str = "none"  # ours: trainer.fp8
    flops_per_token: int = 0
    ns_flops: int = 0  # Newton-Schulz FLOPs per optimizer step (ours with Muon)
    step: Optional[Callable[[], object]] = None
    resident: Optional[Callable[[], int]] = None  # bytes of parameters + optimizer state
    trainer: Optional[Trainer] = None  # ours, for --losses
    last: object = None  # what the last step returned (ours: its stats)
    error: str = ""
    notes: str = ""
    times: list[float] = field(default_factory=list)
    census: Optional[StepCensus] = None
    peak_bytes: Optional[int] = None  # --one-at-a-time on CUDA: the timed steps' peak allocation
    losses: dict[str, float] = field(default_factory=dict)

    @property
    def arithmetic(self) -> str:
        """The precision column: the autocast precision, and FP8's recipe where one is on."""
        return self.precision if self.fp8 == "none" else f"{self.precision}+fp8 {self.fp8}"

    @property
    def key(self) -> tuple[str, str, str, str, str, int]:
        return self.model, self.impl, self.optim, self.mode, self.arithmetic, self.grad_accum

    @property
    def label(self) -> str:
        return " ".join(map(str, self.key[:-1])) + (f" x{self.grad_accum}" if self.grad_accum > 1 else "")


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


def compose_config(overrides: list[str]) -> TrainConfig:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return to_dataclass(compose("config", overrides))


def ours_overrides(c: Contender, args: argparse.Namespace) -> list[str]:
    return [
        f"model={c.model}", f"trainer.precision={c.precision}",
        f"trainer.compile={str(c.mode == 'compiled').lower()}",
        f"trainer.batch_size={args.batch_size}", f"trainer.seq_len={args.seq_len}",
        f"trainer.grad_accum={c.grad_accum}", *([f"trainer.fp8={c.fp8}"] if c.fp8 != "none" else []),
        # The peak is measured by this script; a positive value spares each Trainer its own.
        "trainer.peak_tflops=1", "trainer.max_steps=100000", f"trainer.device={args.device}",
        "logger.wandb.mode=disabled", f"optim={c.optim}", *args.overrides,
    ]


def build_ours(c: Contender, args: argparse.Namespace, run_dir: Path) -> Trainer:
    cfg = compose_config(ours_overrides(c, args))
    validate(cfg)
    return Trainer(cfg, run_dir)


def build_reference(m: ModelConfig, n_ours: int, c: Contender, args: argparse.Namespace) -> ReferenceTrainer:
    """The reference of our model `m` (its vocabulary set), which has `n_ours` parameters."""
    shape = ReferenceConfig(
        vocab_size=m.vocab_size, n_layers=m.n_layers, d_model=m.d_model, n_heads=m.n_heads,
        n_kv_heads=m.n_kv_heads, ffn_hidden=m.ffn_hidden, max_seq_len=m.max_seq_len,
        rope_theta=m.rope_theta, norm_eps=m.norm_eps,
    )
    ref = ReferenceTrainer(shape, args.batch_size, args.seq_len, c.precision,
                           compile=c.mode == "compiled", device=args.device, grad_accum=c.grad_accum)
    n_ref = sum(p.numel() for p in ref.model.parameters())
    if n_ours != n_ref:
        raise RuntimeError(f"reference has {n_ref} parameters, ours {n_ours}: not the same shape")
    return ref


def plan_contenders(args: argparse.Namespace) -> list[Contender]:
    contenders: list[Contender] = []
    for model in args.models:
        for mode in args.modes:
            for precision in args.precisions:
                for accum in args.grad_accums:
                    tokens = accum * args.batch_size * args.seq_len
                    contenders.extend(Contender(model, "ours", mode, precision, optim, accum, tokens, fp8)
                                      for fp8 in args.fp8 for optim in args.optims)
                    contenders.append(Contender(model, "reference", mode, precision, "adamw", accum, tokens))
    return contenders


Shape = tuple[ModelConfig, int]  # our model's config (its vocabulary set) and parameter count


def build(c: Contender, args: argparse.Namespace, tmp: Path, shapes: dict[tuple, Shape]) -> None:
    """Set up `c` (its step, resident bytes, FLOPs); an error goes into c.error, for the table.
    Ours records its shape in `shapes`, which the reference of the same row then copies."""
    try:
        if c.impl == "ours":
            trainer = build_ours(c, args, tmp / "_".join(map(str, c.key)))
            shapes.setdefault((c.model, c.mode, c.precision, c.grad_accum), (trainer.model_cfg, trainer.model.num_params()))
            c.trainer = trainer
            c.step = lambda t=trainer: t.train_step(measure=False)
            c.resident = lambda t=trainer: tensor_bytes(t.model.parameters()) + t.optimizer.state_bytes()
            c.tokens_per_step = trainer.tokens_per_step
            c.flops_per_token = trainer.flops_per_token
            if trainer.cfg.optim.name == "muon":
                c.ns_flops = newton_schulz_flops(trainer.model, trainer.cfg.optim.muon)
            return
        shape = shapes.get((c.model, c.mode, c.precision, c.grad_accum))
        if shape is None or args.no_reference or shape[0].n_experts > 0:
            c.error = "-"  # the reference is a dense model only
            return
        ref = build_reference(*shape, c, args)
        c.step = ref.step
        c.resident = lambda r=ref: tensor_bytes(r.model.parameters()) + tensor_bytes(
            v for state in r.opt.state.values() for v in state.values() if torch.is_tensor(v)
        )
        c.tokens_per_step = ref.tokens_per_step
        c.flops_per_token = train_flops_per_token(shape[0], args.seq_len)
    except Exception as err:  # report it in the table; the other rows still run
        c.error = one_line(err)


def warm_up(live: list[Contender], args: argparse.Namespace) -> None:
    """Compilation, first-touch allocations, kernel choice. Interleaved like the timed rounds,
    because compiled models of one class share torch.compile's code cache: compiling one can
    make another recompile at its next call. A configuration that fails here drops out."""
    breaks = {c.key: 0 for c in live}
    for w in range(args.warmup):
        for c in live:
            if c.step is None:
                continue
            t0, before = time.perf_counter(), graph_breaks()
            try:
                c.last = c.step()
            except Exception as err:
                c.error = ("compile failed: " if c.mode == "compiled" else "") + one_line(err)
                c.step = None
            breaks[c.key] += graph_breaks() - before
            print(f"  warm-up {w + 1}/{args.warmup} {c.label}: {time.perf_counter() - t0:.1f} s",
                  file=sys.stderr, flush=True)
    for c in live:
        if breaks[c.key]:
            c.notes = f"{breaks[c.key]} graph break(s) while compiling"


def timed_rounds(live: list[Contender], args: argparse.Namespace) -> list[float]:
    """args.rounds rounds of args.steps steps of each configuration; the other processes' CPU
    use (cores) during each round."""
    foreign: list[float] = []
    for r in range(args.rounds):
        before, t_round = cpu_snapshot(), time.perf_counter()
        for c in live:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                c.last = c.step()
            if args.device == "cuda":
                torch.cuda.synchronize()
            c.times.append((time.perf_counter() - t0) / args.steps)
        t_round = time.perf_counter() - t_round
        load = foreign_cores(before, cpu_snapshot(), t_round)
        if load is not None:
            foreign.append(load)
        print(f"  round {r + 1}/{args.rounds}: {t_round:.1f} s", file=sys.stderr, flush=True)
    return foreign


def measure_after(c: Contender, args: argparse.Namespace) -> None:
    """What a configuration gives once timed: its census, and with --losses its losses."""
    if args.census:
        try:
            c.census = census(c.step, torch.device(args.device))
        except Exception as err:  # the table still prints; this row says why it has no census
            c.notes = (c.notes + "; " if c.notes else "") + "census failed: " + one_line(err)
    if args.losses and c.trainer is not None and isinstance(c.last, dict):
        evaluated = c.trainer.evaluate()
        c.losses = {"steps trained": float(c.trainer.step), "train/loss, last step": float(c.last["train/loss"]),
                    **{k: float(v) for k, v in evaluated.items() if k.endswith("/loss")}}


def release(c: Contender, args: argparse.Namespace) -> None:
    """Drop everything of `c` that holds memory (--one-at-a-time, before the next one is
    built). torch.compile's caches hold the compiled model too, so they go as well."""
    c.step = c.resident = c.trainer = c.last = None
    torch._dynamo.reset()
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()


def run_one_at_a_time(contenders: list[Contender], args: argparse.Namespace, tmp: Path) -> list[float]:
    shapes: dict[tuple, Shape] = {}
    foreign: list[float] = []
    for c in contenders:
        build(c, args, tmp, shapes)
        if c.step is not None and not c.error:
            warm_up([c], args)
        if c.step is not None and not c.error:
            if args.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            foreign += timed_rounds([c], args)
            if args.device == "cuda":
                c.peak_bytes = torch.cuda.max_memory_allocated()
            measure_after(c, args)
        release(c, args)
    return foreign


def run_interleaved(contenders: list[Contender], args: argparse.Namespace, tmp: Path) -> list[float]:
    shapes: dict[tuple, Shape] = {}
    for c in contenders:
        build(c, args, tmp, shapes)
    live = [c for c in contenders if c.step is not None and not c.error]
    warm_up(live, args)
    live = [c for c in live if c.step is not None]
    foreign = timed_rounds(live, args)
    for c in live:
        measure_after(c, args)
    return foreign
