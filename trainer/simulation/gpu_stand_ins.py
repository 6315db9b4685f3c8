"""How trainer/simulation/memory_estimate.py runs a training step under FakeTensorMode on the CPU as a GPU
would hold it: a fake mode that nn.Module.to_empty can work under, the kernels whose saved
tensors differ between the CPU and CUDA (RMSNorm, Newton-Schulz's scratch), and balanced
answers to expert parallelism's host reads of routed-token counts. Each caveat is told in
trainer/simulation/memory_estimate.py's module docstring."""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorConverter, FakeTensorMode

from model.moe import MoE
from optim.muon import buffers


# ---- FakeTensorMode that module.to / to_empty can work under ----


class _FreshOutputConverter(FakeTensorConverter):
    """Does not memoise the fake tensors it wraps around ops' fresh meta outputs: the memo's
    weak reference is what makes torch.utils.swap_tensors (nn.Module.to, to_empty) refuse a
    fake parameter. Those outputs are new tensors that no later conversion looks up; real
    tensors brought into the mode are still memoised."""

    def set_tensor_memo(self, t: torch.Tensor, v: torch.Tensor) -> None:
        if t.device.type != "meta":
            super().set_tensor_memo(t, v)


def fake_mode() -> FakeTensorMode:
    mode = FakeTensorMode()
    old = mode.fake_tensor_converter
    mode.fake_tensor_converter = _FreshOutputConverter(copy_data=old.meta_converter.copy_data, export=old.export)
    return mode


# ---- What the GPU's kernels keep, where the CPU's differ ----


class FusedRMSNorm(torch.autograd.Function):
    """RMSNorm keeping for its backward what CUDA's fused kernel keeps (the input and 1/rms),
    where the CPU's decomposition also keeps the normalised product."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, weight)
        y = x * rstd
        return y * weight if weight is not None else y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        normed = x * rstd
        g = grad * weight if weight is not None else grad
        grad_x = rstd * (g - normed * (g * normed).mean(-1, keepdim=True))
        grad_w = (grad * normed).flatten(0, -2).sum(0) if weight is not None and ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def fused_rms_norm(x: torch.Tensor, normalized_shape: list[int], weight: Optional[torch.Tensor] = None,
                   eps: Optional[float] = None) -> torch.Tensor:
    """F.rms_norm with CUDA's memory behaviour (FusedRMSNorm) over a trailing dimension."""
    if len(normalized_shape) != 1:
        return _CPU_RMS_NORM(x, normalized_shape, weight, eps)
    return FusedRMSNorm.apply(x, weight, torch.finfo(x.dtype).eps if eps is None else eps)


_CPU_RMS_NORM = F.rms_norm


@contextlib.contextmanager
def gpu_kernels() -> Iterator[None]:
    """F.rms_norm as CUDA runs it, for the model's RMSNorm (model/gpt.py calls F.rms_norm). The
    function itself is swapped, not intercepted by a TorchFunctionMode: the recompute of a
    checkpointed block runs in the backward, outside any such mode, and must run the same ops
    as the forward did."""
    F.rms_norm = fused_rms_norm
    try:
        yield
    finally:
        F.rms_norm = _CPU_RMS_NORM


@contextlib.contextmanager
def gpu_newton_schulz() -> Iterator[None]:
    """Newton-Schulz's scratch memory as on a GPU, by optim/muon/buffers.py's two CPU settings:
    whole batches of matrices at once (the CPU cuts them into cache-sized runs,
    CPU_WORKING_SET_BYTES), and scratch buffers freed when done (the CPU keeps the most recent
    ones for the next call, _CPU_BUFFERS_KEPT)."""
    kept = buffers.CPU_WORKING_SET_BYTES, buffers._CPU_BUFFERS_KEPT
    buffers.CPU_WORKING_SET_BYTES, buffers._CPU_BUFFERS_KEPT = None, 0
    try:
        yield
    finally:
        buffers.CPU_WORKING_SET_BYTES, buffers._CPU_BUFFERS_KEPT = kept
        buffers.release_buffers()


class BalancedRouting:
    """Answers the host reads of expert parallelism's routed-token counts (the tracker passes
    them here), which fake tensors cannot, with balanced counts: `per_expert` pairs for every
    expert, set before each MoE layer's forward (`watch`). Any other read of a value to the host
    is an error."""

    def __init__(self) -> None:
        self.per_expert: Optional[int] = None

    def watch(self, model: nn.Module, tp_rank: int, tp: int) -> None:
        for layer in model.modules():
            if isinstance(layer, MoE):
                layer.register_forward_pre_hook(self._pre_hook(layer, tp_rank, tp))

    def _pre_hook(self, layer: MoE, tp_rank: int, tp: int):
        def hook(module: nn.Module, args: tuple) -> None:
            pairs = args[0].shape[0] * args[0].shape[1] * layer.top_k
            # Under TP each rank sends its contiguous part of the sorted pairs (MoE._experts_over_ep).
            per_rank = -(-pairs // tp)
            lo = min(pairs, tp_rank * per_rank)
            part = min(pairs, lo + per_rank) - lo
            if part % layer.n_experts:
                raise ValueError(f"an EP estimate routes {part} (token, expert) pairs per rank evenly over "
                                 f"model.n_experts={layer.n_experts}: choose a batch_size x seq_len that makes them divide")
            self.per_expert = part // layer.n_experts
        return hook

    def host_value(self) -> int:
        if self.per_expert is None:
            raise RuntimeError("the step read a tensor's value to the host outside expert parallelism's "
                               "dispatch: a fake tensor has none")
        return self.per_expert
