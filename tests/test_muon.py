"""optim.muon.Muon against torch.optim.Muon and against itself, one matrix at a time."""
from __future__ import annotations

import copy
import importlib
import io

import pytest
import torch
import torch.optim._muon as torch_muon_module

import optim.muon.optimizer as muon_module
from eval.step_census import census
from optim.muon.optimizer import Muon
from tests.closeness import assert_close, check

NS = importlib.import_module("optim.muon.newton_schulz")
BUFFERS = importlib.import_module("optim.muon.buffers")

# The last two take the fp32 symmetric-block path on CPU (min side >= 128).
SHAPES_2D = [(64, 32), (32, 64), (48, 48), (96, 40), (160, 128), (128, 192)]


class _Fp32Instead(torch.Tensor):
    """torch.optim.Muon hard-codes grad.bfloat16() in its Newton-Schulz. Handing it this
    subclass makes that one call return a plain fp32 copy, so torch's own iteration code runs
    in fp32 and can be compared with ours at fp32 precision."""

    def bfloat16(self, memory_format=torch.preserve_format):  # noqa: ARG002
        return self.as_subclass(torch.Tensor).clone()


@pytest.fixture
def torch_muon_fp32(monkeypatch):
    original = torch_muon_module._zeropower_via_newtonschulz

    def fp32_ns(grad, *args, **kwargs):
        out = original(grad.as_subclass(_Fp32Instead), *args, **kwargs)
        assert out.dtype == torch.float32 and type(out) is torch.Tensor
        return out

    monkeypatch.setattr(torch_muon_module, "_zeropower_via_newtonschulz", fp32_ns)


def _params(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g) * 0.05) for s in shapes]


def _grads(params, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g) for p in params] for _ in range(steps)]


def _run(opt, params, grads):
    for step_grads in grads:
        for p, gr in zip(params, step_grads):
            p.grad = gr.clone()
        opt.step()


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr, torch_fn", [("match_rms_adamw", "match_rms_adamw"), ("spectral", "original")])
def test_matches_torch_muon_fp32(torch_muon_fp32, adjust_lr, torch_fn, nesterov):
    ours, theirs = _params(SHAPES_2D), _params(SHAPES_2D)
    start = [p.detach().clone() for p in ours]
    grads = _grads(ours, steps=5)
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov, ns_steps=5, eps=1e-7)
    _run(Muon(ours, ns_dtype="fp32", adjust_lr=adjust_lr, **kw), ours, grads)
    _run(torch.optim.Muon(theirs, adjust_lr_fn=torch_fn, **kw), theirs, grads)
    for a, b, w0 in zip(ours, theirs, start):
        # Compare the accumulated change W_5 - W_0 (comparing W would hide errors behind W_0).
        # torch keeps M as an EMA ((1 - mu) times ours) and normalises by max(||G||, eps)
        # instead of ||G|| + eps; both vanish in the normalisation up to ~1e-7 relative.
        check("update", _rel(a.detach() - w0, b.detach() - w0), 1e-5)


def test_matches_torch_muon_bf16_loosely():
    """Unpatched torch.optim.Muon (bf16 Newton-Schulz) vs ours in bf16: same algorithm, but
    bf16 rounding (8-bit mantissa) differs between the two op orders, ~1% of the update. Each
    is that far from the fp32 update, so the two are held to a multiple of our own bf16 update's
    distance from our fp32 one (seen: 1.2-1.4x it; at most about 2x, one rounding each way).
    A wrong scale or a missed step is off by 10% and more."""
    ours, theirs, fp32 = _params(SHAPES_2D), _params(SHAPES_2D), _params(SHAPES_2D)
    start = [p.detach().clone() for p in ours]
    grads = _grads(ours, steps=3)
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5)
    _run(Muon(ours, ns_dtype=torch.bfloat16, **kw), ours, grads)
    _run(torch.optim.Muon(theirs, adjust_lr_fn="match_rms_adamw", **kw), theirs, grads)
    _run(Muon(fp32, ns_dtype="fp32", **kw), fp32, grads)
    for a, b, exact, w0 in zip(ours, theirs, fp32, start):
        bf16_rounding = _rel(a.detach() - w0, exact.detach() - w0)
        assert 1e-3 < bf16_rounding < 3e-2  # bf16's rounding, neither none nor more
        check("update", _rel(a.detach() - w0, b.detach() - w0), 4 * bf16_rounding)


@pytest.mark.parametrize("ns_dtype", ["fp32", "bf16"])
def test_batched_step_equals_per_parameter_optimizers(ns_dtype):
    # Three [48, 80] and two tall [80, 48] matrices land in one stack of five.
    shapes = [(48, 80), (80, 48), (48, 80), (80, 48), (48, 80), (32, 32)]
    together, alone = _params(shapes), _params(shapes)
    grads = _grads(together, steps=3)
    kw = dict(lr=0.01, weight_decay=0.05, ns_dtype=ns_dtype, coefficients="polar_express")
    _run(Muon(together, **kw), together, grads)
    for i, p in enumerate(alone):
        _run(Muon([p], **kw), [p], [[g[i]] for g in grads])
    for a, b in zip(together, alone):
        # Bitwise equal on CPU here; GEMM blocking may depend on the batch size elsewhere,
        # and in bf16 that can flip a rounding (updates are ~2e-2, bf16 ulp there ~1e-4).
        assert_close(a, b, rtol=0, atol=1e-7 if ns_dtype == "fp32" else 2e-4)


def _count_ns_calls(monkeypatch):
    calls = []
    original = muon_module.newton_schulz

    def counting(G, *args, **kwargs):
        calls.append(tuple(G.shape))
        return original(G, *args, **kwargs)

    monkeypatch.setattr(muon_module, "newton_schulz", counting)
    return calls


def test_one_batched_newton_schulz_call_per_shape(monkeypatch):
    """Same (rows, cols) and Newton-Schulz settings: one stack, across params and groups
    (with different lr / weight decay), and the result equals per-parameter optimizers."""
    monkeypatch.setattr(BUFFERS, "CPU_WORKING_SET_BYTES", None)  # CPU runs off: one call per shape
    calls = _count_ns_calls(monkeypatch)
    shapes = [(48, 80), (80, 48), (48, 80), (96, 40), (80, 48), (48, 80), (2, 48, 80)]
    together, alone = _params(shapes), _params(shapes)

    def groups(ps):
        return [
            {"params": ps[:3], "lr": 0.02},
            {"params": ps[3:4], "split_rows": 16},  # [96, 40] -> six [16, 40] heads
            {"params": ps[4:], "weight_decay": 0.3},
        ]

    grads = _grads(together, steps=2)
    kw = dict(lr=0.01, weight_decay=0.1, ns_dtype="fp32")
    _run(Muon(groups(together), **kw), together, grads)
    assert sorted(calls) == sorted([(5, 48, 80), (2, 80, 48), (6, 16, 40)] * 2)
    for i, p in enumerate(alone):
        (group,) = [g for g in groups(alone) if any(q is p for q in g["params"])]
        _run(Muon([{**group, "params": [p]}], **kw), [p], [[g[i]] for g in grads])
    for a, b in zip(together, alone):
        assert_close(a, b, rtol=0, atol=1e-7)


def test_cpu_runs_equal_one_stack(monkeypatch):
    shapes = [(48, 80)] * 5 + [(80, 48)] * 3
    runs, whole = _params(shapes), _params(shapes)
    grads = _grads(runs, steps=2)
    monkeypatch.setattr(BUFFERS, "CPU_WORKING_SET_BYTES", 1)  # one matrix per run
    calls = _count_ns_calls(monkeypatch)
    _run(Muon(runs, lr=0.02, ns_dtype="fp32"), runs, grads)
    assert len(calls) == 2 * 8 and all(c[0] == 1 for c in calls)
    monkeypatch.setattr(BUFFERS, "CPU_WORKING_SET_BYTES", None)
    _run(Muon(whole, lr=0.02, ns_dtype="fp32"), whole, grads)
    for a, b in zip(runs, whole):
        assert_close(a, b, rtol=0, atol=1e-7)


def test_three_dim_expert_param_equals_per_expert_muon():
    experts = _params([(4, 40, 24)])[0]
    singles = [torch.nn.Parameter(experts.detach()[e].clone()) for e in range(4)]
    grads = _grads([experts], steps=3)
    kw = dict(lr=0.02, weight_decay=0.1, ns_dtype="fp32", adjust_lr="spectral")
    _run(Muon([experts], **kw), [experts], grads)
    for e, p in enumerate(singles):
        _run(Muon([p], **kw), [p], [[g[0][e]] for g in grads])
        assert_close(experts.detach()[e], p.detach(), rtol=0, atol=1e-7)


@pytest.mark.parametrize("adjust_lr", ["match_rms_adamw", "spectral"])
def test_split_rows_equals_per_head_muon(adjust_lr):
    heads, h = 6, 16
    w = _params([(heads * h, 40)])[0]
    per_head = [torch.nn.Parameter(w.detach()[i * h : (i + 1) * h].clone()) for i in range(heads)]
    grads = _grads([w], steps=3)
    kw = dict(lr=0.02, weight_decay=0.1, ns_dtype="fp32", adjust_lr=adjust_lr)
    _run(Muon([{"params": [w], "split_rows": h}], **kw), [w], grads)
    for i, p in enumerate(per_head):
        _run(Muon([p], **kw), [p], [[g[0][i * h : (i + 1) * h]] for g in grads])
        assert_close(w.detach()[i * h : (i + 1) * h], p.detach(), rtol=0, atol=1e-7)
    # The scale used (h, C), not (R, C): a whole-matrix Muon moves the weights differently.
    whole = _params([(heads * h, 40)])[0]
    _run(Muon([whole], **kw), [whole], grads)
    assert not torch.allclose(whole, w, rtol=0, atol=1e-4)


@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (128, 128), (3, 64, 96)], ids=str)
def test_update_rms_matches_adamw_scale(shape):
    p = _params([shape])[0]
    before = p.detach().clone()
    p.grad = torch.randn(shape)
    Muon([p], lr=1e-2, weight_decay=0.0).step()  # defaults: bf16, match_rms_adamw
    rms = ((p.detach() - before) / 1e-2).pow(2).mean().sqrt().item()
    assert 0.15 < rms < 0.25, rms


def _snapshot(params):
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("through_bytes", [False, True])
def test_state_dict_round_trip_resumes_identically(through_bytes):
    shapes = [(48, 80), (80, 48), (2, 24, 40), (64, 32)]
    params = _params(shapes)
    groups = [{"params": params[:3]}, {"params": params[3:], "split_rows": 16, "weight_decay": 0.0}]
    opt = Muon(groups, lr=0.02, weight_decay=0.1, coefficients="polar_express")
    grads = _grads(params, steps=5)
    _run(opt, params, grads[:3])
    saved_params, saved_state = _snapshot(params), copy.deepcopy(opt.state_dict())
    _run(opt, params, grads[3:])

    resumed = [torch.nn.Parameter(t.clone()) for t in saved_params]
    opt2 = Muon(
        [{"params": resumed[:3]}, {"params": resumed[3:], "split_rows": 16, "weight_decay": 0.0}],
        lr=0.02, weight_decay=0.1, coefficients="polar_express",
    )
    if through_bytes:
        buffer = io.BytesIO()
        torch.save(saved_state, buffer)
        buffer.seek(0)
        saved_state = torch.load(buffer, weights_only=True)
    opt2.load_state_dict(saved_state)
    assert opt2.param_groups[1]["split_rows"] == 16
    _run(opt2, resumed, grads[3:])
    for a, b in zip(params, resumed):
        assert torch.equal(a, b)
    buf = opt2.state[resumed[0]]["momentum_buffer"]
    assert buf.dtype == torch.float32 and buf.shape == resumed[0].shape


def test_params_without_grad_are_skipped_and_closure_runs():
    a, b = _params([(16, 24), (24, 16)])
    b_before = b.detach().clone()
    opt = Muon([a, b], lr=0.1)

    def closure():
        a.grad = torch.ones_like(a)
        return 3.0

    assert opt.step(closure) == 3.0
    assert torch.equal(b, b_before) and b not in opt.state
    assert "momentum_buffer" in opt.state[a]


def test_ns_dtype_accepts_strings_and_dtypes():
    p = _params([(8, 8)])
    assert Muon(p, ns_dtype="bf16").param_groups[0]["ns_dtype"] == torch.bfloat16
    assert Muon(p, ns_dtype="fp32").param_groups[0]["ns_dtype"] == torch.float32
    assert Muon(p, ns_dtype=torch.float32).param_groups[0]["ns_dtype"] == torch.float32


@pytest.mark.parametrize(
    "kwargs, key",
    [
        (dict(lr=-1.0), "optim.muon.lr"),
        (dict(weight_decay=-0.1), "optim.muon.weight_decay"),
        (dict(momentum=1.0), "optim.muon.momentum"),
        (dict(momentum=-0.1), "optim.muon.momentum"),
        (dict(nesterov="yes"), "optim.muon.nesterov"),
        (dict(ns_steps=0), "optim.muon.ns_steps"),
        (dict(ns_steps=2.5), "optim.muon.ns_steps"),
        (dict(coefficients="quintic"), "optim.muon.coefficients"),
        (dict(ns_dtype="fp8"), "optim.muon.ns_dtype"),
        (dict(ns_dtype=torch.int32), "optim.muon.ns_dtype"),
        (dict(adjust_lr="original"), "optim.muon.adjust_lr"),
        (dict(eps=0.0), "optim.muon.eps"),
    ],
)
def test_invalid_options_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        Muon(_params([(8, 8)]), **kwargs)
    # The same value given per group is rejected too.
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        Muon([{"params": _params([(8, 8)]), **kwargs}])


def test_invalid_shapes_and_split_rows():
    with pytest.raises(ValueError, match="optim.muon.split_rows"):
        Muon([{"params": _params([(48, 8)]), "split_rows": 7}])
    with pytest.raises(ValueError, match="optim.muon.split_rows"):
        Muon([{"params": _params([(48, 8)]), "split_rows": 0}])
    with pytest.raises(ValueError, match="2-D"):
        Muon(_params([(8,)]))
    with pytest.raises(ValueError, match="2-D"):
        Muon(_params([(2, 2, 4, 4)]))


def _step_with(opt, params, grads, found_inf):
    for p, gr in zip(params, grads):
        p.grad = gr.clone()
    if found_inf is not None:
        opt.found_inf = found_inf
    opt.step()
    opt.__dict__.pop("found_inf", None)


@pytest.mark.parametrize("nesterov", [True, False])
def test_found_inf_skips_on_the_device_and_otherwise_changes_nothing(nesterov):
    """found_inf (as OptimizerSet.step hands it over) = 1: parameters and momentum are left
    exactly as they were, NaN gradients included; = 0: the same step as without it."""
    shapes = [(48, 80), (80, 48), (3, 16, 24), (64, 32)]
    groups = lambda ps: [{"params": ps[:3]}, {"params": ps[3:], "split_rows": 16, "weight_decay": 0.0}]  # noqa: E731
    kw = dict(lr=0.02, weight_decay=0.1, nesterov=nesterov, ns_dtype="fp32")
    gated, plain = _params(shapes), _params(shapes)
    opt_gated, opt_plain = Muon(groups(gated), **kw), Muon(groups(plain), **kw)
    first, second = _grads(gated, steps=2)
    _step_with(opt_gated, gated, first, torch.zeros(()))
    _step_with(opt_plain, plain, first, None)
    for a, b in zip(gated, plain):
        # The gated weight decay factor is computed in fp32, the plain one in double.
        assert_close(a, b, rtol=1e-6, atol=1e-7)

    before = [p.detach().clone() for p in gated]
    momentum = [opt_gated.state[p]["momentum_buffer"].clone() for p in gated]
    poisoned = [g.clone() for g in second]
    poisoned[0][3, 5], poisoned[2][1, 0, 0] = float("nan"), float("inf")
    _step_with(opt_gated, gated, poisoned, torch.ones(()))
    for p, b, m in zip(gated, before, momentum):
        assert torch.equal(p, b)
        assert torch.equal(opt_gated.state[p]["momentum_buffer"], m)

    # The skipped step left no trace: the next step equals the plain optimizer's.
    _step_with(opt_gated, gated, second, torch.zeros(()))
    _step_with(opt_plain, plain, second, None)
    for a, b in zip(gated, plain):
        assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("nesterov, ns_dtype, combo", [(True, "fp32", False), (False, "fp32", False),
                                                      (True, "bf16", False), (True, "bf16", True)])
def test_compiled_updates_equal_the_eager_ones(nesterov, ns_dtype, combo):
    """compile_updates runs the elementwise work as fused compiled kernels (for GPUs); on the
    CPU's compiler here it must compute what the eager for-each path does, gate included.
    With bf16 Newton-Schulz the fused update reads the last iterate in bf16, where the eager
    path casts it into the fp32 stack first: the same values. Combo kernels (on a GPU, several
    kernels a launch) change the launches, not the values."""
    from optim.muon.buffers import _CPU_BUFFERS, release_buffers

    release_buffers()
    shapes = [(48, 80), (80, 48), (3, 16, 24), (48, 80)]
    groups = lambda ps: [{"params": ps[:3]}, {"params": ps[3:], "weight_decay": 0.0}]  # noqa: E731
    kw = dict(lr=0.02, weight_decay=0.1, nesterov=nesterov, ns_dtype=ns_dtype)
    fused, eager = _params(shapes), _params(shapes)
    opt_fused = Muon(groups(fused), compile_updates=True, combo_kernels=combo, **kw)
    opt_eager = Muon(groups(eager), **kw)
    grads = _grads(fused, steps=3)
    grads[1][2][0, 1, 1] = float("nan")
    from torch._dynamo.utils import counters

    for i, (step_grads, found_inf) in enumerate(zip(grads, [None, torch.ones(()), torch.zeros(())])):
        for group in opt_fused.param_groups + opt_eager.param_groups:
            group["lr"] = 0.02 / (1 + i)  # a schedule: the lr must not be baked into a kernel
        before = [p.detach().clone() for p in fused]
        compiled_before = counters["stats"]["unique_graphs"]
        _step_with(opt_fused, fused, step_grads, found_inf)
        if i > 0:  # every step after the first reuses its compiled kernels
            assert counters["stats"]["unique_graphs"] == compiled_before
        _step_with(opt_eager, eager, step_grads, found_inf)
        for a, b in zip(fused, eager):
            assert_close(a, b, rtol=1e-6, atol=1e-7)
        if found_inf is not None and found_inf.item():
            assert all(torch.equal(a, b) for a, b in zip(fused, before))
    for a, b in zip(fused, eager):
        assert_close(opt_fused.state[a]["momentum_buffer"], opt_eager.state[b]["momentum_buffer"],
                                   rtol=1e-6, atol=1e-7)
    if combo:  # compiled with combo kernels (muon_fused.compiled's cache key says so)
        from optim.muon import fused as muon_fused
        from optim.muon.update import apply_update, momentum

        assert (apply_update, True) in muon_fused._COMPILED and (momentum, True) in muon_fused._COMPILED
    bf16_out = [key for key in _CPU_BUFFERS.cache if key[0] == "muon.ortho"]
    assert bool(bf16_out) == (ns_dtype == "bf16") and all(key[3] == torch.bfloat16 for key in bf16_out)


def test_the_compiled_normalisation_rounds_like_the_eager_one():
    """compile_updates normalises the Newton-Schulz input in compiled kernels: the same bf16
    X0 as the eager division (its norm summed in another order: at most one bf16 step apart,
    and nearly always equal), and zero for a skipped step."""
    from optim.muon import fused as muon_fused
    from optim.muon.newton_schulz import _normalise

    G = torch.randn(6, 48, 80, generator=torch.Generator().manual_seed(0)) * 3.0
    eager, fused = torch.empty(G.shape, dtype=torch.bfloat16), torch.empty(G.shape, dtype=torch.bfloat16)
    _normalise(G, eager, 1.02, 1e-7)
    muon_fused.compiled(muon_fused.normalise)(G, fused, 1.02, 1e-7, torch.ones(()))
    differ = (eager != fused).float().mean().item()
    check("share of elements that differ", differ, 1e-3)
    assert_close(fused.float(), eager.float(), rtol=2 ** -7, atol=0)
    muon_fused.compiled(muon_fused.normalise)(G, fused, 1.02, 1e-7, torch.zeros(()))
    assert not fused.float().abs().max().item()


# Each Newton-Schulz call on a stack launches, whatever the stack's size (as eval/step_census.py
# counts ops: top-level aten ops that do work, each one kernel on a GPU):
#   normalisation: ||G||_F (linalg_vector_norm), + eps (add_), G / that into X (div): 3
#   standard, per step: A = X X^T (bmm), B = bA + cAA and X' = aX + BX (2 baddbmm): 5 x 3 = 15
#   Gram (5 steps, restart after the 2nd), per restart segment R = X X^T and at its end Q X
#     (2 x 2 bmm); per step Z = aI + bR + cR^2 (baddbmm, and add_ on the diagonal); Z Q in a
#     segment's later steps (1 + 2, written `@`: matmul); Z R Z in all but a segment's last
#     (2 x (1 + 2) matmul): 4 bmm + 9 matmul (13 batched GEMMs), 5 baddbmm, 5 add_
# with fp32 parameters, fp32 iteration and the classic coefficients (no safety factor, no
# cast): no other kernel. Three stacks, one square (standard either way), one wide, one tall.
# On a GPU the whole call becomes one graph launch with cuda_graphs; this keeps the count
# behind that launch from growing back unnoticed.
NS_KERNELS = {
    "standard": {"aten::linalg_vector_norm": 3, "aten::add_": 3, "aten::div": 3, "aten::bmm": 3 * 5,
                 "aten::baddbmm": 3 * 10},
    "gram": {"aten::linalg_vector_norm": 3, "aten::add_": 3 + 2 * 5, "aten::div": 3, "aten::bmm": 5 + 2 * 4,
             "aten::matmul": 2 * 9, "aten::baddbmm": 10 + 2 * 5},
}


@pytest.mark.parametrize("method", ["standard", "gram"])
def test_newton_schulz_kernels_per_muon_step(method, monkeypatch):
    # gpt_124m's three stacks in small: 768 x 768 (48), 768 x 2048 (12), 2048 x 768 (24).
    shapes = [(16, 16)] * 4 + [(16, 40)] + [(40, 16)] * 2
    params = _params(shapes)
    for p, g in zip(params, _grads(params, steps=1)[0]):
        p.grad = g
    opt = Muon(params, lr=0.02, ns_dtype="fp32", ns_method=method)
    calls = []
    original = muon_module.newton_schulz
    monkeypatch.setattr(muon_module, "newton_schulz", lambda *a, **k: calls.append((a, k)) or original(*a, **k))
    opt.step()
    assert len(calls) == 3  # one per stack
    # The step's Newton-Schulz calls again, as one profiled step: only what they launch.
    counted = census(lambda: [original(*a, **k) for a, k in calls], torch.device("cpu"), steps=1)
    assert dict(counted.op_names) == NS_KERNELS[method]
