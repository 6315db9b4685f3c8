"""Newton-Schulz of matrices split across a TP group, without gathering them (tp_mode=gram)."""
from __future__ import annotations

import torch
from torch import Tensor

from model.comm import Group, all_reduce
from optim.newton_schulz import NORM_SAFETY, coefficients_for


def newton_schulz_sharded(
    X_shard: Tensor,
    split: int,
    group: Group,
    steps: int = 5,
    coefficients: str = "classic",
    dtype: torch.dtype = torch.bfloat16,
    eps: float = 1e-7,
    keep: Tensor | None = None,
) -> Tensor:
    """This rank's shard of Newton-Schulz(X) for the N full matrices X split over `group`.

    X_shard is this rank's [N, rows, cols] part, split along matrix dimension `split`
    (0: rows, 1: cols). The quintic step p(X) = aX + b XX^TX + c XX^TXX^TX can be written
    with either Gram matrix, and one of them is a sum over the shards:
      rows split:  G = X^T X = sum_r X_r^T X_r  (cols x cols),  X_r <- a X_r + X_r (bG + cG^2)
      cols split:  A = X X^T = sum_c X_c X_c^T  (rows x rows),  X_c <- a X_c + (bA + cA^2) X_c
    so each iteration all-reduces one small Gram matrix and keeps the update local. The
    Frobenius norm is all-reduced once. Returns the shard in `dtype`. `keep` gates the result
    as in newton_schulz (0: zeros).
    """
    coeffs = coefficients_for(coefficients, steps)
    sq = X_shard.float().pow(2).sum(dim=(-2, -1), keepdim=True)
    norm = all_reduce(sq, group).sqrt_()
    denom = norm * NORM_SAFETY[coefficients] + eps
    if keep is not None:
        denom = denom / keep
    X = (X_shard.float() / denom).to(dtype)
    for a, b, c in coeffs:
        gram = X.mT @ X if split == 0 else X @ X.mT
        # Summed in fp32: the Gram matrix is small, and its accuracy bounds the whole step.
        gram = all_reduce(gram.float(), group).to(dtype)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        X = torch.baddbmm(X, X, poly, beta=a) if split == 0 else torch.baddbmm(X, poly, X, beta=a)
    return X
