"""trainer.precision=auto and optim.muon.ns_dtype=auto: bf16 where the device runs it fast.

bf16 is the right default on GPUs and the wrong one on most CPUs: without bf16 units (AVX2,
or AVX512 without its BF16 extension) a bf16 matmul runs about 20x slower than fp32. So
"auto" looks at the device: compute capability on CUDA, a short measurement on a CPU.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # trainer.config imports optim.muon, which imports this module
    from trainer.config import TrainConfig
    from trainer.mesh import Mesh

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
    from eval.flops import measure_matmul_peak  # eval.flops is heavier than this module

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


def _agree(choices: list[PrecisionChoice], device: torch.device, mesh: Mesh) -> list[PrecisionChoice]:
    """Rank 0's choices on every rank: ranks that each timed a CPU matmul may disagree, and
    a run whose ranks train in different precisions would not be one model."""
    if mesh.world_size == 1:
        return choices
    flags = torch.tensor([float(c.precision == "bf16") for c in choices], device=device)
    dist.broadcast(flags, src=0)
    return [c if (c.precision == "bf16") == bool(f) else PrecisionChoice("bf16" if f else "fp32", "rank 0's choice")
            for c, f in zip(choices, flags.tolist())]


def cuda_fp32_matmuls(device: torch.device, tf32: bool) -> Optional[str]:
    """How fp32 matmuls run under trainer.tf32, for the start-up line; None off CUDA, where
    TF32 does not exist. NVIDIA_TF32_OVERRIDE=0 is the driver's veto over torch's flag."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"fp32 matmuls in true fp32 (TF32 needs compute capability 8.0, this GPU has {major}.{minor})"
    if tf32 and os.environ.get("NVIDIA_TF32_OVERRIDE") == "0":
        return "fp32 matmuls in true fp32 (NVIDIA_TF32_OVERRIDE=0 overrides trainer.tf32=true)"
    return f"fp32 matmuls in {'TF32' if tf32 else 'true fp32'} (trainer.tf32={str(tf32).lower()})"


def resolve_run_precisions(
    cfg: TrainConfig, device: torch.device, mesh: Mesh, resumed: Optional[dict[str, Any]] = None
) -> tuple[TrainConfig, str]:
    """`cfg` with trainer.precision and optim.muon.ns_dtype resolved (so the checkpoint, the
    logged config and resolved_config.yaml record what ran), and the start-up line saying
    what was chosen and why (on CUDA also whether fp32 matmuls run in TF32).

    `resumed` is the config of the checkpoint this run continues: "auto" keeps what that run
    chose, so a resume (on another machine, or after a measurement that came out the other
    way) does not switch precision halfway through.
    """
    requested = {"training": cfg.trainer.precision}
    before = {"training": (resumed or {}).get("trainer", {}).get("precision")}
    if cfg.optim.name == "muon":  # AdamW runs no Newton-Schulz: nothing to choose or measure
        requested["Newton-Schulz"] = cfg.optim.muon.ns_dtype
        before["Newton-Schulz"] = (resumed or {}).get("optim", {}).get("muon", {}).get("ns_dtype")
    chosen = {}
    for name, value in requested.items():
        if value == "auto" and before[name] in ("bf16", "fp32"):
            chosen[name] = PrecisionChoice(before[name], "kept from the checkpoint this run resumes")
        else:
            chosen[name] = resolve_precision(value, device)
    if "auto" in requested.values():
        chosen = dict(zip(chosen, _agree(list(chosen.values()), device, mesh)))
    parts = [(c.precision, n, f"auto: {c.reason}" if requested[n] == "auto" else "set explicitly")
             for n, c in chosen.items()]
    if len(parts) == 2 and parts[0][0::2] == parts[1][0::2]:
        line = f"precision: {parts[0][0]} training and Newton-Schulz ({parts[0][2]})"
    else:
        line = "precision: " + "; ".join(f"{p} {n} ({why})" for p, n, why in parts)
    matmuls = cuda_fp32_matmuls(device, cfg.trainer.tf32)
    if matmuls is not None:
        line += f"; {matmuls}"
    muon = cfg.optim.muon
    if "Newton-Schulz" in chosen:
        muon = replace(muon, ns_dtype=chosen["Newton-Schulz"].precision)
    resolved = replace(
        cfg,
        trainer=replace(cfg.trainer, precision=chosen["training"].precision),
        optim=replace(cfg.optim, muon=muon),
    )
    return resolved, line
