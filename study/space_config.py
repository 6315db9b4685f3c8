"""A search space read from its config node (conf/tuning/<side>.yaml, or the study's
spaces.<side> overrides): every field checked, every malformed input one line naming
`spaces.<side>.<dim>.<field>`. The space itself and its grid arithmetic: study/search_space.py.

Input is plain dicts (an OmegaConf container converted with `to_container`), so this module
needs only the standard library.
"""
from __future__ import annotations

import difflib
import math
import re
from typing import Any, Mapping, Optional, Sequence

from study.search_space import (SCALES, SHAPE_TOLERANCE, SPACE_FIELDS, Dim, Space, SpaceError, in_domain,
                               override_prefix, scale_from_unit, scale_to_unit, snap_value)

DIM_FIELDS = ("key", "scale", "init", "grid", "step", "points", "low", "high", "min", "max", "integer")
_KEY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_NAME = re.compile(r"[A-Za-z_]\w*")
_DOMAIN = {"log": "> 0", "log1m": "< 1"}  # what each scale's transform needs of a value


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
                out.append(f"{override_prefix(key)}{key}={_override_text(v)}")

    walk("", node)
    return tuple(out)


def _outside(scale: str, x: float, lo: Optional[float], hi: Optional[float]) -> Optional[str]:
    """Why x cannot be a point of a dim (its scale's domain, its hard bounds), or None."""
    if not in_domain(scale, x):
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
    u_init = scale_to_unit(scale, init)
    match = [x for x in grid if abs(scale_to_unit(scale, x) - u_init) <= SHAPE_TOLERANCE * max(1.0, abs(u_init))]
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
        grid = [snap_value(scale, integer, x) for x in grid]
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
        u0 = scale_to_unit(scale, init)
        grid = [snap_value(scale, integer, scale_from_unit(scale, u0 + k * unit)) for k in range(-(points // 2), points // 2 + 1)]
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
        ul, uh = scale_to_unit(scale, low), scale_to_unit(scale, high)
        grid = [snap_value(scale, integer, scale_from_unit(scale, ul + (uh - ul) * k / (points - 1))) for k in range(points)]
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
