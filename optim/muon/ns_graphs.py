"""CUDA graphs for Newton-Schulz: newton_schulz(graph=True), which optim.muon.cuda_graphs uses.

One Newton-Schulz call on a stack is about twenty kernels (the normalisation, three GEMMs per
step, a cast); each is launched by the host, one after the other. Recorded once as a CUDA
graph and replayed, the whole iteration is one launch.

A graph replays the kernels it recorded on the addresses it recorded. So a graph is kept per
settings and exact input and output tensors (address, shape, strides, dtype), and replayed
only for a call that passes tensors at those addresses: they then hold that call's data.
`keep`, the step's on-device skip gate, is a fresh tensor every step, so it is copied into a
0-d tensor of the graph's own, which the graph reads. Everything else the iteration allocates
comes from one memory pool per device that all these graphs share: they run one after the
other on one stream, and each frees all it allocated by the end of its own run, so one
graph's scratch memory may be another's.

The first call with a given key runs eagerly (nothing is recorded for a one-off call, such as
a caller whose buffers move); the second records the graph, after a warm-up on scratch copies
on the capture stream as torch asks, then replays it; later calls replay. Inside
torch.compile's tracing, inside someone else's capture, and off CUDA, calls run eagerly.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch
from torch import Tensor

# The iteration on given tensors: fn(G, out, keep) writes newton_schulz(G, keep=keep) into out.
Eager = Callable[[Tensor, Tensor, "Tensor | None"], Tensor]
# capture(fn, G, out, keep) -> replay: records fn on exactly these tensors; replay() reruns it.
Capture = Callable[[Eager, Tensor, Tensor, "Tensor | None"], Callable[[], None]]

# False: every call runs eagerly (a switch for comparisons and for debugging).
ENABLED = True
# Device types graphs are recorded on. Tests add "cpu", with a stand-in for `_capture`.
DEVICE_TYPES: tuple[str, ...] = ("cuda",)
# Graphs kept per thread, least recently used dropped first; and keys seen once.
MAX_GRAPHS = 64
MAX_SEEN = 256


@dataclass
class _Graph:
    replay: Callable[[], None]
    keep: Tensor | None  # the graph's own copy of the gate, refreshed before each replay


class _Cache(threading.local):
    def __init__(self) -> None:
        self.graphs: OrderedDict[Hashable, _Graph] = OrderedDict()
        self.seen: OrderedDict[Hashable, None] = OrderedDict()
        self.recorded = 0  # graphs recorded by this thread so far (tests read it)


_CACHE = _Cache()


def usable(device: torch.device) -> bool:
    """Whether a call on `device` may record or replay a graph now."""
    if not ENABLED or device.type not in DEVICE_TYPES:
        return False
    if torch.compiler.is_compiling():  # dynamo is tracing: let it see the eager kernels
        return False
    # Inside another capture every kernel joins that graph already; captures do not nest.
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _layout(t: Tensor) -> tuple[Any, ...]:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)


def run(settings: Hashable, G: Tensor, out: Tensor, keep: Tensor | None, eager: Eager) -> Tensor:
    """eager(G, out, keep), through a graph recorded for these tensors where there is one;
    returns out. `settings` must name everything else the result depends on."""
    key = (settings, _layout(G), _layout(out), None if keep is None else (keep.dtype, keep.device))
    cache = _CACHE
    graph = cache.graphs.get(key)
    if graph is None:
        if key not in cache.seen:
            _remember(cache.seen, key, None, MAX_SEEN)
            return eager(G, out, keep)
        # Allocated outside the capture, so that the graph's pool holds only scratch memory.
        static_keep = None if keep is None else keep.detach().clone()
        graph = _Graph(_capture(eager, G, out, static_keep), static_keep)
        cache.recorded += 1
        _remember(cache.graphs, key, graph, MAX_GRAPHS)
    else:
        cache.graphs.move_to_end(key)
    if keep is not None:
        graph.keep.copy_(keep)
    graph.replay()
    return out


def _remember(table: OrderedDict, key: Hashable, value: Any, limit: int) -> None:
    table[key] = value
    while len(table) > limit:
        table.popitem(last=False)


def clear() -> None:
    """Drop this thread's graphs and restart its count of recorded ones; graphs recorded from
    then on share a new memory pool. The old pool's memory goes back to the caching allocator
    once no graph holds it (torch.cuda.empty_cache returns it to the device). The end of every
    job of a sweep calls it (through buffers.release_buffers), and so does the
    Newton-Schulz timing of ns_method=auto for the graphs it recorded."""
    _CACHE.graphs.clear()
    _CACHE.seen.clear()
    _CACHE.recorded = 0
    _POOLS.clear()


def forget(*tensors: Tensor) -> None:
    """Drop this thread's graphs (and first sightings) of calls on any of `tensors`, as G or as
    out: for a caller about to free buffers it ran graphs on, whose graphs would otherwise hold
    their pool memory until clear() or until newer ones push them out."""
    ptrs = {t.data_ptr() for t in tensors}
    for table in (_CACHE.graphs, _CACHE.seen):
        for key in [key for key in table if key[1][0] in ptrs or key[2][0] in ptrs]:
            del table[key]


_POOLS: dict[torch.device, Any] = {}
_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _stream_and_pool(device: torch.device) -> tuple[torch.cuda.Stream, Any]:
    """The side stream graphs of `device` are recorded on (made once), and the memory pool they
    share (made again after clear() dropped the last one: the next job of a sweep records into a
    new pool, on the same stream)."""
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    if device not in _POOLS:
        _POOLS[device] = torch.cuda.graph_pool_handle()
    return _STREAMS[device], _POOLS[device]


def _capture_cuda(eager: Eager, G: Tensor, out: Tensor, keep: Tensor | None) -> Callable[[], None]:
    """Records eager(G, out, keep) as a CUDA graph; returns its replay."""
    device = G.device
    stream, pool = _stream_and_pool(device)
    current = torch.cuda.current_stream(device)
    # Warm-up (cuBLAS handles and workspaces for the capture stream) on copies: G and out
    # must keep their contents, since `out` may be G itself.
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        scratch_G = G.clone()
        scratch_out = scratch_G if out.data_ptr() == G.data_ptr() else torch.empty_like(out)
        eager(scratch_G, scratch_out, keep)
    current.wait_stream(stream)
    del scratch_G, scratch_out
    graph = torch.cuda.CUDAGraph()
    # thread_local: asynchronous collectives that other code left in flight do not break it.
    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        eager(G, out, keep)
    return graph.replay


_capture: Capture = _capture_cuda
