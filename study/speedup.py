"""Speedup of one optimizer (the target) over another (the baseline) from end-of-schedule losses,
with a bootstrap interval that covers the choice of hyperparameters as well as seed noise.

The speedup is the tokens the baseline needs to reach the target's final loss at the target's
1x budget, divided by the target's 1x tokens. Each side ran its chosen config to the end of
its schedule at a few token budgets (1x, 1.5x, 2x, 3x, ...) with the same fresh seeds: only
those end points enter, because a loss read mid-schedule is taken before that run's lr has
decayed, so it says how a longer schedule is going, not what that many tokens reach (Wen et
al.). A ratio read from intermediate checkpoints may be shown by the report, labelled as
such; it is never computed here.

Between budgets the loss is interpolated linearly in log tokens, after a monotone
(non-increasing) fit: more tokens with a schedule made for them never hurt, so a budget
whose mean comes out above a shorter one's is seed noise, and pooling it keeps a crossing
unique. A crossing outside the budgets run is a bound ("> 3.00x", "< 0.33x"), never
extrapolated. Diverged or crashed runs are +inf losses: a budget with one is never "reached",
which counts against the side that diverged.

Everything here is plain arrays, numpy and `math`, so synthetic curves test it without runs;
design56 §8 has the reasoning, and tests/test_speedup.py the checks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import numpy as np

BOUNDS = ("=", ">", "<")
CORRECTIONS = ("t", "variance", "none")  # the seed resampling's small-sample correction

# Student's t 0.975 quantiles by degrees of freedom (standard table values); beyond 30 the
# Cornish-Fisher expansion below is within 1e-4 of them. Used to calibrate the bootstrap at
# a handful of seeds (see _seed_expansion).
_T_975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
          2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
          2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423)
_Z_975 = 1.959963984540054


def t_975(df: int) -> float:
    if df < 1:
        raise ValueError(f"a t quantile needs at least 1 degree of freedom, got {df}")
    if df <= len(_T_975):
        return _T_975[df - 1]
    z = _Z_975
    return (z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3))


def mean(values: Sequence[float]) -> float:
    """The mean, exactly rounded (fsum) whatever the order, so a report is byte-identical on
    any machine; one +inf (a diverged run) makes it +inf."""
    values = [float(v) for v in values]
    if any(math.isinf(v) or math.isnan(v) for v in values):
        return math.inf
    return math.fsum(values) / len(values)


def isotonic_decreasing(y: Sequence[float], w: Optional[Sequence[float]] = None) -> np.ndarray:
    """The weighted least-squares non-increasing fit of y (pool adjacent violators).

    Non-finite entries (diverged budgets) stay +inf and take no part in the pooling: the fit
    is non-increasing over the finite ones, and an inf budget is simply never reached. Pooled
    values are fsum weighted means of the raw values, so they do not depend on the merge order.
    """
    y = [float(v) for v in y]
    if w is None and all(map(math.isfinite, y)) and all(a >= b for a, b in zip(y, y[1:])):
        return np.array(y)  # nothing to pool: most of a bootstrap's replicates, so most calls
    w = [1.0] * len(y) if w is None else [float(v) for v in w]
    if len(w) != len(y):
        raise ValueError(f"{len(y)} values but {len(w)} weights")
    finite = [i for i, v in enumerate(y) if math.isfinite(v)]
    if any(not w[i] > 0 for i in finite):
        raise ValueError(f"weights of finite values must be positive, got {w}")
    blocks: list[tuple[float, list[int]]] = []  # (pooled value, indices into y), left to right
    for i in finite:
        value, members = y[i], [i]
        while blocks and blocks[-1][0] < value:  # a later value above an earlier one: pool
            members = blocks.pop()[1] + members
            value = (math.fsum(w[j] * y[j] for j in members) / math.fsum(w[j] for j in members))
        blocks.append((value, members))
    out = np.full(len(y), math.inf)
    for value, members in blocks:
        out[members] = value
    return out


def reach(log_tokens: Sequence[float], fitted: Sequence[float], level: float) -> Optional[float]:
    """The smallest log-token at which the piecewise-linear fit is <= level; None when no
    budget measured gets there. A segment next to an inf budget is inf except at its finite
    end: a diverged budget is not interpolated across."""
    x = [float(v) for v in log_tokens]
    f = [float(v) for v in fitted]
    if f[0] <= level:
        return x[0]
    for i in range(len(f) - 1):
        a, b = f[i], f[i + 1]  # a > level here, or the previous step returned
        if b <= level:
            if math.isinf(a):
                return x[i + 1]
            return x[i] + (a - level) / (a - b) * (x[i + 1] - x[i])
    return None


@dataclass(frozen=True)
class Ratio:
    """A speedup, or a bound on it when the crossing lies outside the budgets run: bound ">"
    (the baseline never reached the target's loss: value = its max tokens / the 1x tokens) or
    "<" (the mirrored case: value = the 1x tokens / the target's max tokens)."""
    value: float
    bound: str = "="

    def __post_init__(self) -> None:
        if self.bound not in BOUNDS:
            raise ValueError(f"bound must be one of {BOUNDS}, got {self.bound!r}")
        if not (math.isfinite(self.value) and self.value > 0):
            raise ValueError(f"a ratio is finite and positive, got {self.value}")

    def format(self, spec: str = ".2f") -> str:
        """'1.30x', '> 3.00x', '< 0.33x'."""
        number = f"{format(self.value, spec)}x"
        return number if self.bound == "=" else f"{self.bound} {number}"

    @property
    def censored(self) -> bool:
        return self.bound != "="

    def as_float(self) -> float:
        """The order the bootstrap sorts by: '>' above every measured ratio, '<' below."""
        return {"=": self.value, ">": math.inf, "<": 0.0}[self.bound]

    def to_dict(self) -> dict:
        return {"value": float(self.value), "bound": self.bound}

    @classmethod
    def from_dict(cls, data: Mapping) -> "Ratio":
        return cls(float(data["value"]), str(data["bound"]))


def _check_tokens(tokens: Sequence[float], who: str) -> list[float]:
    tokens = [float(t) for t in tokens]
    if not tokens or any(not (math.isfinite(t) and t > 0) for t in tokens):
        raise ValueError(f"{who}: tokens must be positive and finite, got {tokens}")
    if any(b <= a for a, b in zip(tokens, tokens[1:])):
        raise ValueError(f"{who}: tokens must be strictly ascending, got {tokens}")
    return tokens


def _ratio(xt: list[float], tt: list[float], ft: np.ndarray,
           xb: list[float], bt: list[float], fb: np.ndarray, at: int = 0) -> Ratio:
    """The speedup from both sides' fitted curves (x = log tokens, t = tokens, f = the fit;
    xt[0] == xb[0] is the 1x budget), anchored at budget `at` of both (0: the 1x budget, the
    headline). A crossing at a budget, and a bound, are divided in tokens, so that 3x is exactly
    3 and not exp(log 3)."""
    l_star, l_0 = ft[at], fb[at]  # the target's loss at the anchor; the baseline's
    # (Both inf, both diverged at 1x, takes the second branch and gives 1: no evidence either way.)
    if l_0 > l_star:  # the baseline is behind at equal tokens: how far must it go?
        x = reach(xb, fb, l_star)
        if x is None:
            return Ratio(bt[-1] / bt[at], ">")
        return Ratio(bt[xb.index(x)] / bt[at] if x in xb else math.exp(x - xb[at]))
    # The baseline is at least as good at 1x: mirrored, the tokens the target needs to reach
    # the baseline's 1x loss, inverted, so the ratio goes below 1; both branches give 1 at L0 = L*.
    x = reach(xt, ft, l_0)
    if x is None:
        return Ratio(tt[at] / tt[-1], "<")
    return Ratio(tt[at] / tt[xt.index(x)] if x in xt else math.exp(xt[at] - x))


def speedup(target_tokens: Sequence[float], target_means: Sequence[float],
            base_tokens: Sequence[float], base_means: Sequence[float],
            target_weights: Optional[Sequence[float]] = None,
            base_weights: Optional[Sequence[float]] = None) -> Ratio:
    """The speedup of the target over the baseline from each side's mean final loss per
    budget (inf: a run there diverged). Both sides' first budget is the 1x budget, in the same
    tokens; the weights (default equal) are the number of finite seeds per budget."""
    tt, bt = _check_tokens(target_tokens, "target"), _check_tokens(base_tokens, "baseline")
    if tt[0] != bt[0]:
        raise ValueError(f"both sides start at the 1x budget: target {tt[0]} vs baseline {bt[0]} tokens")
    if len(target_means) != len(tt) or len(base_means) != len(bt):
        raise ValueError("one mean per budget on each side")
    return _ratio([math.log(t) for t in tt], tt, isotonic_decreasing(target_means, target_weights),
                  [math.log(t) for t in bt], bt, isotonic_decreasing(base_means, base_weights))


def _array(values, what: str, ndim: int) -> np.ndarray:
    """A read-only float copy, NaN (a crashed run's loss) turned into +inf."""
    out = np.array(values, dtype=float)
    if out.ndim != ndim:
        raise ValueError(f"{what} must be {ndim}-D, got shape {out.shape}")
    out[np.isnan(out)] = math.inf
    out.setflags(write=False)
    return out


@dataclass(frozen=True, eq=False)
class Side:
    """One optimizer's results on one reported split (design56 §8.1).

    tokens: each budget's tokens, ascending; tokens[0] is the 1x budget.
    finals: [budgets, seeds] end-of-schedule losses; inf (or NaN) = diverged/crashed. The seed
        axis is the study's seeds in order, the same on both sides, which pairs them.
    seeds: the seed ids of that axis; sides pair only when theirs are equal (None: 0..n-1).
    selection: per budget, the recorded objectives (tune split) of the trials the config used
        at that budget was chosen from: budget 0 the tuning trials, others that budget's retune
        trials; empty (or the whole tuple empty) for no selection there.
    chosen: per budget, the index of the chosen trial (-1 where there was no selection); None:
        the argmin (first of ties), which is what the tuner picks. A given index must be an argmin.
    selection_seeds: per budget, [trials, tuning seeds] objectives when 2+ tuning seeds were
        recorded (the re-selection then resamples them), else None.
    selection_noise: per budget, the measured seed sd of the chosen config's tune-split loss
        (over the final runs' seeds): the noise the single-seed re-selection adds.
    """
    tokens: tuple[float, ...]
    finals: np.ndarray
    seeds: Optional[tuple[int, ...]] = None
    selection: tuple[np.ndarray, ...] = ()
    chosen: Optional[tuple[int, ...]] = None
    selection_seeds: tuple[Optional[np.ndarray], ...] = ()
    selection_noise: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        tokens = tuple(_check_tokens(self.tokens, "side"))
        budgets = len(tokens)
        finals = _array(self.finals, "finals", 2)
        if finals.shape[0] != budgets or finals.shape[1] < 1:
            raise ValueError(f"finals must be [budgets={budgets}, seeds>=1], got {finals.shape}")
        seeds = tuple(range(finals.shape[1])) if self.seeds is None else tuple(int(s) for s in self.seeds)
        if len(seeds) != finals.shape[1] or len(set(seeds)) != len(seeds):
            raise ValueError(f"seeds {seeds} must name each of the {finals.shape[1]} columns once")
        selection = tuple(_array(s, "selection", 1) for s in self.selection) or tuple(
            _array([], "selection", 1) for _ in tokens)
        if len(selection) != budgets:
            raise ValueError(f"selection: one entry per budget ({budgets}), got {len(selection)}")
        if self.chosen is not None and len(self.chosen) != budgets:
            raise ValueError(f"chosen: one index per budget ({budgets}), got {self.chosen}")
        chosen = []
        for b, objectives in enumerate(selection):
            if not len(objectives):
                chosen.append(-1)
                continue
            best = int(np.argmin(objectives))
            pick = best if self.chosen is None else int(self.chosen[b])
            if not (0 <= pick < len(objectives)) or objectives[pick] > objectives[best]:
                raise ValueError(f"selection at budget {b}: chosen trial {pick} is not an argmin of {list(objectives)}")
            chosen.append(pick)
        per_seed = tuple(None if s is None else _array(s, "selection_seeds", 2)
                         for s in self.selection_seeds) or (None,) * budgets
        if len(per_seed) != budgets:
            raise ValueError(f"selection_seeds: one entry per budget ({budgets}), got {len(per_seed)}")
        for b, s in enumerate(per_seed):
            if s is not None and (s.shape[0] != len(selection[b]) or s.shape[1] < 2):
                raise ValueError(f"selection_seeds at budget {b}: want [{len(selection[b])} trials, 2+ seeds], "
                                 f"got {s.shape}")
        noise = tuple(float(v) for v in self.selection_noise)
        needs_noise = any(len(s) > 1 and p is None for s, p in zip(selection, per_seed))
        if noise or needs_noise:
            if len(noise) != budgets or any(not (math.isfinite(v) and v >= 0) for v in noise):
                raise ValueError(f"selection_noise: one finite sd >= 0 per budget ({budgets}), got {noise}")
        else:
            noise = (0.0,) * budgets
        for name, value in (("tokens", tokens), ("finals", finals), ("seeds", seeds), ("selection", selection),
                            ("chosen", tuple(chosen)), ("selection_seeds", per_seed), ("selection_noise", noise)):
            object.__setattr__(self, name, value)

    @property
    def means(self) -> list[float]:
        """Mean final loss per budget over all seeds (inf if any seed diverged)."""
        return [mean(row) for row in self.finals]


@dataclass(frozen=True)
class Comparison:
    """The headline for one reported split.

    ratio: the point estimate, on the means over all seeds, with no selection adjustment.
    lo, hi: the 2.5th and 97.5th percentiles of the bootstrap replicates (a censored replicate
        gives the bound, e.g. "> 3.00x"); None when no replicate was drawn.
    p: threshold s0 -> (1 + #{S_r <= s0}) / (R + 1), the one-sided p-value for H0: S <= s0.
    censored_share: the share of replicates below ("<") and above (">") the budgets run.
    paired: whether the seeds were resampled jointly for both sides (same seed ids).
    correction: the small-sample correction of the seed resampling (see _seed_expansion).
    draws: the replicates' ratios, ascending, a censored one at its bound: what a fit across
        studies resamples (study/ladder.py); not part of the JSON.
    """
    split: str
    ratio: Ratio
    lo: Optional[Ratio]
    hi: Optional[Ratio]
    p: dict[float, float]
    censored_share: tuple[float, float]
    replicates: int
    seed: int
    paired: bool
    correction: str
    draws: tuple[float, ...] = field(default=(), repr=False, compare=False)

    def to_dict(self) -> dict:
        """Plain JSON data (no numpy types, no inf: a censored value is its bound with its
        sign, and 'no interval' is None), so a report regenerated from records can be
        compared byte for byte."""
        return {
            "split": self.split,
            "ratio": self.ratio.to_dict(),
            "lo": None if self.lo is None else self.lo.to_dict(),
            "hi": None if self.hi is None else self.hi.to_dict(),
            "p": [{"threshold": float(s0), "p": float(p)} for s0, p in sorted(self.p.items())],
            "censored_share": {"below": float(self.censored_share[0]), "above": float(self.censored_share[1])},
            "replicates": int(self.replicates),
            "seed": int(self.seed),
            "paired": bool(self.paired),
            "correction": self.correction,
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> "Comparison":
        def ratio(value):
            return None if value is None else Ratio.from_dict(value)
        return cls(str(data["split"]), Ratio.from_dict(data["ratio"]), ratio(data["lo"]), ratio(data["hi"]),
                   {float(e["threshold"]): float(e["p"]) for e in data["p"]},
                   (float(data["censored_share"]["below"]), float(data["censored_share"]["above"])),
                   int(data["replicates"]), int(data["seed"]), bool(data["paired"]), str(data["correction"]))


# --- the bootstrap -----------------------------------------------------------------------------

def _seed_expansion(n: int, correction: str) -> float:
    """The factor c in m + c (mean(x[idx]) - m), the replicate mean of a budget's n seeds.

    The plain percentile bootstrap (c = 1) has the variance of the plug-in sd, (n-1)/n of the
    unbiased one, and treats that sd as known: at n = 5 its "95%" interval is the z-interval
    at 0.89 of the sample sd, where the exact interval for a mean is the t-interval with
    t(0.975, 4) = 2.78, not 1.96. "variance" (design56 §8.4 step 1, c = sqrt(n/(n-1))) fixes
    only the first part. "t" also scales by t(0.975, n-1)/z(0.975), so the percentile interval
    of one mean is exactly its t-interval; the speedup is, to first order, a mean over the
    paired seeds of a per-seed score, so the same factor calibrates it. Simulated at n = 5
    (tests/test_speedup.py's law, run noise 0.005 uncentred, 400 data draws, R = 1000): the
    interval covered a true 1.0x 0.83 of the time plain, 0.86 with "variance", 0.93 with "t"
    (+-0.012 Monte Carlo), and p(1.0) < 0.05 came out 12%, 10% and 6% of the time (nominal 5%).
    """
    if n < 2 or correction == "none":
        return 1.0  # one seed: nothing to resample, the interval is the selection's alone
    c = math.sqrt(n / (n - 1))
    return c * t_975(n - 1) / _Z_975 if correction == "t" else c


def _resampled_means(values: np.ndarray, idx: np.ndarray, c: float) -> np.ndarray:
    """[..., n] values, [R, n] seed indices -> [..., R] replicate means, expanded by c about
    the full-sample mean. Summed in a fixed order (elementwise adds are exactly rounded, a
    reduction's order is the build's), so replicates are identical on any machine. A row with
    an inf keeps the plain resampled mean: inf when a diverged seed is drawn, else finite."""
    total = values[..., idx[:, 0]]
    for j in range(1, idx.shape[1]):
        total = total + values[..., idx[:, j]]
    means = total / idx.shape[1]
    full = np.array([mean(row) for row in values.reshape(-1, values.shape[-1])]).reshape(values.shape[:-1])
    finite = np.isfinite(full)[..., None]
    with np.errstate(invalid="ignore"):
        expanded = full[..., None] + c * (means - full[..., None])
    return np.where(finite, expanded, means)


def _penalties(side: Side, replicates: int, seed: int, which: int) -> np.ndarray:
    """[R, budgets] losses to add to the side in each replicate: the re-selection step.

    Per budget b: perturb the recorded trial objectives as the tuning noise could have come
    out (single tuning seed: + selection_noise[b] * N(0,1), independent per trial; 2+ tuning
    seeds: the seeds resampled jointly for all trials, since a seed's data order and init are
    shared by every trial run on it, with the variance expansion sqrt(k/(k-1)) so that its
    spread matches the unbiased sd the single-seed path uses), re-pick the argmin, and charge the recorded gap
    l[re-picked] - l[chosen] >= 0. The config at budget b > 0 is (the 1x choice, b's retuned
    lr), so b is charged the 1x gap plus its own. Each (side, budget) has its own generator:
    adding or removing a selection never moves the seed draws, so a competitor that is never
    re-picked leaves the interval exactly as without selection.
    """
    budgets = len(side.tokens)
    gap = np.zeros((replicates, budgets))
    for b in range(budgets):
        objectives, pick = side.selection[b], side.chosen[b]
        if len(objectives) < 2 or not math.isfinite(objectives[pick]):
            continue
        rng = np.random.default_rng([seed, 1, which, b])
        per_seed = side.selection_seeds[b]
        if per_seed is None:
            noise = side.selection_noise[b]
            perturbed = objectives[None, :] + noise * rng.standard_normal((replicates, len(objectives)))
        else:
            k = per_seed.shape[1]
            idx = rng.integers(0, k, size=(replicates, k))
            perturbed = _resampled_means(per_seed, idx, _seed_expansion(k, "variance")).T
        perturbed = np.where(np.isfinite(objectives)[None, :], perturbed, math.inf)  # inf stays inf
        gap[:, b] = objectives[np.argmin(perturbed, axis=1)] - objectives[pick]
    gap[:, 1:] += gap[:, :1]
    return gap


def _order_statistic(sorted_values: list[float], rank: int, lower: float, upper: float) -> Ratio:
    value = sorted_values[rank - 1]
    if value == math.inf:
        return Ratio(upper, ">")
    if value == 0.0:
        return Ratio(lower, "<")
    return Ratio(value)


def replicate_means(target: Side, base: Side, replicates: int, seed: int,
                    correction: str = "t") -> tuple[np.ndarray, np.ndarray]:
    """Each side's [R, budgets] mean final losses, one row per bootstrap replicate (see
    compare): the seeds resampled, paired when the sides' seed ids match, and the re-selection
    penalty added. The same seed gives the same rows, so another estimator over them (the
    power-law fit, study/sensitivity.py) sees the draws the headline saw."""
    rng = np.random.default_rng([seed, 0])
    paired = target.seeds == base.seeds
    idx_t = rng.integers(0, target.finals.shape[1], size=(replicates, target.finals.shape[1]))
    idx_b = idx_t if paired else rng.integers(0, base.finals.shape[1], size=(replicates, base.finals.shape[1]))
    mt = (_resampled_means(target.finals, idx_t, _seed_expansion(target.finals.shape[1], correction)).T
          + _penalties(target, replicates, seed, 0))
    mb = (_resampled_means(base.finals, idx_b, _seed_expansion(base.finals.shape[1], correction)).T
          + _penalties(base, replicates, seed, 1))
    return mt, mb


def compare(target: Side, base: Side, replicates: int, seed: int, thresholds: Sequence[float] = (1.0, 1.1),
            *, split: str = "", correction: str = "t") -> Comparison:
    """The target's speedup over the baseline on one split, its 95% bootstrap interval, the
    one-sided p-values that it exceeds each threshold, and the share of censored replicates.

    Each replicate (design56 §8.4) draws n seed indices with replacement, the same for both
    sides (when their seed ids match) and every budget; the replicate mean per budget is
    expanded per `correction` (see _seed_expansion); each side's losses get its re-selection
    penalty (see _penalties); the ratio is recomputed from the monotone fits, a censored one
    counting as +inf (">") or 0 ("<"). The interval is the pair of order statistics at
    floor(0.025 (R+1)) and R+1 minus that, so it needs no interpolation between a bound and a
    number. Deterministic for a given seed; calls for several splits with the same seed share
    every draw, so val and OOD see the same seeds and the same re-selection.
    """
    if target.tokens[0] != base.tokens[0]:
        raise ValueError(f"both sides start at the 1x budget: {target.tokens[0]} vs {base.tokens[0]} tokens")
    if replicates < 0:
        raise ValueError(f"replicates must be >= 0, got {replicates}")
    if correction not in CORRECTIONS:
        raise ValueError(f"correction must be one of {CORRECTIONS}, got {correction!r}")
    thresholds = sorted({float(s) for s in thresholds})
    tt, bt = list(target.tokens), list(base.tokens)
    xt, xb = [math.log(t) for t in tt], [math.log(t) for t in bt]
    # Equal weights: a budget's mean is finite only when all its n seeds are (design56 §8.2's
    # "number of finite seeds" is then n everywhere), and an inf one takes no part in the fit.
    point = _ratio(xt, tt, isotonic_decreasing(target.means), xb, bt, isotonic_decreasing(base.means))
    paired = target.seeds == base.seeds
    if replicates == 0:
        return Comparison(split, point, None, None, {}, (0.0, 0.0), 0, int(seed), paired, correction)

    mt, mb = replicate_means(target, base, replicates, seed, correction)
    values = sorted(_ratio(xt, tt, isotonic_decreasing(a), xb, bt, isotonic_decreasing(b)).as_float()
                    for a, b in zip(mt.tolist(), mb.tolist()))

    upper, lower = bt[-1] / bt[0], tt[0] / tt[-1]
    rank = max(1, math.floor(0.025 * (replicates + 1)))
    lo = _order_statistic(values, rank, lower, upper)
    hi = _order_statistic(values, replicates + 1 - rank, lower, upper)
    p = {}
    for s0 in thresholds:
        # A "<" replicate (0) is <= s0: certain when s0 is above its bound, unknown (so counted
        # for H0, the conservative way) below it; a ">" replicate (inf) counts as <= s0 only
        # when s0 is at or above its bound, where the order is unknown.
        at_most = sum(1 for v in values if v <= s0 or (v == math.inf and s0 >= upper))
        p[s0] = (1 + at_most) / (replicates + 1)
    share = (sum(1 for v in values if v == 0.0) / replicates, sum(1 for v in values if v == math.inf) / replicates)
    draws = tuple(min(max(v, lower), upper) for v in values)
    return Comparison(split, point, lo, hi, p, share, replicates, int(seed), paired, correction, draws)


def compare_splits(targets: Mapping[str, Side], bases: Mapping[str, Side], replicates: int, seed: int,
                   thresholds: Sequence[float] = (1.0, 1.1), *, correction: str = "t") -> dict[str, Comparison]:
    """compare() per reported split (val and each OOD set), in sorted order, with one seed:
    every split sees the same seed draws and the same re-selection penalties."""
    if sorted(targets) != sorted(bases):
        raise ValueError(f"the sides report different splits: {sorted(targets)} vs {sorted(bases)}")
    return {name: compare(targets[name], bases[name], replicates, seed, thresholds, split=name, correction=correction)
            for name in sorted(targets)}
