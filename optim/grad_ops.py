"""Gradient collectives and the global gradient norm, aware of the DP x TP mesh."""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist

from parallel.tp_ops import all_reduce, group_size


def average_gradients(params: Iterable[torch.Tensor], group: Optional[dist.ProcessGroup]) -> None:
    """Average gradients over data-parallel ranks with one all-reduce per dtype bucket.

    Flattening into one buffer turns hundreds of small collectives into one large one.
    """
    size = group_size(group)
    if size == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    for dtype in sorted({g.dtype for g in grads}, key=str):
        bucket = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in bucket])
        flat.div_(size)
        all_reduce(flat, group)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def sum_of_squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of the squared elements of all `tensors`, accumulated in fp64, as a 0-d fp32 tensor.

    One foreach norm over the list (one multi-tensor kernel on a GPU), not a pow and a sum
    per tensor: the step's reductions stay constant in the number of parameters.

    Accumulated in fp64, the norm is the fp64 one to fp32 rounding (1e-7), however a matrix is
    split over ranks. In fp32, torch's CPU norm of a contiguous tensor runs down it with one
    vector of fp32 partial sums, so its error grows with the length (2.5e-4 relative for an
    8192 x 1024 matrix), and a matrix cut into TP shards gets a different error. The CUDA
    kernel (tree reductions, already 1e-8 close in fp32) converts each element to `dtype`
    before squaring it, so fp64 costs the same launches there.
    """
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float64)
    total = torch.linalg.vector_norm(torch.stack(norms))
    # Squaring into an fp32 output rounds once, from fp64, and on CUDA the cast is part of
    # the multiply's kernel: as many launches as the fp32 stack/square/sum had. Callers keep
    # an fp32 sum (fp32 all-reduce payloads, fp32 norm and clip scale).
    return torch.mul(total, total, out=torch.empty((), dtype=torch.float32, device=total.device))


def global_grad_norm(params: Iterable[torch.Tensor], tp_group: Optional[dist.ProcessGroup],
                     pp_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """L2 norm of the full model's gradient (after DP averaging), on every rank.

    TP-sharded gradients hold different parts of the model on each TP rank, so their squares
    are summed over TP; replicated gradients are equal on every rank and counted once. Under
    a pipeline every stage holds other layers: the squares are summed over `pp_group` too.
    """
    sharded, replicated = [], []
    for p in params:
        if p.grad is None:
            continue
        target = sharded if getattr(p, "tp_split_dim", None) is not None else replicated
        target.append(p.grad)
    device = next(iter(sharded + replicated)).device
    sq_sharded = all_reduce(sum_of_squares(sharded, device), tp_group)
    return all_reduce(sq_sharded + sum_of_squares(replicated, device), pp_group).sqrt()


def clip_gradients(params: list[torch.Tensor], max_norm: float, tp_group: Optional[dist.ProcessGroup],
                   pp_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Scale gradients so their global norm is at most `max_norm` (0: no clipping).

    Returns the norm before clipping. The scale stays on the device: no host sync.
    """
    norm = global_grad_norm(params, tp_group, pp_group)
    if max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_([p.grad for p in params if p.grad is not None], scale)
    return norm
