"""optim.muon.ns_method=auto: Gram or standard Newton-Schulz per matrix shape, by measured time.

The timer is mocked (a real timing depends on the machine): "auto" must follow it per shape,
record the choice in the config, the start-up line and the checkpoint, keep a resumed run's
choice, take rank 0's choice on every rank, and run exactly the chosen iteration per shape.
"""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import yaml

from optim.muon import ns_choice
from optim.builder import build_optimizer, muon_ns_shapes
from optim.config import OptimConfig
from optim.muon.options import MuonOptions
from optim.muon.optimizer import Muon, ns_shape
from optim.muon.options import ns_by_shape_problem
from optim.muon.newton_schulz import newton_schulz
from optim.muon.ns_method import NSShape, use_gram
from tests.distributed import run_distributed
from tests.test_checkpoint import make_trainer
from tests.test_distributed_muon import CFG, batches, parallel_tolerance, single_process_floor, train
from tests.test_tensor_parallel import gathered
from tests.closeness import approx, assert_close, check

CPU = torch.device("cpu")


def timer_from(gram_over_standard: dict[str, float]):
    """A timer under which Gram takes `gram_over_standard[key]` times standard's time, and
    which records what it was asked."""
    asked = []

    def timer(shape: NSShape, method: str) -> float:
        asked.append((shape.key, method))
        return gram_over_standard[shape.key] if method == "gram" else 1.0

    timer.asked = asked
    return timer


def test_choose_takes_the_faster_method_per_shape_and_gram_only_on_a_clear_win():
    shapes = [NSShape(16, 48), NSShape(48, 16), NSShape(24, 24), NSShape(8, 96, 0)]
    timer = timer_from({"16x48": 0.5, "48x16": 2.0, "24x24": 1 / 1.01, "8x96_shard_rows": 0.8})
    measured = ns_choice.choose(shapes, timer)
    assert measured.by_shape == {"16x48": "gram", "48x16": "standard", "24x24": "standard", "8x96_shard_rows": "gram"}
    assert measured.speedups == approx({"16x48": 2.0, "48x16": 0.5, "24x24": 1.01, "8x96_shard_rows": 1.25})
    # Alternating rounds: standard, Gram, standard, Gram, ... for each shape.
    assert timer.asked == [(s.key, m) for s in sorted(shapes, key=lambda s: s.key)
                           for _ in range(ns_choice.ROUNDS) for m in ("standard", "gram")]


def muon_cfg(**muon) -> OptimConfig:
    return OptimConfig(name="muon", muon=MuonOptions(ns_dtype="fp32", **muon))


COUNTS = {NSShape(24, 24): 4, NSShape(16, 48): 2, NSShape(48, 16): 2}


@pytest.mark.parametrize("method", ["standard", "gram"])
def test_forced_methods_measure_nothing_and_keep_their_config(method):
    def timer(shape, m):
        pytest.fail("a forced ns_method must not time anything")

    cfg = muon_cfg(ns_method=method)
    assert ns_choice.resolve_ns_method(cfg, COUNTS, CPU, timer=timer) == (cfg, None)
    assert ns_choice.resolve_ns_method(dataclasses.replace(cfg, name="adamw"), COUNTS, CPU, timer=timer)[1] is None
    # "gram" keeps its meaning: Gram where it costs fewer multiply-adds, whatever a timer says.
    assert [use_gram(method, s, 5) for s in COUNTS] == [False, method == "gram", method == "gram"]


def test_resolution_fills_every_shape_and_says_what_it_chose():
    timer = timer_from({"24x24": 0.99, "16x48": 1 / 1.28, "48x16": 1 / 1.3})
    resolved, line = ns_choice.resolve_ns_method(muon_cfg(ns_method="auto"), COUNTS, CPU, timer=timer)
    assert resolved.muon.ns_by_shape == {"16x48": "gram", "48x16": "gram", "24x24": "standard"}
    assert line == ("Newton-Schulz method: gram for 16x48 (1.28x), 48x16 (1.30x); standard for 24x24 (1.01x) "
                    "(auto: measured on this CPU, Gram's speed over standard's)")


def test_a_resume_keeps_its_checkpoints_choice_and_measures_only_new_shapes():
    timer = timer_from({"24x24": 0.5, "16x48": 2.0, "48x16": 2.0})
    before = {"optim": {"muon": {"ns_method": "auto", "ns_by_shape": {"16x48": "gram", "48x16": "standard"}}}}
    cfg = muon_cfg(ns_method="auto", ns_by_shape={"48x16": "gram"})  # set explicitly: wins
    resolved, line = ns_choice.resolve_ns_method(cfg, COUNTS, CPU, before, timer=timer)
    assert resolved.muon.ns_by_shape == {"16x48": "gram", "48x16": "gram", "24x24": "gram"}
    assert {key for key, _ in timer.asked} == {"24x24"}
    assert line == ("Newton-Schulz method: gram for 16x48, 24x24 (2.00x), 48x16 (auto: measured on this CPU, "
                    "Gram's speed over standard's; 16x48 kept from the checkpoint this run resumes; "
                    "48x16 set in optim.muon.ns_by_shape)")


def test_the_default_timer_times_the_real_iteration_on_this_device(monkeypatch):
    from optim.muon import newton_schulz as NS

    stacks = []
    monkeypatch.setattr(NS, "_iterate_gram", lambda X, *a, _f=NS._iterate_gram: stacks.append(("gram", X.shape)) or _f(X, *a))
    monkeypatch.setattr(NS, "_iterate", lambda X, *a, _f=NS._iterate: stacks.append(("standard", X.shape)) or _f(X, *a))
    counts = {NSShape(8, 24): 3, NSShape(40, 24): 9, NSShape(4, 24, 1): 2}
    timer = ns_choice.device_timer(CPU, torch.float32, 5, "classic", 1e-7, counts, warmup=1, repeats=2)
    for shape in list(counts)[:2]:
        for method in ("standard", "gram", "standard"):
            assert timer(shape, method) > 0
    # One warm-up call on a (shape, method)'s first timing, then 2 timed; a CPU times up to
    # MEASURE_BATCH_CPU matrices of a shape.
    assert stacks == [(m, (3, 8, 24)) for m, n in (("standard", 3), ("gram", 3), ("standard", 2)) for _ in range(n)] \
        + [(m, (4, 40, 24)) for m, n in (("standard", 3), ("gram", 3), ("standard", 2)) for _ in range(n)]
    assert timer(NSShape(4, 24, 1), "gram") > 0  # the sharded iteration, on the local shard


def test_under_cuda_graphs_the_timer_times_replays_and_drops_its_graphs(monkeypatch):
    """optim.muon.cuda_graphs: what is timed is what the steps run, graph replays (emulated on
    the CPU as in tests/test_newton_schulz.py), and the graphs go once the choice is made."""
    from optim.muon import ns_graphs

    replays = []
    monkeypatch.setattr(ns_graphs, "DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(ns_graphs, "_capture",
                        lambda eager, G, out, keep: (lambda: replays.append(tuple(G.shape)) or eager(G, out, keep)))
    ns_graphs.clear()
    counts = {NSShape(8, 24): 3, NSShape(40, 24): 2}
    timer = ns_choice.device_timer(CPU, torch.float32, 5, "classic", 1e-7, counts, warmup=2, repeats=3, graphs=True)
    try:
        for shape in counts:
            for method in ("standard", "gram"):
                assert timer(shape, method) > 0
        # Per (shape, method): an eager call, the recording (replayed once), 3 timed replays.
        assert replays == [(3, 8, 24)] * 8 + [(2, 40, 24)] * 8
        assert ns_graphs._CACHE.recorded == 4
        # A new shape's stack replaces the last one's, and its graphs go with it.
        assert len(ns_graphs._CACHE.graphs) == 2
        timer.release()
        assert not ns_graphs._CACHE.graphs and not ns_graphs._CACHE.seen
    finally:
        ns_graphs.clear()


def test_auto_times_under_the_runs_cuda_graphs_setting_and_releases_the_timer(monkeypatch):
    made = []

    def device_timer(*args, graphs=False, **kwargs):
        timer = timer_from({"24x24": 1.0, "16x48": 0.5, "48x16": 0.5})
        timer.released = []
        timer.release = lambda: timer.released.append(True)
        made.append((graphs, timer))
        return timer

    monkeypatch.setattr(ns_choice, "device_timer", device_timer)
    for graphs in (False, True):
        ns_choice.resolve_ns_method(muon_cfg(ns_method="auto", cuda_graphs=graphs), COUNTS, CPU)
    assert [(graphs, timer.released) for graphs, timer in made] == [(False, [True]), (True, [True])]


def _out_of_memory_timer(shape: NSShape, method: str) -> float:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (GPU 0; 139.8 GiB total)\n"
                                 "If reserved but unallocated memory is large try setting ...")


FAILED_LINE = ("optim.muon.ns_method=auto: timing Newton-Schulz on rank 0 failed (OutOfMemoryError: CUDA out of "
               "memory. Tried to allocate 1.00 GiB (GPU 0; 139.8 GiB total)); set optim.muon.ns_method=standard "
               "or gram, or give every shape in optim.muon.ns_by_shape")


def test_a_failed_measurement_stops_the_run_in_one_line():
    with pytest.raises(ns_choice.MeasurementError) as failed:
        ns_choice.resolve_ns_method(muon_cfg(ns_method="auto"), COUNTS, CPU, timer=_out_of_memory_timer)
    assert str(failed.value) == FAILED_LINE
    assert isinstance(failed.value.__cause__, torch.OutOfMemoryError)  # rank 0 keeps the traceback


def _failed_measurement_worker(rank: int, world: int) -> tuple[str, str]:
    """Rank 0's timer raises; rank 1's must never be asked (only rank 0 measures)."""
    def never(shape, method):
        raise AssertionError("a rank other than 0 measured")

    try:
        ns_choice.resolve_ns_method(muon_cfg(ns_method="auto"), COUNTS, CPU,
                                    timer=_out_of_memory_timer if rank == 0 else never)
    except ns_choice.MeasurementError as err:
        return str(err), type(err.__cause__).__name__
    return "no error", ""


def test_a_failed_measurement_on_rank_0_stops_every_rank_with_the_same_line():
    """Without the error passed on, rank 1 would wait in the broadcast until the timeout."""
    results = run_distributed(_failed_measurement_worker, 2)
    assert results == [(FAILED_LINE, "OutOfMemoryError"), (FAILED_LINE, "NoneType")]


@pytest.mark.parametrize("value, says", [
    ({"768x2048": "fast"}, "optim.muon.ns_by_shape.768x2048: unknown value 'fast' (expected standard or gram)"),
    ({"768by2048": "gram"}, "optim.muon.ns_by_shape: bad shape '768by2048'"),
])
def test_bad_ns_by_shape_names_the_key(value, says):
    assert ns_by_shape_problem("auto", value).startswith(says)
    assert ns_by_shape_problem("gram", value).startswith("optim.muon.ns_by_shape is read only with")
    with pytest.raises(ValueError, match="optim.muon.ns_by_shape"):
        Muon([torch.nn.Parameter(torch.randn(4, 8))], ns_method="auto", ns_by_shape=value)


def test_bad_ns_by_shape_fails_config_validation_in_one_line(compose_cfg):
    from trainer.config import ConfigError, to_dataclass, validate

    cfg = to_dataclass(compose_cfg(["optim=muon", "++optim.muon.ns_by_shape={768x2048:gram}"]))
    with pytest.raises(ConfigError, match="^optim.muon.ns_by_shape is read only with optim.muon.ns_method=auto"):
        validate(cfg)


def test_auto_without_a_choice_for_a_shape_names_it():
    opt = Muon([torch.nn.Parameter(torch.randn(4, 8))], ns_method="auto", ns_by_shape={"8x4": "gram"})
    opt.param_groups[0]["params"][0].grad = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"no choice for 4x8 matrices in optim.muon.ns_by_shape"):
        opt.step()


SHAPES = [(24, 24), (16, 48), (48, 16), (2, 16, 48)]  # square, wide, tall, 3-D experts


def _steps(opts_and_params, grads):
    for step in range(len(grads[0])):
        for opt, params in opts_and_params:
            for p, g in zip(params, grads):
                p.grad = g[step].clone()
            opt.step()


def test_an_auto_step_equals_each_shape_stepped_with_its_chosen_method():
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen, dtype=torch.float64) for _ in range(3)] for s in SHAPES]
    kw = dict(lr=0.02, weight_decay=0.1, ns_dtype=torch.float64)
    # Gram for the wide matrices; standard for the tall ones, where the multiply-add count
    # would have picked Gram, and for the square ones.
    by_shape = {"24x24": "standard", "16x48": "gram", "48x16": "standard"}
    auto = [torch.nn.Parameter(w.clone()) for w in weights]
    auto_opt = Muon(auto, ns_method="auto", ns_by_shape=by_shape, **kw)
    assert auto_opt.ns_shapes() == {NSShape(24, 24): 1, NSShape(16, 48): 3, NSShape(48, 16): 1}
    # The reference: the same matrices in groups that force each shape's chosen method.
    chosen = [by_shape[f"{s[-2]}x{s[-1]}"] for s in SHAPES]
    forced = [torch.nn.Parameter(w.clone()) for w in weights]
    forced_opt = Muon([{"params": [p for p, c in zip(forced, chosen) if c == method], "ns_method": method}
                       for method in ("standard", "gram")], **kw)
    standard = [torch.nn.Parameter(w.clone()) for w in weights]
    _steps([(auto_opt, auto), (forced_opt, forced), (Muon(standard, **kw), standard)], grads)
    for a, f in zip(auto, forced):
        assert_close(a.detach(), f.detach(), rtol=0, atol=0)
    # And the choice matters: Gram's rounding differs from standard's where Gram ran.
    for a, s, c, shape in zip(auto, standard, chosen, SHAPES):
        assert torch.equal(a.detach(), s.detach()) == (c == "standard"), shape


def test_the_chosen_iteration_is_the_one_that_runs(monkeypatch):
    from optim.muon import newton_schulz as NS

    ran = []
    monkeypatch.setattr(NS, "_iterate_gram", lambda X, *a, _f=NS._iterate_gram: ran.append(("gram", tuple(X.shape[1:]))) or _f(X, *a))
    monkeypatch.setattr(NS, "_iterate", lambda X, *a, _f=NS._iterate: ran.append(("standard", tuple(X.shape[1:]))) or _f(X, *a))
    G = torch.randn(2, 24, 24)
    newton_schulz(G, 5, "classic", torch.float32, method="auto", by_shape={"24x24": "gram"})
    newton_schulz(G.mT.reshape(2, 24, 24), 5, "classic", torch.float32, method="auto", by_shape={"24x24": "standard"})
    assert ran == [("gram", (24, 24)), ("standard", (24, 24))]


def test_model_shapes_are_what_muon_orthogonalises():
    """The shapes start-up measures (from the model) are the shapes step() hands to
    Newton-Schulz: with a choice for exactly those, an auto step finds every one."""
    from model.gpt import GPT

    model = GPT(CFG)
    cfg = muon_cfg(ns_method="auto", split_heads=True)
    counts = muon_ns_shapes(model, cfg, CFG)
    head = CFG.d_model // CFG.n_heads
    assert counts == {NSShape(head, 32): 2 * (4 + 2 + 2), NSShape(32, 32): 2, NSShape(64, 32): 4, NSShape(32, 64): 2}
    cfg = dataclasses.replace(cfg, muon=dataclasses.replace(cfg.muon, ns_by_shape={s.key: "gram" for s in counts}))
    opt = build_optimizer(model, cfg, CFG)
    assert opt.optimizers["muon"].ns_shapes() == counts
    train(model, opt, batches(1, 2), 0, 1)


def test_tp_shards_are_named_as_newton_schulz_sees_them(monkeypatch):
    import optim.muon.optimizer as muon_module

    monkeypatch.setattr(muon_module, "group_size", lambda group: 1 if group is None else 4)
    p = torch.nn.Parameter(torch.randn(16, 64))
    p.tp_split_dim = 0  # a column-parallel shard: rows split over 4 ranks
    group = {"split_rows": None, "tp_group": object()}
    assert ns_shape(p, {**group, "tp_mode": "gather"}) == (1, NSShape(64, 64))
    assert ns_shape(p, {**group, "tp_mode": "gram"}) == (1, NSShape(16, 64, 0))
    e = torch.nn.Parameter(torch.randn(3, 16, 8))
    e.tp_split_dim = 2  # expert stacks: the matrix's cols split
    assert ns_shape(e, {**group, "tp_mode": "gather"}) == (3, NSShape(16, 32))
    assert ns_shape(e, {**group, "tp_mode": "gram"}) == (3, NSShape(16, 8, 1))
    assert NSShape.parse("16x8_shard_cols") == NSShape(16, 8, 1)


def _agree_worker(rank: int, world: int) -> dict:
    """TP=2 over both ranks (both tp_modes), then DP=2 (ZeRO-1). Rank 0's (mocked) timing says
    Gram wins everywhere, rank 1's the opposite; both must run rank 0's choice, or the sharded
    iteration (tp_mode=gram) would disagree across the ranks of one matrix."""
    from model.parallelize import parallelize_tp
    from model.gpt import GPT
    from parallel.mesh import build_mesh

    def timer(shape, method):
        return (0.5 if rank == 0 else 2.0) if method == "gram" else 1.0

    out = {}
    tp_mesh, dp_mesh = build_mesh(2), build_mesh(1)
    for tp_mode, mesh in (("gather", tp_mesh), ("gram", tp_mesh), ("zero", dp_mesh)):
        cfg = muon_cfg(ns_method="auto", tp_mode="gram" if tp_mode == "gram" else "gather")
        torch.manual_seed(0)
        model = parallelize_tp(GPT(CFG), mesh.tp_group)
        resolved, line = ns_choice.resolve_ns_method(cfg, muon_ns_shapes(model, cfg, CFG, mesh), CPU, timer=timer)
        data = batches(3, 4)
        train(model, build_optimizer(model, resolved, CFG, mesh), data, mesh.dp_rank, mesh.dp)
        torch.manual_seed(0)
        reference = GPT(CFG)
        ref_cfg, _ = ns_choice.resolve_ns_method(cfg, muon_ns_shapes(reference, cfg, CFG), CPU,
                                                 timer=lambda s, m: 0.5 if m == "gram" else 1.0, group=None)
        train(reference, build_optimizer(reference, ref_cfg, CFG), data, 0, 1)
        ref = dict(reference.named_parameters())
        worst = max(((gathered(p, p.detach(), mesh.tp_group, ref[n].shape[0]) - ref[n]).norm() / ref[n].norm()).item()
                    for n, p in model.named_parameters())
        out[tp_mode] = (resolved.muon.ns_by_shape, worst, parallel_tolerance(single_process_floor(ref_cfg, steps=3)))
    return out


def test_every_rank_runs_rank_0s_choice():
    results = run_distributed(_agree_worker, 2)
    for tp_mode in ("gather", "gram", "zero"):
        (by_shape0, worst0, tolerance), (by_shape1, worst1, _) = results[0][tp_mode], results[1][tp_mode]
        assert by_shape0 == by_shape1 and set(by_shape0.values()) == {"gram"}, tp_mode
        if tp_mode == "gram":
            assert any(key.endswith("_shard_rows") for key in by_shape0)
            assert any(key.endswith("_shard_cols") for key in by_shape0)
        # Gram on shards or gathered matrices equals Gram on the single-process model's.
        check(f"{tp_mode}: relative parameter error", max(worst0, worst1), tolerance)


def test_trainer_logs_records_and_resumes_the_choice(tmp_path, caplog, monkeypatch):
    def mocked(gram_wins: bool):
        monkeypatch.setattr(ns_choice, "device_timer", lambda *a, **k: (
            lambda shape, method: (0.5 if gram_wins == (shape.rows < shape.cols) else 2.0) if method == "gram" else 1.0))

    mocked(gram_wins=True)  # Gram wins on the wide shapes, loses on the others
    overrides = ["optim.muon.ns_method=auto", "trainer.max_steps=1"]
    with caplog.at_level(logging.INFO, logger="trainer"):
        trainer = make_trainer(tmp_path, overrides)
    # gpt_tiny: wq, wo 64 x 64; wk, wv 32 x 64; w_gate, w_up 192 x 64; w_down 64 x 192
    chosen = {"32x64": "gram", "64x192": "gram", "64x64": "standard", "192x64": "standard"}
    assert trainer.cfg.optim.muon.ns_by_shape == chosen
    assert trainer.optimizer.optimizers["muon"].param_groups[0]["ns_by_shape"] == chosen
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Newton-Schulz method:")]
    assert lines == ["Newton-Schulz method: gram for 32x64 (2.00x), 64x192 (2.00x); standard for 192x64 (0.50x), "
                     "64x64 (0.50x) (auto: measured on this CPU, Gram's speed over standard's)"]
    saved = yaml.safe_load((tmp_path / "resolved_config.yaml").read_text())
    assert saved["optim"]["muon"]["ns_method"] == "auto" and saved["optim"]["muon"]["ns_by_shape"] == chosen
    trainer.train()
    # Resumed where the timing comes out the other way: the run keeps its checkpoint's choice.
    mocked(gram_wins=False)
    resumed = make_trainer(tmp_path, ["optim.muon.ns_method=auto", "trainer.max_steps=2"])
    assert resumed.step == 1 and resumed.cfg.optim.muon.ns_by_shape == chosen
