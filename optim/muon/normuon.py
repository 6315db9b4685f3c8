"""NorMuon (Li et al. 2025, arXiv 2510.05491): per-neuron normalisation of Muon's orthogonalised
update (optim.muon.normuon).

Newton-Schulz gives every singular direction the same size, but not every row (neuron): the
rows of O can differ a lot in norm. NorMuon keeps an exponential average v of each row's mean
square, divides each row by sqrt(v) + eps, and rescales the result to O's Frobenius norm, so
the update keeps Muon's RMS (and our match_rms_adamw scale still applies on top):

    m = mean(O * O over the reduced dimension)      one entry per row (or column)
    v = beta2 * v + (1 - beta2) * m
    O' = O / (sqrt(v) + eps) * ||O||_F / ||O / (sqrt(v) + eps)||_F

Which dimension: as in nanochat, the mean runs over the columns of a tall or square matrix
(v per row) and over the rows of a wide one (v per column), so v has max(rows, cols) entries
per matrix. The choice is made on the full matrix, not on a TP shard, so every layout keeps the
same v. A constant factor on v cancels in the rescale, so v needs no bias correction.

Under TP each rank holds its shard of O and its shard of v (the part that lies along its
rows or columns; the whole v where the split runs along the reduced dimension): one
all-reduce of a small tensor completes either the row sums or the two norms.

Under FSDP2 (normalise_rows) a rank holds a range of rows of a parameter, cut without regard
to where its matrices begin: with optim.muon.split_heads one attention head's rows may lie on
two ranks. The sums are then taken per matrix over whichever rows a rank holds and completed
by all-reduces over the groups that split the matrix, as above.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from parallel.comm import Group, all_reduce

# Added to sqrt(v) (the paper's epsilon). v is a mean square of O's entries, about
# 1 / max(rows, cols), so this only matters for an all-zero update (a skipped step).
EPS = 1e-8


def reduced_dim(rows: int, cols: int) -> int:
    """The matrix dimension NorMuon averages over for a full rows x cols matrix: -1 (columns,
    v per row) when rows >= cols, else -2 (rows, v per column)."""
    return -1 if rows >= cols else -2


def state_shape(k: int, rows: int, cols: int, full_rows: int, full_cols: int) -> tuple[int, int, int]:
    """v's shape for k local rows x cols matrices that are shards of full_rows x full_cols ones."""
    return (k, rows, 1) if reduced_dim(full_rows, full_cols) == -1 else (k, 1, cols)


def normalise(
    O: Tensor, v: Tensor, beta2: float, full_rows: int, full_cols: int,
    split: int | None = None, group: Group = None, keep: Tensor | None = None,
) -> None:
    """NorMuon on a stack O [N, rows, cols] in place, updating v (fp32, state_shape) in place.

    `split` (0: rows, 1: cols) and `group`: O is this rank's shard of N full_rows x full_cols
    matrices split over `group`. `keep` (0-d, 1 or 0): 0 leaves v as it was (a skipped step,
    whose O is zero and stays zero).
    """
    red = reduced_dim(full_rows, full_cols)
    sums = O.float().square().sum(dim=red, keepdim=True)
    if split is not None and (split == 1) == (red == -1):
        sums = all_reduce(sums, group)  # the reduced dimension is the split one
    mean = sums / (full_cols if red == -1 else full_rows)
    weight = (1.0 - beta2) if keep is None else (1.0 - beta2) * keep
    v.lerp_(mean, weight)
    step = v.sqrt().add_(EPS).reciprocal_()
    norms = torch.stack([sums.sum(dim=(-2, -1)), (sums * step.square()).sum(dim=(-2, -1))])
    if split is not None and (split == 0) == (red == -1):
        norms = all_reduce(norms, group)  # each rank holds its own rows' (columns') entries
    rescale = (norms[0] / norms[1].clamp_min(1e-30)).sqrt()
    O.mul_((step * rescale[:, None, None]).to(O.dtype))



@dataclass(frozen=True)
class RowShard:
    """This rank's rows [first, first + count) of a parameter whose rows are `segments`
    matrices of `segment_rows` rows each (one matrix, or one per attention head), each the
    local part of a full_rows x full_cols matrix (TP may split the matrix further)."""

    first: int
    count: int
    segment_rows: int
    segments: int
    full_rows: int
    full_cols: int

    @property
    def per_row(self) -> bool:
        """v per row (averaged over the columns), else per column of each matrix."""
        return reduced_dim(self.full_rows, self.full_cols) == -1

    def state_shape(self, cols: int) -> tuple[int, int]:
        """v: [count, 1] per row, or [segments, cols] per column of every matrix of the
        parameter (small, so every rank keeps them all; it only uses those its rows meet)."""
        return (self.count, 1) if self.per_row else (self.segments, cols)

    def _touched(self) -> tuple[int, int, int]:
        """(first matrix, matrices met, rows of padding before `first`) of this rank's rows."""
        if self.count == 0:
            return 0, 0, 0
        lead = self.first % self.segment_rows
        met = -(-(lead + self.count) // self.segment_rows)
        return self.first // self.segment_rows, met, lead

    def per_matrix(self, x: Tensor) -> Tensor:
        """[count, ...] per row -> [segments, ...] summed over each matrix's rows held here
        (zero for the matrices this rank holds no row of). Zero-padding to whole matrices
        keeps the sums in a fixed order, with no atomics."""
        s0, met, lead = self._touched()
        out = x.new_zeros(self.segments, *x.shape[1:])
        if met:
            trail = met * self.segment_rows - lead - self.count
            padded = F.pad(x, (0, 0) * (x.dim() - 1) + (lead, trail))
            out[s0 : s0 + met] = padded.view(met, self.segment_rows, *x.shape[1:]).sum(dim=1)
        return out

    def per_row_of(self, x: Tensor) -> Tensor:
        """[segments, ...] per matrix -> [count, ...]: each of this rank's rows gets its matrix's."""
        s0, met, lead = self._touched()
        return x[s0 : s0 + met].repeat_interleave(self.segment_rows, dim=0)[lead : lead + self.count]

    def export(self, v: Tensor, cols: int) -> Tensor:
        """v in the parameter's local shape [count, cols], as checkpoints hold it."""
        return v.expand(self.count, cols) if self.per_row else self.per_row_of(v)

    def restore(self, rows: Tensor) -> Tensor:
        """The inverse of export (fp32): a matrix this rank holds no row of gets zeros, which
        it never reads."""
        rows = rows.float()
        if self.per_row:
            return rows[:, :1].contiguous()
        s0, met, lead = self._touched()
        v = rows.new_zeros(self.segments, rows.shape[1])
        for s in range(met):  # any of the matrix's rows here holds its v
            v[s0 + s] = rows[max(0, s * self.segment_rows - lead)]
        return v


def normalise_rows(
    O: Tensor, v: Tensor, beta2: float, shard: RowShard, row_groups: Sequence[Group] = (),
    col_group: Group = None, keep: Tensor | None = None,
) -> None:
    """NorMuon in place on this rank's rows O [count, cols] of a parameter laid out as `shard`
    says, updating v (fp32, shard.state_shape) in place.

    `row_groups`: the groups whose ranks hold the matrices' other rows (FSDP2's shard group,
    and TP's where it splits a matrix's rows); `col_group`: the group holding its other
    columns (TP's where it splits them). `keep` as in normalise.
    """
    square = O.float().square()
    weight = (1.0 - beta2) if keep is None else (1.0 - beta2) * keep
    if shard.per_row:
        sums = all_reduce(square.sum(dim=-1, keepdim=True), col_group)  # [count, 1]
        v.lerp_(sums / shard.full_cols, weight)
        step = v.sqrt().add_(EPS).reciprocal_()
        norms = shard.per_matrix(torch.cat([sums, sums * step.square()], dim=-1))  # [segments, 2]
        for group in row_groups:
            norms = all_reduce(norms, group)
    else:
        sums = shard.per_matrix(square)  # [segments, cols]
        for group in row_groups:
            sums = all_reduce(sums, group)
        v.lerp_(sums / shard.full_rows, weight)
        step = v.sqrt().add_(EPS).reciprocal_()
        norms = all_reduce(torch.stack([sums.sum(dim=-1), (sums * step.square()).sum(dim=-1)], dim=-1), col_group)
        step = shard.per_row_of(step)
    rescale = (norms[:, 0] / norms[:, 1].clamp_min(1e-30)).sqrt()
    O.mul_((step * shard.per_row_of(rescale)[:, None]).to(O.dtype))
