"""NorMuon (optim.muon.normuon) and Gram Newton-Schulz (optim.muon.ns_method=gram), each
against a reference written here from the papers' equations, and under DP (uneven ZeRO-1) and
TP (gather and gram modes) against single-process. Cautious weight decay, the third member of
the family, is tested in tests/test_cautious_wd.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from parallel.comm import COUNTER
from optim.muon import newton_schulz as NS
from optim.muon.optimizer import Muon
from optim.muon.newton_schulz import newton_schulz, muon_scale
from optim.muon.ns_method import gram_macs, gram_pays, standard_macs
from optim.muon.newton_schulz_tp import newton_schulz_sharded
from tests.distributed import run_distributed
from tests.test_distributed_muon import (CFG, optim_cfg, pair_batch, parallel_tolerance, single_process_floor,
                                        trained_pair)
from tests.closeness import approx, assert_close, check, check_relative

COEFFS = ["classic", "polar_express"]


def spread_matrices(batch: int, n: int, m: int, lo_exp: float, seed: int = 0) -> torch.Tensor:
    """fp64 [batch, n, m] matrices with singular values log-spaced over [10^lo_exp, 1]."""
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(batch, n, n, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(batch, m, n, generator=g, dtype=torch.float64))
    s = torch.logspace(0, lo_exp, n, dtype=torch.float64)
    return (U * s) @ V.mT


# ---------------------------------------------------------------- Gram Newton-Schulz


def test_gram_cost_model_matches_a_hand_count():
    # n = 2, m = 3, 5 steps. Standard: 5 * (2 * 4 * 3 + 8) = 160. Gram, restart after step 2:
    # segment 1: R (12) + step 0: R^2 (8) + ZRZ (16) + step 1: R^2 (8) + ZQ (8) + QX (12) = 64;
    # segment 2: R (12) + step 2: 8 + 16 + step 3: 8 + 8 + 16 + step 4: 8 + 8 + QX (12) = 96.
    assert standard_macs(2, 3, 5) == 160
    assert gram_macs(2, 3, 5) == 160
    assert not gram_pays(384, 384, 5) and not gram_pays(100, 150, 5)
    assert gram_pays(384, 1024, 5) and gram_pays(768, 3072, 5)
    assert gram_macs(768, 3072, 5) / standard_macs(768, 3072, 5) == approx(2 / 3)


@pytest.mark.parametrize("coefficients", COEFFS)
@pytest.mark.parametrize("shape", [(48, 128), (128, 48), (3, 24, 80), (2, 2, 16, 40)],
                         ids=["wide", "tall", "3d", "4d"])
def test_gram_equals_standard_newton_schulz_in_fp64(shape, coefficients, monkeypatch):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    calls = []
    monkeypatch.setattr(NS, "_iterate_gram", lambda *a, _f=NS._iterate_gram: calls.append(1) or _f(*a))
    standard = newton_schulz(G, 5, coefficients, torch.float64)
    gram = newton_schulz(G, 5, coefficients, torch.float64, method="gram")
    assert calls, "the Gram path was not taken"
    check("gram vs standard", ((gram - standard).abs().max() / standard.abs().max()).item(), 1e-9)


def test_square_matrices_stay_on_the_standard_iteration(monkeypatch):
    monkeypatch.setattr(NS, "_iterate_gram", lambda *a: pytest.fail("Gram path taken for a square matrix"))
    G = torch.randn(3, 32, 32, dtype=torch.float64)
    assert_close(newton_schulz(G, 5, "classic", torch.float64, method="gram"),
                               newton_schulz(G, 5, "classic", torch.float64), rtol=0, atol=0)


# Relative Frobenius distance of bf16 Gram Newton-Schulz from fp64 (standard) Newton-Schulz,
# worst of 4 matrices, measured on this CPU: classic / polar_express, Gram (standard bf16):
#   Gaussian 128 x 512:              0.017 / 0.076   (0.012 / 0.014)
#   singular values 1e-6..1:          0.155 / 0.227   (0.121 / 0.186)
#   rank 20 of 128:                  0.246 / 0.341   (0.274 / 0.418)
# Without the restart the spread case goes to 7.1 / 4552. The bounds below leave ~1.3x room.
BF16_BOUNDS = {
    "gaussian": {"classic": 0.03, "polar_express": 0.1},
    "spread": {"classic": 0.2, "polar_express": 0.3},
    "rank_deficient": {"classic": 0.35, "polar_express": 0.45},
}


def bf16_cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "gaussian": torch.randn(4, 128, 512, generator=g, dtype=torch.float64),
        "spread": spread_matrices(4, 128, 512, -6),
        "rank_deficient": torch.randn(4, 128, 20, generator=g, dtype=torch.float64)
        @ torch.randn(4, 20, 512, generator=g, dtype=torch.float64),
    }


def relative_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm(dim=(-2, -1)) / b.norm(dim=(-2, -1))).max().item()


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: torch sees no GPU")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("coefficients", COEFFS)
def test_bf16_gram_stays_within_its_bound_and_never_blows_up(coefficients, device):
    for name, G in bf16_cases().items():
        exact = newton_schulz(G, 5, coefficients, torch.float64)
        gram = newton_schulz(G.float().to(device), 5, coefficients, torch.bfloat16, method="gram").double().cpu()
        assert gram.isfinite().all(), name
        assert torch.linalg.matrix_norm(gram, 2).max() <= 1.35, name  # the band's top is 1.14
        assert relative_distance(gram, exact) <= BF16_BOUNDS[name][coefficients], name
    # On the well-conditioned matrices, as close to the polar factor U V^T as standard bf16.
    G = bf16_cases()["gaussian"]
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    polar = U @ Vh
    standard = newton_schulz(G.float().to(device), 5, coefficients, torch.bfloat16).double().cpu()
    gram = newton_schulz(G.float().to(device), 5, coefficients, torch.bfloat16, method="gram").double().cpu()
    assert relative_distance(gram, polar) <= relative_distance(standard, polar) + 0.02


def test_without_the_restart_bf16_gram_leaves_its_bound(monkeypatch):
    """The restart is what keeps half precision stable: the bound above must catch its loss."""
    monkeypatch.setattr(NS, "GRAM_RESTART_AFTER", ())
    G = bf16_cases()["spread"]
    exact = newton_schulz(G, 5, "classic", torch.float64)
    gram = newton_schulz(G.float(), 5, "classic", torch.bfloat16, method="gram").double()
    assert relative_distance(gram, exact) > 3 * BF16_BOUNDS["spread"]["classic"]


def _sharded_gram_worker(rank: int, world: int) -> dict:
    group = torch.distributed.group.WORLD
    out = {}
    # (full shape, split): cols split with the Gram matrix on the short rows, and rows split
    # with it on the short cols; both are cheaper under Gram on the shard.
    for full_shape, split in [((3, 12, 96), 1), ((3, 96, 12), 0)]:
        G = torch.randn(full_shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        shard = G.chunk(world, dim=1 + split)[rank]
        exact = newton_schulz(G, 5, "polar_express", torch.float64).chunk(world, dim=1 + split)[rank]
        result = {}
        for method in ("standard", "gram"):
            COUNTER.reset()
            got = newton_schulz_sharded(shard, split, group, 5, "polar_express", torch.float64, method=method)
            result[method] = (((got - exact).abs().max() / exact.abs().max()).item(),
                              sum(c for (_, op), c in COUNTER.calls.items() if op == "all_reduce"))
        out[split] = result
    return out


def test_sharded_gram_equals_the_gathered_iteration_with_one_all_reduce_per_segment():
    for per_rank in run_distributed(_sharded_gram_worker, 2):
        for split, result in per_rank.items():
            for method, (err, all_reduces) in result.items():
                check(f"{split} {method}", err, 1e-9)
            # one for the Frobenius norm, then one Gram matrix per iteration or per segment
            assert result["standard"][1] == 1 + 5, split
            assert result["gram"][1] == 1 + 2, split


# ---------------------------------------------------------------- NorMuon

LR, WD, MU, BETA2 = 0.05, 0.1, 0.95, 0.95


def normuon_reference(weights, grad_steps, beta2=BETA2, eps=1e-8):
    """Muon with NorMuon, transcribed from the equations (fp64), one matrix at a time.

    O = NS(G + mu M); per row (the matrix is tall or square) or per column (wide):
    v <- beta2 v + (1 - beta2) mean(O^2); O_hat = O / (sqrt(v) + eps);
    O' = O_hat ||O||_F / ||O_hat||_F; W <- W - lr wd W - lr scale O'."""
    out = []
    for w, grads in zip(weights, grad_steps):
        w = w.clone()
        mats = w.reshape(-1, *w.shape[-2:])
        rows, cols = mats.shape[-2:]
        m_buf = torch.zeros_like(mats)
        v = [None] * mats.shape[0]
        for g in grads:
            g = g.reshape(mats.shape)
            new = []
            for i in range(mats.shape[0]):
                m_buf[i] = MU * m_buf[i] + g[i]
                O = newton_schulz(g[i] + MU * m_buf[i], 5, "classic", torch.float64)
                per_row = rows >= cols
                mean = (O ** 2).mean(dim=1 if per_row else 0)
                v[i] = (1 - beta2) * mean if v[i] is None else beta2 * v[i] + (1 - beta2) * mean
                denom = v[i].sqrt() + eps
                O_hat = O / (denom[:, None] if per_row else denom[None, :])
                O_new = O_hat * O.norm() / O_hat.norm()
                new.append(mats[i] - LR * WD * mats[i] - LR * muon_scale(rows, cols, "match_rms_adamw") * O_new)
            mats = torch.stack(new)
        out.append(mats.reshape(w.shape))
    return out


def muon_steps(weights, grad_steps, found_inf=None, **kw):
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = Muon(params, lr=LR, weight_decay=WD, momentum=MU, ns_dtype=torch.float64, **kw)
    for step in range(len(grad_steps[0])):
        for p, grads in zip(params, grad_steps):
            p.grad = grads[step].clone()
        if found_inf is not None:
            opt.found_inf = found_inf
        opt.step()
    return [p.detach() for p in params], opt


@pytest.mark.parametrize("shape", [(12, 20), (20, 12), (3, 12, 20), (2, 20, 12)], ids=["wide", "tall", "3d-wide", "3d-tall"])
def test_normuon_equals_the_papers_equations(shape):
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(2)]
    # rows of very different gradient scale, so the per-row normalisation has work to do
    scale = torch.logspace(-1, 1, shape[-2], dtype=torch.float64)[:, None]
    grad_steps = [[torch.randn(shape, generator=g, dtype=torch.float64) * scale for _ in range(3)] for _ in weights]
    got, opt = muon_steps(weights, grad_steps, normuon=True, normuon_beta2=BETA2)
    want = normuon_reference(weights, grad_steps)
    for a, b in zip(got, want):
        check_relative("weights", a, b, 1e-6)
    plain, _ = muon_steps(weights, grad_steps)
    # NorMuon moved the weights somewhere else than Muon did (the test can tell them apart)
    assert all(((a - p).norm() / (p - w).norm()).item() > 1e-2 for a, p, w in zip(got, plain, weights))
    k, rows, cols = (shape[0] if len(shape) == 3 else 1), shape[-2], shape[-1]
    assert opt.state[opt.param_groups[0]["params"][0]]["normuon_v"].shape == (
        (k, rows, 1) if rows >= cols else (k, 1, cols))


def test_normuon_survives_a_skipped_first_step_and_a_state_dict_round_trip_in_bf16():
    p = torch.nn.Parameter(torch.randn(12, 20, dtype=torch.bfloat16))
    opt = Muon([p], lr=LR, weight_decay=WD, normuon=True, ns_dtype="fp32")
    p.grad = torch.full_like(p, float("nan"))
    opt.found_inf = torch.tensor(1.0)
    before = p.detach().clone()
    opt.step()  # skipped with v still zero: no NaN from 0 / 0
    assert torch.equal(p.detach(), before) and not opt.state[p]["normuon_v"].any()
    del opt.found_inf
    p.grad = torch.randn_like(p)
    opt.step()
    # torch's load_state_dict casts state to the parameter's dtype; the step puts v back in fp32
    again = Muon([p], lr=LR, weight_decay=WD, normuon=True, ns_dtype="fp32")
    again.load_state_dict(opt.state_dict())
    assert again.state[p]["normuon_v"].dtype == torch.bfloat16
    again.step()
    assert again.state[p]["normuon_v"].dtype == torch.float32 and p.detach().isfinite().all()


def test_normuon_skipped_step_changes_nothing():
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(12, 20, generator=g, dtype=torch.float64)]
    grads = [[torch.randn(12, 20, generator=g, dtype=torch.float64)]]
    _, opt = muon_steps(weights, grads, normuon=True)
    p = opt.param_groups[0]["params"][0]
    before = (p.detach().clone(), opt.state[p]["normuon_v"].clone(), opt.state[p]["momentum_buffer"].clone())
    p.grad = torch.full_like(p, float("nan"))
    opt.found_inf = torch.tensor(1.0, dtype=torch.float64)
    opt.step()
    after = (p.detach(), opt.state[p]["normuon_v"], opt.state[p]["momentum_buffer"])
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_normuon_state_goes_to_checkpoints_in_the_parameters_shape_and_back():
    from optim.optimizer_set import OptimizerSet

    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(2, 12, 20, generator=g), torch.randn(20, 12, generator=g)]
    grads = [[torch.randn(w.shape, generator=g)] for w in weights]
    _, opt = muon_steps(weights, grads, normuon=True)
    holder = OptimizerSet({"muon": opt})
    for p in opt.param_groups[0]["params"]:
        v = opt.state[p]["normuon_v"].clone()
        saved = holder.checkpoint_state("muon", p)
        assert saved["normuon_v"].shape == p.shape
        holder.install_checkpoint_state("muon", p, saved)
        assert torch.equal(opt.state[p]["normuon_v"], v) and opt.state[p]["normuon_v"].is_contiguous()


# ---------------------------------------------------------------- parallel == single process

# ffn_hidden 128: the MLP shards under TP=2 are 64 x 32 and 32 x 64, so Gram Newton-Schulz pays
# on the shards too and tp_mode=gram takes its one-all-reduce-per-segment path.
WIDE_CFG = dataclasses.replace(CFG, ffn_hidden=128)


def _option_worker(rank: int, world: int, tp: int, option: str, tp_mode: str) -> tuple[float, int, float]:
    """The worst relative parameter error against single-process, how many times this rank
    took a Gram iteration (whole-matrix or sharded): Gram and standard agree to fp32 rounding,
    so the error alone would not show a Gram path that is never taken; and the error's
    tolerance (tests/test_distributed_muon.py parallel_tolerance)."""
    import optim.muon.newton_schulz as ns
    import optim.muon.newton_schulz_tp as ns_tp

    gram_calls = []
    patched = ((ns, "_iterate_gram"), (ns_tp, "_gram_sharded"))
    originals = [getattr(module, name) for module, name in patched]
    for (module, name), real in zip(patched, originals):
        setattr(module, name, lambda *a, _f=real: gram_calls.append(1) or _f(*a))
    muon = {"normuon": {"normuon": True}, "gram": {"ns_method": "gram"}}[option]
    cfg = optim_cfg("muon", tp_mode=tp_mode, **muon)
    try:
        # gram_calls.clear: count the parallel run's calls only
        mesh, model, ref = trained_pair(cfg, tp, WIDE_CFG, after_reference=gram_calls.clear)
    finally:  # the rank's process serves later tests (tests/distributed.py)
        for (module, name), real in zip(patched, originals):
            setattr(module, name, real)
    worst = max(((full - ref[n]).norm() / ref[n].norm()).item() for n, full in model.items())
    tolerance = parallel_tolerance(single_process_floor(cfg, WIDE_CFG, pair_batch(mesh.dp)))
    return worst, len(gram_calls), tolerance


@pytest.mark.parametrize("option", ["normuon", "gram"])
@pytest.mark.parametrize("dp, tp, tp_mode", [
    (3, 1, "gather"), pytest.param(1, 2, "gather", marks=pytest.mark.slow), (1, 2, "gram"),
], ids=["dp3", "tp2-gather", "tp2-gram"])
def test_option_in_parallel_equals_single_process(option, dp, tp, tp_mode):
    """DP=3: uneven whole-matrix ownership (NorMuon's v lives with the owner). TP=2: each rank
    normalises its shard of O with the row sums or norms all-reduced over TP."""
    results = run_distributed(_option_worker, dp * tp, tp, option, tp_mode)
    for rank, (worst, _, tolerance) in enumerate(results):
        check(f"rank {rank}: relative parameter error", worst, tolerance)
    gram_calls = [calls for _, calls, _ in results]
    if option == "gram":  # under TP every rank iterates its shard; under DP the owners of MLP matrices
        assert all(gram_calls) if tp > 1 else any(gram_calls), gram_calls
    else:
        assert not any(gram_calls), gram_calls
