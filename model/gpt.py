"""A decoder-only GPT, readable top to bottom.

Pre-norm RMSNorm blocks, attention with separate wq / wk / wv projections (never fused, so
Muon can orthogonalise each on its own), rotary position embeddings, optional QK-norm,
grouped-query attention, a SwiGLU MLP, and an LM head untied from the embedding.

The model is plain single-device PyTorch. How it is parallelised lives elsewhere. For
generation, `forward` optionally takes a `KVCache`: each call then appends its tokens' keys
and values and attends over everything cached so far.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from model.activation_checkpoint import recomputing
from model.attention_logits import attention_with_head_max, causal_max_logit
from model.chunked_loss import chunked_head_loss
from model.config import ModelConfig
from model.init import InitRule, init_whole
from model.moe import MoE


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalise(x, self.weight)

    def normalise(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 even under bf16 autocast: the mean of squares loses too much
        # precision in bf16 for wide models. F.rms_norm is one fused kernel in eager mode
        # where the device has one (the written-out formula is five).
        return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), self.eps).type_as(x)


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape [max_seq_len, head_dim // 2]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + head_dim/2) of x [B, H, T, D] by position-dependent angles.

    This "rotate half" pairing is the Llama / Hugging Face convention, which keeps exported
    checkpoints loadable without permuting the wq / wk rows.
    """
    # chunk, not slicing: the backward of a split is one concatenation, of two slices two
    # zero-filled buffers and two copies.
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[None, None], sin[None, None]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.type_as(x)


class LayerKV:
    """One layer's cached keys and values [B, n_kv_heads, max_len, head_dim], allocated on the
    first append (so it takes the shapes, dtype and device of whatever layer fills it)."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.length = 0
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, H, T, D] after the cached positions; return all keys and values so far."""
        if self.k is None:
            batch, heads, _, dim = k.shape
            self.k = k.new_empty(batch, heads, self.max_len, dim)
            self.v = v.new_empty(batch, heads, self.max_len, dim)
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; {end} were asked for")
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    """Keys and values of every layer for the tokens already processed, for generation.

    Preallocated to `max_len` positions, so decoding a token writes in place instead of
    concatenating (which would copy the whole cache at every step).
    """

    def __init__(self, n_layers: int, max_len: int) -> None:
        self.layers = [LayerKV(max_len) for _ in range(n_layers)]
        self.max_len = max_len

    @property
    def length(self) -> int:
        """Positions cached so far: the position of the next token."""
        return self.layers[0].length


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.d_model, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        # While QK-clip is on (optim/qk_clip.py), the largest pre-softmax logit of each of this
        # rank's query heads over the step's training forward passes; None otherwise.
        self.register_buffer("head_max_logit", None, persistent=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        max_logit_out: Optional[list[torch.Tensor]] = None,
        kv: Optional[LayerKV] = None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # A checkpoint's rerun in the backward (model/activation_checkpoint.py) computes what
        # the forward did, for the same saved tensors, but records nothing the forward recorded.
        if max_logit_out is not None:
            max_logit = causal_max_logit(q, k)
            if not recomputing():
                max_logit_out.append(max_logit)
        mask, causal = None, True
        if kv is not None:
            start = kv.length
            k, v = kv.append(k, v)
            # SDPA's is_causal aligns the mask to the top-left, which is wrong once queries
            # start after cached keys: query i (position start + i) sees keys 0..start + i.
            # A single new token sees every key, so it needs no mask at all.
            causal = start == 0
            if not causal and seq > 1:
                mask = cached_causal_mask(start, seq, x.device)
        if self.head_max_logit is not None and kv is None and torch.is_grad_enabled():
            y, head_max = attention_with_head_max(q, k, v)
            if not recomputing():
                self.head_max_logit.copy_(torch.maximum(self.head_max_logit, head_max))
        else:
            # GQA: each kv head serves n_heads / n_kv_heads query heads.
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=self.n_kv_heads != self.n_heads
            )
        return self.wo(y.transpose(1, 2).reshape(batch, seq, -1))


def cached_causal_mask(start: int, seq: int, device: torch.device) -> torch.Tensor:
    """[seq, start + seq] boolean mask: query i (at position start + i) sees keys 0..start + i."""
    keys = torch.arange(start + seq, device=device)
    queries = torch.arange(start, start + seq, device=device)
    return keys[None, :] <= queries[:, None]


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w_gate = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w_up = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w_down = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class LMHead(nn.Linear):
    """The output projection, and the loss over its logits (a TP version shards both)."""

    def __init__(self, d_model: int, vocab_size: int) -> None:
        super().__init__(d_model, vocab_size, bias=False)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        use_moe = cfg.n_experts > 0 and layer >= cfg.n_dense_layers
        self.mlp = MoE(cfg) if use_moe else SwiGLU(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        max_logit_out: Optional[list[torch.Tensor]] = None,
        kv: Optional[LayerKV] = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, max_logit_out, kv)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, init_seed: Optional[int] = None) -> None:
        """`init_seed`: the seed of the initialisation rule (model/init.py); by default the
        global generator's, so `torch.manual_seed(s); GPT(cfg)` is the model of seed s. Built
        under torch.device("meta") it does no initialisation work: materialize() does it."""
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size must be set (it is taken from the tokenizer)")
        self.cfg = cfg
        self.init_seed = torch.initial_seed() if init_seed is None else init_seed
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = LMHead(cfg.d_model, cfg.vocab_size)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        # Not persistent: derived from the config, so checkpoints need not carry them.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # Sums of squares of each block's output and of the final normed hidden state,
        # accumulated on the device while `track_output_rms` is on (the trainer turns it on
        # for logging steps) and read with one transfer by `pop_output_rms`.
        self.register_buffer("output_sq_sum", torch.zeros(cfg.n_layers + 1), persistent=False)
        self.track_output_rms = False
        if not self.embed.weight.is_meta:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """The initialisation rule (model/init.py) on this whole, unsharded model."""
        init_whole(self, InitRule.of(self.cfg, self.init_seed))

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Every buffer's starting value, in place on the buffers' device: after the model
        was given storage on its device (materialize), whose contents are garbage."""
        cos, sin = rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        self.output_sq_sum.zero_()
        for block in self.blocks:
            block.attn.head_max_logit = None
            if isinstance(block.mlp, MoE):
                block.mlp.reset_buffers()

    def forward(
        self,
        idx: torch.Tensor,
        targets: Optional[torch.Tensor] = None,
        max_logit_out: Optional[list[torch.Tensor]] = None,
        cache: Optional[KVCache] = None,
    ) -> torch.Tensor:
        """Logits [B, T, V] when targets is None, else the mean cross-entropy loss.

        If `max_logit_out` is a list, each block appends its attention's max logit to it.
        With a `cache`, idx continues the cached tokens: its positions start at cache.length.
        """
        seq = idx.shape[1]
        start = 0 if cache is None else cache.length
        if start + seq > self.cfg.max_seq_len:
            raise ValueError(f"{start + seq} positions exceed model.max_seq_len={self.cfg.max_seq_len}")
        cos, sin = self.rope_cos[start : start + seq], self.rope_sin[start : start + seq]
        x = self.embed(idx)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, max_logit_out, None if cache is None else cache.layers[i])
            self.track_output(i, x)
        x = self.final_norm(x)
        self.track_output(self.cfg.n_layers, x)
        if targets is None:
            return self.head.full_logits(self.head(x))
        loss = self.head_loss(x, targets)
        for block in self.blocks:
            aux = getattr(block.mlp, "aux_loss", None)
            if aux is not None:
                loss = loss + aux
        return loss

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of the head over the final normed hidden state `x` (in
        model.loss_chunks chunks where asked): the last pipeline stage's loss function too."""
        if self.cfg.loss_chunks > 1:
            return chunked_head_loss(self.head, x, targets, self.cfg.loss_chunks)
        return self.head.loss(self.head(x), targets)

    def track_output(self, slot: int, x: torch.Tensor) -> None:
        if self.track_output_rms:
            self.output_sq_sum[slot] += x.detach().float().pow(2).sum()

    def pop_output_rms(self, n_tokens: int) -> torch.Tensor:
        """RMS of each block's output (final norm last) over the `n_tokens` tracked since
        the previous call; resets the sums."""
        rms = (self.output_sq_sum / (n_tokens * self.cfg.d_model)).sqrt()
        self.output_sq_sum.zero_()
        return rms

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters in all; non_embedding leaves out the token embedding and the LM head,
        whose size follows the vocabulary rather than the model (the x-axis of a scaling fit)."""
        skip = (self.embed.weight, self.head.weight) if non_embedding else ()
        return sum(p.numel() for p in self.parameters() if not any(p is q for q in skip))

    def new_cache(self, max_len: Optional[int] = None) -> KVCache:
        """An empty KV cache for up to `max_len` positions (default: model.max_seq_len)."""
        return KVCache(self.cfg.n_layers, max_len or self.cfg.max_seq_len)
