"""Model FLOPs per trained token and the device's measured matmul peak: the two halves of MFU.

Convention (model FLOPs, as in MFU; recomputation and non-matmul work are not counted):

* A forward pass costs 2 FLOPs (multiply + add) per weight of every matmul a token goes
  through: wq, wk, wv, wo, the SwiGLU MLP (w_gate, w_up, w_down), the LM head and, in MoE
  layers, the router plus only the *active* experts (top_k routed + the shared ones).
  The embedding is a lookup and costs nothing.
* Attention scores (q.k) and values (p.v) of causal attention over seq_len T: query i sees
  i + 1 keys, (T + 1) / 2 on average, so per token and layer 2 matmuls x 2 FLOPs x
  n_heads x head_dim x (T + 1) / 2 = 2 * n_heads * head_dim * (T + 1). (The often quoted
  12 * L * d * T counts the full T x T square, i.e. twice this.) Grouped-query attention
  shares keys and values between heads but every query head still does its own products.
* Training = forward + backward = 3 x forward (the backward computes gradients of both
  the activations and the weights, each as large as the forward).

So training FLOPs per token = 6 * N_active + 6 * L * n_heads * head_dim * (T + 1), where
N_active counts the matmul weights above. RMSNorm, RoPE, SiLU, softmax, the loss and the
optimizer are left out, as everyone's MFU does.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from model.config import ModelConfig


def forward_flops_breakdown(cfg: ModelConfig, seq_len: int) -> dict[str, int]:
    """Forward FLOPs per token by part (keys: attn_proj, attn_scores, mlp, router, experts,
    shared_experts, head), for a model whose vocab_size is set."""
    if cfg.vocab_size <= 0:
        raise ValueError("model.vocab_size must be set to count the LM head's FLOPs")
    d, hd = cfg.d_model, cfg.head_dim
    q_width, kv_width = cfg.n_heads * hd, cfg.n_kv_heads * hd
    # wq and wo are d x q_width, wk and wv d x kv_width.
    attn_proj = 2 * d * q_width + 2 * d * kv_width
    attn_scores = 2 * cfg.n_heads * hd * (seq_len + 1)  # see the module docstring
    n_moe = cfg.n_layers - cfg.n_dense_layers if cfg.n_experts > 0 else 0
    n_dense = cfg.n_layers - n_moe
    expert_hidden = cfg.expert_hidden or cfg.ffn_hidden
    parts = {
        "attn_proj": cfg.n_layers * attn_proj,
        "attn_scores": cfg.n_layers * attn_scores,
        "mlp": n_dense * 3 * d * cfg.ffn_hidden,
        "router": n_moe * d * cfg.n_experts,
        "experts": n_moe * cfg.top_k * 3 * d * expert_hidden,
        "shared_experts": n_moe * cfg.n_shared_experts * 3 * d * expert_hidden,
        "head": d * cfg.vocab_size,
    }
    # Every part but the scores is a weight count: 2 FLOPs per weight.
    return {k: v if k == "attn_scores" else 2 * v for k, v in parts.items()}


def forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    return sum(forward_flops_breakdown(cfg, seq_len).values())


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Forward + backward model FLOPs per trained token (3 x forward)."""
    return 3 * forward_flops_per_token(cfg, seq_len)


PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_peak(device: torch.device, precision: str, seconds: float = 1.0,
                        size: int | None = None) -> float:
    """Achieved FLOP/s of a large square matmul in `precision` ("bf16" or "fp32") on `device`.

    Timed as F.linear, the op every projection of the model runs (on CPU the bf16 kernels
    of plain `a @ b` and of `linear` can differ several-fold). Calls repeat for about
    `seconds` after a warm-up and the median call counts: on a dedicated device that is its
    best rate; on a shared CPU it is the rate a matmul gets under the sharing the run itself
    will see (e.g. several ranks on few cores), where the fastest call would only reflect a
    moment when the others happened to be idle.
    On CUDA fp32 this measures whatever the trainer enabled (TF32 on Ampere and newer).
    """
    dtype = PRECISION_DTYPES[precision]
    # Big enough to leave the launch/cache-bound regime, small enough for ~1 s on a CPU.
    size = size or (4096 if device.type == "cuda" else 1024)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(size, size, generator=gen).to(device=device, dtype=dtype)
    w = torch.randn(size, size, generator=gen).to(device=device, dtype=dtype)
    # A GPU finishes one such matmul in well under a millisecond: time several per sample
    # so the host-side sync does not count.
    per_sample = 10 if device.type == "cuda" else 1
    for _ in range(2):  # kernel choice, first-touch allocations
        F.linear(x, w)
    _sync(device)
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < 3 or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        for _ in range(per_sample):
            F.linear(x, w)
        _sync(device)
        samples.append((time.perf_counter() - t0) / per_sample)
    return 2 * size**3 / statistics.median(samples)


_PEAKS: dict[tuple[str, str, int], float] = {}


def device_peak_flops(device: torch.device, precision: str) -> float:
    """measure_matmul_peak, once per process for each device, precision and thread count:
    the peak does not change between the runs of a sweep or the trainers of a test session."""
    key = _peak_key(device, precision)
    if key not in _PEAKS:
        _PEAKS[key] = measure_matmul_peak(device, precision)
    return _PEAKS[key]


def _peak_key(device: torch.device, precision: str) -> tuple[str, str, int]:
    return str(device), precision, torch.get_num_threads()


def remember_peak(device: torch.device, precision: str, flops: float) -> None:
    """A peak measured for this process by another with the same threads (a process that
    forks runs must not run matmuls itself: its children would hang in OpenMP), which
    device_peak_flops then returns."""
    _PEAKS[_peak_key(device, precision)] = flops
