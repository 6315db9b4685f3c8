"""trainer.precision=auto and optim.muon.ns_dtype=auto for a run: what the device runs fast
(optim/fast_dtype.py), agreed across ranks, kept across a resume, and said at start-up."""
from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Optional

import torch

from optim.fast_dtype import PrecisionChoice, resolve_precision
from parallel.comm import broadcast, world
from parallel.mesh import Mesh

if TYPE_CHECKING:  # for the annotations only
    from trainer.config import TrainConfig


def _agree(choices: list[PrecisionChoice], device: torch.device, mesh: Mesh) -> list[PrecisionChoice]:
    """Rank 0's choices on every rank: ranks on unlike machines (a GPU without bf16 tensor
    cores beside one with them, a CPU without AMX beside one with it) may decide differently,
    and a run whose ranks train in different precisions would not be one model."""
    if mesh.world_size == 1:
        return choices
    flags = torch.tensor([float(c.precision == "bf16") for c in choices], device=device)
    broadcast(flags, 0, world(), "setup")
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
    chose, so a resume on another kind of machine does not switch precision halfway through.
    """
    requested = {"training": cfg.trainer.precision}
    before = {"training": (resumed or {}).get("trainer", {}).get("precision")}
    if cfg.optim.name == "muon":  # AdamW runs no Newton-Schulz: nothing to choose
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
