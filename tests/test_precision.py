"""trainer.precision=auto and optim.muon.ns_dtype=auto, and the one-GPU-per-rank check.

On a CPU "auto" goes by the CPU's flags (bf16 units or not), and with bf16 units by a timing
that must confirm them. Both are mocked here (their real values depend on the machine), except
in the test that runs this machine's own decision three times. "auto" must follow them, on
every rank alike, and an explicit precision must win over them. On CUDA "auto" follows the
compute capability, mocked here and checked for real by tests/test_gpu.py.
"""
from __future__ import annotations

import itertools
import logging
import re

import pytest
import torch
import yaml

from eval import fast_dtype
from optim.muon import Muon
from tests.conftest import compose
from tests.distributed import run_distributed
from tests.test_checkpoint import make_trainer
from hydra.types import RunMode

from tests.test_multirun import TINY, fake_hydra
from trainer import launch, precision
from trainer.config import ConfigError, to_dataclass, validate
from trainer.device import TF32Flags, check_local_gpus, set_tf32, tf32_allowed, tf32_flags
from parallel.mesh import Mesh, build_mesh

CPU = torch.device("cpu")

# CPU flag sets as /proc/cpuinfo would list them (abridged).
AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma"})  # most laptops and CI runners: no bf16 units
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl"}  # AVX512 without its BF16 extension
AVX512_BF16 = AVX512 | {"avx512_bf16"}
AMX = AVX512_BF16 | {"amx_tile", "amx_bf16", "amx_int8"}
NO_UNITS = "CPU has no bf16 units: no amx_bf16/avx512_bf16 flag"


def never_timed(count: int) -> list[float]:
    raise AssertionError("timed bf16 on a CPU whose flags already decide")


@pytest.fixture
def cpu(monkeypatch):
    """Set this CPU's flags and what each sample of its bf16 timing reads (bf16 / fp32 speed)."""
    def set_cpu(flags: frozenset[str], speedup: float = 1.0) -> None:
        monkeypatch.setattr(fast_dtype, "cpu_flags", lambda: flags)
        monkeypatch.setattr(fast_dtype, "timed_bf16_speedups", lambda count: [speedup] * count)
        fast_dtype.fast_precision.cache_clear()

    yield set_cpu
    fast_dtype.fast_precision.cache_clear()  # later tests decide for this machine again


@pytest.mark.parametrize("flags", [frozenset(), AVX2, AVX512, AVX512 | {"amx_tile"}, frozenset({"avx512"})])
def test_a_cpu_without_bf16_units_is_fp32_and_never_timed(flags):
    calls = []
    choice = fast_dtype.decide_cpu_precision(flags, lambda count: calls.append(count) or [50.0] * count)
    assert choice == fast_dtype.PrecisionChoice("fp32", NO_UNITS)
    assert calls == []  # however fast the timing would have said bf16 is
    assert not fast_dtype.cpu_has_bf16_units(flags)


@pytest.mark.parametrize("flags, unit", [(AMX, "amx_bf16"), (AVX512_BF16, "avx512_bf16"),
                                         (frozenset({"amx_bf16"}), "amx_bf16")])
def test_bf16_units_that_time_faster_than_the_margin_give_bf16(flags, unit):
    calls = []
    choice = fast_dtype.decide_cpu_precision(flags, lambda count: calls.append(count) or [3.1] * count)
    assert fast_dtype.cpu_has_bf16_units(flags)
    assert calls == [fast_dtype.BF16_TIMING_SAMPLES] == [7]
    assert choice == fast_dtype.PrecisionChoice(
        "bf16", f"CPU has {unit}; bf16 matmul timed at 3.10x fp32's speed (median of 7; bf16 needs >= 1.5x)")


@pytest.mark.parametrize("speedup", [1.49, 1.2, 1.0, 0.05])
def test_bf16_units_that_time_under_the_margin_give_fp32_and_say_why(speedup):
    choice = fast_dtype.decide_cpu_precision(AMX, lambda count: [speedup] * count)
    assert choice == fast_dtype.PrecisionChoice(
        "fp32", f"CPU has amx_bf16 but bf16 matmul timed at only {speedup:.2f}x fp32's speed "
                "(median of 7; bf16 needs >= 1.5x)")
    # At the margin bf16 is chosen: the margin is the least speedup worth bf16.
    assert fast_dtype.decide_cpu_precision(AMX, lambda count: [1.5] * count).precision == "bf16"


# Seven samples each with the readings (1.02x, 2.00x, 3.90x, 17.76x) among them.
TIE_WITH_SPIKES = [1.0, 17.76, 0.9, 3.9, 1.02, 2.0, 0.95]  # median 1.02: a tie, bf16 units unused
FAST_WITH_DIPS = [3.1, 0.4, 2.9, 1.02, 3.3, 17.76, 3.0]  # median 3.0: the units at work


@pytest.mark.parametrize("samples, expected", [
    (TIE_WITH_SPIKES, fast_dtype.PrecisionChoice(
        "fp32", "CPU has avx512_bf16 but bf16 matmul timed at only 1.02x fp32's speed (median of 7; bf16 needs >= 1.5x)")),
    (FAST_WITH_DIPS, fast_dtype.PrecisionChoice(
        "bf16", "CPU has avx512_bf16; bf16 matmul timed at 3.00x fp32's speed (median of 7; bf16 needs >= 1.5x)")),
])
def test_noisy_timings_decide_the_same_way_whatever_order_the_spikes_come_in(samples, expected):
    # Every order of the same noisy samples, as repeated runs on one busy machine would see them.
    orders = list(itertools.permutations(samples))[::97]
    choices = {fast_dtype.decide_cpu_precision(AVX512_BF16, lambda count, s=order: list(s)) for order in orders}
    assert len(orders) > 50 and choices == {expected}


def test_parse_cpuinfo_flags_keeps_the_flags_every_processor_has():
    cpuinfo = ("processor\t: 0\nmodel name\t: a CPU\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16\n\n"
               "processor\t: 1\nflags\t\t: fpu avx2 avx512f amx_bf16\nbugs\t\t: spectre_v1\n")
    # avx512_bf16 on one core only cannot be relied on; "bugs" is not a flags line
    assert fast_dtype.parse_cpuinfo_flags(cpuinfo) == {"fpu", "avx2", "avx512f", "amx_bf16"}
    arm = "processor\t: 0\nFeatures\t: fp asimd bf16\n"  # aarch64 has no `flags` line
    assert fast_dtype.parse_cpuinfo_flags(arm) == frozenset()


def test_without_proc_cpuinfo_the_flags_are_torchs_capability_and_mean_fp32(monkeypatch, tmp_path):
    monkeypatch.setattr(fast_dtype, "CPUINFO", tmp_path / "cpuinfo")  # not there, as on macOS
    flags = fast_dtype.cpu_flags()
    assert flags == {torch.backends.cpu.get_cpu_capability().lower()}
    assert fast_dtype.decide_cpu_precision(flags, never_timed) == fast_dtype.PrecisionChoice("fp32", NO_UNITS)


def test_this_machines_decision_is_the_same_three_times_and_follows_its_flags():
    flags = fast_dtype.cpu_flags()
    calls = []

    def timing(count: int) -> list[float]:
        calls.append(count)
        return fast_dtype.timed_bf16_speedups(count)

    choices = [fast_dtype.decide_cpu_precision(flags, timing) for _ in range(3)]
    assert len({c.precision for c in choices}) == 1, choices
    units = [f for f in ("amx_bf16", "avx512_bf16") if f in flags]
    if not units:
        assert choices == [fast_dtype.PrecisionChoice("fp32", NO_UNITS)] * 3 and calls == []
        return
    assert calls == [7] * 3
    for choice in choices:  # the timing confirms the units or not, and the line says which
        assert choice.reason.startswith(f"CPU has {units[0]}")
        speedup = float(re.search(r"timed at (?:only )?([0-9.]+)x", choice.reason).group(1))
        assert choice.precision == ("bf16" if speedup >= 1.5 else "fp32")


def test_auto_on_a_cpu_follows_its_flags_and_the_confirming_timing(cpu):
    cpu(AVX2, speedup=50.0)  # a timing never reached
    assert fast_dtype.resolve_precision("auto", CPU) == fast_dtype.PrecisionChoice("fp32", NO_UNITS)
    cpu(AMX, speedup=2.0)
    assert fast_dtype.resolve_precision("auto", CPU).precision == "bf16"
    cpu(AMX, speedup=1.2)  # about a tie: not worth bf16's precision loss
    choice = fast_dtype.resolve_precision("auto", CPU)
    assert choice.precision == "fp32" and "timed at only 1.20x" in choice.reason


@pytest.mark.parametrize("capability, expected", [((9, 0), "bf16"), ((8, 0), "bf16"), ((7, 0), "fp32")])
def test_auto_on_cuda_follows_the_compute_capability(monkeypatch, capability, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    fast_dtype.fast_precision.cache_clear()
    try:
        choice = fast_dtype.fast_precision(torch.device("cuda", 0))
    finally:
        fast_dtype.fast_precision.cache_clear()
    assert choice.precision == expected
    assert f"compute capability {capability[0]}.{capability[1]}" in choice.reason


def test_an_explicit_precision_wins_over_the_flags_and_the_timing(cpu):
    cpu(AVX2)
    assert fast_dtype.resolve_precision("bf16", CPU) == fast_dtype.PrecisionChoice("bf16", "set explicitly")
    cpu(AMX, speedup=3.0)
    assert fast_dtype.resolve_precision("fp32", CPU).precision == "fp32"


def test_run_resolution_replaces_auto_and_says_why(cpu):
    cpu(AVX2)
    cfg = to_dataclass(compose(["optim=muon"]))
    assert (cfg.trainer.precision, cfg.optim.muon.ns_dtype) == ("auto", "auto")  # the defaults
    resolved, line = precision.resolve_run_precisions(cfg, CPU, Mesh())
    assert (resolved.trainer.precision, resolved.optim.muon.ns_dtype) == ("fp32", "fp32")
    assert line == f"precision: fp32 training and Newton-Schulz (auto: {NO_UNITS})"
    assert cfg.trainer.precision == "auto"  # the caller's config is left as it was
    cpu(AMX, speedup=3.1)
    resolved, line = precision.resolve_run_precisions(cfg, CPU, Mesh())
    assert (resolved.trainer.precision, resolved.optim.muon.ns_dtype) == ("bf16", "bf16")
    assert line == ("precision: bf16 training and Newton-Schulz (auto: CPU has amx_bf16; bf16 matmul timed "
                    "at 3.10x fp32's speed (median of 7; bf16 needs >= 1.5x))")
    cpu(AVX2)

    explicit = to_dataclass(compose(["optim=muon", "trainer.precision=bf16"]))
    resolved, line = precision.resolve_run_precisions(explicit, CPU, Mesh())
    assert (resolved.trainer.precision, resolved.optim.muon.ns_dtype) == ("bf16", "fp32")
    assert line.startswith("precision: bf16 training (set explicitly); fp32 Newton-Schulz (auto: ")

    adamw = to_dataclass(compose(["optim=adamw"]))
    assert "Newton-Schulz" not in precision.resolve_run_precisions(adamw, CPU, Mesh())[1]


def test_adamw_with_an_explicit_precision_times_nothing(cpu, monkeypatch):
    cpu(AMX)  # flags that would lead "auto" to the timing
    monkeypatch.setattr(fast_dtype, "timed_bf16_speedups", never_timed)
    cfg = to_dataclass(compose(["optim=adamw", "trainer.precision=fp32"]))  # ns_dtype stays "auto"
    resolved, line = precision.resolve_run_precisions(cfg, CPU, Mesh())
    assert resolved.trainer.precision == "fp32" and line == "precision: fp32 training (set explicitly)"


def test_a_resumed_auto_run_keeps_the_precision_it_started_with(cpu):
    cpu(AVX2)  # this machine would choose fp32 ...
    cfg = to_dataclass(compose(["optim=muon"]))
    before = {"trainer": {"precision": "bf16"}, "optim": {"muon": {"ns_dtype": "bf16"}}}
    resolved, line = precision.resolve_run_precisions(cfg, CPU, Mesh(), before)
    # ... but the run it continues trained in bf16
    assert (resolved.trainer.precision, resolved.optim.muon.ns_dtype) == ("bf16", "bf16")
    assert "kept from the checkpoint this run resumes" in line
    explicit = to_dataclass(compose(["optim=muon", "trainer.precision=fp32"]))
    resolved, _ = precision.resolve_run_precisions(explicit, CPU, Mesh(), before)
    assert (resolved.trainer.precision, resolved.optim.muon.ns_dtype) == ("fp32", "bf16")


def _resolve_with_a_disagreeing_measurement(rank: int, world: int) -> tuple[str, str]:
    # Ranks on a CPU with bf16 units time their matmuls at different moments and may disagree.
    fast_dtype.cpu_flags = lambda: AMX
    fast_dtype.timed_bf16_speedups = lambda count: [1.0 if rank == 0 else 3.0] * count
    cfg = to_dataclass(compose(["optim=muon"]))
    resolved, _ = precision.resolve_run_precisions(cfg, CPU, build_mesh(1))
    return resolved.trainer.precision, resolved.optim.muon.ns_dtype


def test_every_rank_takes_rank_0s_choice():
    assert run_distributed(_resolve_with_a_disagreeing_measurement, 2) == [("fp32", "fp32")] * 2


def test_trainer_logs_and_records_the_resolved_precision(tmp_path, cpu, caplog):
    cpu(AVX2)
    with caplog.at_level(logging.INFO, logger="trainer"):
        trainer = make_trainer(tmp_path, ["trainer.precision=auto", "optim.muon.ns_dtype=auto", "trainer.max_steps=1"])
    assert (trainer.cfg.trainer.precision, trainer.cfg.optim.muon.ns_dtype) == ("fp32", "fp32")
    assert trainer.optimizer.optimizers["muon"].param_groups[0]["ns_dtype"] == torch.float32
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("precision:")]
    assert lines == [f"precision: fp32 training and Newton-Schulz (auto: {NO_UNITS})"]
    saved = yaml.safe_load((tmp_path / "resolved_config.yaml").read_text())
    assert (saved["trainer"]["precision"], saved["optim"]["muon"]["ns_dtype"]) == ("fp32", "fp32")
    assert saved["model"]["vocab_size"] == trainer.model_cfg.vocab_size > 0
    trainer.train()
    from trainer import checkpoint_files

    state = checkpoint_files.load(tmp_path / "checkpoints" / "step_00000001")
    assert state["config"]["trainer"]["precision"] == "fp32"
    # Resumed where bf16 units time faster: the run goes on in fp32, as it started.
    cpu(AMX, speedup=3.0)
    resumed = make_trainer(tmp_path, ["trainer.precision=auto", "optim.muon.ns_dtype=auto", "trainer.max_steps=2"])
    assert resumed.step == 1
    assert (resumed.cfg.trainer.precision, resumed.cfg.optim.muon.ns_dtype) == ("fp32", "fp32")


@pytest.mark.parametrize("flags, speedup, dtype", [(AVX2, 50.0, torch.float32), (AMX, 1.0, torch.float32),
                                                    (AMX, 2.0, torch.bfloat16)])
def test_muon_ns_dtype_auto_resolves_on_the_parameters_device(cpu, flags, speedup, dtype):
    cpu(flags, speedup)
    opt = Muon([torch.nn.Parameter(torch.randn(8, 4))], ns_dtype="auto")
    assert opt.param_groups[0]["ns_dtype"] == dtype


def test_more_local_ranks_than_gpus_names_both_counts_and_the_cpu_way_out():
    with pytest.raises(ValueError) as err:
        check_local_gpus("auto", local_ranks=4, gpus=1)
    message = str(err.value)
    assert "4 processes on this node" in message and "1 visible GPU;" in message
    assert "trainer.device=cpu" in message and "\n" not in message
    with pytest.raises(ValueError, match="3 processes on this node .* 2 visible GPUs"):
        check_local_gpus("cuda", local_ranks=3, gpus=2)
    with pytest.raises(ValueError, match="no CUDA device is visible.*trainer.device=cpu"):
        check_local_gpus("cuda", local_ranks=1, gpus=0)
    # Nothing to check: the CPU asked for, auto with no GPU (it trains on the CPU), enough GPUs.
    check_local_gpus("cpu", local_ranks=4, gpus=1)
    check_local_gpus("auto", local_ranks=4, gpus=0)
    check_local_gpus("auto", local_ranks=2, gpus=2)


# ---- trainer.tf32: TF32 for CUDA fp32 matmuls, one job at a time ----

# torch's own defaults, and neither of the two states a job sets: a leak in either direction shows.
PROCESS_TF32 = TF32Flags(matmul=False, cudnn=True)


@pytest.fixture
def process_tf32():
    """PROCESS_TF32 for the test, and afterwards the flags as this pytest process had them."""
    before = set_tf32(PROCESS_TF32)
    yield PROCESS_TF32
    set_tf32(before)


def test_set_tf32_sets_both_cuda_flags_and_returns_the_ones_it_replaced(process_tf32):
    onednn = torch.backends.mkldnn.matmul.fp32_precision
    assert set_tf32(True) == process_tf32
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (True, True)
    assert set_tf32(False) == TF32Flags(True, True)
    assert tf32_flags() == TF32Flags(False, False)
    assert set_tf32(process_tf32) == TF32Flags(False, False) and tf32_flags() == process_tf32
    with pytest.raises(RuntimeError, match="inside"), tf32_allowed(True):
        assert tf32_flags() == TF32Flags(True, True)
        raise RuntimeError("inside")
    assert tf32_flags() == process_tf32  # put back, also when the block raised
    # CPU matmuls keep their own setting (torch.set_float32_matmul_precision would change it).
    assert torch.backends.mkldnn.matmul.fp32_precision == onednn


def test_each_job_of_a_sweep_runs_with_its_own_tf32_and_leaves_the_process_as_it_was(tmp_path, process_tf32):
    """Two jobs in one process, in train.py's order of calls, as `train.py -m
    trainer.tf32=true,false` runs them: TF32 on for the first must not reach the second (an
    fp32 job would silently get TF32 matmuls), nor outlive the sweep."""
    from trainer.loop import Trainer

    seen = []
    for num, tf32 in enumerate(["true", "false"]):
        typed = to_dataclass(compose(TINY + [f"trainer.tf32={tf32}"]))
        before = launch.start_job(typed, fake_hydra(RunMode.MULTIRUN))
        trainer = Trainer(typed, tmp_path / str(num))
        at_start = tf32_flags()
        trainer.train()
        at_end = tf32_flags()
        launch.end_job(trainer.mesh, True, before)
        seen.append((before, at_start, at_end, tf32_flags()))
    on, off = TF32Flags(True, True), TF32Flags(False, False)
    assert seen == [(process_tf32, on, on, process_tf32), (process_tf32, off, off, process_tf32)]


@pytest.mark.parametrize("capability, tf32, override, says", [
    ((9, 0), True, None, "fp32 matmuls in TF32 (trainer.tf32=true)"),
    ((9, 0), False, None, "fp32 matmuls in true fp32 (trainer.tf32=false)"),
    ((8, 0), True, "0", "fp32 matmuls in true fp32 (NVIDIA_TF32_OVERRIDE=0 overrides trainer.tf32=true)"),
    ((7, 0), True, None, "fp32 matmuls in true fp32 (TF32 needs compute capability 8.0, this GPU has 7.0)"),
])
def test_the_start_up_line_says_how_cuda_runs_fp32_matmuls(monkeypatch, capability, tf32, override, says):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.delenv("NVIDIA_TF32_OVERRIDE", raising=False)
    if override is not None:
        monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", override)
    cfg = to_dataclass(compose(["optim=muon", "trainer.precision=fp32", "optim.muon.ns_dtype=fp32",
                                f"trainer.tf32={str(tf32).lower()}"]))
    _, line = precision.resolve_run_precisions(cfg, torch.device("cuda", 0), Mesh())
    assert line == f"precision: fp32 training and Newton-Schulz (set explicitly); {says}"
    # A CPU has no TF32: its line says nothing about it.
    assert precision.resolve_run_precisions(cfg, CPU, Mesh())[1] == "precision: fp32 training and Newton-Schulz (set explicitly)"


def test_a_tf32_that_is_not_a_bool_names_the_key():
    cfg = to_dataclass(compose())
    assert cfg.trainer.tf32 is True  # the default: TF32 where the GPU has it
    cfg.trainer.tf32 = "no"
    with pytest.raises(ConfigError, match=r"^trainer.tf32 must be true or false, got 'no'$"):
        validate(cfg)
