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

With tensor parallelism the rows above are those of the TP-local shard (FSDP2 shards what TP
left on the rank). An owner then also all-gathers its matrices over TP before Newton-Schulz,
as Muon's tp_mode=gather does, and keeps its TP shard of the result: the DP gather -> TP
gather -> Newton-Schulz -> TP shard -> DP shard of Distributed Muon. Every rank of a TP group
sits at the same place in its dp_shard group and so owns the same matrices.

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

from optim.muon import normuon
from optim.muon.options import MuonOptions, check_group, full_matrix, parse_ns_dtype
from optim.muon.buffers import reusable_buffer
from optim.muon.newton_schulz import muon_scale, newton_schulz
from optim.muon.update import MomentumSetting, apply_update, gate_for, momentum, phase, update_factors
from optim.muon.ns_method import NSShape, iteration_for
from optim.muon.newton_schulz_tp import newton_schulz_sharded
from optim.zero_plan import ParamSpec, build_plan
from parallel.comm import Group, all_gather_into, all_to_all_into, group_rank, group_size
from parallel.fsdp import row_range


@dataclass(frozen=True)
class _Matrix:
    """One 2-D parameter: where its rows live and who orthogonalises it."""

    index: int  # position in the optimizer's list of all parameters, group by group
    rows: int  # of the (TP-local) matrix the group shards
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
        params: this rank's shards of 2-D matrices or 3-D expert stacks (rows start, stop of
            row_range; a 3-D stack is split over its first, expert, dimension), or param
            groups: dicts with "params" and, aligned with them, "full_shapes" (and, for
            TP-sharded matrices, "tp_split_dims": 0, 1 or None each), plus any option below,
            and "shard_group" for expert stacks sharded over another group than `group`
            (under EP, the ranks that hold the same experts).
        full_shapes: every parameter's unsharded (TP-local) shape, when `params` is a list.
        group: the group the rows are sharded over (None: one process holding everything).
        tp_group: the TP group (None: no tensor parallelism).
        options, overrides: as Muon's (MuonOptions). With cuda_graphs, the Newton-Schulz of each
            batch of same-shape matrices (an owner's, or a rank's experts) is copied into a
            buffer that stays at one address from step to step, which the graph replays.
        lr, weight_decay: as Muon's. Like Muon, `step` honours a `found_inf` attribute (a 0-d
        float tensor, 1.0 to skip the step on the device without a host sync).
    """

    def __init__(
        self,
        params: Sequence[Tensor] | Sequence[dict[str, Any]],
        full_shapes: Optional[Sequence[Sequence[int]]],
        group: Group,
        lr: float = 3e-3,
        weight_decay: float = 0.0,
        options: Optional[MuonOptions] = None,
        tp_group: Group = None,
        cautious_wd: bool = False,
        compile_updates: bool = False,
        **overrides: Any,
    ) -> None:
        params = list(params)
        if params and not isinstance(params[0], dict):
            if full_shapes is None or len(full_shapes) != len(params):
                raise ValueError(f"ShardedMuon: {len(params)} parameters but "
                                 f"{0 if full_shapes is None else len(full_shapes)} full shapes")
            params = [{"params": params, "full_shapes": list(full_shapes)}]
        self.group = group
        self.tp_group = tp_group
        self.options = (options or MuonOptions()).with_overrides(overrides)
        self.cautious_wd, self.compile_updates = cautious_wd, compile_updates
        defaults = dict(lr=lr, weight_decay=weight_decay, **self.options.group_defaults())
        check_group({**defaults, "params": []})  # the defaults themselves, as Muon checks them
        super().__init__(params, defaults)
        self.matrices = _plan(self.full_shapes, group_size(group))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        shapes = [torch.Size(s) for s in param_group.get("full_shapes", ())]
        splits = list(param_group.get("tp_split_dims") or [None] * len(shapes))
        rows_group = param_group.setdefault("shard_group", self.group)
        if rows_group is not self.group and any(len(s) != 3 for s in shapes):
            raise ValueError("ShardedMuon: only expert stacks can be sharded over a group of their own")
        n, me = group_size(rows_group), group_rank(rows_group)
        plist = list(param_group["params"])
        if len(shapes) != len(plist) or len(splits) != len(plist):
            raise ValueError("ShardedMuon: a param group needs one full shape (and TP split) per parameter")
        for i, (p, full) in enumerate(zip(plist, shapes)):
            start, stop = row_range(full[0], n, me)
            if p.dim() not in (2, 3) or p.shape != torch.Size((stop - start, *full[1:])):
                raise ValueError(f"ShardedMuon: parameter {i} of shape {tuple(p.shape)} is not rank {me}'s rows "
                                 f"[{start}, {stop}) of {tuple(full)} split {n} ways")
            if splits[i] is not None and splits[i] not in (0, 1):
                raise ValueError(f"ShardedMuon: parameter {i}: a TP split must be a matrix dimension, 0 or 1")
        head = param_group.get("split_rows")
        if head is not None:
            if any(len(s) != 2 or s[0] % head for s in shapes):
                raise ValueError(f"ShardedMuon: split_rows={head} must divide the rows of 2-D matrices")
        param_group["full_shapes"], param_group["tp_split_dims"] = shapes, splits
        super().add_param_group(param_group)
        check_group(self.param_groups[-1], shapes)  # canonical ns_dtype ("auto" resolved on the shards' device)

    @property
    def full_shapes(self) -> list[torch.Size]:
        return [s for g in self.param_groups for s in g["full_shapes"]]

    def _entries(self) -> list[tuple[dict[str, Any], Tensor, torch.Size, Optional[int]]]:
        """(group, shard, full shape, TP split dim) of every parameter, group by group."""
        return [(g, p, s, t) for g in self.param_groups for p, s, t in zip(g["params"], g["full_shapes"],
                                                                           g["tp_split_dims"])]

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("ShardedMuon.step takes no closure")
        entries = self._entries()
        if any(p.grad is None for _, p, _, _ in entries):
            raise ValueError("ShardedMuon.step: every shard needs a gradient (a rank without rows of a "
                             "matrix holds an empty one)")
        found_inf = getattr(self, "found_inf", None)
        keep = None if found_inf is None else (found_inf == 0).to(torch.float32)
        inputs: list[Tensor] = [None] * len(entries)  # type: ignore[list-item]
        step = phase(momentum, self.compile_updates, self.options.combo_kernels)
        for g in self.param_groups:
            idx = [i for i, e in enumerate(entries) if e[0] is g]
            if not idx:
                continue
            params = [entries[i][1] for i in idx]
            bufs = [self.state[p].setdefault("momentum_buffer", torch.zeros_like(p)) for p in params]
            flat = params[0].new_empty(sum(p.numel() for p in params))
            parts = step(bufs, [p.grad for p in params], flat, MomentumSetting.of(g),
                         gate_for(keep, self.compile_updates, flat.device))
            for i, part in zip(idx, parts):
                inputs[i] = part
        updates: list[Optional[Tensor]] = [None] * len(entries)
        # Expert stacks: whole experts on every rank, orthogonalised where they are (gathered over
        # TP first where TP splits each expert's hidden units; every rank of a TP group holds the
        # same experts).
        stacks = [i for i, (_, p, _, _) in enumerate(entries) if p.dim() == 3]
        whole = [self._tp_gather(inputs[i], entries[i][3]) for i in stacks]
        for i, u in zip(stacks, self._orthogonalise(whole, [entries[i][0] for i in stacks], "experts")):
            updates[i] = self._tp_shard(u, entries[i][3])
        fulls = self._gather_to_owners(inputs)
        tp = group_size(self.tp_group)
        # tp_mode=gram: Newton-Schulz on the TP shards, all-reducing Gram matrices over TP;
        # otherwise the owner gathers the whole matrix over TP and keeps its shard of the result.
        # optim.muon.split_heads: one matrix per head, and TP splits rows by whole heads, so the
        # heads are complete on every TP rank: no TP gather.
        heads = [i for i in fulls if entries[i][0]["split_rows"] is not None]
        on_shards = [i for i in fulls if i not in heads and tp > 1 and entries[i][3] is not None
                     and entries[i][0]["tp_mode"] == "gram"]
        owned = [i for i in fulls if i not in on_shards and i not in heads]
        tp_full = [self._tp_gather(fulls[i], entries[i][3]) for i in owned]
        tp_full += [fulls[i].view(-1, entries[i][0]["split_rows"], fulls[i].shape[-1]) for i in heads]
        ortho = self._orthogonalise(tp_full, [entries[i][0] for i in owned + heads], "owned")
        ortho_local = {i: self._tp_shard(o, entries[i][3]) for i, o in zip(owned, ortho)}
        ortho_local.update({i: o.reshape(fulls[i].shape) for i, o in zip(heads, ortho[len(owned):])})
        ortho_local.update(self._orthogonalise_tp_shards({i: fulls[i] for i in on_shards}, entries))
        for i, rows in self._scatter_from_owners(ortho_local, inputs).items():
            updates[i] = rows
        self._normuon(entries, updates, keep)
        self._apply(entries, updates, keep)

    def _normuon(self, entries, updates: list[Optional[Tensor]], keep: Optional[Tensor]) -> None:
        """NorMuon (optim/muon/normuon.py) on each update as this rank holds it: a 2-D parameter's rows
        (their matrices' sums completed over the shard group, and over TP where it splits them),
        an expert stack's whole experts (over TP where it splits each expert)."""
        for i, (g, p, full, split) in enumerate(entries):
            if not g["normuon"]:
                continue
            v = self.state[p].get("normuon_v")
            if v is None:
                v = self.state[p]["normuon_v"] = torch.zeros(self._normuon_shape(g, p, full, split), device=p.device)
            if p.dim() == 2:
                shard = self._row_shard(g, full, split)
                row_groups = [self.group] + ([self.tp_group] if split == 0 and g["split_rows"] is None else [])
                normuon.normalise_rows(updates[i], v, g["normuon_beta2"], shard, row_groups,
                                       self.tp_group if split == 1 else None, keep)
            else:
                rows, cols = self._tp_full(full[-2], full[-1], split)
                normuon.normalise(updates[i], v, g["normuon_beta2"], rows, cols, split, self.tp_group, keep)

    def _tp_full(self, rows: int, cols: int, split: Optional[int]) -> tuple[int, int]:
        """The whole matrix's shape, from the TP-local one."""
        return full_matrix(rows, cols, split, group_size(self.tp_group))

    def _row_shard(self, g: dict[str, Any], full: torch.Size, split: Optional[int]) -> normuon.RowShard:
        """This rank's rows of a 2-D parameter of (TP-local) shape `full`, as NorMuon sees them:
        one matrix per head under split_heads (TP splits rows by whole heads), else one matrix."""
        start, stop = row_range(full[0], group_size(self.group), group_rank(self.group))
        head = g["split_rows"]
        if head is not None:
            cols = self._tp_full(head, full[1], split if split == 1 else None)[1]
            return normuon.RowShard(start, stop - start, head, full[0] // head, head, cols)
        return normuon.RowShard(start, stop - start, full[0], 1, *self._tp_full(full[0], full[1], split))

    def _normuon_shape(self, g: dict[str, Any], p: Tensor, full: torch.Size, split: Optional[int]) -> tuple[int, ...]:
        """v's shape: for this rank's rows of a matrix, or its (TP-local parts of) whole experts."""
        if p.dim() == 3:
            return normuon.state_shape(p.shape[0], p.shape[1], p.shape[2], *self._tp_full(p.shape[1], p.shape[2], split))
        return self._row_shard(g, full, split).state_shape(p.shape[1])

    def _entry_of(self, p: Tensor) -> tuple[dict[str, Any], Tensor, torch.Size, Optional[int]]:
        return next(e for e in self._entries() if e[1] is p)

    def export_state(self, p: Tensor, state: dict[str, Any]) -> dict[str, Tensor]:
        """`p`'s state as checkpoints hold it: every non-scalar tensor in p's (local) shape,
        NorMuon's v broadcast over the dimension it was reduced along, as Muon saves it."""
        out = {key: value for key, value in state.items() if torch.is_tensor(value)}
        if "normuon_v" in out:
            g, _, full, split = self._entry_of(p)
            if p.dim() == 3:
                out["normuon_v"] = out["normuon_v"].expand(p.shape)
            else:
                out["normuon_v"] = self._row_shard(g, full, split).export(out["normuon_v"], p.shape[1])
        return out

    def import_state(self, p: Tensor, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """The inverse of export_state (state already on p's device)."""
        if "normuon_v" in state:
            g, _, full, split = self._entry_of(p)
            if p.dim() == 3:
                shape = self._normuon_shape(g, p, full, split)
                state["normuon_v"] = state["normuon_v"][:, : shape[1], : shape[2]].float().contiguous()
            else:
                state["normuon_v"] = self._row_shard(g, full, split).restore(state["normuon_v"].reshape(p.shape))
        return state

    def _orthogonalise_tp_shards(self, shards: dict[int, Tensor], entries) -> dict[int, Tensor]:
        """tp_mode=gram: this TP rank's shard of each matrix's Newton-Schulz, computed on the
        shards (optim/muon/newton_schulz_tp.py), one call per shape, split and setting."""
        batches: dict[tuple, list[int]] = {}
        for i, t in shards.items():
            g, split = entries[i][0], entries[i][3]
            batches.setdefault((tuple(t.shape), split, id(g)), []).append(i)
        out = {}
        for ((rows, cols), split, _), idx in batches.items():
            g = entries[idx[0]][0]
            iteration = iteration_for(g["ns_method"], NSShape(rows, cols, split), g["ns_steps"], g["ns_by_shape"])
            orth = newton_schulz_sharded(torch.stack([shards[i] for i in idx]), split, self.tp_group, g["ns_steps"],
                                         g["coefficients"], parse_ns_dtype(g["ns_dtype"]), g["eps"], iteration=iteration)
            out.update(zip(idx, orth.unbind(0)))
        return out

    def _tp_gather(self, local: Tensor, split: Optional[int]) -> Tensor:
        """The whole matrices from every TP rank's (TP-local) ones, along the TP split (a matrix
        dimension: 0 rows, 1 columns, of a matrix or of every matrix of a stack)."""
        if split is None or group_size(self.tp_group) == 1:
            return local
        tp = group_size(self.tp_group)
        gathered = local.new_empty((tp, *local.shape))
        all_gather_into(gathered, local, self.tp_group)
        return torch.cat(gathered.unbind(0), dim=split + local.dim() - 2)

    def _tp_shard(self, full: Tensor, split: Optional[int]) -> Tensor:
        if split is None or group_size(self.tp_group) == 1:
            return full
        tp = group_size(self.tp_group)
        return full.chunk(tp, dim=split + full.dim() - 2)[group_rank(self.tp_group)].contiguous()

    def _orthogonalise(self, matrices: list[Tensor], groups: list[dict[str, Any]], tag: str) -> list[Tensor]:
        """Newton-Schulz of each matrix (or stack), one call per shape and setting, left in the
        Newton-Schulz dtype: the iteration's last product is in that dtype already, so sending
        it back that way loses nothing and, in bf16, halves the return trip. `tag` names the
        call site's buffers (the results are read until the step's end)."""
        out: list[Optional[Tensor]] = [None] * len(matrices)
        batches: dict[tuple, list[int]] = {}
        for j, (m, g) in enumerate(zip(matrices, groups)):
            setting = (g["ns_steps"], g["coefficients"], parse_ns_dtype(g["ns_dtype"]), g["eps"], g["ns_method"])
            batches.setdefault((tuple(m.shape[-2:]), setting, id(g)), []).append(j)
        for b, (((rows, cols), (steps, coefficients, dtype, eps, method), _), idx) in enumerate(batches.items()):
            parts = [matrices[j].reshape(-1, rows, cols) for j in idx]
            total = sum(t.shape[0] for t in parts)
            iteration = iteration_for(method, NSShape(rows, cols), steps, groups[idx[0]]["ns_by_shape"])
            if self.options.cuda_graphs and total:
                # The same batches come every step, in the same order: buffers named by call
                # site and batch keep their addresses, so the recorded graph replays on them.
                name = f"sharded_muon.{tag}.{b}"
                stack = reusable_buffer(name, total, rows, cols, parts[0].dtype, parts[0].device, persistent=True)
                torch.cat(parts, out=stack)
                result = reusable_buffer(name + ".out", total, rows, cols, dtype, parts[0].device, persistent=True)
                orth = newton_schulz(stack, steps, coefficients, dtype, eps, out=result, iteration=iteration,
                                     graph=True)
            else:
                stack = torch.cat(parts)
                orth = (newton_schulz(stack, steps, coefficients, dtype, eps, out_dtype=dtype, iteration=iteration)
                        if total else stack.to(dtype))
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
        dtypes = {o.dtype for o in ortho.values()} or {parse_ns_dtype(self.param_groups[0]["ns_dtype"])}
        if len(dtypes) > 1:
            raise ValueError("ShardedMuon: every param group must share ns_dtype (one return trip)")
        reference = inputs[0].new_empty(0, dtype=dtypes.pop())
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

    def _apply(self, entries: list[tuple[dict[str, Any], Tensor, torch.Size, Optional[int]]],
               updates: list[Optional[Tensor]], keep: Optional[Tensor]) -> None:
        """The update (optim/muon/update.py's apply_update) on this rank's rows, with the scale
        for the whole matrix's shape (TP included). `keep` == 0 (a skipped step) leaves p as it is."""
        # One for-each call per group and scale (a few launches a step, not a few per matrix).
        buckets: dict[tuple[int, float], tuple[dict[str, Any], list[Tensor], list[Tensor]]] = {}
        for (g, p, full, split), u in zip(entries, updates):
            rows, cols = full[-2], full[-1]
            if g["split_rows"] is not None and p.dim() == 2:
                rows = g["split_rows"]  # one matrix per head
            else:
                rows, cols = self._tp_full(rows, cols, split)
            scale = muon_scale(rows, cols, g["adjust_lr"])
            bucket = buckets.setdefault((id(g), scale), (g, [], []))
            bucket[1].append(p)
            bucket[2].append(u)
        step = phase(apply_update, self.compile_updates, self.options.combo_kernels)
        for (_, scale), (g, params, ups) in buckets.items():
            if keep is not None:
                ups = torch._foreach_mul(ups, keep)  # a skipped step's update is zero (no decay either)
            decay, alpha = update_factors(g["lr"], g["weight_decay"], scale, keep, params[0])
            step(params, ups, decay, alpha, self.cautious_wd)
