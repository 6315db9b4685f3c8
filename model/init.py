"""The initialisation rule: every parameter's starting value from the run seed and its name
alone, so that the model is the same at every layout.

The rule. Each parameter, under its logical name (its name in the single-process GPT, e.g.
"blocks.3.attn.wq.weight"), gets a torch.Generator of its own on the target device, seeded
with the first 8 bytes of sha256("<seed>:<name>") (Python's hash() is salted per process, so
never that). The generator draws the WHOLE logical tensor, in fp32:
- 1-D parameters (norm gains): ones;
- the outputs of residual branches (attn.wo, the MLP's and shared experts' w_down, the routed
  experts' w_down): normal(0, init_std / sqrt(2 n_layers)), so the residual stream does not
  grow with depth;
- every other matrix (embedding, wq / wk / wv, gate / up, router, LM head): normal(0, init_std).
A rank then keeps only its part: its TP chunk (torch.chunk's, with the vocabulary rows TP pads
set to zero), its EP experts, its FSDP2 rows. One parameter's draw depends on nothing else
(not on the order parameters are visited, nor on which others this rank holds), so the
single-process model and every shard of every layout are cut from the same logical tensors,
bit for bit. The values depend on the device type (CPU and CUDA generators differ), not on
the layout.

`GPT(cfg)` applies the rule to its own parameters (model/gpt.py); a model built on the meta
device and sharded there is given its values by `materialize` below, one logical tensor at a
time, so start-up memory never holds more than one whole parameter beyond the rank's shards.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from model.config import ModelConfig
from parallel.comm import Group, group_rank, group_size
from parallel.fsdp import PARAM_ATTRIBUTES, is_sharded, local_rows

# Names ending so are the outputs of residual branches (dense and shared-expert w_down are
# "...w_down.weight", the routed experts' stack is "...experts.w_down").
RESIDUAL_OUTPUTS = ("wo.weight", "w_down.weight", "experts.w_down")
# Path segments that module wrappers (activation checkpointing, torch.compile, FSDP1) insert
# into parameter names; the logical name is the name without them.
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def logical_name(name: str) -> str:
    """The parameter's name in the single-process GPT."""
    for segment in WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def parameter_seed(seed: int, name: str) -> int:
    """The generator seed of parameter `name` under run seed `seed`: stable across processes,
    machines and Python versions, and different for every name."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclass(frozen=True)
class InitRule:
    """The rule's numbers for one model: the run seed and the two standard deviations."""
    seed: int
    std: float
    residual_std: float

    @classmethod
    def of(cls, cfg: ModelConfig, seed: int) -> "InitRule":
        return cls(seed=seed, std=cfg.init_std, residual_std=cfg.init_std / math.sqrt(2 * cfg.n_layers))

    def std_of(self, name: str) -> float:
        return self.residual_std if name.endswith(RESIDUAL_OUTPUTS) else self.std

    def logical(self, name: str, shape: torch.Size, device: torch.device) -> torch.Tensor:
        """The whole logical tensor of parameter `name`, fp32, drawn on `device`."""
        if len(shape) == 1:
            return torch.ones(shape, dtype=torch.float32, device=device)
        generator = torch.Generator(device=device).manual_seed(parameter_seed(self.seed, name))
        full = torch.empty(shape, dtype=torch.float32, device=device)
        return full.normal_(0.0, self.std_of(name), generator=generator)


@torch.no_grad()
def init_whole(model: nn.Module, rule: InitRule) -> None:
    """Apply the rule to a model whose every parameter is whole (the single-process GPT)."""
    for name, param in model.named_parameters():
        param.copy_(rule.logical(logical_name(name), param.shape, param.device))


@dataclass(frozen=True)
class RankParts:
    """This rank's coordinates in the groups that split parameters: TP (tp_split_dim) and EP
    (ep_split_dim). FSDP2's rows are read from each parameter's DTensor."""
    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1

    @classmethod
    def of(cls, tp_group: Group, ep_group: Group) -> "RankParts":
        return cls(group_rank(tp_group), group_size(tp_group), group_rank(ep_group), group_size(ep_group))


def chunk_part(full: torch.Tensor, dim: int, rank: int, size: int, length: int) -> torch.Tensor:
    """Part `rank` of `size` of `full` along `dim`, `length` long: torch.chunk's part of `full`
    zero-padded to `size * length` (how TP pads the vocabulary). A view where nothing is padded."""
    total = full.shape[dim]
    start, stop = min(rank * length, total), min((rank + 1) * length, total)
    part = full.narrow(dim, start, stop - start)
    if stop - start == length:
        return part
    shape = list(full.shape)
    shape[dim] = length
    padded = full.new_zeros(shape)
    padded.narrow(dim, 0, stop - start).copy_(part)
    return padded


def local_part(full: torch.Tensor, param: torch.Tensor, parts: RankParts) -> torch.Tensor:
    """What `param` holds of its logical tensor `full` on this rank, by its recorded splits."""
    # For an FSDP2 DTensor `shape` is the whole (TP / EP-local) tensor FSDP2 sharded.
    tp_dim = getattr(param, "tp_split_dim", None)
    if tp_dim is not None and parts.tp_size > 1:
        full = chunk_part(full, tp_dim, parts.tp_rank, parts.tp_size, param.shape[tp_dim])
    ep_dim = getattr(param, "ep_split_dim", None)
    if ep_dim is not None and parts.ep_size > 1:
        full = chunk_part(full, ep_dim, parts.ep_rank, parts.ep_size, param.shape[ep_dim])
    if is_sharded(param):
        local, start = local_rows(param)
        full = full.narrow(0, start, local.shape[0])
    return full


def _split_attributes(model: nn.Module) -> Iterator[tuple[str, dict]]:
    for name, param in model.named_parameters():
        yield name, {a: getattr(param, a) for a in PARAM_ATTRIBUTES if hasattr(param, a)}


@torch.no_grad()
def materialize(model: nn.Module, logical_shapes: dict[str, torch.Size], rule: InitRule, device: torch.device,
                parts: RankParts) -> None:
    """Give a model built (and sharded) on the meta device its storage on `device` and its
    values by the rule: one logical tensor at a time is drawn whole on `device`, this rank's
    part of it copied in, and the tensor freed before the next. `logical_shapes`: every
    parameter's logical shape, by logical name (the meta model's before sharding). The
    buffers get their starting values from the model itself (`model.reset_buffers()`)."""
    # to_empty makes new parameter objects: the splits parallelize_tp recorded must follow.
    kept = dict(_split_attributes(model))
    model.to_empty(device=device)
    for name, param in model.named_parameters():
        for attribute, value in kept[name].items():
            setattr(param, attribute, value)
        logical = logical_name(name)
        if logical not in logical_shapes:
            raise KeyError(f"parameter {name} has no logical counterpart in the model it was built from")
        full = rule.logical(logical, logical_shapes[logical], device)
        part = local_part(full, param, parts)
        target, _ = local_rows(param)
        if part.shape != target.shape:
            raise AssertionError(f"{name}: this rank's part of the logical tensor is {tuple(part.shape)}, "
                                 f"the parameter holds {tuple(target.shape)}")
        target.copy_(part)
        del full, part
    model.reset_buffers()
