"""The screen: before coordinate descent, every setting of each side (held ones included) tried
one grid step either side of the start, on both sides alike, and the start itself on the tuning
seeds and tuning.noise_seeds, whose spread is the seed noise. A setting whose better neighbour
beats the start by more than that noise, on either side, joins both sides' descent, even where
tuning.dims left it out: a held setting is then inherited only where nothing says it matters.

The screen's runs are recorded like any others (stage "screen"); which settings joined follows
from them, so the runner and a report made from the records later (study/search_state.py) read
the same descent space.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from study.records import Entry
from study.search_space import Dim, Space, extension_point, held_overrides
from study.space_config import parse_space


@dataclass(frozen=True)
class ScreenTrial:
    ordinal: int
    dim: Optional[str]          # None: the start
    reason: str                 # "start", "low" or "high"
    values: dict[str, float]


def neighbours(dim: Dim) -> list[tuple[str, float]]:
    """The grid points one step below and above the dim's start (an extension where the start
    sits at an edge of its grid); none for a one-point dim or past a hard bound."""
    grid = list(dim.grid)
    i = grid.index(dim.init)
    out = []
    for reason, j, side in (("low", i - 1, "low"), ("high", i + 1, "high")):
        point = grid[j] if 0 <= j < len(grid) else extension_point(dim, grid, side)
        if point is not None:
            out.append((reason, point))
    return out


def screen_trials(space: Space) -> list[ScreenTrial]:
    """The start, then each dim's two neighbours in the space's order."""
    start = space.initial()
    trials = [ScreenTrial(0, None, "start", start)]
    for dim in space.dims:
        for reason, point in neighbours(dim):
            trials.append(ScreenTrial(len(trials), dim.name, reason, {**start, dim.name: point}))
    return trials


def full_space(plan: dict[str, Any], side: str) -> Space:
    """Every setting of `side`, held ones included, each starting where the study starts."""
    node = (plan.get("full_spaces") or {}).get(side) or plan["spaces"][side]
    return parse_space(side, node)


@dataclass
class ScreenResult:
    noise: dict[str, float]                # per side: the sd of the start over its seeds
    gains: dict[str, dict[str, float]]     # per side and dim: start - its better neighbour (+: better)
    joined: list[str]                      # held dims that join the descent, in the full space's order

    def lines(self) -> list[str]:
        out = []
        for side, gains in self.gains.items():
            shown = ", ".join(f"{d} {g:+.4f}" for d, g in sorted(gains.items(), key=lambda kv: -kv[1]))
            out.append(f"{side}: seed noise {self.noise[side]:.4f}; gains over the start: {shown}")
        out.append("joined the descent: " + (", ".join(self.joined) or "none"))
        return out


def _mean(values: list[float]) -> float:
    return math.inf if not values or any(math.isinf(v) for v in values) else math.fsum(values) / len(values)


def screen_result(plan: dict[str, Any], entries: list[Entry]) -> Optional[ScreenResult]:
    """What the recorded screen found, or None for a study without one (or not screened yet)."""
    if not plan["tuning"].get("screen"):
        return None
    tune_seeds = set(plan["tuning"]["seeds"])
    noise, gains = {}, {}
    for side in (plan["target"], plan["baseline"]):
        runs = [e for e in entries if e.stage == "screen" and e.side == side]
        if not runs:
            return None
        start = [e.score for e in runs if e.dim is None]
        finite = [v for v in start if math.isfinite(v)]
        noise[side] = float(np.std(finite, ddof=1)) if len(finite) > 1 else 0.0
        base = _mean([e.score for e in runs if e.dim is None and e.seed in tune_seeds])
        by_dim: dict[str, dict[int, list[float]]] = {}
        for e in runs:
            if e.dim is not None:
                by_dim.setdefault(e.dim, {}).setdefault(e.ordinal, []).append(e.score)
        gains[side] = {dim: base - min(_mean(scores) for scores in trials.values())
                       for dim, trials in by_dim.items()}
    tuned = set(plan["spaces"][plan["target"]]) - {"optimizer", "fixed"}
    order = full_space(plan, plan["target"]).names
    joined = [d for d in order if d not in tuned and any(
        math.isfinite(gains[side].get(d, -math.inf)) and gains[side].get(d, -math.inf) > noise[side] for side in gains)]
    return ScreenResult(noise, gains, joined)


def descent_node(plan: dict[str, Any], side: str, joined: list[str]) -> dict[str, Any]:
    """The space `side` descends over: the plan's (its tuning.dims), with the `joined` dims taken
    back from the held ones, in the full space's order, their held overrides dropped."""
    node = plan["spaces"][side]
    if not joined:
        return node
    full_node = (plan.get("full_spaces") or {})[side]
    full = parse_space(side, full_node)
    drop = {o for d in full.dims if d.name in joined for o in held_overrides(d)}
    out = {"optimizer": node["optimizer"], "fixed": [o for o in node.get("fixed", []) if o not in drop]}
    for name in full.names:
        if name in node or name in joined:
            out[name] = copy.deepcopy(full_node[name] if name in joined else node[name])
    return out


def descent_space(plan: dict[str, Any], entries: list[Entry], side: str) -> Space:
    result = screen_result(plan, entries)
    return parse_space(side, descent_node(plan, side, result.joined if result else []))
