"""Tensor-parallel communication primitives as autograd functions.

Each names the collective it runs in forward and in backward, so every collective of a
TP model can be read off the layer code. With a TP group of one they are identities.
"""
from __future__ import annotations

import torch

from parallel.comm import Group, all_gather_into, all_reduce, group_rank, group_size  # noqa: F401


class _CopyToTP(torch.autograd.Function):
    """Forward: identity (every TP rank holds the same input). Backward: all-reduce, since
    each rank's branch contributes part of the input's gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce(grad.contiguous(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """Forward: all-reduce the ranks' partial sums. Backward: identity."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        return all_reduce(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _gather(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    # Gather rank-major along a new leading dim, then lay the shards side by side in `dim`.
    out = x.new_empty((size, *x.shape))
    all_gather_into(out, x, group)
    return torch.cat(out.unbind(0), dim=dim)


def _split(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    return x.chunk(size, dim=dim)[group_rank(group)].contiguous()


class _GatherFromTP(torch.autograd.Function):
    """Forward: all-gather shards along `dim`. Backward: keep this rank's slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _split(grad, ctx.dim, ctx.group), None, None


class _SumOver(torch.autograd.Function):
    """Forward: all-reduce (sum). Backward: all-reduce (sum) of the gradient. For a statistic
    summed over ranks that every rank then uses in the same loss: each rank's input receives
    the gradient of every rank's copy of that loss."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce(grad.contiguous().clone(), ctx.group), None


def sum_over(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _SumOver.apply(x, group) if group_size(group) > 1 else x


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _CopyToTP.apply(x, group) if group_size(group) > 1 else x


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group) if group_size(group) > 1 else x


def gather_from_tp(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    return _GatherFromTP.apply(x, dim, group) if group_size(group) > 1 else x
