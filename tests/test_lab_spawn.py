"""The benchmarks' launcher (lab/tools/spawn.py): fresh gloo ranks, results in rank order, and a
rank's failure raised in the caller, naming the rank, instead of a hang."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lab.tools.spawn import run_ranks


def _sum_of_ranks(rank: int, world_size: int, fail_on: int) -> tuple[int, int, float]:
    if rank == fail_on:
        raise ValueError(f"planted failure on rank {rank}")
    if fail_on >= 0:  # no collective that the failed rank would leave waiting
        return rank, world_size, 0.0
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    return dist.get_rank(), dist.get_world_size(), total.item()


def test_run_ranks_returns_each_ranks_result_in_order():
    assert run_ranks(_sum_of_ranks, 2, -1) == [(0, 2, 3.0), (1, 2, 3.0)]


def test_a_failing_rank_is_raised_with_its_traceback():
    with pytest.raises(RuntimeError, match=r"rank 1 failed:(.|\n)*planted failure on rank 1"):
        run_ranks(_sum_of_ranks, 2, 1)
