"""Train a GPT with Muon or AdamW.

    python train.py                                   # defaults: conf/config.yaml
    python train.py model=gpt_small optim=adamw       # pick presets
    python train.py -m optim=muon,adamw optim.lr=1e-3,3e-3   # Hydra multirun sweep
    python train.py -m +experiment=muon_vs_adamw_small       # a pinned comparison sweep
    torchrun --nproc_per_node=8 train.py parallel.tp=2       # one run over 8 processes
    python train.py parallel.simulate_world=8 parallel.dp_shard=8   # rank 0 of that layout, alone
"""
from __future__ import annotations

import sys

from trainer.run.interrupts import install_start_up_handler

install_start_up_handler()

# The imports below come after the handler: importing torch alone takes seconds.
import atexit
import logging
import os
import socket
import time
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from data.sources import DataConfigError
from trainer.checkpoint.files import CheckpointError
from trainer.config import TrainConfig, register_configs, to_dataclass
from trainer.device import DeviceError
from trainer.run.launch import (end_job, launch_overrides, launch_rank, quiet_nonzero_rank_logging,
                            record_launch_error, resume_command, start_job)
from trainer.loop import NonFiniteLoss, Trainer
from trainer.run.lock import RunLocked, claim, held, planned_run_dir
from parallel.mesh import destroy_mesh, world_size_from_env
from parallel.slurm import adopt_slurm_env
from trainer.run.preflight import check_config, config_warnings, preflight
from trainer.run.preemption import Preempted
from trainer.run.kind import Finished, check_run_dir, objective_value
from trainer.simulation.one_rank import simulating

register_configs()
log = logging.getLogger("train")
# A multirun keeps its default process group from job to job; it goes when the process ends.
atexit.register(destroy_mesh)


def one_line(err: Exception) -> str:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    full_key = getattr(err, "full_key", None)
    return f"{full_key}: {first}" if full_key and full_key not in first else first


# torchrun ends every rank as soon as one exits with an error: a rank that stays silent waits
# this long before exiting, so that the rank saying what went wrong gets to say it.
SILENT_RANK_EXIT_DELAY_S = 3.0


# The line a silent rank would have said: handed to torchrun only as it exits (exit_silently).
_unsaid_line: str | None = None


def exit_silently(code: int) -> None:
    time.sleep(SILENT_RANK_EXIT_DELAY_S)
    # Recorded now, not when the error was found: torchrun ends the other ranks once the one
    # that spoke has failed, and a rank it ended must not be listed with the error's line too.
    if _unsaid_line is not None:
        record_launch_error(_unsaid_line, time.time())
    sys.exit(code)


def print_error(message: str, per_node: bool = False) -> bool:
    """Every rank of a launch reads the same config and data, so they all fail alike: the line
    from rank 0 is the message, the same line from every rank noise. A `per_node` error (this
    node's GPUs) comes from each node's local rank 0, named by its host on a multi-node launch.
    Every rank hands the line to torchrun, whose summary names it as the root cause.
    Returns whether this rank printed."""
    env = os.environ
    if per_node and int(env.get("WORLD_SIZE", "1")) > int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1"))):
        message = f"{socket.gethostname()}: {message}"
    line = f"error: {message}"
    if per_node:
        speaks = env.get("LOCAL_RANK", env.get("SLURM_LOCALID", "0")) == "0"
    else:
        speaks = launch_rank() == 0
    if speaks:
        record_launch_error(line, time.time())
        print(line, file=sys.stderr)
    else:  # it fails when it exits, after the delay (exit_silently): the rank that prints is first
        global _unsaid_line
        _unsaid_line = line
    return speaks


def exit_bad_input(err: Exception) -> None:
    """Bad input is the user's to fix: one line naming the key or file, not a traceback."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise err
    if not print_error(one_line(err), per_node=isinstance(err, DeviceError)):
        exit_silently(2)
    sys.exit(2)


# The run dir __main__ checked before Hydra wrote into it (realpath): main() checks any other.
_checked_dir: str | None = None


def run_dir_checks(typed: TrainConfig, run_dir: Path, dir_key: str) -> Finished | None:
    """The run dir's own start-up checks (trainer/run/kind.py), before any data or model work:
    exit 2 with one line where it holds the other kind of run (a simulation's or a training
    run's); the finished run it holds, if it holds one, for the caller to say so and stop."""
    try:
        return check_run_dir(typed, run_dir, dir_key)
    except ValueError as err:
        exit_bad_input(err)
    return None


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    try:
        adopt_slurm_env()  # before anything reads RANK or LOCAL_RANK
        quiet_nonzero_rank_logging()
        typed = check_config(cfg, world_size_from_env())  # as the preflight did, now per job
    except (ValueError, OmegaConfBaseException) as err:
        exit_bad_input(err)

    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    run_dir = Path(hydra_cfg.runtime.output_dir)
    # Usually taken by __main__ below, before Hydra wrote into the dir. Taken here for what it
    # could not name: each job of a sweep (its own dir), a task the submitit launcher started.
    try:
        job_lock = None if held(run_dir) else claim(run_dir)
    except (RunLocked, OSError) as err:
        exit_bad_input(err)
    lock = held(run_dir)
    if lock is not None and lock.took_over:
        log.warning(lock.took_over)
        lock.took_over = None
    if os.path.realpath(run_dir) != _checked_dir:  # a sweep's job, or a dir __main__ could not foresee
        try:
            finished = run_dir_checks(typed, run_dir, "hydra.sweep.dir" if multirun else "hydra.run.dir")
        except SystemExit:
            if job_lock is not None:
                job_lock.release()
            raise
        if finished is not None:
            if launch_rank() == 0:
                log.info(finished.line())
            if job_lock is not None:
                job_lock.release()
            # What the job returned when it ended, for a sweeper that reads it again.
            return finished.recorded_objective(typed.eval.objective)
    tf32_before = start_job(typed, hydra_cfg)
    log.info("run dir: %s (%d intra-op CPU threads)", run_dir, torch.get_num_threads())
    if launch_rank() == 0:  # every rank has the same config: the others would only repeat it
        for line in config_warnings(typed):
            log.warning(line)
        if Path(typed.checkpoint.resume) != Path(cfg.checkpoint.resume):  # a run dir: the checkpoint it names
            log.info("checkpoint.resume=%s: resuming from %s", cfg.checkpoint.resume, typed.checkpoint.resume)
    # A simulation (parallel.simulate_world) leaves no checkpoint to resume from; a study's run
    # (logger.resume_hint=false) is resumed by the study's own command, which it prints.
    resume_line = (f"to resume: {resume_command(USER_ARGV, run_dir, multirun)}"
                   if typed.logger.resume_hint and not simulating(typed) else None)
    trainer: Trainer | None = None
    try:
        trainer = Trainer(typed, run_dir)
        final = trainer.train()
    except (DataConfigError, CheckpointError, DeviceError) as err:
        # Found only once the device is taken (more ranks on this node than GPUs: the
        # Trainer's first step, before any collective or data work) or the data or the
        # checkpoint opened (a text field the dataset lacks, a checkpoint of another model),
        # but still the user's input.
        exit_bad_input(err)
    except NonFiniteLoss as err:
        if not multirun:
            if not print_error(str(err)):
                exit_silently(3)
            if resume_line is not None:
                print(f"{resume_line} (from the last good checkpoint; change what diverged first, e.g. optim.lr)",
                      file=sys.stderr)
            sys.exit(3)
        # One diverging lr must not cost the rest of the sweep: this job scores NaN.
        log.error("job %s (%s) diverged; the sweep continues: %s",
                  hydra_cfg.job.num, hydra_cfg.job.override_dirname or "defaults", err)
        return float("nan")
    except Preempted:
        if trainer is not None and trainer.speaks and resume_line is not None:
            print(resume_line, file=sys.stderr)  # a checkpoint of this very step was just saved
        raise
    except Exception:
        if multirun:
            # Hydra runs the next job and re-raises this only once the whole sweep is over:
            # put the traceback in this job's log now, where the user looks first.
            log.exception("job %s (%s) failed", hydra_cfg.job.num, hydra_cfg.job.override_dirname or "defaults")
        raise
    finally:
        end_job(trainer.mesh if trainer is not None else None, multirun, tf32_before)
        if job_lock is not None:
            job_lock.release()
    # The return value is what Hydra sweepers optimise: eval.objective at the last step (by
    # default the in-domain val loss; a tuning study's val/tune/loss).
    return objective_value(final, typed.eval.objective)


# The command line as the user typed it, before __main__ adds overrides of its own: what the
# resume command repeats.
USER_ARGV: list[str] = []

if __name__ == "__main__":
    USER_ARGV = sys.argv[1:]
    try:
        extra_args, extra_env = launch_overrides(sys.argv[1:], os.environ)
    except ValueError as err:
        if not print_error(str(err)):
            exit_silently(2)
        sys.exit(2)
    os.environ.update(extra_env)
    sys.argv += extra_args
    # Every value of every job, checked before Hydra writes the run dir: a bad one is one line
    # (from rank 0 alone) and exit 2, with nothing written.
    composed = None
    try:
        composed = preflight(sys.argv[1:], str(Path(__file__).parent / "conf"), world_size_from_env())
    except (ValueError, OmegaConfBaseException) as err:
        exit_bad_input(err)
    # The run dir's lock, taken before Hydra writes .hydra/ and the job log into the dir: a run
    # refused here leaves the holder's dir exactly as it was.
    run_lock = None
    planned = planned_run_dir(sys.argv[1:], str(Path(__file__).parent / "conf"))
    if planned is not None:
        sys.argv += planned[1]
        try:
            run_lock = claim(planned[0])
        except RunLocked as err:  # another run holds it
            exit_bad_input(err)
        except OSError as err:  # a dir that cannot be made or written (read-only, under /proc)
            exit_bad_input(ValueError(f"hydra.run.dir={planned[0]}: the run dir cannot be written "
                                      f"({err.strerror or err}: {err.filename or planned[0]})"))
    try:
        finished = None
        if planned is not None and composed is not None:
            # Before Hydra writes .hydra/ and the job log: a refused or finished run leaves the
            # dir as it was. Every rank reads the same files, so all decide alike.
            finished = run_dir_checks(to_dataclass(composed), planned[0], "hydra.run.dir")
            _checked_dir = os.path.realpath(planned[0])
        if finished is None:
            main()
        elif launch_rank() == 0:
            print(finished.line())
    finally:
        if run_lock is not None:
            run_lock.release()
