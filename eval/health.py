"""Training-health statistics per parameter family: weight RMS and applied-update RMS.

Everything is reduced on the device and moved to the host in one transfer, so a logging
step costs one sync however many parameters the model has.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from optim.routing import kind_of
from parallel.fsdp import local_rows
from parallel.comm import all_gather_object
from parallel.tp_ops import Group, all_reduce


class HealthStats:
    """`shard_group`: the group FSDP2 shards the parameters over (dp_shard), whose ranks each
    hold some rows of every parameter; None without FSDP2. `ep_group`: the ranks that hold
    different experts (expert parallelism). `pp_group`: under a pipeline, the ranks holding the
    other stages' layers, whose families' figures are summed with this stage's."""

    def __init__(self, model: torch.nn.Module, tp_group: Group = None, shard_group: Group = None,
                 ep_group: Group = None, pp_group: Group = None) -> None:
        by_kind: dict[str, list[torch.Tensor]] = defaultdict(list)
        for name, param in model.named_parameters():
            if param.requires_grad:
                by_kind[kind_of(name)].append(param)
        # Every stage reports every family of the whole model (a stage may hold none of one).
        self.kinds = sorted({k for kinds in all_gather_object(sorted(by_kind), pp_group, "setup") for k in kinds})
        self.params = [by_kind[k] for k in self.kinds]
        self.device = next(model.parameters()).device
        self.tp_group = tp_group
        self.shard_group = shard_group
        self.ep_group = ep_group
        self.pp_group = pp_group
        # The RMS is that of the logical (single-process) tensor: TP shards record the
        # logical element count, which excludes the vocabulary padding rows (always zero).
        numel = [float(sum(getattr(p, "logical_numel", p.numel()) for p in plist)) for plist in self.params]
        self.numel = all_reduce(torch.tensor(numel, dtype=torch.float64, device=self.device), pp_group).tolist()

    def snapshot(self) -> list[list[torch.Tensor]]:
        """Copies of the weights, taken before an optimizer step whose update is measured."""
        return [[self._mine(p).clone() for p in plist] for plist in self.params]

    @staticmethod
    def _mine(p: torch.Tensor) -> torch.Tensor:
        """This rank's part of a parameter (its FSDP2 rows, or all of it), detached."""
        return local_rows(p.detach())[0]

    def weight_rms(self) -> dict[str, float]:
        values = self._rms([[self._mine(p) for p in plist] for plist in self.params])
        return {f"model/weight_rms/{k}": v for k, v in zip(self.kinds, values)}

    def update_rms(self, before: list[list[torch.Tensor]], lr: float) -> dict[str, float]:
        """RMS of the update actually applied (weight decay included), divided by the lr.

        Dividing by lr makes the figure comparable across the schedule: under Muon's
        match_rms_adamw scaling it sits near 0.2, AdamW's typical update RMS. At lr 0 (the
        last step of a schedule that decays to 0) nothing moves and the ratio is undefined:
        no update RMS is reported for that step.
        """
        if lr <= 0:
            return {}
        deltas = [
            [self._mine(p) - old for p, old in zip(plist, olds)]
            for plist, olds in zip(self.params, before)
        ]
        values = self._rms(deltas)
        return {f"optim/update_rms/{k}": v / lr for k, v in zip(self.kinds, values)}

    def _rms(self, tensor_lists: list[list[torch.Tensor]]) -> list[float]:
        # Squares summed over the ranks that hold other parts: TP's shards, EP's experts.
        split: dict[str, list[torch.Tensor]] = {"tp": [], "ep": [], "none": []}
        for plist, tensors in zip(self.params, tensor_lists):
            sq = [t.float().pow(2).sum() for t in tensors]
            zero = torch.zeros((), device=self.device)
            where = ["tp" if getattr(p, "tp_split_dim", None) is not None
                     else "ep" if getattr(p, "ep_split_dim", None) is not None else "none" for p in plist]
            for key, sums in split.items():
                sums.append(sum((s for s, w in zip(sq, where) if w == key), zero))
        # Under FSDP2 the EP ranks are dp_shard ranks: the sum over dp_shard below covers them.
        experts = all_reduce(torch.stack(split["ep"]), self.ep_group if self.shard_group is None else None)
        total = all_reduce(torch.stack(split["tp"]), self.tp_group) + experts + torch.stack(split["none"])
        total = all_reduce(total, self.shard_group)  # FSDP2: every rank holds other rows
        total = all_reduce(total, self.pp_group)  # a pipeline: every stage holds other layers
        numel = torch.tensor(self.numel, dtype=torch.float32, device=total.device)
        return (total / numel).sqrt().tolist()
