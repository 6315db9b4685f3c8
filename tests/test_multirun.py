"""Sweeps and launches: Hydra multirun, experiment configs, launcher configs, torchrun run dirs."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from trainer.run import launch
from tests.conftest import REPO, compose, requires
from tests.prestarted import run_python
from trainer.config import to_dataclass, validate

TINY = [
    "model=gpt_tiny", "trainer.max_steps=3", "trainer.batch_size=2", "trainer.seq_len=32",
    "trainer.precision=fp32", "trainer.device=cpu", "eval.interval=0", "eval.batches=1", "logger.interval=1",
    "logger.wandb.mode=disabled", "logger.tensorboard=false", "logger.progress=none",
    "optim.schedule=constant", "optim.warmup_steps=0", "optim.min_lr=0", "optim.muon.ns_dtype=fp32",
    # Every job shares the repository's token cache, whatever the working directory.
    f"data.cache_dir={REPO / '.cache' / 'data'}",
]


def run_train(args: list[str], cwd: Path = REPO, launcher: list[str] | None = None,
              threads: str | None = "auto") -> subprocess.CompletedProcess:
    """train.py with `args`, under `launcher` (torchrun) if given. `threads`: OMP_NUM_THREADS,
    None for unset; "auto" is 1 under a launcher, whose processes share the cores, else unset:
    one process forks from the suite's usual command server (tests/prestarted.py), whose
    environment has none."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads == "auto":
        threads = "1" if launcher else None
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads
    env["WANDB_MODE"] = "disabled"
    if launcher:  # torchrun's own process tree: a fresh interpreter
        return subprocess.run([sys.executable, *launcher, str(REPO / "train.py"), *args],
                              cwd=cwd, capture_output=True, text=True, timeout=900, env=env)
    return run_python([str(REPO / "train.py"), *args], cwd=cwd, env=env, timeout=900)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def job_dirs(sweep_dir: Path) -> list[Path]:
    return sorted(p for p in sweep_dir.iterdir() if p.is_dir())


# ---- multirun in one process ----

def test_two_job_multirun_gives_two_separate_complete_run_dirs(tmp_path):
    proc = run_train(["-m", "optim=muon,adamw", "optim.lr=0.002", f"hydra.sweep.dir={tmp_path}", *TINY])
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = job_dirs(tmp_path)
    # Named by what the sweep varies; the fixed overrides are in .hydra/overrides.yaml.
    assert [p.name for p in jobs] == ["0_optim=muon", "1_optim=adamw"]
    for job, optimizer in zip(jobs, ["muon", "adamw"]):
        saved = yaml.safe_load((job / ".hydra" / "config.yaml").read_text())
        assert saved["optim"]["name"] == optimizer
        logged = records(job)
        assert [r["step"] for r in logged] == [1, 2, 3]
        assert all(math.isfinite(r["train/loss"]) for r in logged)
        assert {r["optim/lr"] for r in logged} == {0.002}
        assert "val/val/loss" in logged[-1]
        assert (job / "checkpoints" / "latest").exists()
        assert (job / "train.log").read_text().count("run dir:") == 1  # its own log only


@pytest.mark.slow
@requires("hydra_plugins.hydra_joblib_launcher", "hydra/launcher=local")
def test_the_local_parallel_launcher_runs_jobs_side_by_side_on_a_share_of_the_cores(tmp_path):
    proc = run_train(["-m", "hydra/launcher=local", "optim=muon,adamw", f"hydra.sweep.dir={tmp_path}", *TINY],
                     threads=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "deprecated" not in proc.stderr
    jobs = job_dirs(tmp_path)
    assert [p.name for p in jobs] == ["0_optim=muon", "1_optim=adamw"]
    share = max(1, (os.cpu_count() or 1) // 2)
    for job in jobs:
        assert f"({share} intra-op CPU threads)" in (job / "train.log").read_text()
        assert [r["step"] for r in records(job)] == [1, 2, 3]


def test_a_diverging_job_does_not_stop_the_sweep(tmp_path):
    proc = run_train([
        "-m", "optim=adamw", "optim.lr=1e30,0.001", "trainer.nonfinite=stop",
        f"hydra.sweep.dir={tmp_path}", *TINY,
    ])
    assert proc.returncode == 0, proc.stderr[-3000:]
    diverged, healthy = job_dirs(tmp_path)
    assert (diverged.name, healthy.name) == ("0_optim.lr=1e+30", "1_optim.lr=0.001")
    assert "diverged; the sweep continues" in (diverged / "train.log").read_text()
    logged = records(healthy)
    assert [r["step"] for r in logged] == [1, 2, 3]
    assert {r["optim/lr"] for r in logged} == {0.001}


def test_a_diverging_single_run_exits_non_zero_with_one_line(tmp_path):
    proc = run_train([
        f"hydra.run.dir={tmp_path}", *TINY, "optim=adamw", "optim.lr=1e30", "trainer.nonfinite=stop",
    ])
    assert proc.returncode == 3
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "non-finite" in errors[0] and "Traceback" not in proc.stderr


# ---- torchrun: one run dir, written by rank 0 ----

@pytest.mark.slow  # a torchrun launch or a six-job sweep: with the longer tests (make test's budget)
def test_torchrun_ranks_agree_on_one_run_dir_and_only_rank_0_writes_hydra_outputs(tmp_path):
    proc = run_train(
        TINY, cwd=tmp_path,
        launcher=["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = list((tmp_path / "outputs" / "muon_gpt_tiny").iterdir())
    assert len(runs) == 1 and runs[0].name.startswith("torchrun_"), runs
    assert [p.parent for p in tmp_path.rglob(".hydra")] == runs
    assert [p.parent for p in tmp_path.rglob("train.log")] == runs
    log = (runs[0] / "train.log").read_text()
    assert log.count("run dir:") == 1 and "][rank " not in log  # rank 0's lines only
    assert [r["step"] for r in records(runs[0])] == [1, 2, 3]


@pytest.mark.slow
def test_a_multirun_under_torchrun_runs_every_job_in_one_process_group(tmp_path):
    """Re-creating the default group between jobs would hang on torchrun's store: it is kept."""
    proc = run_train(
        ["-m", "optim=muon,adamw", *TINY], cwd=tmp_path,
        launcher=["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweeps = list((tmp_path / "outputs" / "multirun").iterdir())
    assert len(sweeps) == 1 and sweeps[0].name.startswith("torchrun_"), sweeps
    jobs = job_dirs(sweeps[0])
    assert [p.name for p in jobs] == ["0_optim=muon", "1_optim=adamw"]
    assert sorted(p.parent for p in tmp_path.rglob(".hydra")) == jobs
    for job in jobs:
        assert [r["step"] for r in records(job)] == [1, 2, 3]


def env(**values: str) -> dict[str, str]:
    return {"PATH": "/usr/bin", **values}


UUID = "0edc0003-5146-49fc-aa3f-0e4d95e867ac"


def test_a_single_process_launch_changes_nothing():
    assert launch.launch_overrides(["optim=adamw"], env()) == ([], {})
    assert launch.launch_overrides(["-m", "optim=muon,adamw"], env(WORLD_SIZE="1")) == ([], {})
    assert launch.launch_overrides(["--bad-flag"], env()) == ([], {})  # left to Hydra to report


def test_torchrun_ranks_share_the_rendezvous_id_and_only_rank_0_writes():
    torchrun = env(WORLD_SIZE="2", TORCHELASTIC_RUN_ID=UUID)
    extra, exported = launch.launch_overrides([], {**torchrun, "RANK": "0"})
    assert extra == [] and exported == {"TRAIN_RUN_ID": "torchrun_0edc0003"}
    extra, exported = launch.launch_overrides([], {**torchrun, "RANK": "1"})
    assert exported == {"TRAIN_RUN_ID": "torchrun_0edc0003"}
    assert extra == ["hydra.output_subdir=null", "hydra/job_logging=nonzero_rank", "hydra/hydra_logging=disabled"]
    # The user's own logging choice stands.
    extra, _ = launch.launch_overrides(["hydra/job_logging=stdout"], {**torchrun, "RANK": "1"})
    assert "hydra/job_logging=nonzero_rank" not in extra


def test_run_ids_from_rdzv_id_slurm_and_the_user():
    assert launch.shared_run_id(env(TORCHELASTIC_RUN_ID="exp 1/a")) == "torchrun_exp_1_a"
    assert launch.shared_run_id(env(TORCHELASTIC_RUN_ID="none", SLURM_JOB_ID="77", SLURM_STEP_ID="0")) == "slurm_77_0"
    assert launch.shared_run_id(env(TRAIN_RUN_ID="mine", TORCHELASTIC_RUN_ID=UUID)) == "mine"
    assert launch.shared_run_id(env(TORCHELASTIC_RUN_ID="none")) is None


def test_a_launch_without_a_shared_id_must_pin_its_dir():
    static = env(WORLD_SIZE="2", RANK="0", TORCHELASTIC_RUN_ID="none")
    with pytest.raises(ValueError, match=r"^hydra\.run\.dir: .*pin hydra\.run\.dir="):
        launch.launch_overrides([], static)
    with pytest.raises(ValueError, match=r"^hydra\.sweep\.dir: "):
        launch.launch_overrides(["-m", "optim=muon,adamw"], static)
    assert launch.launch_overrides(["hydra.run.dir=outputs/x"], static) == ([], {})


def test_the_shared_id_replaces_the_timestamp_in_run_and_sweep_dirs(monkeypatch):
    from hydra import compose as hydra_compose, initialize_config_dir

    from trainer.config import register_configs

    register_configs()
    monkeypatch.setenv("TRAIN_RUN_ID", "torchrun_0edc0003")
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=["optim=adamw"], return_hydra_config=True)
    assert cfg.hydra.run.dir == "outputs/adamw_gpt_tiny/torchrun_0edc0003"
    assert cfg.hydra.sweep.dir == "outputs/multirun/torchrun_0edc0003"


# ---- per-job state ----

def fake_hydra(mode: RunMode, **launcher) -> DictConfig:
    return OmegaConf.create({"mode": mode, "sweep": {"dir": "outputs/multirun/2030-01-01_00-00-00"},
                             "job": {"num": 3, "override_dirname": "optim.lr=0.001,optim=adamw"},
                             "launcher": launcher})


def test_sweep_jobs_share_a_wandb_group_unless_the_user_gave_one():
    typed = to_dataclass(compose(["logger.wandb.mode=disabled"]))
    launch.start_job(typed, fake_hydra(RunMode.MULTIRUN))
    assert typed.logger.wandb.group == "2030-01-01_00-00-00"  # the sweep's name, not a path
    typed = to_dataclass(compose(["logger.wandb.group=mine"]))
    launch.start_job(typed, fake_hydra(RunMode.MULTIRUN))
    assert typed.logger.wandb.group == "mine"
    typed = to_dataclass(compose())
    launch.start_job(typed, fake_hydra(RunMode.RUN))
    assert typed.logger.wandb.group is None


def test_sweep_jobs_are_named_by_what_they_vary_and_label_their_progress(capsys):
    """Before: every run of an lr sweep had the same wandb name, and the progress lines of
    jobs running side by side could not be told apart."""
    from trainer.run.progress import Progress

    typed = to_dataclass(compose(["optim=adamw"]))
    launch.start_job(typed, fake_hydra(RunMode.MULTIRUN))
    assert typed.logger.wandb.name == "adamw_gpt_tiny optim.lr=0.001,optim=adamw"
    assert typed.logger.progress_prefix == "job 3"
    typed = to_dataclass(compose(["optim=adamw", "logger.wandb.name=mine"]))
    launch.start_job(typed, fake_hydra(RunMode.RUN))
    assert typed.logger.wandb.name == "mine" and typed.logger.progress_prefix is None
    progress = Progress(10, 0, "lines", "job 3")
    progress.report(5, 2.5, 1000.0)
    progress.message("step 5: val/val/loss 2.4")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("[job 3] step 5/10 | loss 2.5000") and lines[1] == "[job 3] step 5: val/val/loss 2.4"


def test_parallel_local_jobs_split_the_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    before = torch.get_num_threads()
    try:
        launch.share_cpu_threads(fake_hydra(RunMode.MULTIRUN, n_jobs=2))
        assert torch.get_num_threads() == 4
        launch.share_cpu_threads(fake_hydra(RunMode.MULTIRUN, n_jobs=-1))
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        launch.share_cpu_threads(fake_hydra(RunMode.MULTIRUN, n_jobs=2))
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


# ---- experiment and launcher configs ----

def compose_with_hydra(overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir

    from trainer.config import register_configs

    register_configs()  # as compose() does: a test run on its own must not depend on another
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides, return_hydra_config=True)


@pytest.mark.parametrize("experiment, model, experts", [
    ("muon_vs_adamw_small", "gpt_small", 0),
    ("muon_vs_adamw_moe_small", "moe_small", 8),
])
@pytest.mark.parametrize("optim", ["muon", "adamw"])
def test_experiment_configs_pin_the_comparison(experiment, model, experts, optim):
    cfg = compose([f"+experiment={experiment}", f"optim={optim}"])
    typed = to_dataclass(cfg)
    validate(typed)
    assert (typed.model.name, typed.model.n_experts) == (model, experts)
    assert typed.optim.name == optim  # the sweep's optimizer choice keeps the pinned settings
    assert (typed.seed, typed.trainer.max_steps, typed.trainer.batch_size, typed.trainer.seq_len) == (0, 300, 16, 256)
    assert (typed.trainer.precision, typed.trainer.grad_accum, typed.trainer.compile) == ("bf16", 1, False)
    assert typed.optim.muon.ns_dtype == "bf16"  # pinned, not the machine-dependent "auto"
    assert (typed.optim.schedule, typed.optim.warmup_steps, typed.optim.min_lr) == ("cosine", 30, 0.0)
    assert (typed.eval.interval, typed.eval.batches) == (50, 8)
    params = compose_with_hydra([f"+experiment={experiment}"]).hydra.sweeper.params
    assert dict(params) == {"optim": "muon,adamw", "optim.lr": "1e-3,3e-3,1e-2"}


@pytest.mark.parametrize("experiment, model, experts", [
    ("reference_cpu", "gpt_small", 0),
    ("reference_cpu_moe", "moe_small", 8),
])
@pytest.mark.parametrize("optim", ["muon", "adamw"])
def test_reference_cpu_pins_what_docs_results_states(experiment, model, experts, optim):
    """lab/results.md quotes these settings, for the dense and the MoE halves alike: 240 steps
    x 2048 tokens, fp32 (training and Newton-Schulz), cosine to 0 after 24 warmup steps, weight
    decay 0.1, and an lr grid that holds both optimizers' best lrs inside it."""
    typed = to_dataclass(compose([f"+experiment={experiment}", f"optim={optim}"]))
    validate(typed)
    assert (typed.model.name, typed.model.n_experts, typed.optim.name, typed.seed) == (model, experts, optim, 0)
    t = typed.trainer
    assert (t.max_steps, t.batch_size * t.seq_len * t.grad_accum) == (240, 2048)
    assert (t.precision, typed.optim.muon.ns_dtype) == ("fp32", "fp32")
    o = typed.optim
    assert (o.schedule, o.warmup_steps, o.min_lr, o.weight_decay) == ("cosine", 24, 0.0, 0.1)
    assert (typed.eval.interval, typed.eval.batches * typed.eval.batch_size) == (24, 48)
    params = compose_with_hydra([f"+experiment={experiment}"]).hydra.sweeper.params
    assert dict(params) == {"optim": "adamw,muon", "optim.lr": "3e-4,1e-3,3e-3,1e-2,3e-2"}


def test_sweep_dirs_hold_every_optimizer_and_name_jobs_by_their_overrides():
    hydra_cfg = compose_with_hydra(["+experiment=muon_vs_adamw_small"]).hydra
    assert hydra_cfg.sweep.dir.startswith("outputs/multirun/")  # not split by ${name}
    assert "${hydra.job.override_dirname}" in OmegaConf.to_container(hydra_cfg.sweep)["subdir"]


def test_only_swept_overrides_name_the_job_dirs():
    argv = ["-m", "+experiment=muon_vs_adamw_small", "optim=muon,adamw", "optim.lr=0.002",
            "model=gpt_tiny", "hydra.sweep.dir=/tmp/x", "hydra/launcher=local"]
    extra, _ = launch.launch_overrides(argv, env())
    assert extra == ["hydra.job.config.override_dirname.exclude_keys=[experiment,model,optim.lr]"]
    assert launch.launch_overrides(argv[1:], env()) == ([], {})  # a single run has no job dirs
    mine = argv + ["hydra.job.config.override_dirname.exclude_keys=[model]"]
    assert launch.launch_overrides(mine, env()) == ([], {})
    assert launch.launch_overrides(["-m", "optim=muon,adamw"], env()) == ([], {})


@requires("hydra_plugins.hydra_joblib_launcher", "hydra/launcher=local")
@requires("hydra_plugins.hydra_submitit_launcher", "hydra/launcher=slurm")
def test_launcher_configs_compose():
    local = compose_with_hydra(["hydra/launcher=local"]).hydra.launcher
    assert local._target_.endswith("JoblibLauncher") and local.n_jobs == 2
    slurm = compose_with_hydra(["hydra/launcher=slurm"]).hydra.launcher
    assert slurm._target_.endswith("SlurmLauncher")
    assert slurm.tasks_per_node == slurm.gpus_per_node and slurm.nodes == 1 and slurm.timeout_min > 0


def test_ranks_other_than_0_drop_the_job_log_file(tmp_path, monkeypatch):
    """SLURM tasks started by the submitit launcher never run train.py's __main__."""
    import logging

    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    job_log = logging.FileHandler(tmp_path / "train.log")
    root.addHandler(job_log)
    root.setLevel(logging.INFO)
    try:
        monkeypatch.setenv("RANK", "0")
        launch.quiet_nonzero_rank_logging()
        assert job_log in root.handlers
        monkeypatch.setenv("RANK", "1")
        launch.quiet_nonzero_rank_logging()
        assert job_log not in root.handlers and root.level == logging.WARNING
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
        job_log.close()


FAMILY = {"muon": "muon", "normuon": "muon+normuon", "cautious_wd": "muon+cautious_wd",
          "all": "muon+normuon+cautious_wd+gram_ns", "adamw": "adamw", "adamw_cautious_wd": "adamw+cautious_wd"}


@pytest.mark.slow  # a torchrun launch or a six-job sweep: with the longer tests (make test's budget)
def test_the_muon_family_sweep_runs_every_setting_and_compare_runs_gives_each_a_row(tmp_path):
    """docs/muon_family.md's comparison sweep, on gpt_tiny for 3 steps and one seed."""
    params = compose_with_hydra(["+experiment=muon_family_cpu"]).hydra.sweeper.params
    assert dict(params) == {"muon_family": ",".join(FAMILY), "seed": "0,1,2"}
    sweep = tmp_path / "family"
    proc = run_train(["-m", "+experiment=muon_family_cpu", "seed=0", f"hydra.sweep.dir={sweep}", *TINY])
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = job_dirs(sweep)
    assert [p.name.split("=", 1)[1] for p in jobs] == list(FAMILY)
    for job, setting in zip(jobs, FAMILY):
        optim = yaml.safe_load((job / ".hydra" / "config.yaml").read_text())["optim"]
        assert optim["lr"] == (1e-2 if setting in ("muon", "normuon", "cautious_wd", "all") else 1e-3)
        assert all(math.isfinite(r["train/loss"]) for r in records(job))
    out = tmp_path / "cmp"
    cmp = subprocess.run([sys.executable, "scripts/compare_runs.py", str(sweep), "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert cmp.returncode == 0, cmp.stderr[-3000:]
    summary = (out / "summary.md").read_text()
    table = summary.split("## Every optimizer setting, at its best lr")[1].split("\n## ")[0]
    rows = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert rows == ["muon (A)", "adamw (B)", "adamw+cautious_wd", "muon+cautious_wd",
                    "muon+normuon", "muon+normuon+cautious_wd+gram_ns"]
    # what each setting's optimizer step cost, from the times every run logs
    header = next(line for line in table.splitlines() if line.startswith("| setting"))
    assert header.rstrip(" |").endswith("median perf/optim_step_s")
    costs = [line.rstrip(" |").rsplit("|", 1)[1] for line in table.splitlines() if line.startswith("| ")][2:]
    assert len(costs) == 6 and all(float(c) > 0 for c in costs), costs
