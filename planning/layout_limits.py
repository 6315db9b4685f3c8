"""How large a layout the memory planner, the FakeTensor estimate and a simulation take.

Both dry runs do work for every rank of the layout (FSDP2 cuts every parameter into one chunk
per shard rank, empty ones included; the Muon owner plans and ZeRO-1's buffers are made per
rank), so a mistyped size (`--dp-shard 1000000`) would run for minutes while its memory grows,
and then answer for a layout nobody can run. Two bounds, each with its reason:
- FSDP2 shards every parameter by rows (dim 0): with more shard ranks than the model's largest
  parameter has rows (as a TP rank holds it), every rank past that holds nothing at all;
- at most MAX_WORLD ranks in all: 2^17 = 131072, beyond the largest GPU clusters of today (about
  100k GPUs), so a larger world is a typo, not a plan.
"""
from __future__ import annotations

from typing import Optional

from planning.memory_plan import local_params
from model.config import ModelConfig
from parallel.mesh import Layout

MAX_WORLD = 1 << 17


def widest_parameter(model: ModelConfig, tp: int, ep: int = 1) -> tuple[str, int]:
    """(family, rows) of the parameter with the most rows as a TP rank (and under EP an expert
    rank) holds it: the most shard ranks FSDP2 can give a row each."""
    widest = max(local_params(model, tp, ep), key=lambda p: p.shape[0])
    return widest.kind, widest.shape[0]


def oversized(model: ModelConfig, layout: Layout, dp_shard_typed: str, world_typed: str) -> Optional[str]:
    """The one line refusing `layout` as too large (the bounds above), or None. `dp_shard_typed`
    and `world_typed` are how the user wrote the shard size and the world (a flag, a config
    key), which the line names."""
    if layout.dp_shard > 1:
        kind, rows = widest_parameter(model, layout.tp, layout.ep)
        if layout.dp_shard > rows:
            return (f"{dp_shard_typed}: FSDP2 shards every parameter by rows, and the widest of {model.name} "
                    f"({kind}) has {rows} rows on a rank of this layout: shard ranks beyond {rows} would hold nothing; "
                    f"shard over at most {rows} ranks (replicate for more data parallelism)")
    if layout.world_size > MAX_WORLD:
        return (f"{world_typed}: {layout.world_size} ranks, more than the {MAX_WORLD} (2^17) a dry run takes: beyond "
                "the largest GPU clusters of today, and the dry run's work grows with every rank")
    return None
