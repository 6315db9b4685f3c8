"""Checkpoints: each rank writes its own shard, and any (DP, TP) layout resumes any other.

A checkpoint is a directory <run_dir>/checkpoints/step_<N>/ written with
torch.distributed.checkpoint (DCP): every logical tensor (a parameter as a single process
holds it, TP shards joined and vocabulary padding dropped; its optimizer state; the MoE
expert biases) is stored as the chunks the ranks hold, each written once by one rank (see
trainer/checkpoint_shards.py). On load every rank reads the parts it needs for its own
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
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from data.atomic import atomic_output
from parallel.comm import all_gather_object, all_reduce, barrier, broadcast_object, group_rank, group_size, world
from parallel.tp_ops import gather_from_tp
from trainer.checkpoint_shards import ChunkLoadPlanner, Chunks, ChunkSavePlanner, TPPlacement, pieces_of

log = logging.getLogger("checkpoint")
# DCP warns on every single-process save and load that it assumes a single process: that is
# exactly what no_dist=True asks for.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
FORMAT_VERSION = 1  # the single-file format
SHARDED_FORMAT = 2
META_FILE = "trainer.json"
MANIFEST_FILE = "manifest.sha256"
HASH_CHUNK_BYTES = 8 << 20
CORRUPT_SUFFIX = ".corrupt"
STEP_NAME = re.compile(r"^step_(\d+)(\.pt)?$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, with the file it concerns."""


def to_logical(local: torch.Tensor, split_dim: Optional[int], rows: int, tp_group) -> torch.Tensor:
    """The full tensor of a TP-local shard (padding rows past `rows` dropped)."""
    if split_dim is None or group_size(tp_group) == 1:
        return local.detach().clone()
    full = gather_from_tp(local.detach().contiguous(), split_dim, tp_group)
    return full[:rows] if split_dim == 0 else full


def to_local(full: torch.Tensor, like: torch.Tensor, split_dim: Optional[int], tp_group) -> torch.Tensor:
    """This rank's TP shard of a full tensor, zero-padding rows as the local layout needs."""
    # Checkpoints load onto the CPU; the shard goes to the device of the tensor it replaces
    # (optimizer state installed on the CPU would fail the first GPU step).
    full = full.to(like.device)
    tp = group_size(tp_group)
    if split_dim is None or tp == 1:
        return full.to(like.dtype)
    if split_dim == 0 and full.shape[0] < like.shape[0] * tp:
        pad = full.new_zeros(like.shape[0] * tp - full.shape[0], *full.shape[1:])
        full = torch.cat([full, pad])
    return full.chunk(tp, dim=split_dim)[group_rank(tp_group)].to(like.dtype).contiguous()


def _rng_state(device: torch.device) -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    # Only the GPU this rank trains on: touching every visible GPU would start a CUDA context
    # on each of them from every rank, even for a run on the CPU.
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if device.type != "cuda" or cuda is None:
        return
    if isinstance(cuda, list):  # older checkpoints hold every visible GPU's state
        index = device.index or 0
        if index >= len(cuda):
            return
        cuda = cuda[index]
    torch.cuda.set_rng_state(cuda, device)


def logical_state(trainer) -> dict[str, Any]:
    """The trainer's whole state as full logical tensors, as the single-file format holds it.
    Collective: every rank calls it."""
    model, mesh = trainer.model, trainer.mesh
    logical_rows = {n: _logical_rows(trainer, n, p) for n, p in model.named_parameters()}
    params = {n: to_logical(p, getattr(p, "tp_split_dim", None), logical_rows[n], mesh.tp_group)
              for n, p in model.named_parameters()}
    names = set(params)
    buffers = {k: v.detach().clone() for k, v in model.state_dict().items() if k not in names}
    optim = {
        name: {key: to_logical(t, getattr(param, "tp_split_dim", None), logical_rows[name], mesh.tp_group)
               if t.ndim > 0 else t.clone() for key, t in state.items()}
        for name, (param, state) in trainer.optimizer.local_state(model).items()
    }
    rng = all_gather_object(_rng_state(trainer.device), world(), "checkpoint")
    return {"format": FORMAT_VERSION, "step": trainer.step, "tokens": trainer.tokens,
            "skipped_steps": trainer.skipped_steps, "params": params, "buffers": buffers,
            "optim": optim, "rng": rng, "mesh": {"dp": mesh.dp, "tp": mesh.tp}}


def _logical_rows(trainer, name: str, param: torch.Tensor) -> int:
    if name in ("embed.weight", "head.weight"):
        return trainer.model_cfg.vocab_size  # TP pads these rows; the padding is not saved
    split = getattr(param, "tp_split_dim", None)
    return param.shape[0] * (group_size(trainer.mesh.tp_group) if split == 0 else 1)


def state_is_finite(trainer) -> bool:
    """Whether every weight and optimizer-state tensor on every rank is finite. Collective.

    Checked before each save: a checkpoint of NaN weights is one that resume=auto would
    continue from, and that rotation would keep in place of the good ones."""
    tensors = [*trainer.model.parameters(), *trainer.optimizer.state_tensors()]
    # (AdamW's step counts may live on the CPU while the weights are on the GPU.)
    finite = torch.stack([torch.isfinite(t).all().to(trainer.device)
                          for t in tensors if t.is_floating_point()]).all()
    flag = finite.to(dtype=torch.float32).reshape(1)
    all_reduce(flag, world(), op=dist.ReduceOp.MIN, label="checkpoint")
    return bool(flag.item())


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


def file_digest(path: Path) -> str:
    """sha256 of a file, read in chunks: checkpoint files can be larger than memory."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_json(state: dict[str, Any]) -> dict[str, Any]:
    """One rank's RNG states as plain JSON (checkpoints load without unpickling)."""
    version, internal, gauss = state["python"]
    name, keys, pos, has_gauss, cached = state["numpy"]
    out = {"python": [version, list(internal), gauss],
           "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
           "torch": state["torch"].tolist()}
    if "cuda" in state:
        out["cuda"] = state["cuda"].tolist()
    return out


def _rng_from_json(obj: dict[str, Any]) -> dict[str, Any]:
    version, internal, gauss = obj["python"]
    name, keys, pos, has_gauss, cached = obj["numpy"]
    state = {"python": (version, tuple(internal), gauss),
             "numpy": (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached),
             "torch": torch.tensor(obj["torch"], dtype=torch.uint8)}
    if "cuda" in obj:
        state["cuda"] = torch.tensor(obj["cuda"], dtype=torch.uint8)
    return state


def _placements(trainer) -> dict[str, TPPlacement]:
    tp_rank = group_rank(trainer.mesh.tp_group)
    return {n: TPPlacement(getattr(p, "tp_split_dim", None), tp_rank, _logical_rows(trainer, n, p))
            for n, p in trainer.model.named_parameters()}


def _state_key(name: str, key: str) -> str:
    return f"optim/{name}/{key}"


def model_chunks(trainer) -> dict[str, Chunks]:
    """This rank's pieces of every parameter and persistent buffer, as views of the live
    tensors: what a save writes from, and what a load fills in place."""
    model = trainer.model
    tp = group_size(trainer.mesh.tp_group)
    params = dict(model.named_parameters())
    placements = _placements(trainer)
    out: dict[str, Chunks] = {}
    for name, p in params.items():
        placement = placements[name]
        out[f"model/{name}"] = Chunks(placement.logical_shape(tuple(p.shape), tp),
                                      pieces_of(p.detach(), tuple(p.shape), 0, placement))
    for name, buf in model.state_dict().items():
        if name not in params:  # persistent buffers (MoE expert biases), the same on every rank
            out[f"buffer/{name}"] = Chunks(tuple(buf.shape), [((0,) * buf.ndim, buf.detach())])
    return out


def sharded_state(trainer) -> dict[str, Chunks]:
    """This rank's pieces of every logical tensor, as views of the live tensors. DP replicas
    offer the same pieces; DCP writes each once."""
    model = trainer.model
    tp = group_size(trainer.mesh.tp_group)
    params = dict(model.named_parameters())
    placements = _placements(trainer)
    out = model_chunks(trainer)
    for piece in trainer.optimizer.owned_pieces(model):
        p, placement = params[piece.name], placements[piece.name]
        for key, value in trainer.optimizer.checkpoint_state(piece.optimizer, piece.tensor).items():
            if value.ndim == 0:  # AdamW's step count: every owner of the parameter holds the same
                out[_state_key(piece.name, key)] = Chunks((), [((), value.detach())])
                continue
            chunks = out.setdefault(_state_key(piece.name, key),
                                    Chunks(placement.logical_shape(tuple(p.shape), tp), []))
            chunks.pieces += pieces_of(value.detach(), tuple(p.shape), piece.start, placement)
    return out


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


def _process_group(mesh):
    """DCP's plans and metadata travel over the host (gloo) group where there is one, else
    over the default group (None in a single process)."""
    return mesh.host_group if mesh.host_group is not None else world()


def save(trainer, directory: Path, keep: int, config: dict[str, Any], good: bool = False,
         background: bool = False, async_group=None) -> PendingSave:
    """Start writing a checkpoint of the current step; every rank must call, then call
    `commit_pending` (at once, or before the next save and at the end when `background`).
    `background`: DCP copies the tensors to host memory and writes them from a thread while
    training goes on; its collectives use `async_group`, a gloo group of their own, so they
    never interleave with training's. `good`: its weights are already known to be good (see
    `last_good`)."""
    import torch.distributed.checkpoint as dcp

    mesh = trainer.mesh
    name = checkpoint_path(directory, trainer.step).name
    partial, final = directory / f".{name}.partial", directory / name
    if mesh.is_main:
        shutil.rmtree(partial, ignore_errors=True)  # left by a save that died
        partial.mkdir(parents=True)
    rng = all_gather_object(_rng_json(_rng_state(trainer.device)), _process_group(mesh), "checkpoint")
    if mesh.is_main:
        meta = {"format": SHARDED_FORMAT, "step": trainer.step, "tokens": trainer.tokens,
                "skipped_steps": trainer.skipped_steps, "mesh": {"dp": mesh.dp, "tp": mesh.tp},
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
                 process_group=_process_group(mesh), no_dist=no_dist)
        future = None
    return PendingSave(partial, final, trainer.step, good, keep, future)


def commit_pending(pending: PendingSave, mesh) -> Path:
    """Wait for the files, hash them (each rank its own), write the manifest, rename the
    checkpoint into place, point `latest` (and `last_good`) at it, rotate. Every rank calls."""
    if pending.future is not None:
        pending.future.result()
    mine = sorted(pending.partial.glob(f"__{mesh.rank}_*"))
    if mesh.is_main:
        mine += [pending.partial / ".metadata", pending.partial / META_FILE]
    digests = {p.name: file_digest(p) for p in mine}
    gathered = all_gather_object(digests, _process_group(mesh), "checkpoint")
    if mesh.is_main:
        everything = {k: v for d in gathered for k, v in d.items()}
        on_disk = {p.name for p in pending.partial.iterdir()} - {MANIFEST_FILE}
        if set(everything) != on_disk:
            raise CheckpointError(f"{pending.partial}: files without a digest: {sorted(on_disk - set(everything))}")
        with atomic_output(pending.partial / MANIFEST_FILE) as f:
            f.write("".join(f"{d}  {n}\n" for n, d in sorted(everything.items())).encode())
        directory = pending.final.parent
        if pending.final.exists():  # the same step saved again (a resumed run re-reaching it)
            shutil.rmtree(pending.final)
        os.replace(pending.partial, pending.final)
        _fsync_dir(directory)
        with atomic_output(directory / "latest") as f:
            f.write(pending.final.name.encode())
        if pending.good:
            mark_good(directory, pending.step)
        rotate(directory, pending.keep)
        log.info("saved checkpoint %s", pending.final)
    barrier(_process_group(mesh), "checkpoint")  # no rank reads it before it is in place
    return pending.final


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


def _verify_sharded(path: Path, share: tuple[int, int] = (0, 1)) -> None:
    """Check the manifest and the digests of this rank's share of the files (rank, world)."""
    manifest = path / MANIFEST_FILE
    if not (path / META_FILE).exists():
        raise CheckpointError(f"{path}: no {META_FILE} (not a checkpoint, or an incomplete one)")
    if not manifest.exists():
        raise CheckpointError(f"{path}: its manifest {MANIFEST_FILE} is missing (incomplete checkpoint)")
    listed = {}
    for line in manifest.read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        listed[name] = digest
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


def set_aside(path: Path) -> list[Path]:
    """Rename an unusable checkpoint (and a single file's manifest) to *.corrupt, never over
    an earlier one, so that a run writing the same step again cannot overwrite them."""
    moved = []
    for file in (path, path.with_suffix(".sha256")) if path.suffix == ".pt" else (path,):
        if not file.exists():
            continue
        target = file.with_name(file.name + CORRUPT_SUFFIX)
        n = 1
        while target.exists():
            target = file.with_name(f"{file.name}{CORRUPT_SUFFIX}.{n}")
            n += 1
        file.rename(target)
        moved.append(target)
    return moved


def find_resume(resume: str, directory: Path, mesh=None) -> Optional[dict[str, Any]]:
    """`none`: start fresh. A path: that checkpoint (errors are fatal). `auto`: the newest
    checkpoint in `directory` that verifies, falling back to older ones (and saying so).

    Collective when `mesh` has several ranks: the ranks share the hashing of a sharded
    checkpoint's files and agree on the verdict. Under `auto`, rank 0 renames unusable
    checkpoints to *.corrupt. When checkpoints exist but none is usable, CheckpointError lists
    them with their reasons: starting from scratch over a run's checkpoints is for the user to
    choose (checkpoint.resume=none), not something to do after a warning."""
    if resume == "none":
        return None
    rank, world = (mesh.rank, mesh.world_size) if mesh is not None else (0, 1)
    group = _process_group(mesh) if mesh is not None else None

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
        state, problem = verdict(Path(resume))
        if problem:
            raise CheckpointError(problem)
        return state
    candidates = checkpoints_in(directory)
    latest = directory / "latest"
    if latest.exists():
        named = directory / latest.read_text().strip()
        candidates = [named] + [c for c in candidates if c != named]
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


def restore(trainer, state: dict[str, Any]) -> None:
    """Load a checkpoint (from `find_resume`) into a trainer of any (DP, TP) layout."""
    model, mesh = trainer.model, trainer.mesh
    where = state.get("path", "checkpoint")
    saved_optim = state.get("config", {}).get("optim", {}).get("name")
    if saved_optim is not None and saved_optim != trainer.cfg.optim.name:
        raise CheckpointError(
            f"{where}: trained with optim={saved_optim}, but this run has optim={trainer.cfg.optim.name}; "
            f"resume it with optim={saved_optim}, or start optim={trainer.cfg.optim.name} in a new run dir "
            "(or with checkpoint.resume=none)"
        )
    params = dict(model.named_parameters())
    expected = {n: (_logical_rows(trainer, n, p),) + tuple(_full_tail(p, mesh)) for n, p in params.items()}
    if state.get("sharded"):
        _restore_sharded(trainer, state, expected)
    else:
        _restore_file(trainer, state, expected)
    trainer.step = state["step"]
    # Checkpoints from before these were saved: the best estimate is what was logged then.
    trainer.tokens = state.get("tokens", trainer.step * trainer.tokens_per_step)
    trainer.skipped_steps = state.get("skipped_steps", 0)
    same_world = len(state["rng"]) == mesh.world_size
    rng = state["rng"][mesh.rank if same_world else 0]
    _set_rng_state(_rng_from_json(rng) if state.get("sharded") else rng, trainer.device)


def _check_fits(trainer, expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]],
                buffers: set[str]) -> None:
    differing = sorted(n for n in set(expected) | set(found) if expected.get(n) != found.get(n))
    if differing:
        details = ", ".join(f"{n}: checkpoint {found.get(n)} vs model {expected.get(n)}" for n in differing[:8])
        raise CheckpointError(f"checkpoint does not fit this model; differing keys: {details}")
    names = dict(trainer.model.named_parameters())
    mine = {k for k in trainer.model.state_dict() if k not in names}
    if mine != buffers:
        raise CheckpointError(f"checkpoint buffers differ: {sorted(mine ^ buffers)}")


def _restore_sharded(trainer, state: dict[str, Any], expected: dict[str, tuple[int, ...]]) -> None:
    """Every rank reads, straight into its parameters and fresh optimizer state, the parts of
    the stored chunks that its own layout holds."""
    import torch.distributed.checkpoint as dcp

    model, mesh = trainer.model, trainer.mesh
    path = state["path"]
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    found = {k[len("model/"):]: tuple(md.size) for k, md in metadata.items() if k.startswith("model/")}
    buffers = {k[len("buffer/"):] for k in metadata if k.startswith("buffer/")}
    _check_fits(trainer, expected, found, buffers)
    params = dict(model.named_parameters())
    placements = _placements(trainer)
    with torch.no_grad():
        for p in params.values():
            p.zero_()  # the vocabulary padding rows, which the checkpoint does not hold
    targets = model_chunks(trainer)
    # Fresh optimizer state for what this rank owns now, filled by the load.
    installs = []
    for piece in trainer.optimizer.owned_pieces(model):
        p, placement = params[piece.name], placements[piece.name]
        prefix = f"optim/{piece.name}/"
        entry = {}
        for key in (k[len(prefix):] for k in metadata if k.startswith(prefix) and "/" not in k[len(prefix):]):
            md = metadata[prefix + key]
            if len(md.size) == 0:
                entry[key] = torch.zeros((), dtype=md.properties.dtype)
                targets[prefix + key] = Chunks((), [((), entry[key])])
                continue
            entry[key] = torch.zeros(piece.tensor.numel(), dtype=md.properties.dtype, device=p.device)
            chunks = targets.setdefault(prefix + key, Chunks(tuple(md.size), []))
            chunks.pieces += pieces_of(entry[key], tuple(p.shape), piece.start, placement)
        installs.append((piece, entry))
    dcp.load(targets, storage_reader=dcp.FileSystemReader(path), planner=ChunkLoadPlanner(),
             process_group=_process_group(mesh), no_dist=mesh.world_size == 1)
    for piece, entry in installs:
        if entry:
            trainer.optimizer.install_checkpoint_state(
                piece.optimizer, piece.tensor, {k: v if v.ndim == 0 else v.view(piece.tensor.shape) for k, v in entry.items()})


def _restore_file(trainer, state: dict[str, Any], expected: dict[str, tuple[int, ...]]) -> None:
    """A single-file checkpoint: full logical tensors, cut to this rank's layout."""
    model, mesh = trainer.model, trainer.mesh
    params = dict(model.named_parameters())
    _check_fits(trainer, expected, {n: tuple(t.shape) for n, t in state["params"].items()}, set(state["buffers"]))
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(to_local(state["params"][n], p, getattr(p, "tp_split_dim", None), mesh.tp_group))
        for k, v in state["buffers"].items():
            model.get_buffer(k).copy_(v)
    local = {
        name: {k: to_local(v, params[name], getattr(params[name], "tp_split_dim", None), mesh.tp_group)
               if v.ndim > 0 else v.clone() for k, v in entry.items()}
        for name, entry in state["optim"].items()
    }
    trainer.optimizer.load_local_state(model, local)


def _full_tail(param: torch.Tensor, mesh) -> list[int]:
    """The logical shape of `param` past dim 0 (TP splits along dim 1 or 2 undone)."""
    shape = list(param.shape)
    dim = getattr(param, "tp_split_dim", None)
    if dim is not None and dim > 0:
        shape[dim] *= group_size(mesh.tp_group)
    return shape[1:]
