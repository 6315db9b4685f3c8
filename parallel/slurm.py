"""SLURM tasks as torch ranks: the env:// variables that a multi-task SLURM step (srun, or
the submitit launcher, which starts every rank as a SLURM task instead of through torchrun)
implies, read from SLURM's own variables."""
from __future__ import annotations

import os
import re
from typing import Mapping


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
