"""FSDP2: parameters, gradients and optimizer state sharded over the mesh's `dp_shard` ranks.

Each transformer block, then the root (embedding, final norm, head), becomes one
torch.distributed.fsdp.fully_shard unit: a block's parameters are all-gathered just before
its forward (and again before its backward when `reshard_after_forward`), and its gradients
are reduce-scattered, averaged, as soon as its backward ends, which overlaps the
communication with the neighbouring blocks' compute. Every parameter ends up a DTensor
sharded on dim 0 (torch.chunk's rows on each rank), the layout optim/sharded_muon.py steps.

With `dp_replicate > 1` the unit's mesh is 2-D (dp_replicate, dp_shard): HSDP, sharded within
a replica group and all-reduced across them.

Mixed precision: the compute dtype is `param_dtype` (bf16 under trainer.precision=bf16) while
the sharded master weights stay fp32, and gradients are reduced in fp32.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
# Imported with this module, before any process group exists (see parallel/mesh.py).
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def fsdp_mesh(device_mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards over: dp_shard alone, or (dp_replicate, dp_shard) for HSDP."""
    if device_mesh["dp_replicate"].size() > 1:
        return device_mesh["dp_replicate", "dp_shard"]
    return device_mesh["dp_shard"]


def apply_fsdp(root: nn.Module, blocks: Iterable[nn.Module], mesh: DeviceMesh,
               param_dtype: Optional[torch.dtype] = None, reshard_after_forward: bool = True) -> None:
    """Shard each of `blocks`, then `root` (which holds them and the rest), in place."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    # The root's parameters are used last in the forward and first in the backward: keeping
    # them gathered saves one all-gather a step and costs only the root's own parameters.
    fully_shard(root, mesh=mesh, mp_policy=policy, reshard_after_forward=False)


def sync_gradients(root: nn.Module, enabled: bool) -> None:
    """Whether the next backward reduce-scatters the gradients: off for every micro-batch of an
    accumulation but the last, whose backward reduces the sum of all of them once."""
    if not isinstance(root, FSDPModule):
        raise TypeError("sync_gradients needs a module that apply_fsdp sharded")
    root.set_requires_gradient_sync(enabled)
