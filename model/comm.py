"""Counted collectives: every collective of the model and the optimizers goes through here.

Each call adds its payload bytes and its host-side time to a counter keyed by
(group label, operation), so a run can log `comm/<dp|tp>/<op>_bytes` and the time spent
communicating. Payload bytes are the size of the full buffer the collective works on: the
tensor for all-reduce, the gathered output for all-gather, the input for reduce-scatter.
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Optional

import torch
import torch.distributed as dist

Group = Optional[dist.ProcessGroup]

_labels: dict[int, str] = {}


def label_group(group: Group, label: str) -> None:
    """Name a process group ("dp", "tp") for the counters."""
    if group is not None:
        _labels[id(group)] = label


def group_size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


class CommCounter:
    def __init__(self) -> None:
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.seconds = 0.0

    def record(self, group: Group, op: str, nbytes: int, seconds: float) -> None:
        key = (_labels.get(id(group), "world"), op)
        self.bytes[key] += nbytes
        self.calls[key] += 1
        self.seconds += seconds

    def metrics(self, steps: int = 1) -> dict[str, float]:
        """Per-step averages over `steps` steps, under the contract's metric names."""
        out = {f"comm/{label}/{op}_bytes": b / steps for (label, op), b in sorted(self.bytes.items())}
        out.update({f"comm/{label}/{op}_calls": c / steps for (label, op), c in sorted(self.calls.items())})
        out["comm/seconds"] = self.seconds / steps
        return out

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.seconds = 0.0


COUNTER = CommCounter()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(x: torch.Tensor, group: Group, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    if group_size(group) > 1:
        start = time.perf_counter()
        dist.all_reduce(x, op=op, group=group)
        COUNTER.record(group, "all_reduce", _nbytes(x), time.perf_counter() - start)
    return x


def all_gather_into(out: torch.Tensor, x: torch.Tensor, group: Group) -> torch.Tensor:
    """out (group size x x's elements, rank-major) <- every rank's x."""
    if group_size(group) == 1:
        return out.copy_(x.reshape(out.shape))
    start = time.perf_counter()
    # Flat views: gloo wants the output as one buffer of group-size x input elements.
    dist.all_gather_single(out.view(-1), x.contiguous().view(-1), group=group)
    COUNTER.record(group, "all_gather", _nbytes(out), time.perf_counter() - start)
    return out


def reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, group: Group) -> torch.Tensor:
    """out <- this rank's chunk of the sum of every rank's x (x rank-major, group size x out)."""
    if group_size(group) == 1:
        return out.copy_(x.reshape(out.shape))
    start = time.perf_counter()
    dist.reduce_scatter_single(out.view(-1), x.contiguous().view(-1), group=group)
    COUNTER.record(group, "reduce_scatter", _nbytes(x), time.perf_counter() - start)
    return out
