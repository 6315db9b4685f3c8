"""After a divergence, every tool goes back to the last good checkpoint: resume=auto, export and
sampling pass over the suspect ones and refuse them when named, unless asked."""
from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import torch

from scripts import export_hf
from tests.prestarted import run_python
from tests.test_checkpoint import make_trainer
from tests.test_faults import cli, error_line, poison_step
from trainer.checkpoint import files as checkpoint_files


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in checkpoint_files.checkpoints_in(directory))


def test_checkpoints_after_a_skip_stay_suspect_until_an_eval_is_finite(tmp_path):
    """Step 3 is skipped: the checkpoint before it is refuted, the one after it (step 4) is
    suspect although step 5 trains finite, and the finite eval at step 6 ends the suspicion."""
    trainer = make_trainer(tmp_path, ["trainer.batch_size=2", "trainer.nonfinite=skip", "checkpoint.interval=2",
                                      "eval.interval=6", "checkpoint.keep=10"])
    poison_step(trainer, 3)
    trainer.train()
    directory = tmp_path / "checkpoints"
    listed = checkpoint_files.suspects(directory)
    assert sorted(listed) == ["step_00000002", "step_00000004"]
    assert "step 3, the step after it" in listed["step_00000002"]
    assert "saved after step 3 was non-finite" in listed["step_00000004"]
    assert (directory / "last_good").read_text() == "step_00000008"
    assert checkpoint_files.newest_trusted(directory) == directory / "step_00000008"


def test_a_suspect_checkpoint_is_refused_by_name_unless_allowed(tmp_path):
    trainer = make_trainer(tmp_path, ["trainer.batch_size=2", "trainer.nonfinite=skip", "checkpoint.interval=2",
                                      "eval.interval=0", "checkpoint.keep=10"])
    poison_step(trainer, 3)
    trainer.train()
    suspect = tmp_path / "checkpoints" / "step_00000004"
    assert checkpoint_files.suspicion(suspect) is not None
    proc = cli(tmp_path / "again", f"checkpoint.resume={suspect}")
    assert proc.returncode == 2
    line = error_line(proc)
    # Refused by the preflight, before Hydra writes a run dir.
    assert line.startswith(f"error: checkpoint.resume: {suspect}: its weights are suspect")
    assert "checkpoint.allow_suspect=true" in line and not (tmp_path / "again").exists()
    proc = cli(tmp_path / "again", f"checkpoint.resume={suspect}", "checkpoint.allow_suspect=true",
               "trainer.max_steps=6", "trainer.batch_size=2", "trainer.nonfinite=skip")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from step 4" in proc.stdout


def test_pointers_never_name_a_checkpoint_set_aside(tmp_path):
    for step in (1, 2, 3):
        checkpoint_files.checkpoint_path(tmp_path, step).mkdir()
    (tmp_path / "latest").write_text("step_00000003")
    (tmp_path / "last_good").write_text("step_00000002")
    checkpoint_files.set_suspect(tmp_path, "step_00000001", "a test's reason")
    checkpoint_files.set_aside(tmp_path / "step_00000003")
    assert (tmp_path / "latest").read_text() == "step_00000002"
    checkpoint_files.set_aside(tmp_path / "step_00000002")
    assert (tmp_path / "latest").read_text() == "step_00000001"
    assert not (tmp_path / "last_good").exists()  # step 1, the one left, is suspect
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == [
        "step_00000001", "step_00000002.corrupt", "step_00000003.corrupt"]


def hf_logits_are_finite(out: Path) -> bool:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        logits = model(torch.arange(8)[None]).logits
    return bool(torch.isfinite(logits).all())


def generate(source: Path, *flags: str) -> subprocess.CompletedProcess:
    return run_python(["scripts/generate.py", str(source), "--prompt", "def ", "--max-new-tokens", "8",
                       "--device", "cpu", *flags], timeout=300)


def test_resume_export_and_generate_after_a_divergence_take_the_last_good_checkpoint(tmp_path):
    """lr=1e4 diverges; the checkpoints written after the first non-finite step have finite
    weights whose forward is NaN. Before: resume=auto took `latest` and diverged again, export
    wrote a model with NaN logits, generate printed the prompt and exited 0."""
    run = tmp_path / "run"
    diverging = ["optim=adamw", "optim.lr=1e4", "trainer.batch_size=2", "trainer.max_steps=40",
                 "checkpoint.interval=1", "checkpoint.keep=2", "trainer.nonfinite_max_consecutive=5"]
    proc = cli(run, *diverging)
    assert proc.returncode == 3, proc.stderr[-3000:]
    directory = run / "checkpoints"
    good = directory / (directory / "last_good").read_text()
    assert error_line(proc).endswith(f"Last good checkpoint: {good}.")
    newer = [n for n in names(directory) if n > good.name]
    latest = directory / (directory / "latest").read_text()
    assert len(newer) == 2 and latest.name == newer[-1]
    assert sorted(checkpoint_files.suspects(directory)) == newer

    # Export: the run dir means the last good checkpoint; the suspect one is refused by name.
    assert export_hf.resolve_checkpoint(run) == good
    assert export_hf.main([str(run), str(tmp_path / "hf")]) == 0
    assert hf_logits_are_finite(tmp_path / "hf")
    assert export_hf.main([str(latest), str(tmp_path / "hf_latest")]) == 2  # bad input, as train.py
    assert not (tmp_path / "hf_latest").exists()

    # Sampling: the same text as from the last good checkpoint named outright.
    from_run, from_good = generate(run), generate(good)
    assert from_run.returncode == 0 and from_good.returncode == 0, from_run.stderr[-2000:]
    assert from_run.stdout == from_good.stdout
    refused = generate(latest)
    assert refused.returncode == 2 and "--allow-suspect" in refused.stderr
    assert generate(latest, "--allow-suspect").returncode == 0

    # Resume: from the last good checkpoint, at a sane lr; the suspect ones are set aside.
    step = checkpoint_files.step_of(good)
    proc = cli(run, *diverging, "optim.lr=1e-3", f"trainer.max_steps={step + 2}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from step {step}" in proc.stdout and "passing over suspect" in proc.stdout
    assert names(directory) == [f"step_{step + 1:08d}", f"step_{step + 2:08d}"]
    assert sorted(p.name for p in directory.glob(f"*{checkpoint_files.ABANDONED_SUFFIX}")) == [
        n + checkpoint_files.ABANDONED_SUFFIX for n in newer]
    losses = [json.loads(line)["train/loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(x) for x in losses[-2:])
