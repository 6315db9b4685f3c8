"""optim.muon.ns_method=auto: Gram or standard Newton-Schulz per matrix shape, by measured time.

Gram Newton-Schulz does fewer multiply-adds than the standard iteration on non-square matrices
(ns_method.gram_pays), but fewer multiply-adds is not always less time: on a GPU it timed
well below what the count promises, and on either side of the standard iteration
(lab/BENCHMARKS.md, "Gram against standard"). So "auto" times both on the running device, once per run at start-up: for each
shape Muon will orthogonalise, a stack of that shape in the run's dtype and settings, a warm-up
and a few timed calls per method in alternating rounds (synchronising on CUDA), and keeps the
faster. Under optim.muon.cuda_graphs the whole-matrix calls are timed as CUDA graph replays, as
the steps will run them: a graph removes the launch cost, which Gram (more, smaller GEMMs) pays
more of, so the faster method can differ with and without graphs.

Rank 0 measures and broadcasts its choice: TP ranks that iterate on shards of one matrix must
run the same method, and a run should be one algorithm whatever its ranks' timings say. The
choice is written into optim.muon.ns_by_shape, which resolved_config.yaml and checkpoints
record; a resumed run keeps its checkpoint's choice and measures only shapes it lacks.

If rank 0's measurement fails (a CUDA out-of-memory on the up to 2 x MEASURE_BYTES of timing
stacks, say), it tells the other ranks, which would otherwise wait in the broadcast until the
process group's timeout, and every rank stops with one line naming the error and the ways out.
It does not fall back to a method: "auto" promises a measured choice, the choice is recorded in
the config and kept by every resume, and a fallback would record an unmeasured one as if it
were measured; a run that needs to go on sets ns_method=standard or gram, or ns_by_shape.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Mapping, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from optim.muon import ns_graphs
from optim.config import OptimConfig
from optim.muon.options import parse_ns_dtype
from optim.muon.newton_schulz import newton_schulz
from optim.muon.ns_method import NSShape
from optim.muon.newton_schulz_tp import newton_schulz_sharded
from parallel.comm import broadcast_object, group_size, simulated, world

# timer(shape, method) -> seconds of one Newton-Schulz call on a small stack of `shape` with
# `method` ("standard" or "gram"). Injectable, so the choice can be tested without timing. A
# timer may have a `release()`, called once the choice is made, to free what it holds.
Timer = Callable[[NSShape, str], float]

# Gram must be this much faster to be chosen: a tie is not worth its slightly larger bf16
# error (docs/muon_family.md), and a few repeats at start-up carry a few percent of noise.
GRAM_MIN_SPEEDUP = 1.03
# Matrices per timed stack. A GPU runs a small stack far below the speed of the real one, and
# not alike for both methods (Gram launches more, smaller GEMMs): a small stack can rank the
# methods the other way round from the whole one (lab/BENCHMARKS.md). So a GPU times the model's count of the shape, up to MEASURE_BYTES of input (the per-rank stacks
# of a ZeRO run are smaller still). A CPU, which runs any stack in cache-sized pieces
# (buffers.batch_chunk), times MEASURE_BATCH_CPU: each call costs up to a second there.
MEASURE_BYTES = 1 << 30
MEASURE_BATCH_CPU = 4
# Per method and shape: untimed calls first, then ROUNDS rounds that alternate standard and
# Gram (a drift, clocks ramping up, hits both alike), each the fastest of REPEATS calls.
WARMUP, ROUNDS, REPEATS = 2, 3, 2


@dataclass(frozen=True)
class Measured:
    by_shape: dict[str, str]  # shape key -> "gram" or "standard"
    speedups: dict[str, float]  # shape key -> standard's time / Gram's
    error: Optional[str] = None  # rank 0's measurement failed: what it raised, in one line


class MeasurementError(RuntimeError):
    """ns_method=auto could not measure: raised on every rank, with the same line."""


def failure_line(error: str) -> str:
    return (f"optim.muon.ns_method=auto: timing Newton-Schulz on rank 0 failed ({error}); set "
            f"optim.muon.ns_method=standard or gram, or give every shape in optim.muon.ns_by_shape")


def device_timer(
    device: torch.device, dtype: torch.dtype, steps: int, coefficients: str, eps: float,
    counts: Mapping[NSShape, int], input_dtype: torch.dtype = torch.float32,
    warmup: int = WARMUP, repeats: int = REPEATS, graphs: bool = False,
) -> Timer:
    """Times newton_schulz (newton_schulz_sharded for TP shards, without the all-reduces,
    which Gram only has fewer of) on random matrices, as many as the model has of the shape on
    a GPU (up to MEASURE_BYTES), MEASURE_BATCH_CPU elsewhere: the fastest of `repeats` calls,
    after `warmup` untimed ones on a (shape, method)'s first timing.

    `graphs` (optim.muon.cuda_graphs): whole matrices go through newton_schulz's CUDA graph
    path, as Muon's steps then run them; with warmup >= 2 the untimed calls are the eager first
    call and the recording, and every timed call is a replay (TP shards have no graph path,
    in the steps either). The timer's `release()` drops the graphs it recorded."""
    itemsize = torch.finfo(input_dtype).bits // 8
    stacks: dict[NSShape, tuple[Tensor, Tensor]] = {}  # the shape being timed: input, output
    warmed: set[tuple[NSShape, str]] = set()

    def release() -> None:
        for G, out in stacks.values():
            ns_graphs.forget(G, out)
        stacks.clear()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def stack_of(shape: NSShape) -> tuple[Tensor, Tensor]:
        if shape not in stacks:
            release()  # one shape's stack at a time: up to 2 x MEASURE_BYTES
            count = counts.get(shape, MEASURE_BATCH_CPU)
            fits = max(1, MEASURE_BYTES // (shape.rows * shape.cols * itemsize))
            n = max(1, min(count, fits) if device.type == "cuda" else min(count, MEASURE_BATCH_CPU))
            gen = torch.Generator().manual_seed(0)
            G = torch.randn(n, shape.rows, shape.cols, generator=gen, dtype=input_dtype).to(device)
            stacks[shape] = (G, torch.empty_like(G))
        return stacks[shape]

    def timer(shape: NSShape, method: str) -> float:
        G, out = stack_of(shape)
        if shape.split is None:
            def call() -> Any:
                return newton_schulz(G, steps, coefficients, dtype, eps, out=out, graph=graphs, iteration=method)
        else:
            def call() -> Any:
                return newton_schulz_sharded(G, shape.split, None, steps, coefficients, dtype, eps, iteration=method)
        if (shape, method) not in warmed:
            warmed.add((shape, method))
            for _ in range(warmup):
                call()
        best = float("inf")
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            call()
            sync()
            best = min(best, time.perf_counter() - start)
        return best

    timer.release = release  # type: ignore[attr-defined]
    return timer


def choose(shapes: Iterable[NSShape], timer: Timer, rounds: int = ROUNDS) -> Measured:
    """Per shape, "gram" where Gram timed GRAM_MIN_SPEEDUP faster than standard, else
    "standard"; each method's time the fastest of `rounds` alternating timings."""
    by_shape, speedups = {}, {}
    for shape in sorted(set(shapes), key=lambda s: s.key):
        best = {"standard": float("inf"), "gram": float("inf")}
        for _ in range(rounds):
            for method in best:
                best[method] = min(best[method], timer(shape, method))
        standard, gram = best["standard"], best["gram"]
        speedups[shape.key] = standard / gram
        by_shape[shape.key] = "gram" if speedups[shape.key] >= GRAM_MIN_SPEEDUP else "standard"
    return Measured(by_shape, speedups)


def _world(group: Any) -> tuple[int, int]:
    # A simulated rank (fake process groups) hears from no rank 0: it measures for itself.
    if not (dist.is_available() and dist.is_initialized()) or simulated(group):
        return 0, 1
    return dist.get_rank(), group_size(group)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"this {device.type.upper()}"


def resolve_ns_method(
    cfg: OptimConfig, counts: Mapping[NSShape, int], device: torch.device,
    resumed: Optional[dict[str, Any]] = None, group: Any = None, timer: Timer | None = None,
) -> tuple[OptimConfig, Optional[str]]:
    """`cfg` with optim.muon.ns_by_shape holding a choice for every shape in `counts` (the
    matrices Muon orthogonalises, builder.muon_ns_shapes), and the start-up line saying what
    was chosen and why; (cfg, None) unless optim=muon with ns_method=auto.

    Entries already in the config win, then those of `resumed` (the config of the checkpoint
    this run continues); the rest rank 0 measures with `timer` (default: device_timer in the
    run's Newton-Schulz settings, CUDA graphs included) and broadcasts over `group` (default:
    all ranks). Collective when there is something to measure: every rank must call it. If the
    measurement raises on rank 0, every rank raises MeasurementError with one line saying so.
    """
    m = cfg.muon
    if cfg.name != "muon" or m.ns_method != "auto":
        return cfg, None
    given = dict(m.ns_by_shape)
    kept = {k: v for k, v in dict((resumed or {}).get("optim", {}).get("muon", {}).get("ns_by_shape") or {}).items()
            if k not in given}
    missing = [s for s in counts if s.key not in given and s.key not in kept]
    measured = Measured({}, {})
    if missing:
        group = group if group is not None else world()
        rank, world_size = _world(group)
        cause: Optional[Exception] = None
        if rank == 0:
            try:
                if timer is None:
                    timer = device_timer(device, parse_ns_dtype(m.ns_dtype), m.ns_steps, m.coefficients, m.eps,
                                         counts, graphs=m.cuda_graphs)
                try:
                    measured = choose(missing, timer)
                finally:
                    release = getattr(timer, "release", None)
                    if release is not None:
                        release()
            except Exception as err:  # the other ranks are waiting in the broadcast below
                cause, text = err, str(err).strip()
                measured = Measured({}, {}, type(err).__name__ + (f": {text.splitlines()[0]}" if text else ""))
        if world_size > 1:
            measured = broadcast_object(measured, 0, group, "setup")
        if measured.error is not None:
            raise MeasurementError(failure_line(measured.error)) from cause
    by_shape = {**kept, **given, **measured.by_shape}
    return replace(cfg, muon=replace(m, ns_by_shape=by_shape)), startup_line(counts, by_shape, measured, kept, given, device)


def startup_line(
    counts: Iterable[NSShape], by_shape: Mapping[str, str], measured: Measured, kept: Mapping[str, str],
    given: Mapping[str, str], device: torch.device,
) -> str:
    """e.g. "Newton-Schulz method: gram for 768x2048 (1.28x), 2048x768 (1.30x); standard for
    768x768 (0.84x) (auto: measured on NVIDIA H200, Gram's speed over standard's)"."""
    keys = sorted({s.key for s in counts})

    def named(key: str) -> str:
        return f"{key} ({measured.speedups[key]:.2f}x)" if key in measured.speedups else key

    lists = [(method, [named(k) for k in keys if by_shape[k] == method]) for method in ("gram", "standard")]
    what = "; ".join(f"{method} for {', '.join(names)}" for method, names in lists if names) or "no Muon matrices"
    why = []
    if measured.speedups:
        why.append(f"measured on {device_name(device)}, Gram's speed over standard's")
    if any(k in kept for k in keys):
        why.append(f"{', '.join(k for k in keys if k in kept)} kept from the checkpoint this run resumes")
    if any(k in given for k in keys):
        why.append(f"{', '.join(k for k in keys if k in given)} set in optim.muon.ns_by_shape")
    return f"Newton-Schulz method: {what} (auto: {'; '.join(why) or 'nothing to measure'})"
