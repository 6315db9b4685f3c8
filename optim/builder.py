"""Builds the optimizer for a model: Muon for hidden matrices and AdamW for the rest, stepped
together as one object with one state_dict."""
from __future__ import annotations

from collections import Counter, defaultdict

import torch

from model.config import ModelConfig
from optim.adamw import build_adamw
from optim.config import OptimConfig
from optim.muon.optimizer import Muon, ns_shape
from optim.muon.ns_method import NSShape
from optim.optimizer_set import OptimizerSet
from optim.grad_ops import average_gradients, clip_gradients
from optim.routing import muon_split_rows, route_parameters
from optim.sharded import ShardedOptimizer
from optim.zero import ZeroOptimizer
from parallel.mesh import Mesh


class MuonWithAdamW(OptimizerSet):
    """Every rank steps every parameter: the single-process (and TP-only) optimizer. With
    data parallelism the trainer uses ZeroOptimizer (optim/zero.py) instead."""

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer], params: list[torch.Tensor], mesh: Mesh) -> None:
        super().__init__(optimizers)
        self.params = params
        self.mesh = mesh

    def prepare_grads(self, max_norm: float) -> torch.Tensor:
        """Average gradients over DP, clip by the global norm; returns the norm."""
        average_gradients(self.params, self.mesh.dp_group)
        return clip_gradients(self.params, max_norm, self.mesh.tp_group, self.mesh.pp_group)

    def zero_grad(self) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=True)


def muon_ns_shapes(model: torch.nn.Module, cfg: OptimConfig, model_cfg: ModelConfig, mesh: Mesh = Mesh()) -> Counter[NSShape]:
    """How many matrices of each shape Muon orthogonalises in a step of the whole model, on
    any rank (ZeRO-1 hands each rank a share of the same shapes): what ns_method=auto measures."""
    params = dict(model.named_parameters())
    counts: Counter[NSShape] = Counter()
    for route in route_parameters(model, cfg.name):
        if route.optimizer != "muon":
            continue
        split_rows = muon_split_rows(route.kind, cfg.muon.split_heads, model_cfg.head_dim)
        group = {"split_rows": split_rows, "tp_group": mesh.tp_group, "tp_mode": cfg.muon.tp_mode}
        k, shape = ns_shape(params[route.name], group)
        counts[shape] += k
    return counts


def build_optimizer(
    model: torch.nn.Module, cfg: OptimConfig, model_cfg: ModelConfig, mesh: Mesh = Mesh(),
    compile_updates: bool = False,
) -> MuonWithAdamW | ZeroOptimizer | ShardedOptimizer:
    """The sharded optimizers on FSDP2's shards (parallel.dp_shard > 1), ZeRO-1 over DP when
    there is data parallelism, else a plain local optimizer.
    `compile_updates`: Muon's elementwise work as compiled fused kernels (see Muon)."""
    if mesh.layout.dp_shard > 1:
        return ShardedOptimizer(model, cfg, model_cfg, mesh, compile_updates)
    if mesh.dp > 1:
        return ZeroOptimizer(model, cfg, model_cfg, mesh, compile_updates)
    params = dict(model.named_parameters())
    by_target: dict[str, dict[str, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
    for route in route_parameters(model, cfg.name):
        by_target[route.optimizer][route.kind].append(params[route.name])

    optimizers: dict[str, torch.optim.Optimizer] = {}
    if by_target["muon"]:
        groups = [{**g, "tp_group": mesh.tp_group} for g in cfg.param_groups(by_target["muon"], True, model_cfg.head_dim)]
        optimizers["muon"] = Muon(groups, lr=cfg.lr, options=cfg.muon, cautious_wd=cfg.cautious_wd,
                                  compile_updates=compile_updates)
    if by_target["adamw"]:
        optimizers["adamw"] = build_adamw(cfg.param_groups(by_target["adamw"], False, model_cfg.head_dim), cfg)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return MuonWithAdamW(optimizers, trainable, mesh)
