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
"""
from __future__ import annotations

import torch
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
