"""Seeds: grouping runs into arms, mean +- standard error, and the errors of both ratios."""
from __future__ import annotations

import json
import math
import re
import statistics

import pytest

from eval.compare import Run, load_run, schedule_ratio
from eval.seeds import (
    Estimate, estimate, group_arms, in_run_ratio_over_seeds, paired_difference, schedule_ratio_over_seeds,
    seed_pairs, t_975,
)
from tests.test_compare import compare, write_run
from tests.closeness import approx


def test_estimate_is_the_mean_and_its_standard_error():
    est = estimate([1.0, 2.0, 3.0])
    assert (est.mean, est.n, est.df) == (2.0, 3, 2)
    assert est.se == approx(1.0 / math.sqrt(3))  # sample sd 1, over sqrt(n)
    assert est.half_width_95 == approx(4.303 / math.sqrt(3))
    assert est.format(".2f") == "2.00 ± 0.58"
    single = estimate([5.0])
    assert single.se is None and single.half_width_95 is None and single.format(".1f") == "5.0"
    assert estimate([]) is None


def test_t_quantiles_never_narrow_the_interval():
    assert t_975(1) == 12.706 and t_975(2) == 4.303
    assert t_975(11) == t_975(10) == 2.228  # between entries: the smaller df's, wider value
    assert t_975(1000) == 1.980 > 1.96
    with pytest.raises(ValueError):
        t_975(0)


def run(tmp_path, name: str, seed: int | None, lr: float = 1e-3, steps: int = 3, optimizer: str = "muon") -> Run:
    write_run(tmp_path / name, optimizer, lr, [5.0 - 0.1 * s for s in range(steps)], seed=seed)
    return load_run(tmp_path / name)


def test_runs_that_differ_only_in_seed_form_one_arm(tmp_path):
    runs = [run(tmp_path, "s1", 1), run(tmp_path, "s0", 0), run(tmp_path, "lr", 0, lr=3e-3),
            run(tmp_path, "long", 0, steps=5), run(tmp_path, "adamw", 0, optimizer="adamw"),
            run(tmp_path, "old_a", None), run(tmp_path, "old_b", None)]
    arms = group_arms(runs)
    assert [[r.path.name for r in arm.runs] for arm in arms] == [
        ["s0", "s1"], ["lr"], ["long"], ["adamw"], ["old_a"], ["old_b"]]
    assert arms[0].label == "muon lr=0.001 (2 seeds)" and arms[0].seeds == [0, 1]
    # the arm's final is the mean over its seeds, with its standard error
    assert arms[0].final("train/loss") == approx(4.8)
    assert arms[0].final_estimate("train/loss").se == 0.0


def test_a_repeated_seed_is_refused_not_counted_twice(tmp_path):
    with pytest.raises(ValueError, match="same settings and seed 0"):
        group_arms([run(tmp_path, "a", 0), run(tmp_path, "b", 0)])


def test_the_mean_curve_and_band_use_the_steps_every_seed_logged(tmp_path):
    write_run(tmp_path / "s0", "muon", 1e-3, [4.0, 3.0, 2.0], seed=0)
    write_run(tmp_path / "s1", "muon", 1e-3, [6.0, 5.0, 4.0], seed=1)
    arm = group_arms([load_run(tmp_path / "s0"), load_run(tmp_path / "s1")])[0]
    steps, means, ses = arm.curve("train/loss")
    assert steps == [1, 2, 3] and means == [5.0, 4.0, 3.0]
    assert ses == approx([math.sqrt(2) / math.sqrt(2)] * 3)  # sd sqrt(2), n 2


def test_in_run_ratios_are_taken_within_seed_pairs(tmp_path):
    """Muon's loss c/s against AdamW's k*c/s, per seed: AdamW's final is Muon's at 40/k, so the
    pair's ratio is k, whatever c; the mean and error are over the pairs' k."""
    ks = {0: 1.25, 1: 1.6, 2: 2.0}
    for seed, k in ks.items():
        c = 10.0 + seed  # a seed moves both optimizers' losses alike
        write_run(tmp_path / f"m{seed}", "muon", 3e-3, [c / s for s in range(1, 41)], seed=seed)
        write_run(tmp_path / f"a{seed}", "adamw", 1e-3, [k * c / s for s in range(1, 41)], seed=seed)
    write_run(tmp_path / "a9", "adamw", 1e-3, [5.0 / s for s in range(1, 41)], seed=9)  # no partner
    muon, adamw = group_arms([load_run(tmp_path / f"m{s}") for s in ks] +
                             [load_run(tmp_path / f"a{s}") for s in (9, *ks)])
    assert [(x.seed, y.seed) for x, y in seed_pairs(muon, adamw)] == [(0, 0), (1, 1), (2, 2)]
    r = in_run_ratio_over_seeds(muon, adamw, "train/loss", lambda run, key: run.series[key])
    assert r.reference == "B" and r.ratio.n == 3
    assert r.ratio.mean == approx(statistics.fmean(ks.values()), abs=1e-9)
    assert r.ratio.se == approx(statistics.stdev(ks.values()) / math.sqrt(3), abs=1e-9)


def test_schedule_ratio_error_matches_finite_differences():
    """The delta-method error: each input's standard error times the ratio's derivative in it,
    the derivatives taken numerically from the plain schedule ratio."""
    lengths = [1.0, 1.25, 1.5, 2.0]
    finals = [Estimate(3.0, 0.02, 3, 2), Estimate(2.9, 0.03, 3, 2), Estimate(2.8, 0.01, 3, 2),
              Estimate(2.6, 0.04, 4, 3)]
    target = Estimate(2.73, 0.015, 3, 2)
    s = schedule_ratio_over_seeds(target, lengths, finals)
    means = [f.mean for f in finals]
    assert s.ratio == approx(schedule_ratio(2.73, lengths, means).ratio) == approx(1.675)
    h = 1e-6

    def derivative(shift_target: float = 0.0, index: int | None = None) -> float:
        moved = [m + (h if i == index else 0.0) for i, m in enumerate(means)]
        return (schedule_ratio(2.73 + shift_target, lengths, moved).ratio - s.ratio) / h

    terms = [derivative(shift_target=h) * target.se] + [derivative(index=i) * f.se for i, f in enumerate(finals)]
    assert s.se == approx(math.sqrt(sum(t * t for t in terms)), rel=1e-4)
    assert s.df == 2 and s.half_width_95 == approx(4.303 * s.se)
    # no error from a single seed, and none when the shortest schedule already reaches it
    single = [Estimate(f.mean, None, 1) for f in finals]
    assert schedule_ratio_over_seeds(target, lengths, single).se is None
    assert schedule_ratio_over_seeds(Estimate(3.1, 0.01, 3, 2), lengths, finals).se is None


def interval(cell: str) -> tuple[float, float, float, float]:
    """`1.563 ± 0.013 (95% CI 1.50 to 1.62)` -> (1.563, 0.013, 1.50, 1.62)."""
    m = re.fullmatch(r"\s*([\d.]+) ± ([\d.]+) \(95% CI ([\d.]+) to ([\d.]+)\)\s*", cell)
    assert m, cell
    return tuple(float(x) for x in m.groups())  # type: ignore[return-value]


def printed(mean: float, se: float, half_width: float) -> tuple[float, float, float, float]:
    """What interval() reads back from a cell of these values: the mean and its error to 3
    decimals, the interval's ends to 2, as the table prints them."""
    return round(mean, 3), round(se, 3), round(mean - half_width, 2), round(mean + half_width, 2)


def test_cli_reports_seeds_as_mean_and_error_with_an_interval(tmp_path):
    """Three seeds per arm, losses c/s. AdamW: c = 14.6, 15, 15.4 at 40, 60 and 80 steps, so
    its mean finals are 0.375, 0.25 and 0.1875. Muon: 40 steps, c chosen so that it reaches
    each seed's AdamW final at step 24, 25 and 26: in-run ratios 40/24, 40/25, 40/26."""
    c_adamw, crossing = [14.6, 15.0, 15.4], [24, 25, 26]
    c_muon = [c * n / 40 for c, n in zip(c_adamw, crossing)]
    for seed in range(3):
        write_run(tmp_path / "sweep" / f"m{seed}", "muon", 3e-3, [c_muon[seed] / s for s in range(1, 41)], seed=seed)
        for steps, where in ((40, "sweep"), (60, "longer"), (80, "longer")):
            write_run(tmp_path / where / f"a{steps}_{seed}", "adamw", 1e-3,
                      [c_adamw[seed] / s for s in range(1, steps + 1)], seed=seed)
    proc = compare(tmp_path, str(tmp_path / "sweep"), "--longer", str(tmp_path / "longer"), "--alpha", "1")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    muon_finals = [c / 40 for c in c_muon]
    mean, se = statistics.fmean(muon_finals), statistics.stdev(muon_finals) / math.sqrt(3)
    assert f"| muon (best) | 0.003 | 0,1,2 | {mean + 0.1:.4f} ± {se:.4f} | {mean + 1:.4f} ± {se:.4f} |" in lines
    assert "- A seed 2 = muon lr=0.003: precision unknown; corpus unknown; no environment.json " \
        f"({tmp_path / 'sweep' / 'm2'})" in lines
    # in-run, per seed pair; the 95% interval uses t with 2 degrees of freedom
    pair_ratios = [40 / n for n in crossing]
    row = next(line for line in lines if line.startswith("| val/val/loss ") and "at the" not in line)
    got = interval(row.split("|")[-3])
    expected_se = statistics.stdev(pair_ratios) / math.sqrt(3)
    assert got == printed(statistics.fmean(pair_ratios), expected_se, 4.303 * expected_se)
    assert row.split("|")[-2].strip() == "B"
    # honest: Muon's mean final lies between AdamW's 1.5x (0.25) and 2x (0.1875) means
    t = (0.25 - mean) / (0.25 - 0.1875)
    ratio, slope = 1.5 + 0.5 * t, 0.0625 / 0.5
    se_60, se_80 = statistics.stdev(c_adamw) / 60 / math.sqrt(3), statistics.stdev(c_adamw) / 80 / math.sqrt(3)
    ratio_se = math.sqrt(se ** 2 + ((1 - t) * se_60) ** 2 + (t * se_80) ** 2) / slope
    honest = lines[next(i for i, line in enumerate(lines) if line.startswith("## Schedule ratio")):]
    for key in ("val/val/loss", "val/ood_prose/loss"):
        row = next(line for line in honest if line.startswith(f"| {key} "))
        assert interval(row.split("|")[-2]) == printed(ratio, ratio_se, 4.303 * ratio_se), row
    assert (tmp_path / "cmp" / "losses.png").stat().st_size > 1000


def test_cli_refuses_a_repeated_seed_in_one_line(tmp_path):
    write_run(tmp_path / "sweep" / "m0", "muon", 3e-3, [3.0, 2.0], seed=0)
    write_run(tmp_path / "sweep" / "m0_again", "muon", 3e-3, [3.0, 2.1], seed=0)
    write_run(tmp_path / "sweep" / "a0", "adamw", 1e-3, [3.0, 2.5], seed=0)
    proc = compare(tmp_path, str(tmp_path / "sweep"))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1
    assert lines[0].startswith("error: runs ") and "same settings and seed 0" in lines[0]


def switch_on_normuon(run_dir) -> None:
    config = run_dir / ".hydra" / "config.yaml"
    config.write_text(config.read_text() + "  muon:\n    normuon: true\n")


def test_a_variant_is_compared_with_its_plain_setting_within_each_seed(tmp_path):
    """Seeds move both settings' losses alike (c), the variant is lower by d_s per seed: the
    paired difference is the mean and standard error of the d_s, free of c's spread, and its
    row in the settings table says so; plain settings get no difference."""
    d = {0: -0.05, 1: -0.08, 2: -0.02}
    for seed, c in ((0, 3.0), (1, 3.5), (2, 2.6)):
        write_run(tmp_path / "muon" / str(seed), "muon", 1e-2, [c + 1, c], seed=seed)
        write_run(tmp_path / "adamw" / str(seed), "adamw", 1e-3, [c + 2, c + 0.5], seed=seed)
        write_run(tmp_path / "normuon" / str(seed), "muon", 1e-2, [c + 1, c + d[seed]], seed=seed)
        switch_on_normuon(tmp_path / "normuon" / str(seed))
    write_run(tmp_path / "normuon" / "9", "muon", 1e-2, [9.0, 9.0], seed=9)  # no partner: left out
    switch_on_normuon(tmp_path / "normuon" / "9")
    arms = group_arms([load_run(p) for p in sorted(tmp_path.glob("*/*"))])
    normuon = next(arm for arm in arms if arm.optimizer == "muon+normuon")
    plain = next(arm for arm in arms if arm.optimizer == "muon")
    diff = paired_difference(normuon, plain, "train/loss")
    assert diff.n == 3 and diff.mean == approx(statistics.fmean(d.values()), abs=1e-12)
    assert diff.se == approx(statistics.stdev(d.values()) / math.sqrt(3), abs=1e-12)
    assert paired_difference(plain, group_arms([load_run(tmp_path / "normuon" / "9")])[0], "train/loss") is None

    (tmp_path / "normuon" / "9").rename(tmp_path / "unpaired")
    proc = compare(tmp_path, str(tmp_path / "muon"), str(tmp_path / "adamw"), str(tmp_path / "normuon"))
    assert proc.returncode == 0, proc.stderr
    rows = {line.split("|")[1].strip(): line for line in proc.stdout.splitlines() if line.startswith("| muon")
            or line.startswith("| adamw")}
    half = t_975(2) * diff.se
    expected = f"{diff.mean:+.4f} ± {diff.se:.4f} (95% CI {diff.mean - half:+.3f} to {diff.mean + half:+.3f})"
    assert expected in rows["muon+normuon"]
    assert rows["muon (A)"].count(" - ") >= 1 and "95% CI" not in rows["muon (A)"]


def test_the_settings_table_gives_each_setting_its_median_step_times(tmp_path):
    """Each seed's median over its logged steps but the first (compilation), then mean +- se
    over the seeds; a setting whose runs logged no times gets "-"."""
    times = {"muon": {0: [9.0, 1.0, 1.2, 1.1], 1: [9.0, 1.4, 1.3, 1.5]},
             "adamw": {0: [5.0, 0.5, 0.7, 0.6], 1: [5.0, 0.8, 0.9, 0.7]}}
    for name, optimizer, lr in (("muon", "muon", 1e-2), ("adamw", "adamw", 1e-3), ("normuon", "muon", 1e-2)):
        for seed in (0, 1):
            path = tmp_path / name / str(seed)
            write_run(path, optimizer, lr, [5.0, 4.0, 3.5, 3.0 + 0.1 * seed], seed=seed)
            if name == "normuon":
                switch_on_normuon(path)
                continue
            records = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
            for record, t in zip(records, times[name][seed]):
                record["perf/optim_step_s"] = t
            (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    muon = group_arms([load_run(tmp_path / "muon" / s) for s in ("0", "1")])[0]
    cost = muon.median_estimate("perf/optim_step_s")
    assert cost.mean == approx(1.25) and cost.se == approx(0.15)  # medians 1.1 and 1.4
    assert muon.median_estimate("perf/step_s") is None

    proc = compare(tmp_path, *(str(tmp_path / n) for n in ("muon", "adamw", "normuon")))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.split("## Every optimizer setting, at its best lr")[1].split("\n## ")[0].splitlines()
    header = next(line for line in lines if line.startswith("| setting"))
    assert header.rstrip(" |").endswith("median perf/optim_step_s") and "perf/step_s" not in header
    rows = {line.split("|")[1].strip(): line.rstrip(" |").rsplit("|", 1)[1].strip() for line in lines
            if line.startswith("| muon") or line.startswith("| adamw")}
    assert rows == {"muon (A)": "1.250 ± 0.150", "adamw (B)": "0.700 ± 0.100", "muon+normuon": "-"}
