"""Muon on row-sharded parameters (FSDP2's layout) equals Muon on the whole matrices, in fp32 and bf16.

Each rank holds torch.chunk's rows of every parameter, gradient and momentum; Newton-Schulz
runs on whole matrices at their owners, reached by two all-to-alls. In fp32 the sharded run
must give the single-process optim.muon.Muon's parameters within 1e-6, uneven shards and
ranks with no rows included, and send exactly the bytes exchange_bytes states.
"""
from __future__ import annotations

import pytest
import torch

from optim.muon import Muon
from optim.sharded_muon import ShardedMuon, exchange_bytes, row_range
from tests.distributed import run_distributed

# 2-D matrices with rows that 2 and 3 ranks split unevenly (7, 5, 2 rows: one rank gets none
# of the 2-row one at n=3), and an expert stack of 4 experts (n=3: 2, 2, 0 experts).
SHAPES = [(12, 8), (8, 12), (7, 5), (5, 9), (2, 6), (4, 6, 8)]
STEPS = 3
OPTIONS = dict(lr=0.05, weight_decay=0.1, momentum=0.9, nesterov=True, ns_steps=5, ns_dtype="fp32",
               adjust_lr="match_rms_adamw", eps=1e-7)


def initial_params() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g) for s in SHAPES]


def gradients(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g) for s in SHAPES]


def single_process(variant: dict) -> list[torch.Tensor]:
    params = [torch.nn.Parameter(p.clone()) for p in initial_params()]
    opt = Muon(params, **{**OPTIONS, **variant})
    for step in range(STEPS):
        for p, grad in zip(params, gradients(step)):
            p.grad = grad
        opt.step()
    return [p.detach() for p in params]


def _sharded_worker(rank: int, world_size: int, variant: dict) -> dict:
    import torch.distributed as dist

    from parallel import comm

    group = dist.group.WORLD

    def mine(t: torch.Tensor) -> torch.Tensor:
        start, stop = row_range(t.shape[0], world_size, rank)
        return t[start:stop].clone()

    shards = [torch.nn.Parameter(mine(p)) for p in initial_params()]
    opt = ShardedMuon(shards, SHAPES, group, **{**OPTIONS, **variant})
    comm.COUNTER.reset()
    for step in range(STEPS):
        for p, grad in zip(shards, gradients(step)):
            p.grad = mine(grad)
        opt.step()
    momentum = [opt.state[p]["momentum_buffer"].shape == p.shape for p in shards]
    return {"shards": [p.detach() for p in shards], "sent": comm.COUNTER.bytes[("world", "all_to_all")],
            "calls": comm.COUNTER.calls[("world", "all_to_all")], "momentum_sharded": all(momentum)}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("variant", [{}, {"cautious_wd": True, "ns_method": "gram", "nesterov": False},
                                     {"ns_dtype": "bf16"}],
                         ids=["muon", "cautious_gram_heavyball", "bf16"])
def test_sharded_muon_equals_muon_on_whole_matrices(world_size, variant):
    expected = single_process(variant)
    results = run_distributed(_sharded_worker, world_size, variant)
    for i, full in enumerate(expected):
        got = torch.cat([r["shards"][i] for r in results])
        assert got.shape == full.shape
        torch.testing.assert_close(got, full, rtol=0, atol=1e-6, msg=f"parameter {i} {SHAPES[i]}")
    assert all(r["momentum_sharded"] for r in results)
    # Two all-to-alls a step, and together they carry exactly what the formula says.
    assert [r["calls"] for r in results] == [2 * STEPS] * world_size
    ns_bytes = 2 if variant.get("ns_dtype") == "bf16" else 4
    assert sum(r["sent"] for r in results) == STEPS * exchange_bytes([torch.Size(s) for s in SHAPES], world_size, 4,
                                                                     ns_bytes)


def test_the_exchange_formula_counts_every_matrix_once_each_way():
    shapes = [torch.Size((12, 8)), torch.Size((4, 6, 8))]  # the expert stack never travels
    # fp32 rows to the owner, the bf16 update back
    assert exchange_bytes(shapes, 2, 4, 2) == exchange_bytes(shapes, 3, 4, 2) == 12 * 8 * (4 + 2)
    assert exchange_bytes(shapes, 1, 4, 2) == 0
    assert row_range(7, 3, 0) == (0, 3) and row_range(7, 3, 2) == (6, 7) and row_range(2, 3, 2) == (2, 2)


def test_a_shard_that_is_not_this_ranks_rows_is_refused():
    with pytest.raises(ValueError, match=r"parameter 0 of shape \(5, 8\) is not rank 0's rows \[0, 12\) of \(12, 8\)"):
        ShardedMuon([torch.nn.Parameter(torch.zeros(5, 8))], [(12, 8)], None, ns_dtype="fp32")
