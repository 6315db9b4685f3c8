"""Turn a single-device GPT into its tensor-parallel shard, in place.

The model definition (model/gpt.py) knows nothing of parallelism; this file decides which
layer is split how. Attention is split by heads (wq, wk, wv column-parallel, wo
row-parallel), the MLP by hidden units (gate and up column-parallel, down row-parallel),
the embedding and LM head by vocabulary. Norms are replicated. Under expert parallelism
(parallelize_moe) each rank keeps n_experts / ep whole experts, which TP leaves whole.

Both work on a model on the meta device as on a real one: trainer/build.py shards the meta
model and model/init.py then fills in each rank's part, by the splits recorded here
(`tp_split_dim`: torch.chunk's part along that dim; `ep_split_dim`: this EP rank's experts).
"""
from __future__ import annotations

import torch
from torch import nn

from model.config import ModelConfig
from model.gpt import GPT, RMSNorm
from model.moe import Experts, MoE, moe_layers
from parallel.comm import group_rank
from parallel.expert_parallel import check_expert_parallel
from parallel.tp_layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelHead, shard
from parallel.tp_ops import Group, copy_to_tp, group_size


# The model's own layers as TP shards: the generic TP layers live in parallel/tp_layers.py.


class ReplicatedNorm(RMSNorm):
    """An RMSNorm copied from the full model, the same on every TP rank."""

    def __init__(self, full: RMSNorm, group: Group) -> None:
        super().__init__(full.weight.shape[0], full.eps)
        self.weight = nn.Parameter(full.weight.detach().clone())
        self.weight.tp_split_dim = None
        self.group = group


class TPInputNorm(ReplicatedNorm):
    """A norm whose output feeds column-parallel layers: `copy_to_tp` sums the output's
    gradient over TP ranks, so gamma's gradient is identical on every rank."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return copy_to_tp(super().forward(x), self.group)


class TPHeadNorm(ReplicatedNorm):
    """QK-norm over head_dim: one gamma shared by all heads while each rank sees only its own
    heads, so gamma's gradient is summed over TP ranks (copy_to_tp on the weight)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalise(x, copy_to_tp(self.weight, self.group))


class TPExperts(nn.Module):
    """Routed experts with each expert's hidden units split over TP, as in the dense MLP:
    gate/up [E, hidden/T, d] (column-parallel), down [E, d, hidden/T] (row-parallel; the MoE
    layer all-reduces the combined output once)."""

    def __init__(self, full: nn.Module, group: Group) -> None:
        super().__init__()
        self.w_gate = shard(full.w_gate, 1, group)
        self.w_up = shard(full.w_up, 1, group)
        self.w_down = shard(full.w_down, 2, group)
        self.grad_group: Group = None  # each rank's gradients are its own shard's, whole

    forward = Experts.forward


def check_tp_divisibility(cfg: ModelConfig, tp: int, split_experts: bool = True) -> None:
    """Raise ValueError naming the model key that TP does not divide."""
    keys = ["n_heads", "n_kv_heads", "ffn_hidden"]
    if cfg.n_experts and split_experts:
        keys.append("expert_hidden" if cfg.expert_hidden else "ffn_hidden")
    for key in keys:
        value = getattr(cfg, key)
        if value % tp:
            raise ValueError(f"model.{key}={value} is not divisible by parallel.tp={tp}")


# The dimension TP splits, by parameter-name suffix (0: output rows, 1: input columns);
# anything else is replicated. parallelize_tp below must agree (a test checks it); tools
# that reason about layouts without processes (lab/tools/bench/bench_comm.py) read it here.
TP_SPLIT_BY_SUFFIX: dict[str, int] = {
    "attn.wq.weight": 0, "attn.wk.weight": 0, "attn.wv.weight": 0, "attn.wo.weight": 1,
    "w_gate.weight": 0, "w_up.weight": 0, "w_down.weight": 1,  # dense MLP and shared experts
    "experts.w_gate": 1, "experts.w_up": 1, "experts.w_down": 2,
    "embed.weight": 0, "head.weight": 0,
}


def tp_split_dim(name: str, split_experts: bool = True) -> int | None:
    if not split_experts and ".experts." in name:
        return None  # under EP the experts stay whole
    return next((d for suffix, d in TP_SPLIT_BY_SUFFIX.items() if name.endswith(suffix)), None)


def check_ep(cfg: ModelConfig, ep: int) -> None:
    """Raise ValueError (one line, naming the keys) unless `ep` ranks can share the experts."""
    if ep == 1:
        return
    if not cfg.n_experts:
        raise ValueError(f"parallel.ep={ep} needs a MoE model (model.n_experts > 0); model.name={cfg.name} "
                         "has no experts")
    check_expert_parallel(cfg.n_experts, ep)


def parallelize_moe(model: GPT, ep_group: Group, tp_group: Group, dp_group: Group) -> GPT:
    """Every MoE layer's groups, after parallelize_tp: the data-parallel ranks (the auxiliary
    loss's statistics are global), and under EP (an ep_group of more than one rank) this
    rank's experts [ep_rank * E / ep, (ep_rank + 1) * E / ep), whole."""
    ep = group_size(ep_group)
    for _, layer in moe_layers(model):
        layer.dp_group = dp_group
        if ep == 1:
            continue
        check_expert_parallel(layer.n_experts, ep)
        # torch.chunk's part along the expert dim, as model/init.py reads `ep_split_dim`.
        local = layer.n_experts // ep
        first = group_rank(ep_group) * local
        for name in ("w_gate", "w_up", "w_down"):
            mine = nn.Parameter(getattr(layer.experts, name).detach()[first : first + local].clone())
            mine.tp_split_dim = None
            mine.ep_split_dim = 0  # the checkpoint places it at expert `first` of the logical stack
            mine.logical_numel = getattr(layer.experts, name).numel()
            setattr(layer.experts, name, mine)
        layer.set_ep_group(ep_group)
        layer.experts.grad_group = tp_group  # each TP rank runs its part of the tokens
    return model


def parallelize_tp(model: GPT, group: Group, split_experts: bool = True) -> GPT:
    """`split_experts`: split each routed expert's hidden units over TP; False (under EP)
    keeps the experts whole."""
    tp = group_size(group)
    if tp == 1:
        for param in model.parameters():
            param.tp_split_dim = None
        return model
    check_tp_divisibility(model.cfg, tp, split_experts)
    for block in model.blocks:
        attn, mlp = block.attn, block.mlp
        block.attn_norm = TPInputNorm(block.attn_norm, group)
        attn.wq = ColumnParallelLinear(attn.wq, group)
        attn.wk = ColumnParallelLinear(attn.wk, group)
        attn.wv = ColumnParallelLinear(attn.wv, group)
        attn.wo = RowParallelLinear(attn.wo, group)
        if attn.q_norm is not None:
            attn.q_norm = TPHeadNorm(attn.q_norm, group)
            attn.k_norm = TPHeadNorm(attn.k_norm, group)
        if isinstance(mlp, MoE):
            # The replicated router reads the norm's output directly; MoE itself enters the
            # TP region for the experts (see model/moe.py).
            block.mlp_norm = ReplicatedNorm(block.mlp_norm, group)
            mlp.tp_group = group
            mlp.router.weight.tp_split_dim = None
            if split_experts:
                mlp.experts = TPExperts(mlp.experts, group)
            else:
                for param in mlp.experts.parameters():
                    param.tp_split_dim = None
            if mlp.shared is not None:
                _split_swiglu(mlp.shared, group)
        else:
            block.mlp_norm = TPInputNorm(block.mlp_norm, group)
            _split_swiglu(mlp, group)
    # A pipeline stage's model holds the embedding only on the first stage, the final norm and
    # head only on the last (model/pipeline_split.py).
    if model.final_norm is not None:
        model.final_norm = TPInputNorm(model.final_norm, group)
    if model.embed is not None:
        model.embed = VocabParallelEmbedding(model.embed, group)
    if model.head is not None:
        model.head = VocabParallelHead(model.head, model.cfg.vocab_size, group)
    for param in model.parameters():
        if not hasattr(param, "tp_split_dim"):
            raise AssertionError("every parameter must record its TP split after parallelize_tp")
    return model


def _split_swiglu(mlp: nn.Module, group: Group) -> None:
    mlp.w_gate = ColumnParallelLinear(mlp.w_gate, group)
    mlp.w_up = ColumnParallelLinear(mlp.w_up, group)
    mlp.w_down = RowParallelLinear(mlp.w_down, group)
