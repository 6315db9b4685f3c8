"""Whole training runs with sharded parameters (FSDP2, parallel.dp_shard > 1) track the
single-process run: fp32, losses within 1e-5 relative over 10 steps, and the health metrics
(weight and update RMS per family, which the ranks sum over their shards) alike."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed import run_distributed
from tests.test_parallel_training import _train_worker, assert_tracks, losses, read_metrics, train_in_process
from tests.closeness import approx

MUON = ["optim=muon", "optim.muon.ns_dtype=fp32"]
CLIP = MUON + ["optim.qk_clip.enabled=true", "optim.qk_clip.tau=1", "model.init_std=0.3"]
MOE = ["model=moe_tiny", "trainer.seq_len=32"]
FAMILY = ["optim.muon.normuon=true", "optim.cautious_wd=true", "optim.muon.ns_method=gram"]
HEADS_NORMUON = ["optim.muon.split_heads=true", "optim.muon.normuon=true"]


@pytest.mark.parametrize("world, layout, options, per_rank, accum", [
    (2, ["parallel.dp_shard=2"], MUON, 2, 1),
    (2, ["parallel.dp_shard=2"], ["optim=adamw"], 2, 1),
    (3, ["parallel.dp_shard=3"], MUON + FAMILY, 1, 1),  # uneven shards
    # Four processes on two cores: with the slow tests.
    pytest.param(4, ["parallel.dp_shard=2", "parallel.tp=2"], MUON, 4, 1, marks=pytest.mark.slow),  # 2-D
    pytest.param(4, ["parallel.dp_shard=2", "parallel.tp=2"], MUON + ["optim.muon.tp_mode=gram"], 4, 1,
                 marks=pytest.mark.slow),
    pytest.param(4, ["parallel.dp_replicate=2", "parallel.dp_shard=2"], MUON, 1, 1, marks=pytest.mark.slow),  # HSDP
    # experts sharded over dp_shard and split over TP: gathered over TP at the rank that holds them
    pytest.param(4, ["parallel.dp_shard=2", "parallel.tp=2"], MUON + MOE, 4, 1, marks=pytest.mark.slow),
    (2, ["parallel.dp_shard=2"], MUON + MOE, 2, 1),
    (2, ["parallel.dp_shard=2"], MUON, 1, 2),  # gradient accumulation
    (2, ["parallel.dp_shard=2"], CLIP, 2, 1),  # QK-clip scales each head's rows where they are
    (2, ["parallel.dp_shard=2"], MUON + ["optim.muon.split_heads=true"], 2, 1),  # a matrix per head
    # NorMuon per head, on heads whose rows the shards cut; and with TP (sums over both groups)
    (3, ["parallel.dp_shard=3"], MUON + HEADS_NORMUON, 1, 1),
    pytest.param(4, ["parallel.dp_shard=2", "parallel.tp=2"], MUON + MOE + ["optim.muon.normuon=true"], 4, 1,
                 marks=pytest.mark.slow),
    pytest.param(4, ["parallel.dp_shard=2", "parallel.tp=2"], MUON + HEADS_NORMUON, 4, 1, marks=pytest.mark.slow),
    # cuda_graphs: its fixed-address buffers (the graphs themselves need CUDA; test_sharded_muon.py
    # replays emulated ones)
    (2, ["parallel.dp_shard=2"], MUON + ["optim.muon.cuda_graphs=true"], 2, 1),
    # gathered weights kept from the forward to the backward (their bytes: test below)
    (2, ["parallel.dp_shard=2", "parallel.reshard_after_forward=false"], MUON, 2, 1),
    # each block compiled under FSDP2, against the whole model compiled in one process
    pytest.param(2, ["parallel.dp_shard=2"], MUON + ["trainer.compile=true"], 2, 1, marks=pytest.mark.slow),
], ids=["muon", "adamw", "dp_shard3_normuon_cautious_gram", "dp_shard2_tp2", "dp_shard2_tp2_gram", "hsdp2x2",
     "moe_dp_shard2_tp2", "moe",
     "accum2", "qk_clip", "split_heads", "dp_shard3_split_heads_normuon", "moe_dp_shard2_tp2_normuon",
     "dp_shard2_tp2_split_heads_normuon", "cuda_graphs", "no_reshard_after_forward", "compile"])
def test_sharded_training_tracks_the_single_process_run(tmp_path, world, layout, options, per_rank, accum):
    dp = world // (2 if "parallel.tp=2" in layout else 1)
    single = train_in_process(tmp_path / "single", options + [f"trainer.batch_size={per_rank * dp * accum}"])
    run_distributed(_train_worker, world, str(tmp_path / "par"),
                    options + layout + [f"trainer.batch_size={per_rank}", f"trainer.grad_accum={accum}"])
    sharded = read_metrics(tmp_path / "par")
    assert_tracks(losses(sharded), losses(single), 1e-5)
    health = [k for k in single[-1] if k.startswith(("optim/update_rms/", "model/weight_rms/", "optim/qk_clip/"))]
    assert health
    if "optim.qk_clip.enabled=true" in options:
        assert sum(r["optim/qk_clip/heads_clipped"] for r in single) > 0  # the clip did act
    for key in health:
        assert sharded[-1][key] == approx(single[-1][key], rel=1e-4), key


# (dp, tp, dp_shard): checkpoints written at one layout continue at another, through DCP's
# chunks: ZeRO-1 -> FSDP2 -> TP, and an FSDP2 resume that is exact.
@pytest.mark.parametrize("saved, loaded, options", [
    ((2, 1, 2), (2, 1, 2), ()),
    # NorMuon's v, saved in its weights' shape, read back by rows
    pytest.param((2, 1, 2), (2, 1, 2), ("optim.muon.normuon=true",), marks=pytest.mark.slow),
    pytest.param((2, 1, 1), (2, 1, 2), ("optim.muon.normuon=true",), marks=pytest.mark.slow),
    pytest.param((2, 1, 1), (2, 1, 2), (), marks=pytest.mark.slow),
    pytest.param((2, 1, 2), (1, 2, 1), (), marks=pytest.mark.slow),
    # NorMuon's v per head, saved from rows that cut heads and read back by TP's whole heads
    pytest.param((2, 1, 2), (1, 2, 1), tuple(HEADS_NORMUON), marks=pytest.mark.slow),
], ids=["fsdp-resume", "fsdp-resume-normuon", "zero1-to-fsdp-normuon", "zero1-to-fsdp", "fsdp-to-tp2",
     "fsdp-to-tp2-heads-normuon"])
def test_sharded_checkpoints_resume_at_any_layout(tmp_path, saved, loaded, options):
    from tests.test_checkpoint import assert_continues_like, run_layout

    def run(run_dir, layout, mode):
        dp, tp, shard = layout
        run_layout(run_dir, dp, tp, mode, options=(f"parallel.dp_shard={shard}", *options))

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(straight, saved, "train")
    run(resumed, saved, "interrupt")
    run(resumed, loaded, "train")
    assert_continues_like(straight, resumed, 0.0 if saved == loaded else 1e-5)


def _numbers_worker(rank: int, world: int, run_dir: str, extra: tuple[str, ...] = ()) -> dict:
    """Rank 0's FSDP2 traffic in a logged step, and every rank's bytes of parameters,
    gradients and optimizer state after one step."""
    from parallel.fsdp import local_rows
    from parallel.mesh import build_mesh
    from tests.conftest import compose
    from tests.test_parallel_training import COMMON
    from tests.test_start_checks import logged
    from trainer.config import to_dataclass
    from trainer.loop import Trainer

    cfg = to_dataclass(compose(COMMON + MUON + [f"parallel.dp_shard={world}", "trainer.batch_size=1",
                                                "trainer.grad_accum=2", "trainer.max_steps=3", *extra]))
    with logged("trainer") as said:
        trainer = Trainer(cfg, Path(run_dir), build_mesh(1, dp_shard=world))
    x, y = trainer.train_batches.micro_batch(0, 0, trainer.mesh.dp_rank, trainer.mesh.dp, 1)
    trainer.forward(x, y).backward()
    grads = sum(local_rows(p.grad)[0].numel() * 4 for p in trainer.model.parameters())
    params = sum(local_rows(p.detach())[0].numel() * 4 for p in trainer.model.parameters())
    trainer.optimizer.prepare_grads(0.0)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad()
    state = trainer.optimizer.state_bytes()
    trainer.train()
    return {"params": params, "grads": grads, "state": state, "model": trainer.model_cfg,
            "model_lines": [line for line in said if line.startswith("model ")]}


def test_fsdp_bytes_and_memory_meet_the_planners_formulas(tmp_path):
    """What planning/scale_plan.py predicts for FSDP2, measured: rank 0's all-gather and
    reduce-scatter bytes per step (counted by parallel/comm.py around FSDP2's own
    collectives), and per-rank parameter, gradient and optimizer-state bytes at dp_shard=4."""
    import json

    from planning.scale_plan import fsdp_dp_bytes, fsdp_memory, local_params, muon_exchange_bytes_per_rank
    from optim.muon.row_sharded import exchange_bytes
    world = 4
    results = run_distributed(_numbers_worker, world, str(tmp_path))
    params = local_params(results[0]["model"], 1)
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    step2 = next(r for r in logged if r["step"] == 2)  # no evaluation or checkpoint in its window
    # (dp_shard is the whole data-parallel group here, so its collectives count as comm/dp/)
    predicted = fsdp_dp_bytes(params, world, micro_batches=2, param_bytes=4)  # fp32 compute
    assert step2["comm/dp/all_gather_bytes"] == predicted["all_gather"]
    assert step2["comm/dp/reduce_scatter_bytes"] == predicted["reduce_scatter"]
    assert step2["comm/dp/all_to_all_calls"] == 2
    matrices = [torch_size(p.shape) for p in params if p.muon and len(p.shape) == 2]
    assert muon_exchange_bytes_per_rank(params, world, ns_bytes=4) * world == exchange_bytes(matrices, world, 4, 4)
    memory = fsdp_memory(params, world, "muon")
    rank0 = results[0]
    assert (rank0["params"], rank0["grads"], rank0["state"]) == (
        memory["params"], memory["grads"], memory["optimizer_state"])
    # Against ZeRO-1, whose every rank holds all the parameters and gradients (fp32):
    full = 4 * sum(p.numel for p in params)
    assert rank0["params"] + rank0["grads"] <= 1.02 * (2 * full) / world
    assert memory["gathered"] < full
    # The start-up line: the whole layout, and this rank's share beside the model's total (rank 0's alone).
    total = sum(p.numel for p in params)
    assert [line.split("; corpus ")[0] for line in rank0["model_lines"]] == [
        f"model gpt_tiny: {total / 1e6:.2f}M parameters, {rank0['params'] / 4 / 1e6:.2f}M on this rank; "
        f"mesh dp_replicate=1 dp_shard={world} tp=1 ep=1; {2 * world * 64} tokens per step"]
    assert rank0["params"] / 4 < total / 2 and all(r["model_lines"] == [] for r in results[1:])


def test_weights_kept_from_forward_to_backward_are_gathered_once(tmp_path):
    """parallel.reshard_after_forward=false: each block's weights stay gathered from its
    forward to its backward, so a micro-batch gathers every block once, not twice, as the
    planner's formula says."""
    import json

    from planning.scale_plan import fsdp_dp_bytes, local_params

    world = 2
    results = run_distributed(_numbers_worker, world, str(tmp_path), ("parallel.reshard_after_forward=false",))
    params = local_params(results[0]["model"], 1)
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    step2 = next(r for r in logged if r["step"] == 2)
    kept = fsdp_dp_bytes(params, world, micro_batches=2, param_bytes=4, reshard_after_forward=False)
    assert step2["comm/dp/all_gather_bytes"] == kept["all_gather"]
    assert kept["all_gather"] < fsdp_dp_bytes(params, world, micro_batches=2, param_bytes=4)["all_gather"]


def torch_size(shape):
    import torch

    return torch.Size(shape)


def test_bf16_compute_from_fp32_master_weights(tmp_path):
    """trainer.precision=bf16 under FSDP2: bf16 all-gathers and compute, fp32 shards and fp32
    gradient reduction. The losses follow the single-process bf16 run within bf16's rounding,
    and the master weights stay fp32."""
    import json

    options = MUON + ["trainer.precision=bf16", "trainer.max_steps=10"]
    single = train_in_process(tmp_path / "single", options + ["trainer.batch_size=4"])
    run_distributed(_train_worker, 2, str(tmp_path / "par"), options + ["parallel.dp_shard=2", "trainer.batch_size=2"])
    sharded = read_metrics(tmp_path / "par")
    assert_tracks(losses(sharded), losses(single), 2e-2)
    assert json.loads((tmp_path / "par" / "environment.json").read_text())["layout"]["dp_shard"] == 2
    # The parameters are gathered in bf16: 2 bytes an element, as the planner counts them.
    import yaml

    from planning.scale_plan import fsdp_dp_bytes, local_params
    from model.config import ModelConfig

    model = ModelConfig(**yaml.safe_load((tmp_path / "par" / "resolved_config.yaml").read_text())["model"])
    step5 = next(r for r in sharded if r["step"] == 5)
    assert step5["comm/dp/all_gather_bytes"] == fsdp_dp_bytes(local_params(model, 1), 2, param_bytes=2)["all_gather"]
