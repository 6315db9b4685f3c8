"""Muon's step, written once, in three phases over lists of tensors; every engine (Muon, each
ZeRO-1 owner, FSDP2's row shards) calls these and nothing else for the arithmetic:

    1. momentum:       M = momentum * M + G;  U = G + momentum * M  (Nesterov), else U = M
    2. newton_schulz:  O = NS(U)   (optim/muon/newton_schulz.py: normalisation, the iteration,
                       Gram or standard, stacked batches, workspaces and CUDA graphs behind it)
    3. apply_update:   W = W * (1 - lr * weight_decay) - lr * scale * O

With `cautious`, the decay of phase 3 acts only where O and W have the same sign, where the
update already moves the weight towards zero (Cautious Weight Decay, arXiv 2510.12402).

Each phase is one function of lists of tensors whose per-step hyperparameters are 0-d tensors
(the lr, through apply_update's factors; the momentum settings are constants of a run, a
MomentumSetting): run as it is, or (optim.muon.compile_updates, on GPUs) the same function under
torch.compile (`phase`), which fuses its for-each ops into a few kernels and never recompiles
for a new lr.
`keep` (0-d float, 1.0, or 0.0 for a step skipped on the device because a gradient was not
finite: OptimizerSet.step's found_inf) gates a step with no host sync: the gradient counts as
zero and the momentum keeps its value; the update and decay are zero.

optim/muon/reference.py is the same step written per matrix as plainly as the maths, an oracle
the tests hold these to, not a caller of them.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Optional

import torch
from torch import Tensor

from optim.muon import fused


def phase(fn: Callable, compiled: bool, combo: bool = False) -> Callable:
    """`fn` (momentum or apply_update) as it is, or compiled into fused kernels (fused.compiled;
    `combo`: inductor's combo kernels, several per launch)."""
    return fused.compiled(fn, combo) if compiled else fn


class MomentumSetting(NamedTuple):
    """What `momentum` reads of a param group (optim/muon/options.py's fields): parameters whose
    settings are equal share one call. A new momentum option is a field here and there."""

    momentum: float
    nesterov: bool

    @staticmethod
    def of(group: Mapping[str, Any]) -> "MomentumSetting":
        return MomentumSetting(group["momentum"], group["nesterov"])


def momentum(bufs: list[Tensor], grads: list[Tensor], out: Tensor, setting: MomentumSetting,
             keep: Optional[Tensor] = None) -> list[Tensor]:
    """For every (buf, grad), with mu = setting.momentum: buf <- mu * buf + grad in place, and
    the Newton-Schulz input (grad + mu * buf with the updated buf for Nesterov, else buf) into
    `out`, one contiguous tensor in the gradients' dtype (a Newton-Schulz stack, or a flat
    buffer) holding a part of each grad's size, in order. Returns those parts, in the grads'
    shapes. With `keep` == 0 the gradients count as zero (overwritten in `out`, one op for all
    of them: NaN * 0 is NaN) and the buffers keep their values (factor 1); a gated step that is
    not skipped rounds exactly as an ungated one."""
    outs = [part.view(g.shape) for part, g in zip(out.view(-1).split([g.numel() for g in grads]), grads)]
    if not bufs:
        return outs
    mu, nesterov = setting
    factor: float | Tensor = mu
    if keep is not None:
        skip = keep == 0
        torch._foreach_copy_(outs, grads)
        out.masked_fill_(skip, 0.0)
        grads, factor = outs, torch.where(skip, 1.0, mu)
    torch._foreach_mul_(bufs, factor)
    torch._foreach_add_(bufs, grads)
    if nesterov:
        if grads is not outs:
            torch._foreach_copy_(outs, grads)
        torch._foreach_add_(outs, bufs, alpha=mu)
    else:
        torch._foreach_copy_(outs, bufs)
    return outs


def apply_update(params: list[Tensor], updates: list[Tensor], decay: Tensor, alpha: Tensor, cautious: bool) -> None:
    """p <- p * decay + u * alpha for every (p, u): `decay` the 0-d factor 1 - lr * weight_decay
    (gated: 1 on a skipped step), `alpha` the 0-d -lr * scale; with `cautious` the decay only
    where u * p > 0 (a skipped step's u is zero, so its decay is off there too). The update is
    one multiply-add in the weights' dtype, whatever u's (a bf16 u is widened, not rounded)."""
    if not params:
        return
    if cautious:
        torch._foreach_mul_(params, [torch.where(u * p > 0, decay, 1.0) for p, u in zip(params, updates)])
    else:
        torch._foreach_mul_(params, decay)
    torch._foreach_addcmul_(params, updates, [alpha] * len(params))


def update_factors(lr: float, weight_decay: float, scale: float, keep: Optional[Tensor], like: Tensor
                   ) -> tuple[Tensor, Tensor]:
    """apply_update's 0-d (decay, alpha) for a group's lr and weight decay and the matrix's lr
    scale (optim/muon/newton_schulz.py muon_scale): 1 - lr * weight_decay * keep (1 on a step
    `keep` skips) and -lr * scale, on `like`'s device, in fp64 for fp64 weights and fp32
    otherwise (the precision a Python scalar has in their ops)."""
    dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    gate = torch.ones((), dtype=dtype, device=like.device) if keep is None else keep.to(dtype)
    return 1.0 - (lr * weight_decay) * gate, torch.full((), -lr * scale, dtype=dtype, device=like.device)


def gate_for(keep: Optional[Tensor], compiled: bool, device: torch.device) -> Optional[Tensor]:
    """The `keep` a phase gets: as given, but never None for a compiled phase, whose kernels
    would otherwise compile twice (with and without a gate) in a run that skips a step."""
    if keep is None and compiled:
        return torch.ones((), device=device)
    return keep
