"""Distributed Muon + AdamW with ZeRO-1 over data parallelism.

Per step, for the DP group:
  1. reduce-scatter the flat gradient buffer: each rank receives the averaged gradients of
     its segment (optim/zero_plan.py lays the segments out);
  2. clip with the global gradient norm (segment norms all-reduced over DP, and over TP for
     TP-sharded parameters);
  3. each rank steps what it owns: whole Muon matrices (TP-aware, see optim/muon/optimizer.py) and its
     flat pieces of the AdamW parameters, with optimizer state for those only;
  4. all-gather the updated segments back into every rank's parameters.

DP traffic is one reduce-scatter and one all-gather of the flat buffer, the same as AdamW
ZeRO-1, and each Muon matrix is orthogonalised by exactly one DP rank.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from parallel.comm import all_gather_async, all_gather_object, all_reduce, group_size, reduce_scatter_into
from model.config import ModelConfig
from optim.adamw import build_adamw
from optim.config import OptimConfig
from optim.grad_ops import sum_of_squares
from optim.muon.optimizer import Muon, tp_gather_dim
from optim.muon.options import full_matrix, matrix_layout
from optim.optimizer_set import OptimizerSet, OwnedPiece, skip_if
from optim.routing import muon_split_rows, route_parameters
from optim.zero_plan import ParamSpec, Slice, ZeroPlan, build_plan
from parallel.mesh import Mesh

log = logging.getLogger("optim")


def newton_schulz_shapes(
    param: torch.Tensor, split_rows: int | None, tp_group: Any, tp_mode: str
) -> tuple[tuple[int, int], ...]:
    """The (rows, cols) of every matrix whose Newton-Schulz this parameter's owner runs.

    With tp_mode=gather a TP-sharded matrix is gathered and orthogonalised whole on every
    TP rank, so its owner pays for the full matrix: the plan must balance that cost, not the
    shard's. With tp_mode=gram each rank iterates on its shard (plus a small Gram matrix), so
    the shard's shape is the closer measure.
    """
    k, rows, cols = matrix_layout(param.shape, split_rows)
    split = tp_gather_dim(param, {"tp_group": tp_group, "split_rows": split_rows})
    if tp_mode == "gather":
        rows, cols = full_matrix(rows, cols, split, group_size(tp_group))
    return ((rows, cols),) * k


class _Domain:
    """Parameters that every rank of one data-parallel group holds alike, and their ZeRO-1
    layout over that group: one flat buffer cut into a segment per rank, reduce-scattered
    (gradients) and all-gathered (parameters) in `gather_buckets` buckets.

    Without expert parallelism there is one domain, every parameter over the DP group. Under
    EP the experts a rank holds are not those of the other ranks of its EP group: they form a
    second domain over the ranks that hold the same experts (`edp`)."""

    def __init__(self, specs: list[ParamSpec], group: Any, size: int, rank: int, buckets: int,
                 device: torch.device) -> None:
        self.group, self.size, self.rank = group, size, rank
        self.plan: ZeroPlan = build_plan(specs, size)
        self.slices: list[Slice] = sorted(
            (s for share in self.plan.ranks for s in share.muon + share.adamw), key=lambda s: s.offset
        )
        self.mine = self.plan.ranks[rank]
        self.segment_start = rank * self.plan.segment
        self.segment_grad = torch.zeros(self.plan.segment, device=device)
        self.flat = torch.zeros(self.plan.total, device=device)  # gradients, then parameters, packed
        # The parameter all-gather in buckets: (lo, hi) within a segment, the same on every
        # rank; each bucket gathers into its own [size * (hi - lo)] buffer.
        n_buckets = max(1, min(buckets, self.plan.segment))
        cuts = [round(b * self.plan.segment / n_buckets) for b in range(n_buckets + 1)]
        self.buckets = list(zip(cuts[:-1], cuts[1:]))
        # A send and a receive buffer per bucket: an asynchronous all-gather reads its input
        # until it completes, so buckets in flight cannot share one.
        self.pieces = [torch.zeros(hi - lo, device=device) for lo, hi in self.buckets]
        # The receive buffers reuse the gradient buffer, which is free once reduce-scattered.
        self.gathered = [self.flat[size * lo : size * hi] for lo, hi in self.buckets]
        self.owned: list[tuple[torch.Tensor, Slice]] = []  # (tensor stepped here, its slice)
        # Each owned matrix is stepped before the first bucket it touches is gathered.
        self.muon_by_bucket: list[list[torch.Tensor]] = [[] for _ in self.buckets]

    def own_matrix(self, p: torch.Tensor, s: Slice) -> None:
        self.owned.append((p, s))
        local = s.offset - self.segment_start
        first = next(b for b, (lo, hi) in enumerate(self.buckets) if local < hi)
        self.muon_by_bucket[first].append(p)

    def _slices_in(self, lo: int, hi: int) -> list[Slice]:
        """The slices overlapping flat-buffer offsets [lo, hi)."""
        return [s for s in self.slices if s.offset < hi and s.offset + s.length > lo]

    def matching_views(
        self, tensors: list[torch.Tensor], flat: torch.Tensor, lo: int, hi: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The flat buffer's elements [lo, hi) as matching pieces of `tensors` (one per
        parameter of the model) and of `flat` (which holds elements lo..hi), for one for-each
        copy either way instead of one copy per parameter."""
        params, flats = [], []
        for s in self._slices_in(lo, hi):
            a, b = max(lo, s.offset), min(hi, s.offset + s.length)
            params.append(tensors[s.param].reshape(-1)[s.start + a - s.offset : s.start + b - s.offset])
            flats.append(flat[a - lo : b - lo])
        return params, flats

    def pack(self, tensors: list[torch.Tensor], lo: int, hi: int, out: torch.Tensor) -> torch.Tensor:
        """out (fp32, hi - lo elements) <- the flat buffer's elements [lo, hi) taken from
        `tensors` (one per parameter), zeros in the padding."""
        out.zero_()
        src, dst = self.matching_views(tensors, out, lo, hi)
        if dst:
            torch._foreach_copy_(dst, src)
        return out

    def reduce_grads(self, grads: list[torch.Tensor], divisor: int) -> None:
        """Reduce-scatter the gradients (summed over the group, divided by `divisor`) and point
        each owned tensor's .grad at its part of this rank's segment."""
        flat = self.pack(grads, 0, self.plan.total, self.flat)
        reduce_scatter_into(self.segment_grad, flat, self.group)
        self.segment_grad.div_(divisor)
        for tensor, s in self.owned:
            local = s.offset - self.segment_start
            tensor.grad = self.segment_grad[local : local + s.length].view(tensor.shape)

    def step_and_gather(self, muon: Optional[Muon], params: list[torch.Tensor]) -> list[tuple]:
        """Step this rank's Muon matrices bucket by bucket, launching each bucket's all-gather
        as soon as its matrices are updated. Returns the gathers in flight."""
        pending = []
        segment = self.plan.segment
        for (lo, hi), matrices, piece, gathered in zip(self.buckets, self.muon_by_bucket, self.pieces, self.gathered):
            if muon is not None and matrices:
                muon.step(only=matrices)
            self.pack(params, self.segment_start + lo, self.segment_start + hi, piece)
            pending.append((lo, hi, segment, gathered, all_gather_async(gathered, piece, self.group)))
        return pending

    def unpack(self, pending: list[tuple], targets: list[torch.Tensor]) -> None:
        """Wait for the gathers and copy every rank's updated segments into the parameters."""
        for lo, hi, segment, gathered, handle in pending:
            handle.wait()
            dst, src = [], []
            for r in range(self.size):
                params, pieces = self.matching_views(targets, gathered[r * (hi - lo) : (r + 1) * (hi - lo)],
                                                     r * segment + lo, r * segment + hi)
                dst += params
                src += pieces
            if dst:
                torch._foreach_copy_(dst, src)


class ZeroOptimizer(OptimizerSet):
    """ZeRO-1 Muon + AdamW (optim=muon) or ZeRO-1 AdamW (optim=adamw) over the DP group, and,
    under expert parallelism, over the experts' own data-parallel group for the experts."""

    def __init__(self, model: torch.nn.Module, cfg: OptimConfig, model_cfg: ModelConfig, mesh: Mesh,
                 compile_updates: bool = False) -> None:
        self.mesh = mesh
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        routes = {r.name: r for r in route_parameters(model, cfg.name)}
        self.kinds = [routes[n].kind for n, _ in named]

        def split_rows(kind: str) -> int | None:
            return muon_split_rows(kind, cfg.muon.split_heads, model_cfg.head_dim)

        specs = []
        for i, (name, p) in enumerate(named):
            is_muon = routes[name].optimizer == "muon"
            matrices = (
                newton_schulz_shapes(p, split_rows(self.kinds[i]), mesh.tp_group, cfg.muon.tp_mode)
                if is_muon else ()
            )
            specs.append(ParamSpec(index=i, numel=p.numel(), muon_matrices=matrices))
        device = self.params[0].device
        experts = [getattr(p, "ep_split_dim", None) is not None for p in self.params]
        self.domains = [_Domain([s for s, e in zip(specs, experts) if not e], mesh.dp_group, mesh.dp, mesh.dp_rank,
                                cfg.gather_buckets, device)]
        if any(experts):  # EP: each rank's experts over the ranks that hold the same ones
            edp = mesh.dp // mesh.ep
            self.domains.append(_Domain([s for s, e in zip(specs, experts) if e], mesh.edp_group, edp,
                                        mesh.dp_rank // mesh.ep, cfg.gather_buckets, device))
        self.plan = self.domains[0].plan

        optimizers: dict[str, torch.optim.Optimizer] = {}
        muon_groups: dict[str, list[torch.Tensor]] = {}
        adamw_groups: dict[str, list[torch.Tensor]] = {}
        for domain in self.domains:
            for s in domain.mine.muon:
                p = self.params[s.param]
                muon_groups.setdefault(self.kinds[s.param], []).append(p)
                domain.own_matrix(p, s)
            for s in domain.mine.adamw:
                # A detached view into the parameter's storage: AdamW updates it in place.
                piece = self.params[s.param].detach().view(-1)[s.start : s.start + s.length]
                adamw_groups.setdefault(self.kinds[s.param], []).append(piece)
                domain.owned.append((piece, s))

        if muon_groups:
            groups = [{**g, "tp_group": mesh.tp_group} for g in cfg.param_groups(muon_groups, True, model_cfg.head_dim)]
            optimizers["muon"] = Muon(groups, lr=cfg.lr, options=cfg.muon, cautious_wd=cfg.cautious_wd,
                                      compile_updates=compile_updates)
        if adamw_groups:
            optimizers["adamw"] = build_adamw(cfg.param_groups(adamw_groups, False, model_cfg.head_dim), cfg)
        super().__init__(optimizers)
        self._owned = [entry for domain in self.domains for entry in domain.owned]
        # Which owned slices belong to TP-sharded parameters (their squares sum over TP).
        self._sharded = [getattr(self.params[s.param], "tp_split_dim", None) is not None for _, s in self._owned]
        if mesh.is_main:
            for domain in self.domains:
                log.info(domain.plan.describe())

    @torch.no_grad()
    def prepare_grads(self, max_norm: float) -> torch.Tensor:
        """Reduce-scatter the gradients over DP (the experts' over their own DP group), then
        clip them. Returns the global norm."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        for p in self.params:
            p.grad = None  # an owned Muon matrix gets its reduced part below
        for domain in self.domains:
            # Over the global batch: an expert's gradient holds its EP group's tokens already,
            # so the sum over its group covers every DP rank's tokens once.
            domain.reduce_grads(grads, self.mesh.dp)
        # Every rank owns distinct elements (an expert domain's ranks hold distinct experts
        # across EP and distinct slices within edp), so one sum over DP counts each once.
        device = self.params[0].device
        sq_sharded = sum_of_squares([t.grad for (t, _), f in zip(self._owned, self._sharded) if f], device)
        sq_replicated = sum_of_squares([t.grad for (t, _), f in zip(self._owned, self._sharded) if not f], device)
        both = all_reduce(torch.stack([sq_sharded, sq_replicated]), self.mesh.dp_group)
        # Under a pipeline the other stages' squares join before the norm: one clip, one skip.
        norm = all_reduce(all_reduce(both[0:1], self.mesh.tp_group)[0] + both[1], self.mesh.pp_group).sqrt()
        if max_norm > 0:
            scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            for domain in self.domains:
                domain.segment_grad.mul_(scale)
        return norm

    @torch.no_grad()
    def step(self, found_inf: Optional[torch.Tensor] = None) -> None:
        """Step what this rank owns, then all-gather the updated segments.

        With optim.gather_buckets = B > 1 the segment is cut into B buckets (the same cuts on
        every rank): AdamW steps first, then the Muon matrices bucket by bucket, and each
        bucket's all-gather is launched asynchronously as soon as every matrix touching it is
        updated, so its transfer overlaps the Newton-Schulz of the following buckets.

        `found_inf` skips the step on the device (see OptimizerSet.step); every rank holds the
        same flag (the norm is global), so the gathered parameters agree either way.
        """
        muon = self.optimizers.get("muon")
        with skip_if(self.optimizers.values(), found_inf):
            if "adamw" in self.optimizers:
                self.optimizers["adamw"].step()
            pending = [domain.step_and_gather(muon, self.params) for domain in self.domains]
        # view, not reshape: a parameter that could only be copied would silently keep its values.
        targets = [p.data.view(-1) for p in self.params]
        for domain, gathers in zip(self.domains, pending):
            domain.unpack(gathers, targets)

    def owned_pieces(self, model: torch.nn.Module) -> list[OwnedPiece]:
        """Whole Muon matrices and flat AdamW pieces, as the ZeRO-1 plan gave this rank."""
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        return [OwnedPiece(names[s.param], tensor, s.start, "muon" if tensor is self.params[s.param] else "adamw")
                for tensor, s in self._owned]

    def local_state(self, model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """Per-parameter state, whole over DP (the experts over their own DP group): each rank
        contributes what it owns (zeros elsewhere) and one sum over the group assembles it.
        Collective."""
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        out = {}
        for domain in self.domains:
            slots: dict[str, dict[str, torch.Tensor]] = {}
            for tensor, s in domain.owned:
                for opt_key, opt in self.optimizers.items():
                    if not opt.state.get(tensor):
                        continue
                    p, name = self.params[s.param], names[s.param]
                    entry = slots.setdefault(name, {})
                    for key, value in self.checkpoint_state(opt_key, tensor).items():
                        if key == "step":
                            entry["step"] = value.detach().clone().float()
                            continue
                        full = entry.setdefault(key, torch.zeros(p.numel(), device=p.device))
                        full[s.start : s.start + s.length] = value.reshape(-1)
            # Agree on which entries exist, then assemble them with one all-reduce per key.
            wanted = sorted((n, k) for n, e in slots.items() for k in e)
            present = all_gather_object(wanted, domain.group, "checkpoint")
            for name, key in sorted({item for items in present for item in items}):
                p = self.params[names.index(name)]
                value = slots.get(name, {}).get(key)
                if value is None:
                    value = torch.zeros((), device=p.device) if key == "step" else torch.zeros(p.numel(), device=p.device)
                op = torch.distributed.ReduceOp.MAX if key == "step" else torch.distributed.ReduceOp.SUM
                value = all_reduce(value, domain.group, op=op, label="checkpoint")
                out.setdefault(name, (p, {}))[1][key] = value if key == "step" else value.view(p.shape)
        return out

    def load_local_state(self, model: torch.nn.Module, local: dict[str, dict[str, torch.Tensor]]) -> None:
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        for tensor, s in self._owned:
            entry = local.get(names[s.param])
            if not entry:
                continue
            self.install_checkpoint_state(
                "muon" if tensor is self.params[s.param] else "adamw", tensor,
                {k: v if k == "step" else v.reshape(-1)[s.start : s.start + s.length].view(tensor.shape)
                 for k, v in entry.items()})

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for tensor, _ in self._owned:
            tensor.grad = None
