"""What a run dir already holds, judged before the expensive start-up: which kind of run wrote
it, and whether the run it holds is finished.

A run dir holds one kind of run. A training run leaves checkpoints, metrics rows and an
environment.json; a simulation (parallel.simulate_world, trainer/simulation/one_rank.py) leaves no
checkpoint, marks every metrics row "simulated": 1 and puts a "simulation" entry in
environment.json. The two in one dir would interleave their rows in metrics.jsonl, and the
dir's environment.json would call the training run a simulation (or the other way round):
each refuses the other's dir (`check_run_kind`).

A run resumed from a checkpoint at or past its trainer.max_steps has nothing to train: it says
so (`Finished.line`) instead of building its data and model to take no step.

Reads a few small files: every rank of a launch reads the same ones and comes to the same
decision without talking, before any process group exists.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from trainer.checkpoint.files import (STEP_NAME, CheckpointError, checkpoints_in, open_checkpoint, read_saved_run,
                                      resolve_checkpoint, step_of)
from trainer.config import ConfigError, TrainConfig
from eval.environment import ENV_FILE, read_environment
from trainer.simulation.one_rank import ROW_FLAG, simulating
from trainer.run.sinks import METRICS_FILE, SET_ASIDE_FILE

FLAG = next(iter(ROW_FLAG))  # "simulated"
FLAG_BYTES = json.dumps(FLAG).encode()


@dataclass
class DirRecords:
    """What of each kind of run a dir holds, in words (empty: nothing of that kind)."""

    training: list[str]
    simulation: list[str]


def _count_rows(path: Path) -> tuple[int, int]:
    """(training rows, simulated rows) of a metrics file. A line without the flag is tested
    only for being whole (a row is a flat JSON object), so a long file costs no JSON parsing;
    a torn last line counts as neither."""
    try:
        data = path.read_bytes()
    except OSError:
        return 0, 0
    training = simulated = 0
    for line in data.splitlines():
        line = line.strip()
        if not line:
            continue
        if FLAG_BYTES in line:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and row.get(FLAG) == ROW_FLAG[FLAG]:
                simulated += 1
                continue
        if line.startswith(b"{") and line.endswith(b"}"):
            training += 1
    return training, simulated


def _rows(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n} rows"


def dir_records(run_dir: Path) -> DirRecords:
    """The records of each kind in `run_dir`: checkpoints (only a training run writes them),
    metrics rows (set-aside ones too) and environment.json."""
    found = DirRecords([], [])
    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        names = [p.name for p in checkpoints_in(checkpoints)]
        found.training.append(f"checkpoints/{names[0]}" if names else "files in checkpoints/")
    for name in (METRICS_FILE, SET_ASIDE_FILE):
        training, simulated = _count_rows(run_dir / name)
        if training:
            found.training.append(f"{_rows(training)} of a training run in {name}")
        if simulated:
            found.simulation.append(f'{_rows(simulated)} marked "{FLAG}": {ROW_FLAG[FLAG]} in {name}')
    env = read_environment(run_dir)
    if isinstance(env, dict):
        if env.get("simulation"):
            found.simulation.append(f'the "simulation" entry of {ENV_FILE}')
        else:
            found.training.append(f"a training run's {ENV_FILE}")
    return found


def check_run_kind(run_dir: Path, cfg: TrainConfig, named: str, dir_key: str) -> None:
    """ConfigError in one line when `run_dir` holds records of the other kind of run than
    `cfg`'s. `named` names the dir as the user gave it (e.g. hydra.run.dir=<dir>), `dir_key`
    the key that gives it another."""
    found = dir_records(run_dir)
    if simulating(cfg) and found.training:
        raise ConfigError(
            f"{named}: holds a training run ({', '.join(found.training)}); a simulation "
            f"(parallel.simulate_world={cfg.parallel.simulate_world}) must not mix its records into it: "
            f"give the simulation a dir of its own (another {dir_key})")
    if not simulating(cfg) and found.simulation:
        raise ConfigError(
            f"{named}: holds a simulation's records ({', '.join(found.simulation)}); a training run must not mix "
            f"its records with them: give this run a dir of its own (another {dir_key})")


@dataclass(frozen=True)
class Finished:
    """A run whose resume checkpoint is at or past trainer.max_steps; `named`: how the user
    pointed at it (the run dir's key, or checkpoint.resume)."""

    checkpoint: Path
    step: int
    max_steps: int
    named: str

    def line(self) -> str:
        reached = (f"reached its trainer.max_steps={self.max_steps} at step {self.step}" if self.step == self.max_steps
                   else f"is at step {self.step}, past trainer.max_steps={self.max_steps}")
        return (f"{self.named}: the run {reached} (checkpoint {self.checkpoint}); nothing to train. "
                f"To train on, raise trainer.max_steps, e.g. trainer.max_steps={max(2 * self.step, self.step + 1)}")

    def recorded_objective(self, key: str = "val/val/loss") -> float:
        """The metric `key` (eval.objective) the run logged at the checkpoint's step (what
        train.py's main() returned when the run ended: a sweeper's score), from the metrics of
        the run dir the checkpoint is in; NaN where it logged none."""
        loss = float("nan")
        try:
            lines = (self.checkpoint.parent.parent / METRICS_FILE).read_bytes().splitlines()
        except OSError:
            return loss
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            value = objective_value(row, key) if isinstance(row, dict) and row.get("step") == self.step else loss
            if not math.isnan(value):
                loss = value
        return loss


def objective_value(metrics: dict, key: str) -> float:
    """What train.py's main() returns to a sweeper: metrics[key] (key: eval.objective), or NaN
    where the metrics lack it or hold no number there."""
    value = metrics.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else float("nan")


def resume_step(resume: str, run_dir: Path, allow_suspect: bool) -> Optional[tuple[Path, int]]:
    """The checkpoint a run would resume from, and its step, read without loading a tensor or
    hashing a file: `auto` takes the newest trusted checkpoint in <run_dir>/checkpoints (the one
    trainer/checkpoint/store.py find_resume tries first), a path names its own (a run dir: its
    newest trusted one). None where there is none, or where it cannot be read: the start-up
    then finds it and says what is wrong with it."""
    if resume == "none":
        return None
    source = run_dir / "checkpoints" if resume == "auto" else Path(resume)
    if resume == "auto" and not (source.is_dir() and checkpoints_in(source)):
        return None
    try:
        path = resolve_checkpoint(source, allow_suspect, "checkpoint.allow_suspect=true")
        step = read_saved_run(path).get("step")  # a sharded checkpoint's trainer.json
        if step is None and STEP_NAME.match(path.name):
            step = step_of(path)  # a single-file one keeps its record inside the pickle: its name says it
    except (CheckpointError, OSError, ValueError):
        return None
    return (path, step) if isinstance(step, int) else None


def finished_run(cfg: TrainConfig, run_dir: Path, named: str) -> Optional[Finished]:
    """The run `cfg` would resume, if its checkpoint is at or past trainer.max_steps and
    verifies (a simulation resumes nothing: None). Only such a checkpoint is hashed here: one
    that fails its digests is left to the start-up, which falls back to an older one or says
    what is wrong with it, and a run with steps to go is verified there once, not twice."""
    if simulating(cfg):
        return None
    resume = cfg.checkpoint.resume
    found = resume_step(resume, run_dir, cfg.checkpoint.allow_suspect)
    if found is None or found[1] < cfg.trainer.max_steps:
        return None
    try:
        open_checkpoint(found[0])
    except (CheckpointError, OSError):
        return None
    return Finished(found[0], found[1], cfg.trainer.max_steps, named if resume == "auto" else f"checkpoint.resume={resume}")


def check_run_dir(cfg: TrainConfig, run_dir: Path, dir_key: str) -> Optional[Finished]:
    """Both start-up checks of a run dir, for train.py: ConfigError when it holds the other kind
    of run; else the finished run it holds (None: there is training to do). `dir_key` is the
    key that chose the dir: hydra.run.dir, or hydra.sweep.dir for a sweep's job."""
    named = f"{dir_key}={run_dir}" if dir_key == "hydra.run.dir" else f"run dir {run_dir} (a job of {dir_key})"
    check_run_kind(run_dir, cfg, named, dir_key)
    return finished_run(cfg, run_dir, named)
