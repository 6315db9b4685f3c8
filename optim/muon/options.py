"""Muon's options, and the one rule by which a step changes a weight.

MuonOptions is built once from the config (MuonOptions.from_config) and handed whole to every
engine: Muon (one process, and each ZeRO-1 owner), ShardedMuon (FSDP2's row shards). It is
checked here and nowhere else, in one line naming the config key: trainer/config.py calls
check_config_options on the run's config, the engines check the options they are given and
every param group's values (check_group). A new option is a field here, a key in
optim/config.py and the code that reads it.

The rule, for a weight W, its orthogonalised update O and a scale s for the matrix's shape:

    W = W * (1 - lr * weight_decay) - lr * s * O

decoupled weight decay with the group's lr as given. With `cautious_wd` the decay acts only
where O and W have the same sign, where the update already moves the weight towards zero
(Cautious Weight Decay, arXiv 2510.12402): W = W - lr * weight_decay * W * [O * W > 0].
decay_and_update applies it to a list of weights, eagerly or as a compiled kernel; every
engine calls it, and differs from the others only in how whole matrices reach their owner.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import Tensor

from optim.fast_dtype import resolve_precision
from optim.muon import fused
from optim.muon.newton_schulz import ADJUST_LR_MODES, COEFFICIENTS
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


@dataclass(frozen=True)
class MuonOptions:
    """Everything about Muon but the lr and weight decay (which a schedule and the parameter
    families set per group). The first block is what each param group holds and a checkpoint
    saves; the second says how this process computes, not what the optimizer is.

    momentum, nesterov: M = momentum * M + G; the Newton-Schulz input G + momentum * M if
        nesterov else M.
    ns_steps, coefficients: Newton-Schulz iterations; "classic" or "polar_express".
    ns_dtype: Newton-Schulz compute dtype: torch.bfloat16 / torch.float32, "bf16" / "fp32", or
        "auto" (bf16 where the parameters' device runs it really faster than fp32).
    adjust_lr: "match_rms_adamw" (0.2 sqrt(max(A, B))), "spectral" (sqrt(max(1, A/B))) or
        "none", for the A x B matrix actually orthogonalised.
    eps: added to the Frobenius norm before normalising.
    tp_mode: "gather" or "gram", how TP-sharded matrices are orthogonalised.
    ns_method, ns_by_shape: "standard", "gram" (Gram Newton-Schulz where it costs fewer
        multiply-adds) or "auto" (Gram for the shapes ns_by_shape, {NSShape key ("768x2048"):
        "gram" or "standard"}, maps to "gram"; optim/muon/ns_choice.py measures it).
    normuon, normuon_beta2: NorMuon's per-row second moment (optim/muon/normuon.py).
    cautious_wd: decay only the coordinates where the update and the weight agree in sign.
    compile_updates: the elementwise work (momentum, weight decay, update) as torch.compile'd
        fused kernels (optim/muon/fused.py): fewer memory passes, for GPUs.
    cuda_graphs: on CUDA, replay each stack's Newton-Schulz as a recorded CUDA graph (one launch
        instead of dozens, optim/muon/ns_graphs.py). It costs memory: each stack's buffer is kept
        between steps, and the graphs hold one memory pool for the iterations' scratch buffers.
        Both are released at the end of each job (buffers.release_buffers).
    combo_kernels: with compile_updates, those kernels launched as inductor combo kernels
        (several per launch); off until measured on a GPU (fused.compiled).
    """

    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    coefficients: str = "classic"
    ns_dtype: Any = torch.bfloat16  # a torch dtype, one of NS_DTYPES' names, or "auto"
    adjust_lr: str = "match_rms_adamw"
    eps: float = 1e-7
    tp_mode: str = "gather"
    ns_method: str = "standard"
    ns_by_shape: Optional[Mapping[str, str]] = None
    normuon: bool = False
    normuon_beta2: float = 0.95

    cautious_wd: bool = False  # not a group option: a run resumed with it switched keeps its checkpoint
    compile_updates: bool = False
    cuda_graphs: bool = False
    combo_kernels: bool = False

    def __post_init__(self) -> None:
        check_group_options(dataclasses.asdict(self))

    @staticmethod
    def from_config(optim: Any, compile_updates: bool = False) -> "MuonOptions":
        """From optim/config.py's OptimConfig (optim.muon.* and optim.cautious_wd)."""
        m = optim.muon
        return MuonOptions(
            momentum=m.momentum, nesterov=m.nesterov, ns_steps=m.ns_steps, coefficients=m.coefficients,
            ns_dtype=m.ns_dtype, adjust_lr=m.adjust_lr, eps=m.eps, tp_mode=m.tp_mode, ns_method=m.ns_method,
            ns_by_shape=m.ns_by_shape, normuon=m.normuon, normuon_beta2=m.normuon_beta2,
            cautious_wd=optim.cautious_wd, compile_updates=compile_updates, cuda_graphs=m.cuda_graphs,
        )

    def with_overrides(self, overrides: Mapping[str, Any]) -> "MuonOptions":
        """These options with some fields replaced (Muon(params, ns_dtype="fp32")), checked."""
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"Muon: unknown option(s) {', '.join(unknown)}")
        return dataclasses.replace(self, **overrides) if overrides else self

    def group_defaults(self) -> dict[str, Any]:
        """What every param group holds besides lr and weight_decay (torch's group options)."""
        return dict(momentum=self.momentum, nesterov=self.nesterov, ns_steps=self.ns_steps,
                    coefficients=self.coefficients, ns_dtype=self.ns_dtype, adjust_lr=self.adjust_lr,
                    eps=self.eps, split_rows=None, tp_group=None, tp_mode=self.tp_mode,
                    ns_method=self.ns_method, normuon=self.normuon, normuon_beta2=self.normuon_beta2,
                    ns_by_shape=None if self.ns_by_shape is None else dict(self.ns_by_shape))


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
    ValueError, in one line naming the config key, at the first bad one."""
    if isinstance(options["ns_dtype"], torch.dtype):
        if options["ns_dtype"] not in NS_DTYPES.values():
            raise ValueError(f"optim.muon.ns_dtype: unknown value {options['ns_dtype']!r} "
                             f"(expected one of auto, {', '.join(NS_DTYPES)})")
    else:
        _choice("optim.muon.ns_dtype", options["ns_dtype"], ("auto", *NS_DTYPES))
    _choice("optim.muon.coefficients", options["coefficients"], tuple(COEFFICIENTS))
    _choice("optim.muon.adjust_lr", options["adjust_lr"], ADJUST_LR_MODES)
    _choice("optim.muon.tp_mode", options["tp_mode"], TP_MODES)
    _choice("optim.muon.ns_method", options["ns_method"], NS_METHODS)
    if options.get("ns_by_shape") is not None:
        problem = ns_by_shape_problem(options["ns_method"], options["ns_by_shape"])
        if problem is not None:
            raise ValueError(problem)
    _fraction("optim.muon.normuon_beta2", options["normuon_beta2"])
    _fraction("optim.muon.momentum", options["momentum"])
    eps = options["eps"]
    if not _is_number(eps) or not eps > 0:
        raise ValueError(f"optim.muon.eps must be a finite number > 0, got {eps}")
    steps = options["ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise ValueError(f"optim.muon.ns_steps must be an int >= 1, got {steps!r}")
    if steps < 1:
        raise ValueError(f"optim.muon.ns_steps must be >= 1, got {steps}")
    for key in ("nesterov", "normuon"):
        if not isinstance(options[key], bool):
            raise ValueError(f"optim.muon.{key} must be a bool, got {options[key]!r}")


def check_config_options(optim: Any) -> None:
    """The run config's Muon options (optim.muon.* and optim.cautious_wd), checked as the
    optimizer will check them: what trainer/config.py's validate calls."""
    MuonOptions.from_config(optim)


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


# ---- the rule ----

def update_step(params: list[Tensor], updates: list[Tensor], decay: Tensor, alpha: Tensor,
                cautious: bool = False) -> None:
    """p <- p * decay + alpha * u, for 0-d tensors decay (1 - lr * wd, gated) and alpha
    (-lr * scale); with `cautious`, the decay only where u * p > 0. A plain function of
    tensors, run as it is or compiled (fused.compiled): the scalars that change every step are
    tensors, so no step recompiles."""
    for p, u in zip(params, updates):
        factor = torch.where(u * p > 0, decay, 1.0) if cautious else decay
        p.copy_(p * factor + u * alpha)


def decay_and_update(params: list[Tensor], updates: list[Tensor], lr: float, weight_decay: float, scale: float,
                     options: MuonOptions, keep: Optional[Tensor] = None) -> None:
    """The rule on every (p, u): p <- p * (1 - lr * weight_decay) - lr * scale * u, the decay
    only where u * p > 0 under options.cautious_wd. `keep` (0-d float, on the parameters'
    device: 1.0, or 0.0 for a step skipped on the device): gates the decay; the caller has
    already zeroed the updates of a skipped step, so it changes nothing, cautiously or not.

    Eagerly as for-each ops (a few launches per list, whatever its length); with
    options.compile_updates as update_step compiled into one kernel that reads each weight and
    update once (its factors are fp32 scalars, as for fp32 weights)."""
    if not params:
        return
    decay, alpha = lr * weight_decay, -lr * scale
    if options.compile_updates:
        device = params[0].device
        gate = keep if keep is not None else torch.ones((), device=device)
        fused.compiled(update_step, options.combo_kernels)(
            params, updates, 1.0 - decay * gate, torch.full((), alpha, device=device), options.cautious_wd)
        return
    if decay != 0 and options.cautious_wd:
        # 1 - decay where u and p agree in sign, else 1, in the weights' dtype; a skipped
        # step's u is zero, so it needs no gate.
        torch._foreach_mul_(params, [(u * p > 0).to(p.dtype).mul_(-decay).add_(1.0) for p, u in zip(params, updates)])
    elif decay != 0:
        torch._foreach_mul_(params, 1.0 - decay if keep is None else 1.0 - decay * keep)
    torch._foreach_add_(params, updates, alpha=alpha)
