"""Checkpoints in a layout-independent form: save at one (DP, TP), resume at any other.

A checkpoint holds full logical tensors, as a single-process run would have them: every
parameter (TP shards gathered, vocabulary padding dropped), every persistent buffer (MoE
expert biases), and the optimizer state per parameter (Muon momentum; AdamW moments and
step), assembled from the ZeRO-1 shards. Plus step, token and skipped-step counts, RNG
states of every rank and the resolved config. The data loader needs only the step (its
batches are a function of seed and step) and the schedule is a function of the step too.

Files: <run_dir>/checkpoints/step_<N>.pt, each with a <name>.sha256 manifest, and a
`latest` pointer written last. Every file is written atomically (temp name, fsync, rename),
so a crash at any moment leaves the previous checkpoint intact. A `last_good` pointer names
the newest checkpoint whose weights went on to train (a finite eval on them, or a finite next
step); rotation never deletes it, so up to keep + 1 checkpoints may be on disk. A checkpoint that fails to load is renamed to *.corrupt, never
overwritten or deleted: what it held may still be recoverable by hand.
"""
from __future__ import annotations

import hashlib
import logging
import random
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from data.atomic import atomic_output
from model.comm import group_rank, group_size
from model.tp_ops import gather_from_tp

log = logging.getLogger("checkpoint")
FORMAT_VERSION = 1


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
    """The trainer's whole state as full logical tensors. Collective: every rank calls it."""
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
    rng = [None] * mesh.world_size
    if mesh.world_size > 1:
        dist.all_gather_object(rng, _rng_state(trainer.device))
    else:
        rng = [_rng_state(trainer.device)]
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
    if trainer.mesh.world_size > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def last_good(directory: Path) -> Optional[Path]:
    """The checkpoint that the `last_good` pointer names, if it is still there."""
    pointer = directory / "last_good"
    if not pointer.exists():
        return None
    path = directory / pointer.read_text().strip()
    return path if path.exists() else None


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"step_{step:08d}.pt"


def mark_good(directory: Path, step: int) -> None:
    """Point `last_good` at the checkpoint of `step` (rank 0 only)."""
    with atomic_output(directory / "last_good") as f:
        f.write(checkpoint_path(directory, step).name.encode())


def save(trainer, directory: Path, keep: int, config: dict[str, Any], good: bool = False) -> Optional[Path]:
    """Write a checkpoint of the current step (rank 0 writes; every rank must call). `good`:
    its weights are already known to be good (see `last_good`)."""
    state = logical_state(trainer)
    if not trainer.mesh.is_main:
        return None
    state["config"] = config
    path = checkpoint_path(directory, trainer.step)
    with atomic_output(path) as f:
        torch.save(state, f)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    with atomic_output(path.with_suffix(".sha256")) as f:
        f.write(f"{digest}  {path.name}\n".encode())
    with atomic_output(directory / "latest") as f:
        f.write(path.name.encode())
    if good:
        mark_good(directory, trainer.step)
    protected = last_good(directory)
    for old in sorted(directory.glob("step_*.pt"))[:-keep] if keep > 0 else []:
        if old == protected:
            continue  # the one to go back to if the newer ones come from a diverging run
        old.unlink()
        old.with_suffix(".sha256").unlink(missing_ok=True)
    log.info("saved checkpoint %s", path)
    return path


def load(path: Path) -> dict[str, Any]:
    """Read and verify a checkpoint; CheckpointError names the file when it is unusable."""
    manifest = path.with_suffix(".sha256")
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint")
    if not manifest.exists():
        raise CheckpointError(f"{path}: its manifest {manifest.name} is missing (incomplete checkpoint)")
    expected = manifest.read_text().split()[0]
    if hashlib.sha256(path.read_bytes()).hexdigest() != expected:
        raise CheckpointError(f"{path}: checksum does not match {manifest.name} (truncated or corrupted)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # a file that verifies but does not unpickle is still unusable
        raise CheckpointError(f"{path}: cannot be read ({err})") from err
    if state.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format {state.get('format')} is not {FORMAT_VERSION}")
    state["path"] = str(path)
    return state


CORRUPT_SUFFIX = ".corrupt"


def set_aside(path: Path) -> list[Path]:
    """Rename an unusable checkpoint and its manifest to *.corrupt (never over an earlier one),
    so that a run writing the same step again cannot overwrite them."""
    moved = []
    for file in (path, path.with_suffix(".sha256")):
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


def find_resume(resume: str, directory: Path, set_aside_unusable: bool = True) -> Optional[dict[str, Any]]:
    """`none`: start fresh. A path: that checkpoint (errors are fatal). `auto`: the newest
    checkpoint in `directory` that verifies, falling back to older ones (and saying so).

    Under `auto`, unusable checkpoints are renamed to *.corrupt (by the one rank that passes
    `set_aside_unusable`). When checkpoints exist but none is usable, CheckpointError lists
    them with their reasons: starting from scratch over a run's checkpoints is for the user
    to choose (checkpoint.resume=none), not something to do after a warning."""
    if resume == "none":
        return None
    if resume != "auto":
        return load(Path(resume))
    candidates = sorted(directory.glob("step_*.pt"), reverse=True)
    latest = directory / "latest"
    if latest.exists():
        named = directory / latest.read_text().strip()
        candidates = [named] + [c for c in candidates if c != named]
    earlier = sorted(p.name for p in directory.glob(f"step_*.pt{CORRUPT_SUFFIX}*"))
    unusable = []
    for path in candidates:
        try:
            state = load(path)
        except CheckpointError as err:
            unusable.append(str(err))
            if set_aside_unusable:
                moved = set_aside(path)
                log.warning("skipping unusable checkpoint %s; kept as %s", err, ", ".join(m.name for m in moved) or "-")
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
    """Load a logical checkpoint into a trainer of any (DP, TP) layout."""
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
    found = {n: tuple(t.shape) for n, t in state["params"].items()}
    differing = sorted(n for n in set(expected) | set(found) if expected.get(n) != found.get(n))
    if differing:
        details = ", ".join(f"{n}: checkpoint {found.get(n)} vs model {expected.get(n)}" for n in differing[:8])
        raise CheckpointError(f"checkpoint does not fit this model; differing keys: {details}")
    buffers = {k for k in model.state_dict() if k not in params}
    if buffers != set(state["buffers"]):
        raise CheckpointError(f"checkpoint buffers differ: {sorted(buffers ^ set(state['buffers']))}")
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
    trainer.step = state["step"]
    # Checkpoints from before these were saved: the best estimate is what was logged then.
    trainer.tokens = state.get("tokens", trainer.step * trainer.tokens_per_step)
    trainer.skipped_steps = state.get("skipped_steps", 0)
    same_world = len(state["rng"]) == mesh.world_size
    _set_rng_state(state["rng"][mesh.rank if same_world else 0], trainer.device)


def _full_tail(param: torch.Tensor, mesh) -> list[int]:
    """The logical shape of `param` past dim 0 (TP splits along dim 1 or 2 undone)."""
    shape = list(param.shape)
    dim = getattr(param, "tp_split_dim", None)
    if dim is not None and dim > 0:
        shape[dim] *= group_size(mesh.tp_group)
    return shape[1:]
