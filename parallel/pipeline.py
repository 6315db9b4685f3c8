"""Pipeline parallelism: torch.distributed.pipelining's stages and schedules over the mesh's
`pp` group, with every send and receive counted (comm/pp/send_bytes, comm/pp/recv_bytes).

Nothing here schedules: torch's schedules decide the order of the forwards and backwards.
This file says which stages a rank holds (`stage_ids`), which schedule a name means and what
it needs (`check_schedule`), and wraps the two runs a trainer asks of a pipeline: a training
step (forward and backward of every micro-batch, the loss on the last stage) and an
evaluation (forward only).

A rank holds `stages_per_rank` stages. Single-stage schedules (gpipe, 1f1b) place stage s on
rank s. The looped ones (interleaved_1f1b, interleaved_zero_bubble) place stage s on rank
s mod pp, and the V schedule (zbv) places rank r's two stages at r and 2 pp - 1 - r, so the
first and last stage share rank 0.

Pipeline parallelism's other pieces: model/pipeline_split.py (the GPT cut into stages);
trainer/pipeline.py (the trainer's side: checks, the loss, the runs); planning/pipeline_plan.py
(what a schedule costs: bubble, memory, bytes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    FORWARD,
    PipelineScheduleMulti,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
    _Action,
    _add_send_recv,
    _add_unshard_reshard,
    _PipelineSchedule,
    _PipelineScheduleRuntime,
)
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

from parallel.comm import COUNTER

SCHEDULES: dict[str, type[_PipelineSchedule]] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "interleaved_zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}
SINGLE_STAGE = ("gpipe", "1f1b")
# Schedules that split a backward into its input-gradient and weight-gradient halves: they
# need the eager autograd graph of each stage, which a compiled block does not expose.
SPLIT_BACKWARD = ("interleaved_zero_bubble", "zbv")


def stage_ids(schedule: str, pp: int, pp_rank: int, stages_per_rank: int) -> list[int]:
    """The pipeline stages rank `pp_rank` holds, in the order it runs their forwards."""
    if schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(stages_per_rank)]


def check_schedule(schedule: str, pp: int, microbatches: int, stages_per_rank: int, compiled: bool) -> None:
    """Raise ValueError, one line naming the keys, for a schedule that cannot run what the
    parallel.pp_* keys ask (torch would fail only at the first step, some ranks later than
    others)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"parallel.pp_schedule={schedule!r}: unknown schedule (expected one of "
                         f"{', '.join(SCHEDULES)})")
    if stages_per_rank < 1:
        raise ValueError(f"parallel.pp_stages_per_rank={stages_per_rank} must be at least 1")
    if microbatches < 1:
        raise ValueError(f"parallel.pp_microbatches={microbatches} must be at least 1")
    if schedule in SINGLE_STAGE and stages_per_rank != 1:
        raise ValueError(f"parallel.pp_schedule={schedule} holds one stage per rank, not "
                         f"parallel.pp_stages_per_rank={stages_per_rank} (the looped schedules interleaved_1f1b "
                         "and interleaved_zero_bubble hold several)")
    if schedule == "zbv" and stages_per_rank != 2:
        raise ValueError(f"parallel.pp_schedule=zbv holds exactly 2 stages per rank (a V), not "
                         f"parallel.pp_stages_per_rank={stages_per_rank}")
    if schedule == "zbv" and microbatches < 2 * pp - 1:
        raise ValueError(f"parallel.pp_schedule=zbv needs parallel.pp_microbatches={microbatches} to be at least "
                         f"2 x parallel.pp - 1 = {2 * pp - 1} (its V fills with that many)")
    if schedule == "1f1b" and microbatches < pp:
        raise ValueError(f"parallel.pp_schedule=1f1b needs parallel.pp_microbatches={microbatches} to be at least "
                         f"parallel.pp={pp} (a micro-batch in flight per stage)")
    if schedule.startswith("interleaved"):
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            raise ValueError(f"parallel.pp_schedule={schedule} runs micro-batches in rounds of parallel.pp={pp}: "
                             f"parallel.pp_microbatches={microbatches} must be a multiple of {rounds} (try "
                             f"{rounds * pp} or {pp})")
    if compiled and schedule in SPLIT_BACKWARD:
        raise ValueError(f"parallel.pp_schedule={schedule} splits each backward into input and weight gradients, "
                         "which compiled blocks do not allow: set trainer.compile=false or parallel.pp_schedule="
                         "1f1b or interleaved_1f1b")


class ForwardOnlyV(_PipelineScheduleRuntime):
    """Forward only, over stages in a V placement (rank r holds stages r and 2 pp - 1 - r):
    each rank runs every micro-batch through its first stage, then through its second, with
    torch's runtime adding the sends and receives. torch's ZBV schedule cannot evaluate (its
    eval() fails on a stage that has no backward, and the other ranks then wait forever), so a
    zbv pipeline evaluates with this order over the same stages."""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int,
                 loss_fn: Optional[Callable[..., torch.Tensor]] = None, scale_grads: bool = False) -> None:
        super().__init__(stages, n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
        pp = self.pp_group_size
        self.stage_index_to_group_rank = generate_stage_to_rank_mapping(pp, self._num_stages, style="v")
        for stage in self._stages:
            stage.stage_index_to_group_rank = self.stage_index_to_group_rank
        order = {rank: [_Action(stage, FORWARD, mb) for stage in (rank, 2 * pp - 1 - rank)
                        for mb in range(n_microbatches)] for rank in range(pp)}
        # torch's lowering of a compute-only order, less its validation (which wants a backward
        # of every forward) and its gradient reduction: FSDP2's gathers, then the sends and
        # receives between ranks.
        order = {rank: _add_unshard_reshard(actions) for rank, actions in order.items()}
        self.pipeline_order_with_comms = _add_send_recv(order, stage_to_rank=lambda s: self.stage_index_to_group_rank[s],
                                                        num_stages=self._num_stages)


# What evaluates a pipeline whose schedule cannot run forward only.
FORWARD_ONLY = {"zbv": ForwardOnlyV}


class CountedStage(PipelineStage):
    """A PipelineStage whose sends and receives are counted as the mesh's `pp` traffic: the
    bytes of every activation and gradient this rank sends and receives (one call each)."""

    def _counted(self, ops: list[dist.P2POp]) -> list[dist.P2POp]:
        for op in ops:
            kind = "send" if op.op is dist.isend else "recv"
            COUNTER.record(self.group, kind, op.tensor.numel() * op.tensor.element_size(), 0.0)
        return ops

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._counted(super().get_fwd_recv_ops(fwd_chunk_id))

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._counted(super().get_bwd_recv_ops(bwd_chunk_id))

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._counted(super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._counted(super().get_bwd_send_ops(bwd_chunk_id))


@dataclass
class PipelineSpec:
    """What a pipeline is: its schedule, its size and this rank's place in it."""

    schedule: str
    pp: int
    microbatches: int
    stages_per_rank: int = 1

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank


class Pipeline:
    """This rank's stages of one pipeline and a schedule to run them.

    `modules[i]` runs stage `ids[i]`. `loss_fn(output, target)` is the last stage's loss of
    one micro-batch; it returns what the backward starts from (the caller decides its scale:
    the schedule does not divide the gradients, so accumulating over several steps adds up).
    Every rank of the pp group calls `train` and `evaluate` together with the same batch shape.
    """

    def __init__(self, spec: PipelineSpec, modules: list[nn.Module], ids: list[int], device: torch.device,
                 group: dist.ProcessGroup, loss_fn: Optional[Callable[..., torch.Tensor]],
                 input_args: list[tuple[torch.Tensor, ...]], output_args: list[tuple[torch.Tensor, ...]],
                 forward_only: bool = False) -> None:
        """`input_args[i]` and `output_args[i]`: tensors (meta ones will do) of the shapes and
        dtypes stage `ids[i]` takes and gives for one micro-batch. Given, torch infers nothing:
        its inference runs every stage once, forward and backward, on uninitialised tensors.
        `forward_only`: a pipeline for evaluate() alone (a schedule that cannot evaluate is
        replaced by one that runs the same stages forward only)."""
        self.stages = [CountedStage(m, i, spec.num_stages, device, input_args=a, output_args=o, group=group)
                       for m, i, a, o in zip(modules, ids, input_args, output_args)]
        cls = FORWARD_ONLY.get(spec.schedule, SCHEDULES[spec.schedule]) if forward_only else SCHEDULES[spec.schedule]
        stages = self.stages if issubclass(cls, PipelineScheduleMulti) else self.stages[0]
        self.schedule = cls(stages, spec.microbatches, loss_fn=loss_fn, scale_grads=False)

    @property
    def has_first(self) -> bool:
        return any(stage.is_first for stage in self.stages)

    @property
    def has_last(self) -> bool:
        return any(stage.is_last for stage in self.stages)

    def _run(self, run: Callable, x: torch.Tensor, y: torch.Tensor) -> Optional[list[torch.Tensor]]:
        losses: Optional[list[torch.Tensor]] = [] if self.has_last else None
        args = (x,) if self.has_first else ()
        run(*args, target=y if self.has_last else None, losses=losses, return_outputs=False)
        return losses

    def train(self, x: torch.Tensor, y: torch.Tensor) -> Optional[list[torch.Tensor]]:
        """Forward and backward of every micro-batch of (x, y); the gradients accumulate in the
        stages' parameters. Returns the micro-batches' losses (as loss_fn returned them) on the
        rank that holds the last stage, None elsewhere."""
        return self._run(self.schedule.step, x, y)

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> Optional[list[torch.Tensor]]:
        """Forward only; the micro-batches' losses on the last stage's rank, None elsewhere."""
        return self._run(self.schedule.eval, x, y)
