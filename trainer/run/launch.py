"""How one process of a launch joins it, before and around each Hydra job.

Every rank of a torchrun (or SLURM) launch composes the config itself, so the ranks must
agree on one run dir without talking: they take the launch's shared id as its stamp, and
only rank 0 writes Hydra's outputs. In a multirun sweep one process runs job after job, so
each job starts clean and leaves nothing behind for the next.
"""
from __future__ import annotations

import gc
import json
import logging
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Mapping

import torch
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from optim.muon.buffers import release_buffers
from trainer.config import TrainConfig
from trainer.run.preflight import read_command_line
from trainer.device import TF32Flags, seed_everything, set_tf32, tf32_flags
from parallel.mesh import Mesh, destroy_mesh, is_simulated, release_compiled_graphs, release_subgroups
from parallel.slurm import torch_env_from_slurm

# conf/config.yaml puts this in place of the ${now:} stamp of the run and sweep dirs.
RUN_ID_ENV = "TRAIN_RUN_ID"
EXCLUDE_KEYS = "hydra.job.config.override_dirname.exclude_keys"


def _given(argv: list[str], key: str) -> bool:
    """Whether the command line overrides `key` (also as +key=, ++key= or ~key)."""
    return any(arg.split("=", 1)[0].lstrip("+~") == key for arg in argv)


def shared_run_id(env: Mapping[str, str]) -> str | None:
    """An id every rank of this launch sees, and sees again after torchrun restarts the group.

    torchrun's rendezvous id is a random uuid per `--standalone` (or single-node) launch and
    the user's --rdzv-id otherwise; "none" is the static rendezvous's placeholder, shared by
    unrelated launches, so it does not count. Tasks started by srun share the SLURM job and
    step ids, which a requeued job keeps.
    """
    if env.get(RUN_ID_ENV):
        return env[RUN_ID_ENV]  # the user's own choice
    run_id = env.get("TORCHELASTIC_RUN_ID", "none")
    if re.fullmatch(r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", run_id):
        return "torchrun_" + run_id[:8]  # a generated uuid: 8 hex digits tell launches apart
    if run_id != "none":
        return "torchrun_" + re.sub(r"[^A-Za-z0-9._-]", "_", run_id)
    if env.get("SLURM_JOB_ID"):
        # The step tells apart several trainings launched one after another in one job.
        step = env.get("SLURM_STEP_ID")
        return f"slurm_{env['SLURM_JOB_ID']}" + (f"_{step}" if step else "")
    return None


def parse_command_line(argv: list[str]) -> tuple[bool, list[Override]]:
    """Hydra's own reading of the command line: (multirun?, the overrides); ValueError where
    Hydra's parser refuses it (Hydra reports that itself)."""
    line = read_command_line(argv)
    if line is None:
        raise ValueError("a command line Hydra's parser refuses")
    return line.multirun, OverridesParser.create().parse_overrides(line.overrides)


def job_dirname_overrides(overrides: list[Override]) -> list[str]:
    """Name a sweep's job dirs by the overrides the sweep varies, not by every override.

    The fixed ones are the same for every job (and saved in its .hydra/overrides.yaml);
    in the name they only add length, up to the file system's limit on a dir name.
    Values swept by an experiment's hydra.sweeper.params still name the dirs.
    """
    if any(o.get_key_element().lstrip("+~") == EXCLUDE_KEYS for o in overrides):
        return []  # the user's own choice
    fixed = sorted({o.key_or_group for o in overrides if not o.is_sweep_override() and not o.is_hydra_override()})
    return [f"{EXCLUDE_KEYS}=[{','.join(fixed)}]"] if fixed else []


def launch_overrides(argv: list[str], env: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """Extra Hydra overrides and environment for this process, decided before Hydra composes.

    In a multi-process launch every rank composes the config itself, so they must agree on
    the run (or sweep) dir without talking: each takes the launch's shared id as the dir's
    stamp. Only rank 0 writes Hydra's outputs (.hydra/ and the job log); the others log
    warnings to the console.
    """
    try:
        multirun, overrides = parse_command_line(argv)
    except (SystemExit, Exception):
        return [], {}  # Hydra reports a malformed command line itself, in its own words
    extra = job_dirname_overrides(overrides) if multirun else []
    env = {**env, **torch_env_from_slurm(env)}
    if not env.get("WORLD_SIZE", "1").isdigit():
        raise ValueError(f"WORLD_SIZE={env['WORLD_SIZE']!r} is not a process count")
    if int(env.get("WORLD_SIZE", "1")) <= 1:
        return extra, {}
    dir_key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    extra_env: dict[str, str] = {}
    run_id = shared_run_id(env)
    if run_id is not None:
        extra_env[RUN_ID_ENV] = run_id
    elif not _given(argv, dir_key):
        raise ValueError(
            f"{dir_key}: the {env['WORLD_SIZE']} processes share no launch id (torchrun "
            f"--rdzv-id, or SLURM_JOB_ID) to agree on one dir; pin {dir_key}=<dir>"
        )
    if env.get("RANK", "0") != "0":
        if not _given(argv, "hydra.output_subdir"):
            extra.append("hydra.output_subdir=null")
        if not _given(argv, "hydra/job_logging"):
            extra.append("hydra/job_logging=nonzero_rank")
        if not _given(argv, "hydra/hydra_logging"):
            extra.append("hydra/hydra_logging=disabled")
    return extra, extra_env


def resume_command(user_argv: list[str], run_dir: Path, multirun: bool, env: Mapping[str, str] = os.environ) -> str:
    """The command that continues this run (checkpoint.resume=auto finds its checkpoints): the
    user's own command line with the run's dir pinned. A sweep is continued whole: each job
    finds its own dir again. Under torchrun, the launch's own options are not known here."""
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    directory = run_dir.parent if multirun else run_dir
    args = [a for a in user_argv if not a.startswith(f"{key}=")] + [f"{key}={directory}"]
    if int(env.get("WORLD_SIZE", "1")) > 1:
        return f"torchrun <the same options> {shlex.join(['train.py', *args])}"
    return shlex.join(["python", "train.py", *args])


def launch_rank(env: Mapping[str, str] = os.environ) -> int:
    """This process's rank in its launch (torchrun's RANK, a SLURM task's id), 0 alone."""
    return int(env.get("RANK", env.get("SLURM_PROCID", "0")))


def record_launch_error(message: str, failed_at: float, env: Mapping[str, str] = os.environ) -> None:
    """Hand torchrun the one line this rank stops with, as the root cause of its failure.

    torchrun sets TORCHELASTIC_ERROR_FILE for each rank and, when the rank exits with an error,
    reads it back: the record of the earliest failure becomes the "Root Cause" of the summary
    it prints last (otherwise a link to its docs about tracebacks). The layout is the one its
    @record decorator writes, less the Python call stack, which torchrun would print in place
    of the message. Every rank that refuses writes it (each says the same), so whichever rank
    torchrun sees fail first, its summary names the cause. Best effort: nothing is lost but
    the summary's line. `failed_at` (seconds since the epoch) orders the ranks' records."""
    path = env.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {"message": {"message": message, "extraInfo": {"timestamp": str(int(failed_at))}}}
    try:
        Path(path).write_text(json.dumps(record))
    except OSError:
        pass


def quiet_nonzero_rank_logging() -> None:
    """Ranks != 0 keep no job log file and log only warnings.

    torchrun ranks get this through launch_overrides; SLURM tasks started by the submitit
    launcher never run this file's __main__, so their Hydra job logging is undone here.
    """
    if launch_rank() == 0:
        return
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, logging.FileHandler)]:
        root.removeHandler(handler)
        handler.close()
    root.setLevel(max(root.level, logging.WARNING))


def share_cpu_threads(hydra_cfg: DictConfig) -> None:
    """Jobs the joblib launcher runs side by side split the cores between them.

    Otherwise each would start one thread per core and they would thrash. joblib's workers
    already get OMP_NUM_THREADS set to this share; an OMP_NUM_THREADS the user exported wins.
    """
    n_jobs = OmegaConf.select(hydra_cfg, "launcher.n_jobs", default=None)
    if not isinstance(n_jobs, int) or n_jobs == 0:
        return
    cores = os.cpu_count() or 1
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        threads = int(os.environ["OMP_NUM_THREADS"])
    else:
        # joblib's convention: -1 is one job per core, -2 all cores but one, ...
        running = n_jobs if n_jobs > 0 else max(1, cores + 1 + n_jobs)
        threads = cores // running
    torch.set_num_threads(max(1, threads))


def start_job(typed: TrainConfig, hydra_cfg: DictConfig) -> TF32Flags:
    """State a job must not inherit from the previous job of a sweep in this process.

    Returns the TF32 flags as they are before the job (the Trainer sets the job's own), for
    end_job to put back.
    """
    wandb = typed.logger.wandb
    if hydra_cfg.mode == RunMode.MULTIRUN:
        if wandb.group is None:
            # The sweep dir names the sweep: its jobs appear together in wandb.
            wandb.group = Path(str(hydra_cfg.sweep.dir)).name[-128:]
        if wandb.name is None:
            varied = hydra_cfg.job.override_dirname
            wandb.name = f"{typed.name} {varied}"[:128] if varied else typed.name
        if typed.logger.progress_prefix is None:
            typed.logger.progress_prefix = f"job {hydra_cfg.job.num}"
    elif wandb.name is None:
        wandb.name = typed.name
    share_cpu_threads(hydra_cfg)
    seed_everything(typed.seed)
    return tf32_flags()


def end_job(mesh: Mesh | None, multirun: bool, tf32_before: TF32Flags) -> None:
    """Leave nothing behind for the next job of a sweep: process groups, compiled graphs, wandb,
    trainer.tf32 (back to `tf32_before`, what start_job found), and Muon's Newton-Schulz CUDA
    graphs and kept buffers (optim.muon.cuda_graphs: their GPU memory, and graphs recorded
    under this job's matmul flags)."""
    set_tf32(tf32_before)
    release_buffers()
    # A simulation's fake groups have no launcher's store to go stale (see release_subgroups):
    # the next job of its sweep starts its own.
    if not multirun or is_simulated():
        destroy_mesh()
    elif mesh is not None:
        # The next job joins the same default group (see release_subgroups); it goes at exit.
        release_subgroups(mesh)
    release_compiled_graphs()  # (a single process has no mesh to release them with)
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish()  # normally already finished by the metric sinks; this covers errors
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
