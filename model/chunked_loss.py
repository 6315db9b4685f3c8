"""The LM head and its cross-entropy, a slice of tokens at a time (model.loss_chunks).

The head's logits are [tokens, vocab]: at a 128k vocabulary they outweigh every other
activation of a step. `chunked_head_loss` splits the final hidden states and the targets into
N slices of tokens and runs the head and the head's own per-slice loss (LMHead.loss, or the
vocabulary-parallel loss under TP) on one slice at a time, so at most one slice's logits and
their gradient are alive, forward and backward: peak O(tokens / N x vocab).

How: an autograd.Function whose forward computes each slice's gradients (with respect to the
hidden states and the head's parameters) as soon as that slice's loss is known, then drops the
slice's logits; its backward only scales those gradients by the incoming one. Chosen over a
checkpoint per slice because
- the head's forward matmul runs once, not twice (recomputation would add a third to the
  head's FLOPs, and under TP would run the loss's all-reduces a second time);
- the order of the slices' work is fixed by a Python loop, forward and backward, rather than
  left to the autograd engine's or the compiler's scheduling of the recomputation: every TP
  rank issues the loss's all-reduces in the same order, and the logits are never whole;
- the price, a head-weight gradient held from the end of the forward, is no extra peak: the
  unchunked backward allocates that gradient first and keeps it through the blocks' backward,
  with the activations still alive, just as here.
The gradients reach the head's parameters as the Function's input gradients, so they are
accumulated into `.grad` like any other (FSDP2's gathered head weight included) and the
hidden state's gradient flows on into the blocks. Under bf16 autocast the head runs in bf16
and the loss in fp32, as unchunked; the weight gradient is summed over the slices in fp32.
torch.compile runs this function eagerly (a graph break): a traced graph cannot call
torch.autograd.grad inside a forward, and the head is a few matmuls whose cost compilation
does not change.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn


@torch.compiler.disable(reason="torch.autograd.grad inside a forward cannot be traced")
def chunked_head_loss(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, chunks: int) -> torch.Tensor:
    """The mean cross-entropy of head(hidden) [..., vocab] against targets [...] over all
    tokens, computed `chunks` slices of tokens at a time.

    `head` is called on [1, slice, d] and its `loss(logits, targets)` gives the slice's mean;
    each mean is weighted by the slice's token count, so unequal slices (N not dividing the
    tokens) still give the exact token mean.
    """
    if chunks < 1:
        raise ValueError(f"model.loss_chunks must be >= 1, got {chunks}")
    params = tuple(p for p in head.parameters() if p.requires_grad)
    if torch.is_grad_enabled() and (hidden.requires_grad or params):
        return _ChunkedHeadLoss.apply(hidden, targets, head, chunks, *params)
    with torch.no_grad():  # evaluation: the slices' losses alone
        total = hidden.new_zeros((), dtype=torch.float64)
        for x, t, weight in token_slices(hidden, targets, chunks):
            total += _slice_loss(head, x, t).double() * weight
        return total.float()


def token_slices(hidden: torch.Tensor, targets: torch.Tensor,
                 chunks: int) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """(hidden rows [n, d], targets [n], n / tokens) of each non-empty slice of the flattened
    tokens, in order; the first tokens % chunks slices hold one token more than the rest."""
    flat, flat_targets = hidden.flatten(0, -2), targets.flatten()
    tokens = flat_targets.numel()
    if flat.shape[0] != tokens:
        raise ValueError(f"the hidden states hold {flat.shape[0]} tokens but the targets {tokens}")
    return [(x, t, t.numel() / tokens)
            for x, t in zip(flat.tensor_split(chunks), flat_targets.tensor_split(chunks)) if t.numel()]


def _slice_loss(head: nn.Module, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The head's mean loss over one slice, through its own [batch, seq, ...] interface."""
    return head.loss(head(x.unsqueeze(0)), targets.unsqueeze(0))


def _slice_grads(head: nn.Module, x: torch.Tensor, targets: torch.Tensor, weight: float, wants_hidden: bool,
                 params: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """One slice's mean loss (detached) and the gradients of its weighted loss: with respect to
    its hidden rows first where `wants_hidden`, then to `params`. A function of its own so that
    the slice's logits, local here, are freed on return, before the next slice makes its own."""
    with torch.enable_grad():
        x = x.detach().requires_grad_(wants_hidden)
        loss = _slice_loss(head, x, targets)
        grads = torch.autograd.grad(loss * weight, ((x,) if wants_hidden else ()) + params)
    return loss.detach(), grads


class _ChunkedHeadLoss(torch.autograd.Function):
    """Forward: the loss, with every slice's gradients computed and summed on the way.
    Backward: those gradients times the loss's incoming gradient."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, targets: torch.Tensor, head: nn.Module, chunks: int,
                *params: torch.Tensor) -> torch.Tensor:
        wants_hidden = ctx.needs_input_grad[0]
        ctx.params_needed = ctx.needs_input_grad[4:]
        wanted = tuple(p for p, needed in zip(params, ctx.params_needed) if needed)
        ctx.param_dtypes = [p.dtype for p in wanted]
        grad_hidden = hidden.new_empty(hidden.shape) if wants_hidden else None
        grad_rows = grad_hidden.view(-1, hidden.shape[-1]) if wants_hidden else None
        # The weighted means summed in fp64: with many slices an fp32 running sum would drift
        # by several roundings from the whole mean.
        total = hidden.new_zeros((), dtype=torch.float64)
        # fp32 sums of the slices' parameter gradients: each slice's comes in the parameter's
        # dtype (bf16 under FSDP2's mixed precision), and a bf16 running sum would lose bits.
        sums: list[Optional[torch.Tensor]] = [None] * len(wanted)
        start = 0
        for x, t, weight in token_slices(hidden.detach(), targets, chunks):
            loss, grads = _slice_grads(head, x, t, weight, wants_hidden, wanted)
            total += loss.double() * weight
            if wants_hidden:
                grad_rows[start : start + x.shape[0]].copy_(grads[0])
                grads = grads[1:]
            start += x.shape[0]
            for i, grad in enumerate(grads):
                sums[i] = grad.float() if sums[i] is None else sums[i].add_(grad)
        ctx.save_for_backward(grad_hidden, *sums)
        ctx.used = False
        return total.float()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        if ctx.used:
            raise RuntimeError("the chunked head loss (model.loss_chunks > 1) cannot be backpropagated twice "
                               "(retain_graph): its gradients were computed once, in the forward")
        ctx.used = True
        grad_hidden, *sums = ctx.saved_tensors
        # Scaled in place, no second weight-sized buffer: they belong to this loss alone, and a
        # second backward, which would find them scaled already, is refused above.
        if grad_hidden is not None:
            grad_hidden.mul_(grad_loss)
        scaled = iter([s.mul_(grad_loss).to(dtype) for s, dtype in zip(sums, ctx.param_dtypes)])
        param_grads = [next(scaled) if needed else None for needed in ctx.params_needed]
        return grad_hidden, None, None, None, *param_grads
