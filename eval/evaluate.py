"""Held-out loss on fixed batches, and the max attention logit on one of them."""
from __future__ import annotations

from typing import Callable, ContextManager, Optional

import torch
import torch.distributed as dist

from model.gpt import GPT
from parallel.tp_ops import Group, all_reduce

Batch = tuple[torch.Tensor, torch.Tensor]


@torch.no_grad()
def eval_losses(
    model: GPT,
    eval_sets: dict[str, list[Batch]],
    autocast: Callable[[], ContextManager],
    dp_group: Group = None,
    counted: Optional[dict[str, int]] = None,
) -> dict[str, float]:
    """Mean loss over each set's fixed batches, as {"val/<set>/loss": value}.

    Under data parallelism each rank holds a share of every set's batches; the sums and
    counts are all-reduced once for all sets together. `counted[set]`: only that many of
    the set's batches count, the rest are padding that keeps the ranks' forwards in step
    (under FSDP2 every forward is a collective).
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    totals = torch.zeros(len(eval_sets), 2, device=device)  # [loss sum, batch count] per set
    for i, (name, batches) in enumerate(eval_sets.items()):
        real = len(batches) if counted is None else counted[name]
        for j, (x, y) in enumerate(batches):
            with autocast():
                loss = model(x, y).float()
            if j < real:
                totals[i, 0] += loss
                totals[i, 1] += 1
    model.train(was_training)
    totals = all_reduce(totals, dp_group)
    values = (totals[:, 0] / totals[:, 1]).tolist()  # one device-to-host transfer
    return {f"val/{name}/loss": v for name, v in zip(eval_sets, values)}


@torch.no_grad()
def attention_max_logits(
    model: GPT,
    x: torch.Tensor,
    autocast: Callable[[], ContextManager],
    tp_group: Group = None,
) -> dict[str, float]:
    """Largest pre-softmax attention logit of each layer on batch `x`.

    Under TP each rank holds some of the heads, so the maxima are all-reduced over TP.
    """
    was_training = model.training
    model.eval()
    per_layer: list[torch.Tensor] = []
    with autocast():
        model(x, max_logit_out=per_layer)
    model.train(was_training)
    maxima = all_reduce(torch.stack(per_layer).float(), tp_group, op=dist.ReduceOp.MAX)
    return {f"attn/max_logit/layer_{i}": v for i, v in enumerate(maxima.tolist())}
