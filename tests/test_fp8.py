"""trainer.fp8 (model/fp8.py): which modules become float8, that the optimizers still see the
fp32 weights, that a sharded run casts what one process casts, the step order of the float8
all-gather's scales, and checkpoints that load with FP8 on or off.

The CPU has no float8 units: torchao emulates the matmuls there (the same float8 casts, the
product in fp32), so everything but the speed is what a GPU runs."""
from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from model.config import ModelConfig
from model.fp8 import FP8Report, _convert_experts, convert_to_fp8, converts, torchao_float8
from model.gpt import GPT
from model.moe import Experts
from tests.conftest import compose
from tests.distributed import run_distributed
from tests.test_parallel_training import COMMON, losses, read_metrics, train_in_process
from tests.closeness import check_relative
from trainer.checkpoint import files as checkpoint_files
from trainer.config import ConfigError, to_dataclass, validate

CPU = torch.device("cpu")
FP8 = ["optim=muon", "optim.muon.ns_dtype=fp32", "trainer.fp8=tensorwise", "trainer.fp8_filter=all"]
# The slow comparisons below hold float8 runs to fixed tolerances, seen to hold on the default
# vocabulary's data (step 1-3 equal to 1e-6, a few 1e-5 later). Where a weight sits at a float8
# rounding boundary, fp32 order noise rounds it a whole float8 step away: at TEST_VOCAB's data
# that happened at step 2 under PP (6.6e-6). They keep the default vocabulary; the quick FSDP2
# test below measures its own floor instead.
DEFAULT_VOCAB = ["data.vocab_size=8192"]


def model_config(name: str) -> ModelConfig:
    return replace(to_dataclass(compose([f"model={name}"])).model, vocab_size=512)


def converted(model: nn.Module) -> set[str]:
    from torchao.float8.float8_linear import Float8Linear

    return {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}


@pytest.mark.parametrize("recipe, per_block", [
    # wk and wv are 512 wide (8 kv heads of 64): below tensorwise's 1024 outputs at 2048 inputs
    ("tensorwise", {"attn.wq", "attn.wo", "mlp.w_gate", "mlp.w_up", "mlp.w_down"}),
    # rowwise pays only past 2048 outputs: gate and up (8192 x 2048), not wq, wo, down (2048 out)
    ("rowwise", {"mlp.w_gate", "mlp.w_up"}),
])
def test_the_auto_rule_picks_gpt_1b_linears_by_recipe(recipe, per_block):
    cfg = model_config("gpt_1b")
    with torch.device("meta"):
        model = GPT(cfg, init_seed=0)
    report = convert_to_fp8(model, recipe, "auto", False, CPU)
    expected = {f"blocks.{i}.{name}" for i in range(cfg.n_layers) for name in per_block}
    assert converted(model) == expected == set(report.linears)
    assert len(report.left_out) == cfg.n_layers * 7 - len(expected)
    assert f"{len(expected)} block linears in float8" in report.line()


def test_the_rule_leaves_out_odd_shapes_and_everything_outside_the_blocks():
    square = nn.Linear(64, 192, bias=False)
    assert converts("tensorwise", "blocks.0.mlp.w_gate", square, "all")
    assert not converts("tensorwise", "blocks.0.mlp.w_gate", square, "auto")  # too small to pay
    assert not converts("tensorwise", "blocks.0.mlp.w_gate", nn.Linear(64, 200, bias=False), "all")  # 200 % 16
    assert not converts("tensorwise", "head", nn.Linear(4096, 8192, bias=False), "all")
    assert not converts("none", "blocks.0.mlp.w_gate", square, "all")
    assert converts("rowwise", "blocks.3.mlp.w_up", nn.Linear(2048, 8192, bias=False), "auto")
    assert not converts("rowwise", "blocks.3.mlp.w_up", nn.Linear(2048, 4096, bias=False), "auto")


@pytest.mark.parametrize("overrides, words", [
    (["trainer.fp8=tensorwise", "parallel.tp=2"], ("trainer.fp8=tensorwise", "parallel.tp=2", "hand-written")),
    (["trainer.fp8=e4m3"], ("trainer.fp8", "e4m3")),
    (["trainer.fp8_filter=some"], ("trainer.fp8_filter", "some")),
])
def test_bad_fp8_settings_are_refused_in_one_line(overrides, words):
    with pytest.raises(ConfigError) as err:
        validate(to_dataclass(compose(overrides)))
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words)


def test_experts_stay_in_bf16_off_hopper_and_the_start_up_line_says_why():
    with torch.device("meta"):
        model = GPT(model_config("moe_tiny"), init_seed=0)
    report = convert_to_fp8(model, "tensorwise", "all", False, CPU)
    assert report.experts.startswith("left in bf16") and "CUDA" in report.experts
    assert "MoE experts (1 layers): left in bf16" in report.line()
    assert all(type(p.data) is torch.Tensor for n, p in model.named_parameters() if ".experts." in n)


def test_expert_weights_are_wrapped_for_the_float8_grouped_gemm_keeping_their_layout_marks():
    from torchao.prototype.moe_training.tensor import Float8TrainingWeightWrapperTensor

    experts = Experts(4, 32, 64)
    with torch.no_grad():
        for param in experts.parameters():
            param.normal_()
    experts.w_gate.ep_split_dim = 0
    before = {n: p.detach().clone() for n, p in experts.named_parameters()}
    _convert_experts([experts])
    for name, param in experts.named_parameters():
        assert isinstance(param.data, Float8TrainingWeightWrapperTensor), name
        assert torch.equal(param.data.float(), before[name]), name
    assert experts.w_gate.ep_split_dim == 0


def test_float8_linears_quantise_while_the_optimizer_sees_fp32_weights_and_gradients():
    cfg = replace(model_config("gpt_tiny"), vocab_size=256)
    torch.manual_seed(0)
    plain = GPT(cfg, init_seed=0)
    fp8 = GPT(cfg, init_seed=0)
    report = convert_to_fp8(fp8, "tensorwise", "all", False, CPU)
    assert len(report.linears) == cfg.n_layers * 7
    idx = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        ref, out = plain(idx), fp8(idx)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert 1e-3 < rel < 0.1, rel  # float8's 3 mantissa bits, not bf16's 8 nor nothing
    fp8(idx, idx).backward()
    for name, p in fp8.named_parameters():
        assert type(p.data) is torch.Tensor and p.dtype == torch.float32, name
        assert type(p.grad) is torch.Tensor and p.grad.dtype == torch.float32, name


def _fsdp_fp8_worker(rank: int, world: int, run_dir: str, overrides: list[str]) -> dict:
    """Train under FSDP2 with the float8 all-gather, recording the order of forwards, optimizer
    steps and scale refreshes; return the final weights and how their scales compare."""
    from torchao.float8.float8_utils import amax_to_scale

    import trainer.loop as loop
    from parallel.comm import all_gather_into
    from parallel.mesh import build_mesh
    from trainer.loop import Trainer

    import trainer.build as build

    events: list[str] = []
    refresh = loop.refresh_weight_scales
    recorded = lambda roots: (events.append("refresh"), refresh(roots))[1]  # noqa: E731
    loop.refresh_weight_scales = build.refresh_weight_scales = recorded
    try:
        cfg = to_dataclass(compose(COMMON + overrides))
        trainer = Trainer(cfg, Path(run_dir), build_mesh(1, dp_shard=cfg.parallel.dp_shard))
        step = trainer.optimizer.step
        trainer.optimizer.step = lambda *a, **k: (events.append("step"), step(*a, **k))[1]
        trainer.model.register_forward_pre_hook(lambda *_: events.append("forward"))
        trainer.train()
    finally:
        loop.refresh_weight_scales = build.refresh_weight_scales = refresh
    scales, weights = [], {}
    for name, module in trainer.model.named_modules():
        weight = getattr(module, "weight", None)
        if weight is None or not hasattr(weight, "_local_tensor") or not hasattr(weight._local_tensor, "_precomputed_scale"):
            continue
        local = weight.to_local()._tensor  # this rank's rows, in fp32
        full = local.new_empty(weight.shape)  # gpt_tiny's rows split evenly over 2 ranks
        all_gather_into(full, local, trainer.mesh.device_mesh.get_group("dp_shard"))
        expected = amax_to_scale(full.abs().max(), module.config.cast_config_weight.target_dtype,
                                 module.config.round_scales_to_power_of_2)
        scales.append((weight._local_tensor._precomputed_scale.item(), expected.item()))
        weights[f"{name}.weight"] = full
    return {"events": events, "scales": scales, "weights": weights, "all_gather": trainer.fp8.all_gather}


@pytest.fixture(scope="module")
def fsdp_fp8_run(tmp_path_factory) -> tuple[Path, dict]:
    run_dir = tmp_path_factory.mktemp("fsdp_fp8")
    results = run_distributed(_fsdp_fp8_worker, 2, str(run_dir), FP8 + ["parallel.dp_shard=2", "trainer.batch_size=2"])
    return run_dir, results[0]


def test_fsdp2_with_the_float8_all_gather_tracks_the_single_process_run(tmp_path, fsdp_fp8_run):
    run_dir, result = fsdp_fp8_run
    assert result["all_gather"]
    # The same micro-batches as the two ranks', so every float8 cast sees the same tensor.
    single = train_in_process(tmp_path / "single", FP8 + ["trainer.batch_size=2", "trainer.grad_accum=2"])
    a, b = losses(read_metrics(run_dir)), losses(single)
    assert len(a) == len(b) == 10
    # Not 1e-5 as in fp32: the reduction order of the gradient average moves a weight by an ulp
    # of fp32, and one that sits at a float8 rounding boundary then rounds a whole float8 step
    # (6%) away; over 10 steps that grew to 3e-5 on one CPU's kernels and 1e-4 on another
    # vocabulary. So the bound is a multiple of what the same reordering does in one process
    # (the batch of 4 in one micro-batch instead of two), or 1e-4 where that is less.
    # Unrounded scales (torchao's own precompute) or a stale scale would move the first step's
    # loss already.
    reordered = losses(train_in_process(tmp_path / "reordered", FP8 + ["trainer.batch_size=4"]))
    floor = max(abs(x - y) / abs(y) for x, y in zip(reordered, b))
    assert a[0] == b[0]
    for step, (x, y) in enumerate(zip(a, b), start=1):
        check_relative(f"step {step}", x, y, max(1e-4, 4 * floor))


def test_scales_are_recomputed_after_every_optimizer_step_and_before_the_next_forward(fsdp_fp8_run):
    _, result = fsdp_fp8_run
    events = result["events"]
    steps = [i for i, e in enumerate(events) if e == "step"]
    assert len(steps) == 10
    assert events.index("refresh") < events.index("forward")  # the first all-gather has its scales
    for i in steps:
        following = events[i + 1:]
        assert following and following[0] == "refresh", events[i:i + 3]
    # The scale each weight's all-gather uses is the recipe's scale of the final weights.
    assert len(result["scales"]) == 2 * 7
    for precomputed, expected in result["scales"]:
        assert precomputed == expected


def test_checkpoints_hold_fp32_weights_that_load_with_fp8_on_or_off(tmp_path, fsdp_fp8_run, caplog):
    from trainer.loop import Trainer

    run_dir, result = fsdp_fp8_run
    path = run_dir / "checkpoints" / "step_00000010"
    params = checkpoint_files.load(path)["params"]
    for name, full in result["weights"].items():
        assert type(params[name]) is torch.Tensor and params[name].dtype == torch.float32, name
        assert torch.equal(params[name], full), name
    for fp8 in ("none", "tensorwise"):
        options = [o for o in FP8 if not o.startswith("trainer.fp8=")]
        cfg = to_dataclass(compose(COMMON + options + [f"trainer.fp8={fp8}", f"checkpoint.resume={path}",
                                                       "trainer.max_steps=11"]))
        with caplog.at_level(logging.INFO):
            caplog.clear()
            trainer = Trainer(cfg, tmp_path / fp8)
        assert trainer.step == 10
        said = [r.getMessage() for r in caplog.records]
        # Switching FP8 off on a resume is said; and what runs in fp32 on this CPU is said as fp32.
        switched = [line for line in said if line.startswith("resumed with trainer.fp8=")]
        assert switched == ([] if fp8 == "tensorwise" else [
            "resumed with trainer.fp8=none, but the checkpoint was trained with trainer.fp8=tensorwise: the block "
            "matmuls from the resume on run in another precision (the weights carry over unchanged)"])
        assert [line for line in said if line.startswith("fp8 ")] == ([] if fp8 == "none" else [
            "fp8 tensorwise: 14 block linears in float8, 0 left in fp32 by trainer.fp8_filter's rule; emulated off "
            "CUDA (the same float8 casts, the products in fp32): several times slower than trainer.fp8=none, for "
            "checking numerics, not for speed"])
        loaded = dict(trainer.model.named_parameters())
        for name, full in params.items():
            assert torch.equal(loaded[name].detach(), full), (fp8, name)
        assert len(converted(trainer.model)) == (0 if fp8 == "none" else 14)


@pytest.mark.slow
@pytest.mark.parametrize("layout, options", [
    ([], ["trainer.fp8=rowwise"]),  # ZeRO-1 over 2 data-parallel ranks (plain parameters; rowwise scales)
    (["parallel.ep=2"], ["trainer.fp8=tensorwise", "model=moe_tiny", "trainer.seq_len=32"]),  # experts in bf16 on a CPU
], ids=["zero1_rowwise", "moe_ep2"])
def test_float8_under_zero1_and_ep_tracks_the_single_process_run(tmp_path, layout, options):
    from tests.test_parallel_training import _train_worker

    base = [o for o in FP8 if not o.startswith("trainer.fp8=")] + options + DEFAULT_VOCAB
    single = train_in_process(tmp_path / "single", base + ["trainer.batch_size=2", "trainer.grad_accum=2"])
    run_distributed(_train_worker, 2, str(tmp_path / "par"), base + layout + ["trainer.batch_size=2"])
    a, b = losses(read_metrics(tmp_path / "par")), losses(single)
    assert len(a) == len(b) == 10
    for step, (x, y) in enumerate(zip(a, b), start=1):
        check_relative(f"step {step}", x, y, 1e-4)


def test_the_start_up_line_names_the_runs_precision_and_the_cpus_emulation():
    """Before: "14 left in bf16" on a CPU run training in fp32, and not a word that float8 is
    emulated there (slower than no FP8)."""
    with torch.device("meta"):
        model = GPT(model_config("gpt_tiny"), init_seed=0)
    assert convert_to_fp8(model, "tensorwise", "auto", False, CPU, "fp32").line() == (
        "fp8 tensorwise: 0 block linears in float8, 14 left in fp32 by trainer.fp8_filter's rule; emulated off CUDA "
        "(the same float8 casts, the products in fp32): several times slower than trainer.fp8=none, for checking "
        "numerics, not for speed")
    on_gpu = FP8Report("rowwise", ("blocks.0.mlp.w_up",), ("blocks.0.attn.wq",), False, "float8 rowwise grouped GEMMs",
                       precision="bf16")
    assert on_gpu.line() == "fp8 rowwise: 1 block linears in float8, 1 left in bf16 by trainer.fp8_filter's rule"


def test_only_the_known_noise_of_torchaos_import_is_held_back():
    """train.py's path imports torchao through model/fp8.py, the export and sampling scripts
    through transformers (tests/test_export.py runs those): the lines below are dropped, on a
    CPU build of torch those about CUDA kernels too, and nothing else."""
    from data.quiet_imports import NOISE, quiet_library_noise

    torchao_float8()  # its import holds the noise back from here on
    quiet_library_noise()  # a second call adds nothing
    seen: list[str] = []
    loggers = [logging.getLogger(name) for name in NOISE]
    handlers = [logging.Handler() for _ in loggers]
    for logger, handler in zip(loggers, handlers):
        assert len(logger.filters) == 1
        handler.emit = lambda record: seen.append(record.getMessage())
        # its own logger's records, not those of a child logger again (torchao.kernel.intmm's)
        handler.addFilter(lambda record, name=logger.name: record.name == name)
        logger.addHandler(handler)
    try:
        cuda_kernels = ["Failed to load /venv/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load",
                        "Warning: Detected no triton, on systems without Triton certain kernels will not work"]
        for logger, message in zip(loggers, cuda_kernels + [
                "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile as an "
                "opaque value type. Calling register_constant() on Enum subclasses is deprecated"]):
            logger.warning(message)
            logger.warning("another warning")
    finally:
        for logger, handler in zip(loggers, handlers):
            logger.removeHandler(handler)
    assert seen == (cuda_kernels[:1] if torch.version.cuda else []) + ["another warning"] + (
        cuda_kernels[1:] if torch.version.cuda else []) + ["another warning"] * 2


def test_report_of_a_run_without_fp8():
    report = FP8Report("none", (), (), False, "bf16")
    assert report.line() == "fp8: off"


def test_fp8_without_compile_is_warned_at_start():
    from trainer.run.preflight import config_warnings

    eager = config_warnings(to_dataclass(compose(["trainer.fp8=rowwise"])))
    assert len(eager) == 1 and "trainer.fp8=rowwise" in eager[0] and "trainer.compile=true" in eager[0]
    assert config_warnings(to_dataclass(compose(["trainer.fp8=rowwise", "trainer.compile=true"]))) == []


# The same casts, compiled or split into stages, as the single-process eager run: the first
# steps agree to fp32 rounding; later, a weight that an fp32 reordering moves across a float8
# rounding boundary rounds a whole float8 step away, so the runs drift apart by up to about
# 2e-4 over 10 steps (seen: 1.7e-4 under PP, 1.5e-4 under FSDP2 + compile).
@pytest.mark.slow
@pytest.mark.parametrize("world, single, parallel", [
    # 1 sequence per micro-batch in both, so every activation is cast with the same scale
    (2, ["trainer.batch_size=1", "trainer.grad_accum=2"], ["parallel.pp=2", "trainer.batch_size=2"]),
    (1, ["trainer.batch_size=2"], ["trainer.batch_size=2", "trainer.compile=true"]),
    (2, ["trainer.batch_size=2", "trainer.grad_accum=2", "trainer.compile=true"],
     ["parallel.dp_shard=2", "trainer.batch_size=2", "trainer.compile=true"]),
], ids=["pp2", "compile", "fsdp2_compile"])
def test_float8_compiled_and_in_a_pipeline_tracks_the_eager_single_process_run(tmp_path, world, single, parallel):
    from tests.test_parallel_training import _train_worker

    reference = losses(train_in_process(tmp_path / "single", FP8 + DEFAULT_VOCAB + single))
    if world == 1:
        other = losses(train_in_process(tmp_path / "other", FP8 + DEFAULT_VOCAB + parallel))
    else:
        run_distributed(_train_worker, world, str(tmp_path / "other"), FP8 + DEFAULT_VOCAB + parallel)
        other = losses(read_metrics(tmp_path / "other"))
    assert len(reference) == len(other) == 10
    for step, (x, y) in enumerate(zip(other, reference), start=1):
        check_relative(f"step {step}", x, y, 1e-6 if step <= 3 else 1e-3)


def test_muon_steps_float8_wrapped_expert_weights_exactly_as_plain_ones():
    """On an H100 the experts' weights are torchao training tensors (their grouped GEMM runs
    in float8); Muon's step on them must be its step on the fp32 weights."""
    from optim.muon.optimizer import Muon

    plain, wrapped = Experts(4, 32, 64), Experts(4, 32, 64)
    with torch.no_grad():
        for a, b in zip(plain.parameters(), wrapped.parameters()):
            a.normal_()
            b.copy_(a)
    _convert_experts([wrapped])
    gen = torch.Generator().manual_seed(1)
    for a, b in zip(plain.parameters(), wrapped.parameters()):
        a.grad = torch.randn(a.shape, generator=gen)
        b.grad = a.grad.clone()
    before = [p.detach().clone() for p in plain.parameters()]
    for params in (plain.parameters(), wrapped.parameters()):
        Muon(list(params), lr=0.02, ns_dtype="fp32").step()
    for a, b, old in zip(plain.parameters(), wrapped.parameters(), before):
        assert not torch.equal(a.detach(), old)  # the step moved it
        assert torch.equal(a.detach(), b.detach().float())


@pytest.mark.parametrize("capability, linears, experts", [
    ((8, 0), "compute capability 8.9 or newer", "compute capability 9.x"),  # A100: no float8 units
    ((8, 9), None, "compute capability 9.x"),  # Ada: float8 matmuls, no grouped kernel
    ((9, 0), None, None),  # H100, H200
    ((10, 0), None, "compute capability 9.x"),
])
def test_which_gpus_run_float8_linears_and_experts(monkeypatch, capability, linears, experts):
    from model import fp8

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    gpu = torch.device("cuda", 0)
    for found, want in ((fp8.fp8_unsupported(gpu), linears), (fp8.experts_unsupported(gpu), experts)):
        assert (found is None) if want is None else (want in found and f"{capability[0]}.{capability[1]}" in found)
