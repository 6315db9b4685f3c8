"""How close attention kernels must come to the truth, and a check of that yardstick on CPU.

tests/test_gpu.py holds FlexAttention (QK-clip's CUDA path) to it against the explicit-logit
path. A fixed tolerance cannot say what bf16 promises: both paths round to 8-bit mantissas at
several places, so their error is set by the inputs' size and the kernel's structure. Instead
each result is measured against float64 attention from the same inputs, and must be about as
close to it as the explicit path in the same dtype is (the way FlashAttention is tested).
Here the yardstick runs on CPU: it must pass the CPU's own blocked online-softmax kernel
(SDPA's flash backend, built like FlexAttention), and fail kernels that really are worse.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from model.attention_logits import explicit_attention_with_head_max

# Measured in bf16 against the explicit path, over the 131,072 elements of an output or
# gradient: the CPU's blocked kernel (30 seeds) had 0.77x to 1.16x its RMS error, but 0.5x to
# 2.4x its worst single element; FlexAttention on an H200 (4 seeds) 0.7x to 0.85x and 0.55x to
# 1.45x. The worst element is one draw from a wide tail (the 0.0598 against 0.05 allowed that
# failed on an H200 was such a draw). So the RMS carries the claim, with 2x headroom, and the
# worst element gets a looser bound that still catches a few badly wrong elements.
RMS_FACTOR = 2.0
WORST_FACTOR = 4.0
# Errors below about 8 fp32 ulps of the largest value are fp32's own accumulation noise, and
# their ratio means nothing (the explicit head maximum is often exact).
FLOOR = 1e-6


def attention_fp64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Causal attention [B, H, T, D] and each head's largest logit [H], computed in float64
    from the same inputs, with those float64 inputs (leaves) for the gradients."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    logits = q @ k.repeat_interleave(groups, dim=1).mT / math.sqrt(q.shape[-1])
    future = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool, device=q.device).triu(1)
    logits = logits.masked_fill(future, float("-inf"))
    out = logits.softmax(dim=-1) @ v.repeat_interleave(groups, dim=1)
    return out, logits.detach().amax(dim=(0, 2, 3)), (q, k, v)


def errors(result: torch.Tensor, truth: torch.Tensor) -> tuple[float, float]:
    """(RMS, worst) absolute error of `result` against the float64 `truth`."""
    err = (result.detach().double() - truth.detach()).abs()
    return err.square().mean().sqrt().item(), err.max().item()


def assert_no_less_accurate(name: str, result: torch.Tensor, baseline: torch.Tensor, truth: torch.Tensor) -> None:
    """`result` is about as close to `truth` as `baseline` (same inputs, same dtype) is."""
    floor = FLOOR * truth.detach().abs().max().item()
    (rms, worst), (base_rms, base_worst) = errors(result, truth), errors(baseline, truth)
    assert rms <= RMS_FACTOR * base_rms + floor and worst <= WORST_FACTOR * base_worst + floor, (
        f"{name}: error against float64 RMS {rms:.3g}, worst {worst:.3g}; the baseline's RMS "
        f"{base_rms:.3g}, worst {base_worst:.3g} (allowed {RMS_FACTOR}x and {WORST_FACTOR}x, + {floor:.2g})"
    )


def blocked_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The CPU's flash attention: tiles and an online softmax, like FlexAttention's kernel."""
    groups = q.shape[1] // k.shape[1]
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(
            q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), is_causal=True
        )


def bf16_logits_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A worse bf16 attention: logits rounded to bf16 (about 0.1 absolute at logits of 30)."""
    groups = q.shape[1] // k.shape[1]
    logits = q @ k.repeat_interleave(groups, dim=1).mT / math.sqrt(q.shape[-1])
    future = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).triu(1)
    probs = logits.masked_fill(future, float("-inf")).float().softmax(dim=-1)
    return probs.to(v.dtype) @ v.repeat_interleave(groups, dim=1)


def tf32_inputs_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """fp32 attention whose matmul inputs keep TF32's 10 mantissa bits, as on a GPU with TF32 on."""
    def tf32(t: torch.Tensor) -> torch.Tensor:
        return (t.detach().view(torch.int32) & ~0x1FFF).view(torch.float32)  # drop the 13 lowest bits

    return explicit_attention_with_head_max(tf32(q), tf32(k), tf32(v))[0]


def outputs_and_grads(kernel, q, k, v) -> list[torch.Tensor]:
    out = kernel(q, k, v)
    return [out, *torch.autograd.grad(out.float().square().sum(), (q, k, v))]


def inputs(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """As tests/test_gpu.py draws them: grouped-query heads, logits of order 10."""
    torch.manual_seed(seed)
    q, k, v = (torch.randn(2, h, 128, 64, dtype=dtype, requires_grad=True) for h in (8, 2, 2))
    with torch.no_grad():
        q.mul_(3.0)
    return q, k, v


def explicit_and_truth(q, k, v) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    explicit = outputs_and_grads(lambda *x: explicit_attention_with_head_max(*x)[0], q, k, v)
    out, _, leaves = attention_fp64(q, k, v)
    return explicit, [out, *torch.autograd.grad(out.square().sum(), leaves)]


NAMES = ("output", "dq", "dk", "dv")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_correct_blocked_kernel_is_as_accurate_as_the_explicit_path(dtype, seed):
    q, k, v = inputs(dtype, seed)
    explicit, truth = explicit_and_truth(q, k, v)
    for name, result, base, true in zip(NAMES, outputs_and_grads(blocked_kernel, q, k, v), explicit, truth):
        assert_no_less_accurate(name, result, base, true)


def test_bf16_logits_are_caught_by_the_rms_bound():
    q, k, v = inputs(torch.bfloat16, 0)
    explicit, truth = explicit_and_truth(q, k, v)
    worse = outputs_and_grads(bf16_logits_kernel, q, k, v)
    # Their RMS error is 2.5x to 3.3x the explicit path's in the output, dq and dk.
    for name, result, base, true in list(zip(NAMES, worse, explicit, truth))[:3]:
        with pytest.raises(AssertionError, match=f"^{name}: "):
            assert_no_less_accurate(name, result, base, true)


def test_the_fp32_check_tells_true_fp32_from_tf32():
    q, k, v = inputs(torch.float32, 0)
    explicit, truth = explicit_and_truth(q, k, v)
    with pytest.raises(AssertionError, match="^output: "):
        assert_no_less_accurate("output", tf32_inputs_kernel(q, k, v), explicit[0], truth[0])


def test_the_explicit_head_maximum_is_within_the_floor_of_float64s():
    """Why the floor: the explicit path's fp32 logits of bf16 inputs leave no error above it."""
    q, k, v = inputs(torch.bfloat16, 0)
    _, head_max = explicit_attention_with_head_max(q, k, v)
    _, true_max, _ = attention_fp64(q, k, v)
    assert head_max.shape == (8,) and head_max.dtype == torch.float32
    assert errors(head_max, true_max)[1] <= FLOOR * true_max.abs().max().item()
