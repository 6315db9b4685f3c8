"""The dtype a device runs fast: what trainer.precision=auto and optim.muon.ns_dtype=auto mean.

A fixed rule on what the hardware has, never a timing, so that the same machine always
resolves the same way: a timing of bf16 against fp32 matmuls on a busy machine read anywhere
from 1x to 18x for identical commands, and identical runs then trained in fp32 one time and
bf16 the next.

- CUDA: bf16 on compute capability 8.0 and newer (bf16 tensor cores), else fp32.
- CPU: bf16 only with a bf16 matrix unit, Intel AMX (`amx_bf16`), else fp32. Without one a
  bf16 matmul is no faster than fp32 and often far slower (AVX2), at best level with fp32
  under AVX512's BF16 dot-product extension (`avx512_bf16`, a vector instruction, not a
  matrix unit; lab/BENCHMARKS.md), so there bf16 would give up mantissa bits for nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

# The CPU flag (as /proc/cpuinfo and torch.cpu.get_capabilities() both spell it) of AMX's bf16
# matrix instructions. amx_tile alone is not enough: it is the tile registers, and bf16
# arithmetic on them is amx_bf16.
AMX_BF16 = "amx_bf16"
# A bf16 extension that does not earn bf16 (see the module docstring); named in the reason
# so that a user who knows the CPU "has bf16" sees why it still trains in fp32.
AVX512_BF16 = "avx512_bf16"

CPUINFO = Path("/proc/cpuinfo")  # Linux's; absent on macOS and Windows
KERNEL_SOURCE = "/proc/cpuinfo"
TORCH_SOURCE = "torch.cpu.get_capabilities()"


@dataclass(frozen=True)
class PrecisionChoice:
    precision: str  # "bf16" or "fp32"
    reason: str


@dataclass(frozen=True)
class CpuFeatures:
    """The CPU's feature flags and where they were read (named in the start-up line)."""
    flags: frozenset[str]
    source: str


def parse_cpuinfo_flags(cpuinfo: str) -> frozenset[str]:
    """The flags every processor in /proc/cpuinfo text lists (empty when it has no `flags`
    line, e.g. on ARM). Only the common ones: a flag some cores lack cannot be relied on."""
    per_cpu = [set(line.partition(":")[2].split()) for line in cpuinfo.splitlines()
               if line.split(":")[0].strip() == "flags"]
    return frozenset(set.intersection(*per_cpu)) if per_cpu else frozenset()


def torch_cpu_flags(capabilities: Mapping[str, object]) -> frozenset[str]:
    """The features torch.cpu.get_capabilities() reports as present (its map also holds
    counts and names, such as cache sizes and the architecture: only True counts)."""
    return frozenset(name for name, value in capabilities.items() if value is True)


def cpu_features() -> CpuFeatures:
    """This CPU's flags. Where the Linux kernel lists them, its list decides: it names
    amx_bf16 only once it has enabled AMX's tile state for processes (Linux 5.16 and newer),
    while CPUID, which torch reads, names the unit whether or not this process may use it.
    Elsewhere (macOS, Windows) torch.cpu.get_capabilities(), torch's CPUID-based feature
    map. Not torch.backends.cpu.get_cpu_capability(): that names the vector ISA level torch's
    kernels dispatch to ("AVX512"), never AMX, so it cannot tell."""
    try:
        flags = parse_cpuinfo_flags(CPUINFO.read_text())
    except OSError:
        flags = frozenset()
    if flags:
        return CpuFeatures(flags, KERNEL_SOURCE)
    get_capabilities = getattr(torch.cpu, "get_capabilities", None)  # absent from older torch
    return CpuFeatures(torch_cpu_flags(get_capabilities() if get_capabilities else {}), TORCH_SOURCE)


def decide_cpu_precision(features: CpuFeatures) -> PrecisionChoice:
    """What "auto" means on a CPU with `features`: bf16 with AMX bf16, else fp32; the reason
    names the flag and where it was read."""
    if AMX_BF16 in features.flags:
        return PrecisionChoice("bf16", f"CPU has AMX bf16 ({AMX_BF16} in {features.source})")
    has = f"CPU has {AVX512_BF16} but no AMX bf16" if AVX512_BF16 in features.flags else "CPU has no AMX bf16"
    return PrecisionChoice("fp32", f"{has} (no {AMX_BF16} in {features.source})")


def fast_precision(device: torch.device) -> PrecisionChoice:
    """What "auto" means on `device`: bf16 on GPUs with bf16 tensor cores and on CPUs with AMX
    bf16, else fp32. Not torch.cuda.is_bf16_supported(): it asks about the current device, not
    `device`, and by default says yes on GPUs that only emulate bf16, slower than fp32."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name = torch.cuda.get_device_name(device)
        if major >= 8:  # Ampere and newer have bf16 tensor cores
            return PrecisionChoice("bf16", f"CUDA {name} (compute capability {major}.{minor}) has bf16 tensor cores")
        return PrecisionChoice("fp32", f"CUDA {name} (compute capability {major}.{minor}) has no bf16 tensor cores")
    if device.type != "cpu":
        return PrecisionChoice("fp32", f"no bf16 rule for {device.type} devices")
    return decide_cpu_precision(cpu_features())


def resolve_precision(requested: str, device: torch.device) -> PrecisionChoice:
    """An explicit "bf16" or "fp32" wins; "auto" asks fast_precision."""
    if requested == "auto":
        return fast_precision(device)
    return PrecisionChoice(requested, "set explicitly")
