"""A GPT cut into pipeline stages by layer, with the whole model's parameter names kept.

Which layers a stage runs: the embedding counts as one layer on the first stage and the final
norm, head and loss as one on the last (torchtitan's default), and the n_layers + 2 layers are
split evenly, or by an explicit list of blocks per stage (parallel.pp_layers_per_stage).

A rank keeps one GPT holding only its stages' parts (`keep_stages`): the blocks it runs stay
under their own index (`blocks.3.attn.wq.weight` at every pp), the embedding only where the
first stage is, the final norm and head only where the last is. Checkpoints, the routing of
parameters to Muon or AdamW and the metrics therefore name the same parameters at every
layout. Each stage is a `StageModule` over that GPT's modules: what torch's PipelineStage runs.

Pipeline parallelism's other pieces: parallel/pipeline.py (the stages and schedules over the pp
group); trainer/pipeline.py (the trainer's side: checks, the loss, the runs);
planning/pipeline_plan.py (what a schedule costs: bubble, memory, bytes).
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Iterator, Optional

import torch
from torch import nn

from model.gpt import GPT


def balanced_split(n_layers: int, n_stages: int) -> Optional[list[int]]:
    """Blocks per stage when the embedding and the head count as a layer each and the
    n_layers + 2 layers split evenly; None where they do not divide."""
    total = n_layers + 2
    if total % n_stages:
        return None
    per = total // n_stages
    counts = [per] * n_stages
    counts[0] -= 1
    counts[-1] -= 1
    return counts if min(counts) >= 0 else None


def nearest_split(n_layers: int, n_stages: int) -> list[int]:
    """The most even split of the n_layers + 2 layers (embedding and head as one each), for the
    message that suggests an explicit one."""
    total = n_layers + 2
    sizes = [total // n_stages + (1 if i < total % n_stages else 0) for i in range(n_stages)]
    sizes = sizes[1:] + sizes[:1]  # the extra layers go to the middle stages, away from the ends
    sizes[0] -= 1
    sizes[-1] -= 1
    return sizes


def blocks_per_stage(n_layers: int, n_stages: int, explicit: list[int], stage_keys: str) -> list[int]:
    """How many blocks each of the `n_stages` stages runs, or ValueError in one line naming the
    keys (`stage_keys` says how the stage count came about)."""
    if explicit:
        # Checked first: a negative count can make the sum come out right ([-1, 3] for 2 layers),
        # and the message about the sum would then blame a sum that holds.
        negative = [n for n in explicit if n < 0]
        if negative:
            raise ValueError(f"parallel.pp_layers_per_stage={list(explicit)}: a stage's block count cannot be "
                             f"negative ({', '.join(map(str, negative))}); each stage runs 0 or more blocks")
        if len(explicit) != n_stages or sum(explicit) != n_layers:
            raise ValueError(f"parallel.pp_layers_per_stage={list(explicit)} must list {n_stages} block counts "
                             f"({stage_keys}) that add up to model.n_layers={n_layers}")
        return list(explicit)
    counts = balanced_split(n_layers, n_stages)
    if counts is None:
        raise ValueError(f"{stage_keys} = {n_stages} stages do not divide model.n_layers={n_layers} + 2 (the "
                         "embedding and the head count as a layer each): choose another parallel.pp, or set "
                         f"parallel.pp_layers_per_stage={nearest_split(n_layers, n_stages)}")
    return counts


def stage_layers(counts: list[int]) -> list[list[int]]:
    """The block indices of each stage, from the block counts."""
    out, start = [], 0
    for n in counts:
        out.append(list(range(start, start + n)))
        start += n
    return out


class HeldBlocks(nn.ModuleDict):
    """The blocks a rank holds, each under its index in the whole model. Iterates over the
    blocks (like the ModuleList it replaces); `named_children()` gives (index, block)."""

    def __iter__(self) -> Iterator[nn.Module]:  # type: ignore[override]
        return iter(self.values())


def keep_stages(model: GPT, layers: list[int], first: bool, last: bool) -> GPT:
    """Drop from `model` (in place) what this rank's stages do not run: the blocks outside
    `layers`, the embedding unless it holds the first stage, the final norm and head unless it
    holds the last. Call on the meta model, before anything shards it."""
    model.blocks = HeldBlocks({str(i): model.blocks[i] for i in layers})
    if not first:
        model.embed = None
    if not last:
        model.final_norm = None
        model.head = None
    return model


class AuxLossGradient(torch.autograd.Function):
    """Pass the hidden state through unchanged, and start the backward of an auxiliary loss
    computed on this stage (the MoE balance loss) with gradient `scale`: under a pipeline the
    loss that reaches the backward is the last stage's, so a loss of another stage joins the
    backward where its layer is."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad.device), None


class StageModule(nn.Module):
    """One pipeline stage of `model` (a GPT that keep_stages cut): the embedding where it is
    the first stage, blocks `layers`, and the final norm where it is the last. Its output is the
    hidden state (normed on the last stage): the head and the loss run in the schedule's loss
    function (GPT.head_loss), so chunked and vocabulary-parallel losses work as they do without
    a pipeline. The head is registered here too, so that the stage's parameters are all of those
    it trains."""

    def __init__(self, model: GPT, layers: list[int], first: bool, last: bool) -> None:
        super().__init__()
        self.embed = model.embed if first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[str(i)] for i in layers})
        self.final_norm = model.final_norm if last else None
        self.head = model.head if last else None
        # Not a submodule: its parameters are this stage's own submodules above (and the other
        # stages' of this rank). It holds the rope tables and the output-RMS sums.
        self.__dict__["model"] = model
        # Gradient the schedule's backward gives each auxiliary loss: 1 / (micro-batches x
        # accumulation), like the loss's own scale (set by the trainer).
        self.aux_scale = 1.0
        # The auxiliary losses of this stage's forwards since the last read (detached, scaled).
        self.aux_sum: Optional[torch.Tensor] = None
        # Set to a dict to collect each block's max attention logit per forward (evaluation).
        self.max_logits: Optional[dict[int, list[torch.Tensor]]] = None
        # The forward's autocast (trainer.precision): the schedule calls forward itself.
        self.autocast: Callable[[], ContextManager] = contextlib.nullcontext

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        model = self.model
        if self.embed is not None:
            x = self.embed(x)
        seq = x.shape[1]
        cos, sin = model.rope_cos[:seq], model.rope_sin[:seq]
        for name, block in self.blocks.items():
            layer = int(name)
            logits: Optional[list[torch.Tensor]] = [] if self.max_logits is not None else None
            x = block(x, cos, sin, logits)
            if logits:
                self.max_logits.setdefault(layer, []).extend(logits)
            aux = getattr(block.mlp, "aux_loss", None)
            if aux is not None and torch.is_grad_enabled():
                x = AuxLossGradient.apply(x, aux, self.aux_scale)
                scaled = aux.detach().float() * self.aux_scale
                self.aux_sum = scaled if self.aux_sum is None else self.aux_sum + scaled
            model.track_output(layer, x)
        if self.final_norm is not None:
            x = self.final_norm(x)
            model.track_output(model.cfg.n_layers, x)
        return x

    def pop_aux_sum(self) -> Optional[torch.Tensor]:
        out, self.aux_sum = self.aux_sum, None
        return out
