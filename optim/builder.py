"""Builds the optimizer for a model: Muon for hidden matrices and AdamW for the rest, stepped
together as one object with one state_dict."""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from model.config import ModelConfig
from optim.adamw import build_adamw
from optim.config import OptimConfig
from optim.muon import Muon
from optim.optimizer_set import OptimizerSet
from optim.grad_ops import average_gradients, clip_gradients
from optim.routing import HEAD_KINDS, route_parameters
from optim.zero import ZeroOptimizer
from trainer.mesh import Mesh


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
        return clip_gradients(self.params, max_norm, self.mesh.tp_group)

    def zero_grad(self) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=True)


def build_optimizer(
    model: torch.nn.Module, cfg: OptimConfig, model_cfg: ModelConfig, mesh: Mesh = Mesh(),
    compile_updates: bool = False,
) -> MuonWithAdamW | ZeroOptimizer:
    """ZeRO-1 over DP when there is data parallelism, else a plain local optimizer.
    `compile_updates`: Muon's elementwise work as compiled fused kernels (see Muon)."""
    if mesh.dp > 1:
        return ZeroOptimizer(model, cfg, model_cfg, mesh, compile_updates)
    params = dict(model.named_parameters())
    by_target: dict[str, dict[str, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
    for route in route_parameters(model, cfg.name):
        by_target[route.optimizer][route.kind].append(params[route.name])

    def groups(target: str) -> list[dict[str, Any]]:
        out = []
        for kind, plist in by_target[target].items():
            group = {
                "params": plist,
                "kind": kind,
                "weight_decay": cfg.weight_decay_overrides.get(kind, cfg.weight_decay),
            }
            if target == "muon":
                group["tp_group"] = mesh.tp_group
                if cfg.muon.split_heads and kind in HEAD_KINDS:
                    group["split_rows"] = model_cfg.head_dim
            out.append(group)
        return out

    optimizers: dict[str, torch.optim.Optimizer] = {}
    if by_target["muon"]:
        m = cfg.muon
        optimizers["muon"] = Muon(
            groups("muon"),
            lr=cfg.lr,
            momentum=m.momentum,
            nesterov=m.nesterov,
            ns_steps=m.ns_steps,
            coefficients=m.coefficients,
            ns_dtype=m.ns_dtype,
            adjust_lr=m.adjust_lr,
            eps=m.eps,
            tp_mode=m.tp_mode,
            compile_updates=compile_updates,
            cautious_wd=cfg.cautious_wd,
            ns_method=m.ns_method,
            normuon=m.normuon,
            normuon_beta2=m.normuon_beta2,
        )
    if by_target["adamw"]:
        optimizers["adamw"] = build_adamw(groups("adamw"), cfg)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return MuonWithAdamW(optimizers, trainable, mesh)
