"""Every promise of a bad value failing at start holds: one line naming the key, exit 2, and
nothing written (no run dir, no cache), under torchrun too, where the line is the root cause
of torchrun's summary. And what happens is said: the layout and this rank's parameters, a run
that ends inside its warmup (by rank 0 alone), a resume that changes the schedule, where to
resume from; --help names every parallel key."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from tests.conftest import REPO, compose
from tests.prestarted import run_python
from trainer.config import ParallelConfig, to_dataclass
from trainer.run.launch import resume_command
from trainer.run.preflight import check_config, config_warnings, preflight
from trainer.checkpoint.resume_checks import fp8_change, schedule_changes

PRESETS = "gpt_124m, gpt_1b, gpt_8b, gpt_d128, gpt_d256, gpt_small, gpt_tiny, moe_16b, moe_1b, moe_d256, moe_small, moe_tiny"


@contextlib.contextmanager
def logged(name: str) -> Iterator[list[str]]:
    """The lines logger `name` logs (INFO and up) inside the block, in a spawned rank too,
    where no Hydra logging is set up."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger, handler = logging.getLogger(name), Keep()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


# Before: Hydra's advice cut to its first line ("Could not override 'experiment'", "Ambiguous value
# for argument ...") lost the fix, and a family missing from optim.lr_overrides read "no such key".
EXPERIMENT_WITHOUT_PLUS = ("experiment=reference_cpu: experiment is not in config.yaml's defaults list, so it is "
                           "added, not overridden: write +experiment=reference_cpu")
SWEEP_WITHOUT_MULTIRUN = ("optim.lr=3e-3,1e-3: a comma-separated value is a sweep: add --multirun (-m) to run one "
                          "job per value (for a list write optim.lr=[3e-3,1e-3], for a string quote it: "
                          "optim.lr='3e-3,1e-3')")
FAMILY_WITHOUT_PLUS = ("optim.lr_overrides.embed: not set yet: optim.lr_overrides lists only the families it "
                       "changes, so add one with a plus: write +optim.lr_overrides.embed=0.5")

# (what was typed, what the one line says). Before: tracebacks after the data was loaded, Hydra's
# 4 to 18 lines with exit 1, a `+key` advice we then refuse, a resume error that named no key
# and left a run dir behind, a tau accepted while the clip was off.
BAD_INPUTS = [
    (["optim.muon.ns_steps=-1"], "error: optim.muon.ns_steps must be >= 1, got -1"),
    (["optim.muon.momentum=1.5"], "error: optim.muon.momentum must lie in [0, 1), got 1.5"),
    (["optim.muon.eps=0"], "error: optim.muon.eps must be a finite number > 0, got 0.0"),
    (["optim.qk_clip.tau=0"], "error: optim.qk_clip.tau must be > 0, got 0.0"),
    # Before: "optim.min_lr=0.0003 must lie in [0, optim.lr=nan]", blaming the key not typed.
    (["optim.lr=nan"], "error: optim.lr must be a finite number > 0, got nan"),
    (["trainer.max_steps=abc"], "error: trainer.max_steps: Value 'abc' of type 'str' could not be converted to Integer"),
    (["trainer.max_stepz=3"], "error: trainer.max_stepz: no such key (did you mean trainer.max_steps?)"),
    (["model=nonexistent"], f"error: model=nonexistent: no such preset (available: {PRESETS})"),
    (["model=gpt_tinny"], f"error: model=gpt_tinny: no such preset (did you mean model=gpt_tiny? available: {PRESETS})"),
    (["optim.lr=[1,"], "error: optim.lr=[1,: cannot parse this override (no viable alternative at input '[1,')"),
    (["checkpoint.resume=/nonexistent"], "error: checkpoint.resume=/nonexistent: no such checkpoint (expected "
                                         "auto, none, a run dir, or the path of a step_<N> dir or step_<N>.pt)"),
    (["parallel.tp=3"], "error: parallel.dp_replicate=-1 x parallel.dp_shard=1 x parallel.tp=3 does not multiply "
                        "out to a single process (started without torchrun): start 3 processes (torchrun "
                        "--nproc_per_node=3 train.py ...)"),
    (["trainer.activation_checkpointing=bogus"], "error: trainer.activation_checkpointing: unknown value 'bogus' "
                                                 "(expected one of none, full, selective)"),
    (["model.loss_chunks=0"], "error: model.loss_chunks must be >= 1, got 0"),
    (["data.tune_fraction=1.5"], "error: data.tune_fraction must be in [0, 1) (got 1.5)"),
    (["data.tune_fraction=0.95"], "error: data.tune_fraction: data.val_fraction + data.tune_fraction must be < 1, to "
                                  "leave documents for training (got 0.05 + 0.95)"),
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
    # Habits from other templates and from Hydra's own advice, each with the spelling that works.
    (["experiment=reference_cpu"], "error: " + EXPERIMENT_WITHOUT_PLUS),
    (["optim.lr=3e-3,1e-3"], "error: " + SWEEP_WITHOUT_MULTIRUN),
    (["optim.lr_overrides.embed=0.5"], "error: " + FAMILY_WITHOUT_PLUS),
    # The relative schedule keys: a warmup as long as the run, a floor above the peak.
    (["optim.warmup_fraction=1.0"], "error: optim.warmup_fraction must lie in [0, 1), got 1.0"),
    (["optim.min_lr_ratio=1.5"], "error: optim.min_lr_ratio must lie in [0, 1], got 1.5"),
    # A sweeper scoring a metric the run never logs would get NaN from every trial.
    (["eval.objective=val/tune/loss"], 'error: eval.objective=val/tune/loss: no eval set "tune" '
                                       "(data.tune_fraction is 0); known: val/val/loss, val/ood_prose/loss, "
                                       "train/loss"),
]


# Each case is a command of its own, forked from a process that has imported the project
# (tests/prestarted.py): a few tenths of a second, not the seconds of a fresh interpreter.
@pytest.mark.parametrize("bad, said", [pytest.param(bad, said, id=" ".join(bad)) for bad, said in BAD_INPUTS])
def test_a_bad_input_is_one_line_with_exit_2_and_nothing_written(tmp_path, bad, said):
    proc = run_python(["train.py", *bad, f"hydra.run.dir={tmp_path / 'run'}", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                       f"data.cache_dir={tmp_path / 'cache'}", "logger.wandb.mode=disabled"], timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [said]
    assert proc.stdout == ""
    assert list(tmp_path.iterdir()) == []  # no run or sweep dir, no cache


@pytest.mark.parametrize("typed, said", [
    (["experiment=reference_cpu"], EXPERIMENT_WITHOUT_PLUS),
    (["optim.lr=3e-3,1e-3"], SWEEP_WITHOUT_MULTIRUN),
    (["optim.lr_overrides.embed=0.5"], FAMILY_WITHOUT_PLUS),
    (["optim.weight_decay_overrides.embd=0"], "optim.weight_decay_overrides.embd: unknown parameter family (did you "
                                              "mean +optim.weight_decay_overrides.embed=0? families: attn_k, attn_o, "
                                              "attn_q, attn_v, bias, embed, experts, head, mlp_in, mlp_out, norm, "
                                              "router)"),
])
def test_hydra_advice_keeps_its_fix_in_the_one_line(typed, said):
    """In process, for every case (the BAD_INPUTS rows check exit code 2 end to end); the
    spelling each line advises composes."""
    from trainer.config import ConfigError, register_configs
    from trainer.run.preflight import compose as preflight_compose

    register_configs()
    with pytest.raises(ConfigError) as err:
        preflight_compose(typed, str(REPO / "conf"))
    assert str(err.value) == said
    advised = said.split("write ")[-1] if "write +" in said else None
    if advised is not None:
        preflight_compose([advised], str(REPO / "conf"))


def test_a_run_that_ends_inside_its_warmup_says_how_high_its_lr_gets():
    cfg = to_dataclass(compose(["trainer.max_steps=10", "optim.warmup_steps=20", "optim.lr=0.02"]))
    assert config_warnings(cfg) == [
        "trainer.max_steps=10 < optim.warmup_steps=20: the run ends inside its warmup, so its lr peaks at 0.01, "
        "not optim.lr=0.02"]
    assert config_warnings(to_dataclass(compose(["trainer.max_steps=20", "optim.warmup_steps=20"]))) == []
    # A warmup_fraction overrides warmup_steps: the run warms up for 1 of its 10 steps.
    assert config_warnings(to_dataclass(compose(["trainer.max_steps=10", "optim.warmup_steps=20",
                                                 "optim.warmup_fraction=0.1"]))) == []


def test_a_resume_that_changes_the_schedule_names_old_and_new():
    from dataclasses import asdict

    saved = asdict(to_dataclass(compose(["trainer.max_steps=100", "optim.schedule=cosine"])))
    same = to_dataclass(compose(["trainer.max_steps=100", "optim.schedule=cosine", "trainer.batch_size=3"]))
    assert schedule_changes(saved, same) == []
    longer = to_dataclass(compose(["trainer.max_steps=300", "optim.schedule=wsd"]))
    assert schedule_changes(saved, longer) == [
        "resumed with another learning-rate schedule than the checkpoint's (trainer.max_steps 100 -> 300, "
        "optim.schedule cosine -> wsd): every step from the resume on follows the new one"]
    # A fraction set (or cleared) is a change too, null being a value; a checkpoint saved before
    # the key existed trained as if it were null.
    fractions = to_dataclass(compose(["trainer.max_steps=100", "optim.schedule=cosine", "optim.warmup_fraction=0.1",
                                      "optim.min_lr_ratio=0.05"]))
    said = ("resumed with another learning-rate schedule than the checkpoint's (optim.min_lr_ratio None -> 0.05, "
            "optim.warmup_fraction None -> 0.1): every step from the resume on follows the new one")
    assert schedule_changes(saved, fractions) == [said]
    new_keys = ("warmup_fraction", "min_lr_ratio")
    older = {**saved, "optim": {k: v for k, v in saved["optim"].items() if k not in new_keys}}
    assert schedule_changes(older, fractions) == [said]
    assert schedule_changes(older, same) == []
    assert schedule_changes(asdict(fractions), same) == [said.replace("None -> 0.05", "0.05 -> None")
                                                         .replace("None -> 0.1", "0.1 -> None")]


def test_a_resume_that_switches_fp8_says_so():
    from dataclasses import asdict

    saved = asdict(to_dataclass(compose(["trainer.fp8=tensorwise"])))
    assert fp8_change(saved, to_dataclass(compose(["trainer.fp8=tensorwise"]))) == []
    assert fp8_change(saved, to_dataclass(compose([]))) == [
        "resumed with trainer.fp8=none, but the checkpoint was trained with trainer.fp8=tensorwise: the block "
        "matmuls from the resume on run in another precision (the weights carry over unchanged)"]
    assert fp8_change(asdict(to_dataclass(compose([]))), to_dataclass(compose(["trainer.fp8=rowwise"]))) == [
        "resumed with trainer.fp8=rowwise, but the checkpoint was trained with trainer.fp8=none: the block "
        "matmuls from the resume on run in another precision (the weights carry over unchanged)"]
    assert fp8_change(saved, to_dataclass(compose(["trainer.fp8=tensorwise", "trainer.fp8_filter=all"]))) == [
        "resumed with trainer.fp8_filter=all, but the checkpoint was trained with trainer.fp8_filter=auto: other "
        "block linears run in float8 from the resume on"]
    assert fp8_change({"trainer": {}}, to_dataclass(compose(["trainer.fp8=rowwise"]))) == []  # saved before fp8


# Before, all accepted: NaN, which compares false with everything (so `x <= 0` lets it through),
# inf where only a finite value means something, and the model's float keys, never checked.
NONFINITE = [
    ("optim.lr=inf", "optim.lr must be a finite number > 0, got inf"),
    ("optim.eps=nan", "optim.eps must be a finite number > 0, got nan"),
    ("optim.weight_decay=inf", "optim.weight_decay must be a finite number >= 0, got inf"),
    ("trainer.peak_tflops=inf", "trainer.peak_tflops must be a finite number >= 0 (0 = measure at start-up), got inf"),
    ("model.rope_theta=nan", "model.rope_theta must be a finite number > 0, got nan"),
    ("model.norm_eps=-1e-5", "model.norm_eps must be a finite number > 0, got -1e-05"),
    ("model.init_std=nan", "model.init_std must be a finite number > 0, got nan"),
    ("model.aux_loss_coef=nan", "model.aux_loss_coef must be a finite number >= 0, got nan"),
    ("logger.wandb.init_timeout_s=nan", "logger.wandb.init_timeout_s must be >= 1, got nan"),
    ("parallel.timeout_s=inf", "parallel.timeout_s must be a finite number > 0, got inf"),
]


@pytest.mark.parametrize("override, said", NONFINITE, ids=[override for override, _ in NONFINITE])
def test_nan_and_inf_are_refused_naming_their_key(override, said):
    from trainer.config import ConfigError, validate

    with pytest.raises(ConfigError) as err:
        validate(to_dataclass(compose([override])))
    assert str(err.value) == said


def test_the_resume_command_repeats_the_command_line_with_the_dir_pinned(tmp_path):
    run = tmp_path / "outputs" / "x"
    assert resume_command(["optim.lr=1e-3", "hydra.run.dir=old"], run, multirun=False, env={}) == (
        f"python train.py optim.lr=1e-3 hydra.run.dir={run}")
    assert resume_command(["-m", "optim.lr=1e-3,3e-3"], run / "0_job", multirun=True, env={}) == (
        f"python train.py -m optim.lr=1e-3,3e-3 hydra.sweep.dir={run}")
    assert resume_command(["name=a b"], run, multirun=False, env={"WORLD_SIZE": "4"}) == (
        f"torchrun <the same options> train.py 'name=a b' hydra.run.dir={run}")


# ---- refused before Hydra writes the run dir ----


def fake_checkpoint(path: Path, config: dict) -> Path:
    """As much of a sharded checkpoint as the start-up checks read: its record of the run and a
    manifest (listing no files)."""
    path.mkdir(parents=True)
    (path / "trainer.json").write_text(json.dumps({"format": 2, "step": 4, "config": config}))
    (path / "manifest.sha256").write_text("")
    return path


def saved_config(**changes: str) -> dict:
    """This test's config as a checkpoint records it, with `changes` (key=value overrides)."""
    return dataclasses.asdict(to_dataclass(compose([f"{k}={v}" for k, v in changes.items()])))


def empty_dir(given: Path) -> tuple[str, str]:
    given.mkdir()
    return str(given), f"{given}: no checkpoint found in this directory"


def incomplete(given: Path) -> tuple[str, str]:
    ckpt = fake_checkpoint(given / "checkpoints" / "step_00000004", saved_config())
    (ckpt / "manifest.sha256").unlink()
    return str(ckpt), f"{ckpt}: its manifest manifest.sha256 is missing (incomplete checkpoint)"


def all_suspect(given: Path) -> tuple[str, str]:
    fake_checkpoint(given / "checkpoints" / "step_00000004", saved_config())
    (given / "checkpoints" / "suspect.json").write_text('{"step_00000004": "a test\'s reason"}')
    return str(given), (f"{given / 'checkpoints'}: no checkpoint is known good (all are listed in suspect.json); "
                        "use the newest anyway with checkpoint.allow_suspect=true")


def other_optimizer(given: Path) -> tuple[str, str]:
    ckpt = fake_checkpoint(given / "checkpoints" / "step_00000004", saved_config(optim="adamw"))
    return str(given), (f"{ckpt}: trained with optim=adamw, but this run has optim=muon; resume it with optim=adamw, "
                        "or start fresh with checkpoint.resume=none")


def other_model(given: Path) -> tuple[str, str]:
    ckpt = fake_checkpoint(given / "step_00000004", saved_config(**{"model.d_model": "128", "model.n_layers": "3"}))
    return str(ckpt), (f"{ckpt}: a checkpoint of another model (model.n_layers 3 there, 2 here, model.d_model 128 "
                       "there, 64 here); resume it with model=gpt_tiny and its values, or start fresh with "
                       "checkpoint.resume=none")


@pytest.mark.parametrize("given", [
    pytest.param(incomplete, id="incomplete"),
    pytest.param(empty_dir, id="a dir without checkpoints"),
    pytest.param(all_suspect, id="a run dir whose checkpoints are all suspect"),
    pytest.param(other_optimizer, id="the other optimizer"),
    pytest.param(other_model, id="another model"),
])
def test_a_resume_that_cannot_work_is_refused_before_anything_is_written(tmp_path, given):
    """Before: .hydra/ and train.log were written into the run dir, then the refusal."""
    resume, said = given(tmp_path / "given")
    outputs = tmp_path / "outputs"
    proc = run_python(["train.py", f"checkpoint.resume={resume}", f"hydra.run.dir={outputs / 'run'}",
                       f"data.cache_dir={outputs / 'cache'}", "logger.wandb.mode=disabled"], timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [f"error: checkpoint.resume: {said}"]
    assert not outputs.exists()


def test_the_start_up_checks_refuse_cuda_where_there_is_none(monkeypatch):
    """What the preflight runs before Hydra (the process-level check is the test below)."""
    import torch

    from trainer.device import DeviceError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match=r"^trainer.device=cuda but no CUDA device is visible"):
        check_config(compose(["trainer.device=cuda"]), 1)
    assert check_config(compose(["trainer.device=auto"]), 1).trainer.device == "auto"
    # A SLURM sweep's jobs run on the cluster's nodes, which check their own GPUs.
    sweep = ["-m", "trainer.device=cuda", "optim.lr=1e-3,3e-3"]
    with pytest.raises(DeviceError):
        preflight(sweep, str(REPO / "conf"), 1)
    assert preflight(sweep + ["hydra/launcher=slurm"], str(REPO / "conf"), 1) is None


def test_cuda_asked_where_there_is_none_is_refused_before_anything_is_written(tmp_path):
    proc = run_python(["train.py", "trainer.device=cuda", f"hydra.run.dir={tmp_path / 'run'}",
                       f"data.cache_dir={tmp_path / 'cache'}", "logger.wandb.mode=disabled"],
                      env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        "error: trainer.device=cuda but no CUDA device is visible; run on the CPU with trainer.device=cpu"]
    assert list(tmp_path.iterdir()) == []


# ---- checkpoint.resume=<run dir> ----


def test_a_run_dir_resumes_from_its_newest_good_checkpoint_as_export_reads_it(tmp_path):
    """Before: refused (no trainer.json), while scripts/export_hf.py and generate.py took it."""
    from scripts.export_hf import resolve_checkpoint
    from tests.test_checkpoint import COMMON, make_trainer
    from trainer.checkpoint import files as checkpoint_files
    from trainer.loop import Trainer

    fixed = ["trainer.batch_size=2", "trainer.peak_tflops=1"]
    run = tmp_path / "first"
    make_trainer(run, fixed + ["trainer.max_steps=2", "checkpoint.interval=1"]).train()
    ckpts = run / "checkpoints"
    checkpoint_files.set_suspect(ckpts, "step_00000002", "a test's reason")
    typed = check_config(compose(COMMON + fixed + ["trainer.max_steps=3", f"checkpoint.resume={run}"]), 1)
    assert typed.checkpoint.resume == str(ckpts / "step_00000001") == str(resolve_checkpoint(run))
    assert Trainer(typed, tmp_path / "second").step == 1
    allowed = check_config(compose(COMMON + fixed + [f"checkpoint.resume={run}", "checkpoint.allow_suspect=true"]), 1)
    assert allowed.checkpoint.resume == str(ckpts / "step_00000002")


# ---- --help ----


def test_help_names_every_parallel_key_with_its_default():
    defaults = yaml.safe_load((REPO / "conf" / "parallel" / "default.yaml").read_text())
    proc = run_python(["train.py", "--help"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shown = {key: str(value).lower() if isinstance(value, bool) else str(value) for key, value in defaults.items()}
    assert [f"parallel.{k}={v}" for k, v in shown.items() if f"parallel.{k}={v}" not in proc.stdout] == []
    # and the keys only the schema has (trainer/config.py)
    assert [f.name for f in dataclasses.fields(ParallelConfig) if f"parallel.{f.name}=" not in proc.stdout] == []


# ---- under torchrun ----


def torchrun(run_dir: Path, *overrides: str, wrapper: bool = False) -> subprocess.CompletedProcess:
    """train.py under torchrun, or under scripts/torchrun.py (`wrapper`), which runs torchrun."""
    launcher = ["scripts/torchrun.py"] if wrapper else ["-m", "torch.distributed.run"]
    return subprocess.run(
        [sys.executable, *launcher, "--standalone", "--nproc_per_node=2", "train.py",
         f"hydra.run.dir={run_dir}", f"data.cache_dir={run_dir.parent / 'cache'}", "trainer.device=cpu",
         "logger.wandb.mode=disabled", *overrides],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def root_cause(summary: str) -> str:
    """The root-cause section of torchrun's failure summary."""
    assert "Root Cause (first observed failure):" in summary, summary[-3000:]
    return summary.split("Root Cause (first observed failure):", 1)[1]


def our_frames(output: str) -> list[str]:
    """Traceback lines in our code (train.py, trainer/)."""
    return re.findall(r'File "[^"]*(?:/train\.py|/trainer/[^"]*)"', output)


def bad_layout(run_dir: Path) -> tuple[list[str], str, int]:
    """(overrides, the start of the one error line, how many config warnings are logged)"""
    return (["parallel.tp=2", "parallel.dp_shard=2"], "error: parallel.dp_replicate=-1 x parallel.dp_shard=2 x "
            "parallel.tp=2 does not multiply out to 2 processes (the number torchrun started)", 0)


def unusable_checkpoint(run_dir: Path) -> tuple[list[str], str, int]:
    """A checkpoint in the run dir whose file does not match its digest: found only when the
    ranks verify it together, inside the job, after the config warnings (one: a run that ends
    inside its warmup)."""
    ckpt = fake_checkpoint(run_dir / "checkpoints" / "step_00000001", {})
    (ckpt / "__0_0.distcp").write_bytes(b"not what the manifest says")
    (ckpt / "manifest.sha256").write_text(f"{'0' * 64}  __0_0.distcp\n")
    return (["trainer.max_steps=1", "optim.warmup_steps=2"],
            f"error: no usable checkpoint in {ckpt.parent}: {ckpt / '__0_0.distcp'}: checksum does not match", 1)


@pytest.mark.parametrize("case", [
    pytest.param(bad_layout, id="bad layout"),
    pytest.param(unusable_checkpoint, id="unusable checkpoint", marks=pytest.mark.slow),
])
def test_under_torchrun_the_refusal_is_the_root_cause_of_its_summary(tmp_path, case):
    """Before: our line, then torchrun's summary naming no cause ("To enable traceback see ..."),
    and rank 1 repeating rank 0's config warnings. Bad input runs under scripts/torchrun.py, which
    runs torchrun as it is and then ends with the rank's line and exits with its code (torchrun's
    own is 1 whatever the rank said)."""
    overrides, said, warnings = case(tmp_path / "run")
    wrapped = case is bad_layout
    proc = torchrun(tmp_path / "run", *overrides, wrapper=wrapped)
    output = proc.stdout + proc.stderr
    assert proc.returncode == (2 if wrapped else 1), output[-3000:]  # the rank's code, or torchrun's
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    if wrapped:  # the wrapper's copy of the line is the last thing on stderr
        assert proc.stderr.rstrip("\n").splitlines()[-1] == errors[-1]
        errors = errors[:-1]
    assert len(errors) == 1 and errors[0].startswith(said), output[-3000:]  # from rank 0 alone
    cause = root_cause(proc.stderr)
    assert "exitcode  : 2 " in cause and f"traceback : {errors[0]}\n" in cause, cause
    assert our_frames(output) == []
    assert output.count("< optim.warmup_steps=") == warnings

