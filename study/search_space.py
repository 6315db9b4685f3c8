"""Search spaces for scripts/fair_compare.py: one per optimizer (conf/tuning/<side>.yaml), each a
list of dimensions tuned by study/coordinate_descent.py.

A dimension sets one or more train.py config keys to one value and has a grid of values in its
scale's units (log, linear, or log1m: the log of 1 - x, for betas and momentum, whose
interesting values crowd towards 1). The fairness of a Muon-vs-AdamW comparison rests on the
two spaces having the same shape, so `parity_problems` states every way they differ.

This module holds the space and its arithmetic (scales, grids, extension and refinement, parity,
a trial's overrides), in the standard library only; study/space_config.py reads one from its
config node and checks it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

SCALES = ("log", "linear", "log1m")
# A side's fields; every other entry is a dimension, tuned in file order. Dims sit beside these
# (no `dims:` level), so an error's path is the override that fixes it: spaces.adamw.lr.points=5.
SPACE_FIELDS = ("optimizer", "fixed")
# The dimensions every side must tune, identically apart from `init` (design §5.2): the ones the
# issue lists for both optimizers. Side-specific dims (AdamW's eps, Muon's momentum) may differ.
COMMON_DIMS = ("lr", "embed_lr_mult", "head_lr_mult", "norm_lr_mult", "weight_decay", "warmup",
               "decay_floor", "grad_clip")
# Config dicts keyed by parameter family, empty by default: trainer/run/preflight.py FAMILY_DICTS,
# repeated because eval/ may not import trainer/ (tests/test_search_space.py checks they agree).
# Their keys take `++`: `+` fails once a base override (adamw_side=third) has set the family.
FAMILY_DICTS = ("optim.lr_overrides", "optim.weight_decay_overrides")
# Two grids have one shape when their gaps in scale units agree to this (design §5.2).
SHAPE_TOLERANCE = 1e-9


class SpaceError(ValueError):
    """A malformed search space: one line, naming spaces.<side>.<dim>.<field>."""


@dataclass(frozen=True)
class Dim:
    name: str
    keys: tuple[str, ...]          # the config keys this dimension sets, all to its one value
    scale: str                     # one of SCALES
    init: float                    # the starting value: a point of `grid`
    grid: tuple[float, ...]        # increasing; from `grid`, (init, step, points) or (low, high, points)
    lo_bound: Optional[float] = None   # hard limits (inclusive): extension and refinement never cross them
    hi_bound: Optional[float] = None
    integer: bool = False          # values are whole numbers (trainer.batch_size), printed without ".0"


@dataclass(frozen=True)
class Space:
    name: str                      # the side: adamw, muon
    optimizer: str                 # the optim= preset of this side's runs
    fixed: tuple[str, ...]         # train.py overrides every run of this side gets, not tuned
    dims: tuple[Dim, ...]          # tuned in this order, every round

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.dims)

    def dim(self, name: str) -> Dim:
        return {d.name: d for d in self.dims}[name]

    def initial(self) -> dict[str, float]:
        return {d.name: d.init for d in self.dims}


# ---- scale transforms ----------------------------------------------------------------------

def to_unit(dim: Dim, x: float) -> float:
    """x in the dim's scale units. log1m is -log(1 - x), so units grow with x like the others."""
    return scale_to_unit(dim.scale, x)


def from_unit(dim: Dim, u: float) -> float:
    return scale_from_unit(dim.scale, u)


def scale_to_unit(scale: str, x: float) -> float:
    if scale == "log":
        return math.log(x)
    if scale == "log1m":
        return -math.log1p(-x)
    return x


def scale_from_unit(scale: str, u: float) -> float:
    if scale == "log":
        return math.exp(u)
    if scale == "log1m":
        return -math.expm1(-u)
    return u




def in_domain(scale: str, x: float) -> bool:
    return x > 0 if scale == "log" else x < 1 if scale == "log1m" else True


def snap_value(scale: str, integer: bool, x: float) -> float:
    """The value a computed point is stored as: 12 significant digits (of 1 - x for log1m), so
    that exp(log(1e-3) + log(3)) is 0.003, not 0.0030000000000000005, and a trial's overrides and
    identity read cleanly and the same on every machine. Linear values also resolve to 1e-12, so
    0.3 - 3 * 0.1 is 0."""
    if integer:
        return float(round(x))
    if scale == "log1m":
        return 1.0 - float(f"{1.0 - x:.12g}")
    if scale == "linear":
        x = round(x, 12)
    return float(f"{x:.12g}") + 0.0  # + 0.0: -0.0 becomes 0.0


def snap(dim: Dim, x: float) -> float:
    return snap_value(dim.scale, dim.integer, x)


# ---- extension and refinement --------------------------------------------------------------

def extension_point(dim: Dim, grid: Sequence[float], side: str) -> Optional[float]:
    """The point one grid step beyond `grid`'s `side` ("low" or "high") edge, the step being the
    dim's own grid's gap at that edge in scale units. A step that would cross a hard bound stops
    at the bound itself, so the bound is tried once; past it (or past what the scale allows): None.
    A one-point dim has no step and never extends."""
    if side not in ("low", "high"):
        raise ValueError(f"side must be 'low' or 'high', got {side!r}")
    if len(dim.grid) < 2:
        return None
    base = [to_unit(dim, x) for x in dim.grid]
    edge = grid[0] if side == "low" else grid[-1]
    gap = base[1] - base[0] if side == "low" else base[-1] - base[-2]
    u = to_unit(dim, edge) + (-gap if side == "low" else gap)
    x = snap(dim, from_unit(dim, u))
    bound = dim.lo_bound if side == "low" else dim.hi_bound
    beyond = bound is not None and (x < bound if side == "low" else x > bound)
    if beyond:
        inside = edge > bound if side == "low" else edge < bound
        x = bound if inside and in_domain(dim.scale, bound) else None
    if x is None or x == edge or not in_domain(dim.scale, x):
        return None
    return x


def refine_points(dim: Dim, grid: Sequence[float], centre: float) -> list[float]:
    """The midpoints, in scale units, between `centre` (a point of `grid`) and its neighbours:
    0, 1 or 2 new points, increasing. None repeats a point (float precision, or integers)."""
    points = sorted(grid)
    if centre not in points:
        raise ValueError(f"{dim.name}: {centre!r} is not a point of the grid")
    i = points.index(centre)
    out = []
    for j in (i - 1, i + 1):
        if 0 <= j < len(points):
            x = snap(dim, from_unit(dim, (to_unit(dim, centre) + to_unit(dim, points[j])) / 2))
            if x not in points and x not in out and min(centre, points[j]) < x < max(centre, points[j]):
                out.append(x)
    return sorted(out)


# ---- parity and overrides ------------------------------------------------------------------

def _gaps(dim: Dim) -> list[float]:
    units = [to_unit(dim, x) for x in dim.grid]
    return [b - a for a, b in zip(units, units[1:])]


def _shape(dim: Dim) -> str:
    gaps = _gaps(dim)
    return f"{len(dim.grid)} points" + (f", gaps {' '.join(f'{g:.4g}' for g in gaps)} in {dim.scale} units" if gaps else "")


def parity_problems(a: Space, b: Space) -> list[str]:
    """Every way spaces `a` and `b` are not tuned alike; [] when they are. The common dims
    (COMMON_DIMS, and any other dim both name) must set the same keys on the same scale, with the
    same bounds and grid shape; only `init` may differ. A trainer.* dim (the batch) must be tuned
    on both sides or neither."""
    problems = []
    if len(a.dims) != len(b.dims):
        problems.append(f"spaces: {a.name} has {len(a.dims)} dimensions, {b.name} {len(b.dims)}: "
                        "both sides must be tuned over the same families")
    for name in COMMON_DIMS:
        for side in (a, b):
            if name not in side.names:
                problems.append(f"spaces.{side.name}.{name}: missing; every side tunes {name}")
    shared = [n for n in a.names if n in b.names]
    for name in shared:
        da, db = a.dim(name), b.dim(name)
        here, there = f"spaces.{b.name}.{name}", f"spaces.{a.name}.{name}"
        if da.keys != db.keys:
            problems.append(f"{here}.key: {', '.join(db.keys)}, but {there}.key is {', '.join(da.keys)}: "
                            "a dimension both sides tune sets the same keys")
        if da.scale != db.scale or da.integer != db.integer:
            problems.append(f"{here}.scale: {db.scale}{' integer' * db.integer}, but {there} is "
                            f"{da.scale}{' integer' * da.integer}: a dimension both sides tune has one scale")
            continue
        for field, x, y in (("min", da.lo_bound, db.lo_bound), ("max", da.hi_bound, db.hi_bound)):
            if x != y:
                problems.append(f"{here}.{field}: {'none' if y is None else f'{y:g}'}, but {there}.{field} is "
                                f"{'none' if x is None else f'{x:g}'}: "
                                "both sides' grids must stop at the same bounds")
        ga, gb = _gaps(da), _gaps(db)
        if len(ga) != len(gb) or any(abs(x - y) > SHAPE_TOLERANCE for x, y in zip(ga, gb)):
            problems.append(f"{here}: {_shape(db)}, but {there} has {_shape(da)}: "
                            "a dimension both sides tune needs the same grid shape (only init may differ)")
    for side, other in ((a, b), (b, a)):
        other_keys = {k for d in other.dims for k in d.keys}
        for d in side.dims:
            for key in d.keys:
                if key.startswith("trainer.") and key not in other_keys:
                    problems.append(f"spaces.{side.name}.{d.name}: {key} is tuned on {side.name} only; "
                                    "open it on both sides or on neither")
    return problems


def override_prefix(key: str) -> str:
    """`++` for a key inside a family dict (FAMILY_DICTS), else nothing."""
    return "++" if key.rpartition(".")[0] in FAMILY_DICTS else ""


def format_value(dim: Dim, x: float) -> str:
    """A value as a train.py override: repr of the float (the shortest text that reads back as the
    same float, so the override and a trial's identity are exact), or a whole number."""
    return str(int(x)) if dim.integer else repr(float(x))


def trial_overrides(space: Space, values: Mapping[str, float]) -> list[str]:
    """The train.py overrides of one trial: optim=<preset>, the side's fixed overrides, then each
    dim's keys set to its value (`++` for the family dicts, which start empty)."""
    missing = [n for n in space.names if n not in values]
    extra = sorted(set(values) - set(space.names))
    if missing or extra:
        raise ValueError(f"spaces.{space.name}: a trial needs a value for each of {', '.join(space.names)}"
                         f" ({'missing ' + ', '.join(missing) if missing else 'unknown ' + ', '.join(extra)})")
    out = [f"optim={space.optimizer}", *space.fixed]
    for dim in space.dims:
        out += [f"{override_prefix(key)}{key}={format_value(dim, values[dim.name])}" for key in dim.keys]
    return out


def held_overrides(dim: Dim) -> list[str]:
    """The train.py overrides that hold `dim` at its init: a dim a study does not tune
    (tuning.dims) joins the side's fixed overrides with the value it would have started from."""
    return [f"{override_prefix(key)}{key}={format_value(dim, dim.init)}" for key in dim.keys]


def space_dict(space: Space) -> dict[str, Any]:
    """The space as plain data (plan.json): what the report and an audit read."""
    return {"optimizer": space.optimizer, "fixed": list(space.fixed),
            "dims": [{"name": d.name, "keys": list(d.keys), "scale": d.scale, "integer": d.integer,
                      "init": d.init, "grid": list(d.grid), "bounds": [d.lo_bound, d.hi_bound]}
                     for d in space.dims]}
