"""FSDP2: parameters, gradients and optimizer state sharded over the mesh's `dp_shard` ranks.

Each transformer block, then the root (embedding, final norm, head), becomes one
torch.distributed.fsdp.fully_shard unit: a block's parameters are all-gathered just before
its forward (and again before its backward when `reshard_after_forward`), and its gradients
are reduce-scattered, averaged, as soon as its backward ends, which overlaps the
communication with the neighbouring blocks' compute. Every parameter ends up a DTensor
sharded on dim 0 (torch.chunk's rows on each rank), the layout optim/muon/row_sharded.py steps.

With `dp_replicate > 1` the unit's mesh is 2-D (dp_replicate, dp_shard): HSDP, sharded within
a replica group and all-reduced across them.

Under expert parallelism each MoE layer's experts are a unit of their own, sharded over
`expert_shard` (the dp_shard ranks that hold the same experts) instead of dp_shard. FSDP2
averages their gradients over that unit's ranks only, while they already sum every EP rank's
tokens: the optimizer divides them by ep as well (optim/sharded.py).

Mixed precision: the compute dtype is `param_dtype` (bf16 under trainer.precision=bf16) while
the sharded master weights stay fp32, and gradients are reduced in fp32.
"""
from __future__ import annotations

import time
from typing import Iterable, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
# Imported with this module, before any process group exists (see parallel/mesh.py).
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from parallel.comm import COUNTER

try:  # FSDP2's own collectives, which counted subclasses wrap (torch 2.8 and later)
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
except ImportError:  # older torch: FSDP2 still runs, its traffic is not counted
    DefaultAllGather = DefaultReduceScatter = None

# What parallelize_tp records on each parameter, and fully_shard's new parameters must keep.
PARAM_ATTRIBUTES = ("tp_split_dim", "logical_numel", "ep_split_dim")


def row_range(rows: int, n: int, rank: int) -> tuple[int, int]:
    """Rank `rank`'s rows [start, stop) of `rows` split n ways, as torch.chunk and FSDP2's
    Shard(0) split them: ceil(rows / n) rows a rank, the last ranks fewer or none."""
    per = -(-rows // n)
    return min(rank * per, rows), min((rank + 1) * per, rows)


def is_sharded(param: torch.Tensor) -> bool:
    return isinstance(param, DTensor)


def local_rows(param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's part of a parameter (or gradient) and the first row it holds: for an FSDP2
    DTensor its local shard (sharing its storage), else the tensor itself from row 0."""
    if not isinstance(param, DTensor):
        return param, 0
    mesh = param.device_mesh
    shard_dim = next(i for i, placement in enumerate(param.placements) if placement.is_shard())
    start, _ = row_range(param.shape[0], mesh.size(shard_dim), mesh.get_local_rank(shard_dim))
    return param.to_local(), start


if DefaultAllGather is not None:
    class CountedAllGather(DefaultAllGather):
        """FSDP2's parameter all-gather, counted by parallel/comm.py (its output: every rank's
        shards of one unit's parameters, in the compute dtype) under the group's label."""

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            start = time.perf_counter()
            work = super().__call__(output_tensor, input_tensor, group, async_op)
            COUNTER.record(group, "all_gather", output_tensor.numel() * output_tensor.element_size(),
                           time.perf_counter() - start)
            return work

    class CountedReduceScatter(DefaultReduceScatter):
        """FSDP2's gradient reduce-scatter, counted (its input: one unit's gradients, fp32)."""

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            start = time.perf_counter()
            work = super().__call__(output_tensor, input_tensor, group, op, async_op)
            COUNTER.record(group, "reduce_scatter", input_tensor.numel() * input_tensor.element_size(),
                           time.perf_counter() - start)
            return work


def _count_collectives(module: FSDPModule) -> None:
    if DefaultAllGather is not None and hasattr(module, "set_custom_all_gather"):
        module.set_custom_all_gather(CountedAllGather())
        module.set_custom_reduce_scatter(CountedReduceScatter())


def fsdp_mesh(device_mesh: DeviceMesh, shard: str = "dp_shard") -> DeviceMesh:
    """The mesh FSDP2 shards over: `shard` alone, or (dp_replicate, `shard`) for HSDP."""
    if device_mesh["dp_replicate"].size() > 1:
        return device_mesh["dp_replicate", shard]
    return device_mesh[shard]


def apply_fsdp(root: nn.Module, blocks: Iterable[nn.Module], mesh: DeviceMesh,
               param_dtype: Optional[torch.dtype] = None, reshard_after_forward: bool = True,
               experts: Iterable[nn.Module] = (), expert_mesh: Optional[DeviceMesh] = None) -> None:
    """Shard each of `experts` (EP's local experts, over `expert_mesh`), each of `blocks`, then
    `root` (which holds them and the rest), in place."""
    # Inputs are token ids, and activations follow autocast: FSDP2 need not cast them, and its
    # casting would rebuild container arguments (the model's max-logit output list).
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    kept = {name: {a: getattr(p, a) for a in PARAM_ATTRIBUTES if hasattr(p, a)} for name, p in root.named_parameters()}
    for module in experts:
        fully_shard(module, mesh=expert_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
        _count_collectives(module)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
        _count_collectives(block)
    # The root's parameters are used last in the forward and first in the backward: keeping
    # them gathered saves one all-gather a step and costs only the root's own parameters.
    fully_shard(root, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    _count_collectives(root)
    for name, p in root.named_parameters():
        for attribute, value in kept[name].items():
            setattr(p, attribute, value)


def sync_gradients(root: nn.Module, enabled: bool) -> None:
    """Whether the next backward reduce-scatters the gradients: off for every micro-batch of an
    accumulation but the last, whose backward reduces the sum of all of them once."""
    if not isinstance(root, FSDPModule):
        raise TypeError("sync_gradients needs a module that apply_fsdp sharded")
    root.set_requires_gradient_sync(enabled)


def reshard(root: nn.Module) -> None:
    """Free every gathered parameter of `root`'s FSDP2 units, leaving only the shards: after
    forwards that no backward followed (evaluation), which leave the root's gathered."""
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
