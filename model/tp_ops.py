"""Tensor-parallel communication primitives as autograd functions.

Each names the collective it runs in forward and in backward, so every collective of a
TP model can be read off the layer code. With a TP group of one they are identities.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

Group = Optional[dist.ProcessGroup]


def group_size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce(x: torch.Tensor, group: Group, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


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
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


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


class _SplitToTP(torch.autograd.Function):
    """Forward: keep this rank's slice along `dim`. Backward: all-gather the slices."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather(grad, ctx.dim, ctx.group), None, None


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _CopyToTP.apply(x, group) if group_size(group) > 1 else x


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group) if group_size(group) > 1 else x


def gather_from_tp(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    return _GatherFromTP.apply(x, dim, group) if group_size(group) > 1 else x


def split_to_tp(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    return _SplitToTP.apply(x, dim, group) if group_size(group) > 1 else x
