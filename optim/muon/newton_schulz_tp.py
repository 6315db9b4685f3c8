"""Newton-Schulz of matrices split across a TP group, without gathering them (tp_mode=gram)."""
from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

from parallel.comm import Group, all_reduce
from optim.muon.newton_schulz import NORM_SAFETY, coefficients_for, gram_segments
from optim.muon.ns_method import NSShape, check_iteration, use_gram


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Sums run in fp32, or in fp64 for fp64 inputs (the reference tests)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def newton_schulz_sharded(
    X_shard: Tensor,
    split: int,
    group: Group,
    steps: int = 5,
    coefficients: str = "classic",
    dtype: torch.dtype = torch.bfloat16,
    eps: float = 1e-7,
    keep: Tensor | None = None,
    method: str = "standard",
    by_shape: Mapping[str, str] | None = None,
    iteration: str | None = None,
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

    method="gram" (Gram Newton-Schulz, see optim/muon/newton_schulz.py) all-reduces the Gram
    matrix once per restart segment instead of once per iteration: every later Gram matrix is
    a polynomial of it, computed alike on every rank, and the shard is multiplied by the
    accumulated polynomial Q at the segment's end (X_r Q for a rows split, Q X_c for a cols
    split). Used where gram_pays for the Gram side and the shard's other side; method="auto"
    uses it where `by_shape` maps the shard's key (NSShape(rows, cols, split), e.g.
    "384x2048_shard_rows") to "gram". `iteration` ("standard" or "gram"), where given, is
    the caller's resolved choice, as in newton_schulz.
    """
    coeffs = coefficients_for(coefficients, steps)
    acc = _accumulation_dtype(X_shard.dtype)
    sq = X_shard.to(acc).pow(2).sum(dim=(-2, -1), keepdim=True)
    norm = all_reduce(sq, group).sqrt_()
    denom = norm * NORM_SAFETY[coefficients] + eps
    if keep is not None:
        denom = denom / keep
    X = (X_shard.to(acc) / denom).to(dtype)
    if iteration is None:
        gram = use_gram(method, NSShape(X.shape[-2], X.shape[-1], split), len(coeffs), by_shape)
    else:
        gram = check_iteration(iteration) == "gram"
    if gram:
        return _gram_sharded(X, split, group, coeffs, dtype)
    for a, b, c in coeffs:
        gram = X.mT @ X if split == 0 else X @ X.mT
        # Summed in fp32: the Gram matrix is small, and its accuracy bounds the whole step.
        gram = all_reduce(gram.to(_accumulation_dtype(dtype)), group).to(dtype)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        X = torch.baddbmm(X, X, poly, beta=a) if split == 0 else torch.baddbmm(X, poly, X, beta=a)
    return X


def _gram_sharded(X: Tensor, split: int, group: Group, coeffs, dtype: torch.dtype) -> Tensor:
    """Gram Newton-Schulz on shards: one all-reduce of the Gram matrix per restart segment."""

    def reduced_gram(X: Tensor) -> Tensor:
        gram = X.mT @ X if split == 0 else X @ X.mT
        return all_reduce(gram.to(_accumulation_dtype(dtype)), group).to(dtype)

    def apply(Q: Tensor, X: Tensor) -> Tensor:
        return X @ Q if split == 0 else Q @ X

    Q, X = gram_segments(X, coeffs, reduced_gram, apply)
    return apply(Q, X)
