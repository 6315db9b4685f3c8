"""Faults: NaN steps, divergence, preemption signals, kill -9 and unusable checkpoints never
lose work or corrupt a run; bad input found late still stops with one line."""
from __future__ import annotations

import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from data.config import DataConfig
from data.token_streams import prepare_data
from data.sources import DataConfigError, HFSource, is_held_out
from tests.conftest import REPO
from tests.prestarted import Started, run_python, start_python
from tests.test_checkpoint import COMMON, make_trainer
from trainer.checkpoint import files as checkpoint_files
from trainer.checkpoint import store as checkpoint
from trainer.loop import NonFiniteLoss


def poison_step(trainer, *bad_steps: int) -> None:
    """Make the loss NaN on these optimizer steps (1-based), as bad batches would."""
    forward = trainer.forward

    def maybe_nan(x, y):
        loss = forward(x, y)
        return loss * float("nan") if trainer.step + 1 in bad_steps else loss

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
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_00000004"


@pytest.mark.parametrize("optim", ["muon", "adamw"])
def test_nonfinite_skip_between_logging_steps_happens_on_the_device(tmp_path, optim):
    """No logging step, so no host sync: the optimizers and the expert-bias update skip the
    NaN step on the device, leaving every parameter, optimizer state and bias as it was, and
    the host counts the skip at its next sync point."""
    # The default vocabulary's data: with TEST_VOCAB's, AdamW's two steps move one expert's bias
    # up and back down to zero, and an unmoved bias would not show a skip that moves it.
    trainer = make_trainer(tmp_path, ["model=moe_tiny", f"optim={optim}", "trainer.batch_size=2",
                                      "trainer.nonfinite=skip", "logger.interval=1000", "data.vocab_size=8192"])
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
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_00000004"


def launch(run_dir: Path, *extra: str) -> Started:
    args = [a for a in COMMON if not a.startswith(("trainer.max_steps", "checkpoint.interval"))]
    return start_python(["train.py", f"hydra.run.dir={run_dir}", *args, "trainer.batch_size=2",
                         "trainer.max_steps=16", "checkpoint.interval=3", *extra])


def final_losses(run_dir: Path) -> dict[int, float]:
    """Loss per step; a resumed run re-logs the steps after its checkpoint: keep the last."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "train/loss" in record:
            out[record["step"]] = record["train/loss"]
    return out


def wait_for_step(run_dir: Path, proc: subprocess.Popen | Started, step: int) -> None:
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
        # Saved a checkpoint at a step boundary, then exited as the signal's own: 128 + its number.
        assert code == {signal.SIGTERM: 143, signal.SIGINT: 130}[sig]
        latest = (tmp_path / "checkpoints" / "latest").read_text()
        assert int(latest[5:13]) >= 8
        # It says how to go on: the same command line, with its run dir pinned.
        said = [line for line in proc.stderr.read().splitlines() if line.startswith("to resume: ")]
        args = [a for a in proc.args[2:] if not a.startswith("hydra.run.dir=")] + [f"hydra.run.dir={tmp_path}"]
        assert said == [f"to resume: {shlex.join(['python', 'train.py', *args])}"], said
    else:
        assert code == -signal.SIGKILL
    at = int((tmp_path / "checkpoints" / "latest").read_text()[5:13])
    before = (tmp_path / "metrics.jsonl").read_text().splitlines()
    resumed = launch(tmp_path)  # checkpoint.resume=auto
    assert resumed.wait(timeout=600) == 0, resumed.stderr.read()
    assert final_losses(tmp_path) == uninterrupted
    # One row per step: the stopped run's rows past the checkpoint were set aside, not repeated.
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 17))
    past = [line for line in before if line.strip() and not json_row_at_or_before(line, at)]
    aside = tmp_path / "metrics.set_aside.jsonl"
    assert (aside.read_text().splitlines() if aside.exists() else []) == past


def json_row_at_or_before(line: str, step: int) -> bool:
    """Whether a metrics.jsonl line is a whole row of `step` or earlier (a kill can cut the last one short)."""
    try:
        return json.loads(line)["step"] <= step
    except ValueError:
        return False


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
@pytest.mark.parametrize("layout", [
    [], ["parallel.dp_shard=2"],
    # two pipeline stages (one sequence a step: gpipe over one micro-batch)
    ["parallel.pp=2", "parallel.pp_schedule=gpipe", "parallel.pp_microbatches=1"],
], ids=["zero1", "fsdp2", "pp2"])
def test_torchrun_restarts_the_group_after_a_killed_rank_and_finishes_identically(tmp_path, layout):
    straight = launch_torchrun(tmp_path / "straight", *layout)
    assert straight.wait(timeout=600) == 0, straight.stderr.read()[-3000:]
    run_dir = tmp_path / "killed"
    proc = launch_torchrun(run_dir, *layout)
    wait_for_step(run_dir, proc, 8)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2, workers
    subprocess.run(["kill", "-9", workers[-1]], check=True)  # rank 1 dies
    assert proc.wait(timeout=600) == 0, proc.stderr.read()[-3000:]
    assert final_losses(run_dir) == final_losses(tmp_path / "straight")


def test_a_rank_lost_after_its_checkpoint_is_in_place_leaves_that_steps_row(tmp_path, monkeypatch):
    """The torchrun restart above once lost step 9's row: rank 1 died after checkpoint 9 was
    renamed into place and `latest` pointed at it, so rank 0 failed at the closing barrier
    before it logged the step, and the restart resumed past it. The row goes out first now."""
    trainer = make_trainer(tmp_path, ["trainer.batch_size=2", "checkpoint.interval=2", "trainer.max_steps=4"])

    def peer_gone(group, what):
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(checkpoint, "barrier", peer_gone)
    with pytest.raises(RuntimeError, match="closed by peer"):
        trainer.train()
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_00000002"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert math.isfinite(rows[-1]["train/loss"])


# ---- divergence: a bound on skipped steps, no checkpoint of NaN weights, the good one kept ----


def cli(run_dir: Path, *extra: str, timeout: int = 600, **popen) -> subprocess.CompletedProcess:
    """train.py on COMMON, `extra` replacing any COMMON value of the same key."""
    keys = {e.split("=", 1)[0] for e in extra}
    args = [a for a in COMMON if a.split("=", 1)[0] not in keys]
    return run_python(["train.py", f"hydra.run.dir={run_dir}", *args, *extra], timeout=timeout, **popen)


def error_line(proc: subprocess.CompletedProcess) -> str:
    """The one `error:` line of a failed run, with no traceback."""
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


def all_finite(path: Path) -> bool:
    state = checkpoint_files.load(path)
    tensors = [*state["params"].values(), *(t for entry in state["optim"].values() for t in entry.values())]
    return all(torch.isfinite(t).all() for t in tensors if t.is_floating_point())


@pytest.mark.parametrize("optim", ["adamw", "muon"])
def test_a_huge_lr_stops_the_run_with_exit_3_naming_the_last_good_checkpoint(tmp_path, optim):
    """lr=1e4 blows the weights up within a few steps. Before: 17 of 20 steps skipped one by
    one, rc 0, and checkpoints that rotated every good one out. Now: the run stops after
    trainer.nonfinite_max_consecutive skips in a row, every checkpoint written is finite, and
    the last good one (the newest whose weights trained a finite step) survives keep=2."""
    proc = cli(tmp_path, f"optim={optim}", "optim.lr=1e4", "trainer.batch_size=2", "trainer.max_steps=40",
               "checkpoint.interval=1", "checkpoint.keep=2", "trainer.nonfinite_max_consecutive=5")
    assert proc.returncode == 3, proc.stderr[-3000:]
    line = error_line(proc)
    assert line.startswith("error: diverged: 5 consecutive steps had non-finite loss/gradients")
    losses = {}
    for record in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()):
        losses[record["step"]] = record["train/loss"]
    first_nan = min(step for step, loss in losses.items() if not math.isfinite(loss))
    assert first_nan >= 3 and all(math.isfinite(losses[s]) for s in range(1, first_nan))
    # The 5th skip in a row (step first_nan + 4) stops the run before that step is logged or
    # checkpointed, long before step 40.
    assert max(losses) == first_nan + 3
    # The weights saved after step first_nan - 1 gave the NaN; those after first_nan - 2 trained on.
    good = tmp_path / "checkpoints" / f"step_{first_nan - 2:08d}"
    assert line.endswith(f"Last good checkpoint: {good}.")
    assert (tmp_path / "checkpoints" / "last_good").read_text() == good.name
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    newest = [f"step_{s:08d}" for s in (first_nan + 2, first_nan + 3)]
    assert saved == sorted({good.name, *newest})  # keep=2, plus the good one
    assert all(all_finite(p) for p in (tmp_path / "checkpoints").glob("step_*"))


def test_isolated_skips_are_absorbed_and_a_run_of_them_stops_the_run(tmp_path):
    """The bound counts skips in a row, also across the device's unsynced stretches."""
    quiet = ["trainer.batch_size=2", "trainer.nonfinite_max_consecutive=2", "logger.interval=1000"]
    trainer = make_trainer(tmp_path / "apart", quiet)
    poison_step(trainer, 2, 4, 6)
    trainer.train()
    assert trainer.step == 8 and trainer.skipped_steps == 3
    trainer = make_trainer(tmp_path / "in_a_row", quiet)
    poison_step(trainer, 3, 4)  # the 4th step is the checkpoint's sync point: both in one stretch
    with pytest.raises(NonFiniteLoss, match="diverged: 2 consecutive steps"):
        trainer.train()
    trainer = make_trainer(tmp_path / "across", quiet)
    poison_step(trainer, 4, 5)  # step 4 is collected by its checkpoint, step 5 at the end
    with pytest.raises(NonFiniteLoss, match="diverged: 2 consecutive steps"):
        trainer.train()


def test_no_checkpoint_is_written_from_nonfinite_weights(tmp_path):
    trainer = make_trainer(tmp_path, ["trainer.batch_size=2"])
    for _ in range(2):
        trainer.train_step(measure=True)
    with torch.no_grad():
        next(trainer.model.parameters())[0, 0] = float("inf")
    with pytest.raises(NonFiniteLoss, match="NaN/inf at step 2; no checkpoint was written"):
        trainer.save_checkpoint()
    assert not (tmp_path / "checkpoints").exists() or not list((tmp_path / "checkpoints").iterdir())


def test_a_nonfinite_eval_loss_stops_the_run_before_its_checkpoint(tmp_path):
    trainer = make_trainer(tmp_path, ["trainer.batch_size=2"])  # checkpoints at 4; eval only at 8
    trainer.evaluate = lambda: {"val/val/loss": float("inf")}
    with pytest.raises(NonFiniteLoss, match=r"diverged: val/val/loss inf at step 8\. Last good checkpoint: .*step_00000004\."):
        trainer.train()
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000004"]


# ---- unusable checkpoints: never start over silently, never overwrite them ----


def test_when_no_checkpoint_is_usable_the_run_stops_and_keeps_them_as_corrupt(tmp_path):
    """Before: two warnings, then a run from scratch that overwrote the damaged files."""
    make_trainer(tmp_path, ["trainer.batch_size=2"]).train()  # saves steps 4 and 8
    ckpts = tmp_path / "checkpoints"
    shard = next((ckpts / "step_00000008").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    (ckpts / "step_00000004" / "manifest.sha256").unlink()
    originals = {p.relative_to(ckpts).as_posix(): p.read_bytes() for p in ckpts.glob("step_*/*")}

    def set_aside() -> dict[str, bytes]:
        return {p.relative_to(ckpts).as_posix().replace(".corrupt", ""): p.read_bytes()
                for p in ckpts.glob("step_*.corrupt/*")}

    with pytest.raises(checkpoint_files.CheckpointError) as err:
        make_trainer(tmp_path, ["trainer.batch_size=2"])
    message = str(err.value)
    assert "\n" not in message and f"no usable checkpoint in {ckpts}" in message
    assert f"{shard}: checksum does not match" in message
    assert "step_00000004: its manifest manifest.sha256 is missing" in message
    assert "checkpoint.resume=none" in message
    assert not [p for p in ckpts.glob("step_*") if not p.name.endswith(".corrupt")]
    assert set_aside() == originals
    # A second start still refuses: the set-aside files are not forgotten.
    with pytest.raises(checkpoint_files.CheckpointError, match="step_00000008.corrupt .set aside by an earlier start"):
        make_trainer(tmp_path, ["trainer.batch_size=2"])
    # Starting over is an explicit choice, and it overwrites nothing.
    make_trainer(tmp_path, ["trainer.batch_size=2", "checkpoint.resume=none"]).train()
    assert set_aside() == originals
    assert checkpoint.find_resume("auto", ckpts)["step"] == 8


def test_resuming_with_the_other_optimizer_is_one_line_naming_both(tmp_path):
    """Before: KeyError: 'exp_avg' deep inside torch's adam.py."""
    first = cli(tmp_path, "optim=adamw", "trainer.batch_size=2", "trainer.max_steps=2", "checkpoint.interval=2")
    assert first.returncode == 0, first.stderr[-3000:]
    proc = cli(tmp_path, "optim=muon", "trainer.batch_size=2", "trainer.max_steps=4", "checkpoint.interval=2")
    assert proc.returncode == 2
    line = error_line(proc)
    assert "step_00000002: trained with optim=adamw, but this run has optim=muon" in line


# ---- bad data found while loading: one line naming the file and the problem ----


BAD_FILES = {
    "empty": (b"", "the file is empty"),
    "binary": (b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 8, "not text: a NUL byte at offset 7"),
    "malformed": (b'{"text": "fine"}\n{"text": broken}\n', r"line 2 is not valid JSON \(Expecting value"),
}


@pytest.mark.parametrize("kind", list(BAD_FILES))
def test_hf_file_problems_name_the_file_and_the_problem(tmp_path, hf_cache, kind):
    """Before: a StopIteration or a DatasetGenerationError traceback naming neither."""
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "a fine document"}\n')
    bad = tmp_path / f"{kind}.jsonl"
    content, problem = BAD_FILES[kind]
    bad.write_bytes(content)
    # Named among several files; an empty file only fails a load on its own (beside others,
    # `datasets` reads it as no records, which is fine).
    files = [str(bad)] if kind == "empty" else [str(good), str(bad)]
    source = HFSource("data", "json", data_files=files)
    with pytest.raises(DataConfigError, match=f"^data: cannot load 'json': {bad}: {problem}"):
        list(source.documents())


def test_hf_bad_file_on_the_command_line_exits_2_with_one_line(tmp_path, hf_cache):
    bad = tmp_path / "corpus.jsonl"
    bad.write_bytes(BAD_FILES["malformed"][0])
    proc = cli(tmp_path / "run", "data=hf", "data.path=json", f"data.data_files=[{bad}]",
               f"data.cache_dir={tmp_path / 'cache'}", "data.vocab_size=512",
               env={**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "hf")})
    assert proc.returncode == 2
    assert f"{bad}: line 2 is not valid JSON" in error_line(proc)


def test_a_corpus_too_small_for_a_validation_split_names_the_sizes_and_the_key(tmp_path, hf_cache):
    """Before: a ValueError traceback."""
    texts = [f"document {i} " * 20 for i in range(3)]
    assert not any(is_held_out(text, 0.05) for text in texts)  # the premise: 5% of 3 is none
    corpus = tmp_path / "tiny.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    cfg = DataConfig(name="hf", path="json", data_files=[str(corpus)], vocab_size=512, val_fraction=0.05,
                     cache_dir=str(tmp_path / "cache"), eval_sets={})
    with pytest.raises(DataConfigError, match=r"data split 'val' has no text .*data.val_fraction=0.05 holds out "
                                              r"0 of the source's 3 documents"):
        prepare_data(cfg, seq_len=16)


# ---- Ctrl-C before training starts ----


def test_ctrl_c_during_start_up_exits_130_without_a_traceback(tmp_path):
    """Before: a KeyboardInterrupt traceback. A fresh data cache makes start-up long (the
    tokenizer is trained, the corpus tokenized): the signal lands in it."""
    args = [a for a in COMMON if not a.startswith("trainer.max_steps")]
    # -X faulthandler: if the process outlives the signal, SIGABRT makes it print where every
    # thread is, which is what a failure here must show (it hung once, on one CI run, unseen).
    proc = subprocess.Popen(
        [sys.executable, "-X", "faulthandler", "train.py", f"hydra.run.dir={tmp_path}", *args,
         "trainer.max_steps=100000", f"data.cache_dir={tmp_path / 'cache'}"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.time() + 120
    while not (tmp_path / ".hydra" / "config.yaml").exists():  # inside main(), before the Trainer
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    try:
        # communicate, not wait: a child that goes on logging must not block on a full pipe
        _, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        _, stderr = proc.communicate()
        pytest.fail(f"still running 120 s after SIGINT; its stderr and stacks:\n{stderr[-8000:]}")
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    assert not (tmp_path / "metrics.jsonl").exists()  # it never reached training


def test_a_ctrl_c_lost_during_start_up_still_stops_the_run_before_training(monkeypatch):
    """Before: once, under load, the handler's SystemExit vanished and the run trained on.
    Here it is lost on purpose; training, about to take SIGINT over, still exits 130."""
    from trainer.run import interrupts
    from trainer.run.preemption import PreemptionFlag

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setattr(interrupts, "_interrupted", 0)
    interrupts.install_start_up_handler()
    try:
        with pytest.raises(SystemExit):
            signal.raise_signal(signal.SIGINT)  # caught here as if by code that drops it
        assert interrupts.interrupted() == 130  # what a study asks before its next run
        with pytest.raises(SystemExit) as stopped:
            PreemptionFlag()
        assert stopped.value.code == 130
        assert signal.getsignal(signal.SIGINT) is interrupts._on_signal_during_start_up  # not taken over
        with pytest.raises(SystemExit) as stopped:  # SIGTERM too, and it outranks the Ctrl-C
            signal.raise_signal(signal.SIGTERM)
        assert stopped.value.code == 143 and interrupts.interrupted() == 143
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_a_skip_collected_at_a_checkpoint_still_reaches_the_metrics(tmp_path):
    """Step 1 is skipped on the device; the checkpoint at step 2 (not a logging step) reads the
    count; the logging step 3 must still report it."""
    trainer = make_trainer(tmp_path, ["trainer.batch_size=2", "trainer.nonfinite=skip", "logger.interval=3",
                                      "checkpoint.interval=2", "trainer.max_steps=3"])
    poison_step(trainer, 1)
    trainer.train()
    logged = {r["step"]: r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    assert logged[3]["train/skipped_steps"] == 1.0
