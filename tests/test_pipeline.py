"""Pipeline parallelism (parallel.pp > 1): whole training runs on gloo track the single-process
run (fp32, losses within 1e-5 relative over 10 steps, final health metrics alike), one step
decision holds for every stage, checkpoints move between pp sizes, and the pieces (splits,
placements, schedule checks, counted sends) say what they claim."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed import run_distributed
from tests.test_parallel_training import _train_worker, assert_tracks, losses, read_metrics, train_in_process
from tests.closeness import WELL_CONDITIONED, approx, check_relative

MUON = ["optim=muon", "optim.muon.ns_dtype=fp32"]
FAMILY = ["optim.muon.normuon=true", "optim.muon.ns_method=gram"]
# A clip that binds: init_std 0.3 gives logits far above tau 1 (test_fsdp_training.py's CLIP).
QK_CLIP = ["optim.qk_clip.enabled=true", "optim.qk_clip.tau=1", "model.init_std=0.3"]
MOE = ["model=moe_tiny", "trainer.seq_len=32"]
PP2 = ["parallel.pp=2", "parallel.pp_microbatches=2"]
HEALTH = ("optim/update_rms/", "model/weight_rms/", "model/output_rms/", "optim/qk_clip/", "moe/", "attn/max_logit/",
          "val/")


@pytest.fixture(scope="module")
def singles(tmp_path_factory):
    """The single-process run of a set of overrides, trained once for every case that compares
    with it (interleaved_1f1b, zbv and accum2 share one)."""
    runs: dict[tuple[str, ...], Path] = {}

    def single(overrides: list[str]) -> Path:
        key = tuple(overrides)
        if key not in runs:
            runs[key] = tmp_path_factory.mktemp("single")
            train_in_process(runs[key], overrides)
        return runs[key]

    return single


@pytest.mark.parametrize("world, layout, options, per_rank, dp", [
    # 1f1b (the default schedule), the Muon family, QK-clip, and a global clip that binds at every step
    (2, PP2, MUON + QK_CLIP + FAMILY + ["optim.grad_clip=0.05"], 4, 1),
    pytest.param(2, PP2 + ["parallel.pp_schedule=gpipe"], ["optim=adamw"], 4, 1, marks=pytest.mark.slow),
    (2, PP2 + ["parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2"], MUON, 4, 1),
    (2, PP2 + ["trainer.grad_accum=2"], MUON, 2, 1),  # accumulation over whole pipeline runs
    (2, PP2, MOE + MUON + ["eval.interval=5"], 4, 1),  # an evaluation between training steps
    pytest.param(2, ["parallel.pp=2", "parallel.pp_microbatches=4", "parallel.pp_schedule=interleaved_zero_bubble",
                     "parallel.pp_stages_per_rank=2"], MUON, 4, 1, marks=pytest.mark.slow),
    # a V: rank 0 holds the first and the last stage; evaluated by ForwardOnlyV
    (2, ["parallel.pp=2", "parallel.pp_microbatches=4", "parallel.pp_schedule=zbv", "parallel.pp_stages_per_rank=2"],
     MUON, 4, 1),
    # each block compiled inside its stage, against the whole model compiled in one process
    pytest.param(2, PP2, MUON + ["trainer.compile=true"], 4, 1, marks=pytest.mark.slow),
    # Four processes on two cores: with the slow tests.
    pytest.param(4, PP2, MUON, 4, 2, marks=pytest.mark.slow),  # pp 2 x dp 2 (ZeRO-1)
    pytest.param(4, PP2 + ["parallel.dp_shard=2"], MUON, 4, 2, marks=pytest.mark.slow),  # pp 2 x FSDP2 2
    pytest.param(4, PP2 + ["parallel.tp=2"], MUON, 4, 1, marks=pytest.mark.slow),
    pytest.param(4, PP2 + ["parallel.ep=2"], MOE + MUON + ["eval.interval=5"], 4, 2, marks=pytest.mark.slow),
], ids=["1f1b_family_qk_clip_clip", "gpipe_adamw", "interleaved_1f1b", "accum2", "moe",
        "interleaved_zero_bubble", "zbv", "compile", "dp2", "dp_shard2", "tp2", "moe_ep2"])
def test_pipeline_training_tracks_the_single_process_run(tmp_path, singles, world, layout, options, per_rank, dp):
    options = [*options, *WELL_CONDITIONED]  # the final parameters are compared too
    accum = 2 if "trainer.grad_accum=2" in layout else 1
    single_dir = singles(options + [f"trainer.batch_size={per_rank * dp * accum}"])
    single = read_metrics(single_dir)
    ranks = run_distributed(_logged_train_worker, world, str(tmp_path / "par"),
                            options + layout + [f"trainer.batch_size={per_rank}"])
    piped = read_metrics(tmp_path / "par")
    assert_tracks(losses(piped), losses(single), 1e-5)
    if world == 2:
        assert_start_up_says_the_pipeline(tmp_path / "par", ranks, layout)
    assert_tracks(losses(piped, "optim/grad_norm"), losses(single, "optim/grad_norm"), 1e-5)
    assert_same_final_parameters(single_dir, tmp_path / "par", 1e-5)
    health = [k for k in single[-1] if k.startswith(HEALTH)]
    assert any(k.startswith("model/output_rms/") for k in health) and any(k.startswith("val/") for k in health)
    if "optim.qk_clip.enabled=true" in options:
        assert sum(r["optim/qk_clip/heads_clipped"] for r in single) > 0  # the clip did act
    for key in health:
        assert piped[-1][key] == approx(single[-1][key], rel=1e-4), key
    # each pipeline rank's optimizer step, timed where it runs
    assert all(piped[-1][f"perf/optim_step_s/pp_rank_{r}"] > 0 for r in range(2))
    if "optim.grad_clip=0.05" in options:
        assert min(losses(single, "optim/grad_norm")) > 0.05  # the clip bound at every step
    if world == 2:
        # The sends and receives rank 0 counts in a step: each micro-batch's hidden state
        # [micro, seq, d_model] in fp32 goes out of or into each stage boundary it touches, and
        # its gradient the other way. Its stages 0 and 2 (interleaved) touch boundaries 0|1,
        # 1|2 and 2|3: 2 x stages per rank - 1.
        if "parallel.pp_schedule=zbv" in layout:
            return  # its own placement: rank 0 holds stages 0 and 3 (the bytes are those of 0|1 and 2|3)
        per_rank_stages = 2 if "parallel.pp_stages_per_rank=2" in layout else 1
        seq = 32 if "model=moe_tiny" in options else 64
        m = 4 if "parallel.pp_microbatches=4" in layout else 2
        hidden = (per_rank // m) * seq * 64 * 4
        step = next(r for r in piped if r["step"] == 2)
        expected = accum * m * (2 * per_rank_stages - 1) * hidden
        assert step["comm/pp/send_bytes"] == step["comm/pp/recv_bytes"] == expected
        # and the planner's count of the same traffic
        from planning.pipeline_plan import p2p_bytes
        assert expected == accum * p2p_bytes(2, 0, m, per_rank // m, seq, 64, 4, per_rank_stages)


def _logged_train_worker(rank: int, world: int, run_dir: str, overrides: list[str]) -> dict:
    """_train_worker, returning the model lines this rank logged and the parameters it holds."""
    from parallel.mesh import build_mesh
    from tests.conftest import compose
    from tests.test_parallel_training import COMMON
    from tests.test_start_checks import logged
    from trainer.config import to_dataclass
    from trainer.loop import Trainer

    cfg = to_dataclass(compose(COMMON + overrides))
    with logged("trainer") as said:
        trainer = Trainer(cfg, Path(run_dir), build_mesh(cfg.parallel.tp, dp_shard=cfg.parallel.dp_shard,
                                                         ep=cfg.parallel.ep, pp=cfg.parallel.pp))
    trainer.train()
    return {"model_lines": [line for line in said if line.startswith("model ")],
            "params": sum(p.numel() for p in trainer.model.parameters())}


def assert_start_up_says_the_pipeline(run_dir: Path, ranks: list[dict], layout: list[str]) -> None:
    """Rank 0's start-up line counts every stage's parameters (before: its own stage's, 0.57M
    of gpt_tiny's 1.15M) and names pp in the mesh; environment.json records the pipeline."""
    import json

    import yaml

    model = yaml.safe_load((run_dir / "resolved_config.yaml").read_text())["model"]
    whole, mine = ranks[0]["params"] + ranks[1]["params"], ranks[0]["params"]
    [line] = ranks[0]["model_lines"]
    assert ranks[1]["model_lines"] == [] and mine < whole
    assert line.startswith(f"model {model['name']}: {whole / 1e6:.2f}M parameters, {mine / 1e6:.2f}M on this rank; "
                           "mesh pp=2 dp_replicate=1 dp_shard=1 tp=1 ep=1; ")
    recorded = json.loads((run_dir / "environment.json").read_text())["layout"]
    options = dict(o.split("=", 1) for o in layout)
    per_rank = int(options.get("parallel.pp_stages_per_rank", 1))
    split = recorded.get("pp_layers_per_stage")
    assert {k: v for k, v in recorded.items() if k.startswith("pp")} == {
        "pp": 2, "pp_schedule": options.get("parallel.pp_schedule", "1f1b"), "pp_stages_per_rank": per_rank,
        "pp_microbatches": int(options["parallel.pp_microbatches"]),
        # gpt_tiny's and moe_tiny's 2 blocks, one a stage
        "pp_layers_per_stage": [model["n_layers"] // 2] * 2 if per_rank == 1 else split}
    assert len(split) == 2 * per_rank and sum(split) == model["n_layers"]


def test_an_auxiliary_loss_joins_the_backward_on_its_own_stage(tmp_path):
    """moe_tiny's balance loss (model.aux_loss_coef > 0) lives in block 1, on stage 1: its
    gradient enters the backward there, and the logged loss includes it. A pipeline of 2
    micro-batches of 2 sequences computes it per micro-batch, as accumulating 2 batches of 2
    does in one process."""
    options = MUON + MOE + ["model.aux_loss_coef=0.05", "eval.interval=5", *WELL_CONDITIONED]
    single = train_in_process(tmp_path / "single", options + ["trainer.batch_size=2", "trainer.grad_accum=2"])
    run_distributed(_train_worker, 2, str(tmp_path / "par"), options + PP2 + ["trainer.batch_size=4"])
    piped = read_metrics(tmp_path / "par")
    assert_tracks(losses(piped), losses(single), 1e-5)
    assert_same_final_parameters(tmp_path / "single", tmp_path / "par", 1e-5)
    # and the loss did move the router: without it the runs differ
    plain = train_in_process(tmp_path / "plain", MUON + MOE + ["eval.interval=5", "trainer.batch_size=2",
                                                                "trainer.grad_accum=2", *WELL_CONDITIONED])
    assert max(abs(a - b) for a, b in zip(losses(plain), losses(single))) > 1e-4


@pytest.mark.parametrize("world, bad, said", [
    # Before: accepted without a word when parallel.pp=1, which reads no schedule.
    (1, ["parallel.pp_schedule=bogus"],
     "error: parallel.pp_schedule: unknown value 'bogus' (expected one of gpipe, 1f1b, interleaved_1f1b, "
     "interleaved_zero_bubble, zbv)"),
    (2, ["parallel.pp=2", "parallel.pp_microbatches=1"],
     "error: parallel.pp_schedule=1f1b needs parallel.pp_microbatches=1 to be at least parallel.pp=2 (a micro-batch "
     "in flight per stage)"),
    (2, ["parallel.pp=4", "parallel.dp_replicate=1"],
     "error: parallel.pp=4 x parallel.dp_replicate=1 x parallel.dp_shard=1 x parallel.tp=1 does not multiply out to "
     "2 processes (the number torchrun started)"),
    (3, ["parallel.pp=3", "parallel.pp_microbatches=3", "trainer.batch_size=3", "eval.batch_size=3"],
     "error: parallel.pp=3 = 3 stages do not divide model.n_layers=2 + 2 (the embedding and the head count as a layer "
     "each): choose another parallel.pp, or set parallel.pp_layers_per_stage=[0, 1, 1]"),
    (2, ["parallel.pp=2", "parallel.pp_layers_per_stage=[1,2]"],
     "error: parallel.pp_layers_per_stage=[1, 2] must list 2 block counts (parallel.pp=2) that add up to "
     "model.n_layers=2"),
    # Before: "... that add up to model.n_layers=2", which -1 + 3 does.
    (2, ["parallel.pp=2", "parallel.pp_layers_per_stage=[-1,3]"],
     "error: parallel.pp_layers_per_stage=[-1, 3]: a stage's block count cannot be negative (-1); each stage runs 0 "
     "or more blocks"),
    (2, ["parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.pp_stages_per_rank=2", "parallel.pp_microbatches=4",
         "trainer.compile=true"],
     "error: parallel.pp_schedule=zbv splits each backward into input and weight gradients, which compiled blocks "
     "do not allow: set trainer.compile=false or parallel.pp_schedule=1f1b or interleaved_1f1b"),
    (2, ["parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.pp_stages_per_rank=2", "parallel.pp_microbatches=2"],
     "error: parallel.pp_schedule=zbv needs parallel.pp_microbatches=2 to be at least 2 x parallel.pp - 1 = 3 (its V "
     "fills with that many)"),
    (2, ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2",
         "parallel.pp_microbatches=5", "trainer.batch_size=10", "eval.batch_size=10"],
     "error: parallel.pp_schedule=interleaved_1f1b runs micro-batches in rounds of parallel.pp=2: "
     "parallel.pp_microbatches=5 must be a multiple of 2 (try 4 or 2)"),
    (2, ["parallel.pp=2", "trainer.batch_size=6", "parallel.pp_microbatches=4"],
     "error: trainer.batch_size=6 does not split into parallel.pp_microbatches=4 micro-batches of equal size"),
    (1, ["parallel.pp_layers_per_stage=[1,1]"],
     "error: parallel.pp_layers_per_stage=[1, 1] needs a pipeline (parallel.pp > 1)"),
], ids=["schedule", "too_few_microbatches", "world", "split", "explicit_split", "negative_split", "zbv_compile",
        "zbv_microbatches", "interleaved_rounds", "batch", "split_without_pp"])
def test_a_bad_pipeline_is_one_line_with_exit_2_before_any_data_work(tmp_path, world, bad, said):
    """As torchrun would start rank 0 of `world` ranks: the check runs before the rendezvous."""
    import os

    from tests.prestarted import run_python

    proc = run_python(["train.py", *bad, f"hydra.run.dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}",
                       "logger.wandb.mode=disabled"], timeout=300,
                      env={**os.environ, "WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [said]
    assert list(tmp_path.iterdir()) == []  # no run dir, no cache


@pytest.mark.slow
def test_ns_method_auto_is_decided_together_when_a_stage_holds_no_muon_matrix(tmp_path):
    """optim.muon.ns_method=auto times Newton-Schulz per matrix shape at start-up and every rank
    joins rank 0's broadcast of the choice. A stage of the head alone (blocks split 2 | 0) holds
    no Muon matrix: it used to skip the broadcast and leave rank 0 waiting in it."""
    overrides = MUON + ["optim.muon.ns_method=auto", "parallel.pp=2", "parallel.pp_microbatches=2",
                        "parallel.pp_layers_per_stage=[2,0]", "trainer.batch_size=4", "trainer.max_steps=2"]
    run_distributed(_train_worker, 2, str(tmp_path), overrides)
    import yaml

    chosen = yaml.safe_load((tmp_path / "resolved_config.yaml").read_text())["optim"]["muon"]["ns_by_shape"]
    assert chosen and set(chosen.values()) <= {"gram", "standard"}
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def assert_same_final_parameters(a: Path, b: Path, tol: float) -> None:
    """Every parameter of the two runs' final checkpoints (whole-model names, whatever layout
    saved them) within `tol` relative (the norm of the difference over the norm)."""
    from trainer.checkpoint import files as checkpoint_files

    pa = checkpoint_files.load(a / "checkpoints" / "step_00000010")["params"]
    pb = checkpoint_files.load(b / "checkpoints" / "step_00000010")["params"]
    assert sorted(pa) == sorted(pb)
    for name in pa:
        check_relative(name, pb[name], pa[name], tol)


def test_the_planned_split_and_placement():
    from model.pipeline_split import balanced_split, blocks_per_stage, nearest_split, stage_layers
    from parallel.pipeline import stage_ids

    assert balanced_split(2, 2) == [1, 1]  # embedding + block 0 | block 1 + head
    assert balanced_split(6, 4) == [1, 2, 2, 1]
    assert balanced_split(2, 4) == [0, 1, 1, 0]  # a stage of the embedding alone, one of the head alone
    assert balanced_split(32, 4) is None
    assert nearest_split(32, 4) == [8, 8, 8, 8]  # 34 layers as 9, 8, 8, 9: the ends hold the embedding and head
    assert nearest_split(2, 3) == [0, 1, 1]
    assert blocks_per_stage(32, 4, [8, 8, 8, 8], "parallel.pp=4") == [8, 8, 8, 8]
    assert stage_layers([1, 2, 0, 1]) == [[0], [1, 2], [], [3]]
    assert stage_ids("1f1b", 4, 1, 1) == [1]
    assert stage_ids("interleaved_1f1b", 4, 1, 2) == [1, 5]
    assert stage_ids("zbv", 4, 1, 2) == [1, 6]
    with pytest.raises(ValueError, match=r"parallel.pp=4 = 4 stages do not divide model.n_layers=32 \+ 2 .*"
                                         r"parallel.pp_layers_per_stage=\["):
        blocks_per_stage(32, 4, [], "parallel.pp=4")
    with pytest.raises(ValueError, match=r"parallel.pp_layers_per_stage=\[16, 15\] must list 2 block counts"):
        blocks_per_stage(32, 2, [16, 15], "parallel.pp=2")


def test_the_planners_bubble_and_memory_follow_the_schedules_formulas():
    from planning.pipeline_plan import bubble_fraction, in_flight, sends_per_microbatch

    p, m = 4, 8
    assert bubble_fraction("gpipe", p, m) == bubble_fraction("1f1b", p, m) == approx((p - 1) / (m + p - 1))
    assert bubble_fraction("interleaved_1f1b", p, m, 2) == approx(((p - 1) / 2) / (m + (p - 1) / 2))
    assert bubble_fraction("interleaved_zero_bubble", p, m, 2) == approx(((p - 1) / 6) / (m + (p - 1) / 6))
    assert bubble_fraction("1f1b", 1, m) == 0.0  # one stage: nothing waits
    assert [in_flight("1f1b", p, m, r) for r in range(p)] == [4, 3, 2, 1]
    assert in_flight("gpipe", p, m, 3) == m
    assert in_flight("interleaved_1f1b", p, m, 0, 2) == (2 * 3 + 4 + 1) / 2
    assert [sends_per_microbatch(p, r) for r in range(p)] == [1, 2, 2, 1]
    assert sends_per_microbatch(2, 0, 2) == 3  # stages 0 and 2 of 4: 0->1, 2->3 forward, 2->1 back
    with pytest.raises(ValueError, match="no bubble model for schedule 'zbv'"):
        bubble_fraction("zbv", p, m, 2)


def test_a_stage_keeps_the_whole_models_parameter_names():
    import torch

    from model.gpt import GPT
    from model.pipeline_split import StageModule, keep_stages
    from tests.test_model import tiny

    cfg = tiny(n_layers=4)
    whole = dict(GPT(cfg, init_seed=0).named_parameters())
    with torch.device("meta"):
        model = keep_stages(GPT(cfg, init_seed=0), [2, 3], first=False, last=True)
    names = [n for n, _ in model.named_parameters()]
    assert names and set(names) <= set(whole)
    assert {n.split(".")[1] for n in names if n.startswith("blocks.")} == {"2", "3"}
    assert "embed.weight" not in names and "head.weight" in names
    stage = StageModule(model, [2, 3], first=False, last=True)
    assert {id(p) for p in stage.parameters()} == {id(p) for p in model.parameters()}


def _skip_worker(rank: int, world: int, run_dir: str, overrides: list[str]) -> dict:
    """Three steps; at the second, the stage-1 ranks' gradients hold a NaN before the norm."""
    import torch

    from parallel.mesh import build_mesh
    from tests.conftest import compose
    from tests.test_parallel_training import COMMON
    from trainer.config import to_dataclass
    from trainer.loop import Trainer

    cfg = to_dataclass(compose(COMMON + overrides))
    trainer = Trainer(cfg, Path(run_dir), build_mesh(pp=2))
    prepare = trainer.optimizer.prepare_grads

    def poisoned(max_norm: float) -> torch.Tensor:
        if trainer.step == 1 and trainer.mesh.pp_rank == 1:
            next(p for p in trainer.model.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
        return prepare(max_norm)

    trainer.optimizer.prepare_grads = poisoned
    trainer.train_step(measure=True)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    second = trainer.train_step(measure=True)
    unchanged = all(torch.equal(before[n], p.detach()) for n, p in trainer.model.named_parameters())
    trainer.train_step(measure=True)
    moved = not all(torch.equal(before[n], p.detach()) for n, p in trainer.model.named_parameters())
    return {"unchanged": unchanged, "moved_after": moved, "skipped": second["train/skipped_steps"],
            "stage": trainer.mesh.pp_rank}


def test_a_nonfinite_gradient_on_one_stage_skips_the_step_on_every_stage(tmp_path):
    results = run_distributed(_skip_worker, 2, str(tmp_path), MUON + PP2 + ["trainer.batch_size=4"])
    assert [r["stage"] for r in results] == [0, 1]
    for r in results:
        assert r["unchanged"] and r["moved_after"] and r["skipped"] == 1.0, r


def _pp_layout(run_dir: Path, pp: int, mode: str, options: list[str]) -> None:
    from tests.test_checkpoint import _layout_worker, interrupted, make_trainer

    overrides = ["trainer.batch_size=4", *MUON, *options]
    if pp == 1:
        (interrupted(run_dir, overrides) if mode == "interrupt" else make_trainer(run_dir, overrides).train())
    else:
        run_distributed(_layout_worker, pp, str(run_dir), overrides + [f"parallel.pp={pp}", "parallel.pp_microbatches=2"],
                        mode)


# The same-layout resume also runs, as a real kill -9 under torchrun, in tests/test_faults.py.
@pytest.mark.parametrize("saved, loaded", [
    pytest.param(2, 2, marks=pytest.mark.slow),
    (2, 1),
    pytest.param(1, 2, marks=pytest.mark.slow),
], ids=["pp2-resume", "pp2-to-1", "pp1-to-2"])
def test_pipeline_checkpoints_resume_and_move_between_pp_sizes(tmp_path, saved, loaded):
    """A run stopped after its step-4 checkpoint (the trainer dropped, as a killed job's is) and
    resumed with resume=auto: bit-identical at the same pp, within 1e-5 at another."""
    from trainer.checkpoint import files as checkpoint_files
    from tests.test_checkpoint import assert_continues_like

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _pp_layout(straight, saved, "train", [])
    _pp_layout(resumed, saved, "interrupt", [])
    meta = checkpoint_files.open_checkpoint(resumed / "checkpoints" / "step_00000004")["mesh"]
    assert meta == ({"dp": 1, "tp": 1, "pp": 2} if saved == 2 else {"dp": 1, "tp": 1})
    _pp_layout(resumed, loaded, "train", [])
    assert_continues_like(straight, resumed, 0.0 if saved == loaded else 1e-5)


def test_fsdp_keeps_gathered_blocks_to_the_backward_under_a_pipeline_unless_told():
    """parallel.reshard_after_forward=null: true without a pipeline, false under one (each
    micro-batch's backward would gather every block again); an explicit value wins."""
    from trainer.config import ParallelConfig, reshard_after_forward

    assert reshard_after_forward(ParallelConfig()) is True
    assert reshard_after_forward(ParallelConfig(pp=2)) is False
    assert reshard_after_forward(ParallelConfig(pp=2, reshard_after_forward=True)) is True
    assert reshard_after_forward(ParallelConfig(reshard_after_forward=False)) is False
