"""One Muon step, written as plainly as the maths: the oracle the tests hold the optimizer to
(tests/test_muon_reference.py; the distributed engines are held to the optimizer in turn).

No stacks, shards, buffers, gates or kernels: one weight matrix at a time (a 3-D expert stack
matrix by matrix, a head-split matrix head by head), in whatever dtype it is given (fp64 for an
oracle). It covers what changes a single process's arithmetic for plain Muon: momentum and
Nesterov, the coefficient sets, the lr scales and decoupled weight decay. NorMuon's
normalisation and the weight-decay variants have tests of their own.

It stays an independent oracle, not a per-matrix caller of optim/muon/update.py's phases: a
mistake in a phase (an operand order, a gate, a scale) would otherwise be in the expected value
too, and the test would pass. It shares only the coefficient tables, which tests/test_newton_schulz.py
pins to their published values, and the tests hold it to an fp64 SVD as well.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from optim.muon.newton_schulz import COEFFICIENTS, NORM_SAFETY


def orthogonalise(G: Tensor, steps: int, coefficients: str, eps: float) -> Tensor:
    """The Newton-Schulz approximation of G's polar factor, for one rows x cols matrix."""
    X = G / (torch.linalg.matrix_norm(G) * NORM_SAFETY[coefficients] + eps)
    tall = X.shape[0] > X.shape[1]
    if tall:  # iterate on the wide form, so that A is the smaller square
        X = X.T
    table = COEFFICIENTS[coefficients]
    for step in range(steps):
        a, b, c = table[min(step, len(table) - 1)]  # past the table's end its last entry repeats
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def lr_scale(rows: int, cols: int, adjust_lr: str) -> float:
    """The multiplier on lr for a rows x cols update."""
    return {"match_rms_adamw": 0.2 * math.sqrt(max(rows, cols)),
            "spectral": math.sqrt(max(1.0, rows / cols)),
            "none": 1.0}[adjust_lr]


def muon_step(W: Tensor, G: Tensor, M: Tensor, lr: float, weight_decay: float, momentum: float = 0.95,
              nesterov: bool = True, ns_steps: int = 5, coefficients: str = "classic",
              adjust_lr: str = "match_rms_adamw", eps: float = 1e-7,
              split_rows: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """(W, M) after one step with gradient G, for W of shape [rows, cols] or [experts, rows,
    cols]; `split_rows`: orthogonalise (and scale) each block of that many rows on its own."""
    if W.dim() == 3:
        steps = [muon_step(w, g, m, lr, weight_decay, momentum, nesterov, ns_steps, coefficients, adjust_lr,
                           eps, split_rows) for w, g, m in zip(W, G, M)]
        return torch.stack([w for w, _ in steps]), torch.stack([m for _, m in steps])
    M = momentum * M + G
    U = G + momentum * M if nesterov else M
    rows = split_rows or U.shape[0]
    O = torch.cat([orthogonalise(block, ns_steps, coefficients, eps) for block in U.split(rows)])
    W = W * (1 - lr * weight_decay) - lr * lr_scale(rows, U.shape[1], adjust_lr) * O
    return W, M
