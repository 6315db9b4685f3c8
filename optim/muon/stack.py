"""A Muon stack's items and the elementwise work of a step on them (optim/muon/optimizer.py).

Muon orthogonalises every same-shaped matrix of a step together, as one [N, rows, cols]
stack. Around that batched Newton-Schulz each matrix is streamed through memory for the
momentum step (into its part of the stack) and for the weight decay and update (from its
part of the result): StackWork does both, as eager for-each ops or, with compile_updates,
as compiled fused kernels, and honours the step's on-device gate.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from optim.muon import fused as muon_fused
from optim.muon.newton_schulz import momentum_update, muon_scale
from optim.muon.options import MuonOptions, decay_and_update


@dataclass
class StackItem:
    """One parameter's contribution to a stack: matrices [offset, offset + k) of the stack."""

    param: Tensor
    grad: Tensor
    buf: Tensor
    group: dict[str, Any]
    k: int
    rows: int
    cols: int
    normuon_v: Tensor | None = None  # NorMuon's second moment [k, rows, 1] or [k, 1, cols]


@dataclass(frozen=True)
class StepGate:
    """An on-device skip of the whole step, from `found_inf` (a 0-d float tensor, 1.0 when the
    gradients are not finite), the attribute torch's optimizers read for the same purpose.
    Nothing is read back to the host: a skipped step zeroes the gradients' copy before they
    reach the momentum, keeps the momentum (factor 1) and gates the update and weight decay."""

    skip: Tensor  # bool
    keep: Tensor  # 1.0, or 0.0 to skip

    @staticmethod
    def of(found_inf: Tensor) -> "StepGate":
        skip = found_inf != 0
        return StepGate(skip, (~skip).to(torch.float32))


def stack_views(items: list[StackItem], stack: Tensor) -> list[Tensor]:
    """Each item's matrices [offset, offset + k) of `stack` [N, rows, cols], in its
    parameter's shape (a view wherever the stack's strides allow it)."""
    views, offset = [], 0
    for it in items:
        views.append(stack[offset : offset + it.k].reshape(it.param.shape))
        offset += it.k
    return views


def by_setting(items: list[StackItem], setting: Callable[[StackItem], tuple]) -> dict[tuple, list[int]]:
    """Item indices grouped by `setting(item)`: one foreach call per distinct setting."""
    out: dict[tuple, list[int]] = {}
    for i, it in enumerate(items):
        out.setdefault(setting(it), []).append(i)
    return out


class StackWork:
    """Muon's elementwise work in one step: the momentum step into the Newton-Schulz stack,
    and the weight decay and update after it. Eager for-each ops (a few launches per stack
    whatever its size), or with options.compile_updates (optim/muon/fused.py) fused kernels that stream
    each matrix through memory once per phase. Either honours the step's gate."""

    def __init__(self, gate: StepGate | None, options: MuonOptions) -> None:
        self.gate = gate
        self.options = options

    @property
    def keep(self) -> Tensor | None:
        """What Newton-Schulz gates its result with (None: no gate)."""
        return None if self.gate is None else self.gate.keep

    def _keep_on(self, device: torch.device) -> Tensor:
        return self.gate.keep if self.gate is not None else torch.ones((), device=device)

    def momentum_into(self, items: list[StackItem], stack: Tensor) -> None:
        """Every item's momentum step, its Newton-Schulz input written into its part of `stack`.

        With a gate, eagerly: the gradients are first copied into the stack and zeroed there
        on a skipped step (NaN * 0 is NaN, so only overwriting removes a non-finite value),
        and the momentum factor becomes 1, so the buffers come out unchanged. The stack then
        holds momentum * buf, which Newton-Schulz's gate turns into a zero update.
        """
        outs = stack_views(items, stack)
        if self.options.compile_updates:
            keep = self._keep_on(stack.device)
            for (mu, nesterov), idx in by_setting(items, momentum_setting).items():
                muon_fused.compiled(muon_fused.momentum_step, self.options.combo_kernels)(
                    [items[i].buf for i in idx], [items[i].grad for i in idx], [outs[i] for i in idx],
                    mu, nesterov, keep,
                )
            return
        gate = self.gate
        if gate is not None:
            torch._foreach_copy_(outs, [it.grad for it in items])
            stack.masked_fill_(gate.skip, 0.0)
        for (mu, nesterov), idx in by_setting(items, momentum_setting).items():
            bufs, dst = [items[i].buf for i in idx], [outs[i] for i in idx]
            if gate is None:
                momentum_update(bufs, [items[i].grad for i in idx], dst, mu, nesterov)
                continue
            torch._foreach_mul_(bufs, torch.where(gate.skip, 1.0, mu))
            torch._foreach_add_(bufs, dst)
            if nesterov:
                torch._foreach_add_(dst, bufs, alpha=mu)
            else:
                torch._foreach_copy_(dst, bufs)

    def apply_updates(self, items: list[StackItem], ortho: Tensor, rows: int, cols: int) -> None:
        """The update rule (optim/muon/options.py's decay_and_update) on every item, with its
        matrices of `ortho` (scaled for the rows x cols matrix that was orthogonalised). A
        skipped step's matrices are zero already; the gate keeps the decay off too."""
        updates = stack_views(items, ortho)
        # By param group, not by the values: the lists (and so the compiled variants) stay
        # the same from step to step whatever the schedule does to lr.
        for (_,), idx in by_setting(items, lambda it: (id(it.group),)).items():
            group = items[idx[0]].group
            decay_and_update([items[i].param for i in idx], [updates[i] for i in idx], group["lr"],
                             group["weight_decay"], muon_scale(rows, cols, group["adjust_lr"]), self.options, self.keep)


def momentum_setting(it: StackItem) -> tuple[float, bool]:
    return it.group["momentum"], it.group["nesterov"]
