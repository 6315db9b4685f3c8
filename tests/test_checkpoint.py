"""Checkpoints: exact resume, resharding across (DP, TP), corruption handling."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import compose
from tests.distributed import run_distributed
from trainer import checkpoint
from trainer.config import to_dataclass

COMMON = [
    "model=gpt_tiny", "optim=muon", "optim.muon.ns_dtype=fp32", "trainer.precision=fp32",
    "trainer.device=cpu", "trainer.max_steps=8", "trainer.seq_len=64", "logger.interval=1", "eval.interval=0",
    "eval.batches=2", "logger.wandb.mode=disabled", "logger.tensorboard=false",
    "logger.progress=none", "optim.warmup_steps=2", "checkpoint.interval=4",
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


def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path):
    make_trainer(tmp_path / "straight", ["trainer.batch_size=4"]).train()
    interrupted(tmp_path / "resumed", ["trainer.batch_size=4"])
    make_trainer(tmp_path / "resumed", ["trainer.batch_size=4"]).train()  # resume=auto
    straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert sorted(resumed) == [5, 6, 7, 8]
    for step in resumed:
        assert resumed[step] == straight[step], step  # bit-identical on CPU


def test_checkpoints_are_atomic_kept_and_pointed_to(tmp_path):
    make_trainer(tmp_path, ["trainer.batch_size=2", "checkpoint.interval=2", "checkpoint.keep=2"]).train()
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*.pt")) == ["step_00000006.pt", "step_00000008.pt"]
    assert (ckpts / "latest").read_text() == "step_00000008.pt"
    assert not list(ckpts.glob(".*tmp"))
    state = checkpoint.load(ckpts / "step_00000008.pt")
    assert state["step"] == 8 and state["config"]["model"]["name"] == "gpt_tiny"
    assert set(state["optim"]["blocks.0.attn.wq.weight"]) == {"momentum_buffer"}
    assert set(state["optim"]["embed.weight"]) == {"exp_avg", "exp_avg_sq", "step"}


def test_corrupted_checkpoint_is_named_and_auto_falls_back(tmp_path, caplog):
    make_trainer(tmp_path, ["trainer.batch_size=2"]).train()  # saves steps 4 and 8
    newest = tmp_path / "checkpoints" / "step_00000008.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated
    with pytest.raises(checkpoint.CheckpointError, match="step_00000008.pt"):
        checkpoint.find_resume(str(newest), newest.parent)
    state = checkpoint.find_resume("auto", newest.parent)
    assert state["step"] == 4
    assert "skipping unusable checkpoint" in caplog.text and "step_00000008.pt" in caplog.text


def test_checkpoint_of_another_model_shape_lists_the_differing_keys(tmp_path):
    make_trainer(tmp_path / "a", ["trainer.batch_size=2", "trainer.max_steps=1"]).train()
    path = tmp_path / "a" / "checkpoints" / "step_00000001.pt"
    with pytest.raises(checkpoint.CheckpointError, match="mlp.w_gate.weight"):
        make_trainer(tmp_path / "b", ["trainer.batch_size=2", "model.ffn_hidden=128",
                                      f"checkpoint.resume={path}"])


def _layout_worker(rank: int, world: int, run_dir: str, overrides: list[str], mode: str) -> None:
    from trainer.mesh import build_mesh

    cfg = to_dataclass(compose(COMMON + overrides))
    mesh = build_mesh(cfg.parallel.tp)
    if mode == "interrupt":
        interrupted(Path(run_dir), overrides, mesh)
    else:
        make_trainer(Path(run_dir), overrides, mesh).train()


def run_layout(run_dir: Path, dp: int, tp: int, mode: str, global_batch: int = 4) -> None:
    overrides = [f"trainer.batch_size={global_batch // dp}", f"parallel.tp={tp}"]
    if dp * tp == 1:
        if mode == "interrupt":
            interrupted(run_dir, overrides)
        else:
            make_trainer(run_dir, overrides).train()
    else:
        run_distributed(_layout_worker, dp * tp, str(run_dir), overrides, mode)


# Four processes on two cores take about a minute per case: the default suite keeps one
# reshard (single process -> DP 2 x TP 2); the others run with the slow tests.
@pytest.mark.parametrize("saved, loaded", [
    pytest.param((2, 2), (2, 2), marks=pytest.mark.slow),
    pytest.param((2, 2), (4, 1), marks=pytest.mark.slow),
    ((1, 1), (2, 2)),
    pytest.param((4, 1), (1, 1), marks=pytest.mark.slow),
])
def test_reshard_continues_like_the_unresharded_run(tmp_path, saved, loaded):
    straight = tmp_path / "straight"
    run_layout(straight, *saved, mode="train")
    resumed = tmp_path / "resumed"
    run_layout(resumed, *saved, mode="interrupt")
    run_layout(resumed, *loaded, mode="train")
    a, b = losses(straight), losses(resumed)
    assert sorted(b) == [5, 6, 7, 8]
    tol = 0.0 if saved == loaded else 1e-5
    for step in b:
        assert abs(a[step] - b[step]) <= tol * a[step], (step, a[step], b[step])
    # and the final parameters agree
    pa = checkpoint.load(straight / "checkpoints" / "step_00000008.pt")["params"]
    pb = checkpoint.load(resumed / "checkpoints" / "step_00000008.pt")["params"]
    for name in pa:
        assert ((pa[name] - pb[name]).norm() / pa[name].norm()).item() <= tol, name


def test_restored_state_goes_to_the_device_of_the_tensor_it_replaces():
    """Checkpoints load on the CPU; a GPU run needs its parameters and optimizer state back
    on the GPU. The meta device stands in for one here."""
    like = torch.empty(4, 3, device="meta", dtype=torch.bfloat16)
    local = checkpoint.to_local(torch.ones(4, 3), like, None, None)
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
