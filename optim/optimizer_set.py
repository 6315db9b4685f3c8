"""Several torch optimizers stepped as one, with one state_dict; the trainer's interface."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

import torch


@contextlib.contextmanager
def skip_if(optimizers: Iterable[torch.optim.Optimizer], found_inf: Optional[torch.Tensor]) -> Iterator[None]:
    """Hand `found_inf` to the optimizers for the steps inside, the way torch's GradScaler
    does: an optimizer reads it as its `found_inf` attribute (torch's fused AdamW, and our
    Muon) and leaves parameters and state as they were where it is 1."""
    optimizers = list(optimizers)
    if found_inf is None:
        yield
        return
    for opt in optimizers:
        opt.found_inf = found_inf
    try:
        yield
    finally:
        for opt in optimizers:
            opt.__dict__.pop("found_inf", None)


def install_state(key: str, value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A copy of one optimizer state tensor (checkpoints load onto the CPU) on its parameter's
    device. AdamW's step count goes there too, in fp32, where torch's load_state_dict puts it
    for the fused kernel (which reads it on the device); elsewhere it would fault."""
    if key == "step":
        return value.to(device=param.device, dtype=torch.float32, copy=True)
    return value.to(device=param.device, copy=True)


@dataclass(frozen=True)
class OwnedPiece:
    """A tensor this rank steps: elements [start, start + tensor.numel()) of the flattened
    TP-local parameter `name`, stepped by `optimizer` (whose state is keyed by `tensor`)."""

    name: str
    tensor: torch.Tensor
    start: int
    optimizer: str


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
        """The schedule's lr, times each group's family multiplier (optim.lr_overrides)."""
        for group in self.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)

    def prepare_grads(self, max_norm: float) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, found_inf: Optional[torch.Tensor] = None) -> None:
        """Step every optimizer; with `found_inf` (a 0-d float tensor on the device, 1.0 when
        the gradients are not finite) the step is skipped on the device, with no host sync."""
        with skip_if(self.optimizers.values(), found_inf):
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

    def checkpoint_state(self, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """The state optimizer `key` keeps for `tensor`, as checkpoints hold it: the step count
        0-d, everything else in tensor's shape (an optimizer may keep a compact form, like
        NorMuon's per-row v, and define export_state / import_state)."""
        opt = self.optimizers[key]
        state = opt.state.get(tensor, {})
        export = getattr(opt, "export_state", None)
        if export is not None:
            return export(tensor, state)
        return {k: v for k, v in state.items() if torch.is_tensor(v)}

    def install_checkpoint_state(self, key: str, tensor: torch.Tensor, entry: dict[str, torch.Tensor]) -> None:
        """The inverse of checkpoint_state: `entry` (from a checkpoint, any device) becomes the
        state of `tensor` in optimizer `key`."""
        opt = self.optimizers[key]
        state = {k: install_state(k, v, tensor) for k, v in entry.items()}
        load = getattr(opt, "import_state", None)
        opt.state[tensor] = load(tensor, state) if load is not None else state

    def _optimizer_of(self, p: torch.Tensor) -> str | None:
        return next((key for key, opt in self.optimizers.items()
                     if any(p is q for g in opt.param_groups for q in g["params"])), None)

    def local_state(self, model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """{parameter name: (parameter, its optimizer state)} as this rank holds them (TP-local,
        whole over DP, in checkpoint form). Collective in subclasses that shard state over DP."""
        out = {}
        for name, p in model.named_parameters():
            key = self._optimizer_of(p)
            if key is not None and self.optimizers[key].state.get(p):
                out[name] = (p, self.checkpoint_state(key, p))
        return out

    def load_local_state(self, model: torch.nn.Module, local: dict[str, dict[str, torch.Tensor]]) -> None:
        """Install per-parameter state (TP-local, whole over DP, checkpoint form)."""
        params = dict(model.named_parameters())
        for name, state in local.items():
            p = params[name]
            self.install_checkpoint_state(self._optimizer_of(p), p, state)

    def owned_pieces(self, model: torch.nn.Module) -> list[OwnedPiece]:
        """What this rank steps: every trainable parameter, whole (ZeRO-1 overrides this)."""
        pieces = []
        for name, p in model.named_parameters():
            key = self._optimizer_of(p)
            if key is not None:
                pieces.append(OwnedPiece(name, p, 0, key))
        return pieces

    def state_tensors(self) -> Iterator[torch.Tensor]:
        for opt in self.optimizers.values():
            for per_param in opt.state.values():
                yield from (v for v in per_param.values() if torch.is_tensor(v))

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state_tensors())
