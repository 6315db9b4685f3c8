"""Distributed Muon + AdamW with ZeRO-1 over data parallelism.

Per step, for the DP group:
  1. reduce-scatter the flat gradient buffer: each rank receives the averaged gradients of
     its segment (optim/zero_plan.py lays the segments out);
  2. clip with the global gradient norm (segment norms all-reduced over DP, and over TP for
     TP-sharded parameters);
  3. each rank steps what it owns: whole Muon matrices (TP-aware, see optim/muon.py) and its
     flat pieces of the AdamW parameters, with optimizer state for those only;
  4. all-gather the updated segments back into every rank's parameters.

DP traffic is one reduce-scatter and one all-gather of the flat buffer, the same as AdamW
ZeRO-1, and each Muon matrix is orthogonalised by exactly one DP rank.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from model.comm import all_gather_into, all_reduce, reduce_scatter_into
from model.config import ModelConfig
from optim.config import OptimConfig
from optim.muon import Muon, matrix_layout
from optim.optimizer_set import OptimizerSet
from optim.routing import HEAD_KINDS, route_parameters
from optim.zero_plan import ParamSpec, Slice, ZeroPlan, build_plan
from trainer.mesh import Mesh

log = logging.getLogger("optim")


def _muon_matrices(param: torch.Tensor, split_rows: int | None) -> tuple[tuple[int, int], ...]:
    k, rows, cols = matrix_layout(param.shape, split_rows)
    return ((rows, cols),) * k


class ZeroOptimizer(OptimizerSet):
    """ZeRO-1 Muon + AdamW (optim=muon) or ZeRO-1 AdamW (optim=adamw) over the DP group."""

    def __init__(self, model: torch.nn.Module, cfg: OptimConfig, model_cfg: ModelConfig, mesh: Mesh) -> None:
        self.mesh = mesh
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        routes = {r.name: r for r in route_parameters(model, cfg.name)}
        self.kinds = [routes[n].kind for n, _ in named]

        def split_rows(kind: str) -> int | None:
            return model_cfg.head_dim if cfg.muon.split_heads and kind in HEAD_KINDS else None

        specs = []
        for i, (name, p) in enumerate(named):
            is_muon = routes[name].optimizer == "muon"
            matrices = _muon_matrices(p, split_rows(self.kinds[i])) if is_muon else ()
            specs.append(ParamSpec(index=i, numel=p.numel(), muon_matrices=matrices))
        self.plan: ZeroPlan = build_plan(specs, mesh.dp)
        self.slices: list[Slice] = sorted(
            (s for share in self.plan.ranks for s in share.muon + share.adamw), key=lambda s: s.offset
        )
        mine = self.plan.ranks[mesh.dp_rank]
        self.segment_start = mesh.dp_rank * self.plan.segment
        device = self.params[0].device
        self.segment_grad = torch.zeros(self.plan.segment, device=device)
        self.flat = torch.zeros(self.plan.total, device=device)

        optimizers: dict[str, torch.optim.Optimizer] = {}
        self._owned: list[tuple[torch.Tensor, Slice]] = []  # (tensor stepped here, its slice)
        muon_groups: dict[str, list[torch.Tensor]] = {}
        for s in mine.muon:
            p = self.params[s.param]
            muon_groups.setdefault(self.kinds[s.param], []).append(p)
            self._owned.append((p, s))
        adamw_groups: dict[str, list[torch.Tensor]] = {}
        for s in mine.adamw:
            # A detached view into the parameter's storage: AdamW updates it in place.
            piece = self.params[s.param].detach().view(-1)[s.start : s.start + s.length]
            adamw_groups.setdefault(self.kinds[s.param], []).append(piece)
            self._owned.append((piece, s))

        def wd(kind: str) -> float:
            return cfg.weight_decay_overrides.get(kind, cfg.weight_decay)

        if muon_groups:
            m = cfg.muon
            groups = []
            for kind, plist in muon_groups.items():
                group: dict[str, Any] = {"params": plist, "kind": kind, "weight_decay": wd(kind),
                                         "split_rows": split_rows(kind), "tp_group": mesh.tp_group}
                groups.append(group)
            optimizers["muon"] = Muon(groups, lr=cfg.lr, momentum=m.momentum, nesterov=m.nesterov,
                                      ns_steps=m.ns_steps, coefficients=m.coefficients,
                                      ns_dtype=m.ns_dtype, adjust_lr=m.adjust_lr, eps=m.eps,
                                      tp_mode=m.tp_mode)
        if adamw_groups:
            groups = [{"params": plist, "kind": kind, "weight_decay": wd(kind)}
                      for kind, plist in adamw_groups.items()]
            optimizers["adamw"] = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
        super().__init__(optimizers)
        # Which owned slices belong to TP-sharded parameters (their squares sum over TP).
        self._sharded = [getattr(self.params[s.param], "tp_split_dim", None) is not None for _, s in self._owned]
        if mesh.is_main:
            log.info(self.plan.describe())

    def _flatten(self, tensors: list[torch.Tensor], slices: list[Slice], total: int, start: int) -> torch.Tensor:
        """Concatenate the slices of `tensors` in buffer order, zero-filling the padding."""
        parts, cursor = [], start
        for s in slices:
            if s.offset > cursor:
                parts.append(tensors[0].new_zeros(s.offset - cursor))
            parts.append(tensors[s.param].reshape(-1)[s.start : s.start + s.length])
            cursor = s.offset + s.length
        if start + total > cursor:
            parts.append(tensors[0].new_zeros(start + total - cursor))
        return torch.cat(parts)

    @torch.no_grad()
    def prepare_grads(self, max_norm: float) -> torch.Tensor:
        """Reduce-scatter the gradients over DP, then clip them. Returns the global norm."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = self._flatten([g.float() for g in grads], self.slices, self.plan.total, 0)
        reduce_scatter_into(self.segment_grad, flat, self.mesh.dp_group)
        self.segment_grad.div_(self.mesh.dp)
        for p in self.params:
            p.grad = None
        # Point each owned tensor's .grad at its part of the reduced segment.
        for tensor, s in self._owned:
            local = s.offset - self.segment_start
            tensor.grad = self.segment_grad[local : local + s.length].view(tensor.shape)

        sq = [t.grad.pow(2).sum() for t, _ in self._owned]
        zero = self.segment_grad.new_zeros(())
        sq_sharded = torch.stack([x for x, f in zip(sq, self._sharded) if f] or [zero]).sum()
        sq_replicated = torch.stack([x for x, f in zip(sq, self._sharded) if not f] or [zero]).sum()
        both = all_reduce(torch.stack([sq_sharded, sq_replicated]), self.mesh.dp_group)
        norm = (all_reduce(both[0:1], self.mesh.tp_group)[0] + both[1]).sqrt()
        if max_norm > 0:
            scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            self.segment_grad.mul_(scale)
        return norm

    @torch.no_grad()
    def step(self) -> None:
        super().step()
        mine = [s for s in self.slices if self.segment_start <= s.offset < self.segment_start + self.plan.segment]
        data = [p.detach() for p in self.params]
        segment = self._flatten(data, mine, self.plan.segment, self.segment_start)
        all_gather_into(self.flat, segment.float(), self.mesh.dp_group)
        for s in self.slices:
            self.params[s.param].data.view(-1)[s.start : s.start + s.length].copy_(
                self.flat[s.offset : s.offset + s.length]
            )

    def local_state(self, model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """Per-parameter state, whole over DP: each rank contributes what it owns (zeros
        elsewhere) and one sum over DP assembles it. Collective."""
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        slots: dict[str, dict[str, torch.Tensor]] = {}
        for tensor, s in self._owned:
            for opt in self.optimizers.values():
                state = opt.state.get(tensor)
                if not state:
                    continue
                p, name = self.params[s.param], names[s.param]
                entry = slots.setdefault(name, {})
                for key, value in state.items():
                    if key == "step":
                        entry["step"] = value.detach().clone().float()
                        continue
                    full = entry.setdefault(key, torch.zeros(p.numel(), device=p.device))
                    full[s.start : s.start + s.length] = value.reshape(-1)
        # Agree on which entries exist, then assemble them with one all-reduce per key.
        present = [None] * self.mesh.dp
        wanted = sorted((n, k) for n, e in slots.items() for k in e)
        if self.mesh.dp > 1:
            torch.distributed.all_gather_object(present, wanted, group=self.mesh.dp_group)
        else:
            present = [wanted]
        out = {}
        for name, key in sorted({item for items in present for item in items}):
            p = self.params[names.index(name)]
            value = slots.get(name, {}).get(key)
            if value is None:
                value = torch.zeros((), device=p.device) if key == "step" else torch.zeros(p.numel(), device=p.device)
            op = torch.distributed.ReduceOp.MAX if key == "step" else torch.distributed.ReduceOp.SUM
            value = all_reduce(value, self.mesh.dp_group, op=op)
            out.setdefault(name, (p, {}))[1][key] = value if key == "step" else value.view(p.shape)
        return out

    def load_local_state(self, model: torch.nn.Module, local: dict[str, dict[str, torch.Tensor]]) -> None:
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        for tensor, s in self._owned:
            entry = local.get(names[s.param])
            if not entry:
                continue
            opt = self.optimizers["muon" if tensor is self.params[s.param] else "adamw"]
            opt.state[tensor] = {
                k: v.clone() if k == "step" else v.reshape(-1)[s.start : s.start + s.length].clone().view(tensor.shape)
                for k, v in entry.items()
            }

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for tensor, _ in self._owned:
            tensor.grad = None
