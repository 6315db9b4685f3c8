"""The ZeRO-1 layout: which data-parallel rank owns which optimizer work.

One flat buffer of all local parameters is cut into DP segments of equal length, one per
rank, so gradients move with a single reduce-scatter and parameters with a single
all-gather, exactly as for a flat AdamW ZeRO-1. What differs is the order inside the buffer:

- every Muon matrix (this rank's TP shard of it) lies whole inside one segment, so its
  owner can run Newton-Schulz on it without gathering anything over DP;
- owners are chosen by longest-processing-time-first on the Newton-Schulz cost
  max(m, n) * min(m, n)^2, so no rank does much more orthogonalisation than another;
- AdamW parameters are split flat and fill each segment up to the common length, so the
  padding is only what the largest Muon load forces.

The plan is plain data, built once from shapes alone: every rank computes the same plan
without communicating, and it can be inspected and unit-tested without processes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ParamSpec:
    """What the plan needs to know of one (local, TP-sharded) parameter."""

    index: int  # position in the model's parameter list
    numel: int
    # (rows, cols) of each matrix whose Newton-Schulz the owner runs (the full matrix when TP
    # gathers it); empty for AdamW parameters.
    muon_matrices: tuple[tuple[int, int], ...] = ()

    @property
    def is_muon(self) -> bool:
        return bool(self.muon_matrices)

    @property
    def ns_cost(self) -> int:
        return sum(max(r, c) * min(r, c) ** 2 for r, c in self.muon_matrices)


@dataclass(frozen=True)
class Slice:
    """Elements [start, start + length) of a parameter's flattened tensor, stored at
    `offset` of the flat buffer."""

    param: int
    start: int
    length: int
    offset: int


@dataclass
class RankShare:
    muon: list[Slice] = field(default_factory=list)  # whole matrices (start 0, full length)
    adamw: list[Slice] = field(default_factory=list)  # flat pieces
    ns_cost: int = 0

    @property
    def used(self) -> int:
        return sum(s.length for s in self.muon) + sum(s.length for s in self.adamw)


@dataclass
class ZeroPlan:
    dp: int
    segment: int  # elements per DP rank (the reduce-scatter / all-gather chunk)
    ranks: list[RankShare]

    @property
    def total(self) -> int:
        return self.dp * self.segment

    @property
    def padding(self) -> int:
        return self.total - sum(r.used for r in self.ranks)

    def owner_of(self, param: int) -> list[int]:
        """The DP ranks holding part of `param` (exactly one for a Muon matrix)."""
        return [r for r, share in enumerate(self.ranks) if any(s.param == param for s in share.muon + share.adamw)]

    def describe(self) -> str:
        loads = ", ".join(
            f"rank {r}: {len(s.muon)} matrices, NS cost {s.ns_cost:.3g}, {s.used} elements"
            for r, s in enumerate(self.ranks)
        )
        pct = 100 * self.padding / max(1, self.total)
        return f"ZeRO-1 plan over DP={self.dp}: segment {self.segment} elements, padding {self.padding} ({pct:.2f}%); {loads}"


def build_plan(params: list[ParamSpec], dp: int, align: int = 1) -> ZeroPlan:
    """Assign Muon matrices whole by LPT, then fill the segments with flat AdamW elements.

    `align` rounds the segment length up (e.g. to keep NCCL chunks aligned).
    """
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    ranks = [RankShare() for _ in range(dp)]
    muon_elems = [0] * dp
    # LPT: largest cost first, each to the least-loaded rank; ties broken by index and
    # rank number, so every rank and every run computes the same plan.
    for spec in sorted((p for p in params if p.is_muon), key=lambda p: (-p.ns_cost, p.index)):
        rank = min(range(dp), key=lambda r: (ranks[r].ns_cost, muon_elems[r], r))
        ranks[rank].muon.append(Slice(spec.index, 0, spec.numel, -1))
        ranks[rank].ns_cost += spec.ns_cost
        muon_elems[rank] += spec.numel

    adamw = [p for p in params if not p.is_muon]
    total = sum(p.numel for p in params)
    segment = max(max(muon_elems), math.ceil(total / dp))
    segment = math.ceil(segment / align) * align

    # Fill each rank's segment after its Muon matrices with the next flat AdamW elements.
    pieces = iter([(p.index, p.numel) for p in adamw])
    current = next(pieces, None)
    taken = 0  # elements of `current` already placed
    for rank, share in enumerate(ranks):
        share.muon.sort(key=lambda s: s.param)
        offset = rank * segment
        placed = []
        for s in share.muon:
            placed.append(Slice(s.param, 0, s.length, offset))
            offset += s.length
        share.muon = placed
        room = (rank + 1) * segment - offset
        while current is not None and room > 0:
            index, numel = current
            length = min(room, numel - taken)
            share.adamw.append(Slice(index, taken, length, offset))
            offset += length
            room -= length
            taken += length
            if taken == numel:
                current, taken = next(pieces, None), 0
    if current is not None:
        raise AssertionError("ZeRO plan did not place every AdamW element")
    return ZeroPlan(dp=dp, segment=segment, ranks=ranks)
