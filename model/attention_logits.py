"""Causal attention that also reports its largest pre-softmax logits.

Fused attention kernels (SDPA, flash) never materialise the logits q.k/sqrt(d), yet QK-clip
(optim/qk_clip.py) needs each head's largest one from every training forward pass, and the
eval metric attn/max_logit/layer_<i> needs each layer's. Two ways to get them without running
attention twice:

- On CUDA, FlexAttention computes the row-wise maximum of the scores inside its fused kernel
  (`AuxRequest(max_scores=True)`), from the same tiles it exponentiates: exact, and no extra
  pass over q and k.
- Elsewhere (CPU: tests and CI) FlexAttention has neither a backward nor `max_scores`, so the
  attention is computed from explicit logits, and their maximum is read from those.

Both are only used while QK-clip is on; with it off the model calls SDPA as before.
"""
from __future__ import annotations

import functools
import math

import torch


def causal_logits(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Pre-softmax logits q.k/sqrt(d) [B, H, T, T] in fp32, -inf where a query would see a
    later key. k may have fewer heads than q (grouped-query attention)."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    logits = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    seq = q.shape[2]
    future = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
    return logits.masked_fill(future, float("-inf"))


def causal_max_logit(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Largest visible logit over every head, as a 0-d tensor (the eval metric, one batch)."""
    return causal_logits(q, k).amax()


def explicit_attention_with_head_max(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention from explicit logits, and each head's largest logit [H] (fp32)."""
    logits = causal_logits(q, k)
    head_max = logits.detach().amax(dim=(0, 2, 3))
    groups = q.shape[1] // v.shape[1]
    probs = torch.softmax(logits, dim=-1).to(v.dtype)
    return probs @ v.repeat_interleave(groups, dim=1), head_max


@functools.cache
def _compiled_flex_attention():
    # FlexAttention is only a fused kernel when compiled; eagerly it materialises the scores.
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@functools.cache
def causal_block_mask(seq: int, device: torch.device):
    """FlexAttention's block-sparse causal mask for `seq` positions, built once per length."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, seq, seq, device=device)


def flex_attention_with_head_max(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as explicit_attention_with_head_max, by FlexAttention's fused kernel (CUDA)."""
    from torch.nn.attention.flex_attention import AuxRequest

    out, aux = _compiled_flex_attention()(
        q, k, v, block_mask=causal_block_mask(q.shape[2], q.device),
        enable_gqa=k.shape[1] != q.shape[1], return_aux=AuxRequest(max_scores=True),
    )
    # max_scores is the row-wise maximum [B, H, T] of the scaled scores.
    return out, aux.max_scores.detach().float().amax(dim=(0, 2))


def attention_with_head_max(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention output [B, H, T, D] and each head's largest pre-softmax logit [H]."""
    if q.is_cuda:
        return flex_attention_with_head_max(q, k, v)
    return explicit_attention_with_head_max(q, k, v)
