"""trainer.precision=auto and optim.muon.ns_dtype=auto, and the one-GPU-per-rank check.

"auto" is a fixed rule on what the hardware has, never a timing: on a CPU bf16 only with AMX
bf16 (`amx_bf16`), else fp32; on CUDA bf16 from compute capability 8.0. The CPU's flags are
mocked here (their real values depend on the machine), except in the test that resolves this
machine's own "auto" many times under load. "auto" must follow them, on every rank alike, and
an explicit precision must win over them. The compute capability is mocked here and checked
for real by tests/test_gpu.py.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch
import yaml
from torch.overrides import TorchFunctionMode

from optim import fast_dtype
from optim.fast_dtype import CpuFeatures, PrecisionChoice
from optim.muon.optimizer import Muon
from tests.conftest import compose
from tests.distributed import run_distributed
from tests.test_checkpoint import make_trainer
from hydra.types import RunMode

from tests.test_multirun import TINY, fake_hydra
from trainer import precision
from trainer.run import launch
from trainer.config import ConfigError, to_dataclass, validate
from trainer.device import TF32Flags, check_local_gpus, set_tf32, tf32_allowed, tf32_flags
from parallel.mesh import Mesh, build_mesh

CPU = torch.device("cpu")

# CPU flag sets as /proc/cpuinfo would list them (abridged).
AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma"})  # most laptops and CI runners
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl"}  # AVX512 without its BF16 extension
AVX512_BF16 = AVX512 | {"avx512_bf16"}  # bf16 dot products, but no matrix unit
AMX = AVX512_BF16 | {"amx_tile", "amx_bf16", "amx_int8"}  # Sapphire Rapids and newer
NO_AMX = "CPU has no AMX bf16 (no amx_bf16 in /proc/cpuinfo)"
ONLY_AVX512_BF16 = "CPU has avx512_bf16 but no AMX bf16 (no amx_bf16 in /proc/cpuinfo)"
HAS_AMX = "CPU has AMX bf16 (amx_bf16 in /proc/cpuinfo)"


@pytest.fixture
def cpu(monkeypatch):
    """Set this CPU's flags, as the kernel's /proc/cpuinfo would list them."""
    def set_cpu(flags: frozenset[str]) -> None:
        monkeypatch.setattr(fast_dtype, "cpu_features", lambda: CpuFeatures(flags, "/proc/cpuinfo"))

    return set_cpu


@pytest.mark.parametrize("flags, expected", [
    (AMX, PrecisionChoice("bf16", HAS_AMX)),
    (frozenset({"amx_bf16"}), PrecisionChoice("bf16", HAS_AMX)),
    (AVX512_BF16, PrecisionChoice("fp32", ONLY_AVX512_BF16)),
    (AVX512 | {"amx_tile", "amx_int8"}, PrecisionChoice("fp32", NO_AMX)),  # tiles without bf16 on them
    (AVX512, PrecisionChoice("fp32", NO_AMX)),
    (AVX2, PrecisionChoice("fp32", NO_AMX)),
    (frozenset(), PrecisionChoice("fp32", NO_AMX)),
])
def test_a_cpu_is_bf16_with_amx_bf16_and_fp32_without_saying_which(cpu, flags, expected):
    cpu(flags)
    assert fast_dtype.resolve_precision("auto", CPU) == expected


def write_cpuinfo(path: Path, *flag_lines: str) -> Path:
    path.write_text("".join(f"processor\t: {i}\nflags\t\t: {flags}\n\n" for i, flags in enumerate(flag_lines)))
    return path


def set_torch_capabilities(monkeypatch, **present: bool) -> None:
    """torch.cpu.get_capabilities() as torch would report a CPU: flags, and counts and names."""
    capabilities = {"avx2": True, "avx512_f": True, "num_logical_cores": 2, "architecture": "x86_64"} | present
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: capabilities)


@pytest.mark.parametrize("kernel_lists_amx", [True, False])
def test_the_kernels_flags_decide_where_it_lists_them(monkeypatch, tmp_path, kernel_lists_amx):
    amx = " amx_tile amx_bf16" if kernel_lists_amx else ""
    monkeypatch.setattr(fast_dtype, "CPUINFO", write_cpuinfo(tmp_path / "cpuinfo", "fpu avx2 avx512_bf16" + amx,
                                                              "fpu avx2 avx512_bf16" + amx))
    # torch's CPUID reading says the opposite: the kernel's list still decides, since the
    # kernel names AMX only once it lets processes use it.
    set_torch_capabilities(monkeypatch, amx_bf16=not kernel_lists_amx)
    features = fast_dtype.cpu_features()
    assert features.source == "/proc/cpuinfo"
    assert fast_dtype.resolve_precision("auto", CPU) == (
        PrecisionChoice("bf16", HAS_AMX) if kernel_lists_amx else PrecisionChoice("fp32", ONLY_AVX512_BF16))


@pytest.mark.parametrize("torch_says_amx", [True, False])
def test_without_proc_cpuinfo_torchs_capabilities_decide(monkeypatch, tmp_path, torch_says_amx):
    monkeypatch.setattr(fast_dtype, "CPUINFO", tmp_path / "cpuinfo")  # not there, as on macOS or Windows
    set_torch_capabilities(monkeypatch, amx_bf16=torch_says_amx, amx_tile=torch_says_amx)
    features = fast_dtype.cpu_features()
    assert features == CpuFeatures(frozenset({"avx2", "avx512_f"} | ({"amx_bf16", "amx_tile"} if torch_says_amx else set())),
                                   "torch.cpu.get_capabilities()")
    source = "torch.cpu.get_capabilities()"
    assert fast_dtype.resolve_precision("auto", CPU) == (
        PrecisionChoice("bf16", f"CPU has AMX bf16 (amx_bf16 in {source})") if torch_says_amx
        else PrecisionChoice("fp32", f"CPU has no AMX bf16 (no amx_bf16 in {source})"))


def test_a_flag_only_some_cores_list_does_not_count(monkeypatch, tmp_path):
    monkeypatch.setattr(fast_dtype, "CPUINFO", write_cpuinfo(tmp_path / "cpuinfo", "avx2 amx_bf16", "avx2"))
    set_torch_capabilities(monkeypatch, amx_bf16=True)
    assert fast_dtype.resolve_precision("auto", CPU) == PrecisionChoice("fp32", NO_AMX)


def test_parse_cpuinfo_flags_keeps_the_flags_every_processor_has():
    cpuinfo = ("processor\t: 0\nmodel name\t: a CPU\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16\n\n"
               "processor\t: 1\nflags\t\t: fpu avx2 avx512f amx_bf16\nbugs\t\t: spectre_v1\n")
    # avx512_bf16 on one core only cannot be relied on; "bugs" is not a flags line
    assert fast_dtype.parse_cpuinfo_flags(cpuinfo) == {"fpu", "avx2", "avx512f", "amx_bf16"}
    arm = "processor\t: 0\nFeatures\t: fp asimd bf16\n"  # aarch64 has no `flags` line
    assert fast_dtype.parse_cpuinfo_flags(arm) == frozenset()


class TorchCalls(TorchFunctionMode):
    """Every torch function called in this thread while active: a timing would show up as
    matmuls (and the tensors it times)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


def test_this_machines_auto_is_one_answer_fifty_times_on_a_busy_cpu():
    """Before: a timing decided, and identical runs on a busy machine picked fp32 one time and
    bf16 the next. Now the rule reads flags only: the same answer every time however busy the
    CPU, and no matmul to time."""
    stop = threading.Event()
    busy = [threading.Event() for _ in range(2)]  # one a core: matmuls release the GIL

    def load(started: threading.Event) -> None:  # bf16 and fp32 matmuls, as a timing's rivals
        a = torch.randn(384, 384)
        b = a.bfloat16()
        while not stop.is_set():
            a @ a
            b @ b
            started.set()

    threads = [threading.Thread(target=load, args=(started,), daemon=True) for started in busy]
    for thread in threads:
        thread.start()
    try:
        assert all(started.wait(timeout=30) for started in busy)  # the CPU is loaded before the first
        with TorchCalls() as calls:  # this thread's torch calls only: the load's are not counted
            choices = [fast_dtype.resolve_precision("auto", CPU) for _ in range(50)]
        assert all(thread.is_alive() for thread in threads)  # and stayed loaded until the last
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert calls.names == []
    assert set(choices) == {fast_dtype.decide_cpu_precision(fast_dtype.cpu_features())}
    has_amx = "amx_bf16" in fast_dtype.cpu_features().flags
    assert choices[0].precision == ("bf16" if has_amx else "fp32") and "amx_bf16" in choices[0].reason


@pytest.mark.parametrize("capability, expected", [((9, 0), "bf16"), ((8, 0), "bf16"), ((7, 0), "fp32")])
def test_auto_on_cuda_follows_the_compute_capability(monkeypatch, capability, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    choice = fast_dtype.fast_precision(torch.device("cuda", 0))
    assert choice.precision == expected
    assert f"compute capability {capability[0]}.{capability[1]}" in choice.reason


def test_an_explicit_precision_wins_over_the_flags(cpu):
    cpu(AVX2)
    assert fast_dtype.resolve_precision("bf16", CPU) == PrecisionChoice("bf16", "set explicitly")
    cpu(AMX)
    assert fast_dtype.resolve_precision("fp32", CPU) == PrecisionChoice("fp32", "set explicitly")


def test_run_resolution_replaces_auto_and_says_which_rule_applied(cpu):
    cpu(AVX2)
    cfg = to_dataclass(compose(["optim=muon"]))
    assert (cfg.trainer.precision, cfg.optim.muon.ns_dtype) == ("auto", "auto")  # the defaults
    resolved, line = precision.resolve_run_precisions(cfg, CPU, Mesh())
    assert (resolved.trainer.precision, resolved.optim.muon.ns_dtype) == ("fp32", "fp32")
    assert line == f"precision: fp32 training and Newton-Schulz (auto: {NO_AMX})"
    assert cfg.trainer.precision == "auto"  # the caller's config is left as it was
    cpu(AMX)
    resolved, line = precision.resolve_run_precisions(cfg, CPU, Mesh())
    assert (resolved.trainer.precision, resolved.optim.muon.ns_dtype) == ("bf16", "bf16")
    assert line == f"precision: bf16 training and Newton-Schulz (auto: {HAS_AMX})"
    cpu(AVX512_BF16)

    explicit = to_dataclass(compose(["optim=muon", "trainer.precision=bf16"]))
    resolved, line = precision.resolve_run_precisions(explicit, CPU, Mesh())
    assert (resolved.trainer.precision, resolved.optim.muon.ns_dtype) == ("bf16", "fp32")
    assert line == f"precision: bf16 training (set explicitly); fp32 Newton-Schulz (auto: {ONLY_AVX512_BF16})"

    adamw = to_dataclass(compose(["optim=adamw"]))
    assert "Newton-Schulz" not in precision.resolve_run_precisions(adamw, CPU, Mesh())[1]


def test_adamw_with_an_explicit_precision_reads_no_flags(monkeypatch):
    def never_read() -> CpuFeatures:
        raise AssertionError("read the CPU's flags for a run that chose its precision")

    monkeypatch.setattr(fast_dtype, "cpu_features", never_read)
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


def _resolve_on_unlike_cpus(rank: int, world: int) -> tuple[str, str]:
    # Rank 0 on a CPU without AMX, rank 1 on one with it: each alone would decide differently.
    flags = AVX512_BF16 if rank == 0 else AMX
    fast_dtype.cpu_features = lambda: CpuFeatures(flags, "/proc/cpuinfo")
    cfg = to_dataclass(compose(["optim=muon"]))
    resolved, _ = precision.resolve_run_precisions(cfg, CPU, build_mesh(1))
    return resolved.trainer.precision, resolved.optim.muon.ns_dtype


def test_every_rank_takes_rank_0s_choice():
    assert run_distributed(_resolve_on_unlike_cpus, 2) == [("fp32", "fp32")] * 2


def test_trainer_logs_and_records_the_resolved_precision(tmp_path, cpu, caplog):
    cpu(AVX2)
    with caplog.at_level(logging.INFO, logger="trainer"):
        trainer = make_trainer(tmp_path, ["trainer.precision=auto", "optim.muon.ns_dtype=auto", "trainer.max_steps=1"])
    assert (trainer.cfg.trainer.precision, trainer.cfg.optim.muon.ns_dtype) == ("fp32", "fp32")
    assert trainer.optimizer.optimizers["muon"].param_groups[0]["ns_dtype"] == torch.float32
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("precision:")]
    assert lines == [f"precision: fp32 training and Newton-Schulz (auto: {NO_AMX})"]
    saved = yaml.safe_load((tmp_path / "resolved_config.yaml").read_text())
    assert (saved["trainer"]["precision"], saved["optim"]["muon"]["ns_dtype"]) == ("fp32", "fp32")
    assert saved["model"]["vocab_size"] == trainer.model_cfg.vocab_size > 0
    trainer.train()
    from trainer.checkpoint import files as checkpoint_files

    state = checkpoint_files.load(tmp_path / "checkpoints" / "step_00000001")
    assert state["config"]["trainer"]["precision"] == "fp32"
    # Resumed on a CPU with AMX bf16: the run goes on in fp32, as it started.
    cpu(AMX)
    resumed = make_trainer(tmp_path, ["trainer.precision=auto", "optim.muon.ns_dtype=auto", "trainer.max_steps=2"])
    assert resumed.step == 1
    assert (resumed.cfg.trainer.precision, resumed.cfg.optim.muon.ns_dtype) == ("fp32", "fp32")


@pytest.mark.parametrize("flags, dtype", [(AVX2, torch.float32), (AVX512_BF16, torch.float32), (AMX, torch.bfloat16)])
def test_muon_ns_dtype_auto_resolves_on_the_parameters_device(cpu, flags, dtype):
    cpu(flags)
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
