"""Muon's settings: the Newton-Schulz dtypes, each param group's options checked (one line
naming the config key), and how a parameter is seen as matrices."""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from optim.fast_dtype import resolve_precision
from optim.newton_schulz import ADJUST_LR_MODES, COEFFICIENTS
from optim.ns_method import NS_METHODS, NSShape


NS_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
}


def parse_ns_dtype(value: Any) -> torch.dtype:
    """torch.bfloat16 / torch.float32 / torch.float64, or one of the NS_DTYPES names."""
    if isinstance(value, torch.dtype) and value in NS_DTYPES.values():
        return value
    if isinstance(value, str) and value.lower() in NS_DTYPES:
        return NS_DTYPES[value.lower()]
    raise ValueError(
        f"optim.muon.ns_dtype must be bf16 or fp32 (or fp64, or the torch dtype), got {value!r}"
    )


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def validate_group(group: dict[str, Any], shapes: Sequence[torch.Size] | None = None) -> None:
    """Raises ValueError naming the config key of the first bad option; canonicalises ns_dtype.
    `shapes`: the whole matrices' shapes, where the group's parameters are row shards of them
    (a shard's rows need not be whole heads)."""
    lr = group["lr"]
    if isinstance(lr, Tensor):
        raise ValueError("optim.muon.lr (optim.lr) must be a Python float, not a tensor")
    if not _is_number(lr) or lr < 0:
        raise ValueError(f"optim.muon.lr (optim.lr) must be a finite number >= 0, got {lr!r}")
    wd = group["weight_decay"]
    if not _is_number(wd) or wd < 0:
        raise ValueError(
            f"optim.muon.weight_decay (optim.weight_decay) must be a finite number >= 0, got {wd!r}"
        )
    mu = group["momentum"]
    if not _is_number(mu) or not 0.0 <= mu < 1.0:
        raise ValueError(f"optim.muon.momentum must be in [0, 1), got {mu!r}")
    if not isinstance(group["nesterov"], bool):
        raise ValueError(f"optim.muon.nesterov must be a bool, got {group['nesterov']!r}")
    steps = group["ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= 100:
        raise ValueError(f"optim.muon.ns_steps must be an int in [1, 100], got {steps!r}")
    if group["coefficients"] not in COEFFICIENTS:
        raise ValueError(
            f"optim.muon.coefficients: unknown coefficient set {group['coefficients']!r} "
            f"(expected classic or polar_express)"
        )
    if group["ns_dtype"] == "auto":
        # The device's fast dtype (optim/fast_dtype.py). The defaults have no parameters yet:
        # they keep "auto", and each group resolves it on its own parameters' device.
        if group["params"]:
            group["ns_dtype"] = resolve_precision("auto", group["params"][0].device).precision
    if group["ns_dtype"] != "auto":
        group["ns_dtype"] = parse_ns_dtype(group["ns_dtype"])
    if group["adjust_lr"] not in ADJUST_LR_MODES:
        raise ValueError(
            f"optim.muon.adjust_lr: unknown mode {group['adjust_lr']!r} "
            f"(expected one of {', '.join(ADJUST_LR_MODES)})"
        )
    eps = group["eps"]
    if not _is_number(eps) or eps <= 0:
        raise ValueError(f"optim.muon.eps must be a finite number > 0, got {eps!r}")
    if group["ns_method"] not in NS_METHODS:
        raise ValueError(
            f"optim.muon.ns_method: unknown method {group['ns_method']!r} (expected {', '.join(NS_METHODS)})"
        )
    by_shape = group.get("ns_by_shape")
    if by_shape is not None:
        problem = ns_by_shape_problem(group["ns_method"], by_shape)
        if problem is not None:
            raise ValueError(problem)
    if not isinstance(group["normuon"], bool):
        raise ValueError(f"optim.muon.normuon must be a bool, got {group['normuon']!r}")
    beta2 = group["normuon_beta2"]
    if not _is_number(beta2) or not 0.0 <= beta2 < 1.0:
        raise ValueError(f"optim.muon.normuon_beta2 must be in [0, 1), got {beta2!r}")
    if group["tp_mode"] not in ("gather", "gram"):
        raise ValueError(f"optim.muon.tp_mode: unknown mode {group['tp_mode']!r} (expected gather or gram)")
    h = group["split_rows"]
    if h is not None and (isinstance(h, bool) or not isinstance(h, int) or h < 1):
        raise ValueError(f"optim.muon.split_rows must be None or an int >= 1, got {h!r}")
    for i, p in enumerate(group["params"]):
        matrix_layout(p.shape if shapes is None else shapes[i], h)  # raises on unsupported shapes
        if p.is_sparse:
            raise ValueError("optim.muon: sparse parameters are not supported")


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
