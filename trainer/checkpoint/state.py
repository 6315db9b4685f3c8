"""What a checkpoint holds, and how it goes back into a trainer: the logical tensors (TP shards
joined, vocabulary padding dropped), each rank's chunks of them for DCP, the RNG states, and the
restore into any (DP, TP) layout.
"""
from __future__ import annotations

import math
import random
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from parallel.fsdp import is_sharded, local_rows
from parallel.comm import all_gather_object, all_reduce, group_rank, group_size, world
from parallel.tp_ops import gather_from_tp
from trainer.checkpoint.files import FORMAT_VERSION, CheckpointError
from trainer.checkpoint.shards import ChunkLoadPlanner, Chunks, Placement, pieces_of


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


def rng_state(device: torch.device) -> dict[str, Any]:
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
    rng = all_gather_object(rng_state(trainer.device), world(), "checkpoint")
    return {"format": FORMAT_VERSION, "step": trainer.step, "tokens": trainer.tokens,
            "skipped_steps": trainer.skipped_steps, "params": params, "buffers": buffers,
            "optim": optim, "rng": rng, "mesh": mesh_record(mesh)}


def _logical_rows(trainer, name: str, param: torch.Tensor) -> int:
    if name in ("embed.weight", "head.weight"):
        return trainer.model_cfg.vocab_size  # TP pads these rows; the padding is not saved
    if getattr(param, "ep_split_dim", None) is not None:
        return param.shape[0] * trainer.mesh.ep  # the experts of every EP rank
    split = getattr(param, "tp_split_dim", None)
    return param.shape[0] * (group_size(trainer.mesh.tp_group) if split == 0 else 1)


def state_is_finite(trainer) -> bool:
    """Whether every weight and optimizer-state tensor on every rank is finite. Collective.

    Checked before each save: a checkpoint of NaN weights is one that resume=auto would
    continue from, and that rotation would keep in place of the good ones."""
    tensors = [*(local_rows(p.detach())[0] for p in trainer.model.parameters()), *trainer.optimizer.state_tensors()]
    # (AdamW's step counts may live on the CPU while the weights are on the GPU.)
    finite = torch.stack([torch.isfinite(t).all().to(trainer.device)
                          for t in tensors if t.is_floating_point()]).all()
    flag = finite.to(dtype=torch.float32).reshape(1)
    all_reduce(flag, world(), op=dist.ReduceOp.MIN, label="checkpoint")
    return bool(flag.item())


def rng_json(state: dict[str, Any]) -> dict[str, Any]:
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


def _placements(trainer) -> dict[str, Placement]:
    mesh = trainer.mesh
    tp_rank, tp = group_rank(mesh.tp_group), group_size(mesh.tp_group)
    out = {}
    for n, p in trainer.model.named_parameters():
        if getattr(p, "ep_split_dim", None) is not None:  # this rank's block of whole experts
            out[n] = Placement(p.ep_split_dim, mesh.ep_rank, _logical_rows(trainer, n, p), mesh.ep)
        else:
            out[n] = Placement(getattr(p, "tp_split_dim", None), tp_rank, _logical_rows(trainer, n, p), tp)
    return out


def _state_key(name: str, key: str) -> str:
    return f"optim/{name}/{key}"


def model_chunks(trainer) -> dict[str, Chunks]:
    """This rank's pieces of every parameter and persistent buffer, as views of the live
    tensors: what a save writes from, and what a load fills in place."""
    model = trainer.model
    params = dict(model.named_parameters())
    placements = _placements(trainer)
    out: dict[str, Chunks] = {}
    for name, p in params.items():
        placement = placements[name]
        # Under FSDP2 this rank holds rows of the TP-local tensor: a contiguous range of it.
        local, row = local_rows(p.detach())
        start = row * math.prod(p.shape[1:])
        out[f"model/{name}"] = Chunks(placement.logical_shape(tuple(p.shape)),
                                      pieces_of(local, tuple(p.shape), start, placement))
    for name, buf in model.state_dict().items():
        if name not in params:  # persistent buffers (MoE expert biases), the same on every rank
            out[f"buffer/{name}"] = Chunks(tuple(buf.shape), [((0,) * buf.ndim, buf.detach())])
    return out


def sharded_state(trainer) -> dict[str, Chunks]:
    """This rank's pieces of every logical tensor, as views of the live tensors. DP replicas
    offer the same pieces; DCP writes each once."""
    model = trainer.model
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
                                    Chunks(placement.logical_shape(tuple(p.shape)), []))
            chunks.pieces += pieces_of(value.detach(), tuple(p.shape), piece.start, placement)
    return out


def state_bytes(trainer) -> int:
    """About what a checkpoint of this run takes on disk, before one was written: every
    logical parameter and buffer, and the optimizer state, which ZeRO-1, FSDP2 and TP split
    across the ranks (so this rank's share times the world size)."""
    params = dict(trainer.model.named_parameters())
    model = 0
    for key, chunks in model_chunks(trainer).items():
        name = key.split("/", 1)[1]
        size = params[name].element_size() if name in params else chunks.pieces[0][1].element_size()
        model += math.prod(chunks.size()) * size
    return model + trainer.optimizer.state_bytes() * trainer.mesh.world_size


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


def _other_stages(trainer) -> set[str]:
    """Under a pipeline: the names (parameters and buffers) of the whole model that this rank's
    stages do not hold, which a checkpoint holds for the other ranks. Empty without one."""
    if trainer.mesh.pp == 1:
        return set()
    from model.gpt import GPT

    with torch.device("meta"):
        whole = set(GPT(trainer.model_cfg, init_seed=0).state_dict())
    return whole - set(trainer.model.state_dict())


def _check_fits(trainer, expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]],
                buffers: set[str]) -> None:
    others = _other_stages(trainer)
    found = {n: shape for n, shape in found.items() if n not in others}
    buffers = buffers - others
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
            local_rows(p)[0].zero_()  # the vocabulary padding rows, which the checkpoint does not hold
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
             process_group=process_group(mesh), no_dist=mesh.world_size == 1)
    for piece, entry in installs:
        if entry:
            trainer.optimizer.install_checkpoint_state(
                piece.optimizer, piece.tensor, {k: v if v.ndim == 0 else v.view(piece.tensor.shape) for k, v in entry.items()})


def _restore_file(trainer, state: dict[str, Any], expected: dict[str, tuple[int, ...]]) -> None:
    """A single-file checkpoint: full logical tensors, cut to this rank's layout."""
    model, mesh = trainer.model, trainer.mesh
    params = dict(model.named_parameters())
    if any(is_sharded(p) for p in params.values()) or mesh.ep > 1:
        raise CheckpointError(f"{state.get('path', 'checkpoint')}: a single-file checkpoint (the format before "
                              "sharded ones) does not resume with parallel.dp_shard > 1 or parallel.ep > 1: resume "
                              "it at parallel.dp_shard=1 and parallel.ep=1 once, and the checkpoints it saves "
                              "resume at any layout")
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


def mesh_record(mesh) -> dict[str, int]:
    """The layout a checkpoint records ({"dp", "tp"}, and "pp" under a pipeline)."""
    return {"dp": mesh.dp, "tp": mesh.tp, **({"pp": mesh.pp} if mesh.pp > 1 else {})}


def process_group(mesh):
    """DCP's plans and metadata travel over the host (gloo) group where there is one, else
    over the default group (None in a single process)."""
    return mesh.host_group if mesh.host_group is not None else world()
