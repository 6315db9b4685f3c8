"""Held-out loss on fixed batches, and the max attention logit on one of them."""
from __future__ import annotations

from typing import Callable, ContextManager, Optional

import torch
import torch.distributed as dist

from model.gpt import GPT
from parallel.comm import all_gather_object
from parallel.tp_ops import Group, all_reduce

Batch = tuple[torch.Tensor, torch.Tensor]


@torch.no_grad()
def eval_losses(
    model: GPT,
    eval_sets: dict[str, list[Batch]],
    autocast: Callable[[], ContextManager],
    dp_group: Group = None,
    counted: Optional[dict[str, int]] = None,
    loss_of: Optional[Callable[[torch.Tensor, torch.Tensor], Optional[torch.Tensor]]] = None,
    pp_group: Group = None,
) -> dict[str, float]:
    """Mean loss over each set's fixed batches, as {"val/<set>/loss": value}.

    Under data parallelism each rank holds a share of every set's batches; the sums and
    counts are all-reduced once for all sets together. `counted[set]`: only that many of
    the set's batches count, the rest are padding that keeps the ranks' forwards in step
    (under FSDP2 every forward is a collective).

    Under a pipeline `loss_of(x, y)` runs a batch through it (every rank of the pp group
    together) and gives the loss on the last stage's rank, None on the others: the sums are
    then reduced over the pp group too.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    totals = torch.zeros(len(eval_sets), 2, device=device)  # [loss sum, batch count] per set
    for i, (name, batches) in enumerate(eval_sets.items()):
        real = len(batches) if counted is None else counted[name]
        for j, (x, y) in enumerate(batches):
            if loss_of is not None:
                loss = loss_of(x, y)
                if loss is None:
                    continue
            else:
                with autocast():
                    loss = model(x, y).float()
            if j < real:
                totals[i, 0] += loss
                totals[i, 1] += 1
    model.train(was_training)
    totals = all_reduce(all_reduce(totals, dp_group), pp_group)
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
    return max_logit_metrics(all_reduce(torch.stack(per_layer).float(), tp_group, op=dist.ReduceOp.MAX))


def max_logit_metrics(maxima: torch.Tensor) -> dict[str, float]:
    """[n_layers] maxima as the attn/max_logit/layer_<i> metrics (one device-to-host transfer)."""
    return {f"attn/max_logit/layer_{i}": v for i, v in enumerate(maxima.tolist())}


def gather_stage_metrics(stats: dict[str, torch.Tensor | float], pp_group: Group) -> dict[str, float | torch.Tensor]:
    """Metrics that each pipeline stage has for its own layers (the MoE layers' loads), from
    every stage, for rank 0 to log: one object gather over the pp group on a logging step.
    Without a pipeline the metrics as they are."""
    if pp_group is None:
        return stats
    mine = {k: float(v) for k, v in stats.items()}
    merged: dict[str, float | torch.Tensor] = {}
    for part in all_gather_object(mine, pp_group, "pp"):
        merged.update(part)
    return merged
