"""Muon on row-sharded parameters (FSDP2's layout) equals Muon on the whole matrices, in fp32 and bf16.

Each rank holds torch.chunk's rows of every parameter, gradient and momentum; Newton-Schulz
runs on whole matrices at their owners, reached by two all-to-alls. In fp32 the sharded run
must give the single-process optim.muon.Muon's parameters within 1e-6, uneven shards and
ranks with no rows included, and send exactly the bytes exchange_bytes states.
"""
from __future__ import annotations

import pytest
import torch

from optim.muon.optimizer import Muon
from optim.muon.row_sharded import ShardedMuon, exchange_bytes
from parallel.fsdp import row_range
from tests.distributed import run_distributed
from tests.closeness import assert_close

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
                                     {"ns_dtype": "bf16"}, {"normuon": True}],
                         ids=["muon", "cautious_gram_heavyball", "bf16", "normuon"])
def test_sharded_muon_equals_muon_on_whole_matrices(world_size, variant):
    expected = single_process(variant)
    results = run_distributed(_sharded_worker, world_size, variant)
    for i, full in enumerate(expected):
        got = torch.cat([r["shards"][i] for r in results])
        assert got.shape == full.shape
        assert_close(got, full, rtol=0, atol=1e-6, msg=f"parameter {i} {SHAPES[i]}")
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


# ---- a skipped step, param groups of their own, and tensor parallelism ----

SKIPPED = 1  # the step whose gradients are NaN and whose found_inf is 1
WD_BY_GROUP = (0.1, 0.0)  # 2-D matrices in one group, the rest in another


def groups_of(tensors: list[torch.Tensor], shapes=None) -> list[dict]:
    """Matrices 0-2 decay, the rest do not: Muon's param groups, or ShardedMuon's with shapes."""
    out = []
    for wd, members in zip(WD_BY_GROUP, ([0, 1, 2], [3, 4, 5])):
        group = {"params": [tensors[i] for i in members], "weight_decay": wd}
        if shapes is not None:
            group["full_shapes"] = [shapes[i] for i in members]
        out.append(group)
    return out


def step_with_skip(opt, params, grads_of) -> list[torch.Tensor]:
    for step in range(STEPS):
        for p, grad in zip(params, grads_of(step)):
            p.grad = torch.full_like(grad, float("nan")) if step == SKIPPED else grad
        opt.found_inf = torch.tensor(float(step == SKIPPED))
        opt.step()
    return [p.detach() for p in params]


def _grouped_worker(rank: int, world_size: int) -> list[torch.Tensor]:
    import torch.distributed as dist

    def mine(t: torch.Tensor) -> torch.Tensor:
        start, stop = row_range(t.shape[0], world_size, rank)
        return t[start:stop].clone()

    shards = [torch.nn.Parameter(mine(p)) for p in initial_params()]
    opt = ShardedMuon(groups_of(shards, SHAPES), None, dist.group.WORLD, **OPTIONS)
    return step_with_skip(opt, shards, lambda step: [mine(g) for g in gradients(step)])


def test_param_groups_and_a_step_skipped_on_the_device_as_muon_does():
    params = [torch.nn.Parameter(p.clone()) for p in initial_params()]
    expected = step_with_skip(Muon(groups_of(params), **OPTIONS), params, gradients)
    results = run_distributed(_grouped_worker, 2)
    for i, full in enumerate(expected):
        assert_close(torch.cat([r[i] for r in results]), full, rtol=0, atol=1e-6,
                                   msg=f"parameter {i} {SHAPES[i]}")
    assert all(torch.isfinite(t).all() for r in results for t in r)


# TP splits (0: rows, column-parallel; 1: columns, row-parallel) of the 2-D matrices, then a
# group of attention-head matrices (4-row heads; TP splits rows by whole heads, and each
# TP-local part's 12 rows fall 6 and 6 over dp_shard, which cuts the middle head in two), then
# expert stacks split over TP along each expert's rows or columns.
TP_SHAPES = [(12, 8), (8, 12), (16, 6), (24, 6), (4, 6, 8), (4, 8, 6)]
TP_SPLITS = [0, 1, 0, 0, 0, 1]
HEAD_ROWS = 4


def tp_groups(tensors: list, shapes=None, splits=None) -> list[dict]:
    """The matrices and experts in one group, the head matrix in a group of its own."""
    out = []
    for members, extra in (([0, 1, 2, 4, 5], {}), ([3], {"split_rows": HEAD_ROWS})):
        group = {"params": [tensors[i] for i in members], **extra}
        if shapes is not None:
            group["full_shapes"] = [shapes[i] for i in members]
            group["tp_split_dims"] = [splits[i] for i in members]
        out.append(group)
    return out


def tp_gradient(step: int, i: int) -> torch.Tensor:
    return torch.randn(TP_SHAPES[i], generator=torch.Generator().manual_seed(100 + step * 10 + i))


def _tp_worker(rank: int, world_size: int, variant: dict) -> list[torch.Tensor]:
    from parallel.comm import group_rank
    from parallel.mesh import build_mesh

    mesh = build_mesh(2, dp_shard=2)  # dp_shard 2 x tp 2
    shard_group = mesh.device_mesh.get_group("dp_shard")
    tp_rank, dp_rank = group_rank(mesh.tp_group), group_rank(shard_group)

    def tp_local(t: torch.Tensor, split: int) -> torch.Tensor:
        return t.chunk(2, dim=split + t.dim() - 2)[tp_rank]

    def mine(t: torch.Tensor) -> torch.Tensor:
        start, stop = row_range(t.shape[0], 2, dp_rank)
        return t[start:stop].clone()

    g = torch.Generator().manual_seed(0)
    full = [torch.randn(s, generator=g) for s in TP_SHAPES]
    local = [tp_local(t, d) for t, d in zip(full, TP_SPLITS)]
    shards = [torch.nn.Parameter(mine(t)) for t in local]
    opt = ShardedMuon(tp_groups(shards, [t.shape for t in local], TP_SPLITS), None, shard_group,
                      tp_group=mesh.tp_group, **{**OPTIONS, **variant})
    for step in range(STEPS):
        for i, (p, d) in enumerate(zip(shards, TP_SPLITS)):
            p.grad = mine(tp_local(tp_gradient(step, i), d))
        opt.step()
    return [p.detach() for p in shards]


@pytest.mark.parametrize("variant, tol", [({"tp_mode": "gather"}, 1e-6), ({"tp_mode": "gram"}, 1e-5),
                                          ({"tp_mode": "gather", "normuon": True}, 1e-6)],
                         ids=["gather", "gram", "normuon"])
def test_dp_shard_2_x_tp_2_orthogonalises_the_whole_matrices(variant, tol):
    """DP gather -> TP gather -> Newton-Schulz -> TP shard -> DP shard (or, tp_mode=gram,
    Newton-Schulz on the TP shards with their Gram matrices all-reduced), against Muon on the
    whole matrices in one process. Gram's sums run in another order: 1e-5. With NorMuon, each
    matrix's row or column sums are completed over dp_shard and TP, and a head's over the
    dp_shard ranks that hold its rows."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in TP_SHAPES]
    single = {k: v for k, v in variant.items() if k != "tp_mode"}
    opt = Muon(tp_groups(params), **{**OPTIONS, **single})
    for step in range(STEPS):
        for i, p in enumerate(params):
            p.grad = tp_gradient(step, i)
        opt.step()
    results = run_distributed(_tp_worker, 4, variant)  # rank = dp_rank * 2 + tp_rank
    for i, (expected, split) in enumerate(zip(params, TP_SPLITS)):
        tp_parts = [torch.cat([results[dp * 2 + tp][i] for dp in range(2)]) for tp in range(2)]
        got = torch.cat(tp_parts, dim=split + expected.dim() - 2)
        assert_close(got, expected.detach(), rtol=0, atol=tol, msg=f"matrix {i} {TP_SHAPES[i]}")


# ---- NorMuon on heads cut by the shards, a checkpoint's round trip, and CUDA graphs ----

# Heads of 4 rows x 6 columns (v per column of each head) and of 8 rows x 4 columns (v per
# row); at 2 and 3 ranks the shards' boundaries cut heads (rows 0-9 | 10-19, 0-6 | 7-13 | 14-19).
HEAD_SHAPES = [(20, 6), (40, 4)]
HEADS = [4, 8]


def head_params() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(s, generator=g) for s in HEAD_SHAPES]


def head_gradient(step: int, i: int) -> torch.Tensor:
    return torch.randn(HEAD_SHAPES[i], generator=torch.Generator().manual_seed(200 + step * 10 + i))


def _heads_worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    def mine(t: torch.Tensor) -> torch.Tensor:
        start, stop = row_range(t.shape[0], world_size, rank)
        return t[start:stop].clone()

    def build(shards):
        return ShardedMuon([{"params": [p], "full_shapes": [s], "split_rows": h}
                            for p, s, h in zip(shards, HEAD_SHAPES, HEADS)],
                           None, dist.group.WORLD, normuon=True, **OPTIONS)

    shards = [torch.nn.Parameter(mine(p)) for p in head_params()]
    opt = build(shards)
    for step in range(STEPS):
        if step == STEPS - 1:  # the state through a checkpoint's form, into a fresh optimizer
            saved = [opt.export_state(p, opt.state[p]) for p in shards]
            opt = build(shards)
            for p, state in zip(shards, saved):
                opt.state[p].update(opt.import_state(p, {k: v.clone() for k, v in state.items()}))
        for i, p in enumerate(shards):
            p.grad = mine(head_gradient(step, i))
        opt.step()
    return {"shards": [p.detach() for p in shards],
            "v": [opt.export_state(p, opt.state[p])["normuon_v"] for p in shards]}


@pytest.mark.parametrize("world_size", [2, 3])
def test_normuon_on_heads_whose_rows_lie_on_two_ranks(world_size):
    """optim.muon.split_heads with NorMuon on row shards that cut heads: each head's sums are
    completed over the ranks holding its rows. Equal to Muon within 1e-6, through a checkpoint's
    export and import of v mid-run, and v itself saved as Muon saves it."""
    params = [torch.nn.Parameter(p.clone()) for p in head_params()]
    opt = Muon([{"params": [p], "split_rows": h} for p, h in zip(params, HEADS)], normuon=True, **OPTIONS)
    for step in range(STEPS):
        for i, p in enumerate(params):
            p.grad = head_gradient(step, i)
        opt.step()
    results = run_distributed(_heads_worker, world_size)
    for i, expected in enumerate(params):
        assert_close(torch.cat([r["shards"][i] for r in results]), expected.detach(),
                                   rtol=0, atol=1e-6, msg=f"heads {HEAD_SHAPES[i]}")
        v = opt.export_state(expected, opt.state[expected])["normuon_v"]
        assert_close(torch.cat([r["v"][i] for r in results]), v, rtol=1e-6, atol=0)
        assert v.unique().numel() > 1


def _graphs_worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from optim.muon import ns_graphs

    # CUDA graphs emulated on the CPU, as tests/test_newton_schulz.py does: "recording" binds the
    # eager iteration to the exact tensors passed, "replay" reruns it on them, so a replay reads
    # whatever the buffers hold then.
    replays = []
    ns_graphs.DEVICE_TYPES = ("cpu",)

    def capture(eager, G, out, keep):
        def replay():
            replays.append(G.data_ptr())
            eager(G, out, keep)
        return replay

    ns_graphs._capture = capture
    ns_graphs.clear()

    def mine(t: torch.Tensor) -> torch.Tensor:
        start, stop = row_range(t.shape[0], world_size, rank)
        return t[start:stop].clone()

    shards = [torch.nn.Parameter(mine(p)) for p in initial_params()]
    opt = ShardedMuon(shards, SHAPES, dist.group.WORLD, cuda_graphs=True, **OPTIONS)
    for step in range(STEPS + 1):
        for p, grad in zip(shards, gradients(step)):
            p.grad = mine(grad)
        opt.step()
    return {"shards": [p.detach() for p in shards], "recorded": ns_graphs._CACHE.recorded, "replays": len(replays)}


def test_cuda_graphs_replay_the_owners_and_the_experts_newton_schulz():
    """optim.muon.cuda_graphs under sharding: each batch an owner (or a rank's experts) gives
    Newton-Schulz is copied into a buffer that keeps its address, so its graph is recorded at
    the second step and replayed from then on; the parameters equal eager Muon's."""
    params = [torch.nn.Parameter(p.clone()) for p in initial_params()]
    opt = Muon(params, **OPTIONS)
    for step in range(STEPS + 1):
        for p, grad in zip(params, gradients(step)):
            p.grad = grad
        opt.step()
    results = run_distributed(_graphs_worker, 2)
    for i, full in enumerate(params):
        assert_close(torch.cat([r["shards"][i] for r in results]), full.detach(), rtol=0, atol=1e-6,
                                   msg=f"parameter {i} {SHAPES[i]}")
    for r in results:
        # every batch eager at the first step, recorded at the second and replayed from then on
        assert r["recorded"] >= 2 and r["replays"] == r["recorded"] * STEPS, r
