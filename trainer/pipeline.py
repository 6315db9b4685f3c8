"""The trainer's side of pipeline parallelism (parallel.pp > 1): which stages and layers this
rank holds, the checks of the parallel.pp_* keys, and the training and evaluation runs through
torch's schedules (parallel/pipeline.py) with the loss, the auxiliary losses and the health
statistics of every stage brought together.

Every rank of a pipeline (the mesh's pp group) loads the same batch: the first stage reads its
tokens, the last its targets. The loss lives on the last stage; each training step sums it over
the pp group (one scalar), so every rank holds the step's loss and the rest of the loop (the
loss window, the skip decision) runs unchanged.

Pipeline parallelism's other pieces: parallel/pipeline.py (the stages and schedules over the pp
group); model/pipeline_split.py (the GPT cut into stages); planning/pipeline_plan.py (what a
schedule costs: bubble, memory, bytes).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, ContextManager, Optional

import torch
import torch.distributed as dist

from model.gpt import GPT
from model.pipeline_split import StageModule, blocks_per_stage, stage_layers
from parallel.comm import all_gather_object, all_reduce
from parallel.mesh import Mesh
from parallel.pipeline import Pipeline, PipelineSpec, check_schedule, stage_ids
from trainer.config import TrainConfig


def merged_over(counts: Counter, pp_group) -> Counter:
    """The sum of every pipeline rank's `counts` (one object gather; `counts` itself without a
    pipeline): what a start-up decision that all ranks take together must cover, where each
    stage holds other layers (a stage may hold none of a kind)."""
    if pp_group is None:
        return counts
    return sum((Counter(part) for part in all_gather_object(counts, pp_group, "setup")), Counter())


def pipeline_spec(cfg: TrainConfig) -> PipelineSpec:
    p = cfg.parallel
    return PipelineSpec(p.pp_schedule, p.pp, p.pp_microbatches or cfg.trainer.batch_size, p.pp_stages_per_rank)


def stage_keys(cfg: TrainConfig) -> str:
    p = cfg.parallel
    if p.pp_schedule == "zbv" or p.pp_stages_per_rank > 1:
        return f"parallel.pp={p.pp} x parallel.pp_stages_per_rank={p.pp_stages_per_rank}"
    return f"parallel.pp={p.pp}"


def check_pipeline(cfg: TrainConfig) -> None:
    """Raise ValueError, one line naming the keys, for a pipeline the config cannot run. No-op
    without one (parallel.pp=1), where the pp_* keys must keep their defaults."""
    p, t = cfg.parallel, cfg.trainer
    if p.pp == 1:
        if p.pp_layers_per_stage:
            raise ValueError(f"parallel.pp_layers_per_stage={list(p.pp_layers_per_stage)} needs a pipeline "
                             "(parallel.pp > 1)")
        return
    spec = pipeline_spec(cfg)
    if p.simulate_world:
        raise ValueError(f"parallel.pp={p.pp} with parallel.simulate_world={p.simulate_world}: a dry run of one "
                         "pipeline rank is not supported (its sends and receives need the other stages)")
    if p.pp_microbatches < 0:
        raise ValueError(f"parallel.pp_microbatches={p.pp_microbatches} must be at least 1 (0: trainer.batch_size, "
                         "one sequence each)")
    check_schedule(spec.schedule, spec.pp, spec.microbatches, spec.stages_per_rank, t.compile)
    if t.batch_size % spec.microbatches:
        raise ValueError(f"trainer.batch_size={t.batch_size} does not split into parallel.pp_microbatches="
                         f"{spec.microbatches} micro-batches of equal size")
    if cfg.eval.batch_size % spec.microbatches:
        raise ValueError(f"eval.batch_size={cfg.eval.batch_size} does not split into parallel.pp_microbatches="
                         f"{spec.microbatches} micro-batches (evaluation runs through the pipeline too)")
    blocks_per_stage(cfg.model.n_layers, spec.num_stages, list(p.pp_layers_per_stage), stage_keys(cfg))


@dataclass(frozen=True)
class StagePlan:
    """The stages one rank holds and the blocks each runs."""

    spec: PipelineSpec
    ids: list[int]
    layers: list[list[int]]  # per held stage, its block indices

    @property
    def holds_first(self) -> bool:
        return 0 in self.ids

    @property
    def holds_last(self) -> bool:
        return self.spec.num_stages - 1 in self.ids

    @property
    def blocks(self) -> list[int]:
        return sorted(i for layers in self.layers for i in layers)


def stage_plan(cfg: TrainConfig, pp_rank: int) -> StagePlan:
    spec = pipeline_spec(cfg)
    counts = blocks_per_stage(cfg.model.n_layers, spec.num_stages, list(cfg.parallel.pp_layers_per_stage),
                              stage_keys(cfg))
    every = stage_layers(counts)
    ids = stage_ids(spec.schedule, spec.pp, pp_rank, spec.stages_per_rank)
    return StagePlan(spec, ids, [every[i] for i in ids])


def pipeline_record(cfg: TrainConfig) -> dict:
    """The pipeline as environment.json's layout records it (trainer/run/environment.py): its schedule,
    stages per rank, micro-batches and blocks per stage (what parallel.pp_layers_per_stage
    would set), each stage's in stage order."""
    spec = pipeline_spec(cfg)
    return {"pp_schedule": spec.schedule, "pp_stages_per_rank": spec.stages_per_rank,
            "pp_microbatches": spec.microbatches,
            "pp_layers_per_stage": blocks_per_stage(cfg.model.n_layers, spec.num_stages,
                                                    list(cfg.parallel.pp_layers_per_stage), stage_keys(cfg))}


def stage_modules(model: GPT, plan: StagePlan) -> list[StageModule]:
    last = plan.spec.num_stages - 1
    return [StageModule(model, layers, i == 0, i == last) for i, layers in zip(plan.ids, plan.layers)]


def activation_dtype(cfg: TrainConfig) -> torch.dtype:
    """The dtype of the hidden state between stages: the residual stream stays in the
    embedding's dtype, fp32 unless FSDP2 computes in bf16 (trainer.precision=bf16 with
    dp_shard > 1 casts the weights, the embedding's too)."""
    if cfg.trainer.precision == "bf16" and cfg.parallel.dp_shard > 1:
        return torch.bfloat16
    return torch.float32


class PipelineRun:
    """This rank's stages, with a training pipeline and (built at the first evaluation) a
    forward-only one of the evaluation batches' shape."""

    def __init__(self, cfg: TrainConfig, model: GPT, stages: list[StageModule], plan: StagePlan, mesh: Mesh,
                 device: torch.device, autocast: Callable[[], ContextManager]) -> None:
        self.cfg, self.model, self.stages, self.plan, self.mesh, self.device = cfg, model, stages, plan, mesh, device
        self.autocast = autocast
        t = cfg.trainer
        # Each micro-batch's loss starts its backward scaled by 1 / (micro-batches x
        # accumulation): the gradients add up to those of the step's mean loss.
        self.loss_scale = 1.0 / (plan.spec.microbatches * t.grad_accum)
        for stage in stages:
            stage.aux_scale = self.loss_scale
            stage.autocast = autocast
        self.train_pipe = self._pipeline(t.batch_size, self._scaled_loss, forward_only=False)
        self.eval_pipe: Optional[Pipeline] = None

    def _pipeline(self, batch: int, loss_fn: Callable, forward_only: bool) -> Pipeline:
        spec = self.plan.spec
        micro = batch // spec.microbatches
        seq = self.cfg.trainer.seq_len
        # Shapes given, not inferred: torch's inference would run each stage once on empty
        # tensors, and those forwards would count in the MoE loads and output statistics.
        # The hidden state carries gradients back between stages (requires_grad tells torch so).
        hidden = torch.empty(micro, seq, self.model.cfg.d_model, dtype=activation_dtype(self.cfg), device="meta",
                             requires_grad=True)
        tokens = torch.empty(micro, seq, dtype=torch.long, device="meta")
        return Pipeline(spec, self.stages, self.plan.ids, self.device, self.mesh.pp_group, loss_fn,
                        input_args=[(tokens,) if i == 0 else (hidden,) for i in self.plan.ids],
                        output_args=[(hidden,)] * len(self.stages), forward_only=forward_only)

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            return self.model.head_loss(x, y)

    def _scaled_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._loss(x, y) * self.loss_scale

    def train_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Forward and backward of the step's accumulation batches through the pipeline; returns
        the step's mean loss (the auxiliary losses of every stage included), the same on every
        rank of the pipeline."""
        total = torch.zeros((), device=self.device)
        for x, y in batches:
            losses = self.train_pipe.train(x, y)
            if losses:
                total += torch.stack([loss.detach().float() for loss in losses]).sum()
        for stage in self.stages:
            aux = stage.pop_aux_sum()
            if aux is not None:
                total += aux
        return all_reduce(total, self.mesh.pp_group)

    def per_rank(self, name: str, value: float) -> dict[str, float]:
        """`value` of every rank of the pipeline, as <name>/pp_rank_<r> (a logging step's gather)."""
        values = all_gather_object(value, self.mesh.pp_group, "pp")
        return {f"{name}/pp_rank_{r}": v for r, v in enumerate(values)}

    def _eval_pipe(self) -> Pipeline:
        if self.eval_pipe is None:
            self.eval_pipe = self._pipeline(self.cfg.eval.batch_size, self._loss, forward_only=True)
        return self.eval_pipe

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> Optional[torch.Tensor]:
        """The mean loss of batch (x, y) on the rank of the last stage, None elsewhere."""
        losses = self._eval_pipe().evaluate(x, y)
        return torch.stack([loss.float() for loss in losses]).mean() if losses else None

    @torch.no_grad()
    def max_logits(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """[n_layers] each block's largest attention logit on batch x, over the whole pipeline
        and TP (-inf at no layer: every layer is some stage's)."""
        for stage in self.stages:
            stage.max_logits = {}
        was_training = self.model.training
        self.model.eval()  # no routing counts, no auxiliary loss: this forward is not training
        try:
            self._eval_pipe().evaluate(x, y)
            out = torch.full((self.model.cfg.n_layers,), float("-inf"), device=self.device)
            for stage in self.stages:
                for layer, values in stage.max_logits.items():
                    out[layer] = torch.stack(values).float().max()
        finally:
            self.model.train(was_training)
            for stage in self.stages:
                stage.max_logits = None
        out = all_reduce(out, self.mesh.tp_group, op=dist.ReduceOp.MAX)
        return all_reduce(out, self.mesh.pp_group, op=dist.ReduceOp.MAX)
