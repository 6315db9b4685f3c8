"""How much the speedup of a fair study depends on the way it is read: second estimates beside
the headline (study/speedup.py), each from the same records.

- The power law, as Wen et al. read a data budget: the slower side's end-of-schedule losses over
  its budgets fitted with L(D) = a * D^-b + c, and the tokens it needs to reach the faster
  side's 1x loss read from the fit, with the bootstrap's own replicates. A crossing past the
  budgets run is then a number, marked extrapolated, not a bound.
- The speedup anchored at each budget of the target, not only at 1x.
- The speedup replayed with the first k tuning trials of each side (k = 1 .. trials), under the
  same selection rule: the config chosen among those k, its final losses taken as the chosen
  config's moved by their tuning-loss gap (the re-selection's own model). At k = trials it is
  the headline. If the last doubling of k moved it by more than half its interval's width, more
  tuning could still move the answer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from study.speedup import Comparison, Ratio, Side, _ratio, isotonic_decreasing, replicate_means

# The exponents b the power-law fit tries (a log grid, then a golden-section refinement):
# a loss curve over a few budgets of one schedule rarely supports b outside it.
B_RANGE = (0.01, 3.0)


@dataclass(frozen=True)
class PowerLaw:
    a: float
    b: float
    c: float

    def loss(self, tokens: float) -> float:
        return self.a * tokens ** -self.b + self.c

    def tokens_to(self, level: float) -> Optional[float]:
        """The tokens at which the fit reaches `level`; None below its asymptote c."""
        if level <= self.c:
            return None
        return (self.a / (level - self.c)) ** (1.0 / self.b)


def fit_power_laws(tokens: Sequence[float], losses: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Least squares of L = a * (D / D0)^-b + c, one fit per row of `losses` ([R, budgets], all
    finite; D0 the first budget, so that a is a loss): for each b, a and c in closed form; b from
    a log grid over B_RANGE, then a golden-section search around each row's best. Returns
    (a, b, c) per row in raw tokens; a <= 0 marks a row with no decreasing fit."""
    y = np.asarray(losses, dtype=float)
    x = np.asarray(tokens, dtype=float) / float(tokens[0])
    n = x.size

    def solve(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # b: [R] -> a, c, residual
        u = x[None, :] ** -b[:, None]
        su, suu = u.sum(axis=1), (u * u).sum(axis=1)
        sy, suy = y.sum(axis=1), (u * y).sum(axis=1)
        det = n * suu - su * su
        a = np.where(det > 0, (n * suy - su * sy) / np.where(det > 0, det, 1.0), 0.0)
        c = (sy - a * su) / n
        residual = ((a[:, None] * u + c[:, None] - y) ** 2).sum(axis=1)
        return a, c, residual

    rows = y.shape[0]
    grid = np.exp(np.linspace(math.log(B_RANGE[0]), math.log(B_RANGE[1]), 80))
    errors = np.stack([solve(np.full(rows, g))[2] for g in grid], axis=1)
    best = np.argmin(errors, axis=1)
    lo, hi = grid[np.maximum(best - 1, 0)], grid[np.minimum(best + 1, len(grid) - 1)]
    golden = (math.sqrt(5) - 1) / 2
    for _ in range(40):
        m1, m2 = hi - golden * (hi - lo), lo + golden * (hi - lo)
        left = solve(m1)[2] <= solve(m2)[2]
        hi, lo = np.where(left, m2, hi), np.where(left, lo, m1)
    b = (lo + hi) / 2
    a, c, _ = solve(b)
    return a * float(tokens[0]) ** b, b, c  # a (D/D0)^-b = (a D0^b) D^-b


def fit_power_law(tokens: Sequence[float], losses: Sequence[float]) -> Optional[PowerLaw]:
    """The fit of one curve over its finite points; None with fewer than 3 or no decreasing fit."""
    pts = [(float(t), float(v)) for t, v in zip(tokens, losses) if math.isfinite(v)]
    if len(pts) < 3:
        return None
    a, b, c = fit_power_laws([t for t, _ in pts], np.array([[v for _, v in pts]]))
    return PowerLaw(float(a[0]), float(b[0]), float(c[0])) if a[0] > 0 else None


@dataclass(frozen=True)
class PowerLawSpeedup:
    """The power-law estimate of a speedup: its value (None: the slower side's fit never gets
    there), whether that lies past the budgets run, and its bootstrap interval."""

    value: Optional[float]
    extrapolated: bool
    lo: Optional[float]
    hi: Optional[float]
    unreachable_share: float

    def format(self) -> str:
        if self.value is None:
            return "never (below the fit's asymptote)"
        text = f"{self.value:.2f}x" + (", extrapolated" if self.extrapolated else "")
        if self.lo is not None and self.hi is not None:
            text += f" ({self.lo:.2f}x to {self.hi:.2f}x)"
        return text


def _power_law_ratios(tokens: Sequence[float], mt: np.ndarray, mb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of mean final losses ([R, budgets] each side): (speedup, extrapolated); the speedup
    NaN where the slower side's fit cannot be made or never gets there. The faster side's level
    is its monotone fit at 1x, as in the headline; the slower side's fit is over its means."""
    rows = mt.shape[0]
    ft0 = np.array([isotonic_decreasing(r)[0] for r in mt.tolist()])
    fb0 = np.array([isotonic_decreasing(r)[0] for r in mb.tolist()])
    behind = fb0 > ft0  # the baseline is behind: it must reach the target's 1x loss
    slower = np.where(behind[:, None], mb, mt)
    level = np.where(behind, ft0, fb0)
    ratio = np.full(rows, math.nan)
    extrapolated = np.zeros(rows, dtype=bool)
    ok = np.isfinite(slower).all(axis=1) & np.isfinite(level)
    if ok.any():
        a, b, c = fit_power_laws(tokens, slower[ok])
        lev = level[ok]
        with np.errstate(all="ignore"):
            reached = np.where((a > 0) & (lev > c), (a / (lev - c)) ** (1.0 / b), math.nan)
        r = np.maximum(reached / float(tokens[0]), 1.0)
        r = np.where(behind[ok], r, 1.0 / r)
        ratio[ok] = r
        extrapolated[ok] = reached > float(tokens[-1])
    return ratio, extrapolated


def power_law_ratio(tokens: Sequence[float], target_means: Sequence[float],
                    base_means: Sequence[float]) -> tuple[Optional[float], bool]:
    """(speedup, extrapolated) from one set of mean final losses per budget: the slower side's
    power-law fit read at the faster side's 1x loss. None where the fit cannot be made or never
    gets there."""
    ratio, extrapolated = _power_law_ratios(tokens, np.array([target_means], dtype=float),
                                            np.array([base_means], dtype=float))
    return (None, False) if math.isnan(ratio[0]) else (float(ratio[0]), bool(extrapolated[0]))


def power_law_speedup(target: Side, base: Side, replicates: int, seed: int,
                      correction: str = "t") -> PowerLawSpeedup:
    tokens = list(target.tokens)
    value, extrapolated = power_law_ratio(tokens, target.means, base.means)
    if replicates == 0:
        return PowerLawSpeedup(value, extrapolated, None, None, 0.0)
    mt, mb = replicate_means(target, base, replicates, seed, correction)
    draws, _ = _power_law_ratios(tokens, mt, mb)
    finite = np.sort(draws[np.isfinite(draws)])
    unreachable = 1 - len(finite) / replicates
    if len(finite) < 0.95 * replicates:  # too many replicates never get there for an interval
        return PowerLawSpeedup(value, extrapolated, None, None, unreachable)
    rank = max(1, math.floor(0.025 * (len(finite) + 1)))
    return PowerLawSpeedup(value, extrapolated, float(finite[rank - 1]), float(finite[len(finite) - rank]),
                           unreachable)


def anchored(target: Side, base: Side) -> list[Ratio]:
    """The speedup anchored at each of the target's budgets (the first is the headline's)."""
    tt, bt = list(target.tokens), list(base.tokens)
    xt, xb = [math.log(t) for t in tt], [math.log(t) for t in bt]
    ft, fb = isotonic_decreasing(target.means), isotonic_decreasing(base.means)
    return [_ratio(xt, tt, ft, xb, bt, fb, at) for at in range(len(tt))]


def first_k_gap(side: Side, k: int) -> float:
    """The tuning-loss gap of the config chosen among the first k tuning trials over the one
    chosen among all of them (>= 0; 0 without a selection): the argmin, first of ties."""
    objectives = side.selection[0]
    if len(objectives) == 0:
        return 0.0
    best = int(np.argmin(objectives[:k]))
    return float(objectives[best] - objectives[side.chosen[0]])


def replay_k(target: Side, base: Side, k: int) -> Ratio:
    """The speedup had each side stopped tuning after its first k trials (see the docstring)."""
    tt, bt = list(target.tokens), list(base.tokens)
    xt, xb = [math.log(t) for t in tt], [math.log(t) for t in bt]
    mt = [m + first_k_gap(target, k) for m in target.means]
    mb = [m + first_k_gap(base, k) for m in base.means]
    return _ratio(xt, tt, isotonic_decreasing(mt), xb, bt, isotonic_decreasing(mb))


def still_moving(replayed: Sequence[Ratio], headline: Comparison) -> Optional[str]:
    """Why more tuning could still move the answer, or None: the last doubling of k (from
    k = trials / 2 to trials) moved the speedup by more than half its interval's width."""
    trials = len(replayed)
    if trials < 2 or headline.lo is None or headline.hi is None:
        return None
    half, full = replayed[trials // 2 - 1], replayed[-1]
    if half.censored or full.censored:
        moved = half != full
        return f"the speedup read {half.format()} at k = {trials // 2} and {full.format()} at k = {trials}" if moved \
            else None
    width = headline.hi.value - headline.lo.value
    if abs(full.value - half.value) > width / 2:
        return (f"the last doubling of the trials (k = {trials // 2} to {trials}) moved it from {half.format()} to "
                f"{full.format()}, more than half its interval's width ({width:.2f})")
    return None
