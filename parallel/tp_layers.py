"""Hand-written tensor-parallel layers.

Every layer is built from the full (tp=1) layer, keeping this rank's shard of its weight,
so a model initialised from a seed and then sharded holds exactly the weights a
single-process model would: runs at different TP sizes are the same experiment. The full
layer may be on the meta device (a model built there and given its values once sharded):
the shard then is too, and nothing here allocates elsewhere.

Each sharded weight records the dimension it is split along as `param.tp_split_dim`
(0: output rows, 1: input columns); replicated weights have None. The optimizer reads it.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallel.tp_ops import Group, all_reduce, gather_from_tp, group_rank, group_size, reduce_from_tp


def shard(full: torch.Tensor, dim: int, group: Group, logical_numel: Optional[int] = None) -> nn.Parameter:
    """This rank's slice of `full` along `dim`, as a parameter that remembers the split and
    the element count of the logical tensor (without padding) for statistics."""
    piece = full.detach().chunk(group_size(group), dim=dim)[group_rank(group)].clone()
    param = nn.Parameter(piece)
    param.tp_split_dim = dim
    param.logical_numel = full.numel() if logical_numel is None else logical_numel
    return param


def padded_vocab(vocab_size: int, tp: int) -> int:
    """Vocabulary rows rounded up so TP divides them; the extra rows are never predicted."""
    return math.ceil(vocab_size / tp) * tp


class ColumnParallelLinear(nn.Module):
    """y[..., shard] = x @ W[shard]^T: the output features are split across TP ranks.

    The input must be the same on every rank and enter through `copy_to_tp` (the norm
    before it does that), so its gradient is summed over the ranks' shards.
    """

    def __init__(self, full: nn.Linear, group: Group) -> None:
        super().__init__()
        self.weight = shard(full.weight, 0, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x[..., shard] @ W[:, shard]^T: the input features are split."""

    def __init__(self, full: nn.Linear, group: Group) -> None:
        super().__init__()
        self.group = group
        self.weight = shard(full.weight, 1, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp(F.linear(x, self.weight), self.group)


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the vocabulary rows; a rank looks up the ids in
    its slice, writes zeros for the others, and an all-reduce assembles the embeddings."""

    def __init__(self, full: nn.Embedding, group: Group) -> None:
        super().__init__()
        self.group = group
        vocab, dim = full.weight.shape
        # On the source's device: on meta (a model built there) the padding costs nothing.
        padded = torch.zeros(padded_vocab(vocab, group_size(group)), dim, dtype=full.weight.dtype,
                             device=full.weight.device)
        padded[:vocab] = full.weight.detach()
        self.weight = shard(padded, 0, group, logical_numel=full.weight.numel())
        self.vocab_start = group_rank(group) * self.weight.shape[0]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        local = idx - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        emb = F.embedding(local.masked_fill(outside, 0), self.weight)
        emb = emb.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(emb, self.group)


class VocabParallelHead(nn.Module):
    """The LM head split over the vocabulary: each rank computes logits for its vocabulary
    slice only, and the loss is computed without ever gathering the full logits."""

    def __init__(self, full: nn.Linear, vocab_size: int, group: Group) -> None:
        super().__init__()
        self.group = group
        self.vocab_size = vocab_size
        padded = torch.zeros(padded_vocab(vocab_size, group_size(group)), full.weight.shape[1], dtype=full.weight.dtype,
                             device=full.weight.device)
        padded[:vocab_size] = full.weight.detach()
        self.weight = shard(padded, 0, group, logical_numel=full.weight.numel())
        self.vocab_start = group_rank(group) * self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, self.vocab_start, self.vocab_size, self.group)

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return gather_from_tp(logits, -1, self.group)[..., : self.vocab_size]


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    group: Group,
) -> torch.Tensor:
    """Mean cross-entropy over tokens, from logits sharded along the vocabulary, in fp32.

    loss = log(sum_v exp(l_v - m)) + m - l_target, where the max m, the sum of exponentials
    and the target logit are each all-reduced over TP. Columns past `vocab_size` are padding
    and get -inf, so they are never predicted.
    """
    logits = local_logits.float().flatten(0, -2)
    targets = targets.flatten()
    n_local = logits.shape[-1]
    column = torch.arange(vocab_start, vocab_start + n_local, device=logits.device)
    if vocab_start + n_local > vocab_size:
        logits = logits.masked_fill(column >= vocab_size, float("-inf"))

    # The max only shifts the exponentials for stability; it carries no gradient.
    with torch.no_grad():
        shift = all_reduce(logits.amax(dim=-1), group, op=dist.ReduceOp.MAX)
    sum_exp = reduce_from_tp((logits - shift.unsqueeze(-1)).exp().sum(dim=-1), group)

    local_target = targets - vocab_start
    mine = (local_target >= 0) & (local_target < n_local)
    picked = logits.gather(-1, local_target.clamp(0, n_local - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = reduce_from_tp(picked.masked_fill(~mine, 0.0), group)
    return (sum_exp.log() + shift - target_logit).mean()
