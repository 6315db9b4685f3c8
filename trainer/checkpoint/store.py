"""Checkpoints: each rank writes its own shard, and any (DP, TP) layout resumes any other.

A checkpoint is a directory <run_dir>/checkpoints/step_<N>/ written with
torch.distributed.checkpoint (DCP): every logical tensor (a parameter as a single process
holds it, TP shards joined and vocabulary padding dropped; its optimizer state; the MoE
expert biases) is stored as the chunks the ranks hold, each written once by one rank (see
trainer/checkpoint/shards.py). On load every rank reads the parts it needs for its own
layout: DCP reshards. Next to the DCP files: trainer.json (step, token and skipped-step
counts, every rank's RNG states, the resolved config; plain JSON, no pickle) and
manifest.sha256 (every file's digest, each rank hashing what it wrote, in chunks).

A save goes to a hidden .step_<N>.partial/ directory that is renamed only once complete, so
a checkpoint directory is complete or absent; the `latest` pointer is written last. A
`last_good` pointer names the newest checkpoint whose weights went on to train (a finite
eval on them, or a finite next step); rotation never deletes it, so up to keep + 1
checkpoints may be on disk. A checkpoint that fails to verify is renamed to *.corrupt, never
overwritten or deleted. checkpoint.async_save writes in the background while training goes on.

Single-file checkpoints from earlier versions (step_<N>.pt with a .sha256 manifest, full
logical tensors gathered on rank 0) still load, at any layout.

This module saves and finds checkpoints across ranks. The rest, by responsibility:
trainer/checkpoint/files.py (the directory on disk: names, pointers, digests, verification,
rotation, reading one whole), trainer/checkpoint/state.py (what a checkpoint holds and the
restore into a trainer) and trainer/checkpoint/shards.py (DCP's chunks and planners).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from data.atomic import atomic_output
from parallel.comm import all_gather_object, barrier, broadcast_object
from trainer.checkpoint.files import (
    CORRUPT_SUFFIX, MANIFEST_FILE, META_FILE, SHARDED_FORMAT, CheckpointError, checkpoint_path, checkpoints_in,
    SUSPECT_FILE, file_digest, fsync_dir, mark_good, open_checkpoint, refuse_suspect, rotate, set_aside,
    set_suspect, suspects,
)
from trainer.checkpoint.shards import ChunkSavePlanner
from trainer.checkpoint.state import mesh_record, process_group, rng_json, rng_state, sharded_state

log = logging.getLogger("checkpoint")
# DCP warns on every single-process save and load that it assumes a single process: that is
# exactly what no_dist=True asks for.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


@dataclass
class PendingSave:
    """A save whose files may still be being written (checkpoint.async_save): committed, that
    is hashed, renamed into place and pointed to, by `commit_pending` on every rank."""

    partial: Path
    final: Path
    step: int
    good: bool
    keep: int
    future: Optional[Future]
    suspect: Optional[str] = None  # why its weights are not known to be good (None: they may be)


def save(trainer, directory: Path, keep: int, config: dict[str, Any], good: bool = False,
         background: bool = False, async_group=None, suspect: Optional[str] = None) -> PendingSave:
    """Start writing a checkpoint of the current step; every rank must call, then call
    `commit_pending` (at once, or before the next save and at the end when `background`).
    `background`: DCP copies the tensors to host memory and writes them from a thread while
    training goes on; its collectives use `async_group`, a gloo group of their own, so they
    never interleave with training's. `good`: its weights are already known to be good (see
    `last_good`). `suspect`: why they are not (see checkpoint_files.SUSPECT_FILE)."""
    import torch.distributed.checkpoint as dcp

    mesh = trainer.mesh
    name = checkpoint_path(directory, trainer.step).name
    partial, final = directory / f".{name}.partial", directory / name
    if mesh.is_main:
        shutil.rmtree(partial, ignore_errors=True)  # left by a save that died
        partial.mkdir(parents=True)
    rng = all_gather_object(rng_json(rng_state(trainer.device)), process_group(mesh), "checkpoint")
    if mesh.is_main:
        meta = {"format": SHARDED_FORMAT, "step": trainer.step, "tokens": trainer.tokens,
                "skipped_steps": trainer.skipped_steps, "mesh": mesh_record(mesh),
                "rng": rng, "config": config}
        with atomic_output(partial / META_FILE) as f:  # fsynced, like the tensor files
            f.write(json.dumps(meta).encode())
    state = sharded_state(trainer)
    writer = dcp.FileSystemWriter(str(partial), sync_files=True)
    no_dist = mesh.world_size == 1
    if background:
        future = dcp.async_save(state, storage_writer=writer, planner=ChunkSavePlanner(),
                                process_group=async_group, no_dist=no_dist)
        future = getattr(future, "upload_completion", future)  # AsyncSaveResponse or a Future
    else:
        dcp.save(state, storage_writer=writer, planner=ChunkSavePlanner(),
                 process_group=process_group(mesh), no_dist=no_dist)
        future = None
    return PendingSave(partial, final, trainer.step, good and suspect is None, keep, future, suspect)


def commit_pending(pending: PendingSave, mesh) -> Path:
    """Wait for the files, hash them (each rank its own), write the manifest, rename the
    checkpoint into place, point `latest` (and `last_good`) at it, rotate. Every rank calls."""
    if pending.future is not None:
        pending.future.result()
    mine = sorted(pending.partial.glob(f"__{mesh.rank}_*"))
    if mesh.is_main:
        mine += [pending.partial / ".metadata", pending.partial / META_FILE]
    digests = {p.name: file_digest(p) for p in mine}
    gathered = all_gather_object(digests, process_group(mesh), "checkpoint")
    if mesh.is_main:
        everything = {k: v for d in gathered for k, v in d.items()}
        on_disk = {p.name for p in pending.partial.iterdir()} - {MANIFEST_FILE}
        if set(everything) != on_disk:
            raise CheckpointError(f"{pending.partial}: files without a digest: {sorted(on_disk - set(everything))}")
        with atomic_output(pending.partial / MANIFEST_FILE) as f:
            f.write("".join(f"{d}  {n}\n" for n, d in sorted(everything.items())).encode())
        directory = pending.final.parent
        # Before the rename: a crash in between leaves a good checkpoint listed, never a
        # suspect one unlisted.
        set_suspect(directory, pending.final.name, pending.suspect)
        if pending.final.exists():  # the same step saved again (a resumed run re-reaching it)
            shutil.rmtree(pending.final)
        os.replace(pending.partial, pending.final)
        fsync_dir(directory)
        with atomic_output(directory / "latest") as f:
            f.write(pending.final.name.encode())
        if pending.good:
            mark_good(directory, pending.step)
        rotate(directory, pending.keep)
        log.info("saved checkpoint %s", pending.final)
    barrier(process_group(mesh), "checkpoint")  # no rank reads it before it is in place
    return pending.final


def find_resume(resume: str, directory: Path, mesh=None, allow_suspect: bool = False) -> Optional[dict[str, Any]]:
    """`none`: start fresh. A path: that checkpoint (errors are fatal). `auto`: the newest
    checkpoint in `directory` that verifies, falling back to older ones (and saying so).
    Suspect checkpoints (checkpoint_files.SUSPECT_FILE) are passed over by `auto` and refused
    as a path, unless `allow_suspect`: after a divergence stop, `auto` resumes from `last_good`.

    Collective when `mesh` has several ranks: the ranks share the hashing of a sharded
    checkpoint's files and agree on the verdict. Under `auto`, rank 0 renames unusable
    checkpoints to *.corrupt. When checkpoints exist but none is usable, CheckpointError lists
    them with their reasons: starting from scratch over a run's checkpoints is for the user to
    choose (checkpoint.resume=none), not something to do after a warning."""
    if resume == "none":
        return None
    rank, world = (mesh.rank, mesh.world_size) if mesh is not None else (0, 1)
    group = process_group(mesh) if mesh is not None else None

    def verdict(path: Path) -> tuple[Optional[dict[str, Any]], Optional[str]]:
        try:
            state, problem = open_checkpoint(path, (rank, world)), None
        except CheckpointError as err:
            state, problem = None, str(err)
        if world > 1:  # one rank's failed share fails the checkpoint for all
            problems = all_gather_object(problem, group, "checkpoint")
            problem = next((p for p in problems if p is not None), None)
        return (None if problem else state), problem

    if resume != "auto":
        if not allow_suspect:
            refuse_suspect(Path(resume), "checkpoint.allow_suspect=true")
        state, problem = verdict(Path(resume))
        if problem:
            raise CheckpointError(problem)
        return state
    candidates = checkpoints_in(directory)
    latest = directory / "latest"
    if latest.exists() and (directory / latest.read_text().strip()) in candidates:
        named = directory / latest.read_text().strip()
        candidates = [named] + [c for c in candidates if c != named]
    if not allow_suspect:
        listed = suspects(directory)
        passed = [c for c in candidates if c.name in listed]
        candidates = [c for c in candidates if c.name not in listed]
        if passed and not candidates:
            named = "; ".join(f"{c.name} ({listed[c.name]})" for c in passed)
            raise CheckpointError(
                f"no checkpoint in {directory} is known good: {named}. Resume from one anyway with "
                "checkpoint.resume=PATH checkpoint.allow_suspect=true, or start fresh with checkpoint.resume=none"
            )
        if passed and rank == 0:
            log.warning("passing over suspect checkpoint(s) %s (see %s); resuming from the newest good one",
                        ", ".join(c.name for c in passed), SUSPECT_FILE)
    earlier = sorted(p.name for p in directory.glob(f"step_*{CORRUPT_SUFFIX}*") if not p.name.endswith(".sha256" + CORRUPT_SUFFIX))
    if world > 1:  # every rank walks the same list, whatever rank 0 renames meanwhile
        candidates, earlier = broadcast_object([candidates, earlier], 0, group, "checkpoint")
    unusable = []
    for path in candidates:
        state, problem = verdict(path)
        if problem is not None:
            unusable.append(problem)
            if rank == 0:
                moved = set_aside(path)
                log.warning("skipping unusable checkpoint %s; kept as %s", problem,
                            ", ".join(m.name for m in moved) or "-")
            continue
        if unusable:
            log.warning("resuming from %s, the newest usable checkpoint", path.name)
        return state
    unusable += [f"{name} (set aside by an earlier start)" for name in earlier]
    if unusable:
        raise CheckpointError(
            f"no usable checkpoint in {directory}: {'; '.join(unusable)}. The files are kept as *{CORRUPT_SUFFIX}; "
            "start fresh with checkpoint.resume=none, or pick one with checkpoint.resume=PATH"
        )
    return None
