"""Everything that differs between CPU and CUDA lives here, so the rest stays device-agnostic."""
from __future__ import annotations

import contextlib
import os
import random
from dataclasses import dataclass
from typing import ContextManager, Iterator

import numpy as np
import torch


class DeviceError(ValueError):
    """This node cannot give each of its ranks the device the config asks for. Unlike a config
    error it may hold on one node only, so each node reports its own."""


def check_local_gpus(device: str, local_ranks: int, gpus: int) -> None:
    """Raise DeviceError, naming both counts, when this node's ranks cannot each get a GPU.

    Called before any work, so `torchrun --nproc_per_node=4` on a one-GPU machine stops with
    this line instead of a CUDA error from set_device on ranks 1 to 3.
    """
    if device == "cpu" or (device == "auto" and gpus == 0):
        return
    if gpus == 0:
        raise DeviceError("trainer.device=cuda but no CUDA device is visible; "
                          "run on the CPU with trainer.device=cpu")
    if local_ranks > gpus:
        raise DeviceError(
            f"trainer.device={device}: {local_ranks} processes on this node (torchrun "
            f"--nproc_per_node, or SLURM tasks per node) but {gpus} visible GPU{'s' if gpus > 1 else ''}; "
            f"start at most {gpus} per node, or run on the CPU with trainer.device=cpu"
        )


def check_device(name: str, local_rank: int = 0) -> None:
    """trainer.device=`name` for this rank and the others of its node, against the GPUs this
    process sees: DeviceError if they cannot each get one. Creates no CUDA context, so the
    start-up checks run it before anything is written."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    check_local_gpus(name, max(local_world_size(), local_rank + 1), gpus)


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """"auto" picks this rank's GPU when CUDA is available, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        check_device("cuda", local_rank)
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def autocast(device: torch.device, precision: str) -> ContextManager:
    """bf16 autocast with fp32 master weights, or nothing for fp32."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def use_deterministic_kernels(enabled: bool) -> None:
    """trainer.deterministic, set (or unset) for every job, so a sweep's jobs do not inherit it.

    cuBLAS reads its workspace setting when it first starts, hence before any CUDA matmul.
    warn_only stays off: with it, flash attention's backward keeps its non-deterministic kernel.
    """
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled)


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so wall-clock timings measure the work itself."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds CUDA generators too


@dataclass(frozen=True)
class TF32Flags:
    """Whether CUDA may run fp32 work on TF32 tensor cores (10-bit mantissa, fp32 range).

    Process-wide: one job's setting holds for every later fp32 matmul of the process until
    someone sets it again. Neither flag changes a CPU kernel.
    """
    matmul: bool  # cuBLAS: fp32 matmuls outside bf16 autocast
    cudnn: bool  # cuDNN: fp32 convolutions (torch's default is True here, False for matmul)


def tf32_flags() -> TF32Flags:
    return TF32Flags(torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)


def set_tf32(allowed: bool | TF32Flags) -> TF32Flags:
    """Allow (or forbid) TF32 for fp32 matmuls and convolutions on CUDA, whatever the device
    of this process; return the flags it replaced, for putting them back after the job.

    Through allow_tf32 rather than the newer fp32_precision settings: torch.compile's inductor
    reads torch.get_float32_matmul_precision(), which raises once the two APIs have been
    mixed, and set_float32_matmul_precision("high") would also switch CPU oneDNN matmuls to
    TF32 where the CPU has it.
    """
    before = tf32_flags()
    flags = allowed if isinstance(allowed, TF32Flags) else TF32Flags(allowed, allowed)
    torch.backends.cuda.matmul.allow_tf32 = flags.matmul
    torch.backends.cudnn.allow_tf32 = flags.cudnn
    return before


@contextlib.contextmanager
def tf32_allowed(allowed: bool) -> Iterator[None]:
    """set_tf32 for the duration of a block, then the flags as they were."""
    before = set_tf32(allowed)
    try:
        yield
    finally:
        set_tf32(before)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, without making the host wait: CUDA copies from pageable
    memory only after the stream has drained (a host sync per batch), from page-locked
    memory asynchronously. The pinned block is returned to torch's pinned-memory cache only
    once the copy has completed."""
    if device.type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def maybe_compile(module: torch.nn.Module, enabled: bool) -> torch.nn.Module:
    return torch.compile(module) if enabled else module


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_world_size() -> int:
    """Processes on this node: torchrun's LOCAL_WORLD_SIZE, 1 without torchrun."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def profiler_activities(device: torch.device) -> list[torch.profiler.ProfilerActivity]:
    """Host ops always; on CUDA the kernels too, so a trace shows the device's own timeline
    (host-side regions only measure kernel launches there)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities
