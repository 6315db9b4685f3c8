"""Run records: a finished run dir cut down to what compare_runs.py reads, small enough to commit.

A published result must outlive the machine it ran on. A run dir holds the tokenizer, wandb's
and TensorBoard's copies, and sometimes checkpoints, so it lives under outputs/, which is never
committed. Twice a published protocol lost its run dirs when the machine changed, and its
figures could no longer be made again. A record keeps the run's metrics.jsonl (gzipped; it
decompresses to the very same bytes), its Hydra config and overrides, its resolved config and
its environment.json. That is everything compare_runs.py needs to redraw every figure and
table, and to check the corpus ids, exactly as from the run dir itself.
"""
from __future__ import annotations

import gzip
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from eval.compare import METRICS, RECORDED_METRICS, find_runs, load_run

# Copied as they are. The first is required: without it a record has no lr, seed or length.
CONFIG = ".hydra/config.yaml"
OPTIONAL_FILES = (".hydra/overrides.yaml", "resolved_config.yaml", "environment.json")


class RecordError(ValueError):
    """A run that cannot be recorded, or a record that would overwrite another."""


@dataclass(frozen=True)
class PlannedRecord:
    run_dir: Path
    record_dir: Path


def compress(data: bytes) -> bytes:
    """gzip with no timestamp, so that recording the same run twice gives the same bytes (and
    git sees no change)."""
    return gzip.compress(data, compresslevel=9, mtime=0)


def plan_records(sources: list[Path], into: Path, replace: bool = False,
                 skip_unfinished: bool = False) -> list[PlannedRecord]:
    """Where each run found under `sources` goes: into/<source name>/<its path below the source>.
    Every check is made here, before anything is written: each run must be finished and have its
    config, and no existing record is overwritten unless `replace`. A run whose record is already
    there, byte for byte, is left out, so a sweep can be recorded again as more of it finishes;
    with `skip_unfinished`, so are the runs still going."""
    planned: list[PlannedRecord] = []
    for source in sources:
        for run_dir in find_runs(source):
            if not (run_dir / METRICS).is_file():
                raise RecordError(f"{run_dir}: no {METRICS} to record (only run dirs that train.py wrote)")
            if not (run_dir / CONFIG).is_file():
                raise RecordError(f"{run_dir}: no {CONFIG}; without it a record has no lr, seed or length")
            unfinished = load_run(run_dir).unfinished()
            if unfinished and skip_unfinished:
                continue  # still going: recorded on a later call, once it has finished
            if unfinished:
                raise RecordError(f"not recorded, unfinished: {unfinished}")
            record_dir = into / source.name / run_dir.relative_to(source)
            if record_dir.exists() and not replace:
                if holds_record_of(record_dir, run_dir):
                    continue  # recorded before: a sweep is recorded as its runs finish
                raise RecordError(f"{record_dir} already holds the record of another run (--replace overwrites it)")
            planned.append(PlannedRecord(run_dir, record_dir))
    targets = [p.record_dir for p in planned]
    if len(set(targets)) != len(targets):
        raise RecordError(f"two sources have the same name, so their records would collide in {into}")
    return planned


def record_files(run_dir: Path) -> dict[str, bytes]:
    """A run's record, as file name -> bytes."""
    files = {RECORDED_METRICS: compress((run_dir / METRICS).read_bytes())}
    files.update({name: (run_dir / name).read_bytes() for name in (CONFIG, *OPTIONAL_FILES)
                  if (run_dir / name).is_file()})
    return files


def holds_record_of(record_dir: Path, run_dir: Path) -> bool:
    """Whether `record_dir` already holds exactly the record `run_dir` would make."""
    existing = {p.relative_to(record_dir).as_posix() for p in record_dir.rglob("*") if p.is_file()}
    files = record_files(run_dir)
    return existing == set(files) and all((record_dir / n).read_bytes() == b for n, b in files.items())


def write_record(run_dir: Path, record_dir: Path) -> Path:
    """The record of one run, made in a temp dir beside `record_dir` and renamed into place, so a
    record is whole or absent; an existing record there is swapped out only after the new one is
    complete."""
    record_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=record_dir.parent, prefix=f".{record_dir.name}."))
    try:
        for name, data in record_files(run_dir).items():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            (staging / name).write_bytes(data)
        os.chmod(staging, 0o755)  # mkdtemp makes it private; a record is read like any file
        if record_dir.exists():
            old = Path(tempfile.mkdtemp(dir=record_dir.parent, prefix=f".{record_dir.name}.old."))
            os.replace(record_dir, old / "record")
            os.replace(staging, record_dir)
            shutil.rmtree(old)
        else:
            os.replace(staging, record_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return record_dir


def record_runs(sources: list[Path], into: Path, replace: bool = False, skip_unfinished: bool = False) -> list[Path]:
    """Record every finished run under `sources` into `into`; see plan_records for the checks."""
    return [write_record(p.run_dir, p.record_dir) for p in plan_records(sources, into, replace, skip_unfinished)]
