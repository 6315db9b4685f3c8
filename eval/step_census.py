"""What one training step asks of the machine, counted with torch.profiler: operators launched,
host syncs, device kernels, how busy the device was, and peak memory.

Two uses: the CPU guards in tests/test_step_census.py, which hold the hot path to a fixed
number of host syncs and to an operator count near the plain reference's (so a gain made on
a GPU cannot silently regress where no GPU runs); and lab/tools/bench/bench_train.py --census, which
prints the same figures beside tokens/s on a GPU.

An operator is counted when it is a top-level aten op of the step (an `aten::` event none of
whose enclosing events is itself an `aten::` op) that does work: views, allocations and
conversions that turn out to copy nothing are not counted. That is what eager mode
dispatches, and on a GPU roughly what it launches (a foreach op counts once, like the one
multi-tensor kernel it becomes there; a compiled graph's fused kernels are not aten ops, its
extern matmuls are).
"""
from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from torch.autograd.profiler_util import FunctionEvent

from eval.trace_stats import DEVICE_OP_CATEGORIES, STEP_PREFIX, length, read_trace, trace_events, union

# A host sync on CPU: reading a tensor's value into Python (.item(), bool(), float()).
CPU_SYNC_OPS = frozenset({"aten::_local_scalar_dense"})
# The Python-facing ops that read a value through _local_scalar_dense.
_VALUE_READS = frozenset({"aten::item", "aten::is_nonzero"})
# On CUDA the runtime calls that make the host wait for the device (cudaDeviceSynchronize is
# left out: the census itself calls it after the steps). A pageable host-to-device copy waits
# too but cannot be told apart from an asynchronous one in a trace.
CUDA_SYNC_CALLS = frozenset({"cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy"})


# Ops that launch nothing themselves: views, metadata, allocations, and conversions that
# only copy (and then count) when one of the ops they call does work.
NO_WORK_OPS = frozenset(f"aten::{name}" for name in (
    "view", "_unsafe_view", "view_as", "reshape", "_reshape_alias", "flatten", "unflatten", "t",
    "transpose", "mT", "permute", "unsqueeze", "squeeze", "expand", "expand_as", "detach", "alias",
    "narrow", "select", "slice", "diagonal", "as_strided", "split", "split_with_sizes", "chunk", "unbind",
    "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
    "resolve_conj", "resolve_neg", "contiguous", "to", "type_as", "item",
))


def does_work(e: FunctionEvent) -> bool:
    """Whether an aten op launched any work: itself, or for a no-work op, one of the ops it called."""
    if e.name not in NO_WORK_OPS:
        return True
    return any(c.name.startswith("aten::") and does_work(c) for c in e.cpu_children)


@dataclass
class StepCensus:
    """Per-step means over the profiled steps."""

    steps: int
    aten_ops: float
    host_syncs: float
    kernels: Optional[float] = None  # device kernels, memcpys and memsets (CUDA only)
    busy_fraction: Optional[float] = None  # device busy time / step wall time (CUDA only)
    # The most a step allocated on top of what was allocated when the census began (CUDA
    # only); add the resident parameters and optimizer state for a step's peak memory.
    transient_peak_bytes: Optional[int] = None
    op_names: Optional[dict[str, int]] = None  # top-level op name -> count over all steps


def _ancestors(e: FunctionEvent):
    parent = e.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def _in_step(e: FunctionEvent) -> bool:
    # The profiler shows every ProfilerStep#<n> region as "ProfilerStep*".
    return any(a.name.startswith(STEP_PREFIX[:-1]) for a in _ancestors(e))


def count_events(events: list[FunctionEvent]) -> tuple[dict[str, int], int]:
    """({top-level aten op name: count}, value reads) over the events inside step regions."""
    ops: dict[str, int] = {}
    syncs = 0
    for e in events:
        if not _in_step(e):
            continue
        # A read inside another op's CPU kernel (e.g. _grouped_mm reading its offsets) is no
        # device sync; only reads the step's own code asks for count.
        if e.name in CPU_SYNC_OPS and not any(
            a.name.startswith("aten::") and a.name not in _VALUE_READS for a in _ancestors(e)
        ):
            syncs += 1
        if e.name.startswith("aten::") and not any(a.name.startswith("aten::") for a in _ancestors(e)):
            if does_work(e):
                ops[e.name] = ops.get(e.name, 0) + 1
    return ops, syncs


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def census(step: Callable[[], object], device: torch.device, steps: int = 3) -> StepCensus:
    """Profile `steps` calls of `step` (already warmed up: compiled, first-touch allocations
    done) and count what they did. Each call is one `ProfilerStep#<i>` region.

    On CUDA a second, device-only recording measures kernels and busy time: recording every
    host op slows the host enough to starve the GPU, which would understate how busy it is.
    """
    device = torch.device(device)
    _synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            with torch.profiler.record_function(f"{STEP_PREFIX}{i + 1}"):
                step()
    ops, syncs = count_events(list(prof.events()))
    result = StepCensus(steps, sum(ops.values()) / steps, syncs / steps, op_names=ops)
    if device.type == "cuda":
        _device_census(step, device, steps, result)
    return result


def _device_census(step: Callable[[], object], device: torch.device, steps: int, result: StepCensus) -> None:
    """Kernels, host syncs (the runtime's waits) per step, busy fraction (union of device op
    intervals / host wall time) and the transient memory peak of `steps` steps, recorded
    with device activity only."""
    _synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    resident = torch.cuda.memory_allocated(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        _synchronize(device)
        wall_us = (time.perf_counter() - start) * 1e6
    result.transient_peak_bytes = torch.cuda.max_memory_allocated(device) - resident
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = trace_events(read_trace(path))
    device_ops = [e for e in events if e.cat in DEVICE_OP_CATEGORIES]
    result.kernels = len(device_ops) / steps
    result.host_syncs = sum(1 for e in events if e.name in CUDA_SYNC_CALLS) / steps
    result.busy_fraction = min(1.0, length(union((e.start, e.end) for e in device_ops)) / wall_us)


def fmt(value: Optional[float], spec: str = ".0f") -> str:
    """A census figure for a table cell; '-' where it was not measured."""
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)
