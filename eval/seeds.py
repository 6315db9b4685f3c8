"""Seeds: runs that differ only in their seed form one arm, whose final losses and ratios
are reported as mean +- standard error over its seeds.

A single seed per arm gives a figure with no error bar: two optimizers a few hundredths of a
nat apart cannot be told apart from seed noise. The standard error (not the spread of the
seeds) is what says how well the mean is known, and a 95% interval over a handful of seeds
must use Student's t, not 1.96.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from eval.compare import Run, Series, final_step, first_reach, in_run_ratio

# Config keys that do not change what a run computes, so runs that differ only in them are
# seeds of one arm: the seed itself, the run's name, where and how it logs, checkpoints and
# profiles, and how the ranks are laid out (parallel == single-process, tested elsewhere).
IGNORED_KEYS = frozenset({"seed", "name", "logger", "checkpoint", "profile", "parallel"})

# Student's t, two-sided 95% (the 0.975 quantile), by degrees of freedom. Between two entries
# the smaller df's value is used: the wider interval, never a too-narrow one.
_T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
          9: 2.262, 10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000, 120: 1.980}

CurveOf = Callable[[Run, str], Series]  # a run's curve of a metric (e.g. smoothed train loss)


def t_975(df: int) -> float:
    if df < 1:
        raise ValueError(f"a t interval needs at least 1 degree of freedom, got {df}")
    return _T_975[max(k for k in _T_975 if k <= df)]


@dataclass(frozen=True)
class Estimate:
    """A mean over seeds; `se` is None for a single seed (nothing to estimate it from)."""
    mean: float
    se: Optional[float]
    n: int
    df: Optional[int] = None  # degrees of freedom of the 95% interval

    @property
    def half_width_95(self) -> Optional[float]:
        return None if self.se is None or not self.df else t_975(self.df) * self.se

    def format(self, spec: str = ".4f") -> str:
        if self.se is None:
            return format(self.mean, spec)
        return f"{format(self.mean, spec)} ± {format(self.se, spec)}"


def estimate(values: list[float]) -> Optional[Estimate]:
    if not values:
        return None
    n = len(values)
    if n == 1:
        return Estimate(values[0], None, 1)
    return Estimate(math.fsum(values) / n, statistics.stdev(values) / math.sqrt(n), n, n - 1)


def last_step(run: Run) -> int:
    return max((steps[-1] for steps, _ in run.series.values() if steps), default=0)


@dataclass
class Arm:
    """One setting (optimizer, lr, schedule, model, data, ...) and its runs, one per seed."""
    runs: list[Run]

    @property
    def first(self) -> Run:
        return self.runs[0]

    @property
    def optimizer(self) -> str:
        return self.first.optimizer

    @property
    def lr(self) -> Optional[float]:
        return self.first.lr

    @property
    def path(self) -> Path:
        return self.first.path

    @property
    def corpus(self) -> str:
        return self.first.corpus

    @property
    def seeds(self) -> list[Optional[int]]:
        return [run.seed for run in self.runs]

    @property
    def label(self) -> str:
        n = len(self.runs)
        return self.first.label + (f" ({n} seeds)" if n > 1 else "")

    def final_estimate(self, key: str) -> Optional[Estimate]:
        return estimate([v for v in (run.final(key) for run in self.runs) if v is not None])

    def median_estimate(self, key: str) -> Optional[Estimate]:
        """Each seed's median of `key` over its logged steps but the first, which carries
        compilation and warm-up, then mean +- se over the seeds: what a step of the setting
        costs (perf/step_s, perf/optim_step_s), robust to a stall at one logged step."""
        return estimate([statistics.median(run.series[key][1][1:]) for run in self.runs
                         if key in run.series and len(run.series[key][1]) > 1])

    def final(self, key: str) -> Optional[float]:
        """The mean final value over the seeds: what the best lr is chosen by."""
        est = self.final_estimate(key)
        return None if est is None else est.mean

    def final_step(self, key: str) -> Optional[int]:
        return final_step(self.first, key)  # every seed of an arm ran equally long

    def curve(self, key: str, curve_of: Optional[CurveOf] = None
              ) -> Optional[tuple[list[int], list[float], list[Optional[float]]]]:
        """Mean and standard error at every step that each seed logged; None if none did."""
        curves = [(curve_of or _series)(run, key) for run in self.runs if key in run.series]
        if not curves:
            return None
        by_step = [dict(zip(*c)) for c in curves]
        steps = sorted(set.intersection(*(set(d) for d in by_step)))
        points = [estimate([d[s] for d in by_step]) for s in steps]
        return steps, [p.mean for p in points], [p.se for p in points]  # type: ignore[union-attr]

    def mean_series(self, key: str, curve_of: Optional[CurveOf] = None) -> Optional[Series]:
        c = self.curve(key, curve_of)
        return None if c is None else (c[0], c[1])


def _series(run: Run, key: str) -> Series:
    return run.series[key]


def _arm_key(run: Run) -> tuple:
    if run.seed is None:  # no config to tell seeds apart by: a run of its own
        return ("run", str(run.path))
    settings = {k: v for k, v in run.config.items() if k not in IGNORED_KEYS}
    # A different length is a different schedule even where the config was edited in place.
    return ("settings", json.dumps(settings, sort_keys=True, default=str), last_step(run))


def group_arms(runs: list[Run]) -> list[Arm]:
    """Runs whose configs are equal but for the seed (and IGNORED_KEYS) and that ran equally
    long: one arm each, runs in seed order, arms in the order of their first run. Two runs of
    one arm with the same seed are refused: a repeat would count twice as independent."""
    arms: dict[tuple, Arm] = {}
    for run in runs:
        arm = arms.setdefault(_arm_key(run), Arm([]))
        twin = next((r for r in arm.runs if r.seed == run.seed), None)
        if twin is not None:
            raise ValueError(f"runs {twin.path} and {run.path} have the same settings and seed {run.seed}; "
                             "keep one, or a repeat counts as a second seed")
        arm.runs.append(run)
    for arm in arms.values():
        arm.runs.sort(key=lambda r: r.seed)
    return list(arms.values())


def seed_pairs(a: Arm, b: Arm) -> list[tuple[Run, Run]]:
    """Runs of A and B with the same seed: a seed gives both optimizers the same initial
    weights and batches, so a ratio taken within a pair does not carry that noise. Arms that
    share no seed are paired in seed order."""
    b_by_seed = {run.seed: run for run in b.runs}
    shared = [(run, b_by_seed[run.seed]) for run in a.runs if run.seed in b_by_seed]
    return shared or list(zip(a.runs, b.runs))


@dataclass
class SeededInRunRatio:
    ratio: Estimate  # over seed pairs
    steps_b: float  # means over the pairs
    steps_a: float
    reference: str  # whose final loss the crossings are at: "A", "B", or "A/B" when pairs differ


def in_run_ratio_over_seeds(a: Arm, b: Arm, key: str, curve_of: CurveOf) -> Optional[SeededInRunRatio]:
    """The in-run ratio of each seed pair, then its mean +- standard error."""
    ratios = []
    for run_a, run_b in seed_pairs(a, b):
        if key in run_a.series and key in run_b.series:
            r = in_run_ratio(curve_of(run_a, key), curve_of(run_b, key))
            if r is not None:
                ratios.append(r)
    if not ratios:
        return None
    reference = "/".join(sorted({r.reference for r in ratios}))
    return SeededInRunRatio(estimate([r.ratio for r in ratios]),  # type: ignore[arg-type]
                            statistics.fmean(r.steps_b for r in ratios),
                            statistics.fmean(r.steps_a for r in ratios), reference)


@dataclass
class SeededScheduleRatio:
    """The schedule ratio at the mean finals, with its standard error by the delta method."""
    lengths: list[float]  # ascending
    finals: list[Estimate]
    target: Estimate
    ratio: Optional[float]
    se: Optional[float]  # None: a contributing arm has one seed, or there is no crossing
    df: Optional[int]

    @property
    def half_width_95(self) -> Optional[float]:
        if self.ratio is None:
            return None
        return Estimate(self.ratio, self.se, 0, self.df).half_width_95


def schedule_ratio_over_seeds(target: Estimate, lengths: list[float], finals: list[Estimate]
                              ) -> SeededScheduleRatio:
    """The ratio is where the chord between B's mean finals at the two lengths around the
    crossing meets A's mean final. Moving A's final by d moves the ratio by d / slope, and
    moving B's interpolated final (weights 1-t and t on the two lengths) likewise, so with
    independent seeds var(ratio) = (se_A^2 + (1-t)^2 se_lo^2 + t^2 se_hi^2) / slope^2. This
    assumes the noise does not move the crossing into another segment; its degrees of
    freedom are the smallest of the three arms' (conservative)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    lengths, finals = [lengths[i] for i in order], [finals[i] for i in order]
    means = [f.mean for f in finals]
    ratio = first_reach((lengths, means), target.mean)  # type: ignore[arg-type]
    result = SeededScheduleRatio(lengths, finals, target, ratio, None, None)
    hi = next((i for i, m in enumerate(means) if m <= target.mean), None)
    if ratio is None or hi is None or hi == 0:
        return result  # not reached, or already reached at the shortest length
    lo = hi - 1
    parts = (target, finals[lo], finals[hi])
    slope = (means[hi] - means[lo]) / (lengths[hi] - lengths[lo])
    if slope == 0 or any(p.se is None for p in parts):
        return result
    t = (ratio - lengths[lo]) / (lengths[hi] - lengths[lo])
    variance = target.se ** 2 + ((1 - t) * finals[lo].se) ** 2 + (t * finals[hi].se) ** 2  # type: ignore[operator]
    result.se = math.sqrt(variance) / abs(slope)
    result.df = min(p.n for p in parts) - 1
    return result


def paired_difference(arm: Arm, base: Arm, key: str) -> Optional[Estimate]:
    """`arm`'s final minus `base`'s, taken within each seed both ran, then mean +- standard
    error over those seeds. A seed gives both settings the same initial weights and batches,
    so most of the seed noise cancels in the difference: two Muon variants a few hundredths of
    a nat apart can be told apart where their unpaired intervals overlap. None when the two
    share no seed (pairing runs of different seeds would cancel nothing)."""
    pairs = [(run, partner) for run, partner in seed_pairs(arm, base)
             if run.seed is not None and run.seed == partner.seed]  # not seed_pairs' fallback
    finals = [(run.final(key), partner.final(key)) for run, partner in pairs]
    return estimate([value - reference for value, reference in finals if value is not None and reference is not None])
