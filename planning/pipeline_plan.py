"""What a pipeline costs, per schedule: the idle share of a step (the bubble), how many
micro-batches' activations a stage holds at its peak, and the bytes each rank sends between
stages. The pipeline rows of lab/scaling.md come from here (scripts/plan/pp_plan.py).

Units. p stages deep (parallel.pp), v stages per rank (parallel.pp_stages_per_rank), m
micro-batches per pipeline run (parallel.pp_microbatches). A micro-batch's forward plus backward
through one rank's layers takes time t; the ideal step (no pipeline idling) is m t.

- gpipe and 1f1b: the last rank starts p - 1 forwards late and the first ends p - 1 backwards
  early, so each rank idles (p - 1) t of a step of (m + p - 1) t (Huang et al. 2019; Narayanan et
  al. 2021 for 1F1B, whose bubble is GPipe's and whose memory is not).
- interleaved_1f1b: each rank's layers are v chunks of t / v, and the idle time shrinks to
  (p - 1) t / v (Narayanan et al. 2021, the interleaved schedule).
- interleaved_zero_bubble: the backward is split into its input-gradient and weight-gradient
  halves and the weight halves fill the idle slots. With forward, input-gradient and
  weight-gradient work of equal length (t / 3 each), the schedule idles a third of the
  interleaved 1F1B bubble (Qi et al. 2023, ZB-H1: (p - 1)(T_F + T_B - T_W)).

Pipeline parallelism's other pieces: parallel/pipeline.py (the stages and schedules over the pp
group); model/pipeline_split.py (the GPT cut into stages); trainer/pipeline.py (the trainer's
side: checks, the loss, the runs).
"""
from __future__ import annotations

from dataclasses import dataclass

PLANNED_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble")


def bubble_time(schedule: str, pp: int, stages_per_rank: int = 1) -> float:
    """A rank's idle time per step, in units of t (one micro-batch's forward and backward
    through the rank's layers)."""
    if schedule not in PLANNED_SCHEDULES:
        raise ValueError(f"no bubble model for schedule {schedule!r} (planned: {', '.join(PLANNED_SCHEDULES)})")
    idle = float(pp - 1)
    if schedule.startswith("interleaved"):
        idle /= stages_per_rank
    if schedule == "interleaved_zero_bubble":
        idle /= 3.0
    return idle


def bubble_fraction(schedule: str, pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """The share of a step a rank idles: bubble / (m + bubble)."""
    idle = bubble_time(schedule, pp, stages_per_rank)
    return idle / (microbatches + idle)


def in_flight(schedule: str, pp: int, microbatches: int, pp_rank: int = 0, stages_per_rank: int = 1) -> float:
    """Micro-batches whose activations rank `pp_rank` holds at its peak, in units of one
    micro-batch through all of the rank's layers.

    gpipe runs every forward before any backward: m. 1f1b starts a backward as soon as the
    last stage can: rank r holds p - r (at most m). The interleaved schedules warm up with
    2 (p - r - 1) + (v - 1) p chunk forwards and hold one more in the steady state
    (torch's and Megatron's warm-up count), each chunk a 1/v of the rank's layers.
    """
    if schedule == "gpipe":
        return float(microbatches)
    if schedule == "1f1b":
        return float(min(microbatches, pp - pp_rank))
    if schedule.startswith("interleaved"):
        v = stages_per_rank
        chunks = min(microbatches * v, 2 * (pp - pp_rank - 1) + (v - 1) * pp + 1)
        return chunks / v
    raise ValueError(f"no memory model for schedule {schedule!r} (planned: {', '.join(PLANNED_SCHEDULES)})")


def sends_per_microbatch(pp: int, pp_rank: int, stages_per_rank: int = 1) -> int:
    """Tensors rank `pp_rank` sends per micro-batch under a looped placement (stage s on rank
    s mod pp): each of its stages but the last sends its output forward, each but the first
    sends its input's gradient back. It receives as many."""
    stages = [pp_rank + k * pp for k in range(stages_per_rank)]
    last = pp * stages_per_rank - 1
    return sum(s != last for s in stages) + sum(s != 0 for s in stages)


def p2p_bytes(pp: int, pp_rank: int, microbatches: int, micro_batch: int, seq_len: int, d_model: int,
              act_bytes: int, stages_per_rank: int = 1) -> int:
    """Bytes rank `pp_rank` sends per pipeline run (and receives: the same), every tensor a
    hidden state or its gradient of [micro_batch, seq_len, d_model]."""
    return microbatches * sends_per_microbatch(pp, pp_rank, stages_per_rank) * micro_batch * seq_len * d_model * act_bytes


@dataclass(frozen=True)
class PipelineCost:
    """One schedule at one pipeline shape, for the planner's table."""

    schedule: str
    pp: int
    microbatches: int
    stages_per_rank: int

    @property
    def bubble(self) -> float:
        return bubble_fraction(self.schedule, self.pp, self.microbatches, self.stages_per_rank)

    @property
    def peak_in_flight(self) -> float:
        """Rank 0's peak (it holds the most)."""
        return in_flight(self.schedule, self.pp, self.microbatches, 0, self.stages_per_rank)

    def step_time(self, busy_s: float, p2p_s: float) -> float:
        """A step of `busy_s` of work per rank (m micro-batches through its layers) and `p2p_s`
        of transfers not hidden behind compute (the first and last hops of each run)."""
        return busy_s / (1.0 - self.bubble) + p2p_s
