"""Search spaces for scripts/fair_compare.py: one per optimizer (conf/tuning/<side>.yaml), each a
list of dimensions tuned by eval/coordinate_descent.py.

A dimension sets one or more train.py config keys to one value and has a grid of values in its
scale's units (log, linear, or log1m: the log of 1 - x, for betas and momentum, whose
interesting values crowd towards 1). The fairness of a Muon-vs-AdamW comparison rests on the
two spaces having the same shape, so `parity_problems` states every way they differ.

Input is plain dicts (an OmegaConf container converted with `to_container`), so this module
needs only the standard library; every malformed input is one line naming
`spaces.<side>.<dim>.<field>`.
"""
from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

SCALES = ("log", "linear", "log1m")
# A side's fields; every other entry is a dimension, tuned in file order. Dims sit beside these
# (no `dims:` level), so an error's path is the override that fixes it: spaces.adamw.lr.points=5.
SPACE_FIELDS = ("optimizer", "fixed")
DIM_FIELDS = ("key", "scale", "init", "grid", "step", "points", "low", "high", "min", "max", "integer")
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

_KEY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_NAME = re.compile(r"[A-Za-z_]\w*")


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
    return _to_unit(dim.scale, x)


def from_unit(dim: Dim, u: float) -> float:
    return _from_unit(dim.scale, u)


def _to_unit(scale: str, x: float) -> float:
    if scale == "log":
        return math.log(x)
    if scale == "log1m":
        return -math.log1p(-x)
    return x


def _from_unit(scale: str, u: float) -> float:
    if scale == "log":
        return math.exp(u)
    if scale == "log1m":
        return -math.expm1(-u)
    return u


_DOMAIN = {"log": "> 0", "log1m": "< 1"}  # what each scale's transform needs of a value


def _in_domain(scale: str, x: float) -> bool:
    return x > 0 if scale == "log" else x < 1 if scale == "log1m" else True


def _snap(scale: str, integer: bool, x: float) -> float:
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
    return _snap(dim.scale, dim.integer, x)


# ---- parsing -------------------------------------------------------------------------------

def _hint(name: str, options: Sequence[str], what: str = "fields") -> str:
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.5)
    return f"did you mean {close[0]}?" if close else f"{what}: {', '.join(options)}"


def _check_fields(node: Mapping, known: Sequence[str], where: str) -> None:
    for field in node:
        if field not in known:
            raise SpaceError(f"{where}.{field}: unknown field ({_hint(str(field), known)})")


def _number(where: str, value: Any) -> float:
    # YAML 1.1 reads 1e-3 (no dot) as a string: accept any string float() reads, but no
    # booleans (a bool is an int in Python) and nothing non-finite.
    try:
        x = float(value) if isinstance(value, (int, float, str)) and not isinstance(value, bool) else None
    except ValueError:
        x = None
    if x is None:
        raise SpaceError(f"{where}: {value!r} is not a number")
    if not math.isfinite(x):
        raise SpaceError(f"{where}: {value!r} is not a finite number")
    return x


def _keys(where: str, value: Any) -> tuple[str, ...]:
    keys = [value] if isinstance(value, str) else value
    if not isinstance(keys, (list, tuple)) or not keys:
        raise SpaceError(f"{where}: a config key or a non-empty list of them, got {value!r}")
    for key in keys:
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise SpaceError(f"{where}: {key!r} is not a config key (a dotted name such as optim.lr; "
                             "no +, = or spaces)")
    if len(set(keys)) != len(keys):
        raise SpaceError(f"{where}: a key is listed twice in {', '.join(keys)}")
    return tuple(keys)


def _prefix(key: str) -> str:
    return "++" if key.rpartition(".")[0] in FAMILY_DICTS else ""


def _override_text(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return repr(value) if isinstance(value, float) else str(value)


def _fixed(where: str, node: Any) -> tuple[str, ...]:
    """`fixed` as override strings. A mapping (nested, as `+spaces.adamw.fixed.optim.x=1` builds
    it, or with dotted keys) becomes key=value; a list holds override strings as written."""
    if node is None:
        return ()
    if isinstance(node, (list, tuple)):
        for item in node:
            if not isinstance(item, str) or "=" not in item:
                raise SpaceError(f"{where}: {item!r} is not an override (key=value)")
        return tuple(node)
    if not isinstance(node, Mapping):
        raise SpaceError(f"{where}: a mapping of config keys to values, got {node!r}")
    out: list[str] = []

    def walk(prefix: str, sub: Mapping) -> None:
        for k, v in sub.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, Mapping) and v:
                walk(key, v)
            elif isinstance(v, (list, tuple, Mapping)):
                raise SpaceError(f"{where}.{key}: a single value, got {v!r}")
            else:
                _keys(f"{where}.{key}", key)
                out.append(f"{_prefix(key)}{key}={_override_text(v)}")

    walk("", node)
    return tuple(out)


def _outside(scale: str, x: float, lo: Optional[float], hi: Optional[float]) -> Optional[str]:
    """Why x cannot be a point of a dim (its scale's domain, its hard bounds), or None."""
    if not _in_domain(scale, x):
        return f"is outside the {scale} scale (values must be {_DOMAIN[scale]})"
    if lo is not None and x < lo:
        return f"is below min {lo:g}"
    if hi is not None and x > hi:
        return f"is above max {hi:g}"
    return None


def _check_point(where: str, scale: str, x: float, lo: Optional[float], hi: Optional[float], what: str) -> None:
    if why := _outside(scale, x, lo, hi):
        raise SpaceError(f"{where}: {what} {x:g} {why}")


def _parse_dim(where: str, name: str, node: Any) -> Dim:
    if not isinstance(node, Mapping):
        raise SpaceError(f"{where}: a mapping of {', '.join(DIM_FIELDS)}, got {node!r}")
    _check_fields(node, DIM_FIELDS, where)
    # A null field is an absent one: an override like `spaces.adamw.lr.step=null` switches form.
    node = {k: v for k, v in node.items() if v is not None}
    for field in ("key", "scale", "init"):
        if field not in node:
            raise SpaceError(f"{where}.{field}: missing")
    keys = _keys(f"{where}.key", node["key"])
    scale = node["scale"]
    if scale not in SCALES:
        raise SpaceError(f"{where}.scale: {scale!r} is not a scale ({_hint(str(scale), SCALES, 'scales')})")
    integer = node.get("integer", False)
    if not isinstance(integer, bool):
        raise SpaceError(f"{where}.integer: true or false, got {integer!r}")
    lo = _number(f"{where}.min", node["min"]) if "min" in node else None
    hi = _number(f"{where}.max", node["max"]) if "max" in node else None
    if lo is not None and hi is not None and lo >= hi:
        raise SpaceError(f"{where}: min {lo:g} > max {hi:g}" if lo > hi else f"{where}: min = max = {lo:g}, an empty range")
    init = _number(f"{where}.init", node["init"])
    _check_point(f"{where}.init", scale, init, lo, hi, "init")
    if integer and init != round(init):
        raise SpaceError(f"{where}.init: {init:g} is not a whole number (integer: true)")
    grid = _grid(where, node, scale, integer, init, lo, hi)
    if len(set(grid)) != len(grid):
        raise SpaceError(f"{where}: the grid repeats a point ({', '.join(f'{x:g}' for x in grid)})")
    # init must be a point: matched in scale units, so 1e-3 finds 0.001 however it was computed.
    u_init = _to_unit(scale, init)
    match = [x for x in grid if abs(_to_unit(scale, x) - u_init) <= SHAPE_TOLERANCE * max(1.0, abs(u_init))]
    if not match:
        raise SpaceError(f"{where}.init={init:g} is not a point of its grid ({', '.join(f'{x:.4g}' for x in grid)})")
    return Dim(name, keys, scale, match[0], tuple(grid), lo, hi, integer)


def _grid(where: str, node: Mapping, scale: str, integer: bool, init: float, lo: Optional[float],
          hi: Optional[float]) -> list[float]:
    """The grid from exactly one of its three forms, each point checked against the bounds."""
    forms = [f for f, present in (("grid", "grid" in node), ("step", "step" in node),
                                  ("low/high", "low" in node or "high" in node)) if present]
    if not forms:
        raise SpaceError(f"{where}: no grid: give grid, (init, step, points) or (low, high, points)")
    if len(forms) > 1:
        raise SpaceError(f"{where}: {forms[0]} and {forms[1]} both given: use exactly one of grid, "
                         "(init, step, points), (low, high, points)")
    points = None
    if forms[0] == "grid":
        if "points" in node:
            raise SpaceError(f"{where}.points: not used with grid (the grid lists its points)")
    else:
        if "points" not in node:
            raise SpaceError(f"{where}.points: missing")
        points = node["points"]
        if isinstance(points, bool) or not isinstance(points, int):
            raise SpaceError(f"{where}.points: a whole number, got {points!r}")
        if points <= 0:
            raise SpaceError(f"{where}: an empty grid (points: {points})")

    if forms[0] == "grid":
        values = node["grid"]
        if not isinstance(values, (list, tuple)):
            raise SpaceError(f"{where}.grid: a list of values, got {values!r}")
        if not values:
            raise SpaceError(f"{where}.grid: empty")
        grid = [_number(f"{where}.grid", v) for v in values]
        for a, b in zip(grid, grid[1:]):
            if b <= a:
                raise SpaceError(f"{where}.grid: not increasing ({a:g} then {b:g}); list each point once, "
                                 "lowest first")
        for x in grid:
            _check_point(f"{where}.grid", scale, x, lo, hi, "point")
        grid = [_snap(scale, integer, x) for x in grid]
    elif forms[0] == "step":
        step = _number(f"{where}.step", node["step"])
        if scale == "linear" and step <= 0:
            raise SpaceError(f"{where}.step: {step:g} must be > 0 (added on a linear scale)")
        if scale != "linear" and step <= 1:
            raise SpaceError(f"{where}.step: {step:g} must be > 1 (a factor on a {scale} scale)")
        if points % 2 == 0:
            raise SpaceError(f"{where}.points: {points} is even; a grid centred on init needs an odd number")
        # log: init x step^k; log1m: 1 - (1 - init) x step^k, so the step is a factor on 1 - x.
        unit = step if scale == "linear" else math.log(step)
        u0 = _to_unit(scale, init)
        grid = [_snap(scale, integer, _from_unit(scale, u0 + k * unit)) for k in range(-(points // 2), points // 2 + 1)]
        for x in grid:
            if why := _outside(scale, x, lo, hi):
                raise SpaceError(f"{where}.step: the grid point {x:g} (init {init:g}, step {step:g}, "
                                 f"points {points}) {why}")
    else:
        for field in ("low", "high"):
            if field not in node:
                raise SpaceError(f"{where}.{field}: missing (low and high go together)")
        low, high = _number(f"{where}.low", node["low"]), _number(f"{where}.high", node["high"])
        if low > high:
            raise SpaceError(f"{where}: low {low:g} > high {high:g}")
        if low == high:
            raise SpaceError(f"{where}: low = high = {low:g}, an empty range")
        if points < 2:
            raise SpaceError(f"{where}.points: {points}; low and high need at least 2")
        _check_point(f"{where}.low", scale, low, lo, hi, "low")
        _check_point(f"{where}.high", scale, high, lo, hi, "high")
        ul, uh = _to_unit(scale, low), _to_unit(scale, high)
        grid = [_snap(scale, integer, _from_unit(scale, ul + (uh - ul) * k / (points - 1))) for k in range(points)]
    return grid


def parse_space(name: str, node: Mapping[str, Any]) -> Space:
    """The search space of side `name` from its config node (conf/tuning/<name>.yaml as a dict)."""
    where = f"spaces.{name}"
    if not isinstance(node, Mapping):
        raise SpaceError(f"{where}: a mapping of optimizer, fixed and the dimensions, got {node!r}")
    for field, value in node.items():  # a dim is a mapping: a plain value is a misspelled field
        if field not in SPACE_FIELDS and not isinstance(value, Mapping) and \
                difflib.get_close_matches(str(field), SPACE_FIELDS, n=1, cutoff=0.7):
            raise SpaceError(f"{where}.{field}: unknown field ({_hint(str(field), SPACE_FIELDS)})")
    optimizer = node.get("optimizer")
    if not optimizer:
        raise SpaceError(f"{where}.optimizer: missing (the optim= preset of this side, e.g. adamw)")
    if not isinstance(optimizer, str) or not _NAME.fullmatch(optimizer):
        raise SpaceError(f"{where}.optimizer: {optimizer!r} is not a preset name")
    fixed = _fixed(f"{where}.fixed", node.get("fixed"))
    dims_node = {k: v for k, v in node.items() if k not in SPACE_FIELDS}
    if not dims_node:
        raise SpaceError(f"{where}: no dimensions; a search space tunes at least one")
    dims = []
    owner: dict[str, str] = {}
    for dim_name, dim_node in dims_node.items():
        if not isinstance(dim_name, str) or not _NAME.fullmatch(dim_name):
            raise SpaceError(f"{where}.{dim_name}: a dimension name must be an identifier")
        dim = _parse_dim(f"{where}.{dim_name}", dim_name, dim_node)
        for key in dim.keys:
            if key in owner:
                raise SpaceError(f"{where}.{dim_name}.key: {key} is also set by {where}.{owner[key]}")
            owner[key] = dim_name
        dims.append(dim)
    for override in fixed:
        key = override.split("=", 1)[0].lstrip("+~")
        if key in owner:
            raise SpaceError(f"{where}.fixed: {key} is tuned by {where}.{owner[key]}; it cannot also be fixed")
    return Space(name, optimizer, fixed, tuple(dims))


def lr_space(space: Space, lr: float, step: float, points: int = 3) -> Space:
    """The lr-only space of a retune at a longer budget: `points` values centred on the side's
    chosen `lr`, `step` apart (a factor on the lr dim's own scale), within its bounds; the other
    dims stay at their 1x choice, so the caller adds them to each trial's values."""
    dim = space.dim("lr")
    node = {"key": list(dim.keys), "scale": dim.scale, "init": lr, "step": step, "points": points,
            "min": dim.lo_bound, "max": dim.hi_bound, "integer": dim.integer}
    return Space(space.name, space.optimizer, space.fixed, (_parse_dim(f"spaces.{space.name}.lr", "lr", node),))


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
        x = bound if inside and _in_domain(dim.scale, bound) else None
    if x is None or x == edge or not _in_domain(dim.scale, x):
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
        out += [f"{_prefix(key)}{key}={format_value(dim, values[dim.name])}" for key in dim.keys]
    return out


def held_overrides(dim: Dim) -> list[str]:
    """The train.py overrides that hold `dim` at its init: a dim a study does not tune
    (tuning.dims) joins the side's fixed overrides with the value it would have started from."""
    return [f"{_prefix(key)}{key}={format_value(dim, dim.init)}" for key in dim.keys]


def space_dict(space: Space) -> dict[str, Any]:
    """The space as plain data (plan.json): what the report and an audit read."""
    return {"optimizer": space.optimizer, "fixed": list(space.fixed),
            "dims": [{"name": d.name, "keys": list(d.keys), "scale": d.scale, "integer": d.integer,
                      "init": d.init, "grid": list(d.grid), "bounds": [d.lo_bound, d.hi_bound]}
                     for d in space.dims]}
