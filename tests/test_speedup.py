"""study/speedup.py: the monotone fit, the crossing in log tokens, censoring, and the bootstrap
that repeats the selection, on synthetic loss curves with a known speedup (design56 §10.1).

The data: L(N) = 3 + 2 N^-0.3 at budgets 1, 1.5, 2, 3x (N in units of the 1x budget), the
target on L(N) and a baseline that is S times slower on L(N / S); 5 paired seeds, each with
an offset shared by both sides and every budget (its init and batches) plus run noise per
(side, budget, seed). The run noise of each budget is centred and scaled to a sample sd of
exactly RUN_SD over the seeds, so each mean lies on the law: the tests then check the
comparison stage, not whether 5 seeds happened to land near the truth. (Uncentred, a true
1.0x makes p(1.0) uniform on (0, 1), and "p(1.0) > 0.2" would fail one draw in five.)

Why RUN_SD = 0.01 and not 0.005: linear interpolation of this convex curve in log tokens puts
the 1.3x crossing at 1.3073, 0.56% high. At 0.005 the 95% interval's half-width is ~1%, and
how far it reaches depends on the 5 seeds' chance correlations across cells: 1 centred draw
in 20 missed 1.3 (300 draws). At 0.01, 299 of 300 cover it; the draw used here has 1.3 at
2.6% above lo and 4.0% below hi.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from study.speedup import (
    Comparison, Ratio, Side, compare, compare_splits, isotonic_decreasing, reach, speedup,
)
from tests.closeness import approx, check_relative

BUDGETS = (1.0, 1.5, 2.0, 3.0)
SEEDS = 5
OFFSET_SD = 0.01
RUN_SD = 0.01
# 1000 replicates: the smallest p-value is 1/1001, ten times under the 0.01 asserted; the Monte
# Carlo error of a p near 0.5 is sqrt(0.25/1000) = 0.016, against margins of 0.3 below.
R = 1000


def law(tokens) -> np.ndarray:
    return 3.0 + 2.0 * np.asarray(tokens, dtype=float) ** -0.3


def centred(rng: np.random.Generator, shape: tuple[int, int], sd: float) -> np.ndarray:
    z = rng.standard_normal(shape)
    z -= z.mean(axis=1, keepdims=True)
    return sd * z / z.std(axis=1, ddof=1, keepdims=True)


def synthetic(true_speedup: float, data_seed: int = 0, offsets=None) -> tuple[Side, Side]:
    rng = np.random.default_rng(data_seed)
    offset = rng.normal(0.0, OFFSET_SD, SEEDS) if offsets is None else np.asarray(offsets, dtype=float)
    target = law(BUDGETS)[:, None] + offset + centred(rng, (len(BUDGETS), SEEDS), RUN_SD)
    base = law(np.array(BUDGETS) / true_speedup)[:, None] + offset + centred(rng, (len(BUDGETS), SEEDS), RUN_SD)
    return Side(BUDGETS, target), Side(BUDGETS, base)


def with_selection(side: Side, **selection) -> Side:
    return Side(side.tokens, side.finals, **selection)


def width(c: Comparison) -> float:
    return c.hi.value - c.lo.value


# --- the fit and the crossing ------------------------------------------------------------------

def test_pav_pools_adjacent_violators_into_a_non_increasing_fit():
    assert isotonic_decreasing([5.0, 4.0, 3.0]).tolist() == [5.0, 4.0, 3.0]  # already monotone
    assert isotonic_decreasing([5.0, 4.0, 4.2, 3.0]).tolist() == approx([5.0, 4.1, 4.1, 3.0])
    assert isotonic_decreasing([1.0, 2.0, 3.0]).tolist() == approx([2.0, 2.0, 2.0])  # pools a chain
    assert isotonic_decreasing([1.0, 2.0], [3.0, 1.0]).tolist() == approx([1.25, 1.25])  # weighted
    # A diverged budget stays inf and is not pooled: the others are fitted among themselves.
    assert isotonic_decreasing([5.0, math.inf, 4.2, 4.5]).tolist() == approx([5.0, math.inf, 4.35, 4.35])
    with pytest.raises(ValueError, match="positive"):
        isotonic_decreasing([1.0, 2.0], [1.0, 0.0])


def test_an_unweighted_fit_equals_the_pooling_whether_or_not_there_is_anything_to_pool():
    """Unweighted and already non-increasing, the fit returns the values as they are (the common
    case of a bootstrap); it must be bit for bit what pooling with unit weights gives."""
    rng = np.random.default_rng(0)
    cases = [sorted(rng.normal(4.0, 1.0, n).tolist(), reverse=True) for n in (1, 2, 3, 5)]
    cases += [rng.normal(4.0, 1.0, n).tolist() for n in (2, 3, 5) for _ in range(20)]
    cases += [[5.0, math.inf, 4.0], [math.inf, 5.0, 4.0], [5.0, 4.0, math.nan], [5.0, -math.inf, 4.0]]
    for y in cases:
        assert isotonic_decreasing(y).tolist() == isotonic_decreasing(y, [1.0] * len(y)).tolist(), y


def test_the_crossing_is_interpolated_in_log_tokens():
    x = [math.log(1.0), math.log(2.0)]
    # Halfway in loss between the 1x and 2x points is halfway in log tokens: sqrt(2)x, not 1.5x.
    assert math.exp(reach(x, [5.0, 4.0], 4.5)) == approx(math.sqrt(2.0), rel=1e-12)
    assert reach(x, [5.0, 4.0], 5.0) == x[0]  # reached at the first budget
    assert reach(x, [5.0, 4.0], 3.9) is None  # never, within the budgets measured
    assert reach([0.0, 1.0, 2.0], [5.0, math.inf, 4.0], 4.5) == 2.0  # no interpolating across a diverged budget
    # The same through speedup(): the baseline needs sqrt(2) times the target's 1x tokens.
    ratio = speedup([1e6, 2e6], [4.5, 4.0], [1e6, 2e6], [5.0, 4.0])
    assert ratio.bound == "=" and ratio.value == approx(math.sqrt(2.0), rel=1e-12)
    with pytest.raises(ValueError, match="1x"):
        speedup([1e6, 2e6], [4.5, 4.0], [2e6, 4e6], [5.0, 4.0])


def test_ratios_print_with_their_bound_and_refuse_nonsense():
    assert Ratio(1.3).format() == "1.30x"
    assert Ratio(3.0, ">").format() == "> 3.00x"
    assert Ratio(1 / 3, "<").format() == "< 0.33x"
    assert Ratio(1.3).format("#.3g") == "1.30x"
    for bad in ((1.0, "~"), (math.inf, "="), (0.0, "="), (math.nan, ">")):
        with pytest.raises(ValueError):
            Ratio(*bad)


# --- recovering a known speedup ----------------------------------------------------------------

def test_a_known_speedup_of_1_3_is_recovered_inside_its_interval():
    c = compare(*synthetic(1.3), replicates=R, seed=0)
    assert c.ratio.bound == "="
    check_relative("point estimate vs the true 1.3x", c.ratio.value, 1.3, 0.02)  # 1.3073: the interpolation's 0.56%
    assert c.lo.value < 1.3 < c.hi.value and not c.lo.censored and not c.hi.censored
    assert c.p[1.0] < 0.01  # every replicate is far above 1: p = 1/1001
    assert c.p[1.1] < 0.05  # 1.1 is ~5 interval half-widths (3.3% each) below the estimate: p = 1/1001
    assert c.censored_share == (0.0, 0.0) and c.paired


def test_a_true_1_0_gives_large_p_values():
    c = compare(*synthetic(1.0), replicates=R, seed=0)
    assert c.ratio.bound == "=" and c.ratio.value == approx(1.0, abs=1e-9)
    # The estimate sits on 1.0, so about half the replicates fall at or below it: p(1.0) ~ 0.5
    # (0.43-0.59 over 300 data draws), against 0.2; 1.1 is far above every replicate.
    assert 0.2 < c.p[1.0] < 0.8
    assert c.p[1.1] > 0.5


def test_a_crossing_beyond_the_budgets_is_a_bound_never_extrapolated():
    # The baseline 4x slower: even at 3x it stays above the target's 1x loss.
    c = compare(*synthetic(4.0), replicates=R, seed=0, thresholds=(1.0, 3.0, 5.0))
    assert c.ratio == Ratio(3.0, ">") and c.ratio.format() == "> 3.00x"
    assert c.lo == c.hi == Ratio(3.0, ">") and c.censored_share == (0.0, 1.0)
    assert c.p[1.0] == 1 / (R + 1)
    # At or above the bound the order is unknown, so a ">" replicate counts for H0: no claim.
    assert c.p[3.0] == c.p[5.0] == 1.0
    # Mirrored: the baseline 4x faster; the target does not reach its 1x loss by 3x.
    c = compare(*synthetic(0.25), replicates=R, seed=0)
    assert c.ratio.bound == "<" and c.ratio.value == approx(1 / 3, rel=1e-12) and c.ratio.format() == "< 0.33x"
    assert c.censored_share == (1.0, 0.0) and c.p[1.0] == 1.0


# --- the bootstrap -----------------------------------------------------------------------------

def test_paired_seeds_cancel_what_a_seed_does_to_both_sides():
    # Offsets far larger than the run noise (sd 0.03), shared by both sides and every budget.
    offsets = [-0.045, -0.02, 0.0, 0.015, 0.05]
    quiet = compare(*synthetic(1.3, offsets=[0.0] * SEEDS), replicates=R, seed=0)
    paired = compare(*synthetic(1.3, offsets=offsets), replicates=R, seed=0)
    assert paired.lo.value == approx(quiet.lo.value, rel=1e-12)
    assert paired.hi.value == approx(quiet.hi.value, rel=1e-12)
    # Resampled independently (different seed ids), each side carries its own offsets' noise.
    target, base = synthetic(1.3, offsets=offsets)
    unpaired = compare(target, Side(base.tokens, base.finals, seeds=(10, 11, 12, 13, 14)), replicates=R, seed=0)
    assert not unpaired.paired and width(unpaired) > 2 * width(paired)


def test_the_small_sample_correction_scales_the_seed_interval():
    data = synthetic(1.3)
    widths = {corr: width(compare(*data, replicates=R, seed=0, correction=corr))
              for corr in ("none", "variance", "t")}
    # The same draws, deviations scaled by sqrt(5/4), then by t(0.975, 4)/z(0.975) = 1.4166;
    # the ratio is nearly linear in the means over the interval (measured 1.1190 and 1.4172).
    assert widths["variance"] / widths["none"] == approx(math.sqrt(5 / 4), rel=0.01)
    assert widths["t"] / widths["variance"] == approx(2.7764 / 1.959964, rel=0.01)


# The tune split's seed sd in the selection tests: 4x the final runs' run noise, so that a
# re-pick's penalty (SIGMA/2 = 0.02, moving the ratio ~3.3%) is as large as the seed interval's
# half-width and the widening stands clear of the bootstrap's Monte Carlo error.
SIGMA = 0.04


@pytest.mark.parametrize("path", ["one tuning seed", "two tuning seeds"])
def test_a_close_competitor_widens_the_interval_and_a_far_one_does_not(path):
    def selection(gap: float) -> dict:
        objectives = np.array([4.0, 4.0 + gap, 4.5])
        if path == "one tuning seed":
            return {"selection": (objectives, (), (), ()), "selection_noise": (SIGMA, 0.0, 0.0, 0.0)}
        # Each trial's two tuning seeds, +-SIGMA around its recorded mean, in opposite
        # directions for the two close trials: which wins depends on the seed drawn.
        spread = np.array([[SIGMA, -SIGMA], [-SIGMA, SIGMA], [SIGMA, -SIGMA]])
        return {"selection": (objectives, (), (), ()),
                "selection_seeds": (objectives[:, None] + spread, None, None, None)}

    target, base = synthetic(1.3)
    plain = compare(target, base, replicates=R, seed=0)
    far = compare(with_selection(target, **selection(10 * SIGMA)), with_selection(base, **selection(10 * SIGMA)),
                  replicates=R, seed=0)
    # Never re-picked: the penalty is exactly 0 and the seed draws are the same stream.
    assert far == plain
    # A competitor SIGMA/2 behind is re-picked in ~36% of replicates with one tuning seed (the
    # two trials' noise differs by N(0, 2 SIGMA^2)) and in 25% with two (one seed drawn twice):
    # on the target each re-pick adds 0.02 to its losses and moves the ratio down, so lo drops;
    # on the baseline it moves hi up. The penalty only ever adds, so the other end cannot move out.
    close_target = compare(with_selection(target, **selection(SIGMA / 2)), base, replicates=R, seed=0)
    assert close_target.lo.value < plain.lo.value and close_target.hi.value <= plain.hi.value
    close_base = compare(target, with_selection(base, **selection(SIGMA / 2)), replicates=R, seed=0)
    assert close_base.hi.value > plain.hi.value and close_base.lo.value >= plain.lo.value
    # Width ratios measured over bootstrap seeds 0-19: 1.24-1.44 (median 1.28-1.44 per case).
    for close in (close_target, close_base):
        assert width(close) > 1.15 * width(plain)
    assert close_target.ratio == plain.ratio  # the point estimate has no selection adjustment


def test_a_retuned_budget_adds_its_own_gap_to_the_1x_one():
    target, base = synthetic(1.3)
    plain = compare(target, base, replicates=R, seed=0)
    # A close competitor only in the baseline's 1.5x retune: its crossing segment moves, so hi does.
    retune = {"selection": ((), np.array([4.0, 4.01]), (), ()), "selection_noise": (0.0, SIGMA, 0.0, 0.0)}
    c = compare(target, with_selection(base, **retune), replicates=R, seed=0)
    assert c.hi.value > plain.hi.value
    with pytest.raises(ValueError, match="argmin"):
        Side(BUDGETS, base.finals, selection=(np.array([4.0, 3.9]), (), (), ()), chosen=(0, -1, -1, -1),
             selection_noise=(SIGMA, 0.0, 0.0, 0.0))


def test_a_diverged_final_is_never_reached_and_replicates_handle_it():
    # A 1.8x baseline crosses between 1.5x and 2x; one of its seeds diverged at 2x.
    target, base = synthetic(1.8)
    finals = base.finals.copy()
    finals[2, 3] = math.inf
    c = compare(target, Side(BUDGETS, finals), replicates=R, seed=0)
    # With the 2x mean inf, the baseline first gets there at 3x: the divergence counts against it.
    assert c.ratio == Ratio(3.0)
    # Replicates that did not draw seed 3 ((4/5)^5 = 33% of them) see the crossing near 1.8x
    # (lo measured 1.748 at bootstrap seeds 0-5), the others at 3x.
    assert c.lo.value == approx(1.8, rel=0.1) and c.hi == Ratio(3.0)
    assert c.censored_share == (0.0, 0.0) and c.p[1.0] == 1 / (R + 1)
    # The target diverging at its own 1x: the baseline is ahead, by a bound.
    finals = target.finals.copy()
    finals[0, 0] = math.nan  # a crashed run's loss
    c = compare(Side(BUDGETS, finals), base, replicates=R, seed=0)
    assert c.ratio.value < 1.0 and c.p[1.0] > 0.5


def test_the_same_seed_gives_the_same_comparison_and_it_survives_json():
    data = synthetic(1.3)
    first = compare(*data, replicates=R, seed=7, split="val/val/loss")
    assert compare(*data, replicates=R, seed=7, split="val/val/loss") == first
    assert compare(*data, replicates=R, seed=8, split="val/val/loss") != first
    text = json.dumps(first.to_dict(), allow_nan=False, sort_keys=True)
    assert Comparison.from_dict(json.loads(text)) == first
    # No replicates: the point estimate (here a bound) alone, and None for the interval.
    point_only = compare(*synthetic(4.0), replicates=0, seed=0)
    assert point_only.lo is None and point_only.p == {} and point_only.ratio == Ratio(3.0, ">")
    assert Comparison.from_dict(json.loads(json.dumps(point_only.to_dict(), allow_nan=False))) == point_only


def test_val_and_ood_share_every_draw():
    target, base = synthetic(1.3)
    shift = 0.7  # an OOD set: every loss higher by the same amount on both sides
    ood_target, ood_base = Side(BUDGETS, target.finals + shift), Side(BUDGETS, base.finals + shift)
    out = compare_splits({"val/val/loss": target, "val/ood_prose/loss": ood_target},
                         {"val/val/loss": base, "val/ood_prose/loss": ood_base}, replicates=R, seed=3)
    assert list(out) == ["val/ood_prose/loss", "val/val/loss"]
    val, ood = out["val/val/loss"], out["val/ood_prose/loss"]
    assert ood.split == "val/ood_prose/loss"
    assert ood.lo.value == approx(val.lo.value, rel=1e-9) and ood.hi.value == approx(val.hi.value, rel=1e-9)
    with pytest.raises(ValueError, match="splits"):
        compare_splits({"val/val/loss": target}, {"val/ood_prose/loss": base}, replicates=R, seed=3)
