"""Alpha-beta times of the collectives a training step runs, for the scale planner.

The standard model: sending n bytes over a link costs alpha + n / beta, with alpha the link's
latency and beta its bandwidth per GPU and direction. Over a group of p GPUs:

- ring all-gather / reduce-scatter of a `total`-byte buffer (the gathered output, or the
  reduce-scatter's input): p - 1 steps, each moving total / p bytes on every link at once,
      (p - 1) * alpha + (p - 1) / p * total / beta;
- ring all-reduce: a reduce-scatter then an all-gather, twice that;
- tree all-reduce (NCCL's double binary tree, pipelined): a reduce up and a broadcast down,
  each about total / beta once the pipeline is full, and 2 log2(p) latencies,
      2 * ceil(log2 p) * alpha + 2 * total / beta;
  NCCL picks whichever is faster, and so does `all_reduce_s`.

A group's link is the slowest one its ring crosses: NVLink when the whole group sits in one
node, else InfiniBand (one NIC per GPU, as on DGX/HGX nodes, so every GPU of a multi-node ring
gets the NIC's bandwidth). Congestion, NCCL's protocol choice (LL / LL128 / Simple) and the
hierarchical algorithms are not modelled; the calibration in lab/BENCHMARKS.md says how far off
this is where it could be measured.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes per second, per GPU and direction
    latency: float  # seconds per message


def ring_all_gather_s(total_bytes: float, p: int, link: Link) -> float:
    """All-gather into a `total_bytes` output over p ranks (reduce-scatter: the same)."""
    if p <= 1:
        return 0.0
    return (p - 1) * link.latency + (p - 1) / p * total_bytes / link.bandwidth


ring_reduce_scatter_s = ring_all_gather_s


def ring_all_reduce_s(total_bytes: float, p: int, link: Link) -> float:
    return 2 * ring_all_gather_s(total_bytes, p, link)


def tree_all_reduce_s(total_bytes: float, p: int, link: Link) -> float:
    if p <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(p)) * link.latency + 2 * total_bytes / link.bandwidth


def all_reduce_s(total_bytes: float, p: int, link: Link) -> float:
    """The faster of ring and tree, as NCCL's tuner picks."""
    return min(ring_all_reduce_s(total_bytes, p, link), tree_all_reduce_s(total_bytes, p, link))
