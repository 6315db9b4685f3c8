"""Muon: momentum, then orthogonalise each weight matrix's update with Newton-Schulz.

Per matrix W with gradient G (Keller Jordan 2024; Liu et al. 2025 for the AdamW-matched scale):

    M = momentum * M + G
    O = NS(G + momentum * M)          (NS(M) without Nesterov)
    W = W * (1 - lr * weight_decay) - lr * scale(rows, cols) * O

The three lines are the step's phases: momentum and the update are written once in
optim/muon/update.py (the update with its sign-gated decay option), Newton-Schulz in
optim/muon/newton_schulz.py; this file stacks the matrices for them. With `normuon`, O is
normalised per row (or column) by a running second moment before the update
(optim/muon/normuon.py). With ns_method="gram", Newton-Schulz runs as Gram Newton-Schulz
where the matrix's aspect ratio makes it cheaper (optim/muon/newton_schulz.py); with "auto", where
`ns_by_shape` says so for the matrix's shape (measured on the device, optim/muon/ns_choice.py).

Parameters are 2-D [out, in] or 3-D [E, out, in] (E independent expert matrices). A group
may set `split_rows=h`: each block of h rows of a [R, C] matrix (one attention head) is then
orthogonalised on its own and scaled with (h, C).

Batching: in one step() every matrix with the same shape (rows, cols), dtype, device and
Newton-Schulz settings is stacked, across parameters and param groups, into one
[N, rows, cols] tensor and orthogonalised by a single batched newton_schulz call (on CPU:
one call per cache-sized run of matrices, see buffers.batch_chunk). Each matrix is
normalised on its own, so this equals per-matrix processing.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import Tensor

from parallel.comm import all_gather_into, group_rank, group_size
from optim.muon.buffers import batch_chunk, reusable_buffer
from optim.muon.newton_schulz import muon_scale, newton_schulz
from optim.muon.options import (MuonOptions, check_group, full_matrix, matrix_layout, matrix_split,
                                ns_by_shape_problem)
from optim.muon.ns_method import NSShape, iteration_for
from optim.muon import normuon
from optim.muon.update import MomentumSetting, apply_update, gate_for, momentum, phase, update_factors
from optim.muon.newton_schulz_tp import newton_schulz_sharded


# ----------------------------------------------------------------------------- stacks
#
# Muon orthogonalises every same-shaped matrix of a step together, as one [N, rows, cols] stack.
# Around that batched Newton-Schulz, StackWork runs the two elementwise phases of
# optim/muon/update.py on the stack's items: the momentum into their parts of the stack, and the
# update from their parts of the result, each eagerly or compiled, with the step's on-device gate.


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


class StackWork:
    """The step's elementwise phases on a stack's items: momentum into the Newton-Schulz stack,
    and the weight decay and update after it (optim/muon/update.py), eagerly or, with
    `compiled`, as torch.compile'd kernels (`combo`: inductor's combo kernels); `cautious`:
    cautious weight decay; `graphs`: the stacks' Newton-Schulz replayed as CUDA graphs."""

    def __init__(self, gate: StepGate | None, compiled: bool = False, combo: bool = False, cautious: bool = False,
                 graphs: bool = False) -> None:
        self.gate = gate
        self.compiled, self.combo, self.cautious, self.graphs = compiled, combo, cautious, graphs

    @property
    def keep(self) -> Tensor | None:
        """What Newton-Schulz gates its result with (None: no gate)."""
        return None if self.gate is None else self.gate.keep

    def momentum_into(self, items: list[StackItem], stack: Tensor) -> None:
        """Every item's momentum step, its Newton-Schulz input written into its part of `stack`
        (a stack's items share one momentum setting: optim/muon/optimizer.py stacks by it)."""
        setting = MomentumSetting.of(items[0].group)
        assert all(MomentumSetting.of(it.group) == setting for it in items), "one momentum setting a stack"
        step = phase(momentum, self.compiled, self.combo)
        step([it.buf for it in items], [it.grad for it in items], stack, setting,
             gate_for(self.keep, self.compiled, stack.device))

    def apply_updates(self, items: list[StackItem], ortho: Tensor, rows: int, cols: int) -> None:
        """The update on every item, with its matrices of `ortho` (scaled for the rows x cols
        matrix that was orthogonalised). A skipped step's matrices are zero already; the gate
        keeps the decay off too."""
        updates = stack_views(items, ortho)
        step = phase(apply_update, self.compiled, self.combo)
        # By param group, not by the values: the lists (and so the compiled variants) stay
        # the same from step to step whatever the schedule does to lr.
        by_group: dict[int, list[int]] = {}
        for i, it in enumerate(items):
            by_group.setdefault(id(it.group), []).append(i)
        for idx in by_group.values():
            group = items[idx[0]].group
            decay, alpha = update_factors(group["lr"], group["weight_decay"], muon_scale(rows, cols, group["adjust_lr"]),
                                          self.keep, items[idx[0]].param)
            step([items[i].param for i in idx], [updates[i] for i in idx], decay, alpha, self.cautious)


def tp_gather_dim(param: Tensor, group: dict[str, Any]) -> int | None:
    """The matrix dimension (0: rows, 1: cols) along which this parameter is a TP shard that
    Newton-Schulz must see whole, or None when the local matrices are already complete.

    Per-head matrices of a row-split (column-parallel) projection are complete on each
    rank, since TP splits the rows by whole heads.
    """
    split = matrix_split(param)
    if split is None or group_size(group.get("tp_group")) == 1:
        return None
    if split == 0 and group["split_rows"] is not None:
        return None
    return split


def ns_shape(param: Tensor, group: dict[str, Any]) -> tuple[int, NSShape]:
    """(k, shape): this parameter gives k matrices of `shape` to Newton-Schulz, as step()
    orthogonalises them (split into heads, TP shards gathered whole or iterated as shards)."""
    k, rows, cols = matrix_layout(param.shape, group["split_rows"])
    return k, _ns_view(rows, cols, tp_gather_dim(param, group), group)


def _ns_view(rows: int, cols: int, split: int | None, group: dict[str, Any]) -> NSShape:
    """The shape Newton-Schulz sees of a local rows x cols matrix that is a TP shard split
    along `split` (None: whole): the gathered matrix under tp_mode=gather, the shard itself
    under tp_mode=gram."""
    if split is not None and group["tp_mode"] == "gram":
        return NSShape(rows, cols, split)
    return NSShape(*full_matrix(rows, cols, split, group_size(group["tp_group"])))


class Muon(torch.optim.Optimizer):
    """Muon for 2-D and 3-D (expert-stacked) weight matrices; see the module docstring.

    Args:
        params: tensors or param groups. A group may also set any option of MuonOptions' first
            block and `split_rows` (int or None; per-head orthogonalisation of [R, C] matrices).
        lr: learning rate; weight decay uses it unadjusted, the update uses lr * scale.
        weight_decay: decoupled weight decay.
        options: everything else (optim/muon/options.py's MuonOptions, what each option means);
            `overrides` replace some of its fields (Muon(params, ns_dtype="fp32")).
        cautious_wd: cautious weight decay (optim.cautious_wd, shared with AdamW).
        compile_updates: the step's elementwise phases compiled into fused kernels (for GPUs:
            trainer.compile there).

    Like torch's fused optimizers, `step` honours a `found_inf` attribute (a 0-d float tensor
    on the parameters' device; OptimizerSet.step sets it): where it is 1 the step leaves
    parameters and momentum unchanged, decided on the device with no host sync.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 3e-3,
        weight_decay: float = 0.0,
        options: MuonOptions | None = None,
        cautious_wd: bool = False,
        compile_updates: bool = False,
        **overrides: Any,
    ) -> None:
        self.options = (options or MuonOptions()).with_overrides(overrides)
        self.cautious_wd, self.compile_updates = cautious_wd, compile_updates
        defaults = dict(lr=lr, weight_decay=weight_decay, **self.options.group_defaults())
        # Fail on the defaults themselves even when every group overrides them.
        check_group({**defaults, "params": []})
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        check_group(self.param_groups[-1])

    def ns_shapes(self) -> Counter[NSShape]:
        """How many matrices of each shape a step of every parameter orthogonalises."""
        counts: Counter[NSShape] = Counter()
        for group in self.param_groups:
            for p in group["params"]:
                k, shape = ns_shape(p, group)
                counts[shape] += k
        return counts

    def set_ns_by_shape(self, by_shape: Mapping[str, str]) -> None:
        """Every group's ns_by_shape (what optim/muon/ns_choice.py chose), checked."""
        for group in self.param_groups:
            problem = ns_by_shape_problem(group["ns_method"], by_shape)
            if problem is not None:
                raise ValueError(problem)
            group["ns_by_shape"] = dict(by_shape)

    @torch.no_grad()
    def step(
        self, closure: Callable[[], float] | None = None, only: Iterable[Tensor] | None = None
    ) -> float | None:
        """One Muon step of every parameter with a gradient, or of those in `only` (a
        distributed optimizer steps its matrices in buckets so that each bucket's parameter
        all-gather can start while the next bucket is orthogonalised)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        chosen = None if only is None else {id(p) for p in only}

        # Stack key: everything the Newton-Schulz result depends on besides the data.
        stacks: dict[tuple, list[StackItem]] = {}
        tp_stacks: dict[tuple, list[StackItem]] = {}  # TP shards that need the full matrix
        for group in self.param_groups:
            # Per (rows, cols, TP split): the settings with the iteration the group's method
            # resolves to for that shape, worked out once per shape, not per matrix.
            settings: dict[tuple[int, int, int | None], _NS] = {}
            beta2 = group["normuon_beta2"] if group["normuon"] else None
            for p in group["params"]:
                if p.grad is None or (chosen is not None and id(p) not in chosen):
                    continue
                if p.grad.is_sparse:
                    raise ValueError("optim.muon: sparse gradients are not supported")
                state = self.state[p]
                buf = state.get("momentum_buffer")
                if buf is None:
                    buf = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["momentum_buffer"] = buf
                elif not buf.is_contiguous():  # e.g. loaded from a checkpoint; updated in place
                    buf = state["momentum_buffer"] = buf.contiguous()
                k, rows, cols = matrix_layout(p.shape, group["split_rows"])
                if beta2 is not None and "normuon_v" not in state:
                    state["normuon_v"] = torch.zeros(self._normuon_shape(p, group), device=p.device)
                elif beta2 is not None and state["normuon_v"].dtype != torch.float32:
                    # torch's load_state_dict casts state to the parameter's dtype; v stays fp32
                    state["normuon_v"] = state["normuon_v"].float()
                item = StackItem(p, p.grad, buf, group, k, rows, cols, state.get("normuon_v") if beta2 is not None else None)
                split = tp_gather_dim(p, group)
                ns = settings.get((rows, cols, split))
                if ns is None:
                    ns = settings[rows, cols, split] = _NS.of(group, _ns_view(rows, cols, split, group))
                if split is not None:
                    key = (rows, cols, split, id(group["tp_group"]), group["tp_mode"], p.dtype, p.device, ns, beta2,
                           MomentumSetting.of(group))
                    tp_stacks.setdefault(key, []).append(item)
                    continue
                key = (rows, cols, p.dtype, p.device, ns, beta2, MomentumSetting.of(group))
                stacks.setdefault(key, []).append(item)

        gate = None if getattr(self, "found_inf", None) is None else StepGate.of(self.found_inf)
        work = StackWork(gate, self.compile_updates, self.options.combo_kernels, self.cautious_wd, self.options.cuda_graphs)
        for (rows, cols, dtype, device, ns, beta2, _), items in stacks.items():
            _step_stack(items, rows, cols, dtype, device, ns, beta2, work)
        for (rows, cols, split, _, _, dtype, device, ns, beta2, _), items in tp_stacks.items():
            _step_tp_stack(items, split, ns, beta2, work)
        return loss

    # NorMuon's v has one entry per row (or column) of each matrix. Checkpoints hold it in its
    # parameter's shape (broadcast along the averaged dimension) so that the checkpoint code
    # saves, cuts and reshards it exactly like the momentum; it is compacted again on load.

    def _group_of(self, p: Tensor) -> dict[str, Any]:
        return next(g for g in self.param_groups if any(q is p for q in g["params"]))

    def _normuon_shape(self, p: Tensor, group: dict[str, Any]) -> tuple[int, int, int]:
        k, rows, cols = matrix_layout(p.shape, group["split_rows"])
        full_rows, full_cols = full_matrix(rows, cols, tp_gather_dim(p, group), group_size(group.get("tp_group")))
        return normuon.state_shape(k, rows, cols, full_rows, full_cols)

    def export_state(self, p: Tensor, state: dict[str, Any]) -> dict[str, Tensor]:
        """`p`'s state as checkpoints hold it: every non-scalar tensor in p's shape."""
        out = {key: value for key, value in state.items() if torch.is_tensor(value)}
        if "normuon_v" in out:
            k, rows, cols = matrix_layout(p.shape, self._group_of(p)["split_rows"])
            out["normuon_v"] = out["normuon_v"].expand(k, rows, cols).reshape(p.shape)
        return out

    def import_state(self, p: Tensor, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """The inverse of export_state (state already on p's device)."""
        if "normuon_v" in state:
            group = self._group_of(p)
            k, rows, cols = matrix_layout(p.shape, group["split_rows"])
            shape = self._normuon_shape(p, group)
            state["normuon_v"] = state["normuon_v"].reshape(k, rows, cols)[:, : shape[1], : shape[2]].float().contiguous()
        return state


@dataclass(frozen=True)
class _NS:
    """The Newton-Schulz settings of a stack."""

    steps: int
    coefficients: str
    dtype: torch.dtype
    eps: float
    iteration: str  # "standard" or "gram": the group's ns_method resolved for the stack's shape

    @staticmethod
    def of(group: dict[str, Any], shape: NSShape) -> "_NS":
        steps = group["ns_steps"]
        iteration = iteration_for(group["ns_method"], shape, steps, group.get("ns_by_shape"))
        return _NS(steps, group["coefficients"], group["ns_dtype"], group["eps"], iteration)


def _normuon(items: list[StackItem], ortho: Tensor, beta2: float | None, full_rows: int, full_cols: int,
             work: "StackWork", split: int | None = None) -> None:
    """NorMuon on a stack of orthogonalised updates (no-op without it), every item's v at once."""
    if beta2 is None:
        return
    if len(items) == 1:
        v = items[0].normuon_v
    else:
        v = torch.cat([it.normuon_v for it in items])
    group = items[0].group["tp_group"] if split is not None else None
    normuon.normalise(ortho, v, beta2, full_rows, full_cols, split, group, work.keep)
    if len(items) > 1:
        torch._foreach_copy_([it.normuon_v for it in items], list(v.split([it.k for it in items])))


def _step_tp_stack(items: list[StackItem], split: int, ns: _NS, beta2: float | None, work: StackWork) -> None:
    """Same-shape TP shards, orthogonalised as the full matrices they are parts of.

    tp_mode "gather": one TP all-gather of the whole stack along the split dimension,
    Newton-Schulz on the full matrices (repeated on every TP rank), keep the own shard.
    tp_mode "gram": Newton-Schulz on the shards, all-reducing the small Gram matrix each
    iteration (newton_schulz_sharded). Either way the scale uses the full matrix shape.
    """
    first = items[0]
    group = first.group["tp_group"]
    inputs = torch.empty(sum(it.k for it in items), first.rows, first.cols,
                         dtype=first.param.dtype, device=first.param.device)
    work.momentum_into(items, inputs)
    keep = work.keep
    tp = group_size(group)
    rows_full, cols_full = full_matrix(first.rows, first.cols, split, tp)
    if first.group["tp_mode"] == "gram":
        own = newton_schulz_sharded(inputs, split, group, ns.steps, ns.coefficients, ns.dtype, ns.eps, keep=keep,
                                    iteration=ns.iteration)
    else:
        gathered = inputs.new_empty((tp, *inputs.shape))
        all_gather_into(gathered, inputs, group)
        full = torch.cat(gathered.unbind(0), dim=1 + split)  # [N, rows, cols]: full matrices
        ortho = newton_schulz(full, ns.steps, ns.coefficients, ns.dtype, ns.eps, out_dtype=ns.dtype, keep=keep,
                              iteration=ns.iteration)
        own = ortho.chunk(tp, dim=1 + split)[group_rank(group)]
    _normuon(items, own, beta2, rows_full, cols_full, work, split)
    work.apply_updates(items, own, rows_full, cols_full)


def _step_stack(
    items: list[StackItem], rows: int, cols: int, dtype: torch.dtype, device: torch.device, ns: _NS,
    beta2: float | None, work: StackWork,
) -> None:
    """All rows x cols matrices of one step and setting: momentum into [N, rows, cols]
    stacks, batched Newton-Schulz, the parameter updates.

    Off CPU all N matrices form one stack and go through one newton_schulz call. On CPU
    the items are cut into runs of about batch_chunk(...) matrices, each carried from
    momentum to parameter update while its data is still in cache (see batch_chunk).
    """
    limit = batch_chunk(min(rows, cols), max(rows, cols), ns.dtype, device)
    run: list[StackItem] = []
    for it in items:
        run.append(it)
        if limit is not None and sum(r.k for r in run) >= limit:
            _step_run(run, rows, cols, dtype, device, ns, beta2, work)
            run = []
    if run:
        _step_run(run, rows, cols, dtype, device, ns, beta2, work)


def _step_run(
    items: list[StackItem], rows: int, cols: int, dtype: torch.dtype, device: torch.device, ns: _NS,
    beta2: float | None, work: StackWork,
) -> None:
    """Momentum into one [N, rows, cols] stack, one batched Newton-Schulz, the updates."""
    total = sum(it.k for it in items)
    # In the parameters' dtype: the Newton-Schulz input, then (in place) its output, so that
    # the eager update adds a same-dtype tensor (a bf16 one would be converted in a temporary).
    # With CUDA graphs the stack stays at one address from step to step, so that its
    # recorded Newton-Schulz (which reads and writes it in place) can be replayed.
    compiled, graphs = work.compiled, work.graphs
    stack = reusable_buffer("muon.stack", total, rows, cols, dtype, device, persistent=graphs)
    work.momentum_into(items, stack)
    # The fused update of compile_updates reads a bf16 O in the same kernel as an fp32 one, so
    # there the last iterate stays in the Newton-Schulz dtype: its last GEMM writes it once,
    # instead of into a temporary then cast into the stack (a pass over the whole stack), and
    # the update reads half the bytes. The same values: a bf16 O widens to fp32 exactly.
    out = stack
    if compiled and ns.dtype != dtype:
        out = reusable_buffer("muon.ortho", total, rows, cols, ns.dtype, device, persistent=graphs)
    ortho = newton_schulz(stack, ns.steps, ns.coefficients, ns.dtype, ns.eps, out=out, keep=work.keep,
                          graph=graphs, iteration=ns.iteration, fused_normalise=compiled and not graphs)
    _normuon(items, ortho, beta2, rows, cols, work)
    work.apply_updates(items, ortho, rows, cols)
