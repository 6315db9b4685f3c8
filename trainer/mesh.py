"""The DP x TP process mesh.

TP groups are contiguous ranks (rank = dp_rank * tp + tp_rank), so a TP group sits on one
node and its frequent activation collectives stay on the fast intra-node links; DP groups
are strided across them.
"""
from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
import torch.distributed as dist
# Imported before any process group exists: its functions' `group=group.WORLD` defaults are
# evaluated at import, so a first import after init (torch.distributed.checkpoint pulls it in)
# would keep the default group, and gloo's worker threads, alive past destroy_process_group
# into interpreter shutdown, where a worker freeing a finished collective's tensors aborts
# the process (SIGABRT, "terminate called without an active exception").
import torch.distributed.nn.functional  # noqa: F401
from torch.distributed.rendezvous import rendezvous

from model.comm import label_group


@dataclass(frozen=True)
class Mesh:
    rank: int = 0
    world_size: int = 1
    tp: int = 1
    tp_group: Optional[dist.ProcessGroup] = None
    dp_group: Optional[dist.ProcessGroup] = None
    # All ranks over gloo, for agreeing on host-side flags (preemption) without making the
    # host wait for the GPU; None where the default group already runs on the host (gloo).
    host_group: Optional[dist.ProcessGroup] = None

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


def _slurm_int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise ValueError(f"{key}={env[key]!r} is not an integer") from None


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list: "gpu[003-005,9],cpu1" -> "gpu003"."""
    first = re.match(r"(?:[^,\[]|\[[^\]]*\])+", nodelist.strip())
    if first is None:
        raise ValueError(f"SLURM node list {nodelist!r} names no host")
    # Each bracket keeps its first value; zero padding is part of the host name.
    return re.sub(r"\[([^\]\-,]*)[^\]]*\]", r"\1", first.group(0))


def tasks_on_node(spec: str, node: int) -> int:
    """Tasks on node `node` of a SLURM tasks-per-node list: "4(x2),3" is 4, 4, 3."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise ValueError(f"SLURM tasks per node {spec!r} is not a list like 4(x2),3")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if not 0 <= node < len(counts):
        raise ValueError(f"SLURM node {node} is not in the tasks per node list {spec!r}")
    return counts[node]


def torch_env_from_slurm(env: Mapping[str, str]) -> dict[str, str]:
    """torch's env:// variables for one task of a multi-task SLURM step (srun, or the submitit
    launcher, which starts every rank as a SLURM task instead of through torchrun).

    submitit's TorchDistributedEnvironment gives the same values inside the jobs it launched
    (tests/test_mesh_env.py checks that), but it refuses to run in a plain `srun` step, counts
    the allocation's tasks rather than the step's, and assumes every node runs as many tasks:
    hence this reading of SLURM's variables.

    Empty when torchrun's RANK and WORLD_SIZE are already set, or this is not such a step.
    A MASTER_ADDR or MASTER_PORT the user exported is kept.
    """
    if "RANK" in env and "WORLD_SIZE" in env:
        return {}
    # SLURM_STEP_NUM_TASKS is the step's own task count; SLURM_NTASKS the allocation's.
    tasks_key = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    if "SLURM_PROCID" not in env or tasks_key not in env or _slurm_int(env, tasks_key) < 2:
        return {}
    nodelist_key = next(
        (k for k in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if env.get(k)), None
    )
    if nodelist_key is None and not env.get("MASTER_ADDR"):
        raise ValueError("SLURM_JOB_NODELIST is not set: cannot tell the rank-0 host (set MASTER_ADDR)")
    # Every task derives the same port from the job id; jobs sharing a node get different ones.
    port = 15000 + _slurm_int(env, "SLURM_JOB_ID") % 10000 if "SLURM_JOB_ID" in env else 29500
    out = {
        "RANK": str(_slurm_int(env, "SLURM_PROCID")),
        "WORLD_SIZE": str(_slurm_int(env, tasks_key)),
        "LOCAL_RANK": str(_slurm_int(env, "SLURM_LOCALID")) if "SLURM_LOCALID" in env else "0",
        "MASTER_ADDR": env.get("MASTER_ADDR") or first_host(env[nodelist_key]),
        "MASTER_PORT": env.get("MASTER_PORT") or str(port),
    }
    # Tasks on this node, as torchrun's LOCAL_WORLD_SIZE: the one-GPU-per-task check needs it.
    per_node_key = next((k for k in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE") if env.get(k)), None)
    if per_node_key is not None:
        node = _slurm_int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
        out["LOCAL_WORLD_SIZE"] = str(tasks_on_node(env[per_node_key], node))
    return out


def adopt_slurm_env() -> None:
    """Export torch's variables for a SLURM task; a no-op under torchrun or a single process."""
    os.environ.update(torch_env_from_slurm(os.environ))


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_mesh(tp: int, device: torch.device, backend: str = "auto", timeout_s: float = 600.0) -> Mesh:
    """Join the job torchrun started (env:// rendezvous) and build the DP and TP groups.

    Without torchrun (WORLD_SIZE unset) this is a single process and no group is created,
    unless this is one task of a multi-task SLURM step, which joins that step's group.
    The timeout turns a dead peer into an error instead of a hang.
    """
    adopt_slurm_env()
    world_size = world_size_from_env()
    check_mesh_shape(world_size, tp)
    if world_size == 1:
        return Mesh()
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        store, rank, size = next(rendezvous("env://", timeout=timeout))
        # torchrun keeps one store across --max-restarts: without a per-round prefix the
        # restarted ranks would read the dead round's gloo addresses and fail to connect.
        store = dist.PrefixStore(f"round_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        dist.init_process_group(
            backend=default_backend(device) if backend == "auto" else backend,
            store=store,
            rank=rank,
            world_size=size,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
    return build_mesh(tp, datetime.timedelta(seconds=timeout_s))


def build_mesh(tp: int, timeout: Optional[datetime.timedelta] = None) -> Mesh:
    """Create the groups on an initialised default group. Every rank must call this.
    `timeout` bounds the host group's collectives like the default group's."""
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
    host_group = None
    if dist.get_backend() != "gloo":
        host_group = dist.new_group(backend="gloo", timeout=timeout)
        label_group(host_group, "host")
    return Mesh(rank=rank, world_size=world_size, tp=tp, tp_group=tp_group, dp_group=dp_group,
                host_group=host_group)


def destroy_mesh() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def release_subgroups(mesh: Mesh) -> None:
    """Free a mesh's TP and DP groups but keep the default group, for the next job of a sweep.

    Re-creating the default group in the same processes would restart group naming at 0 over
    torchrun's store, which still holds the first groups' keys: the new groups would meet
    stale keys and hang. So a multirun under torchrun keeps one default group for all jobs.
    """
    if not dist.is_initialized():
        return
    released: list[dist.ProcessGroup] = []
    for group in (mesh.tp_group, mesh.dp_group, mesh.host_group):
        if group is None or group is dist.GroupMember.WORLD or any(group is g for g in released):
            continue
        dist.destroy_process_group(group)
        released.append(group)
