"""Newton-Schulz against the exact polar factor U V^T (fp64 SVD)."""
from __future__ import annotations

import contextlib
import importlib
import math
import weakref

import pytest
import torch

from optim.muon.newton_schulz import (
    COEFFICIENTS,
    NORM_SAFETY,
    coefficients_for,
    muon_scale,
    newton_schulz,
)

from optim.muon.update import MomentumSetting, momentum
from tests.matmul_precision import true_fp32_matmuls  # noqa: F401 (a fixture, requested by name)
from tests.closeness import approx, assert_close, check

# The module itself (optim/__init__ keeps `optim.muon.newton_schulz` free of re-exports, but be safe).
NS = importlib.import_module("optim.muon.newton_schulz")
BUFFERS = importlib.import_module("optim.muon.buffers")

# Square, wide, tall, batched 3-D. Square Gaussian matrices have sigma_min / ||G||_F ~ n^-1.5,
# far below what 5 steps can lift, so every test matrix gets a controlled spectrum: singular
# values spread over [0.2, 1] (times a random scale), i.e. sigma / ||G||_F >= 0.2 / sqrt(k) >= 0.018.
SHAPES = [(96, 96), (48, 128), (128, 48), (3, 40, 72), (2, 2, 64, 24)]

# Expected singular-value bands after 5 steps. They are the range of the composed scalar
# polynomial p5(...p1(s)) over s in [0.01, 1] (evaluated on a fine grid, and checked by
# test_band_constants_match_the_scalar_polynomials below):
#   classic:        [0.6818, 1.1344]
#   polar_express:  [0.8589, 1.1411]  (it keeps a deliberate +-14% cushion for bf16 safety, but
#                                      lifts small singular values much further: a band 0.28
#                                      wide instead of 0.45, and half the distance to U V^T)
BANDS = {"classic": (0.6818, 1.1344), "polar_express": (0.8589, 1.1411)}
# fp32 only perturbs the polynomial by rounding; bf16 (8-bit mantissa) by up to 0.004 measured.
MARGIN = {torch.float32: 2e-3, torch.bfloat16: 0.02}
# Relative Frobenius distance to U V^T: bounded by the band's worst deviation from 1, measured
# ~0.21 (classic) and ~0.09 (polar_express) on these matrices.
POLAR_DISTANCE = {"classic": 0.25, "polar_express": 0.12}


def _matrices(shape, seed=0, lo=0.2):
    """fp64 matrices of `shape` with singular values spread over [lo, 1] * a random scale."""
    g = torch.Generator().manual_seed(seed)
    *lead, m, n = shape
    k = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(*lead, m, k, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(*lead, n, k, generator=g, dtype=torch.float64))
    s = torch.linspace(1.0, lo, k, dtype=torch.float64)
    s = s[torch.randperm(k, generator=g)] * (0.1 + 10 * torch.rand((), generator=g, dtype=torch.float64))
    return (U * s) @ V.mT


def _svd(G):
    U, S, Vh = torch.linalg.svd(G, full_matrices=False)
    return U, S, Vh


def _composed(s, name, steps=5):
    x = s.clone()
    for a, b, c in coefficients_for(name, steps):
        x = a * x + b * x**3 + c * x**5
    return x


# The same bounds hold on CUDA: bf16 tensor cores accumulate in fp32, like the CPU kernels.
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: torch sees no GPU")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["classic", "polar_express"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_singular_values_in_band_and_vectors_match_svd(shape, name, dtype, device, true_fp32_matmuls):
    G = _matrices(shape)
    O = newton_schulz(G.float().to(device), steps=5, coefficients=name, dtype=dtype)
    assert O.shape == G.shape and O.dtype == torch.float32 and O.device.type == device
    O = O.double().cpu()

    lo, hi = BANDS[name]
    sv = torch.linalg.svdvals(O)
    assert sv.min() >= lo - MARGIN[dtype], sv.min()
    assert sv.max() <= hi + MARGIN[dtype], sv.max()

    U, S, Vh = _svd(G)
    polar = U @ Vh
    dist = torch.linalg.matrix_norm(O - polar) / torch.linalg.matrix_norm(polar)
    assert dist.max() < POLAR_DISTANCE[name], dist
    # Singular vectors: in the SVD basis of G, NS(G) must be diagonal (U^T O V = diag(p(s))).
    inner = U.mT @ O @ Vh.mT
    off = inner - torch.diag_embed(torch.diagonal(inner, dim1=-2, dim2=-1))
    rel_off = torch.linalg.matrix_norm(off) / torch.linalg.matrix_norm(inner)
    assert rel_off.max() < (1e-5 if dtype == torch.float32 else 3e-2), rel_off


# m >= 128: on CPU in fp32 these take the symmetric block path (see _symmetric_blocks).
LARGE_SHAPES = [(128, 200), (200, 128), (2, 160, 160)]


@pytest.mark.parametrize("name", ["classic", "polar_express"])
@pytest.mark.parametrize("shape", SHAPES + LARGE_SHAPES, ids=str)
def test_fp32_equals_scalar_polynomial_on_the_svd(shape, name):
    """NS(G) = U diag(p(s / (||G||_F * safety + eps))) V^T, exactly up to fp32 rounding."""
    G = _matrices(shape, seed=1)
    eps = 1e-7
    O = newton_schulz(G.float(), steps=5, coefficients=name, dtype=torch.float32, eps=eps).double()
    U, S, Vh = _svd(G)
    norm = torch.linalg.matrix_norm(G)[..., None]
    expected = (U * _composed(S / (norm * NORM_SAFETY[name] + eps), name)[..., None, :]) @ Vh
    err = torch.linalg.matrix_norm(O - expected) / torch.linalg.matrix_norm(expected)
    check("error", err.max().item(), 2e-5)


def test_band_constants_match_the_scalar_polynomials():
    s = torch.logspace(-2, 0, 200_001, dtype=torch.float64)
    for name, (lo, hi) in BANDS.items():
        p = _composed(s, name)
        assert p.min().item() == approx(lo, abs=1e-4)
        assert p.max().item() == approx(hi, abs=1e-4)


def test_more_steps_converge_further_with_polar_express():
    G = _matrices((64, 96), seed=2, lo=0.05)
    U, _, Vh = _svd(G)
    polar = U @ Vh
    dists = [
        (torch.linalg.matrix_norm(newton_schulz(G.float(), s, "polar_express", torch.float32).double() - polar)
         / math.sqrt(64)).item()
        for s in (5, 6, 8)
    ]
    assert dists[0] > dists[1] > dists[2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(5, 48, 80), (2, 3, 80, 48)], ids=str)
def test_batched_equals_per_matrix(shape, dtype):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    batched = newton_schulz(G, 5, "polar_express", dtype)
    flat = G.reshape(-1, *shape[-2:])
    single = torch.stack([newton_schulz(g, 5, "polar_express", dtype) for g in flat]).view(shape)
    # Same arithmetic per matrix; only the GEMM kernel's blocking may differ with batch size.
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert_close(batched, single, rtol=0, atol=tol)


@pytest.mark.parametrize("shape", [(3, 200, 136), (3, 136, 200)], ids=str)
def test_symmetric_block_products_equal_full_products(shape, monkeypatch):
    """The blocked products are the full ones up to fp32 rounding. Which rounding depends on
    the CPU's GEMM kernels (their K blocking differs with the output's shape), so the bound is
    the fp32 error of the full products themselves, against fp64 full products: a fixed 1e-6
    held on an AVX2 CPU and failed on an AVX-512 one, where the full products' own fp32 error
    is 1.7e-6. A wrong or unmirrored block is off by ~0.1."""
    G = torch.randn(shape, generator=torch.Generator().manual_seed(6))
    assert BUFFERS._symmetric_blocks(136, torch.float32, torch.device("cpu")) is not None
    blocked = newton_schulz(G, 5, "polar_express", torch.float32)
    monkeypatch.setattr(BUFFERS, "_SYMMETRIC_BLOCK_ROWS", 10**9)
    assert BUFFERS._symmetric_blocks(136, torch.float32, torch.device("cpu")) is None
    full = newton_schulz(G, 5, "polar_express", torch.float32)
    exact = newton_schulz(G.double(), 5, "polar_express", torch.float64)  # full products too
    fp32_error = (full.double() - exact).abs().max().item()
    assert 0 < fp32_error < 1e-5
    # A multiple of that error: the blocked products' own error was seen at 1.0-1.1x the full ones'.
    check("blocked vs exact", (blocked.double() - exact).abs().max().item(), 4 * fp32_error)
    assert_close(blocked, full, rtol=0, atol=4 * fp32_error)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_runs_equal_one_batch(dtype, monkeypatch):
    """On CPU the batch is processed in cache-sized runs; that must not change the result."""
    G = torch.randn(7, 40, 72, generator=torch.Generator().manual_seed(7))
    monkeypatch.setattr(BUFFERS, "CPU_WORKING_SET_BYTES", None)
    assert BUFFERS.batch_chunk(40, 72, dtype, "cpu") is None
    whole = newton_schulz(G, 5, "classic", dtype)
    monkeypatch.setattr(BUFFERS, "CPU_WORKING_SET_BYTES", 1)  # runs of one matrix
    assert BUFFERS.batch_chunk(40, 72, dtype, "cpu") == 1
    runs = newton_schulz(G, 5, "classic", dtype)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert_close(runs, whole, rtol=0, atol=tol)


def test_batch_chunk_has_no_limit_off_cpu():
    assert BUFFERS.batch_chunk(384, 1024, torch.bfloat16, "meta") is None
    assert BUFFERS.batch_chunk(384, 1024, torch.bfloat16, "cpu") >= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_out_may_be_the_input(dtype, monkeypatch):
    monkeypatch.setattr(BUFFERS, "CPU_WORKING_SET_BYTES", 1)  # several runs through the same buffer
    G = torch.randn(4, 72, 40, generator=torch.Generator().manual_seed(8))
    expected = newton_schulz(G, 5, "classic", dtype)
    inplace = G.clone()
    assert newton_schulz(inplace, 5, "classic", dtype, out=inplace) is inplace
    assert_close(inplace, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tall_is_transpose_of_wide(dtype):
    G = torch.randn(4, 40, 100, generator=torch.Generator().manual_seed(4))
    wide = newton_schulz(G, 5, "classic", dtype)
    tall = newton_schulz(G.mT.contiguous(), 5, "classic", dtype)
    assert tall.shape == (4, 100, 40)
    # Tall matrices run the transposed iteration (X^T X, X B): the same products, but the
    # GEMMs see transposed operands, so the fp32 summation order can differ: by how much depends
    # on the CPU's kernels, so in fp32 the bound is a multiple of the wide result's own fp32
    # error against fp64 (seen: the two within 1.3x of that error). A wrong transpose is off by ~1.
    if dtype == torch.float32:
        fp32_error = (wide.double() - newton_schulz(G.double(), 5, "classic", torch.float64)).abs().max().item()
        assert 0 < fp32_error < 1e-5
        tol = 4 * fp32_error
    else:
        tol = 1e-2
    assert_close(tall, wide.mT, rtol=0, atol=tol)


def test_input_untouched_dtype_kept_and_zero_matrix_finite():
    G = torch.randn(2, 32, 48, dtype=torch.float64)
    before = G.clone()
    out = newton_schulz(G, dtype=torch.bfloat16)
    assert torch.equal(G, before) and out.dtype == torch.float64
    assert newton_schulz(G, dtype=torch.float32, out_dtype=torch.bfloat16).dtype == torch.bfloat16
    zero = newton_schulz(torch.zeros(16, 8))
    assert torch.equal(zero, torch.zeros(16, 8))
    with pytest.raises(ValueError, match="rows, cols"):
        newton_schulz(torch.randn(8))


def test_coefficient_tables():
    assert coefficients_for("classic", 5) == [(3.4445, -4.7750, 2.0315)] * 5
    pe = coefficients_for("polar_express", 7)
    assert pe[:5] == COEFFICIENTS["polar_express"] and pe[5] == pe[6] == pe[4]
    assert pe[0] == (8.156554524902461, -22.48329292557795, 15.878769915207462)
    assert len(coefficients_for("polar_express", 3)) == 3


def test_unknown_coefficient_set_errors():
    # The config's check is this one (optim/muon/options.py calls it): the same line at the CLI.
    msg = "optim.muon.coefficients: unknown value 'x' (expected one of classic, polar_express)"
    with pytest.raises(ValueError) as info:
        coefficients_for("x", 5)
    assert str(info.value) == msg
    with pytest.raises(ValueError, match="optim.muon.coefficients: unknown value 'x'"):
        newton_schulz(torch.randn(4, 4), coefficients="x")
    with pytest.raises(ValueError, match="optim.muon.ns_steps"):
        coefficients_for("classic", 0)


def test_muon_scale():
    assert muon_scale(1024, 384, "match_rms_adamw") == approx(0.2 * 32)
    assert muon_scale(384, 1024, "match_rms_adamw") == approx(0.2 * 32)
    assert muon_scale(1024, 256, "spectral") == approx(2.0)
    assert muon_scale(256, 1024, "spectral") == 1.0
    assert muon_scale(5, 7, "none") == 1.0
    with pytest.raises(ValueError, match="optim.muon.adjust_lr"):
        muon_scale(4, 4, "original")


@pytest.mark.parametrize("nesterov", [True, False])
def test_momentum(nesterov):
    """optim/muon/update.py's momentum phase: the buffers and the Newton-Schulz inputs, written
    into one stack in order, against the formula; and a gated step: keep == 1 rounds exactly as
    no gate, keep == 0 (a NaN gradient) leaves every buffer as it was and no NaN in the stack."""
    g = torch.Generator().manual_seed(5)
    shapes = [(6, 5), (3, 7), (2, 4, 3)]
    bufs = [torch.randn(s, generator=g) for s in shapes]
    grads = [torch.randn(s, generator=g) for s in shapes]
    expected_bufs = [0.9 * b + gr for b, gr in zip(bufs, grads)]
    expected = [gr + 0.9 * b for b, gr in zip(expected_bufs, grads)] if nesterov else expected_bufs
    setting = MomentumSetting(0.9, nesterov)
    runs = {}
    for keep in (None, torch.ones(())):
        bufs_in = [b.clone() for b in bufs]
        stack = torch.full((30 + 21 + 24,), float("nan"))
        outs = momentum(bufs_in, grads, stack, setting, keep)
        assert [o.shape for o in outs] == [torch.Size(s) for s in shapes]
        assert [o.data_ptr() for o in outs] == [stack[:1].data_ptr() + 4 * k for k in (0, 30, 51)]
        for b, o, eb, e in zip(bufs_in, outs, expected_bufs, expected):
            assert_close(b, eb)
            assert_close(o, e)
        runs[keep is None] = (bufs_in, stack)
    assert all(torch.equal(a, b) for a, b in zip(runs[True][0], runs[False][0]))
    assert torch.equal(runs[True][1], runs[False][1])
    bufs_in = [b.clone() for b in bufs]
    bad = [gr.clone() for gr in grads]
    bad[1][0, 0] = float("nan")
    stack = torch.empty(30 + 21 + 24)
    momentum(bufs_in, bad, stack, setting, torch.zeros(()))
    assert all(torch.equal(b, b0) for b, b0 in zip(bufs_in, bufs))
    assert torch.isfinite(stack).all()


# ---------------------------------------------------------------- CUDA graphs (optim/muon/ns_graphs.py)
#
# A recorded CUDA graph reruns its kernels on the tensors it was recorded with. On the CPU the
# same contract is emulated: "recording" binds the eager iteration to those exact tensors and
# "replay" reruns it on them. That checks everything but the recording itself: which calls
# record, when a graph is replayed, the gate copied in before each replay, out aliasing G.
# The gpu-marked tests below replay real graphs against the eager kernels.

from optim.muon import ns_graphs  # noqa: E402


@pytest.fixture
def emulated_graphs(monkeypatch):
    monkeypatch.setattr(ns_graphs, "DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(ns_graphs, "_capture", lambda eager, G, out, keep: (lambda: eager(G, out, keep)))
    ns_graphs.clear()
    yield
    ns_graphs.clear()


def _replay_against_eager(device: str, dtype: torch.dtype, shape: tuple[int, ...], in_place: bool, gated: bool,
                          method: str = "standard") -> None:
    """Three calls through the graph path on the same buffers, new data (and gate) each
    time, each equal to the eager iteration on the same input; exactly one graph recorded."""
    gen = torch.Generator().manual_seed(11)
    G = torch.empty(shape, device=device)
    out = G if in_place else torch.empty(shape, device=device)
    keeps = [1.0, 0.0, 1.0]
    for call, keep_value in enumerate(keeps):
        G.copy_(torch.randn(shape, generator=gen))
        keep = torch.tensor(keep_value, device=device) if gated else None
        expected = newton_schulz(G.clone(), 5, "polar_express", dtype, keep=keep, method=method)
        got = newton_schulz(G, 5, "polar_express", dtype, out=out, keep=keep, method=method, graph=True)
        assert got is out
        assert_close(got, expected, rtol=0, atol=0)
        if gated and keep_value == 0:
            assert not got.any()
        assert ns_graphs._CACHE.recorded == (0 if call == 0 else 1), call


@pytest.mark.parametrize("in_place", [True, False], ids=["out_is_G", "own_out"])
@pytest.mark.parametrize("gated", [True, False], ids=["keep", "no_keep"])
@pytest.mark.parametrize("shape, method", [((3, 24, 40), "standard"), ((3, 40, 24), "standard"), ((2, 24, 64), "gram")],
                         ids=["wide", "tall", "gram"])
def test_graph_path_replays_equal_eager_calls_emulated(emulated_graphs, shape, method, gated, in_place):
    _replay_against_eager("cpu", torch.float32, shape, in_place, gated, method)


def test_graph_path_records_nothing_for_moving_buffers_or_when_it_must_not(emulated_graphs, monkeypatch):
    G = torch.randn(2, 16, 24)
    expected = newton_schulz(G, 5, "classic", torch.float32)
    outs = [torch.empty_like(G) for _ in range(3)]  # all alive: three addresses
    for out in outs:  # another `out` every call: a graph recorded for one would never replay
        assert_close(newton_schulz(G, 5, "classic", torch.float32, out=out, graph=True),
                                   expected, rtol=0, atol=0)
    assert ns_graphs._CACHE.recorded == 0
    out = torch.empty_like(G)
    monkeypatch.setattr(ns_graphs, "ENABLED", False)  # the switch for comparisons: all calls eager
    for _ in range(3):
        newton_schulz(G, 5, "classic", torch.float32, out=out, graph=True)
    assert ns_graphs._CACHE.recorded == 0
    monkeypatch.setattr(ns_graphs, "ENABLED", True)
    # Under torch.compile's tracing the eager kernels must be traced, not a graph's replay.
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not ns_graphs.usable(torch.device("cpu"))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    assert ns_graphs.usable(torch.device("cpu")) and not ns_graphs.usable(torch.device("meta"))


def test_a_changed_setting_records_its_own_graph(emulated_graphs):
    G, out = torch.randn(2, 16, 24), torch.empty(2, 16, 24)
    for coefficients in ("classic", "polar_express", "classic", "polar_express"):
        got = newton_schulz(G, 5, coefficients, torch.float32, out=out, graph=True)
        assert_close(got, newton_schulz(G, 5, coefficients, torch.float32), rtol=0, atol=0)
    assert ns_graphs._CACHE.recorded == 2


@contextlib.contextmanager
def matmul_flag(name: str, value: bool):
    """torch.backends.cuda.matmul.<name> = value for a block, then as it was."""
    matmul = torch.backends.cuda.matmul
    before = getattr(matmul, name)
    setattr(matmul, name, value)
    try:
        yield
    finally:
        setattr(matmul, name, before)


@pytest.mark.parametrize("flag", ["allow_tf32", "allow_bf16_reduced_precision_reduction"])
def test_a_changed_matmul_flag_records_its_own_graph(flag, monkeypatch, emulated_graphs):
    """One job of a sweep records its graphs with TF32 off, the next turns it on: the second
    must not replay the first's graph, whose GEMMs cuBLAS chose under the other flags."""
    replayed = []  # the flag's value when each replayed graph was recorded

    def capture(eager, G, out, keep):
        recorded_under = getattr(torch.backends.cuda.matmul, flag)
        return lambda: replayed.append(recorded_under) or eager(G, out, keep)

    monkeypatch.setattr(ns_graphs, "_capture", capture)
    G, out = torch.randn(2, 16, 24), torch.empty(2, 16, 24)
    for value in (False, True):
        with matmul_flag(flag, value):
            for _ in range(2):  # eager, then recorded and replayed
                newton_schulz(G, 5, "classic", torch.float32, out=out, graph=True)
    assert replayed == [False, True]
    assert ns_graphs._CACHE.recorded == 2


def test_the_end_of_a_job_releases_the_graphs_and_the_kept_buffers(emulated_graphs):
    """A sweep's next job must neither replay this job's graphs nor find its GPU memory held:
    end_job drops both, and nothing else keeps the stacks alive."""
    from optim.muon.optimizer import Muon
    from trainer.run import launch
    from trainer.device import tf32_flags

    params = [torch.nn.Parameter(torch.randn(16, 24)) for _ in range(3)]
    opt = Muon(params, lr=0.02, ns_dtype="fp32", cuda_graphs=True)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    assert ns_graphs._CACHE.recorded == 1 and len(ns_graphs._CACHE.graphs) == 1
    kept = list(BUFFERS._CPU_BUFFERS.cache.values())
    assert any(b.shape == (3, 16, 24) for b in kept)  # the Muon stack the graph runs on
    alive = [weakref.ref(b) for b in kept]
    del kept
    launch.end_job(None, True, tf32_flags())
    assert not ns_graphs._CACHE.graphs and not ns_graphs._CACHE.seen and ns_graphs._CACHE.recorded == 0
    assert not BUFFERS._CPU_BUFFERS.cache
    assert [r() for r in alive] == [None] * len(alive)


def test_the_next_job_records_into_a_new_pool_on_the_same_stream(monkeypatch):
    """Before: clear() dropped the memory pools but kept the streams, and the first recording
    after it looked up the dropped pool (KeyError): the second job of a sweep with
    optim.muon.cuda_graphs=true crashed, and so did every gpu test after a CPU one had cleared."""
    made = {"streams": 0, "pools": 0}

    def stream(device):
        made["streams"] += 1
        return ("stream", made["streams"])

    def pool():
        made["pools"] += 1
        return ("pool", made["pools"])

    monkeypatch.setattr(torch.cuda, "Stream", stream)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", pool)
    monkeypatch.setattr(ns_graphs, "_STREAMS", {})
    monkeypatch.setattr(ns_graphs, "_POOLS", {})
    device = torch.device("cuda", 0)
    first = ns_graphs._stream_and_pool(device)
    assert ns_graphs._stream_and_pool(device) == first == (("stream", 1), ("pool", 1))
    ns_graphs.clear()
    assert ns_graphs._stream_and_pool(device) == (("stream", 1), ("pool", 2))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_muon_with_cuda_graphs_equals_muon_without(device, dtype, true_fp32_matmuls, request):
    """Three stacks (square, wide, tall) over four steps, the third skipped on the device;
    emulated graphs on the CPU, real ones on CUDA."""
    from optim.muon.optimizer import Muon

    if device == "cpu":
        request.getfixturevalue("emulated_graphs")
    ns_graphs.clear()
    gen = torch.Generator().manual_seed(3)
    shapes = [(32, 32), (32, 32), (32, 80), (80, 32), (2, 80, 32)]
    weights = [torch.randn(s, generator=gen).to(device) for s in shapes]
    grads = [[torch.randn(s, generator=gen).to(device) for s in shapes] for _ in range(4)]
    runs = {}
    for graphs in (False, True):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        opt = Muon(params, lr=0.02, weight_decay=0.1, ns_dtype=dtype, ns_method="auto", cuda_graphs=graphs,
                   ns_by_shape={"32x32": "standard", "32x80": "gram", "80x32": "standard"})
        for step, step_grads in enumerate(grads):
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.found_inf = torch.tensor(float(step == 2), device=device)
            opt.step()
        runs[graphs] = [p.detach().cpu() for p in params]
    for a, b in zip(runs[False], runs[True]):
        assert_close(b, a, rtol=0, atol=0)
    assert ns_graphs._CACHE.recorded == 3  # one per stack, at the second step
    ns_graphs.clear()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: torch sees no GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("in_place", [True, False], ids=["out_is_G", "own_out"])
@pytest.mark.parametrize("shape, method", [((6, 96, 160), "standard"), ((6, 160, 96), "standard"),
                                           ((4, 96, 256), "gram")], ids=["wide", "tall", "gram"])
def test_cuda_graph_replays_equal_eager_calls(shape, method, in_place, dtype, true_fp32_matmuls):
    ns_graphs.clear()
    _replay_against_eager("cuda", dtype, shape, in_place, gated=True, method=method)
    ns_graphs.clear()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: torch sees no GPU")
def test_graph_path_inside_someone_elses_capture_joins_it():
    """Captures do not nest: inside an outer capture the iteration's kernels join that graph."""
    ns_graphs.clear()
    G = torch.randn(2, 64, 96, device="cuda")
    expected = newton_schulz(G, 5, "classic", torch.bfloat16)
    out = torch.empty_like(G)
    newton_schulz(G, 5, "classic", torch.bfloat16, out=out, graph=True)  # warm-up, outside
    outer = torch.cuda.CUDAGraph()
    with torch.cuda.graph(outer):
        newton_schulz(G, 5, "classic", torch.bfloat16, out=out, graph=True)
    out.zero_()
    outer.replay()
    torch.cuda.synchronize()
    assert_close(out, expected, rtol=0, atol=0)
    assert ns_graphs._CACHE.recorded == 0
    ns_graphs.clear()
