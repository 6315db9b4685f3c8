"""Muon's elementwise work compiled into fused kernels, for GPUs (optim.muon.compile_updates).

Between the Newton-Schulz GEMMs, a Muon step streams every matrix through memory: momentum,
the Nesterov input, weight decay, the update. As for-each ops that is about 17 passes over a
matrix's fp32 size per step; compiled, the momentum phase reads the gradient and buffer and
writes the buffer and the Newton-Schulz input, and the update phase reads the parameter and
update and writes the parameter. On a 1B-parameter MoE those passes, not the matmuls, dominate
the optimizer step.

`compiled` wraps the phases of optim/muon/update.py (the same functions that run eagerly), and
this file's normalisation of Newton-Schulz's input. Each distinct list of shapes compiles once
(a Muon stack, or a stack's share of a ZeRO bucket); the scalars that change every step (the
lr, through the update's factors) are tensors, so no step recompiles.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

# Compiled variants per code object: one per distinct list layout in a step (a stack, or its
# share of a ZeRO bucket, per param group). Dynamo's default of 8 would send larger models
# back to eager; past this limit the calls still run, eagerly (no fullgraph: that would be an
# error instead).
RECOMPILE_LIMIT = 64


def normalise(G: Tensor, out: Tensor, safety: float, eps: float, keep: Tensor) -> None:
    """out[i] <- G[i] / (||G[i]||_F * safety + eps), Newton-Schulz's first step (newton_schulz.py's
    _normalise), as one compiled reduction and one compiled elementwise kernel. Eagerly the
    division writes fp32 into bf16 through torch's generic casting kernel, which runs far below
    the memory bandwidth (lab/BENCHMARKS.md). `keep`: 1.0, or
    0.0 for a skipped step (an infinite denominator: out is zero)."""
    norm = torch.linalg.vector_norm(G, dim=(-2, -1), keepdim=True, dtype=torch.float32)
    out.copy_(G / ((norm * safety + eps) / keep))


_COMPILED: dict[tuple[Callable, bool], Callable] = {}


def compiled(fn: Callable, combo: bool = False) -> Callable:
    """`fn` under torch.compile (built on first use, shapes static). `combo`: with inductor's
    combo kernels, which launch several of the per-tensor kernels of a for-each loop as one (on
    a GPU; the CPU's C++ kernels are not combined). Its aim: the launch gaps between the many
    small kernels of a compiled Muon step, one pair per matrix. Off by default
    until a GPU run measures it (lab/tools/bench/bench_optimizer.py's combo variant)."""
    key = (fn, combo)
    if key not in _COMPILED:
        config = torch._dynamo.config
        name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # older torch
        setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
        _COMPILED[key] = torch.compile(fn, dynamic=False, options={"combo_kernels": True} if combo else None)
    return _COMPILED[key]
