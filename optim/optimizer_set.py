"""Several torch optimizers stepped as one, with one state_dict; the trainer's interface."""
from __future__ import annotations

from typing import Any, Iterator

import torch


class OptimizerSet:
    """Holds {"muon": ..., "adamw": ...}; each param group carries its parameter "kind".

    Subclasses decide how gradients are synchronised (`prepare_grads`) and what a step
    communicates (`step`).
    """

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    def set_lr(self, lr: float) -> None:
        for group in self.param_groups:
            group["lr"] = lr

    def prepare_grads(self, max_norm: float) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def step(self) -> None:
        for opt in self.optimizers.values():
            opt.step()

    def state_dict(self) -> dict[str, Any]:
        return {name: opt.state_dict() for name, opt in self.optimizers.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != set(self.optimizers):
            raise ValueError(
                f"optimizer state holds {sorted(state)}, this run has {sorted(self.optimizers)}"
            )
        for name, opt in self.optimizers.items():
            opt.load_state_dict(state[name])

    def local_state(self, model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """{parameter name: (parameter, its optimizer state)} as this rank holds them (TP-local,
        whole over DP). Collective in subclasses that shard state over DP."""
        out = {}
        for name, p in model.named_parameters():
            for opt in self.optimizers.values():
                if p in opt.state and opt.state[p]:
                    out[name] = (p, {k: v for k, v in opt.state[p].items() if torch.is_tensor(v)})
        return out

    def load_local_state(self, model: torch.nn.Module, local: dict[str, dict[str, torch.Tensor]]) -> None:
        """Install per-parameter state (TP-local, whole over DP), e.g. from a checkpoint."""
        params = dict(model.named_parameters())
        for name, state in local.items():
            p = params[name]
            opt = next(o for o in self.optimizers.values() if any(p is q for g in o.param_groups for q in g["params"]))
            opt.state[p] = {k: v.clone() for k, v in state.items()}

    def state_tensors(self) -> Iterator[torch.Tensor]:
        for opt in self.optimizers.values():
            for per_param in opt.state.values():
                yield from (v for v in per_param.values() if torch.is_tensor(v))

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state_tensors())
