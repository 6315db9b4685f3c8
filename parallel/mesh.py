"""The device mesh: every process group of a run comes from one named DeviceMesh.

Dimensions, outermost first: `pp` (pipeline stages, parallel/pipeline.py), `dp_replicate`
(data-parallel replicas: ZeRO-1, or HSDP's replicas once parameters are sharded), `dp_shard`
(data-parallel ranks that shard the parameters, FSDP) and `tp` (tensor parallel). TP is
innermost, so a TP group is contiguous ranks (rank = (pp_rank * dp + dp_rank) * tp + tp_rank)
on one node, where its activation collectives run over the fast links; the DP dimensions
stride across nodes, and the pipeline stages outside them, where only one activation per
micro-batch crosses between neighbours. Every stage holds a whole data-parallel x TP layout of
its own layers: the `dp`, `tp` and expert groups below are a stage's, and the `pp` group joins
the ranks of the same (dp, tp) place in every stage.

`dp` is the flattened (dp_replicate, dp_shard) dimension: the group that averages gradients
and owns ZeRO-1's optimizer state.

Expert parallelism reuses the data-parallel ranks, as Megatron-Core and torchtitan do:
`parallel.ep=E` unflattens the data-parallel dimension it divides (`dp_shard` under FSDP2, else
`dp_replicate`) into (`expert_shard` or `edp`, `ep`), EP innermost, so an EP group is E
consecutive data-parallel ranks (the same TP rank of each), which hold different experts and
see different tokens. The ranks that hold the same experts form `edp`: expert parameters are
data-parallel over it only (under FSDP2 sharded over `expert_shard`, replicated over
`dp_replicate`).
"""
from __future__ import annotations

import datetime
import gc
import os
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
# Imported before any process group exists: its functions' `group=group.WORLD` defaults are
# evaluated at import, so a first import after init (torch.distributed.checkpoint pulls it in)
# would keep the default group, and gloo's worker threads, alive past destroy_process_group
# into interpreter shutdown, where a worker freeing a finished collective's tensors aborts
# the process (SIGABRT, "terminate called without an active exception").
import torch.distributed.nn.functional  # noqa: F401
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.rendezvous import rendezvous

from parallel.comm import label_group
from parallel.slurm import adopt_slurm_env

# Outermost first; the order fixes which ranks each group holds.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class Layout:
    """How many ranks each mesh dimension has; their product is the world size."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    ep: int = 1  # carved out of the data-parallel ranks, not a factor of the world size
    pp: int = 1  # pipeline stages, outermost (last here: positional Layout(dp_replicate, dp_shard, tp) stays)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in MESH_DIMS)

    def describe(self) -> str:
        """ "dp_replicate 2 x dp_shard 1 x tp 2", and the EP groups where there are some
        (pp only where there is a pipeline)"""
        dims = " x ".join(f"{name} {size}" for name, size in zip(MESH_DIMS, self.shape)
                          if name != "pp" or self.pp > 1)
        return dims if self.ep == 1 else f"{dims}, ep {self.ep} over the data-parallel ranks"


def _world_words(world_size: int) -> str:
    if world_size == 1:
        return "a single process (started without torchrun)"
    return f"{world_size} processes (the number torchrun started)"


def resolve_layout(world_size: int, tp: int = 1, dp_replicate: int = -1, dp_shard: int = 1, ep: int = 1,
                   pp: int = 1) -> Layout:
    """The layout `parallel.*` asks for on `world_size` ranks; -1 means "the rest of the world".

    Raises ValueError, in one line naming the keys, for a size below 1 (other than -1), more
    than one -1, sizes that do not multiply out to the world size, or an `ep` that does not
    divide the data-parallel ranks.
    """
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"parallel.ep={ep} must be a positive number of ranks")
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"parallel.pp={pp} must be a positive number of pipeline stages")
    sizes = {"parallel.pp": pp, "parallel.dp_replicate": dp_replicate, "parallel.dp_shard": dp_shard,
             "parallel.tp": tp}
    for key, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
            raise ValueError(f"{key}={size} must be a positive number of ranks, or -1 for the rest of the world")
    if pp == 1:
        del sizes["parallel.pp"]  # named in the messages only where a pipeline was asked for
    if sizes["parallel.tp"] == -1:
        raise ValueError("parallel.tp=-1: TP needs an explicit size (-1, the rest of the world, is for the "
                         "parallel.dp_* keys)")
    rest = [key for key, size in sizes.items() if size == -1]
    if len(rest) > 1:
        raise ValueError(f"{' and '.join(f'{k}=-1' for k in rest)}: at most one size can be the rest of the world")
    given = 1
    for size in sizes.values():
        given *= size if size != -1 else 1
    asked = " x ".join(f"{k}={v}" for k, v in sizes.items())
    if world_size % given or (not rest and given != world_size):
        advice = f": start {given} processes (torchrun --nproc_per_node={given} train.py ...)" if world_size == 1 else ""
        raise ValueError(f"{asked} does not multiply out to {_world_words(world_size)}{advice}")
    if rest:
        sizes[rest[0]] = world_size // given
    layout = Layout(pp=pp, dp_replicate=sizes["parallel.dp_replicate"], dp_shard=sizes["parallel.dp_shard"],
                    tp=sizes["parallel.tp"], ep=ep)
    if layout.dp_shard > 1 and layout.dp_shard % ep:
        raise ValueError(f"parallel.ep={ep} does not divide parallel.dp_shard={layout.dp_shard} (under FSDP2 the "
                         "experts are spread over the ranks that shard the parameters)")
    if layout.dp_shard == 1 and layout.dp_replicate % ep:
        raise ValueError(f"parallel.ep={ep} does not divide the {layout.dp_replicate} data-parallel ranks "
                         f"(parallel.dp_replicate x parallel.dp_shard on {_world_words(world_size)})")
    return layout


def check_layout(world_size: int, layout_keys: dict[str, int]) -> Layout:
    """The layout parallel.* asks for on `world_size` ranks, or ValueError in one line."""
    return resolve_layout(world_size, **layout_keys)


@dataclass(frozen=True)
class Mesh:
    """This rank's view of the mesh: its groups by role. A single process has no groups (None),
    which every collective in parallel/comm.py treats as a group of one."""

    rank: int = 0
    world_size: int = 1
    layout: Layout = field(default_factory=Layout)
    tp_group: Optional[dist.ProcessGroup] = None
    # The ranks of this rank's place in every pipeline stage (parallel.pp > 1), stage order.
    pp_group: Optional[dist.ProcessGroup] = None
    dp_group: Optional[dist.ProcessGroup] = None  # dp_replicate x dp_shard, flattened
    # Expert parallelism (parallel.ep > 1): the ranks holding different experts, and those
    # holding the same ones (the experts' data-parallel group).
    ep_group: Optional[dist.ProcessGroup] = None
    edp_group: Optional[dist.ProcessGroup] = None
    # The mesh with the data-parallel dimension EP divides unflattened (parallel/fsdp.py's
    # expert_fsdp_mesh reads it).
    expert_mesh: Optional[DeviceMesh] = None
    # All ranks over gloo, for agreeing on host-side flags (preemption) without making the
    # host wait for the GPU; None where the default group already runs on the host (gloo).
    host_group: Optional[dist.ProcessGroup] = None
    device_mesh: Optional[DeviceMesh] = None

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.tp) % self.dp

    @property
    def pp_rank(self) -> int:
        """This rank's place in the pipeline: it holds stage pp_rank (and, with several stages
        per rank, those parallel/pipeline.py's stage_ids names)."""
        return self.rank // (self.dp * self.tp)

    @property
    def ep(self) -> int:
        return self.layout.ep

    @property
    def ep_rank(self) -> int:
        """This rank's place in its EP group: it holds experts [ep_rank * E / ep, ...)."""
        return self.dp_rank % self.ep

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def single_process_mesh(tp: int = 1) -> Mesh:
    """The mesh of one process, for tests and tools that build a layout without processes."""
    return Mesh(layout=Layout(tp=tp))


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_mesh(layout_keys: dict[str, int], device: torch.device, backend: str = "auto",
              timeout_s: float = 600.0) -> Mesh:
    """Join the job torchrun started (env:// rendezvous) and build the mesh that
    `layout_keys` (tp, dp_replicate, dp_shard as in parallel.*) asks for.

    Without torchrun (WORLD_SIZE unset) this is a single process and no group is created,
    unless this is one task of a multi-task SLURM step, which joins that step's group.
    The timeout turns a dead peer into an error instead of a hang.
    """
    adopt_slurm_env()
    world_size = world_size_from_env()
    layout = check_layout(world_size, layout_keys)
    if world_size == 1:
        return Mesh(layout=layout)
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
    return build_mesh(layout.tp, datetime.timedelta(seconds=timeout_s), dp_shard=layout.dp_shard, ep=layout.ep,
                      pp=layout.pp)


def init_simulated_mesh(layout_keys: dict[str, int], world_size: int, rank: int, device: torch.device) -> Mesh:
    """This process as rank `rank` of a `world_size`-rank job, over torch's fake process groups:
    every group of the real mesh exists, with its real ranks and sizes, but its collectives move
    no data between ranks (on torch 2.13 an all-reduce leaves its input, an all-gather repeats
    it in every slot; what parallel/comm.py makes of an all-to-all is said there). Shapes,
    sharding and this rank's memory are the real ones; values that other ranks would contribute
    are not. For dry runs (trainer/simulation/one_rank.py) and estimates (trainer/simulation/memory_estimate.py)."""
    if dist.is_initialized():
        raise RuntimeError("a simulated mesh needs a process without a process group (not under torchrun)")
    if not 0 <= rank < world_size:
        raise ValueError(f"parallel.simulate_rank={rank} must lie in [0, parallel.simulate_world={world_size})")
    layout = check_layout(world_size, layout_keys)
    # torch's own testing module holds the fake store; importing it has no side effects.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    return build_mesh(layout.tp, dp_shard=layout.dp_shard, ep=layout.ep, device_type=device.type, pp=layout.pp)


def is_simulated() -> bool:
    """Whether this process runs over fake process groups (init_simulated_mesh)."""
    return dist.is_initialized() and dist.get_backend() == "fake"


def build_mesh(tp: int = 1, timeout: Optional[datetime.timedelta] = None, dp_shard: int = 1, ep: int = 1,
               device_type: Optional[str] = None, pp: int = 1) -> Mesh:
    """The mesh over an initialised default group, `dp_replicate` the rest of the world.
    Every rank must call this (group creation is collective). `timeout` bounds the host
    group's collectives like the default group's. `device_type`: the mesh's device, by default
    the backend's (cuda for nccl, else cpu)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    layout = resolve_layout(world_size, tp=tp, dp_shard=dp_shard, ep=ep, pp=pp)
    backend = dist.get_backend()
    device_type = device_type or ("cuda" if backend == "nccl" else "cpu")
    device_mesh = init_device_mesh(device_type, layout.shape, mesh_dim_names=MESH_DIMS)
    tp_group = device_mesh.get_group("tp")
    dp_group = device_mesh["dp_replicate", "dp_shard"]._flatten("dp").get_group()
    ep_group = edp_group = experts = None
    if layout.ep > 1:
        if layout.dp_shard > 1:  # FSDP2: the experts are sharded over expert_shard
            experts = device_mesh._unflatten("dp_shard", (layout.dp_shard // layout.ep, layout.ep),
                                             ("expert_shard", "ep"))
            edp_group = (experts["dp_replicate", "expert_shard"]._flatten("edp").get_group()
                         if layout.dp_replicate > 1 else experts.get_group("expert_shard"))
        else:
            experts = device_mesh._unflatten("dp_replicate", (layout.dp_replicate // layout.ep, layout.ep),
                                             ("edp", "ep"))
            edp_group = experts.get_group("edp")
        ep_group = experts.get_group("ep")
        # Labelled before the step's roles below, which win where torch hands one group to two
        # of them (ep = dp): the dispatch names its own traffic (comm/ep/*).
        label_group(edp_group, "edp")
        label_group(ep_group, "ep")
    # Where torch hands one group to two roles (a flattened dimension over a single non-trivial
    # one), the roles the training step's metrics name (comm/dp/*, comm/tp/*) win.
    label_group(device_mesh.get_group("dp_replicate"), "dp_replicate")
    label_group(device_mesh.get_group("dp_shard"), "dp_shard")
    label_group(tp_group, "tp")
    label_group(dp_group, "dp")
    pp_group = device_mesh.get_group("pp") if layout.pp > 1 else None
    label_group(pp_group, "pp")
    # gloo already runs on the host; fake groups have no host to agree with.
    host_group = new_host_group("host", timeout) if backend not in ("gloo", "fake") else None
    return Mesh(rank=rank, world_size=world_size, layout=layout, tp_group=tp_group, pp_group=pp_group, dp_group=dp_group,
                ep_group=ep_group, edp_group=edp_group, expert_mesh=experts, host_group=host_group,
                device_mesh=device_mesh)


def new_host_group(label: str, timeout: Optional[datetime.timedelta] = None) -> dist.ProcessGroup:
    """A gloo group over every rank, beside the mesh, for work the host does without the GPU:
    "host" (flags such as preemption, checkpoint plans and objects, where NCCL would move them
    through the GPU) and "async_checkpoint" (a background save's own collectives, which must
    not interleave with the training step's). Collective: every rank must call it."""
    group = dist.new_group(backend="gloo", timeout=timeout)
    label_group(group, label)
    return group


def mesh_groups(mesh: Mesh) -> list[dist.ProcessGroup]:
    """Every distinct process group the mesh made (not the default group), each once."""
    groups: list[dist.ProcessGroup] = []
    candidates: list[Optional[dist.ProcessGroup]] = [mesh.tp_group, mesh.dp_group, mesh.ep_group, mesh.edp_group,
                                                     mesh.host_group, mesh.pp_group]
    for device_mesh in (mesh.device_mesh, mesh.expert_mesh):
        if device_mesh is not None:
            candidates += device_mesh.get_all_groups()
    for group in candidates:
        if group is None or group is dist.GroupMember.WORLD or any(group is g for g in groups):
            continue
        groups.append(group)
    return groups


def release_dtensor_caches() -> None:
    """Drop DTensor's caches of sharding decisions and redistribution plans. Their entries hold
    DTensor specs or planners, which hold the DeviceMesh, which holds its process groups: after
    FSDP2 (even fully_shard alone) they kept the groups, and their gloo threads, alive past
    destroy_process_group into interpreter shutdown, where such threads can abort the process.
    Called before any group is destroyed."""
    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear is not None:  # the C++ cache (torch 2.10 and later)
        clear()
    if "torch.distributed.tensor" not in sys.modules:
        return  # nothing made a DTensor: no Python-side cache to clear
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import _redistribute

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    # Redistribution planners, keyed by a weak reference to their mesh but holding it strongly.
    planners = getattr(_redistribute, "_planner_cache", None)
    if planners is not None:
        planners.clear()
    gc.collect()  # the meshes those entries held may sit in reference cycles


def release_compiled_graphs() -> None:
    """Drop torch.compile's compiled frames and guards, if anything compiled in this process:
    they hold the modules they ran on and what those read, process groups included (the MoE
    layer's EP group), which would outlive destroy_process_group like the DTensor caches."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()


def destroy_mesh() -> None:
    if dist.is_initialized():
        release_compiled_graphs()
        release_dtensor_caches()
        dist.destroy_process_group()


def release_subgroups(mesh: Mesh) -> None:
    """Free a mesh's groups but keep the default group, for the next job of a sweep.

    Re-creating the default group in the same processes would restart group naming at 0 over
    torchrun's store, which still holds the first groups' keys: the new groups would meet
    stale keys and hang. So a multirun under torchrun keeps one default group for all jobs.
    """
    if not dist.is_initialized():
        return
    release_compiled_graphs()
    release_dtensor_caches()
    for group in mesh_groups(mesh):
        dist.destroy_process_group(group)
