"""A minimal dense Llama-style GPT and training step in plain PyTorch, the yardstick for our
trainer's throughput (lab/tools/bench/bench_train.py runs both on the same shape, batch and precision).

Deliberately nothing but the model and the step, each part in its best plain-PyTorch form:
pre-norm nn.RMSNorm blocks (torch's fused kernel), separate q / k / v projections, rotary
embeddings, causal scaled_dot_product_attention, a SwiGLU MLP, an untied LM head, fused
AdamW, gradient clipping (clip_grad_norm_, for-each norms). No parallelism, no metrics, no MoE, no data pipeline: the
difference between the two tokens/s figures is the cost of everything our trainer adds.

    python lab/tools/bench/reference_gpt.py --steps 5 --precision fp32    # quick stand-alone timing
"""
from __future__ import annotations

import argparse
import contextlib
import math
import time
from dataclasses import dataclass
from typing import ContextManager

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ReferenceConfig:
    vocab_size: int = 8192
    n_layers: int = 6
    d_model: int = 384
    n_heads: int = 6
    n_kv_heads: int = 6
    ffn_hidden: int = 1024
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5


def rotary(head_dim: int, length: int, theta: float) -> torch.Tensor:
    """[2, length, head_dim // 2]: cos and sin of angle pos * theta^(-2i / head_dim)."""
    freq = theta ** (-torch.arange(0, head_dim, 2).float() / head_dim)
    angle = torch.arange(length).float()[:, None] * freq[None, :]
    # Real arithmetic rather than complex numbers, which torch.compile handles poorly.
    return torch.stack((angle.cos(), angle.sin()))


def rotate(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, D] in the planes of channels (i, i + D/2), in fp32."""
    cos, sin = rot[0], rot[1]
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1).type_as(x)


class SelfAttention(nn.Module):
    def __init__(self, c: ReferenceConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = c.n_heads, c.n_kv_heads
        self.head_dim = c.d_model // c.n_heads
        self.q = nn.Linear(c.d_model, c.n_heads * self.head_dim, bias=False)
        self.k = nn.Linear(c.d_model, c.n_kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(c.d_model, c.n_kv_heads * self.head_dim, bias=False)
        self.out = nn.Linear(c.n_heads * self.head_dim, c.d_model, bias=False)

    def forward(self, x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape

        def heads(proj: nn.Linear) -> torch.Tensor:
            return proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)

        q, k, v = rotate(heads(self.q), rot), rotate(heads(self.k), rot), heads(self.v)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.n_kv_heads != self.n_heads)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, c: ReferenceConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(c.d_model, c.ffn_hidden, bias=False)
        self.up = nn.Linear(c.d_model, c.ffn_hidden, bias=False)
        self.down = nn.Linear(c.ffn_hidden, c.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Layer(nn.Module):
    def __init__(self, c: ReferenceConfig) -> None:
        super().__init__()
        self.norm1, self.attn = nn.RMSNorm(c.d_model, eps=c.norm_eps), SelfAttention(c)
        self.norm2, self.ff = nn.RMSNorm(c.d_model, eps=c.norm_eps), FeedForward(c)

    def forward(self, x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rot)
        return x + self.ff(self.norm2(x))


class ReferenceGPT(nn.Module):
    def __init__(self, c: ReferenceConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(c.vocab_size, c.d_model)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.n_layers))
        self.norm = nn.RMSNorm(c.d_model, eps=c.norm_eps)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.register_buffer("rot", rotary(c.d_model // c.n_heads, c.max_seq_len, c.rope_theta), persistent=False)
        for name, p in self.named_parameters():
            if p.ndim == 2:
                # Residual-branch outputs get a depth-scaled init, GPT-2 style.
                last = name.endswith(("out.weight", "down.weight"))
                nn.init.normal_(p, std=0.02 / (math.sqrt(2 * c.n_layers) if last else 1.0))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        rot = self.rot[:, : idx.shape[1]]
        x = self.tok(idx)
        for layer in self.layers:
            x = layer(x, rot)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class ReferenceTrainer:
    """Model, AdamW and a fixed pool of random token batches; `step()` trains on the next
    `grad_accum` of them (micro-batches) and then steps the optimizer once."""

    def __init__(self, c: ReferenceConfig, batch_size: int, seq_len: int, precision: str,
                 compile: bool = False, device: str = "cpu", lr: float = 3e-3,
                 weight_decay: float = 0.1, grad_clip: float = 1.0, seed: int = 0,
                 grad_accum: int = 1) -> None:
        if grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1 (got {grad_accum})")
        torch.manual_seed(seed)
        self.device = torch.device(device)
        self.model = ReferenceGPT(c).to(self.device)
        self.forward = torch.compile(self.model) if compile else self.model
        # Fused: the whole AdamW step is one kernel, as a tuned plain loop would have it.
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay,
                                     betas=(0.9, 0.95), fused=True)
        self.precision, self.grad_clip, self.grad_accum = precision, grad_clip, grad_accum
        self.tokens_per_step = batch_size * seq_len * grad_accum
        # Random tokens: throughput does not depend on their values, and no data pipeline
        # is part of what this yardstick measures.
        data = torch.randint(0, c.vocab_size, (4, batch_size, seq_len + 1), device=self.device)
        self.batches = [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]
        self.n = 0

    def autocast(self) -> ContextManager:
        if self.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def step(self) -> torch.Tensor:
        total = None
        for _ in range(self.grad_accum):
            x, y = self.batches[self.n % len(self.batches)]
            self.n += 1
            with self.autocast():
                loss = self.forward(x, y)
            # Without accumulation the loss is not divided, so the one-micro-batch step stays
            # the bare step its operator count (tests/test_step_census.py) is held against.
            (loss / self.grad_accum if self.grad_accum > 1 else loss).backward()
            total = loss.detach() if total is None else total + loss.detach()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return total / self.grad_accum if self.grad_accum > 1 else total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    trainer = ReferenceTrainer(ReferenceConfig(), args.batch_size, args.seq_len, args.precision, args.compile)
    trainer.step()  # warm-up (and compilation)
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = trainer.step()
    secs = (time.perf_counter() - start) / args.steps
    print(f"loss {loss.item():.3f}; {secs:.3f} s/step, {trainer.tokens_per_step / secs:,.0f} tokens/s")


if __name__ == "__main__":
    main()
