"""Everything that differs between CPU and CUDA lives here, so the rest stays device-agnostic."""
from __future__ import annotations

import contextlib
import os
import random
from typing import ContextManager

import numpy as np
import torch


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """"auto" picks this rank's GPU when CUDA is available, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("trainer.device=cuda but no CUDA device is available")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def autocast(device: torch.device, precision: str) -> ContextManager:
    """bf16 autocast with fp32 master weights, or nothing for fp32."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so wall-clock timings measure the work itself."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds CUDA generators too


def enable_fast_math(device: torch.device) -> None:
    """TF32 matmuls on Ampere+ GPUs: fp32 runs stay fp32 on CPU, where tests check equality."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def maybe_compile(module: torch.nn.Module, enabled: bool) -> torch.nn.Module:
    return torch.compile(module) if enabled else module


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def profiler_activities(device: torch.device) -> list[torch.profiler.ProfilerActivity]:
    """Host ops always; on CUDA the kernels too, so a trace shows the device's own timeline
    (host-side regions only measure kernel launches there)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities
