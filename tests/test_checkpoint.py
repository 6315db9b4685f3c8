"""Checkpoints: exact resume, resharding across (DP, TP), corruption handling."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.conftest import TEST_VOCAB, compose
from tests.distributed import run_distributed
from tests.closeness import WELL_CONDITIONED, check_relative
from trainer.checkpoint import files as checkpoint_files
from trainer.checkpoint import state as checkpoint_state
from trainer.checkpoint import store as checkpoint
from trainer.config import to_dataclass

COMMON = [
    "model=gpt_tiny", "optim=muon", "optim.muon.ns_dtype=fp32", "trainer.precision=fp32",
    "trainer.device=cpu", "trainer.max_steps=8", "trainer.seq_len=64", "logger.interval=1", "eval.interval=0",
    "eval.batches=2", "logger.wandb.mode=disabled", "logger.tensorboard=false",
    "logger.progress=none", "optim.warmup_steps=2", "checkpoint.interval=4", TEST_VOCAB,
]


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}


def make_trainer(run_dir: Path, overrides: list[str], mesh=None):
    from trainer.loop import Trainer

    return Trainer(to_dataclass(compose(COMMON + overrides)), run_dir, mesh)


def interrupted(run_dir: Path, overrides: list[str], mesh=None, stop_at: int = 4) -> None:
    """Train `stop_at` steps, checkpoint, and drop the trainer: as if the job died there."""
    trainer = make_trainer(run_dir, overrides, mesh)
    for _ in range(stop_at):
        trainer.train_step(measure=False)
    trainer.save_checkpoint()


# The Muon family's options: NorMuon's per-row second moment is optimizer state of its own.
FAMILY = ["optim.muon.normuon=true", "optim.muon.ns_method=gram", "optim.cautious_wd=true"]


@pytest.mark.parametrize("options", [[], FAMILY], ids=["muon", "muon-family"])
def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path, options):
    overrides = ["trainer.batch_size=4", *options]
    make_trainer(tmp_path / "straight", overrides).train()
    interrupted(tmp_path / "resumed", overrides)
    make_trainer(tmp_path / "resumed", overrides).train()  # resume=auto
    straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert sorted(resumed) == [5, 6, 7, 8]
    for step in resumed:
        assert resumed[step] == straight[step], step  # bit-identical on CPU


def test_checkpoints_are_atomic_kept_and_pointed_to(tmp_path):
    make_trainer(tmp_path, ["trainer.batch_size=2", "checkpoint.interval=2", "checkpoint.keep=2"]).train()
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000006", "step_00000008"]
    assert (ckpts / "latest").read_text() == "step_00000008"
    assert not list(ckpts.glob(".*"))  # no partial save left behind
    newest = ckpts / "step_00000008"
    listed = dict(line.split()[::-1] for line in (newest / "manifest.sha256").read_text().splitlines())
    assert set(listed) == {p.name for p in newest.iterdir()} - {"manifest.sha256"}
    assert all(checkpoint_files.file_digest(newest / n) == d for n, d in listed.items())
    state = checkpoint_files.load(newest)
    assert state["step"] == 8 and state["config"]["model"]["name"] == "gpt_tiny"
    assert set(state["optim"]["blocks.0.attn.wq.weight"]) == {"momentum_buffer"}
    assert set(state["optim"]["embed.weight"]) == {"exp_avg", "exp_avg_sq", "step"}


def test_a_checkpoint_holds_exactly_the_trainers_state(tmp_path):
    """What `load` reads back from the shards is the single-process state, tensor for tensor."""
    trainer = make_trainer(tmp_path, ["model=moe_tiny", "trainer.batch_size=2", "trainer.max_steps=3"])
    trainer.train()
    saved = checkpoint_files.load(tmp_path / "checkpoints" / "step_00000003")
    live = checkpoint_state.logical_state(trainer)
    for part in ("params", "buffers"):
        assert saved[part].keys() == live[part].keys()
        assert all(torch.equal(saved[part][k], live[part][k]) for k in live[part]), part
    assert saved["optim"].keys() == live["optim"].keys()
    for name, entry in live["optim"].items():
        assert all(torch.equal(saved["optim"][name][k], v) for k, v in entry.items()), name


def test_corrupted_checkpoint_is_named_and_auto_falls_back(tmp_path, caplog):
    make_trainer(tmp_path, ["trainer.batch_size=2"]).train()  # saves steps 4 and 8
    newest = tmp_path / "checkpoints" / "step_00000008"
    shard = next(newest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])  # truncated
    with pytest.raises(checkpoint_files.CheckpointError, match=f"{shard}: checksum does not match"):
        checkpoint.find_resume(str(newest), newest.parent)
    state = checkpoint.find_resume("auto", newest.parent)
    assert state["step"] == 4
    assert "skipping unusable checkpoint" in caplog.text and "step_00000008" in caplog.text


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (1, 4), (4, 1)])
def test_flat_ranges_cut_into_rectangles_that_cover_exactly_the_range(shape):
    from trainer.checkpoint.shards import flat_boxes, flat_offset

    n = math.prod(shape)
    for start in range(n):
        for stop in range(start + 1, n + 1):
            covered = []
            for offsets, sizes in flat_boxes(shape, start, stop):
                index = torch.arange(n).view(shape)[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
                flat = index.reshape(-1).tolist()
                # contiguous in the flat order, starting where flat_offset says
                assert flat == list(range(flat_offset(shape, offsets), flat_offset(shape, offsets) + len(flat)))
                covered += flat
            assert covered == list(range(start, stop)), (start, stop)


def test_tp_placement_drops_the_vocabulary_padding():
    from trainer.checkpoint.shards import Placement, pieces_of

    # 10 logical rows padded to 12, TP 2: rank 1 holds rows 6..11, of which 10 and 11 are padding.
    placement = Placement(split_dim=0, rank=1, rows=10, parts=2)
    local = torch.arange(18.).view(6, 3)
    assert placement.logical_shape((6, 3)) == (10, 3)
    pieces = pieces_of(local, (6, 3), 0, placement)
    assert [(o, tuple(t.shape)) for o, t in pieces] == [((6, 0), (4, 3))]
    assert torch.equal(pieces[0][1], local[:4])
    # a flat ZeRO piece from the middle of row 1 into the padding: two rectangles survive
    pieces = pieces_of(torch.arange(14.), (6, 3), 4, placement)
    assert [(o, tuple(t.shape)) for o, t in pieces] == [((7, 1), (1, 2)), ((8, 0), (2, 3))]
    assert pieces[1][1].reshape(-1).tolist() == [2., 3., 4., 5., 6., 7.]


def _async_worker(rank: int, world: int, run_dir: str, overrides: list[str]) -> None:
    from parallel.mesh import build_mesh

    make_trainer(Path(run_dir), overrides, build_mesh(1)).train()


@pytest.mark.slow
def test_async_save_over_dp_writes_the_same_checkpoints(tmp_path):
    """Two ranks each write their shards from a background thread, over a gloo group of their
    own, while training goes on; committed, the checkpoints equal the synchronous ones."""
    common = ["trainer.batch_size=1", "checkpoint.interval=2", "checkpoint.keep=10"]
    run_distributed(_async_worker, 2, str(tmp_path / "sync"), common)
    run_distributed(_async_worker, 2, str(tmp_path / "async"), common + ["checkpoint.async_save=true"])
    for step in (2, 4, 6, 8):
        a = checkpoint_files.load(tmp_path / "sync" / "checkpoints" / f"step_{step:08d}")
        b = checkpoint_files.load(tmp_path / "async" / "checkpoints" / f"step_{step:08d}")
        assert a["mesh"] == b["mesh"] == {"dp": 2, "tp": 1}
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"]), step
        assert all(torch.equal(a["optim"][n][k], b["optim"][n][k]) for n in a["optim"] for k in a["optim"][n])


def write_single_file_checkpoint(trainer, path: Path) -> None:
    """A checkpoint in the format of earlier versions: one file of full logical tensors."""
    state = checkpoint_state.logical_state(trainer)
    state["config"] = trainer.resolved_config()
    torch.save(state, path)
    path.with_suffix(".sha256").write_text(f"{checkpoint_files.file_digest(path)}  {path.name}\n")


@pytest.mark.parametrize("model", ["gpt_tiny", "moe_tiny"])
def test_single_file_checkpoints_of_earlier_versions_still_resume(tmp_path, model):
    overrides = ["trainer.batch_size=4", f"model={model}"]
    make_trainer(tmp_path / "straight", overrides).train()
    trainer = make_trainer(tmp_path / "resumed", overrides)
    for _ in range(4):
        trainer.train_step(measure=False)
    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    write_single_file_checkpoint(trainer, tmp_path / "resumed" / "checkpoints" / "step_00000004.pt")
    make_trainer(tmp_path / "resumed", overrides).train()  # resume=auto finds the file
    straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert sorted(resumed) == [5, 6, 7, 8]
    assert all(resumed[step] == straight[step] for step in resumed)


def test_async_save_writes_the_same_checkpoint(tmp_path):
    """checkpoint.async_save: the files are written in the background, committed before the
    next save; what they hold is what a synchronous save writes."""
    common = ["trainer.batch_size=2", "checkpoint.interval=2", "checkpoint.keep=10"]
    make_trainer(tmp_path / "sync", common).train()
    make_trainer(tmp_path / "async", common + ["checkpoint.async_save=true"]).train()
    for step in (2, 4, 6, 8):
        a = checkpoint_files.load(tmp_path / "sync" / "checkpoints" / f"step_{step:08d}")
        b = checkpoint_files.load(tmp_path / "async" / "checkpoints" / f"step_{step:08d}")
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"]), step
        assert all(torch.equal(a["optim"][n][k], b["optim"][n][k]) for n in a["optim"] for k in a["optim"][n])
    assert losses(tmp_path / "sync") == losses(tmp_path / "async")


def test_checkpoint_of_another_model_shape_lists_the_differing_keys(tmp_path):
    make_trainer(tmp_path / "a", ["trainer.batch_size=2", "trainer.max_steps=1"]).train()
    path = tmp_path / "a" / "checkpoints" / "step_00000001"
    with pytest.raises(checkpoint_files.CheckpointError, match="mlp.w_gate.weight"):
        make_trainer(tmp_path / "b", ["trainer.batch_size=2", "model.ffn_hidden=128",
                                      f"checkpoint.resume={path}"])


def _layout_worker(rank: int, world: int, run_dir: str, overrides: list[str], mode: str) -> None:
    from parallel.mesh import build_mesh

    cfg = to_dataclass(compose(COMMON + overrides))
    mesh = build_mesh(cfg.parallel.tp, dp_shard=cfg.parallel.dp_shard, ep=cfg.parallel.ep, pp=cfg.parallel.pp)
    if mode == "interrupt":
        interrupted(Path(run_dir), overrides, mesh)
    else:
        make_trainer(Path(run_dir), overrides, mesh).train()


def run_layout(run_dir: Path, dp: int, tp: int, mode: str, global_batch: int = 4, model: str = "gpt_tiny",
               options: tuple[str, ...] = ()) -> None:
    overrides = [f"trainer.batch_size={global_batch // dp}", f"parallel.tp={tp}", f"model={model}", *WELL_CONDITIONED,
                 *options]
    if dp * tp == 1:
        if mode == "interrupt":
            interrupted(run_dir, overrides)
        else:
            make_trainer(run_dir, overrides).train()
    else:
        run_distributed(_layout_worker, dp * tp, str(run_dir), overrides, mode)


# Four processes on two cores take about a minute per case: the default suite keeps one
# reshard (single process -> DP 2 x TP 2); the others run with the slow tests. Every rank
# writes its own shard; each load reads, through DCP, the parts its layout holds: Muon
# matrices owned whole by one DP rank, AdamW state in flat ZeRO-1 pieces, TP shards with
# vocabulary padding, MoE expert stacks.
@pytest.mark.parametrize("saved, loaded, model, batch, options", [
    pytest.param((2, 2), (2, 2), "gpt_tiny", 4, (), marks=pytest.mark.slow),
    pytest.param((2, 2), (4, 1), "gpt_tiny", 4, (), marks=pytest.mark.slow),
    ((1, 1), (2, 2), "gpt_tiny", 4, ()),
    pytest.param((3, 1), (1, 2), "gpt_tiny", 6, (), marks=pytest.mark.slow),
    pytest.param((4, 1), (1, 1), "gpt_tiny", 4, (), marks=pytest.mark.slow),
    pytest.param((2, 2), (4, 1), "moe_tiny", 4, (), marks=pytest.mark.slow),
    pytest.param((1, 1), (2, 2), "moe_tiny", 4, (), marks=pytest.mark.slow),
    # NorMuon's v, saved in its weights' shape, cut and regrouped like the momentum
    pytest.param((2, 1), (1, 2), "moe_tiny", 4, tuple(FAMILY), marks=pytest.mark.slow),
    pytest.param((1, 2), (2, 1), "gpt_tiny", 4, (*FAMILY, "optim.muon.tp_mode=gram"), marks=pytest.mark.slow),
])
def test_reshard_continues_like_the_unresharded_run(tmp_path, saved, loaded, model, batch, options):
    straight = tmp_path / "straight"
    run_layout(straight, *saved, mode="train", global_batch=batch, model=model, options=options)
    resumed = tmp_path / "resumed"
    run_layout(resumed, *saved, mode="interrupt", global_batch=batch, model=model, options=options)
    assert checkpoint_files.open_checkpoint(resumed / "checkpoints" / "step_00000004")["mesh"] == dict(
        dp=saved[0], tp=saved[1])
    run_layout(resumed, *loaded, mode="train", global_batch=batch, model=model, options=options)
    assert_continues_like(straight, resumed, 0.0 if saved == loaded else 1e-5)


def assert_continues_like(straight: Path, resumed: Path, tol: float) -> None:
    """Steps 5-8 of the resumed run, and its final parameters, within `tol` (relative) of
    the run that was never interrupted."""
    a, b = losses(straight), losses(resumed)
    assert sorted(b) == [5, 6, 7, 8]
    for step in b:
        check_relative(f"step {step}", b[step], a[step], tol)
    pa = checkpoint_files.load(straight / "checkpoints" / "step_00000008")["params"]
    pb = checkpoint_files.load(resumed / "checkpoints" / "step_00000008")["params"]
    for name in pa:
        check_relative(name, pb[name], pa[name], tol)


def test_restored_state_goes_to_the_device_of_the_tensor_it_replaces():
    """Checkpoints load on the CPU; a GPU run needs its parameters and optimizer state back
    on the GPU. The meta device stands in for one here."""
    like = torch.empty(4, 3, device="meta", dtype=torch.bfloat16)
    local = checkpoint_state.to_local(torch.ones(4, 3), like, None, None)
    assert local.device.type == "meta" and local.dtype == torch.bfloat16


def test_optimizer_state_is_installed_on_its_parameters_device():
    # Checkpoints load onto the CPU. Fused AdamW reads each step count on the parameters'
    # device, as fp32 (where torch's own load_state_dict puts it); "meta" stands in for a GPU.
    from optim.optimizer_set import install_state

    param = torch.empty(4, 3, device="meta")
    step = install_state("step", torch.tensor(7), param)
    moment = install_state("exp_avg", torch.zeros(4, 3, dtype=torch.float64), param)
    assert (step.device, step.dtype) == (param.device, torch.float32)
    assert (moment.device, moment.dtype) == (param.device, torch.float64)
    source = torch.ones(2)
    assert install_state("momentum_buffer", source, torch.empty(2)).data_ptr() != source.data_ptr()
