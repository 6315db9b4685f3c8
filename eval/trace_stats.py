"""Where a training step's time goes, from the per-rank Chrome traces of `profile.enabled`.

The trainer marks each profiled optimizer step as a `ProfilerStep#<step>` region and its
phases as `forward_backward`, `grad_sync`, `optimizer`, `eval` (and `checkpoint`); every
collective is a `comm/<group>/<op>` region (parallel/comm.py). This module splits each step's
wall time into disjoint parts that add up to the step:

    comm       inside a collective (our comm/ regions and the backend's own events)
    optimizer  inside the optimizer step, not communicating
    eval       inside evaluation, not communicating
    compute    any other busy time (forward, backward, gradient preparation, ...)
    idle       the rest of the step: nothing was running

Regions nest and overlap (a collective inside the optimizer step, aten ops inside a
region), so each category is the union of its intervals and the categories take priority
in the order above; nothing is counted twice. Besides the partition it reports the whole
optimizer step including its collectives (`optimizer_step`, the "optimizer overhead" of a
Distributed Muon comparison) and the communication time of each collective.

Two timelines:
- CPU runs: the training thread (the one holding the step regions). Busy is any aten op or
  phase region there; comm is the time that thread spends issuing and waiting for
  collectives, i.e. the communication the step actually waits for.
- CUDA runs (the trace has kernels): the device. Busy is any kernel, memcpy or memset;
  NCCL kernels are comm; other kernels take the phase of the host region that launched
  them (matched through the launch's correlation id), so asynchronous execution is
  attributed to the phase that queued it. Step windows run from one step's start to the
  next's (the last one to its last kernel's end), so queued work is counted once.
"""
from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

# The trace vocabulary shared with trainer/profiling.py and the training loop.
STEP_PREFIX = "ProfilerStep#"
COMM_PREFIX = "comm/"
FORWARD_BACKWARD, GRAD_SYNC, OPTIMIZER, EVAL = "forward_backward", "grad_sync", "optimizer", "eval"
# Phases that are work of the training thread as a whole, Python included (CPU timeline).
BUSY_PHASES = (FORWARD_BACKWARD, GRAD_SYNC, OPTIMIZER, EVAL)
CATEGORIES = ("compute", "comm", "optimizer", "eval", "idle")

# Collectives the backend records itself on the calling thread: c10d ops ("c10d::allreduce_"),
# gloo/nccl spans ("gloo:all_reduce", "nccl:all_gather") and their parameter records.
_BACKEND_COMM = re.compile(r"^(c10d::|gloo:|nccl:|record_param_comms$)", re.IGNORECASE)
DEVICE_OP_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")

Intervals = list[tuple[float, float]]


# ---------------------------------------------------------------------------------------
# Interval maths: lists of (start, end); `union` makes them sorted and disjoint.

def union(intervals: Iterable[tuple[float, float]]) -> Intervals:
    out: Intervals = []
    for start, end in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def intersect(a: Intervals, b: Intervals) -> Intervals:
    """a ∩ b for disjoint sorted inputs."""
    out: Intervals = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Intervals, b: Intervals) -> Intervals:
    """a minus b for disjoint sorted inputs."""
    out: Intervals = []
    j = 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k, cursor = j, start
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                out.append((cursor, b[k][0]))
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def length(a: Intervals) -> float:
    return sum(end - start for start, end in a)


# ---------------------------------------------------------------------------------------
# Reading traces


@dataclass(frozen=True)
class Event:
    name: str
    cat: str
    start: float  # microseconds, as in the trace
    end: float
    tid: Any
    correlation: Optional[int] = None


def read_trace(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def trace_events(trace: dict[str, Any]) -> list[Event]:
    """The complete ('X') events of a trace; other phases (flows, metadata) carry no time."""
    events = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or "dur" not in e:
            continue
        args = e.get("args") or {}
        start = float(e["ts"])
        events.append(Event(e.get("name", ""), e.get("cat", ""), start, start + float(e["dur"]),
                            e.get("tid"), args.get("correlation")))
    return events


def trace_rank(trace: dict[str, Any], path: Path) -> int:
    info = trace.get("distributedInfo") or {}
    if "rank" in info:
        return int(info["rank"])
    found = re.search(r"rank[_-]?(\d+)", path.name)
    return int(found.group(1)) if found else 0


def find_traces(path: Path) -> list[Path]:
    """Trace files of a run dir (its traces/) or of a trace dir."""
    directory = path / "traces" if (path / "traces").is_dir() else path
    files = sorted(p for p in directory.iterdir() if p.name.endswith((".json", ".json.gz")))
    if not files:
        raise FileNotFoundError(f"{path}: no Chrome traces (*.json) here or under traces/")
    return files


# ---------------------------------------------------------------------------------------
# Breakdown


@dataclass
class RankStats:
    """Totals over the profiled steps of one rank, in microseconds."""

    rank: int
    steps: list[int]
    timeline: str  # "cpu" or "cuda"
    step_time: float = 0.0
    parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    optimizer_step: float = 0.0
    comm_by_op: dict[str, float] = field(default_factory=dict)

    def per_step_ms(self, value: float) -> float:
        return value / max(1, len(self.steps)) / 1e3

    def fraction(self, value: float) -> float:
        return value / self.step_time if self.step_time > 0 else 0.0

    @property
    def fractions(self) -> dict[str, float]:
        return {k: self.fraction(v) for k, v in self.parts.items()}


@dataclass
class _Piece:
    """A stretch of busy time: `anchor` is when it was issued (a kernel's launch)."""

    start: float
    end: float
    anchor: float
    comm: Optional[str] = None  # the collective's name while communicating


def innermost(regions: list[Event], times: list[float]) -> list[Optional[Event]]:
    """For each time, the innermost of the (properly nested) regions containing it."""
    ordered = sorted(regions, key=lambda r: (r.start, -r.end))
    out: list[Optional[Event]] = [None] * len(times)
    stack: list[Event] = []
    i = 0
    for k in sorted(range(len(times)), key=times.__getitem__):
        t = times[k]
        while i < len(ordered) and ordered[i].start <= t:
            while stack and stack[-1].end < ordered[i].start:
                stack.pop()
            stack.append(ordered[i])
            i += 1
        while stack and stack[-1].end < t:
            stack.pop()
        out[k] = stack[-1] if stack else None
    return out


def _comm_name(e: Event) -> str:
    return e.name[len(COMM_PREFIX):] if e.name.startswith(COMM_PREFIX) else e.name


def _host_pieces(on_main: list[Event], comm_regions: list[Event]) -> list[_Piece]:
    """CPU timeline: ops, phases and collectives of the training thread."""
    pieces = []
    backend = [e for e in on_main if _BACKEND_COMM.match(e.name)]
    # The backend's events inside our comm/ regions are the same time under another name.
    outside = {id(e) for e, r in zip(backend, innermost(comm_regions, [e.start for e in backend])) if r is None}
    for e in on_main:
        if e.name.startswith(COMM_PREFIX) or id(e) in outside:
            pieces.append(_Piece(e.start, e.end, e.start, _comm_name(e)))
        elif e.cat == "cpu_op" or e.name in BUSY_PHASES:
            pieces.append(_Piece(e.start, e.end, e.start))
    return pieces


def _device_pieces(events: list[Event], device_ops: list[Event], comm_regions: list[Event]) -> list[_Piece]:
    """CUDA timeline: kernels, anchored at their launch; NCCL kernels named by the comm/
    region that launched them."""
    launches = {e.correlation: e.start for e in events if e.cat in _LAUNCH_CATS and e.correlation is not None}
    anchors = [launches.get(op.correlation, op.start) for op in device_ops]
    regions = innermost(comm_regions, anchors)
    pieces = []
    for op, anchor, region in zip(device_ops, anchors, regions):
        comm = None
        if "nccl" in op.name.lower():
            comm = _comm_name(region) if region is not None else "nccl:" + op.name.split("(")[0]
        pieces.append(_Piece(op.start, op.end, anchor, comm))
    return pieces


def analyze(trace: dict[str, Any], path: Path = Path("trace.json")) -> RankStats:
    """The breakdown of one rank's trace (see the module docstring)."""
    events = trace_events(trace)
    steps = sorted((e for e in events if e.name.startswith(STEP_PREFIX)), key=lambda e: e.start)
    if not steps:
        raise ValueError(f"{path}: no {STEP_PREFIX}<n> regions; was it recorded with profile.enabled?")
    main = steps[0].tid
    on_main = [e for e in events if e.tid == main]
    comm_regions = [e for e in on_main if e.name.startswith(COMM_PREFIX)]
    phases = {name: [e for e in on_main if e.name == name] for name in (OPTIMIZER, EVAL)}
    device_ops = [e for e in events if e.cat in DEVICE_OP_CATEGORIES]
    stats = RankStats(trace_rank(trace, path), [int(s.name[len(STEP_PREFIX):]) for s in steps],
                      "cuda" if device_ops else "cpu")

    if device_ops:
        pieces = _device_pieces(events, device_ops, comm_regions)
        # Device work belongs to the phase whose region launched it; an optimizer step
        # lasts from its first kernel's start to its last kernel's end.
        phase_sets, optimizer_spans = {}, []
        for name, regions in phases.items():
            owner = innermost(regions, [p.anchor for p in pieces])
            phase_sets[name] = union((p.start, p.end) for p, r in zip(pieces, owner) if r is not None)
            if name == OPTIMIZER:
                spans: dict[int, list[float]] = {}
                for p, r in zip(pieces, owner):
                    if r is not None:
                        spans.setdefault(id(r), []).extend((p.start, p.end))
                optimizer_spans = [(min(v), max(v)) for v in spans.values()]
        # Consecutive windows, so queued work running past a step's region is counted once;
        # the last one reaches the end of the last kernel.
        ends = [s.start for s in steps[1:]] + [max([steps[-1].end] + [p.end for p in pieces])]
        windows = [(s.start, end) for s, end in zip(steps, ends)]
    else:
        pieces = _host_pieces(on_main, comm_regions)
        phase_sets = {name: union((e.start, e.end) for e in regions) for name, regions in phases.items()}
        optimizer_spans = [(e.start, e.end) for e in phases[OPTIMIZER]]
        windows = [(s.start, s.end) for s in steps]

    window = union(windows)
    busy = intersect(union((p.start, p.end) for p in pieces), window)
    comm = intersect(union((p.start, p.end) for p in pieces if p.comm), window)
    optimizer = subtract(intersect(phase_sets[OPTIMIZER], busy), comm)
    evaluation = subtract(subtract(intersect(phase_sets[EVAL], busy), comm), optimizer)
    compute = subtract(subtract(subtract(busy, comm), optimizer), evaluation)
    stats.step_time = length(window)
    stats.parts = {"compute": length(compute), "comm": length(comm), "optimizer": length(optimizer),
                   "eval": length(evaluation), "idle": length(window) - length(busy)}
    stats.optimizer_step = length(intersect(union(optimizer_spans), window))
    for name in sorted({p.comm for p in pieces if p.comm}):
        spans = intersect(union((p.start, p.end) for p in pieces if p.comm == name), window)
        if spans:
            stats.comm_by_op[name] = length(spans)
    return stats


def analyze_run(path: Path) -> list[RankStats]:
    """One RankStats per trace file of a run dir or trace dir, by rank."""
    return sorted((analyze(read_trace(p), p) for p in find_traces(path)), key=lambda s: s.rank)


# ---------------------------------------------------------------------------------------
# Comparing two runs (e.g. AdamW as A, Muon as B)


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def comm_per_step(ranks: list[RankStats]) -> float:
    """Mean over ranks of the communication time per step, in ms."""
    return mean([r.per_step_ms(r.parts["comm"]) for r in ranks])


def optimizer_overhead(ranks: list[RankStats]) -> float:
    """Mean over ranks of (optimizer step incl. its collectives) / (step wall time)."""
    return mean([r.fraction(r.optimizer_step) for r in ranks])


def run_dir_of(path: Path) -> Path:
    """The run dir of a run dir or of its traces/ dir."""
    return path if (path / "traces").is_dir() or (path / "metrics.jsonl").exists() else path.parent


def last_metric(run_dir: Path, key: str) -> Optional[float]:
    """The last logged value of `key` in the run's metrics.jsonl, if any."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    value = None
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            value = record.get(key, value)
    return value


@dataclass
class Comparison:
    comm_ms: tuple[float, float]
    comm_ratio: Optional[float]  # B / A
    overhead: tuple[float, float]  # optimizer step / step wall time
    state_bytes: tuple[Optional[float], Optional[float]]

    @property
    def overhead_difference(self) -> float:
        """B's overhead minus A's, in percentage points."""
        return 100 * (self.overhead[1] - self.overhead[0])


def compare(a: list[RankStats], b: list[RankStats], a_dir: Path, b_dir: Path) -> Comparison:
    comm_a, comm_b = comm_per_step(a), comm_per_step(b)
    return Comparison(
        comm_ms=(comm_a, comm_b),
        comm_ratio=comm_b / comm_a if comm_a > 0 else None,
        overhead=(optimizer_overhead(a), optimizer_overhead(b)),
        state_bytes=(last_metric(run_dir_of(a_dir), "mem/optim_state_bytes"),
                     last_metric(run_dir_of(b_dir), "mem/optim_state_bytes")),
    )
