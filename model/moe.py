"""Mixture-of-Experts feed-forward layer (DeepSeek-V3 style).

- Router scores in fp32, by sigmoid (default) or softmax. The top-k experts are *selected* on
  score + bias, where the bias is a per-expert buffer moved after each step toward balanced
  load (auxiliary-loss-free balancing); the *gate values* use the scores without the bias,
  normalised over the top-k for sigmoid, times a routed scaling factor.
- Shared experts are a dense SwiGLU applied to every token and added.
- Experts are stored as 3-D weights [E, out, in], so Muon orthogonalises each expert's
  matrix on its own in one batched call.
- Dispatch is dropless: (token, expert) pairs are sorted by expert and each projection is
  one grouped matmul over the contiguous per-expert blocks, with no loop over tokens.
- Under expert parallelism (parallel.ep > 1) each rank holds n_experts / ep whole experts: the
  sorted pairs go to their experts' ranks and back through parallel/expert_parallel.py.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from parallel.comm import Group, all_reduce, group_rank, group_size
from parallel.expert_parallel import combine, dispatch
from parallel.tp_ops import copy_to_tp, reduce_from_tp, sum_over
from model.activation_checkpoint import recomputing
from model.config import ModelConfig


def grouped_mm_usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch._grouped_mm runs for these operands on this device.

    On CPU it takes fp32, and bf16 when rows are 16-byte aligned; on CUDA it needs bf16 on
    compute capability 9.0 or newer. Elsewhere the per-expert loop below computes the same.
    """
    if not hasattr(torch, "_grouped_mm") or x.dtype != w.dtype:
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    if x.dtype != torch.bfloat16 and torch.compiler.is_compiling():
        return False  # the eager CPU kernel takes fp32, but its compile-time (meta) rule does not
    aligned = all(d * x.element_size() % 16 == 0 for d in (x.shape[-1], w.shape[-1]))
    return x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and aligned)


def grouped_matmul(
    x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, host_ends: Optional[list[int]] = None
) -> torch.Tensor:
    """Rows ends[e-1]:ends[e] of x [N, in] times w[e] [in, out], for every expert e.

    Without torch._grouped_mm the per-expert loop needs the boundaries on the host: a host
    sync, made once per layer when the caller passes them as `host_ends`."""
    if grouped_mm_usable(x, w):
        return torch._grouped_mm(x, w, offs=ends if ends.dtype == torch.int32 else ends.to(torch.int32))
    out = x.new_empty(x.shape[0], w.shape[-1])
    start = 0
    for e, end in enumerate(ends.tolist() if host_ends is None else host_ends):
        out[start:end] = x[start:end] @ w[e]
        start = end
    return out


class Experts(nn.Module):
    """E SwiGLU experts as stacked [E, out, in] weights (nn.Linear's layout, per expert)."""

    def __init__(self, n_experts: int, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.w_up = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.w_down = nn.Parameter(torch.empty(n_experts, d_model, hidden))
        # Set by model/parallelize.py under EP x TP: the experts are whole on every TP rank but
        # each TP rank runs a different part of the tokens, so their gradients are summed
        # over TP (copy_to_tp on the weights).
        self.grad_group: Group = None

    def forward(self, x_sorted: torch.Tensor, ends: torch.Tensor, host_ends: Optional[list[int]] = None) -> torch.Tensor:
        """`host_ends`: the boundaries `ends` already on the host (EP's dispatch has them)."""
        dtype = torch.get_autocast_dtype(x_sorted.device.type) if torch.is_autocast_enabled(x_sorted.device.type) else x_sorted.dtype
        x = x_sorted.to(dtype)
        w_gate, w_up, w_down = (copy_to_tp(w, self.grad_group).to(dtype).transpose(-2, -1)
                                for w in (self.w_gate, self.w_up, self.w_down))
        # The sync-free path is torch._grouped_mm (bf16 on compute capability 9.0+ on CUDA);
        # the fallback reads the expert boundaries to the host once for all three products.
        if grouped_mm_usable(x, w_gate):
            host_ends = None
        elif host_ends is None:
            host_ends = ends.tolist()
        if host_ends is None:
            ends = ends.to(torch.int32)  # torch._grouped_mm's offsets, converted once for the three
        gate = grouped_matmul(x, w_gate, ends, host_ends)
        up = grouped_matmul(x, w_up, ends, host_ends)
        return grouped_matmul(F.silu(gate) * up, w_down, ends, host_ends)


class SharedExperts(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w_gate = nn.Linear(d_model, hidden, bias=False)
        self.w_up = nn.Linear(d_model, hidden, bias=False)
        self.w_down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_experts = cfg.n_experts
        self.top_k = cfg.top_k
        self.score_func = cfg.score_func
        self.routed_scaling = cfg.routed_scaling
        self.aux_loss_coef = cfg.aux_loss_coef
        hidden = cfg.expert_hidden or cfg.ffn_hidden
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = Experts(cfg.n_experts, cfg.d_model, hidden)
        self.shared = SharedExperts(cfg.d_model, hidden * cfg.n_shared_experts) if cfg.n_shared_experts else None
        # Selection bias (not trained by gradients) and this step's routed-token counts.
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts))
        self.register_buffer("load", torch.zeros(cfg.n_experts), persistent=False)
        self.register_buffer("entropy_sum", torch.zeros(()), persistent=False)
        self.aux_loss: Optional[torch.Tensor] = None
        # Set by model/parallelize.py. tp_group: the experts' hidden units are split over TP
        # (or, under EP, each TP rank sends its part of the tokens). ep_group: the experts are
        # spread over these ranks. dp_group: the ranks of the global batch, over which the
        # auxiliary loss's statistics are summed.
        self.tp_group: Group = None
        self.ep_group: Group = None
        self.dp_group: Group = None
        # Whether the EP path runs (set_ep_group): a plain flag, so that torch.compile's graphs
        # never read the group itself (a traced group outlives the run in them).
        self.expert_parallel = False

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """The buffers' starting values (no bias, nothing routed yet), in place."""
        self.expert_bias.zero_()
        self.load.zero_()
        self.entropy_sum.zero_()

    def route(self, x_flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(expert ids [N, k], gate values [N, k], scores [N, E]) for N tokens, in fp32."""
        # Autocast off: under bf16 autocast F.linear would compute in bf16 even on fp32
        # inputs, and near-tied scores would then pick experts by rounding noise.
        with torch.autocast(device_type=x_flat.device.type, enabled=False):
            logits = F.linear(x_flat.float(), self.router.weight.float())
        scores = logits.sigmoid() if self.score_func == "sigmoid" else logits.softmax(dim=-1)
        _, ids = (scores.detach() + self.expert_bias).topk(self.top_k, dim=-1)
        gates = scores.gather(-1, ids)
        if self.score_func == "sigmoid":
            gates = gates / (gates.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, gates * self.routed_scaling, scores

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        x_flat = x.reshape(-1, dim)
        if not recomputing():  # a checkpoint's rerun leaves the forward's loss (see below)
            self.aux_loss = None
        # The router is replicated: it sees the full activations and every TP rank routes
        # identically. The experts see them through copy_to_tp, and the gates too, since each
        # rank's expert outputs (and so the gates' gradients) are partial sums over TP.
        ids, gates, scores = self.route(x_flat)
        gates = copy_to_tp(gates, self.tp_group)
        x_experts = copy_to_tp(x_flat, self.tp_group)

        # Sort the N*k (token, expert) pairs by expert: each expert's tokens are contiguous.
        # Where each expert's block ends comes from a search in the sorted ids, not from a
        # bincount, whose data-dependent output size costs a host sync on CUDA and a graph
        # break under torch.compile.
        sorted_ids, order = ids.flatten().sort(stable=True)
        token_of = order // self.top_k
        experts = torch.arange(self.n_experts, device=ids.device)
        ends = torch.searchsorted(sorted_ids, experts, right=True)
        counts = torch.diff(ends, prepend=ends.new_zeros(1))
        if self.expert_parallel:
            y = self._experts_over_ep(x_experts, token_of, ends)
        else:
            y = self.experts(x_experts[token_of], ends)
        # Back in (token, slot) order, each token's k expert outputs are weighted by their
        # gates and summed in fp32: a plain reduction (compile fuses it), with no
        # atomics, so the sum does not depend on the order threads add in. `order` is a
        # permutation, so its inverse is one scatter of positions, not a second sort.
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        y = y[inverse].view(batch * seq, self.top_k, -1)
        out = (y.float() * gates.unsqueeze(-1)).sum(dim=1).type_as(x)
        out = reduce_from_tp(out, self.tp_group)
        if self.shared is not None:
            out = out + self.shared(x_experts)

        if self.training:
            aux_loss = self.balance_loss(scores, counts) if self.aux_loss_coef > 0 else None
            # Activation checkpointing reruns this forward in the backward: the rerun rebuilds
            # the aux loss's saved tensors, but the forward counted this batch already.
            if not recomputing():
                self.load += counts.detach().float()
                probs = scores.detach() / scores.detach().sum(-1, keepdim=True)
                self.entropy_sum += -(probs * probs.clamp_min(1e-20).log()).sum(-1).mean()
                self.aux_loss = aux_loss
        return out.view(batch, seq, dim)

    def set_ep_group(self, group: Group) -> None:
        """Spread the experts over `group` (parallelize_moe), or not (None). A group of one runs
        the EP path too: what lab/tools/bench/bench_ep_dispatch.py times."""
        self.ep_group, self.expert_parallel = group, group is not None

    # Outside torch.compile's graphs, whole: its dispatch syncs with the host and breaks the graph
    # anyway, and traced, the EP group would become a graph value that outlives the run.
    @torch.compiler.disable
    def _experts_over_ep(self, x: torch.Tensor, token_of: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """The experts' outputs for the expert-sorted pairs, with the experts spread over the
        EP group: this rank's pairs go to their experts' ranks, which run them, and come back.

        Under TP, whose ranks route the same tokens, each TP rank sends a contiguous 1/tp of
        the sorted pairs and returns zeros for the rest: the layer's all-reduce over TP sums
        the parts. The part's per-expert counts come from clamping `ends`, on the device."""
        pairs = token_of.numel()
        per_rank = -(-pairs // group_size(self.tp_group))
        lo = min(pairs, group_rank(self.tp_group) * per_rank)
        hi = min(pairs, lo + per_rank)
        part_ends = ends.clamp(lo, hi) - lo
        part_counts = torch.diff(part_ends, prepend=part_ends.new_zeros(1))
        x_local, local_ends, handle = dispatch(x[token_of[lo:hi]], part_counts, self.ep_group)
        y = combine(self.experts(x_local, local_ends, handle.local_ends_host), handle)
        return F.pad(y, (0, 0, lo, pairs - hi))

    def balance_loss(self, scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Classic load-balancing loss: E * sum_e (fraction of routed slots to e) * (mean
        normalised score of e); 1 when balanced. Over the global batch: both statistics are
        summed over the data-parallel ranks, the scores' sum differentiably (its backward sums
        the gradient too, which the data-parallel mean then divides back), so every rank
        computes the loss, and the gradient, of one process holding the whole batch."""
        counts = all_reduce(counts.float(), self.dp_group)
        probs = scores / scores.sum(-1, keepdim=True)
        tokens = probs.shape[0] * group_size(self.dp_group)
        mean_probs = sum_over(probs.sum(0), self.dp_group) / tokens
        return self.aux_loss_coef * self.n_experts * (counts / counts.sum() * mean_probs).sum()

    @torch.no_grad()
    def update_bias(self, total_load: torch.Tensor, rate: float | torch.Tensor) -> None:
        """bias_e += rate * sign(mean load - load_e): under-used experts become likelier."""
        self.expert_bias += rate * torch.sign(total_load.mean() - total_load)


def moe_layers(model: nn.Module) -> list[tuple[int, MoE]]:
    """(block index, layer) of every MoE feed-forward layer the model holds (a pipeline stage's
    model holds some blocks, each under its index in the whole model)."""
    return [(int(i), b.mlp) for i, b in model.blocks.named_children() if isinstance(b.mlp, MoE)]


@torch.no_grad()
def balance_experts(
    model: nn.Module, dp_group: Group, rate: float, n_micro_batches: int, found_inf: Optional[torch.Tensor] = None
) -> dict[str, torch.Tensor]:
    """After an optimizer step: move every layer's expert bias toward balanced load, using the
    routed-token counts of the step summed over data-parallel ranks (so every rank keeps the
    same bias), and return the step's MoE metrics as device tensors.

    TP ranks route the same tokens identically, so their counts need no reduction. With
    `found_inf` (1.0 for a step the optimizers skipped on the device) the bias moves by a rate
    of zero on a skipped step, without a host sync.
    """
    layers = moe_layers(model)
    if not layers:
        return {}
    if found_inf is not None:
        rate = rate * (1.0 - found_inf)
    dp = group_size(dp_group)
    # One all-reduce for every layer: [L, E + 1] = the loads, then the entropy sum.
    packed = torch.stack([torch.cat([m.load, m.entropy_sum.view(1)]) for _, m in layers])
    packed = all_reduce(packed, dp_group)
    stats = {}
    for (i, layer), row in zip(layers, packed):
        load, entropy = row[:-1], row[-1] / (dp * max(1, n_micro_batches))
        layer.update_bias(load, rate)
        stats[f"moe/load_imbalance/layer_{i}"] = load.max() / load.mean().clamp_min(1e-9)
        stats[f"moe/router_entropy/layer_{i}"] = entropy
        stats[f"moe/bias_spread/layer_{i}"] = layer.expert_bias.max() - layer.expert_bias.min()
    reset_routing_stats(model)
    return stats


@torch.no_grad()
def reset_routing_stats(model: nn.Module) -> None:
    """Zero every MoE layer's per-step routing counts: after they are used, or when the
    step that accumulated them is dropped."""
    for _, layer in moe_layers(model):
        layer.load.zero_()
        layer.entropy_sum.zero_()


def check_moe_config(cfg: ModelConfig) -> None:
    """Raise ValueError naming the model key of an invalid expert setting."""
    if cfg.n_experts == 0:
        return
    if cfg.n_experts < 0:
        raise ValueError(f"model.n_experts must be >= 0, got {cfg.n_experts}")
    if not 1 <= cfg.top_k <= cfg.n_experts:
        raise ValueError(f"model.top_k={cfg.top_k} must lie in [1, model.n_experts={cfg.n_experts}]")
    if cfg.score_func not in ("sigmoid", "softmax"):
        raise ValueError(f"model.score_func: unknown score function {cfg.score_func!r} (expected sigmoid or softmax)")
    if not 0 <= cfg.n_dense_layers <= cfg.n_layers:
        raise ValueError(f"model.n_dense_layers={cfg.n_dense_layers} must lie in [0, model.n_layers={cfg.n_layers}]")
    if cfg.n_shared_experts < 0:
        raise ValueError(f"model.n_shared_experts must be >= 0, got {cfg.n_shared_experts}")
    if not math.isfinite(cfg.routed_scaling) or cfg.routed_scaling <= 0:
        raise ValueError(f"model.routed_scaling must be > 0, got {cfg.routed_scaling}")
