"""Muon + AdamW on FSDP2's shards (parallel.dp_shard > 1): every rank steps its own rows.

FSDP2 leaves each parameter a DTensor whose local tensor is this rank's rows, and its
gradient, reduce-scattered and averaged over the data-parallel ranks, the same rows. The
optimizers step those local tensors in place (they share the DTensors' storage): ShardedMuon
(optim/muon/row_sharded.py: whole matrices orthogonalised at their owners) for the hidden
matrices, torch's fused AdamW for the rest. Their state is sharded like the parameters, so
nothing here gathers a whole parameter.

Under HSDP (dp_replicate > 1) every replica group holds the same shards and gradients (FSDP2
all-reduces them across replicas), and steps them the same way.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from model.config import ModelConfig
from optim.adamw import build_adamw
from optim.config import OptimConfig
from optim.grad_ops import sum_of_squares
from optim.optimizer_set import OptimizerSet, OwnedPiece
from optim.routing import route_parameters
from optim.muon.options import matrix_split
from optim.muon.row_sharded import ShardedMuon
from parallel.comm import all_reduce
from parallel.fsdp import local_rows
from parallel.mesh import Mesh


class ShardedOptimizer(OptimizerSet):
    """ShardedMuon + fused AdamW (optim=muon) or fused AdamW alone, on FSDP2's local shards."""

    def __init__(self, model: torch.nn.Module, cfg: OptimConfig, model_cfg: ModelConfig, mesh: Mesh,
                 compile_updates: bool = False) -> None:
        self.mesh = mesh
        self.shard_group = mesh.device_mesh.get_group("dp_shard")
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.model_params = [p for _, p in named]
        # The local tensors, made once: the optimizers key their state by them, and they stay
        # views of the DTensors' storage (FSDP2 keeps its sharded storage in place).
        self.local: dict[str, torch.Tensor] = {}
        self.row_start: dict[str, int] = {}
        for name, p in named:
            with torch.no_grad():
                local, start = local_rows(p)
            self.local[name] = local.detach()
            self.row_start[name] = start
            for attribute in ("tp_split_dim",):
                setattr(self.local[name], attribute, getattr(p, attribute, None))
        params = dict(named)
        by_target: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
        for route in route_parameters(model, cfg.name):
            if route.name in self.local:
                by_target[route.optimizer][route.kind].append(route.name)
        optimizers: dict[str, torch.optim.Optimizer] = {}
        # Under EP the experts are sharded over the dp_shard ranks that hold the same ones.
        expert_shard = mesh.expert_mesh.get_group("expert_shard") if mesh.expert_mesh is not None else None
        if by_target["muon"]:
            names = dict(by_target["muon"])
            groups = cfg.param_groups({k: [self.local[n] for n in ns] for k, ns in names.items()}, True,
                                      model_cfg.head_dim)
            for group, kind_names in zip(groups, names.values()):
                if any(getattr(params[n], "ep_split_dim", None) is not None for n in kind_names):
                    group["shard_group"] = expert_shard  # the experts: over the ranks holding the same ones
                group["full_shapes"] = [params[n].shape for n in kind_names]
                group["tp_split_dims"] = [matrix_split(params[n]) for n in kind_names]
            optimizers["muon"] = ShardedMuon(groups, None, self.shard_group, lr=cfg.lr, options=cfg.muon,
                                             tp_group=mesh.tp_group, cautious_wd=cfg.cautious_wd,
                                             compile_updates=compile_updates)
        if by_target["adamw"]:
            optimizers["adamw"] = build_adamw(cfg.param_groups(
                {k: [self.local[n] for n in ns] for k, ns in by_target["adamw"].items()}, False, model_cfg.head_dim), cfg)
        super().__init__(optimizers)
        self.names = {id(t): n for n, t in self.local.items()}

    def prepare_grads(self, max_norm: float) -> torch.Tensor:
        """FSDP2 has averaged the gradients; point the local tensors at their rows, and clip
        by the global norm (the shards' squares summed over dp_shard, and over TP for the
        TP-split ones). Returns the norm."""
        tp_split, replicated, experts = [], [], []
        for (name, local), p in zip(self.local.items(), self.model_params):
            if p.grad is None:
                local.grad = None
                continue
            local.grad = local_rows(p.grad)[0]
            (tp_split if getattr(p, "tp_split_dim", None) is not None else replicated).append(local.grad)
            if getattr(p, "ep_split_dim", None) is not None:
                experts.append(local.grad)
        if experts:
            # FSDP2 averaged the experts' gradients over the ranks that hold the same experts
            # (dp / ep of them), but each already sums its EP group's tokens: the global batch's
            # mean divides by all dp ranks.
            torch._foreach_div_(experts, float(self.mesh.ep))
        device = next(iter(self.local.values())).device
        square = all_reduce(sum_of_squares(tp_split, device), self.mesh.tp_group) + sum_of_squares(replicated, device)
        # Under a pipeline the other stages' squares join before the norm: one clip, one skip.
        norm = all_reduce(all_reduce(square, self.shard_group), self.mesh.pp_group).sqrt()
        if max_norm > 0:
            scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(tp_split + replicated, scale)
        return norm

    def zero_grad(self) -> None:
        for p in self.model_params:
            p.grad = None
        for local in self.local.values():
            local.grad = None

    def owned_pieces(self, model: torch.nn.Module) -> list[OwnedPiece]:
        """Every local shard: elements from its first row on of the (TP-local) parameter."""
        pieces = []
        for name, local in self.local.items():
            key = self._optimizer_of(local)
            if key is not None:
                row = local[0].numel() if local.dim() and local.shape[0] else 0
                pieces.append(OwnedPiece(name, local, self.row_start[name] * row, key))
        return pieces

    def local_state(self, model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, dict[str, Any]]]:
        raise NotImplementedError("the state of sharded parameters is saved shard by shard (sharded checkpoints)")
