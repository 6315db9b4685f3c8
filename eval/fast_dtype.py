"""The dtype a device runs fast: what trainer.precision=auto and optim.muon.ns_dtype=auto mean.

bf16 is the right default on GPUs and the wrong one on most CPUs: without bf16 units (AVX2,
or AVX512 without its BF16 extension) a bf16 matmul runs about 20x slower than fp32. So
"auto" looks at the device: compute capability on CUDA, a short measurement on a CPU.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from eval.flops import measure_matmul_peak

# On a CPU, bf16 must beat fp32 by this much to be chosen: a tie is not worth bf16's
# precision loss, and the measurement is a fraction of a second on a possibly busy machine.
BF16_MIN_SPEEDUP = 1.2


@dataclass(frozen=True)
class PrecisionChoice:
    precision: str  # "bf16" or "fp32"
    reason: str


def cpu_bf16_speedup() -> float:
    """bf16 over fp32 F.linear throughput on this CPU, at a size like the models' own matmuls.

    A CPU feature flag would not do: AVX512 without its BF16 extension, or a torch built
    without the right kernels, runs bf16 many times slower than fp32 (about 20x on AVX2).
    """
    fp32 = measure_matmul_peak(torch.device("cpu"), "fp32", seconds=0.05, size=512)
    bf16 = measure_matmul_peak(torch.device("cpu"), "bf16", seconds=0.05, size=512)
    return bf16 / fp32


@functools.lru_cache(maxsize=None)
def fast_precision(device: torch.device) -> PrecisionChoice:
    """What "auto" means on `device`: bf16 where its matmuls are really faster, else fp32.

    Cached per device: every trainer of a sweep or a test session gets the same answer.
    """
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name = torch.cuda.get_device_name(device)
        if major >= 8:  # Ampere and newer have bf16 tensor cores
            return PrecisionChoice("bf16", f"CUDA {name} (compute capability {major}.{minor}) has bf16 tensor cores")
        return PrecisionChoice("fp32", f"CUDA {name} (compute capability {major}.{minor}) has no bf16 tensor cores")
    if device.type != "cpu":
        return PrecisionChoice("fp32", f"no bf16 measurement for {device.type} devices")
    speedup = cpu_bf16_speedup()
    verdict = "bf16" if speedup >= BF16_MIN_SPEEDUP else "fp32"
    return PrecisionChoice(verdict, f"bf16 matmul measured at {speedup:.2f}x fp32's speed on this CPU "
                                    f"(bf16 needs >= {BF16_MIN_SPEEDUP}x)")


def resolve_precision(requested: str, device: torch.device) -> PrecisionChoice:
    """An explicit "bf16" or "fp32" wins; "auto" asks fast_precision."""
    if requested == "auto":
        return fast_precision(device)
    return PrecisionChoice(requested, "set explicitly")
