"""The dtype a device runs fast: what trainer.precision=auto and optim.muon.ns_dtype=auto mean.

bf16 is the right default on GPUs and the wrong one on most CPUs: without bf16 units (AVX2,
or AVX512 without its BF16 extension) a bf16 matmul runs about 20x slower than fp32. So
"auto" looks at the device: compute capability on CUDA, the CPU's feature flags on a CPU.
A CPU's decision rests on its flags, not on a timing alone: a fraction of a second of matmuls
on a busy machine read anywhere from 1x to 18x for identical commands, and the same run then
trained in fp32 one time and bf16 the next.
"""
from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

# CPU flags (as /proc/cpuinfo spells them) of units that compute bf16 products in hardware:
# AMX tiles with their bf16 instructions, and AVX512's BF16 dot-product extension. amx_tile
# alone is not enough: it is the tile registers, and bf16 arithmetic on them is amx_bf16.
BF16_UNIT_FLAGS = ("amx_bf16", "avx512_bf16")

# With bf16 units, bf16 must still time at least this much faster than fp32 to be chosen.
# Units that torch's kernels reach give about 2x (AVX512-BF16: two bf16 products per fp32
# lane) to 10x and more (AMX); kernels that miss them time about 1x, a tie not worth bf16's
# 8-bit mantissa. The margin sits between the two, clear of both: on a busy machine the
# median still scatters, and on the 2-core avx512_bf16 VM this was written on (bf16 ties
# fp32 there) it read 0.6x to 1.17x over ~90 runs at a load of 4-5, so 1.2x would have been
# one bad minute from flipping; 1.5x keeps that machine on fp32 and passes any 2x unit.
BF16_MIN_SPEEDUP = 1.5

# Samples whose median ratio decides: one busy stretch spoils a sample or two, not the median.
BF16_TIMING_SAMPLES = 7

# Calls of each dtype per sample, taken in turns; the fastest of each counts, since a busy
# machine only ever adds time to a call and the fastest is the one it disturbed least.
CALLS_PER_SAMPLE = 3

# Square F.linear operands of this size: like the models' own matmuls, and about 10 ms a
# call on two cores, so the whole confirmation stays near half a second.
TIMING_SIZE = 512

CPUINFO = Path("/proc/cpuinfo")  # Linux's; absent on macOS and Windows


@dataclass(frozen=True)
class PrecisionChoice:
    precision: str  # "bf16" or "fp32"
    reason: str


def parse_cpuinfo_flags(cpuinfo: str) -> frozenset[str]:
    """The flags every processor in /proc/cpuinfo text lists (empty when it has no `flags`
    line, e.g. on ARM). Only the common ones: a flag some cores lack cannot be relied on."""
    per_cpu = [set(line.partition(":")[2].split()) for line in cpuinfo.splitlines()
               if line.split(":")[0].strip() == "flags"]
    return frozenset(set.intersection(*per_cpu)) if per_cpu else frozenset()


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags: /proc/cpuinfo on Linux; elsewhere torch's CPU capability
    ("avx2", "avx512", ...), which names a vector ISA level and never bf16 units, so such a
    machine counts as having none and trains in fp32 without a timing."""
    try:
        flags = parse_cpuinfo_flags(CPUINFO.read_text())
    except OSError:
        flags = frozenset()
    return flags or frozenset({torch.backends.cpu.get_cpu_capability().lower()})


def cpu_bf16_units(flags: Iterable[str]) -> list[str]:
    """The BF16_UNIT_FLAGS among `flags`, in BF16_UNIT_FLAGS order."""
    present = set(flags)
    return [flag for flag in BF16_UNIT_FLAGS if flag in present]


def cpu_has_bf16_units(flags: Iterable[str]) -> bool:
    return bool(cpu_bf16_units(flags))


def _time_linear(operands: tuple[torch.Tensor, torch.Tensor]) -> float:
    start = time.perf_counter()
    F.linear(*operands)
    return time.perf_counter() - start


def _speedup_sample(fp32: tuple[torch.Tensor, torch.Tensor], bf16: tuple[torch.Tensor, torch.Tensor],
                    bf16_first: bool) -> float:
    """Fastest fp32 call / fastest bf16 call of CALLS_PER_SAMPLE each, the two dtypes in
    turns, so load that comes and goes reaches both sides of the ratio alike."""
    fp32_times: list[float] = []
    bf16_times: list[float] = []
    for call in range(CALLS_PER_SAMPLE):
        turn = [(fp32, fp32_times), (bf16, bf16_times)]
        if bf16_first != (call % 2 == 1):
            turn.reverse()
        for operands, times in turn:
            times.append(_time_linear(operands))
    return min(fp32_times) / min(bf16_times)


def timed_bf16_speedups(count: int) -> list[float]:
    """`count` samples of bf16 over fp32 F.linear speed on this CPU. Samples alternate which
    dtype goes first, so a load that rises or falls during the probe favours neither."""
    gen = torch.Generator().manual_seed(0)
    fp32 = (torch.randn(TIMING_SIZE, TIMING_SIZE, generator=gen), torch.randn(TIMING_SIZE, TIMING_SIZE, generator=gen))
    bf16 = (fp32[0].bfloat16(), fp32[1].bfloat16())
    for _ in range(2):  # kernel choice and first-touch allocations stay out of the samples
        _time_linear(fp32)
        _time_linear(bf16)
    return [_speedup_sample(fp32, bf16, bf16_first=i % 2 == 1) for i in range(count)]


def decide_cpu_precision(flags: Iterable[str], time_speedups: Callable[[int], list[float]],
                         samples: int = BF16_TIMING_SAMPLES) -> PrecisionChoice:
    """What "auto" means on a CPU with `flags`: fp32 without bf16 units (`time_speedups` is
    not called: a timing cannot make bf16 fast there, only make the answer vary); with them
    bf16, confirmed by the median of `time_speedups(samples)` (bf16 over fp32 speed), fp32
    with the reason when that falls short of BF16_MIN_SPEEDUP (e.g. kernels that miss the
    units)."""
    units = cpu_bf16_units(flags)
    if not units:
        return PrecisionChoice("fp32", f"CPU has no bf16 units: no {'/'.join(BF16_UNIT_FLAGS)} flag")
    speedup = statistics.median(time_speedups(samples))
    timed = f"{speedup:.2f}x fp32's speed (median of {samples}; bf16 needs >= {BF16_MIN_SPEEDUP}x)"
    if speedup >= BF16_MIN_SPEEDUP:
        return PrecisionChoice("bf16", f"CPU has {units[0]}; bf16 matmul timed at {timed}")
    return PrecisionChoice("fp32", f"CPU has {units[0]} but bf16 matmul timed at only {timed}")


@functools.lru_cache(maxsize=None)
def fast_precision(device: torch.device) -> PrecisionChoice:
    """What "auto" means on `device`: bf16 on GPUs with bf16 tensor cores and on CPUs with
    bf16 units that time faster, else fp32.

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
    return decide_cpu_precision(cpu_flags(), timed_bf16_speedups)


def resolve_precision(requested: str, device: torch.device) -> PrecisionChoice:
    """An explicit "bf16" or "fp32" wins; "auto" asks fast_precision."""
    if requested == "auto":
        return fast_precision(device)
    return PrecisionChoice(requested, "set explicitly")
