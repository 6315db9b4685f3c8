"""Cautious weight decay (optim.cautious_wd): the decay acts only where the update and the weight
agree in sign, checked against a masked reference, for Muon (eager and compiled) and AdamW,
and under DP (uneven ZeRO-1) and TP against single-process."""
from __future__ import annotations

import pytest
import torch

from optim.adamw import CautiousAdamW
from optim.muon.optimizer import Muon
from tests.distributed import run_distributed
from tests.test_distributed_muon import (optim_cfg, pair_batch, parallel_tolerance, single_process_floor,
                                        trained_pair)
from tests.closeness import assert_close, check

LR, WD = 0.05, 0.5


def params_and_grads(shape=(12, 20), n=2):
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(n)]
    grads = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(n)]
    return weights, grads


def stepped(make_opt, weights, grads, found_inf=None):
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = make_opt(params)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    if found_inf is not None:
        opt.found_inf = found_inf
    opt.step()
    return [p.detach() for p in params]


def masked_reference(weights, without_decay):
    """W - lr * wd * W * [u * W > 0], with u's sign that of W - (the step without decay)."""
    out = []
    for w, plain in zip(weights, without_decay):
        agree = (w - plain) * w > 0
        out.append(plain - LR * WD * w * agree)
    return out


def muon(**kw):
    return lambda ps: Muon(ps, lr=LR, ns_dtype=ps[0].dtype, **kw)


def adamw(cautious: bool, wd: float):
    cls = CautiousAdamW if cautious else torch.optim.AdamW
    return lambda ps: cls(ps, lr=LR, weight_decay=wd, fused=True)


@pytest.mark.parametrize("compiled, dtype", [(False, torch.float64), (True, torch.float32)], ids=["eager", "compiled"])
def test_muon_decays_only_where_update_and_weight_agree(compiled, dtype):
    weights, grads = params_and_grads()
    weights, grads = [w.to(dtype) for w in weights], [g.to(dtype) for g in grads]
    plain = stepped(muon(weight_decay=0.0), weights, grads)
    cautious = stepped(muon(weight_decay=WD, cautious_wd=True, compile_updates=compiled), weights, grads)
    # fp64 eagerly; the compiled kernels take the decay as an fp32 scalar, as for fp32 weights
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    for got, want in zip(cautious, masked_reference(weights, plain)):
        assert_close(got, want, rtol=tol, atol=tol)
    # neither all nor none of the coordinates decayed: the mask is doing something
    decayed = [((w - p) * w > 0).float().mean().item() for w, p in zip(weights, plain)]
    assert all(0.2 < f < 0.8 for f in decayed), decayed
    full = stepped(muon(weight_decay=WD), weights, grads)
    assert all((c - f).abs().max() > 1e-3 for c, f in zip(cautious, full))


def test_adamw_decays_only_where_update_and_weight_agree():
    weights, grads = params_and_grads()
    # fp32: torch's fused AdamW has no fp64 kernel on every device; the reference is fp32 too
    weights, grads = [w.float() for w in weights], [g.float() for g in grads]
    plain = stepped(adamw(False, 0.0), weights, grads)
    cautious = stepped(adamw(True, WD), weights, grads)
    for got, want in zip(cautious, masked_reference(weights, plain)):
        assert_close(got, want, rtol=1e-6, atol=1e-7)
    full = stepped(adamw(False, WD), weights, grads)
    assert all((c - f).abs().max() > 1e-3 for c, f in zip(cautious, full))


@pytest.mark.parametrize("make_opt", [
    muon(weight_decay=WD, cautious_wd=True), adamw(True, WD),
], ids=["muon", "adamw"])
def test_a_skipped_step_decays_nothing(make_opt):
    weights, grads = params_and_grads()
    weights, grads = [w.float() for w in weights], [g.float() for g in grads]
    grads[0][0, 0] = float("nan")
    kept = stepped(make_opt, weights, grads, found_inf=torch.tensor(1.0))
    assert all(torch.equal(k, w) for k, w in zip(kept, weights))


# Above fp32 noise: the most any element of these runs moves without cautious decay is < 1e-6.
FLIP_FLOOR = 1e-6


def _parallel_worker(rank: int, world: int, tp: int, name: str, tp_mode: str) -> dict:
    """Five steps with cautious decay under DP x TP and in one process, every parameter compared
    element by element."""
    cfg = optim_cfg(name, cautious_wd=True, tp_mode=tp_mode)
    entering: list[dict[str, torch.Tensor]] = []
    mesh, model, ref = trained_pair(cfg, tp, reference_weights=entering)
    worst, outliers, elements = 0.0, [], 0
    for n, full in model.items():
        diff = (full - ref[n]).abs()
        far = diff > FLIP_FLOOR
        # the most that flipped decisions can move an element: every decay the run could apply
        decays = sum(cfg.lr * cfg.weight_decay * w[n].abs() for w in entering)
        outliers += [(n, d, bound) for d, bound in zip(diff[far].tolist(), decays[far].tolist())]
        near = torch.where(far, 0.0, full - ref[n])
        worst = max(worst, (near.norm() / ref[n].norm()).item())
        elements += full.numel()
    return {"worst": worst, "outliers": outliers, "elements": elements,
            "tolerance": parallel_tolerance(single_process_floor(cfg, global_batch=pair_batch(mesh.dp)))}


@pytest.mark.parametrize("dp, tp, name, tp_mode", [
    (3, 1, "muon", "gather"), (3, 1, "adamw", "gather"), (1, 2, "muon", "gather"), (1, 2, "muon", "gram"),
])
def test_cautious_decay_in_parallel_equals_single_process(dp, tp, name, tp_mode):
    """DP=3: uneven whole-matrix ownership and AdamW pieces cut across parameters.

    The mask is a sign test, so where u * w is within fp32 summation noise of 0 the parallel
    and single-process runs may decide a coordinate differently, at any of the five steps; that
    coordinate then ends at most lr * wd * |w| apart, summed over the steps. Without cautious
    decay no element of this comparison is over 1e-6 off (6 seeds), so any element past that
    must be such a flip: within its bound, and rare. A mask that is wrong on a shard, a row or a
    matrix moves hundreds of elements by a decay each. Every other element agrees to fp32 noise
    (a flip of a small weight can be under 1e-5 yet still lift the relative error over it), held
    to a multiple of the single process's own summation floor (tests/test_distributed_muon.py)."""
    results = run_distributed(_parallel_worker, dp * tp, tp, name, tp_mode)
    for rank, r in enumerate(results):
        check(f"rank {rank}: relative parameter error", r["worst"], r["tolerance"])
        assert len(r["outliers"]) <= r["elements"] // 4000, r["outliers"]
        assert all(d <= bound + FLIP_FLOOR for _, d, bound in r["outliers"]), r["outliers"]
