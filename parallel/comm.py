"""Counted collectives: every collective of a run goes through here.

Each call adds its payload bytes and its host-side time to a counter keyed by
(label, operation), so a run can log `comm/<label>/<op>_bytes` and the time spent
communicating. Payload bytes are the size of the full buffer the collective works on: the
tensor for all-reduce, the gathered output for all-gather, the input for reduce-scatter.

The label is the group's role ("dp", "tp", "host"; label_group) for the training step's
collectives. The collectives outside the step's arithmetic name their purpose instead
(`label=`): "setup" (data, precision and Newton-Schulz agreement at start-up), "checkpoint"
and "preemption". Objects (`*_object`) are counted by their pickled size.

A group of None is a group of one: every collective is then a no-op (or a copy), so the same
code runs in a single process. `world()` is the default group, or None without one.

Over torch's fake process groups (a simulation: one process playing one rank of a larger
layout, parallel/mesh.py's init_simulated_mesh) no data moves, and what each collective leaves
in its output is what this rank has: an all-reduce or broadcast leaves its input, an all-gather
repeats this rank's input in every slot, a reduce-scatter leaves this rank's chunk of its input,
and an all-to-all hands this rank's input back as its output (`_loopback`: torch's own fake
all-to-all copies the input's first block into every incoming block instead, and fails on an
empty input); an object broadcast hands back this rank's own object. The bytes are counted
all the same: what this rank would send.

Under torch.profiler each collective is also a `comm/<group>/<op>` region of the trace, which
scripts/analyze_trace.py attributes to communication by name.
"""
from __future__ import annotations

import contextlib
import pickle
import time
import weakref
from collections import defaultdict
from typing import ContextManager, Optional

import torch
import torch.distributed as dist

Group = Optional[dist.ProcessGroup]

# Held weakly, by the group itself: keyed by id(), a group freed with its mesh (the next job of
# a sweep, the next test on a reused rank) could leave its label to a new group at its address.
_labels: "weakref.WeakKeyDictionary[dist.ProcessGroup, str]" = weakref.WeakKeyDictionary()


def label_group(group: Group, label: str) -> None:
    """Name a process group ("dp", "tp") for the counters."""
    if group is not None:
        _labels[group] = label


def group_label(group: Group) -> str:
    return "world" if group is None else _labels.get(group, "world")


_NO_REGION = contextlib.nullcontext()


def profiling() -> bool:
    """Whether a torch.profiler is recording. One C++ flag read; under torch.compile it is
    False, which keeps regions out of traced graphs."""
    return not torch.compiler.is_compiling() and torch.autograd._profiler_enabled()


def region(name: str) -> ContextManager:
    """A named torch.profiler region, or nothing when no profiler is recording (entering a
    record_function costs a dispatcher call even then, so the hot path skips it)."""
    return torch.profiler.record_function(name) if profiling() else _NO_REGION


def _comm_region(group: Group, op: str, label: Optional[str] = None) -> ContextManager:
    # The name is only formatted while profiling: collectives are on the hot path.
    if not profiling():
        return _NO_REGION
    return torch.profiler.record_function(f"comm/{label or group_label(group)}/{op}")


def group_size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


def simulated(group: Group) -> bool:
    """Whether `group` is a fake process group, whose collectives move no data (see above)."""
    return group is not None and dist.get_backend(group) == "fake"


def _loopback(out: torch.Tensor, x: torch.Tensor) -> None:
    """An all-to-all over a fake group: out <- x, element for element as far as both reach, and
    zeros past x's end. Where the splits in and out agree (the expert-parallel dispatch, whose
    counts come back as sent) out is exactly x: every row returns to this rank."""
    flat_out, flat_x = out.view(-1), x.reshape(-1)
    n = min(flat_out.numel(), flat_x.numel())
    flat_out[:n].copy_(flat_x[:n])
    flat_out[n:].zero_()


class CommCounter:
    def __init__(self) -> None:
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.seconds = 0.0

    def record(self, group: Group, op: str, nbytes: int, seconds: float, label: Optional[str] = None) -> None:
        key = (label or group_label(group), op)
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


def _all_gather_single(*args, **kwargs):
    # torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single and made the
    # old names warn; older releases (2.11 is common on GPU images) only have the old names.
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def _reduce_scatter_single(*args, **kwargs):
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(x: torch.Tensor, group: Group, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
               label: Optional[str] = None) -> torch.Tensor:
    if group_size(group) > 1:
        start = time.perf_counter()
        with _comm_region(group, "all_reduce", label):
            dist.all_reduce(x, op=op, group=group)
        COUNTER.record(group, "all_reduce", _nbytes(x), time.perf_counter() - start, label)
    return x


def all_gather_into(out: torch.Tensor, x: torch.Tensor, group: Group) -> torch.Tensor:
    """out (group size x x's elements, rank-major) <- every rank's x."""
    if group_size(group) == 1:
        return out.copy_(x.reshape(out.shape))
    start = time.perf_counter()
    # Flat views: gloo wants the output as one buffer of group-size x input elements.
    with _comm_region(group, "all_gather"):
        _all_gather_single(out.view(-1), x.contiguous().view(-1), group=group)
    COUNTER.record(group, "all_gather", _nbytes(out), time.perf_counter() - start)
    return out


class Pending:
    """A collective in flight: `wait()` before reading its output. It is counted (bytes,
    one call, host time to issue plus time blocked in wait) and profiled when waited on, so
    the trace shows the communication the caller actually waits for."""

    def __init__(self, work: Optional[dist.Work], group: Group, op: str, nbytes: int, seconds: float) -> None:
        self.work, self.group, self.op, self.nbytes, self.seconds = work, group, op, nbytes, seconds

    def wait(self) -> None:
        if self.work is None:
            return
        start = time.perf_counter()
        with _comm_region(self.group, self.op):
            self.work.wait()
        COUNTER.record(self.group, self.op, self.nbytes, self.seconds + time.perf_counter() - start)
        self.work = None


def all_gather_async(out: torch.Tensor, x: torch.Tensor, group: Group) -> Pending:
    """all_gather_into, returning at once: overlap the transfer with other work, then wait()."""
    if group_size(group) == 1:
        out.copy_(x.reshape(out.shape))
        return Pending(None, group, "all_gather", 0, 0.0)
    start = time.perf_counter()
    with _comm_region(group, "all_gather"):
        work = _all_gather_single(out.view(-1), x.contiguous().view(-1), group=group, async_op=True)
    return Pending(work, group, "all_gather", _nbytes(out), time.perf_counter() - start)


def reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, group: Group) -> torch.Tensor:
    """out <- this rank's chunk of the sum of every rank's x (x rank-major, group size x out)."""
    if group_size(group) == 1:
        return out.copy_(x.reshape(out.shape))
    start = time.perf_counter()
    with _comm_region(group, "reduce_scatter"):
        _reduce_scatter_single(out.view(-1), x.contiguous().view(-1), group=group)
    COUNTER.record(group, "reduce_scatter", _nbytes(x), time.perf_counter() - start)
    return out


def all_to_all_into(out: torch.Tensor, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                    group: Group, label: Optional[str] = None) -> torch.Tensor:
    """out <- the rank-ordered pieces every rank sends this one: x's rank-major pieces of
    `in_splits` elements go one to each rank, `out_splits` come back (uneven splits are fine).
    Counted by the elements this rank sends, under `label` where given (the group's otherwise)."""
    if group_size(group) == 1:
        return out.copy_(x.reshape(out.shape))
    start = time.perf_counter()
    with _comm_region(group, "all_to_all", label):
        if simulated(group):
            _loopback(out, x)
        else:
            dist.all_to_all_single(out.view(-1), x.contiguous().view(-1), output_split_sizes=out_splits,
                                   input_split_sizes=in_splits, group=group)
    COUNTER.record(group, "all_to_all", _nbytes(x), time.perf_counter() - start, label)
    return out


# --- Collectives outside the step's arithmetic: objects, flags and barriers, by purpose ---


def world() -> Group:
    """The default group (every rank), or None in a single process."""
    return dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None


def broadcast(x: torch.Tensor, src: int, group: Group, label: str) -> torch.Tensor:
    """x <- rank `src`'s x (`src` a global rank)."""
    if group_size(group) > 1:
        start = time.perf_counter()
        with _comm_region(group, "broadcast", label):
            dist.broadcast(x, src=src, group=group)
        COUNTER.record(group, "broadcast", _nbytes(x), time.perf_counter() - start, label)
    return x


def _pickled_size(obj: object) -> int:
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def all_gather_object(obj: object, group: Group, label: str) -> list:
    """Every rank's `obj`, in group rank order."""
    if group_size(group) == 1:
        return [obj]
    out: list = [None] * group_size(group)
    start = time.perf_counter()
    with _comm_region(group, "all_gather_object", label):
        dist.all_gather_object(out, obj, group=group)
    nbytes = sum(_pickled_size(o) for o in out)
    COUNTER.record(group, "all_gather_object", nbytes, time.perf_counter() - start, label)
    return out


def broadcast_object(obj: object, src: int, group: Group, label: str) -> object:
    """Rank `src`'s `obj` (`src` a global rank); the others pass anything, e.g. None. Over a
    fake group, this rank's own `obj`: torch's fake broadcast leaves the object's size unset on
    the other ranks, which then try to allocate whatever the memory held."""
    if group_size(group) == 1 or simulated(group):
        return obj
    box = [obj]
    start = time.perf_counter()
    with _comm_region(group, "broadcast_object", label):
        dist.broadcast_object_list(box, src=src, group=group)
    COUNTER.record(group, "broadcast_object", _pickled_size(box[0]), time.perf_counter() - start, label)
    return box[0]


def barrier(group: Group, label: str) -> None:
    if group_size(group) > 1:
        start = time.perf_counter()
        with _comm_region(group, "barrier", label):
            dist.barrier(group=group)
        COUNTER.record(group, "barrier", 0, time.perf_counter() - start, label)
