"""Every promise of a bad value failing at start holds: one line naming the key, exit 2, and
nothing written (no run dir, no cache). And what happens is said: a run that ends inside its
warmup, a resume that changes the schedule, where to resume from."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO, compose
from trainer.config import to_dataclass
from trainer.launch import resume_command
from trainer.preflight import config_warnings
from trainer.resume_checks import schedule_changes

PRESETS = "gpt_124m, gpt_1b, gpt_8b, gpt_small, gpt_tiny, moe_16b, moe_1b, moe_small, moe_tiny"

# (what was typed, what the one line says). Before: tracebacks after the data was loaded, Hydra's
# 4 to 18 lines with exit 1, a `+key` advice we then refuse, a resume error that named no key
# and left a run dir behind, a tau accepted while the clip was off.
BAD_INPUTS = [
    (["optim.muon.ns_steps=-1"], "error: optim.muon.ns_steps must be >= 1, got -1"),
    (["optim.muon.momentum=1.5"], "error: optim.muon.momentum must lie in [0, 1), got 1.5"),
    (["optim.muon.eps=0"], "error: optim.muon.eps must be > 0, got 0.0"),
    (["optim.qk_clip.tau=0"], "error: optim.qk_clip.tau must be > 0, got 0.0"),
    (["trainer.max_steps=abc"], "error: trainer.max_steps: Value 'abc' of type 'str' could not be converted to Integer"),
    (["trainer.max_stepz=3"], "error: trainer.max_stepz: no such key (did you mean trainer.max_steps?)"),
    (["model=nonexistent"], f"error: model=nonexistent: no such preset (available: {PRESETS})"),
    (["model=gpt_tinny"], f"error: model=gpt_tinny: no such preset (did you mean model=gpt_tiny? available: {PRESETS})"),
    (["optim.lr=[1,"], "error: optim.lr=[1,: cannot parse this override (no viable alternative at input '[1,')"),
    (["checkpoint.resume=/nonexistent"], "error: checkpoint.resume=/nonexistent: no such checkpoint (expected "
                                         "auto, none, or the path of a step_<N> dir or step_<N>.pt)"),
    (["parallel.tp=3"], "error: parallel.dp_replicate=-1 x parallel.dp_shard=1 x parallel.tp=3 does not multiply "
                        "out to a single process (started without torchrun): start 3 processes (torchrun "
                        "--nproc_per_node=3 train.py ...)"),
    (["trainer.activation_checkpointing=bogus"], "error: trainer.activation_checkpointing: unknown value 'bogus' "
                                                 "(expected one of none, full, selective)"),
    (["model.loss_chunks=0"], "error: model.loss_chunks must be >= 1, got 0"),
    (["parallel.simulate_world=8", "parallel.tp=3"], "error: parallel.dp_replicate=-1 x parallel.dp_shard=1 x "
                                                     "parallel.tp=3 does not multiply out to the 8 ranks of "
                                                     "parallel.simulate_world=8"),
    (["parallel.simulate_world=8", "parallel.simulate_rank=8"], "error: parallel.simulate_rank=8 must lie in [0, "
                                                                "parallel.simulate_world=8)"),
    (["parallel.simulate_world=8", "checkpoint.resume=/nonexistent"], "error: checkpoint.resume=/nonexistent: a "
                                                                      "simulation (parallel.simulate_world=8) starts "
                                                                      "from the seed and resumes nothing; leave "
                                                                      "checkpoint.resume at auto or none"),
    # Every job of a sweep: the second lr of this one is bad.
    (["-m", "optim.lr=1e-3,abc"], "error: optim.lr: Value 'abc' of type 'str' could not be converted to Float"),
]


# Two in the default suite (a Hydra error, one of ours); each case is a process of its own, so
# the rest run with the slow tests.
DEFAULT_SUITE = {"trainer.max_stepz=3", "checkpoint.resume=/nonexistent"}


@pytest.mark.parametrize("bad, said", [
    pytest.param(bad, said, id=" ".join(bad), marks=() if " ".join(bad) in DEFAULT_SUITE else pytest.mark.slow)
    for bad, said in BAD_INPUTS])
def test_a_bad_input_is_one_line_with_exit_2_and_nothing_written(tmp_path, bad, said):
    proc = subprocess.run(
        [sys.executable, "train.py", *bad, f"hydra.run.dir={tmp_path / 'run'}", f"hydra.sweep.dir={tmp_path / 'sweep'}",
         f"data.cache_dir={tmp_path / 'cache'}", "logger.wandb.mode=disabled"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [said]
    assert proc.stdout == ""
    assert list(tmp_path.iterdir()) == []  # no run or sweep dir, no cache


def test_a_run_that_ends_inside_its_warmup_says_how_high_its_lr_gets():
    cfg = to_dataclass(compose(["trainer.max_steps=10", "optim.warmup_steps=20", "optim.lr=0.02"]))
    assert config_warnings(cfg) == [
        "trainer.max_steps=10 < optim.warmup_steps=20: the run ends inside its warmup, so its lr peaks at 0.01, "
        "not optim.lr=0.02"]
    assert config_warnings(to_dataclass(compose(["trainer.max_steps=20", "optim.warmup_steps=20"]))) == []


def test_a_resume_that_changes_the_schedule_names_old_and_new():
    from dataclasses import asdict

    saved = asdict(to_dataclass(compose(["trainer.max_steps=100", "optim.schedule=cosine"])))
    same = to_dataclass(compose(["trainer.max_steps=100", "optim.schedule=cosine", "trainer.batch_size=3"]))
    assert schedule_changes(saved, same) == []
    longer = to_dataclass(compose(["trainer.max_steps=300", "optim.schedule=wsd"]))
    assert schedule_changes(saved, longer) == [
        "resumed with another learning-rate schedule than the checkpoint's (trainer.max_steps 100 -> 300, "
        "optim.schedule cosine -> wsd): every step from the resume on follows the new one"]


def test_the_resume_command_repeats_the_command_line_with_the_dir_pinned(tmp_path):
    run = tmp_path / "outputs" / "x"
    assert resume_command(["optim.lr=1e-3", "hydra.run.dir=old"], run, multirun=False, env={}) == (
        f"python train.py optim.lr=1e-3 hydra.run.dir={run}")
    assert resume_command(["-m", "optim.lr=1e-3,3e-3"], run / "0_job", multirun=True, env={}) == (
        f"python train.py -m optim.lr=1e-3,3e-3 hydra.sweep.dir={run}")
    assert resume_command(["name=a b"], run, multirun=False, env={"WORLD_SIZE": "4"}) == (
        f"torchrun <the same options> train.py 'name=a b' hydra.run.dir={run}")
