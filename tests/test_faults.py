"""Faults: NaN steps, preemption signals and kill -9 never lose work or corrupt a run."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from tests.test_checkpoint import COMMON, make_trainer
from trainer.loop import NonFiniteLoss


def poison_step(trainer, bad_step: int) -> None:
    """Make the loss NaN on one optimizer step (1-based), as a bad batch would."""
    forward = trainer.forward

    def maybe_nan(x, y):
        loss = forward(x, y)
        return loss * float("nan") if trainer.step + 1 == bad_step else loss

    trainer.forward = maybe_nan


def test_nonfinite_skip_drops_the_update_and_counts_it(tmp_path):
    trainer = make_trainer(tmp_path, ["trainer.batch_size=2", "trainer.nonfinite=skip"])
    poison_step(trainer, 3)
    trainer.train_step(measure=False)
    trainer.train_step(measure=False)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    stats = trainer.train_step(measure=False)  # step 3: NaN
    assert stats["train/skipped_steps"] == 1.0 and trainer.step == 3
    for a, p in zip(before, trainer.model.parameters()):
        assert torch.equal(a, p)
    stats = trainer.train_step(measure=True)
    assert torch.isfinite(torch.as_tensor(stats["train/loss"]))
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_nonfinite_stop_exits_with_a_clear_message_and_keeps_the_last_checkpoint(tmp_path):
    trainer = make_trainer(tmp_path, ["trainer.batch_size=2", "trainer.nonfinite=stop"])
    poison_step(trainer, 6)
    with pytest.raises(NonFiniteLoss, match="step 6"):
        trainer.train()
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_00000004.pt"


@pytest.mark.parametrize("optim", ["muon", "adamw"])
def test_nonfinite_skip_between_logging_steps_happens_on_the_device(tmp_path, optim):
    """No logging step, so no host sync: the optimizers and the expert-bias update skip the
    NaN step on the device, leaving every parameter, optimizer state and bias as it was, and
    the host counts the skip at its next sync point."""
    trainer = make_trainer(tmp_path, ["model=moe_tiny", f"optim={optim}", "trainer.batch_size=2",
                                      "trainer.nonfinite=skip", "logger.interval=1000"])
    poison_step(trainer, 3)
    trainer.train_step(measure=False)
    trainer.train_step(measure=False)
    params = [p.detach().clone() for p in trainer.model.parameters()]
    state = [t.clone() for t in trainer.optimizer.state_tensors()]
    biases = [b.clone() for n, b in trainer.model.named_buffers() if n.endswith("expert_bias")]
    assert biases and any(b.abs().sum() > 0 for b in biases)  # two steps moved them
    stats = trainer.train_step(measure=False)  # step 3: NaN
    assert trainer.step == 3 and float(stats["train/skipped_steps"]) == 1.0
    assert all(torch.equal(a, p) for a, p in zip(params, trainer.model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(state, trainer.optimizer.state_tensors()))
    after = [b for n, b in trainer.model.named_buffers() if n.endswith("expert_bias")]
    assert all(torch.equal(a, b) for a, b in zip(biases, after))
    assert trainer.skipped_steps == 0  # the host has not looked yet
    trainer.train_step(measure=False)
    stats = trainer.train_step(measure=True)  # a logging step collects the count
    assert trainer.skipped_steps == 1 and stats["train/skipped_steps"] == 1.0
    assert not all(torch.equal(a, p) for a, p in zip(params, trainer.model.parameters()))
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_nonfinite_stop_between_logging_steps_stops_at_the_next_sync_point(tmp_path):
    # Step 6 is skipped on the device; the run stops at the final step's sync point,
    # naming step 6, before any checkpoint after it is written.
    trainer = make_trainer(tmp_path, ["trainer.batch_size=2", "trainer.nonfinite=stop", "logger.interval=1000"])
    poison_step(trainer, 6)
    with pytest.raises(NonFiniteLoss, match="step 6"):
        trainer.train()
    assert trainer.step == 7  # stopped inside step 8 (the last, a logging step), before its update
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_00000004.pt"


def launch(run_dir: Path, *extra: str) -> subprocess.Popen:
    args = [a for a in COMMON if not a.startswith(("trainer.max_steps", "checkpoint.interval"))]
    return subprocess.Popen(
        [sys.executable, "train.py", f"hydra.run.dir={run_dir}", *args, "trainer.batch_size=2",
         "trainer.max_steps=16", "checkpoint.interval=3", *extra],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )


def final_losses(run_dir: Path) -> dict[int, float]:
    """Loss per step; a resumed run re-logs the steps after its checkpoint: keep the last."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "train/loss" in record:
            out[record["step"]] = record["train/loss"]
    return out


def wait_for_step(run_dir: Path, proc: subprocess.Popen, step: int) -> None:
    deadline = time.time() + 300
    while time.time() < deadline:
        path = run_dir / "metrics.jsonl"
        if path.exists() and any(json.loads(l)["step"] >= step for l in path.read_text().splitlines() if l):
            return
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.05)
    raise TimeoutError("the run did not reach the step")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    run_dir = tmp_path_factory.mktemp("straight")
    proc = launch(run_dir)
    assert proc.wait(timeout=600) == 0, proc.stderr.read()
    return final_losses(run_dir)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_killed_or_preempted_run_resumes_to_exactly_the_same_losses(tmp_path, uninterrupted, sig):
    proc = launch(tmp_path)
    wait_for_step(tmp_path, proc, 8)
    proc.send_signal(sig)
    code = proc.wait(timeout=120)
    if sig in (signal.SIGTERM, signal.SIGINT):
        assert code == 143  # saved a checkpoint at a step boundary, then exited
        latest = (tmp_path / "checkpoints" / "latest").read_text()
        assert int(latest[5:13]) >= 8
    else:
        assert code == -signal.SIGKILL
    resumed = launch(tmp_path)  # checkpoint.resume=auto
    assert resumed.wait(timeout=600) == 0, resumed.stderr.read()
    assert final_losses(tmp_path) == uninterrupted


def launch_torchrun(run_dir: Path, *extra: str) -> subprocess.Popen:
    args = [a for a in COMMON if not a.startswith(("trainer.max_steps", "checkpoint.interval"))]
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "--max-restarts=1", "train.py", f"hydra.run.dir={run_dir}", *args, "trainer.batch_size=1",
         "trainer.max_steps=16", "checkpoint.interval=3",
         "parallel.timeout_s=120",  # a restart that cannot reconnect fails instead of hanging
         *extra],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


@pytest.mark.slow
def test_torchrun_restarts_the_group_after_a_killed_rank_and_finishes_identically(tmp_path):
    straight = launch_torchrun(tmp_path / "straight")
    assert straight.wait(timeout=600) == 0, straight.stderr.read()[-3000:]
    run_dir = tmp_path / "killed"
    proc = launch_torchrun(run_dir)
    wait_for_step(run_dir, proc, 8)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2, workers
    subprocess.run(["kill", "-9", workers[-1]], check=True)  # rank 1 dies
    assert proc.wait(timeout=600) == 0, proc.stderr.read()[-3000:]
    assert final_losses(run_dir) == final_losses(tmp_path / "straight")
