"""parallel.simulate_world: one process as one rank of a larger layout, over fake process groups.
The rank holds the real layout's shards and experts, trains on its own share of the batch,
writes no checkpoint and says in every record that it is a simulation; bad input is one line."""
from __future__ import annotations

import json
import logging
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from parallel.comm import all_to_all_into, broadcast_object
from parallel.expert_parallel import combine, dispatch
from parallel.fsdp import row_range
from parallel.mesh import Layout, Mesh, destroy_mesh
from tests.conftest import REPO, compose
from trainer.config import ConfigError, register_configs, to_dataclass
from trainer.run.preflight import preflight
from trainer.simulation.one_rank import MemoryPeak, memory_report, planned_memory_of

TINY = [
    "trainer.device=cpu", "trainer.precision=fp32", "trainer.peak_tflops=1", "trainer.max_steps=2",
    "trainer.batch_size=2", "trainer.seq_len=32", "eval.batches=1", "eval.batch_size=2", "logger.interval=1",
    "logger.wandb.mode=disabled", "logger.tensorboard=false", "logger.progress=none", "optim.muon.ns_dtype=fp32",
]
WORLD = 8


@pytest.fixture
def fake_world():
    """The test builds a fake default group in this very process; it goes afterwards, so the
    tests that follow find none."""
    yield
    destroy_mesh()
    assert not dist.is_initialized()


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def local_rows(param: torch.Tensor) -> tuple[int, int]:
    """(rows of the parameter as the layout's TP/EP leave it, rows this rank holds of them)."""
    local = param.to_local() if hasattr(param, "to_local") else param
    return param.shape[0], local.shape[0]


class BatchSpy:
    """Records the (dp_rank, dp_size) and the inputs of every micro-batch the trainer draws."""

    def __init__(self, batches) -> None:
        self.batches, self.calls = batches, []
        self.original = batches.micro_batch
        batches.micro_batch = self

    def __call__(self, step, micro, dp_rank, dp_size, grad_accum):
        x, y = self.original(step, micro, dp_rank, dp_size, grad_accum)
        self.calls.append((step, dp_rank, dp_size, x))
        return x, y


class ExpertLoadSpy:
    """Per MoE forward: the (token, expert) pairs the layer routed on this rank, and the rows its
    local experts then ran on."""

    def __init__(self, model) -> None:
        self.routed, self.ran = [], []
        for block in model.blocks:
            layer = block.mlp
            if getattr(layer, "n_experts", 0):
                layer.register_forward_pre_hook(
                    lambda m, args: self.routed.append(args[0].shape[0] * args[0].shape[1] * m.top_k))
                layer.experts.register_forward_pre_hook(lambda m, args: self.ran.append(args[0].shape[0]))


# (overrides, simulated rank): FSDP2 over all 8; FSDP2 4 x TP 2; MoE with EP 4 x expert_shard 2.
LAYOUTS = {
    "dp_shard8": (["model=gpt_tiny", "parallel.dp_shard=8"], 5),
    "dp_shard4_tp2": (["model=gpt_tiny", "parallel.dp_shard=4", "parallel.tp=2"], 3),
    "ep4_dp_shard8": (["model=moe_tiny", "parallel.dp_shard=8", "parallel.ep=4"], 6),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_simulated_rank_holds_its_real_shards_trains_its_share_and_saves_nothing(
        tmp_path, caplog, fake_world, layout):
    from trainer.loop import Trainer

    extra, rank = LAYOUTS[layout]
    run_dir = tmp_path / "run"
    # A checkpoint.resume=auto would try (and fail) to open this; a simulation starts fresh.
    (run_dir / "checkpoints" / "step_00000001").mkdir(parents=True)
    overrides = [*TINY, *extra, f"parallel.simulate_world={WORLD}", f"parallel.simulate_rank={rank}",
                 "checkpoint.interval=1"]
    caplog.set_level(logging.INFO)
    trainer = Trainer(to_dataclass(compose(overrides)), run_dir)
    mesh, m = trainer.mesh, trainer.model_cfg
    assert (mesh.rank, mesh.world_size) == (rank, WORLD)
    tp, dp_shard = mesh.tp, mesh.layout.dp_shard
    shard_rank = mesh.dp_rank % dp_shard

    # The real layout's shards: TP splits wq's n_heads * head_dim rows, FSDP2 chunks the rest.
    wq = trainer.model.blocks[0].attn.wq.weight
    assert local_rows(wq) == (m.n_heads * m.head_dim // tp, -(-m.n_heads * m.head_dim // tp // dp_shard))
    for name, param in trainer.model.named_parameters():
        rows, held = local_rows(param)
        if ".experts." in name:  # E/ep whole experts, FSDP2-sharded over expert_shard (EP innermost)
            assert rows == m.n_experts // mesh.ep, name
            start, stop = row_range(rows, dp_shard // mesh.ep, shard_rank // mesh.ep)
        else:
            start, stop = row_range(rows, dp_shard, shard_rank)
        assert held == stop - start, name

    batches = BatchSpy(trainer.train_batches)
    load = ExpertLoadSpy(trainer.model)
    trainer.train()

    # Its own share of each step's global batch: block dp_rank of dp.
    assert [(s, r, n) for s, r, n, _ in batches.calls] == [(s, mesh.dp_rank, WORLD // tp) for s in range(2)]
    for step, dp_rank, _, x in batches.calls:
        whole = trainer.train_batches.global_batch(step)
        assert torch.equal(x, whole[dp_rank * 2:(dp_rank + 1) * 2, :-1])
    if m.n_experts:
        # Every forward's routed pairs are exactly what the rank's experts ran.
        assert load.routed and load.ran == load.routed
        assert set(load.routed) == {2 * 32 * m.top_k}

    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_00000001"]
    assert list((run_dir / "checkpoints" / "step_00000001").iterdir()) == []
    rows = records(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["simulated"] == 1
        assert row["perf/simulated_step_s"] == row["perf/step_s"] > 0
        assert row["mem/peak_reserved_bytes"] > 0
        assert all(math.isfinite(v) for k, v in row.items() if k.startswith("val/"))
    env = json.loads((run_dir / "environment.json").read_text())
    assert env["simulation"] == {"simulate_world": WORLD, "simulate_rank": rank, "processes": 1}
    # What trainer/run/kind.py knows a simulation's dir by: a training run refuses it.
    from trainer.run.kind import dir_records
    assert dir_records(run_dir).simulation == ['2 rows marked "simulated": 1 in metrics.jsonl',
                                               'the "simulation" entry of environment.json']
    resolved = (run_dir / "resolved_config.yaml").read_text()
    assert f"simulate_world: {WORLD}" in resolved and f"simulate_rank: {rank}" in resolved
    start = [r.message for r in caplog.records if r.message.startswith("SIMULATION: ")]
    assert len(start) == 1 and f"rank {rank} of a {WORLD}-rank layout" in start[0]
    assert ("experts per MoE layer receive exactly the (token, expert) pairs this rank routed" in start[0]) == (
        m.n_experts > 0)
    assert any(r.message.startswith(f"SIMULATION of rank {rank} of {WORLD}: ") for r in caplog.records)
    # The planner's figure for this layout stands beside the measured peak.
    plan = planned_memory_of(trainer.cfg, m, mesh)
    said = [r.message for r in caplog.records if r.message.startswith("memory: planned ")]
    assert plan["total"] > 0 and len(said) == 1
    assert said[0].startswith(f"memory: planned {plan['total'] / (1 << 30):.3f} GiB, measured peak ")


def test_the_fake_exchange_runs_every_routed_pair_on_the_local_experts_and_returns_it(fake_world):
    """EP over a fake group of 4: the rank's 2 local experts receive the N pairs it routed (local
    expert j those of experts j, j + 2, j + 4, j + 6, source-major), and combine puts every row back."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=2, world_size=4)
    group = dist.new_group([0, 1, 2, 3])
    counts = torch.tensor([3, 0, 2, 5, 1, 4, 0, 2])  # 8 experts, 2 a rank
    n = int(counts.sum())
    x = torch.arange(n * 3, dtype=torch.float32).view(n, 3).requires_grad_()
    x_local, local_ends, handle = dispatch(x, counts, group)
    expert_of = torch.repeat_interleave(torch.arange(8), counts)
    expected = torch.cat([x[(expert_of == e)] for j in range(2) for e in range(j, 8, 2)])
    assert torch.equal(x_local, expected)
    assert local_ends.tolist() == handle.local_ends_host == [3 + 2 + 1 + 0, n]
    y = combine(x_local * 2, handle)
    assert torch.equal(y, x * 2)
    y.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


def test_fake_collectives_hand_back_this_ranks_own_data(fake_world):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4)
    group = dist.group.WORLD
    # Uneven splits: out holds as much of x as fits, zeros past x's end (torch's own fake
    # all-to-all would fail on the empty input).
    out = torch.full((5,), -1.0)
    all_to_all_into(out, torch.tensor([7.0, 8.0, 9.0]), [2, 1, 1, 1], [0, 3, 0, 0], group)
    assert out.tolist() == [7.0, 8.0, 9.0, 0.0, 0.0]
    all_to_all_into(out, torch.empty(0), [2, 1, 1, 1], [0, 0, 0, 0], group)
    assert out.tolist() == [0.0] * 5
    # Rank 0's object cannot reach this rank: it keeps its own (torch's reads an unset size).
    assert broadcast_object({"mine": 3}, 0, group, "setup") == {"mine": 3}


def test_the_measured_peak_is_put_beside_a_plans_prediction():
    gib = 1 << 30
    peak = MemoryPeak(allocated=int(3.3 * gib), reserved=4 * gib, device_type="cuda")
    assert peak.metrics() == {"mem/peak_allocated_bytes": float(int(3.3 * gib)), "mem/peak_reserved_bytes": 4.0 * gib}
    assert memory_report(peak, {"parameters": 1 * gib, "activations": 2 * gib}) == [
        "memory plan (GiB): parameters 1.000, activations 2.000",
        "memory: planned 3.000 GiB, measured peak allocated 3.300 GiB (1.10x the plan)",
    ]
    assert memory_report(peak, None) == ["memory: measured peak allocated 3.300 GiB (no planned figure given)"]
    cpu = MemoryPeak(allocated=None, reserved=gib, device_type="cpu")
    assert cpu.metrics() == {"mem/peak_reserved_bytes": float(gib)}
    assert memory_report(cpu, {"total": 2 * gib, "parameters": gib})[-1] == (
        "memory: planned 2.000 GiB, measured peak resident set 1.000 GiB (0.50x the plan)")


# (command line, processes launched, the one line it ends in).
BAD_SIMULATIONS = [
    (["parallel.simulate_world=8", "parallel.tp=3"], 1,
     "parallel.dp_replicate=-1 x parallel.dp_shard=1 x parallel.tp=3 does not multiply out to the 8 ranks of "
     "parallel.simulate_world=8"),
    (["parallel.simulate_world=8", "parallel.dp_shard=16"], 1,
     "parallel.dp_replicate=-1 x parallel.dp_shard=16 x parallel.tp=1 does not multiply out to the 8 ranks of "
     "parallel.simulate_world=8"),
    (["parallel.simulate_world=8", "parallel.simulate_rank=8"], 1,
     "parallel.simulate_rank=8 must lie in [0, parallel.simulate_world=8)"),
    (["parallel.simulate_rank=2"], 1,
     "parallel.simulate_rank=2 is read only in a simulation: set parallel.simulate_world=<ranks> too"),
    (["parallel.simulate_world=1"], 1,
     "parallel.simulate_world=1: a simulated layout needs at least 2 ranks (0 trains for real)"),
    (["parallel.simulate_world=8"], 4,
     "parallel.simulate_world=8: a simulation is one process; start it with python train.py, not under torchrun "
     "(WORLD_SIZE=4)"),
    (["parallel.simulate_world=8", f"checkpoint.resume={REPO}"], 1,
     f"checkpoint.resume={REPO}: a simulation (parallel.simulate_world=8) starts from the seed and resumes nothing; "
     "leave checkpoint.resume at auto or none"),
]


@pytest.mark.parametrize("argv, launched, said", BAD_SIMULATIONS, ids=[" ".join(a) for a, _, _ in BAD_SIMULATIONS])
def test_a_simulation_that_cannot_run_is_refused_in_one_line_before_any_work(argv, launched, said):
    # preflight is what train.py runs first, with the WORLD_SIZE torchrun set.
    with pytest.raises(ConfigError) as err:
        preflight(argv, str(REPO / "conf"), launched)
    assert str(err.value) == said


# Before: these ran (the FakeTensor estimate's and the simulation's work grows with every rank)
# for minutes while their memory grew; now one line before anything is built.
@pytest.mark.parametrize("argv, said", [
    (["parallel.simulate_world=1000000", "parallel.dp_replicate=1", "parallel.dp_shard=-1"],
     "parallel.dp_shard=-1 (1000000 ranks): FSDP2 shards every parameter by rows, and the widest of gpt_tiny (embed) "
     "has 8192 rows on a rank of this layout: shard ranks beyond 8192 would hold nothing; shard over at most 8192 "
     "ranks (replicate for more data parallelism)"),
    (["parallel.simulate_world=1000000"],
     "parallel.simulate_world=1000000: 1000000 ranks, more than the 131072 (2^17) a dry run takes: beyond the "
     "largest GPU clusters of today, and the dry run's work grows with every rank"),
], ids=["dp_shard_rows", "world"])
def test_a_layout_too_large_to_simulate_is_refused_naming_the_bound(argv, said):
    register_configs()  # what train.py does before its preflight
    with pytest.raises(ConfigError) as err:
        preflight(argv, str(REPO / "conf"), 1)
    assert str(err.value) == said


def test_a_simulation_larger_than_this_machine_is_refused_before_anything_is_built(monkeypatch):
    """Before: gpt_8b on a 23 GB machine printed nothing for minutes and was then killed. The
    machine here is made small (1 GiB), not the model large."""
    import trainer.simulation.one_rank as simulate

    monkeypatch.setattr(simulate, "host_memory", lambda device: (3 << 30, "its RAM"))
    argv = ["model=gpt_tiny", "parallel.simulate_world=8", "parallel.dp_shard=8", "trainer.device=cpu",
            "trainer.precision=fp32", "trainer.batch_size=64", "trainer.seq_len=512"]
    cfg = to_dataclass(compose(argv))
    planned = planned_memory_of(cfg, replace(cfg.model, vocab_size=cfg.data.vocab_size),
                                Mesh(0, 8, Layout(dp_shard=8)))["total"]
    assert planned > 1 << 30  # the activations of 64 x 512 tokens in fp32
    with pytest.raises(ConfigError) as err:
        preflight(argv, str(REPO / "conf"), 1)
    assert str(err.value) == (
        f"parallel.simulate_world=8: the memory plan puts rank 0 of this layout at {planned / (1 << 30):.1f} GiB, "
        "more than this machine's 1.0 GiB (its RAM, 3.0 GiB, less 2.0 GiB kept for the OS, the page cache and this "
        "process's libraries), so it would swap or be killed after minutes of building; shrink the model, the batch "
        "or the layout's share per rank, or set parallel.simulate_force=true to run it anyway")
    assert preflight(argv + ["parallel.simulate_force=true"], str(REPO / "conf"), 1) is not None
    monkeypatch.setattr(simulate, "host_memory", lambda device: (int(planned) + (2 << 30) + 1, "its RAM"))
    assert preflight(argv, str(REPO / "conf"), 1) is not None


def test_a_cpu_rank_leaves_the_os_and_its_libraries_a_stated_margin_of_the_ram():
    """10% of the RAM, at least 2 GiB: gpt_8b's README example plans 21.6 GiB for its rank, under a
    24 GiB host's 23.5 GiB of RAM but over the 21.2 GiB it can give; a GPU's memory keeps none."""
    import torch

    import trainer.simulation.one_rank as simulate

    gib = 1 << 30
    assert simulate.memory_margin(int(23.5 * gib), torch.device("cpu")) == int(2.35 * gib)
    assert simulate.memory_margin(8 * gib, torch.device("cpu")) == 2 * gib
    assert simulate.memory_margin(80 * gib, torch.device("cuda")) == 0
