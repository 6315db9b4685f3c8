"""Muon against the plain reference step (optim/muon/reference.py), in fp64, for every option
that changes a single process's arithmetic; and the reference's Newton-Schulz against an fp64
SVD. The distributed engines are held to Muon in their own tests (parallel == single process),
so the reference is the oracle for all of them."""
from __future__ import annotations

import pytest
import torch

from optim.muon.optimizer import Muon
from optim.muon.reference import muon_step, orthogonalise
from tests.closeness import assert_close, check

LR, WD, STEPS = 0.02, 0.1, 3
SHAPES = [(24, 40), (40, 24), (32, 32), (3, 16, 24)]


def tensors(shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]


def train_both(shapes, options: dict, split_rows=None):
    """STEPS steps of Muon and of the reference from the same weights and gradients."""
    start = [0.1 * w for w in tensors(shapes, 0)]
    grads = [tensors(shapes, 1 + step) for step in range(STEPS)]
    params = [torch.nn.Parameter(w.clone()) for w in start]
    opt = Muon([{"params": params, "split_rows": split_rows}], lr=LR, weight_decay=WD, ns_dtype=torch.float64,
               **options)
    weights, momenta = [w.clone() for w in start], [torch.zeros_like(w) for w in start]
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
        for i, g in enumerate(step_grads):
            weights[i], momenta[i] = muon_step(weights[i], g, momenta[i], LR, WD, split_rows=split_rows, **options)
    return params, weights, start


@pytest.mark.parametrize("options", [
    {},
    {"nesterov": False},
    {"coefficients": "polar_express"},
    {"adjust_lr": "spectral", "ns_steps": 3},
    {"adjust_lr": "none", "momentum": 0.9, "eps": 1e-5},
], ids=["defaults", "no-nesterov", "polar-express", "spectral-3-steps", "none-momentum-eps"])
def test_muon_takes_the_reference_steps(options):
    params, weights, start = train_both(SHAPES, options)
    for p, w, w0 in zip(params, weights, start):
        # The change from the start, so that the weights' own size hides nothing; fp64 on both
        # sides, so only summation order separates them (~1e-15 relative).
        assert_close(p.detach() - w0, w - w0, rtol=1e-10, atol=1e-12)


def test_a_head_split_matrix_takes_the_reference_steps_head_by_head():
    params, weights, start = train_both([(48, 20), (48, 32)], {}, split_rows=16)
    for p, w, w0 in zip(params, weights, start):
        assert_close(p.detach() - w0, w - w0, rtol=1e-10, atol=1e-12)
    # The split is real: whole-matrix steps differ.
    whole = train_both([(48, 20)], {})[1][0]
    assert (whole - weights[0]).abs().max() > 1e-4


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_the_reference_newton_schulz_keeps_the_singular_vectors_and_bounds_the_values(shape):
    """Against an fp64 SVD G = U S V^T: U^T O V is diagonal (the iteration is an odd polynomial
    in G, so it keeps the singular vectors), and the classic quintic's diagonal lies in the
    band it is known to leave the values in after 5 steps, about [0.68, 1.13]."""
    G = tensors([shape], 7)[0]
    U, S, Vh = torch.linalg.svd(G, full_matrices=False)
    inner = U.T @ orthogonalise(G, 5, "classic", 1e-7) @ Vh.T
    off = inner - torch.diag(torch.diagonal(inner))
    check("off-diagonal", off.abs().max().item(), 1e-12)
    values = torch.diagonal(inner)
    assert values.min() > 0.6 and values.max() < 1.2, values
    # Polar Express converges: its values close in on 1.
    polar = torch.diagonal(U.T @ orthogonalise(G, 5, "polar_express", 1e-7) @ Vh.T)
    assert (polar - 1).abs().max() < (values - 1).abs().max()
