"""The DP x TP process mesh.

TP groups are contiguous ranks (rank = dp_rank * tp + tp_rank), so a TP group sits on one
node and its frequent activation collectives stay on the fast intra-node links; DP groups
are strided across them.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from model.comm import label_group


@dataclass(frozen=True)
class Mesh:
    rank: int = 0
    world_size: int = 1
    tp: int = 1
    tp_group: Optional[dist.ProcessGroup] = None
    dp_group: Optional[dist.ProcessGroup] = None

    @property
    def dp(self) -> int:
        return self.world_size // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def check_mesh_shape(world_size: int, tp: int) -> None:
    """Raise ValueError naming parallel.tp if the world cannot be split into DP x TP."""
    if tp < 1 or world_size % tp:
        raise ValueError(
            f"parallel.tp={tp} does not divide the world size {world_size} "
            "(the number of processes torchrun started)"
        )


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_mesh(tp: int, device: torch.device, backend: str = "auto", timeout_s: float = 600.0) -> Mesh:
    """Join the job torchrun started (env:// rendezvous) and build the DP and TP groups.

    Without torchrun (WORLD_SIZE unset) this is a single process and no group is created.
    The timeout turns a dead peer into an error instead of a hang.
    """
    world_size = world_size_from_env()
    check_mesh_shape(world_size, tp)
    if world_size == 1:
        return Mesh()
    if not dist.is_initialized():
        dist.init_process_group(
            backend=default_backend(device) if backend == "auto" else backend,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    return build_mesh(tp)


def build_mesh(tp: int) -> Mesh:
    """Create the groups on an initialised default group. Every rank must call this."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    check_mesh_shape(world_size, tp)
    dp = world_size // tp
    tp_group = dp_group = None
    # new_group is collective: every rank creates every group, in the same order.
    for d in range(dp):
        ranks = [d * tp + t for t in range(tp)]
        group = dist.new_group(ranks)
        if rank in ranks:
            tp_group = group
    for t in range(tp):
        ranks = [d * tp + t for d in range(dp)]
        group = dist.new_group(ranks)
        if rank in ranks:
            dp_group = group
    label_group(tp_group, "tp")
    label_group(dp_group, "dp")
    return Mesh(rank=rank, world_size=world_size, tp=tp, tp_group=tp_group, dp_group=dp_group)


def destroy_mesh() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
