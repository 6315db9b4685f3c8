"""Muon on parameters whose rows are sharded over a group, with Newton-Schulz on whole matrices.

The layout is FSDP2's: each parameter is split along dim 0 the way torch.chunk and DTensor's
Shard(0) split it (ceil(rows / n) rows per rank, the last ranks fewer or none), and every
rank holds its rows of the parameter, its gradient and its momentum. Newton-Schulz needs the
whole matrix, so per step, over the group:

  1. every rank runs the momentum step on its own rows (the state stays sharded);
  2. one all-to-all sends each rank's rows of every matrix to the matrix's owner, a rank the
     LPT plan of optim/zero_plan.py picks to balance the Newton-Schulz FLOPs, as under ZeRO-1;
  3. each owner orthogonalises its whole matrices, batched by shape;
  4. one all-to-all sends each rank its rows of every orthogonalised matrix;
  5. every rank applies weight decay and the update to its own rows.

A 3-D expert stack [E, rows, cols] is split over its experts, so each rank already holds
whole experts: they are orthogonalised where they are, with no exchange.

Bytes per step, besides the data-parallel reduce-scatter and all-gathers that shard the
gradients and gather the weights: each 2-D matrix goes through the all-to-alls twice, once as
rows to its owner in the parameters' dtype and once back as the update in the Newton-Schulz
dtype (bf16 by default: lossless, the iteration's last product is bf16), of which all but the
owner's own rows cross the wire (`exchange_bytes`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from optim.muon import validate_group, parse_ns_dtype
from optim.newton_schulz import NSShape, iteration_for, momentum_update, muon_scale, newton_schulz
from optim.zero_plan import ParamSpec, build_plan
from parallel.comm import Group, all_to_all_into, group_rank, group_size


def row_range(rows: int, n: int, rank: int) -> tuple[int, int]:
    """Rank `rank`'s rows [start, stop) of `rows` split n ways as torch.chunk / Shard(0) split them."""
    per = -(-rows // n)
    return min(rank * per, rows), min((rank + 1) * per, rows)


@dataclass(frozen=True)
class _Matrix:
    """One 2-D parameter: where its rows live and who orthogonalises it."""

    index: int  # position in the optimizer's parameter list
    rows: int
    cols: int
    owner: int

    def rows_of(self, n: int, rank: int) -> tuple[int, int]:
        return row_range(self.rows, n, rank)

    def elements_of(self, n: int, rank: int) -> int:
        start, stop = self.rows_of(n, rank)
        return (stop - start) * self.cols


def exchange_bytes(full_shapes: Sequence[torch.Size], n: int, param_bytes: int, ns_bytes: int) -> int:
    """Bytes the two all-to-alls of one step carry, summed over the group's ranks, as
    parallel/comm.py counts a collective (its whole input buffer): every 2-D matrix once to its
    owner in the parameters' dtype (`param_bytes` an element) and once back in the Newton-Schulz
    dtype (`ns_bytes`). Of that, the owner's own rows stay on the owner: the wire carries less
    by the owners' rows x cols x (param_bytes + ns_bytes). Expert stacks never travel."""
    if n == 1:
        return 0
    return (param_bytes + ns_bytes) * sum(s[0] * s[1] for s in full_shapes if len(s) == 2)


def _plan(full_shapes: Sequence[torch.Size], n: int) -> list[_Matrix]:
    specs = [ParamSpec(index=i, numel=s[0] * s[1], muon_matrices=((s[0], s[1]),))
             for i, s in enumerate(full_shapes) if len(s) == 2]
    plan = build_plan(specs, n)
    owners = {s.param: r for r, share in enumerate(plan.ranks) for s in share.muon}
    return [_Matrix(spec.index, *full_shapes[spec.index], owners[spec.index]) for spec in specs]


class ShardedMuon(torch.optim.Optimizer):
    """Muon for row-sharded parameters (see the module docstring); every rank of `group`
    constructs it with its own shards, in the same order, and steps together.

    Args:
        params: this rank's shards (rows start, stop of row_range) of 2-D matrices or 3-D
            expert stacks; a 3-D stack is split over its first (expert) dimension.
        full_shapes: every parameter's unsharded shape, in the same order.
        group: the group the rows are sharded over (None: one process holding everything).
        The rest as optim.muon.Muon (one parameter group).
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        full_shapes: Sequence[Sequence[int]],
        group: Group,
        lr: float = 3e-3,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        coefficients: str = "classic",
        ns_dtype: torch.dtype | str = torch.bfloat16,
        adjust_lr: str = "match_rms_adamw",
        eps: float = 1e-7,
        ns_method: str = "standard",
        ns_by_shape: Optional[dict[str, str]] = None,
        cautious_wd: bool = False,
    ) -> None:
        params = list(params)
        self.full_shapes = [torch.Size(s) for s in full_shapes]
        if len(self.full_shapes) != len(params):
            raise ValueError(f"ShardedMuon: {len(params)} parameters but {len(self.full_shapes)} full shapes")
        self.group = group
        n, me = group_size(group), group_rank(group)
        for i, (p, full) in enumerate(zip(params, self.full_shapes)):
            start, stop = row_range(full[0], n, me)
            if p.dim() not in (2, 3) or p.shape != torch.Size((stop - start, *full[1:])):
                raise ValueError(f"ShardedMuon: parameter {i} of shape {tuple(p.shape)} is not rank {me}'s rows "
                                 f"[{start}, {stop}) of {tuple(full)} split {n} ways")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        coefficients=coefficients, ns_dtype=ns_dtype, adjust_lr=adjust_lr, eps=eps,
                        split_rows=None, tp_group=None, tp_mode="gather", ns_method=ns_method, normuon=False,
                        normuon_beta2=0.95, ns_by_shape=ns_by_shape)
        validate_group({**defaults, "params": []})  # the defaults themselves, as Muon checks them
        super().__init__(params, defaults)
        if len(self.param_groups) != 1:
            raise ValueError("ShardedMuon takes one parameter group")
        self.cautious_wd = cautious_wd
        self.matrices = _plan(self.full_shapes, n)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        validate_group(self.param_groups[-1])  # canonical ns_dtype ("auto" resolved on the shards' device)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("ShardedMuon.step takes no closure")
        group = self.param_groups[0]
        params: list[Tensor] = group["params"]
        if any(p.grad is None for p in params):
            raise ValueError("ShardedMuon.step: every shard needs a gradient (a rank without rows of a "
                             "matrix holds an empty one)")
        bufs = [self.state[p].setdefault("momentum_buffer", torch.zeros_like(p)) for p in params]
        inputs = [torch.empty_like(p) for p in params]
        momentum_update(bufs, [p.grad for p in params], inputs, group["momentum"], group["nesterov"])
        updates: list[Optional[Tensor]] = [None] * len(params)
        # Expert stacks: whole experts on every rank, orthogonalised in place.
        for i, p in enumerate(params):
            if p.dim() == 3:
                updates[i] = self._orthogonalise([inputs[i]], group)[0]
        fulls = self._gather_to_owners(inputs)
        ortho = dict(zip(fulls, self._orthogonalise(list(fulls.values()), group)))
        for i, rows in self._scatter_from_owners(ortho, inputs).items():
            updates[i] = rows
        self._apply(params, updates, group)

    def _orthogonalise(self, matrices: list[Tensor], group: dict[str, Any]) -> list[Tensor]:
        """Newton-Schulz of each matrix (or stack), one call per shape, left in the Newton-Schulz
        dtype: the iteration's last product is in that dtype already, so sending it back that way
        loses nothing and, in bf16, halves the return trip."""
        out: list[Optional[Tensor]] = [None] * len(matrices)
        by_shape: dict[tuple[int, int], list[int]] = {}
        for j, m in enumerate(matrices):
            by_shape.setdefault(tuple(m.shape[-2:]), []).append(j)
        dtype = parse_ns_dtype(group["ns_dtype"])
        for (rows, cols), idx in by_shape.items():
            stack = torch.cat([matrices[j].reshape(-1, rows, cols) for j in idx])
            iteration = iteration_for(group["ns_method"], NSShape(rows, cols), group["ns_steps"], group["ns_by_shape"])
            orth = (newton_schulz(stack, group["ns_steps"], group["coefficients"], dtype, group["eps"],
                                  out_dtype=dtype, iteration=iteration)
                    if stack.shape[0] else stack.to(dtype))
            offset = 0
            for j in idx:
                k = matrices[j].numel() // (rows * cols)
                out[j] = orth[offset : offset + k].reshape(matrices[j].shape)
                offset += k
        return out  # type: ignore[return-value]

    def _gather_to_owners(self, inputs: list[Tensor]) -> dict[int, Tensor]:
        """{index: full matrix} of the matrices this rank owns, assembled from every rank's rows."""
        if not self.matrices:
            return {}
        n, me = group_size(self.group), group_rank(self.group)
        send = [[inputs[m.index].reshape(-1) for m in self.matrices if m.owner == dest] for dest in range(n)]
        mine = [m for m in self.matrices if m.owner == me]
        in_splits = [sum(t.numel() for t in pieces) for pieces in send]
        out_splits = [sum(m.elements_of(n, src) for m in mine) for src in range(n)]
        reference = inputs[0]
        received = reference.new_empty(sum(out_splits))
        all_to_all_into(received, torch.cat([t for pieces in send for t in pieces]) if sum(in_splits)
                        else reference.new_empty(0), out_splits, in_splits, self.group)
        fulls = {m.index: reference.new_empty(m.rows, m.cols) for m in mine}
        offset = 0
        for src in range(n):
            for m in mine:
                start, stop = m.rows_of(n, src)
                count = (stop - start) * m.cols
                fulls[m.index][start:stop] = received[offset : offset + count].view(stop - start, m.cols)
                offset += count
        return fulls

    def _scatter_from_owners(self, ortho: dict[int, Tensor], inputs: list[Tensor]) -> dict[int, Tensor]:
        """{index: this rank's rows of the orthogonalised matrix} for every 2-D parameter."""
        if not self.matrices:
            return {}
        n, me = group_size(self.group), group_rank(self.group)
        mine = [m for m in self.matrices if m.owner == me]
        pieces = [[ortho[m.index][slice(*m.rows_of(n, dest))].reshape(-1) for m in mine] for dest in range(n)]
        in_splits = [sum(t.numel() for t in p) for p in pieces]
        from_owner = [[m for m in self.matrices if m.owner == src] for src in range(n)]
        out_splits = [sum(m.elements_of(n, me) for m in ms) for ms in from_owner]
        reference = inputs[0].new_empty(0, dtype=parse_ns_dtype(self.param_groups[0]["ns_dtype"]))
        received = reference.new_empty(sum(out_splits))
        all_to_all_into(received, torch.cat([t for p in pieces for t in p]) if sum(in_splits)
                        else reference.new_empty(0), out_splits, in_splits, self.group)
        rows: dict[int, Tensor] = {}
        offset = 0
        for ms in from_owner:
            for m in ms:
                count = m.elements_of(n, me)
                rows[m.index] = received[offset : offset + count].view(inputs[m.index].shape)
                offset += count
        return rows

    def _apply(self, params: list[Tensor], updates: list[Optional[Tensor]], group: dict[str, Any]) -> None:
        """p <- p * (1 - lr * wd) - lr * scale * O on this rank's rows, scale for the whole
        matrix's shape, as optim/muon.py's update; with cautious_wd the decay only where O and p
        agree in sign."""
        lr, decay = group["lr"], group["lr"] * group["weight_decay"]
        for p, u, full in zip(params, updates, self.full_shapes):
            if decay != 0 and self.cautious_wd:
                p.mul_(torch.where(u * p > 0, 1.0 - decay, 1.0))
            elif decay != 0:
                p.mul_(1.0 - decay)
            p.add_(u, alpha=-lr * muon_scale(full[-2], full[-1], group["adjust_lr"]))
