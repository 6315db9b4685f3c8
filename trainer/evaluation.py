"""The trainer's evaluation: each DP rank's share of the fixed eval batches, and the eval
metrics (held-out losses, max attention logits), through the pipeline where there is one."""
from __future__ import annotations

import torch

from eval.evaluate import attention_max_logits, eval_losses, max_logit_metrics
from data.loader import eval_batches
from parallel.fsdp import reshard
from trainer.simulation import one_rank as simulate

Batch = tuple[torch.Tensor, torch.Tensor]


def eval_sets(trainer) -> tuple[dict[str, list[Batch]], dict[str, int], Batch]:
    """Each DP rank evaluates its share of the fixed eval batches (round robin). Returns the
    sets, how many of each set's batches count (the rest pad), and the batch the max attention
    logits are read on."""
    t, e, mesh = trainer.cfg.trainer, trainer.cfg.eval, trainer.mesh
    sets, counted_by_set = {}, {}
    max_logit_batch = None
    for name, tokens in trainer.data.eval_sets.items():
        batches = eval_batches(tokens, t.seq_len, e.batch_size, e.batches)
        if name == "val":
            # Max attention logits are read on one fixed batch, the same on every rank.
            max_logit_batch = tuple(b.to(trainer.device) for b in batches[0])
        if e.sets is not None and name not in e.sets:
            continue
        mine = batches[mesh.dp_rank :: mesh.dp]
        counted = len(mine)
        if trainer.sharded or mesh.ep > 1:
            # Every forward is a collective under FSDP2 and EP: ranks with fewer batches
            # repeat one, uncounted, so that all run as many forwards.
            mine += [batches[0]] * (-(-len(batches) // mesh.dp) - len(mine))
        counted_by_set[name] = simulate.eval_counted(trainer.cfg, counted, len(mine))
        sets[name] = [(x.to(trainer.device), y.to(trainer.device)) for x, y in mine]
    return sets, counted_by_set, max_logit_batch


def evaluate(trainer) -> dict[str, float]:
    mesh, pipe = trainer.mesh, trainer.pipeline
    metrics = eval_losses(trainer.model, trainer.eval_sets, trainer.autocast, mesh.dp_group, trainer.eval_counted,
                          pipe.eval_loss if pipe is not None else None, mesh.pp_group)
    if pipe is not None:
        metrics.update(max_logit_metrics(pipe.max_logits(*trainer.max_logit_batch)))
    else:
        metrics.update(attention_max_logits(trainer.model, trainer.max_logit_batch[0], trainer.autocast,
                                            mesh.tp_group))
    if trainer.sharded:
        # Forwards without a backward leave FSDP2's root gathered (it keeps its parameters
        # to the backward): shard it again before anything reads or saves parameters.
        for root in trainer.fsdp_roots:
            reshard(root)
    return metrics
