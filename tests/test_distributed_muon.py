"""Distributed Muon (ZeRO-1 over DP, TP-aware Newton-Schulz) equals single-process Muon."""
from __future__ import annotations

from typing import Callable

import pytest
import torch

from parallel.comm import COUNTER
from model.config import ModelConfig
from model.gpt import GPT
from model.parallelize import parallelize_tp
from optim.builder import build_optimizer
from optim.config import OptimConfig
from optim.muon.options import MuonOptions
from optim.zero_plan import ParamSpec, build_plan
from tests.distributed import run_distributed
from tests.test_tensor_parallel import gathered
from tests.closeness import check
from parallel.mesh import Mesh, build_mesh

VOCAB = 97
CFG = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=32, vocab_size=VOCAB)


def optim_cfg(name: str, gather_buckets: int = 1, cautious_wd: bool = False, **muon) -> OptimConfig:
    # AdamW normalises each element by its own gradient scale. On a freshly initialised tiny
    # model many gradient elements are ~1e-4 or smaller (embedding rows of tokens seen once,
    # wq / wk of the last layer), and there m / (sqrt(v) + eps) turns fp32 summation-order
    # noise into visible update differences. Measured on test_zero_adamw_equals_single_process
    # (dp 2 x tp 2): embedding error 1.6e-5 at eps=1e-4, 4.8e-7 at eps=1e-3. In a Muon run the
    # embedding's AdamW does the same, and its drift reaches every matrix through the forward
    # (2e-5 to 4e-5 on 2 of 6 seeds at eps=1e-8). eps=1e-3 keeps those elements in AdamW's
    # linear regime, so the comparison checks the sharded data flow, not AdamW's conditioning:
    # a wrong m or v shard still moves elements by ~1e-2 of their update.
    return OptimConfig(name=name, lr=0.02, weight_decay=0.1, eps=1e-3, gather_buckets=gather_buckets,
                       cautious_wd=cautious_wd, muon=MuonOptions(ns_dtype="fp32", **muon))


def batches(n_steps: int, global_batch: int):
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (global_batch, 13), generator=gen) for _ in range(n_steps)]


def train(model, opt, data, dp_rank: int, dp: int, before_step: Callable[[], object] | None = None,
          accumulate: int = 1) -> None:
    """Each step on this DP rank's rows of the batch, as `accumulate` micro-batches whose mean
    losses' gradients add up (a sum in another order, for summation_floor)."""
    per_rank = data[0].shape[0] // dp
    for rows in data:
        mine = rows[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        for micro in mine.chunk(accumulate):
            (model(micro[:, :-1], micro[:, 1:]) / accumulate).backward()
        opt.prepare_grads(1.0)
        if before_step is not None:
            before_step()
        opt.step()
        opt.zero_grad()


# The tolerance of a parallel run against the single process, for Muon in fp32 on these tiny
# models. Newton-Schulz is not a smooth function of its input everywhere: it raises a direction
# whose singular value is small by up to a^5 ~ 490 (5 iterations of a = 3.4445), so fp32
# summation-order noise in a gradient (~1e-7) reaches the weights at ~5e-6 within 5 steps. The
# single process lands there by itself when it only sums its batch in two halves, and how far
# depends on the CPU's kernels (6.4e-6 seen on one, 1.24e-5 reported on another for a pipeline
# run). So a parallel run, which sums in yet another order, is held to a multiple of that
# floor, measured on the machine that runs the test, or to PARALLEL_TOLERANCE where the floor is
# lower. A wrong shard, owner or scale moves weights by 1e-3 to 1e-1: far above either.
PARALLEL_TOLERANCE = 1e-5
FLOOR_MULTIPLE = 4


def worst_relative_error(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """The largest |got - ref| / |ref| (norms) over the parameters."""
    return max(((got[n].detach() - ref[n].detach()).norm() / ref[n].detach().norm()).item() for n in ref)


def summation_floor(train_single: Callable[[int], dict[str, torch.Tensor]]) -> float:
    """worst_relative_error between two single-process trainings that differ only in summation
    order: `train_single(accumulate)` with each batch whole (1) and as two halves (2)."""
    return worst_relative_error(train_single(2), train_single(1))


def parallel_tolerance(floor: float) -> float:
    return max(PARALLEL_TOLERANCE, FLOOR_MULTIPLE * floor)


def single_process_floor(cfg: OptimConfig, model_cfg: ModelConfig = CFG, global_batch: int = 4,
                         steps: int = 5) -> float:
    """summation_floor of trained_pair's single-process run."""
    def train_single(accumulate: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = GPT(model_cfg)
        train(model, build_optimizer(model, cfg, model_cfg, Mesh()), batches(steps, global_batch), 0, 1,
              accumulate=accumulate)
        return dict(model.named_parameters())

    return summation_floor(train_single)


def pair_batch(dp: int) -> int:
    """trained_pair's global batch: 4 sequences, or 2 per rank where DP does not divide 4."""
    return 4 if 4 % dp == 0 else 2 * dp


def trained_pair(cfg: OptimConfig, tp: int, model_cfg: ModelConfig = CFG, global_batch: int | None = None,
                 after_reference: Callable[[], object] | None = None,
                 reference_weights: list[dict[str, torch.Tensor]] | None = None):
    """(mesh, the DP x TP model, its single-process reference, as full tensors by name) after
    the same 5 steps from the same initial weights; `after_reference` runs between the two
    trainings, and `reference_weights`, if given, receives the reference's weights entering
    each step. Call on every rank."""
    mesh = build_mesh(tp)
    data = batches(5, global_batch or pair_batch(mesh.dp))
    torch.manual_seed(0)
    reference = GPT(model_cfg)

    def record() -> None:
        if reference_weights is not None:
            reference_weights.append({n: p.detach().clone() for n, p in reference.named_parameters()})

    train(reference, build_optimizer(reference, cfg, model_cfg, Mesh()), data, 0, 1, record)
    if after_reference is not None:
        after_reference()
    torch.manual_seed(0)
    model = parallelize_tp(GPT(model_cfg), mesh.tp_group)
    train(model, build_optimizer(model, cfg, model_cfg, mesh), data, mesh.dp_rank, mesh.dp)
    ref = dict(reference.named_parameters())
    full = {n: gathered(p, p.detach(), mesh.tp_group, ref[n].shape[0]) for n, p in model.named_parameters()}
    return mesh, full, ref


# The Muon family's options all on (docs/muon_family.md): none of them may add DP traffic.
FAMILY = dict(cautious_wd=True, normuon=True, ns_method="gram")


def _muon_worker(
    rank: int, world: int, tp: int, name: str, split_heads: bool, tp_mode: str = "gather", buckets: int = 1,
    options: dict | None = None,
) -> dict:
    mesh = build_mesh(tp)
    cfg = optim_cfg(name, gather_buckets=buckets, split_heads=split_heads, tp_mode=tp_mode, **(options or {}))
    data = batches(5, 4)
    torch.manual_seed(0)
    reference = GPT(CFG)
    ref_opt = build_optimizer(reference, cfg, CFG, Mesh())
    train(reference, ref_opt, data, 0, 1)

    torch.manual_seed(0)
    model = parallelize_tp(GPT(CFG), mesh.tp_group)
    COUNTER.reset()
    opt = build_optimizer(model, cfg, CFG, mesh)
    train(model, opt, data, mesh.dp_rank, mesh.dp)
    ref = dict(reference.named_parameters())
    worst = worst_relative_error({n: gathered(p, p.detach(), mesh.tp_group, ref[n].shape[0])
                                  for n, p in model.named_parameters()}, ref)
    index = {id(p): i for i, p in enumerate(model.parameters())}
    muon_state = opt.optimizers["muon"].state if "muon" in getattr(opt, "optimizers", {}) else {}
    plan = getattr(opt, "plan", None)
    return {
        "worst": worst,
        "tolerance": parallel_tolerance(single_process_floor(cfg)),
        "dp_bytes": {k: v for (label, k), v in COUNTER.bytes.items() if label == "dp"},
        # parameters whose Muon momentum this rank holds, and those the plan gives it
        "muon_state_params": sorted(index[id(p)] for p in muon_state),
        "planned_muon_params": sorted(s.param for s in plan.ranks[mesh.dp_rank].muon) if plan else None,
        "plan_ns_costs": [r.ns_cost for r in plan.ranks] if plan else None,
    }


def full_shape_plan_costs(dp: int) -> list[int]:
    """Per-rank Newton-Schulz cost of the plan built from the single-process model's full
    matrix shapes: what tp_mode=gather actually computes on each owner."""
    specs = []
    for i, (name, p) in enumerate(GPT(CFG).named_parameters()):
        is_muon = p.ndim == 2 and not name.endswith(("embed.weight", "head.weight"))
        specs.append(ParamSpec(i, p.numel(), ((p.shape[0], p.shape[1]),) if is_muon else ()))
    return [r.ns_cost for r in build_plan(specs, dp).ranks]


# tp_mode only matters with TP, so the (dp, 1) layouts appear once.
@pytest.mark.parametrize("dp, tp, tp_mode", [
    (2, 1, "gather"), (4, 1, "gather"), (1, 2, "gather"), (1, 2, "gram"), (2, 2, "gather"), (2, 2, "gram"),
])
def test_distributed_muon_equals_single_process(dp, tp, tp_mode):
    results = run_distributed(_muon_worker, dp * tp, tp, "muon", False, tp_mode)
    for rank, r in enumerate(results):
        check(f"rank {rank}: relative parameter error", r["worst"], r["tolerance"])
    if dp > 1:
        # Each rank holds momentum for exactly the matrices the plan gives it, and every
        # matrix's momentum lives on exactly one DP rank.
        for r in results:
            assert r["muon_state_params"] == r["planned_muon_params"]
        per_dp = [results[d * tp]["muon_state_params"] for d in range(dp)]
        assert sorted(i for owned in per_dp for i in owned) == sorted(set().union(*map(set, per_dp)))
        assert sum(map(len, per_dp)) == 7 * CFG.n_layers
        if tp_mode == "gather":
            # The owners' load is balanced on the matrices they orthogonalise (full ones).
            assert results[0]["plan_ns_costs"] == full_shape_plan_costs(dp)


@pytest.mark.parametrize("dp, tp, name", [(2, 1, "muon"), (2, 2, "muon"), (2, 1, "adamw")])
def test_bucketed_async_parameter_gather_equals_single_process(dp, tp, name):
    """optim.gather_buckets > 1: matrices stepped bucket by bucket, each bucket's all-gather
    in flight while the next is orthogonalised; same parameters, same DP bytes."""
    results = run_distributed(_muon_worker, dp * tp, tp, name, False, "gather", 3)
    for rank, r in enumerate(results):
        check(f"rank {rank}: relative parameter error", r["worst"], r["tolerance"])
    one_bucket = run_distributed(_muon_worker, dp * tp, tp, name, False, "gather", 1)[0]["dp_bytes"]
    assert results[0]["dp_bytes"] == one_bucket


def test_distributed_muon_with_split_heads_equals_single_process():
    for rank, r in enumerate(run_distributed(_muon_worker, 4, 2, "muon", True)):
        check(f"rank {rank}: relative parameter error", r["worst"], r["tolerance"])


@pytest.mark.parametrize("dp, tp, options", [
    (2, 1, None), (2, 2, None), pytest.param(2, 2, FAMILY, marks=pytest.mark.slow),
], ids=["dp2", "dp2-tp2", "dp2-tp2-family"])
def test_muon_dp_traffic_equals_adamw_zero1(dp, tp, options):
    muon = run_distributed(_muon_worker, dp * tp, tp, "muon", False, "gather", 1, options)[0]["dp_bytes"]
    adamw = run_distributed(_muon_worker, dp * tp, tp, "adamw", False)[0]["dp_bytes"]
    assert set(muon) == {"reduce_scatter", "all_gather", "all_reduce"}
    for op in ("reduce_scatter", "all_gather"):
        assert muon[op] == adamw[op], (op, muon[op], adamw[op])
    # the only other DP traffic is the 2-float gradient-norm all-reduce per step
    assert muon["all_reduce"] == adamw["all_reduce"] == 5 * 2 * 4


def test_zero_adamw_equals_single_process():
    for rank, r in enumerate(run_distributed(_muon_worker, 4, 2, "adamw", False)):
        check(f"rank {rank}: relative parameter error", r["worst"], r["tolerance"])


def test_plan_keeps_matrices_whole_and_balances_newton_schulz_cost():
    specs = [ParamSpec(i, r * c, ((r, c),)) for i, (r, c) in enumerate([(384, 384)] * 24 + [(1024, 384)] * 12 + [(384, 1024)] * 6)]
    specs += [ParamSpec(len(specs) + i, n) for i, n in enumerate([3_145_728, 3_145_728] + [384] * 13)]
    for dp in (2, 4):
        plan = build_plan(specs, dp)
        for spec in specs:
            owners = plan.owner_of(spec.index)
            if spec.is_muon:
                assert len(owners) == 1, "a Muon matrix must never be split"
        # every element placed exactly once, inside its owner's segment
        placed = sorted((s.offset, s.offset + s.length) for r in plan.ranks for s in r.muon + r.adamw)
        assert all(a[1] <= b[0] for a, b in zip(placed, placed[1:]))
        assert sum(b - a for a, b in placed) == sum(s.numel for s in specs)
        for rank, share in enumerate(plan.ranks):
            for s in share.muon + share.adamw:
                assert rank * plan.segment <= s.offset and s.offset + s.length <= (rank + 1) * plan.segment
        costs = [r.ns_cost for r in plan.ranks]
        assert max(costs) <= 1.15 * sum(costs) / dp
        assert plan.padding / plan.total < 0.01
        assert build_plan(specs, dp).ranks == plan.ranks  # deterministic


def _skip_worker(rank: int, world: int, tp: int, name: str, tp_mode: str) -> bool:
    """Two good steps, then one whose gradients hold a NaN on one rank only: after DP
    averaging every rank's norm is NaN, the on-device skip leaves every parameter and every
    piece of optimizer state exactly as it was, and a good step then moves them again."""
    mesh = build_mesh(tp)
    torch.manual_seed(0)
    model = parallelize_tp(GPT(CFG), mesh.tp_group)
    opt = build_optimizer(model, optim_cfg(name, tp_mode=tp_mode), CFG, mesh)
    data = batches(4, 4)
    per_rank = data[0].shape[0] // mesh.dp

    def step(rows, poison: bool) -> None:
        mine = rows[mesh.dp_rank * per_rank : (mesh.dp_rank + 1) * per_rank]
        model(mine[:, :-1], mine[:, 1:]).backward()
        if poison and rank == world - 1:
            next(model.parameters()).grad[0, 0] = float("nan")
        norm = opt.prepare_grads(1.0)
        opt.step((~torch.isfinite(norm)).float())
        opt.zero_grad()

    step(data[0], False)
    step(data[1], False)
    params = [p.detach().clone() for p in model.parameters()]
    state = [t.clone() for t in opt.state_tensors()]
    step(data[2], True)
    unchanged = all(torch.equal(a, p) for a, p in zip(params, model.parameters())) and all(
        torch.equal(a, b) for a, b in zip(state, opt.state_tensors())
    )
    step(data[3], False)
    moved = not all(torch.equal(a, p) for a, p in zip(params, model.parameters()))
    return unchanged and moved


@pytest.mark.parametrize("dp, tp, name, tp_mode", [
    (2, 1, "muon", "gather"), (2, 1, "adamw", "gather"), (1, 2, "muon", "gather"), (1, 2, "muon", "gram"),
])
def test_nonfinite_step_is_skipped_on_the_device_by_every_rank(dp, tp, name, tp_mode):
    assert all(run_distributed(_skip_worker, dp * tp, tp, name, tp_mode))
