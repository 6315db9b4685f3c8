"""The checkpoint directory on disk: step names, the `latest` and `last_good` pointers, the
suspect list, manifests and digests, verification, rotation, setting aside, and reading a
checkpoint whole.

Nothing here knows a trainer: trainer/checkpoint/state.py turns a trainer into the tensors a
checkpoint holds and back, and trainer/checkpoint/store.py saves and finds them across ranks.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from data.atomic import atomic_output
from trainer.checkpoint.shards import ChunkLoadPlanner, Chunks


FORMAT_VERSION = 1  # the single-file format


SHARDED_FORMAT = 2


META_FILE = "trainer.json"


MANIFEST_FILE = "manifest.sha256"


HASH_CHUNK_BYTES = 8 << 20


CORRUPT_SUFFIX = ".corrupt"


# A checkpoint newer than the one a run resumed from in its own dir: the future of a timeline
# the run abandoned (after a divergence, what came after `last_good`). Set aside rather than
# deleted; left in place, rotation would keep it and delete the resumed run's own checkpoints.
ABANDONED_SUFFIX = ".abandoned"


# checkpoints/suspect.json: {checkpoint name: why its weights are not known to be good}. A
# checkpoint saved after a non-finite step (before a finite eval), one whose next step was
# non-finite, or one left unconfirmed by a divergence stop. Its weights are finite (no NaN is
# ever saved), but its forward pass may not be: resume=auto, export and sampling pass it over,
# and use it only when asked (checkpoint.allow_suspect, --allow-suspect).
SUSPECT_FILE = "suspect.json"


STEP_NAME = re.compile(r"^step_(\d+)(\.pt)?$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, with the file it concerns."""


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"step_{step:08d}"


def checkpoints_in(directory: Path) -> list[Path]:
    """The checkpoints in `directory` (sharded dirs and single files), newest first."""
    found = [p for p in directory.glob("step_*") if STEP_NAME.match(p.name)]
    return sorted(found, key=lambda p: (int(STEP_NAME.match(p.name).group(1)), p.is_dir()), reverse=True)


def is_sharded(path: Path) -> bool:
    return path.is_dir() and (path / META_FILE).exists()


def last_good(directory: Path) -> Optional[Path]:
    """The checkpoint that the `last_good` pointer names, if it is still there."""
    pointer = directory / "last_good"
    if not pointer.exists():
        return None
    path = directory / pointer.read_text().strip()
    return path if path.exists() else None


def mark_good(directory: Path, step: int) -> None:
    """Point `last_good` at the checkpoint of `step` (rank 0 only)."""
    with atomic_output(directory / "last_good") as f:
        f.write(checkpoint_path(directory, step).name.encode())


def step_of(path: Path) -> int:
    return int(STEP_NAME.match(path.name).group(1))


def suspects(directory: Path) -> dict[str, str]:
    """The suspect checkpoints of a checkpoints dir, with their reasons (see SUSPECT_FILE)."""
    file = directory / SUSPECT_FILE
    if not file.exists():
        return {}
    try:
        listed = json.loads(file.read_text())
    except ValueError as err:
        raise CheckpointError(f"{file}: cannot be read ({err})") from err
    return {str(k): str(v) for k, v in listed.items()} if isinstance(listed, dict) else {}


def set_suspect(directory: Path, name: str, reason: Optional[str]) -> None:
    """Record (reason) or clear (None) a checkpoint's suspicion (rank 0 only)."""
    listed = suspects(directory)
    if reason is None and name not in listed:
        return
    if reason is None:
        del listed[name]
    else:
        listed[name] = reason
    with atomic_output(directory / SUSPECT_FILE) as f:
        f.write(json.dumps(listed, indent=1, sort_keys=True).encode())


def suspicion(path: Path) -> Optional[str]:
    """Why the checkpoint at `path` is suspect, or None when it is not."""
    return suspects(path.parent).get(path.name)


def refuse_suspect(path: Path, allow: str) -> None:
    """A suspect checkpoint is used only when asked: `allow` names how to ask."""
    reason = suspicion(path)
    if reason is not None:
        raise CheckpointError(f"{path}: its weights are suspect ({reason}); use it anyway with {allow}, "
                              f"or take the last good one ({good_hint(path.parent)})")


def good_hint(directory: Path) -> str:
    good = last_good(directory)
    return str(good) if good is not None else f"none is known good in {directory}"


def newest_trusted(directory: Path) -> Optional[Path]:
    """The newest checkpoint of a checkpoints dir that is not suspect: after a divergence stop,
    the `last_good` one; after a preemption, the newest (`latest`)."""
    listed = suspects(directory)
    return next((p for p in checkpoints_in(directory) if p.name not in listed), None)


def resolve_checkpoint(path: Path, allow_suspect: bool, allow: str) -> Path:
    """The checkpoint that `path` (a checkpoint, a checkpoints/ dir or a run dir) names: for a
    directory, its newest checkpoint that is not suspect (after a divergence stop, `last_good`;
    with `allow_suspect`, `latest`). A suspect checkpoint named outright is refused unless
    `allow_suspect`; `allow` names how to ask for it (an option, a config key)."""
    if path.is_dir() and not is_sharded(path):
        directory = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        found = checkpoints_in(directory)
        latest = directory / "latest"
        if allow_suspect and latest.exists() and (directory / latest.read_text().strip()) in found:
            return directory / latest.read_text().strip()
        trusted = found[0] if allow_suspect and found else newest_trusted(directory)
        if trusted is None:
            raise CheckpointError(
                f"{path}: no checkpoint found in this directory" if not found else
                f"{directory}: no checkpoint is known good (all are listed in {SUSPECT_FILE}); "
                f"use the newest anyway with {allow}")
        return trusted
    if not allow_suspect:
        refuse_suspect(path, allow)
    return path  # open_checkpoint names a missing one itself


def read_saved_run(path: Path) -> dict[str, Any]:
    """What a checkpoint says of the run that saved it (its `config`, `step`, ...; empty for a
    single-file checkpoint, whose record is inside its tensors' pickle), after checking that
    its files are all there. Reads no tensor and hashes nothing, so it is cheap enough to
    refuse an unusable checkpoint at start-up; `open_checkpoint` verifies the digests."""
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint")
    if not path.is_dir():
        manifest = path.with_suffix(".sha256")
        if not manifest.exists():
            raise CheckpointError(f"{path}: its manifest {manifest.name} is missing (incomplete checkpoint)")
        return {}
    for name in sorted(_manifest(path)):
        if not (path / name).exists():
            raise CheckpointError(f"{path / name}: missing (the manifest lists it)")
    return _read_sharded_meta(path)


def file_digest(path: Path) -> str:
    """sha256 of a file, read in chunks: checkpoint files can be larger than memory."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rotate(directory: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints, never the `last_good` one."""
    protected = last_good(directory)
    for old in checkpoints_in(directory)[keep:] if keep > 0 else []:
        if old == protected:
            continue  # the one to go back to if the newer ones come from a diverging run
        if old.is_dir():
            shutil.rmtree(old)
        else:
            old.unlink()
            old.with_suffix(".sha256").unlink(missing_ok=True)
        set_suspect(directory, old.name, None)


def _manifest(path: Path) -> dict[str, str]:
    """A sharded checkpoint's files and their digests, as its manifest lists them."""
    manifest = path / MANIFEST_FILE
    if not (path / META_FILE).exists():
        raise CheckpointError(f"{path}: no {META_FILE} (not a checkpoint, or an incomplete one)")
    if not manifest.exists():
        raise CheckpointError(f"{path}: its manifest {MANIFEST_FILE} is missing (incomplete checkpoint)")
    listed = {}
    for line in manifest.read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        listed[name] = digest
    return listed


def _verify_sharded(path: Path, share: tuple[int, int] = (0, 1)) -> None:
    """Check the manifest and the digests of this rank's share of the files (rank, world)."""
    listed = _manifest(path)
    names = sorted(listed)
    rank, world = share
    for name in names[rank::world]:
        file = path / name
        if not file.exists():
            raise CheckpointError(f"{file}: missing (the manifest lists it)")
        if file_digest(file) != listed[name]:
            raise CheckpointError(f"{file}: checksum does not match {MANIFEST_FILE} (truncated or corrupted)")


def _read_sharded_meta(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads((path / META_FILE).read_text())
    except ValueError as err:
        raise CheckpointError(f"{path / META_FILE}: cannot be read ({err})") from err
    if meta.get("format") != SHARDED_FORMAT:
        raise CheckpointError(f"{path}: format {meta.get('format')} is not {SHARDED_FORMAT}")
    meta["path"] = str(path)
    meta["sharded"] = True
    return meta


def _load_file(path: Path) -> dict[str, Any]:
    """A single-file checkpoint (the format before sharded ones), verified."""
    manifest = path.with_suffix(".sha256")
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint")
    if not manifest.exists():
        raise CheckpointError(f"{path}: its manifest {manifest.name} is missing (incomplete checkpoint)")
    expected = manifest.read_text().split()[0]
    if file_digest(path) != expected:
        raise CheckpointError(f"{path}: checksum does not match {manifest.name} (truncated or corrupted)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # a file that verifies but does not unpickle is still unusable
        raise CheckpointError(f"{path}: cannot be read ({err})") from err
    if state.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format {state.get('format')} is not {FORMAT_VERSION}")
    state["path"] = str(path)
    return state


def open_checkpoint(path: Path, share: tuple[int, int] = (0, 1)) -> dict[str, Any]:
    """Verify a checkpoint (a sharded dir: this rank's share of its files) and read what it
    says of the run; the tensors of a sharded one are read by `restore` or `load`."""
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint")
    if path.is_dir():
        _verify_sharded(path, share)
        return _read_sharded_meta(path)
    return _load_file(path)


def load(path: Path) -> dict[str, Any]:
    """A whole checkpoint in one process, as full logical tensors: {"params", "buffers",
    "optim", "config", "step", ...}. For export and sampling."""
    state = open_checkpoint(path)
    if not state.get("sharded"):
        return state
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    full = {key: torch.empty(tuple(md.size), dtype=md.properties.dtype) for key, md in metadata.items()}
    dcp.load({k: Chunks(tuple(t.shape), [((0,) * t.ndim, t)]) for k, t in full.items()},
             storage_reader=dcp.FileSystemReader(str(path)), planner=ChunkLoadPlanner(), no_dist=True)
    state["params"] = {k[len("model/"):]: t for k, t in full.items() if k.startswith("model/")}
    state["buffers"] = {k[len("buffer/"):]: t for k, t in full.items() if k.startswith("buffer/")}
    state["optim"] = {}
    for k, t in full.items():
        if k.startswith("optim/"):
            name, key = k[len("optim/"):].rsplit("/", 1)
            state["optim"].setdefault(name, {})[key] = t
    return state


def set_aside(path: Path, suffix: str = CORRUPT_SUFFIX) -> list[Path]:
    """Rename an unusable checkpoint (and a single file's manifest) to *.corrupt (or `suffix`),
    never over an earlier one, so that a run writing the same step again cannot overwrite them;
    the `latest` and `last_good` pointers then name what is left (rank 0 only)."""
    moved = []
    for file in (path, path.with_suffix(".sha256")) if path.suffix == ".pt" else (path,):
        if not file.exists():
            continue
        target = file.with_name(file.name + suffix)
        n = 1
        while target.exists():
            target = file.with_name(f"{file.name}{suffix}.{n}")
            n += 1
        file.rename(target)
        moved.append(target)
    _repoint(path.parent, path.name)
    return moved


def _repoint(directory: Path, gone: str) -> None:
    """Neither pointer may name a checkpoint that was set aside: `latest` falls back to the
    newest one left, `last_good` to the newest one left before it that is not suspect (each
    of those was confirmed in its turn), or is removed."""
    left = checkpoints_in(directory)
    for name, fallback in (("latest", left[:1]),
                           ("last_good", [p for p in left if step_of(p) < step_of(directory / gone)
                                          and p.name not in suspects(directory)][:1])):
        pointer = directory / name
        if not pointer.exists() or pointer.read_text().strip() != gone:
            continue
        if fallback:
            with atomic_output(pointer) as f:
                f.write(fallback[0].name.encode())
        else:
            pointer.unlink()

