"""Muon's options: the one class that is both the config schema (optim.muon.*, through
optim/config.py's OptimConfig) and what every engine is given, and the one place each is checked.

The fields marked GROUP are what each param group holds (and a checkpoint saves); the others
say how a process computes (split_heads is read by the builders, cuda_graphs and combo_kernels
by the engines). check_group_options checks the values, in one line naming the config key:
trainer/config.py calls check_config_options on the run's config, and the engines check every
param group (check_group). A new option is a field here (and its check, below), read where it
acts: optim/muon/update.py for the step's arithmetic.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Sequence

import torch
from torch import Tensor

from optim.fast_dtype import resolve_precision
from optim.muon.newton_schulz import coefficients_for, muon_scale
from optim.muon.ns_method import NS_METHODS, NSShape

NS_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
}
TP_MODES = ("gather", "gram")
GROUP = {"group": True}  # a field a param group holds


@dataclass
class MuonOptions:
    """Everything about Muon but the lr and weight decay (which a schedule and the parameter
    families set per group); the schema of optim.muon.* (conf/optim/muon.yaml)."""

    # M = momentum * M + G; the Newton-Schulz input G + momentum * M if nesterov else M.
    momentum: float = field(default=0.95, metadata=GROUP)
    nesterov: bool = field(default=True, metadata=GROUP)
    # Newton-Schulz iterations, and their coefficients: "classic", the quintic (3.4445, -4.7750,
    # 2.0315) every step; "polar_express", per-step coefficients (Amsel et al., 2025).
    ns_steps: int = field(default=5, metadata=GROUP)
    coefficients: str = field(default="classic", metadata=GROUP)
    # Newton-Schulz compute dtype: "bf16" (as in practice on GPUs), "fp32", or "auto": bf16 where
    # the device has bf16 matrix hardware (CUDA compute capability 8.0+; CPUs with AMX bf16), else
    # fp32. An engine also takes a torch dtype.
    ns_dtype: Any = field(default="auto", metadata=GROUP)
    # "match_rms_adamw": lr * 0.2 * sqrt(max(A, B)), so Muon shares AdamW's lr and wd;
    # "spectral": lr * sqrt(max(1, A / B)); "none": lr as is.
    adjust_lr: str = field(default="match_rms_adamw", metadata=GROUP)
    # Orthogonalise wq / wk / wv one attention head at a time instead of whole (the builders give
    # those groups split_rows = the head size).
    split_heads: bool = False
    # How TP-sharded matrices reach Newton-Schulz whole: "gather" all-gathers the momentum
    # shards and orthogonalises the full matrix on every TP rank; "gram" iterates on the
    # shards and all-reduces the small Gram matrix each step (optim/muon/newton_schulz_tp.py).
    tp_mode: str = field(default="gather", metadata=GROUP)
    # Added to the Frobenius norm before normalising.
    eps: float = field(default=1e-7, metadata=GROUP)
    # "standard", or "gram": Gram Newton-Schulz (iterates on the small Gram matrix, with a
    # restart after the second step) for matrices whose aspect ratio makes it cheaper, above
    # about 1.5; square ones stay standard. Under tp_mode=gram it also all-reduces the Gram
    # matrix once per restart segment instead of every step. See optim/muon/newton_schulz.py.
    # "auto": Gram or standard per matrix shape, whichever measured faster on this device at
    # start-up (optim/muon/ns_choice.py); the choice is written into ns_by_shape.
    ns_method: str = field(default="standard", metadata=GROUP)
    # With ns_method=auto: {"ROWSxCOLS": "gram" or "standard"} per matrix shape Muon
    # orthogonalises (TP shards iterated as shards under tp_mode=gram: "ROWSxCOLS_shard_rows"
    # or "_shard_cols"). Start-up measures the shapes missing here, and the resolved config
    # records them all; a resumed run keeps its checkpoint's. Empty otherwise.
    ns_by_shape: Dict[str, str] = field(default_factory=dict, metadata=GROUP)
    # On CUDA, replay each stack's Newton-Schulz as a CUDA graph recorded at the second step
    # (one launch instead of ~20 per stack; optim/muon/ns_graphs.py). Costs memory: each stack's
    # buffer is kept between steps (the sum of all stacks, not the largest one at a time), and
    # the graphs hold a memory pool for the iterations' scratch buffers (at least those of the
    # largest stack). Both are released at the end of each job, in a sweep too.
    cuda_graphs: bool = False
    # NorMuon (arXiv 2510.05491): divide each row (column, for wide matrices) of the
    # orthogonalised update by the root of its running mean square, then restore the update's
    # norm. See optim/muon/normuon.py.
    normuon: bool = field(default=False, metadata=GROUP)
    normuon_beta2: float = field(default=0.95, metadata=GROUP)
    # With compile_updates (trainer.compile on a GPU), the compiled elementwise kernels launched
    # as inductor combo kernels (several per launch); off until measured on a GPU (fused.compiled).
    combo_kernels: bool = False

    def with_overrides(self, overrides: Mapping[str, Any]) -> "MuonOptions":
        """These options with some fields replaced (Muon(params, ns_dtype="fp32")), checked."""
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"Muon: unknown option(s) {', '.join(unknown)}")
        return dataclasses.replace(self, **overrides) if overrides else self

    def group_defaults(self) -> dict[str, Any]:
        """What every param group holds besides lr and weight_decay (torch's group options): the
        GROUP fields, and each group's head split and TP group (set by the builders)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata.get("group")}
        return {**out, "ns_by_shape": dict(out["ns_by_shape"] or {}), "split_rows": None, "tp_group": None}


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _choice(key: str, value: Any, allowed: Sequence[str]) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{key}: unknown value {value!r} (expected one of {', '.join(allowed)})")


def _fraction(key: str, value: Any) -> None:
    if not _is_number(value) or not 0 <= value < 1:  # NaN too
        raise ValueError(f"{key} must lie in [0, 1), got {value}")


def check_group_options(options: Mapping[str, Any]) -> None:
    """The options' values (MuonOptions' fields, or a param group holding them): raise
    ValueError, in one line naming the config key, at the first bad one. The coefficient set,
    the step count and the lr scale are checked by the functions that read them
    (newton_schulz.coefficients_for, muon_scale), so their rules live in one place."""
    if isinstance(options["ns_dtype"], torch.dtype):
        if options["ns_dtype"] not in NS_DTYPES.values():
            raise ValueError(f"optim.muon.ns_dtype: unknown value {options['ns_dtype']!r} "
                             f"(expected one of auto, {', '.join(NS_DTYPES)})")
    else:
        _choice("optim.muon.ns_dtype", options["ns_dtype"], ("auto", *NS_DTYPES))
    coefficients_for(options["coefficients"], options["ns_steps"])
    muon_scale(1, 1, options["adjust_lr"])
    _choice("optim.muon.tp_mode", options["tp_mode"], TP_MODES)
    _choice("optim.muon.ns_method", options["ns_method"], NS_METHODS)
    if options.get("ns_by_shape"):
        problem = ns_by_shape_problem(options["ns_method"], options["ns_by_shape"])
        if problem is not None:
            raise ValueError(problem)
    _fraction("optim.muon.normuon_beta2", options["normuon_beta2"])
    _fraction("optim.muon.momentum", options["momentum"])
    eps = options["eps"]
    if not _is_number(eps) or not eps > 0:
        raise ValueError(f"optim.muon.eps must be a finite number > 0, got {eps}")
    for key in ("nesterov", "normuon"):
        if not isinstance(options[key], bool):
            raise ValueError(f"optim.muon.{key} must be a bool, got {options[key]!r}")


def check_config_options(optim: Any) -> None:
    """The run config's Muon options (optim.muon.*), checked as the optimizer will check them:
    what trainer/config.py's validate calls."""
    check_group_options(dataclasses.asdict(optim.muon))


def check_group(group: dict[str, Any], shapes: Sequence[torch.Size] | None = None) -> None:
    """A param group's values: its lr and weight decay, its options (check_group_options), its
    head split and its parameters' shapes; raises ValueError naming the config key. Resolves
    ns_dtype to a torch dtype ("auto": the fast dtype of the parameters' device, optim/fast_dtype.py;
    a group without parameters keeps "auto"). `shapes`: the whole matrices' shapes, where the
    group's parameters are row shards of them (a shard's rows need not be whole heads)."""
    lr = group["lr"]
    if isinstance(lr, Tensor):
        raise ValueError("optim.muon.lr (optim.lr) must be a Python float, not a tensor")
    if not _is_number(lr) or lr < 0:
        raise ValueError(f"optim.muon.lr (optim.lr) must be a finite number >= 0, got {lr!r}")
    wd = group["weight_decay"]
    if not _is_number(wd) or wd < 0:
        raise ValueError(f"optim.muon.weight_decay (optim.weight_decay) must be a finite number >= 0, got {wd!r}")
    check_group_options(group)
    if group["ns_dtype"] == "auto" and group["params"]:
        group["ns_dtype"] = resolve_precision("auto", group["params"][0].device).precision
    if group["ns_dtype"] != "auto":
        group["ns_dtype"] = parse_ns_dtype(group["ns_dtype"])
    h = group["split_rows"]
    if h is not None and (isinstance(h, bool) or not isinstance(h, int) or h < 1):
        raise ValueError(f"optim.muon.split_rows must be None or an int >= 1, got {h!r}")
    for i, p in enumerate(group["params"]):
        matrix_layout(p.shape if shapes is None else shapes[i], h)  # raises on unsupported shapes
        if p.is_sparse:
            raise ValueError("optim.muon: sparse parameters are not supported")


def parse_ns_dtype(value: Any) -> torch.dtype:
    """torch.bfloat16 / torch.float32 / torch.float64, or one of the NS_DTYPES names."""
    if isinstance(value, torch.dtype) and value in NS_DTYPES.values():
        return value
    if isinstance(value, str) and value.lower() in NS_DTYPES:
        return NS_DTYPES[value.lower()]
    raise ValueError(f"optim.muon.ns_dtype must be bf16 or fp32 (or fp64, or the torch dtype), got {value!r}")


def ns_by_shape_problem(method: str, by_shape: Mapping[str, str]) -> str | None:
    """What is wrong with optim.muon.ns_by_shape (one line naming the key), or None."""
    if not isinstance(by_shape, Mapping):
        return f"optim.muon.ns_by_shape must map shapes to standard or gram, got {by_shape!r}"
    if by_shape and method != "auto":
        return f"optim.muon.ns_by_shape is read only with optim.muon.ns_method=auto, not {method}"
    for key, value in by_shape.items():
        try:
            NSShape.parse(key)
        except ValueError as err:
            return str(err)
        if value not in ("standard", "gram"):
            return f"optim.muon.ns_by_shape.{key}: unknown value {value!r} (expected standard or gram)"
    return None


def matrix_split(param: Tensor) -> int | None:
    """The matrix dimension (0: rows, 1: columns) tensor parallelism splits, of a matrix or of
    each expert of a stack (from the parameter's tp_split_dim); None where it leaves it whole."""
    dim = getattr(param, "tp_split_dim", None)
    return None if dim is None else dim - (param.ndim - 2)


def full_matrix(rows: int, cols: int, split: int | None, tp: int) -> tuple[int, int]:
    """The whole matrix's (rows, cols) of a TP-local rows x cols one split along `split`."""
    if split is None:
        return rows, cols
    return (rows * tp, cols) if split == 0 else (rows, cols * tp)


def matrix_layout(shape: torch.Size, split_rows: int | None) -> tuple[int, int, int]:
    """(k, rows, cols): the parameter seen as k independent rows x cols matrices."""
    if len(shape) not in (2, 3):
        raise ValueError(
            f"optim.muon: Muon takes 2-D [out, in] or 3-D [experts, out, in] parameters, "
            f"got shape {list(shape)}; route it to AdamW"
        )
    k = shape[0] if len(shape) == 3 else 1
    rows, cols = shape[-2], shape[-1]
    if split_rows is not None and split_rows != rows:
        if rows % split_rows:
            raise ValueError(
                f"optim.muon.split_rows={split_rows} does not divide the {rows} rows of a "
                f"parameter of shape {list(shape)}"
            )
        k, rows = k * (rows // split_rows), split_rows
    return k, rows, cols
