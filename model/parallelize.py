"""Turn a single-device GPT into its tensor-parallel shard, in place.

The model definition (model/gpt.py) knows nothing of parallelism; this file decides which
layer is split how. Attention is split by heads (wq, wk, wv column-parallel, wo
row-parallel), the MLP by hidden units (gate and up column-parallel, down row-parallel),
the embedding and LM head by vocabulary. Norms are replicated.
"""
from __future__ import annotations

from torch import nn

from model.config import ModelConfig
from model.gpt import GPT, RMSNorm
from model.moe import Experts, MoE
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

    forward = Experts.forward


def check_tp_divisibility(cfg: ModelConfig, tp: int) -> None:
    """Raise ValueError naming the model key that TP does not divide."""
    keys = ["n_heads", "n_kv_heads", "ffn_hidden"]
    if cfg.n_experts:
        keys.append("expert_hidden" if cfg.expert_hidden else "ffn_hidden")
    for key in keys:
        value = getattr(cfg, key)
        if value % tp:
            raise ValueError(f"model.{key}={value} is not divisible by parallel.tp={tp}")


# The dimension TP splits, by parameter-name suffix (0: output rows, 1: input columns);
# anything else is replicated. parallelize_tp below must agree (a test checks it); tools
# that reason about layouts without processes (scripts/bench_comm.py) read it here.
TP_SPLIT_BY_SUFFIX: dict[str, int] = {
    "attn.wq.weight": 0, "attn.wk.weight": 0, "attn.wv.weight": 0, "attn.wo.weight": 1,
    "w_gate.weight": 0, "w_up.weight": 0, "w_down.weight": 1,  # dense MLP and shared experts
    "experts.w_gate": 1, "experts.w_up": 1, "experts.w_down": 2,
    "embed.weight": 0, "head.weight": 0,
}


def tp_split_dim(name: str) -> int | None:
    return next((d for suffix, d in TP_SPLIT_BY_SUFFIX.items() if name.endswith(suffix)), None)


def parallelize_tp(model: GPT, group: Group) -> GPT:
    tp = group_size(group)
    if tp == 1:
        for param in model.parameters():
            param.tp_split_dim = None
        return model
    check_tp_divisibility(model.cfg, tp)
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
            mlp.experts = TPExperts(mlp.experts, group)
            if mlp.shared is not None:
                _split_swiglu(mlp.shared, group)
        else:
            block.mlp_norm = TPInputNorm(block.mlp_norm, group)
            _split_swiglu(mlp, group)
    model.final_norm = TPInputNorm(model.final_norm, group)
    model.embed = VocabParallelEmbedding(model.embed, group)
    model.head = VocabParallelHead(model.head, model.cfg.vocab_size, group)
    for param in model.parameters():
        if not hasattr(param, "tp_split_dim"):
            raise AssertionError("every parameter must record its TP split after parallelize_tp")
    return model


def _split_swiglu(mlp: nn.Module, group: Group) -> None:
    mlp.w_gate = ColumnParallelLinear(mlp.w_gate, group)
    mlp.w_up = ColumnParallelLinear(mlp.w_up, group)
    mlp.w_down = RowParallelLinear(mlp.w_down, group)


def is_tp_sharded(param: nn.Parameter) -> bool:
    return getattr(param, "tp_split_dim", None) is not None
