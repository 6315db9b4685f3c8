"""Whole training runs with expert parallelism (parallel.ep > 1) track the single-process run:
fp32, losses within 1e-5 relative over 10 steps and the expert weights within 1e-6, with the
router's bias and load metrics identical on every rank, and the all-to-all bytes those of the
tokens routed."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import compose
from tests.distributed import run_distributed
from tests.test_parallel_training import COMMON, assert_tracks, losses, read_metrics
from tests.test_start_checks import logged
from tests.closeness import approx, assert_close
from trainer.config import to_dataclass

MUON = ["optim=muon", "optim.muon.ns_dtype=fp32"]
MOE = ["model=moe_tiny", "trainer.seq_len=32"]
# The last expert is never chosen: its EP rank receives no tokens for it, from any rank, at
# any step (the case the dispatch must survive with empty all-to-all blocks).
STARVED = -100.0


def _train(run_dir: Path, overrides: list[str], mesh=None, starve: bool = False) -> dict:
    """Train; return every MoE layer's expert weights as this rank holds them, its router bias,
    the balance metrics of every step, and (rank 0) what each dispatch sent and received."""
    import model.moe as moe_module
    import trainer.loop as loop_module
    from model.moe import moe_layers
    from trainer.loop import Trainer

    run_dir.mkdir(parents=True, exist_ok=True)
    with logged("trainer") as said:
        trainer = Trainer(to_dataclass(compose(COMMON + MOE + MUON + overrides)), run_dir, mesh)
    if starve:
        for _, layer in moe_layers(trainer.model):
            layer.expert_bias[-1] = STARVED
    balance, dispatches = [], []
    real_balance, real_dispatch = loop_module.balance_experts, moe_module.dispatch

    def recording_balance(*args, **kwargs):
        stats = real_balance(*args, **kwargs)
        balance.append({k: float(v) for k, v in stats.items()})
        return stats

    def recording_dispatch(x, counts, group):
        out = real_dispatch(x, counts, group)
        handle = out[2]
        dispatches.append({"step": trainer.step, "rows": handle.n_rows, "received": handle.n_received,
                           "per_expert": torch.diff(out[1], prepend=out[1].new_zeros(1)).tolist(),
                           "width": x.shape[-1], "bytes": x.element_size(), "training": trainer.model.training})
        return out

    loop_module.balance_experts, moe_module.dispatch = recording_balance, recording_dispatch
    try:
        trainer.train()
    finally:
        loop_module.balance_experts, moe_module.dispatch = real_balance, real_dispatch
    # (under FSDP2 a rank's experts are a DTensor sharded over expert_shard: gathered whole)
    experts = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
               for n, p in trainer.model.named_parameters() if ".experts." in n}
    return {"experts": experts, "bias": [layer.expert_bias.clone() for _, layer in moe_layers(trainer.model)],
            "balance": balance, "dispatches": dispatches, "ep_rank": trainer.mesh.ep_rank,
            "tp_rank": trainer.mesh.tp_rank, "ep": trainer.mesh.ep, "model": trainer.model_cfg,
            "model_lines": [line for line in said if line.startswith("model ")]}


def _ep_worker(rank: int, world: int, run_dir: str, overrides: list[str], starve: bool) -> dict:
    from parallel.mesh import build_mesh

    cfg = to_dataclass(compose(COMMON + MOE + MUON + overrides))
    mesh = build_mesh(cfg.parallel.tp, dp_shard=cfg.parallel.dp_shard, ep=cfg.parallel.ep)
    return _train(Path(run_dir), overrides, mesh, starve)


# (world, layout, options, per-rank batch, accumulation)
@pytest.mark.parametrize("world, layout, options, per_rank, accum, starve", [
    (2, ["parallel.ep=2"], [], 2, 1, False),
    # an EP rank whose only expert gets no token at all
    pytest.param(4, ["parallel.ep=4"], [], 1, 1, True, marks=pytest.mark.slow),
    pytest.param(4, ["parallel.ep=2"], [], 1, 1, False, marks=pytest.mark.slow),  # ep 2 x edp 2, ZeRO-1
    pytest.param(4, ["parallel.ep=2", "parallel.tp=2"], [], 2, 1, False, marks=pytest.mark.slow),
    (2, ["parallel.ep=2"], [], 1, 2, False),  # gradient accumulation
    (2, ["parallel.ep=2"], ["optim.muon.normuon=true"], 2, 1, False),
    # the auxiliary loss over the global batch
    (2, ["parallel.ep=2"], ["model.aux_loss_coef=0.01"], 2, 1, False),
    # FSDP2: the experts a unit of their own over the dp_shard ranks that hold the same ones
    (2, ["parallel.dp_shard=2", "parallel.ep=2"], [], 2, 1, False),
    pytest.param(4, ["parallel.dp_shard=4", "parallel.ep=2"], [], 1, 2, False, marks=pytest.mark.slow),
    pytest.param(4, ["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.ep=2"], ["optim.muon.normuon=true"],
                 1, 1, False, marks=pytest.mark.slow),  # HSDP
    # compiled: the dispatch stays outside the graphs
    pytest.param(2, ["parallel.ep=2"], ["trainer.compile=true"], 2, 1, False, marks=pytest.mark.slow),
], ids=["ep2", "ep4_starved", "ep2_edp2", "ep2_tp2", "ep2_accum2", "ep2_normuon", "ep2_aux_loss", "fsdp2_ep2",
     "fsdp4_ep2_accum2", "hsdp2x2_ep2_normuon", "ep2_compiled"])
def test_expert_parallel_training_tracks_the_single_process_run(tmp_path, world, layout, options, per_rank, accum,
                                                                starve):
    tp = 2 if "parallel.tp=2" in layout else 1
    dp = world // tp
    single = _train(tmp_path / "single", options + [f"trainer.batch_size={per_rank * dp * accum}"], starve=starve)
    results = run_distributed(_ep_worker, world, str(tmp_path / "par"),
                              options + layout + [f"trainer.batch_size={per_rank}", f"trainer.grad_accum={accum}"],
                              starve)
    sharded, reference = read_metrics(tmp_path / "par"), read_metrics(tmp_path / "single")
    assert_tracks(losses(sharded), losses(reference), 1e-5)
    # The health metrics sum each family over the ranks holding its parts (experts over EP).
    health = [k for k in reference[-1] if k.startswith(("optim/update_rms/", "model/weight_rms/"))]
    assert "model/weight_rms/experts" in health
    for key in health:
        assert sharded[-1][key] == approx(reference[-1][key], rel=1e-4), key
    # Every expert, from the rank that holds it, within 1e-6 of the single-process weights.
    ep = results[0]["ep"]
    for name, full in single["experts"].items():
        local = full.shape[0] // ep
        for r in results:
            mine = full[r["ep_rank"] * local : (r["ep_rank"] + 1) * local]
            assert_close(r["experts"][name], mine, rtol=0, atol=1e-6, msg=name)
    # The bias and the balance metrics are global: identical on every rank, and the single run's.
    for r in results:
        assert r["dispatches"] and any(d["received"] != d["rows"] for d in r["dispatches"])  # tokens moved
        for got, want in zip(r["bias"], single["bias"]):
            assert_close(got, want, rtol=0, atol=0)
        assert r["balance"] == results[0]["balance"]
    for got, want in zip(results[0]["balance"], single["balance"]):
        assert got.keys() == want.keys()
        for key in got:
            assert got[key] == approx(want[key], rel=1e-6, abs=1e-9), key
    if starve:  # the starved expert's rank received nothing for it, yet trained in step
        last = results[-1]
        assert last["ep_rank"] == ep - 1
        assert all(d["per_expert"][-1] == 0 for d in last["dispatches"])


def test_all_to_all_bytes_are_those_of_the_routed_tokens(tmp_path):
    """comm/ep/all_to_all_bytes of each logged step (rank 0's) against what rank 0 routed:
    per dispatch, the expert counts, its rows out and the rows it received, then the same back
    (ep_bytes), for the forward and the backward."""
    from parallel.expert_parallel import ep_bytes

    results = run_distributed(_ep_worker, 2, str(tmp_path), ["parallel.ep=2", "trainer.batch_size=2"], False)
    metrics = {r["step"]: r for r in read_metrics(tmp_path)}
    dispatches = results[0]["dispatches"]
    from planning.scale_plan import ep_all_to_all_bytes
    from model.presets import preset_config

    # The planner's per-rank average (planning/scale_plan.py): what all ranks send, over the ranks.
    planned = ep_all_to_all_bytes(preset_config("moe_tiny", 100), 2 * 32, tp=1, act_bytes=4)
    for step in range(0, 9):
        sent = sum(ep_bytes(d["rows"], d["received"], d["width"], d["width"], 4, d["bytes"])
                   for r in results for d in r["dispatches"] if d["step"] == step)
        assert sent == 2 * planned, step
    checked = 0
    for step in range(1, 10):  # the last step also evaluates
        mine = [d for d in dispatches if d["step"] == step - 1]
        assert mine and all(d["training"] for d in mine)
        expected = sum(ep_bytes(d["rows"], d["received"], d["width"], d["width"], 4, d["bytes"]) for d in mine)
        assert metrics[step]["comm/ep/all_to_all_bytes"] == expected, step
        assert metrics[step]["comm/ep/all_to_all_calls"] == 5 * len(mine)  # counts, 2 forward, 2 backward
        checked += 1
    assert checked == 9 and len({d["received"] for d in dispatches}) > 1
    # The start-up line: the whole layout, and this rank's experts beside the model's total
    # (the planner's counts, from shapes alone).
    from planning.memory_plan import local_params

    total = sum(p.numel for p in local_params(results[0]["model"], 1))
    mine = sum(p.numel for p in local_params(results[0]["model"], 1, ep=2))
    assert mine < total
    assert [line.split("; corpus ")[0] for line in results[0]["model_lines"]] == [
        f"model moe_tiny: {total / 1e6:.2f}M parameters, {mine / 1e6:.2f}M on this rank; "
        f"mesh dp_replicate=2 dp_shard=1 tp=1 ep=2; {2 * 2 * 32} tokens per step"]


# (dp, tp, ep, dp_shard) saved -> loaded: each rank writes its experts (under FSDP2 its rows of
# them) at their place in the logical stack, and a load at another layout reads the experts
# (or TP shards of them) it now holds.
@pytest.mark.parametrize("saved, loaded", [
    ((2, 1, 2, 1), (2, 1, 2, 1)),  # exact
    ((2, 1, 2, 1), (1, 1, 1, 1)),
    pytest.param((2, 1, 2, 1), (1, 2, 1, 1), marks=pytest.mark.slow),  # into TP-split experts
    pytest.param((1, 2, 1, 1), (2, 1, 2, 1), marks=pytest.mark.slow),
    pytest.param((2, 1, 2, 1), (4, 1, 4, 1), marks=pytest.mark.slow),  # one expert a rank
    ((2, 1, 2, 2), (2, 1, 2, 2)),  # FSDP2 with EP, exact
    pytest.param((2, 1, 2, 2), (2, 1, 1, 1), marks=pytest.mark.slow),  # into ZeRO-1 without EP
], ids=["ep2-resume", "ep2-to-single", "ep2-to-tp2", "tp2-to-ep2", "ep2-to-ep4", "fsdp-ep2-resume",
     "fsdp-ep2-to-zero1"])
def test_expert_parallel_checkpoints_resume_at_any_layout(tmp_path, saved, loaded):
    from tests.test_checkpoint import assert_continues_like, run_layout

    def run(run_dir, layout, mode):
        dp, tp, ep, shard = layout
        run_layout(run_dir, dp, tp, mode, model="moe_tiny",
                   options=(f"parallel.ep={ep}", f"parallel.dp_shard={shard}", *MUON))

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(straight, saved, "train")
    run(resumed, saved, "interrupt")
    run(resumed, loaded, "train")
    assert_continues_like(straight, resumed, 0.0 if saved == loaded else 1e-5)
