"""Where Newton-Schulz runs, apart from what it computes (newton_schulz.py): how many matrices
one run of batched GEMMs takes on a CPU, the scratch buffers kept between calls, and the row
blocks of the symmetric products. Nothing here changes a result, only its time and memory."""
from __future__ import annotations

import threading
from collections import OrderedDict

import torch
from torch import Tensor

from optim.muon import ns_graphs


# On CPU a batched GEMM streams the whole batch through memory once per operand, so a batch
# larger than the caches turns the small elementwise parts of each step (the beta * C of
# baddbmm, the normalisation, the optimizer's momentum and update) into DRAM traffic. Runs of
# a few MB beat both one batch per shape and one matrix at a time (lab/BENCHMARKS.md, "CPU
# working set"). GPUs get no limit: there, fewer and larger kernels win. None: no limit on CPU either.
CPU_WORKING_SET_BYTES: int | None = 6 << 20
# Below this many rows per block the symmetric block products cost more than they save.
_SYMMETRIC_BLOCK_ROWS = 64


def batch_chunk(m: int, n: int, dtype: torch.dtype, device: torch.device | str) -> int | None:
    """Most m x n matrices (m <= n) one run of batched GEMMs should hold; None: no limit."""
    if torch.device(device).type != "cpu" or CPU_WORKING_SET_BYTES is None:
        return None
    itemsize = torch.finfo(dtype).bits // 8
    per_matrix = (2 * m * n + 2 * m * m) * itemsize  # X, X', A, B
    return max(1, CPU_WORKING_SET_BYTES // per_matrix)


class Workspace:
    """Buffers of one run: X and X' [B, rows, cols], A and B [B, m, m] (m = min side)."""

    def __init__(self, bsz: int, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> None:
        m = min(rows, cols)
        self.tall = rows > cols
        self.x = reusable_buffer("ns.x", bsz, rows, cols, dtype, device)
        self.y = reusable_buffer("ns.y", bsz, rows, cols, dtype, device)
        self.a = reusable_buffer("ns.a", bsz, m, m, dtype, device)
        self.b = reusable_buffer("ns.b", bsz, m, m, dtype, device)
        self.blocks = _symmetric_blocks(m, dtype, device)


# CPU scratch buffers are kept between calls (per thread, the 32 most recently used; each at
# most a few MB when batch_chunk bounds the batch): freshly allocated multi-MB buffers come
# back from the OS as new pages, whose page faults are a visible share of an optimizer step.
# GPUs have a caching allocator instead; GPU buffers are kept only when asked (`persistent`).
_CPU_BUFFERS = threading.local()
_CPU_BUFFERS_KEPT = 32


def reusable_buffer(
    tag: str, bsz: int, rows: int, cols: int, dtype: torch.dtype, device: torch.device | str,
    persistent: bool = False,
) -> Tensor:
    """An uninitialised contiguous [bsz, rows, cols] tensor. On CPU, or anywhere with
    `persistent`, its memory is reused by the next call with the same tag, rows, cols, dtype
    and device (so callers must be done with it by then, in stream order on a GPU); elsewhere
    it is a fresh tensor. `persistent` keeps a GPU buffer at one address from call to call,
    which a replayed CUDA graph needs (see newton_schulz's `graph`), at the price of holding
    its memory between calls."""
    device = torch.device(device)
    if device.type != "cpu" and not persistent:
        return torch.empty(bsz, rows, cols, dtype=dtype, device=device)
    cache = getattr(_CPU_BUFFERS, "cache", None)
    if cache is None:
        cache = _CPU_BUFFERS.cache = OrderedDict()
    key = (tag, rows, cols, dtype, device)
    buf = cache.pop(key, None)
    if buf is None or buf.shape[0] < bsz:
        buf = torch.empty(bsz, rows, cols, dtype=dtype, device=device)
    cache[key] = buf
    while len(cache) > _CPU_BUFFERS_KEPT:
        cache.popitem(last=False)
    return buf[:bsz]


def release_buffers() -> None:
    """Drop this thread's kept buffers (the CPU scratch buffers and the persistent stacks of
    Muon's cuda_graphs, whose GPU memory then goes back to the caching allocator) and the
    CUDA graphs recorded on them (ns_graphs.clear). The end of every job of a sweep calls it:
    the next job's stacks have other shapes, and a graph of this job's must not replay there."""
    ns_graphs.clear()
    cache = getattr(_CPU_BUFFERS, "cache", None)
    if cache is not None:
        cache.clear()


def _symmetric_blocks(m: int, dtype: torch.dtype, device: torch.device) -> list[tuple[int, int]] | None:
    """Row blocks for computing only the upper block triangle of the symmetric A and B.

    A = X X^T and B = b A + c A A are symmetric, so block row i only needs the columns from
    block i on; the rest is mirrored. With k blocks that is (k + 1) / 2k of the FLOPs of the
    full products. Kept only where it measured faster (lab/BENCHMARKS.md, "symmetric blocks"):
    fp32 / fp64 on CPU. bf16 on CPU got slower (the oneDNN bf16 GEMM loses more efficiency on
    the thinner blocks than the FLOPs save), and on GPUs one large GEMM beats many small ones.
    """
    if torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.float64):
        return None
    k = m // _SYMMETRIC_BLOCK_ROWS
    if k < 2:
        return None
    bounds = [round(i * m / k) for i in range(k + 1)]
    return list(zip(bounds[:-1], bounds[1:]))
