"""study/ladder.py: the fair study across model sizes. The trend's arithmetic on rungs of
known speedups, the parameter count it is drawn against, and `fair_compare.py --report` on a dir
of studies: every report, ladder.md, the plot and a page's block, from records alone."""
from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace

import pytest

from study.speedup import Comparison, Ratio
from study.analysis import Scale, model_params
from study.ladder import LADDER_BEGIN, LADDER_END, Rung, fit_rungs, replace_block, trend, trend_line
from tests.conftest import REPO
from tests.prestarted import run_python

SMOKE = REPO / "lab" / "results" / "fair_smoke"


def rung(params: int, speedup: float, draws: tuple[float, ...], experts: int = 0, resolved: bool = True,
         tokens_per_step: int = 512) -> Rung:
    c = Comparison("val/val/loss", Ratio(speedup), Ratio(min(draws)), Ratio(max(draws)), {1.0: 0.5}, (0.0, 0.0),
                   len(draws), 0, True, "t", tuple(sorted(draws)))
    scale = Scale(params, params, tokens_per_step, [40, 80], None, 8, 11, 4, 0.5)
    return Rung(f"r{params}", f"m{params}", experts, scale, {"val/val/loss": c}, resolved)


def test_the_trend_is_the_factor_per_ten_times_the_parameters():
    """Speedups 1.5, 1.35, 1.215 at 1M, 10M, 100M lose 10% per decade: x0.9 exactly, and with
    every replicate at its estimate the interval is that point and no replicate shows no decline."""
    rungs = [rung(10 ** e, 1.5 * 0.9 ** (e - 6), (1.5 * 0.9 ** (e - 6),) * 4) for e in (6, 7, 8)]
    t = trend(rungs, "val/val/loss", replicates=999, seed=0)
    assert t.factor == pytest.approx(0.9, rel=1e-12)
    assert t.lo == pytest.approx(0.9, rel=1e-12) and t.hi == pytest.approx(0.9, rel=1e-12)
    # p(> x1), that it does not grow, is 1; p(< x1), that it does not shrink, the smallest there is
    assert t.p_up == pytest.approx(1.0) and t.p_down == pytest.approx(1 / 1000)
    assert t.rungs == 3 and t.at_bound == 0.0


def test_the_trends_interval_resamples_each_rung_apart_and_leaves_the_moe_out():
    """Two rungs whose replicates are {1, 2} each: slopes from both pairings occur, so the interval
    spans the extremes (x0.5 to x2 per decade over one decade); an MoE rung is not on the line."""
    rungs = [rung(10 ** 6, math.sqrt(2), (1.0, 2.0)), rung(10 ** 7, math.sqrt(2), (1.0, 2.0)),
             rung(10 ** 8, 100.0, (100.0,), experts=8)]
    t = trend(rungs, "val/val/loss", replicates=999, seed=0)
    assert t.rungs == 2 and t.factor == pytest.approx(1.0)
    assert t.lo == pytest.approx(0.5) and t.hi == pytest.approx(2.0)
    assert 0.6 < t.p_down < 0.9 and 0.6 < t.p_up < 0.9  # slope >= 0 in 3 of the 4 pairings, <= 0 in 3
    assert trend(rungs[:1] + rungs[2:], "val/val/loss", 99, 0) is None  # one dense size: no line


def test_a_rung_beyond_its_budgets_enters_at_its_bound_and_makes_the_factor_a_bound():
    """AdamW never reached Muon's loss at the largest rung ("> 2x"): it enters at 2, so 1, 2
    over one decade is x2 per 10x, and a larger true speedup could only steepen it: at least
    x2. The same bound at the smallest rung could only flatten the line: at most; a '<' there
    pulls the same way as a '>' at the top, and one at each end leaves the factor unbounded."""
    def censored(params: int, value: float, bound: str) -> Rung:
        r = rung(params, value, (value,) * 4)
        r.results["val/val/loss"] = replace(r.results["val/val/loss"], ratio=Ratio(value, bound))
        return r

    top = trend([rung(10 ** 6, 1.0, (1.0,) * 4), censored(10 ** 7, 2.0, ">")], "val/val/loss", 99, 0)
    assert top.factor == pytest.approx(2.0) and top.bound == ">" and top.bounded_rungs == 1
    assert "x2.00 or more per 10x" in trend_line(top) and "1 of them a bound" in trend_line(top)
    bottom = trend([censored(10 ** 6, 2.0, ">"), rung(10 ** 7, 1.0, (1.0,) * 4)], "val/val/loss", 99, 0)
    assert bottom.factor == pytest.approx(0.5) and bottom.bound == "<" and "x0.50 or less" in trend_line(bottom)
    low = trend([censored(10 ** 6, 0.5, "<"), rung(10 ** 7, 1.0, (1.0,) * 4)], "val/val/loss", 99, 0)
    assert low.bound == ">"
    both = trend([censored(10 ** 6, 2.0, ">"), censored(10 ** 7, 2.0, ">")], "val/val/loss", 99, 0)
    assert both.bound == "?" and "neither bound" in trend_line(both)
    exact = trend([rung(10 ** 6, 1.0, (1.0,) * 4), rung(10 ** 7, 2.0, (2.0,) * 4)], "val/val/loss", 99, 0)
    assert exact.bound == "=" and "or more" not in trend_line(exact)


def test_non_embedding_parameters_leave_out_the_embedding_and_head_and_count_active_experts():
    dense = {"n_layers": 4, "d_model": 128, "n_heads": 2, "n_kv_heads": 2, "ffn_hidden": 384}
    per_layer = 4 * 128 * 128 + 3 * 128 * 384 + 2 * 128  # attention, SwiGLU, two norms
    assert model_params(dense) == (4 * per_layer + 128,) * 2  # + the final norm
    moe = {**dense, "n_experts": 8, "top_k": 2, "n_shared_experts": 1, "expert_hidden": 64, "n_dense_layers": 1}
    params, active = model_params(moe)
    expert = 3 * 128 * 64
    assert params - active == 3 * (8 - 2) * expert  # 3 MoE layers, 6 routed experts idle per token


def test_a_page_block_is_replaced_and_a_page_without_one_is_refused():
    text = f"top\n{LADDER_BEGIN}\nold line\n{LADDER_END}\nbottom\n"
    assert replace_block(text, ["new"], "p") == f"top\n{LADDER_BEGIN}\nnew\n{LADDER_END}\nbottom\n"
    with pytest.raises(ValueError, match="p: no ladder block"):
        replace_block("no block here\n", ["new"], "p")


def test_a_dir_of_studies_gets_every_report_the_ladder_and_the_pages_block(tmp_path):
    """Two rungs made of the committed smoke study's records, the second declared 3x deeper: each
    report is made again as --report makes it for one study, and the page's block and ladder.md
    carry the same speedups as each study's comparison.json."""
    root = tmp_path / "ladder"
    for name, layers in (("small", None), ("deep", 6)):
        shutil.copytree(SMOKE / "records", root / name / "records")
        if layers:
            plan_path = root / name / "records" / "plan.json"
            plan = json.loads(plan_path.read_text())
            plan["model"].update(n_layers=layers, name="gpt_tiny_deep")
            plan_path.write_text(json.dumps(plan, indent=1) + "\n")
    page = tmp_path / "page.md"
    page.write_text(f"# results\n\n{LADDER_BEGIN}\nstale\n{LADDER_END}\n\nprose after\n")
    proc = run_python(["scripts/fair_compare.py", "--report", str(root), "--page", str(page)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("comparison.md", "comparison.json", "trials.md", "chosen.md"):
        assert (root / "small" / "report" / name).read_bytes() == (SMOKE / "report" / name).read_bytes(), name
    assert (root / "speedup_vs_size.png").stat().st_size > 10_000
    val = json.loads((SMOKE / "report" / "comparison.json").read_text())["splits"]["val/val/loss"]["ratio"]["value"]
    text = page.read_text()
    assert "stale" not in text and text.endswith(f"{LADDER_END}\n\nprose after\n")
    rows = [line for line in text.splitlines() if line.startswith("| gpt_tiny")]
    assert len(rows) == 2 and all(f"| {val:.2f}x, unresolved (" in row and row.endswith(") | - |")
                                  for row in rows), rows
    # the smoke study's searches did not converge: no rung enters a trend
    assert "Trend: no trend is fitted: it needs two resolved dense rungs of different sizes at one tokens a step; " \
           "small, deep are unresolved" in text
    ladder = (root / "ladder.md").read_text()
    assert all(row in ladder for row in rows)


def test_a_page_without_a_block_is_one_line_and_exit_2_before_anything_is_written(tmp_path):
    root = tmp_path / "ladder"
    shutil.copytree(SMOKE / "records", root / "only" / "records")
    page = tmp_path / "page.md"
    page.write_text("# no block\n")
    proc = run_python(["scripts/fair_compare.py", "--report", str(root), "--page", str(page)], timeout=300)
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: {page}: no ladder block"), proc.stderr
    assert not (root / "ladder.md").exists() and not (root / "only" / "report").exists()


def test_the_committed_ladder_and_the_published_tables_are_made_again_from_the_committed_records(tmp_path):
    """lab/results/fair holds the studies behind the headline of README.md and lab/results.md:
    --report on a copy of their records alone gives back every study's report, ladder.md and
    both pages byte for byte (the plot aside: its bytes follow the matplotlib build)."""
    from study.ladder import study_dirs

    committed = REPO / "lab" / "results" / "fair"
    studies = study_dirs(committed)
    assert len(studies) >= 3, [s.name for s in studies]
    copy = tmp_path / "fair"
    for study in studies:
        shutil.copytree(study / "records", copy / study.name / "records")
    pages = {name: tmp_path / name.replace("/", "_") for name in ("README.md", "lab/results.md")}
    for name, page in pages.items():
        page.write_bytes((REPO / name).read_bytes())
    proc = run_python(["scripts/fair_compare.py", "--report", str(copy),
                       *(arg for page in pages.values() for arg in ("--page", str(page)))], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for study in studies:
        for name in ("comparison.md", "comparison.json", "trials.md", "chosen.md"):
            assert (copy / study.name / "report" / name).read_bytes() == (study / "report" / name).read_bytes(), \
                f"{study.name}/report/{name}"
    assert (copy / "ladder.md").read_bytes() == (committed / "ladder.md").read_bytes()
    for name, page in pages.items():
        assert page.read_bytes() == (REPO / name).read_bytes(), f"{name}: its ladder block is not what the records give"


def test_the_plots_name_what_they_draw(tmp_path):
    """speedup_vs_size.png names each rung beside its points; loss_vs_tokens.png draws each side's
    seed band, labels its reference lines and ticks every budget (1x, 1.5x, 2x, with its tokens)."""
    from study.analysis import analyse
    from study.plots import loss_vs_tokens, speedup_vs_size, speedup_vs_trials
    from study.records import load_study

    rungs = [rung(10 ** 6, 1.2, (1.1, 1.2, 1.3)), rung(10 ** 7, 1.2, (1.1, 1.2, 1.3), resolved=False)]
    assert speedup_vs_size(rungs, [trend(rungs, "val/val/loss", 99, 0)], tmp_path / "size.png") == [
        "r1000000", "r10000000 (unresolved)"]
    analysis = analyse(load_study(SMOKE / "records"))
    assert speedup_vs_trials(analysis, tmp_path / "k.png") == ["val", "ood_prose"]
    labels = loss_vs_tokens(analysis, tmp_path / "loss.png")
    for label in ("muon: seeds' range", "adamw: seeds' range", "muon: mean, monotone fit", "1x\n384", "1.5x\n576",
                  "2x\n768"):
        assert label in labels, (label, labels)
    assert any(label.startswith("muon's loss at 1x (") for label in labels)
    assert (tmp_path / "loss.png").stat().st_size > 10_000


def test_a_trend_is_fitted_only_over_resolved_dense_rungs_at_one_tokens_a_step():
    """A rung whose search did not converge stays out; rungs at different tokens a step (a batch
    that grows with size) refuse the trend, saying why; an MoE rung never enters."""
    at_512 = [rung(10 ** 6, 1.1, (1.1,) * 4), rung(10 ** 7, 1.2, (1.2,) * 4), rung(10 ** 8, 3.0, (3.0,) * 4, experts=8)]
    fitted, refused = fit_rungs(at_512)
    assert [r.name for r in fitted] == ["r1000000", "r10000000"] and refused is None
    fitted, refused = fit_rungs([at_512[0], rung(10 ** 7, 1.2, (1.2,) * 4, tokens_per_step=2048)])
    assert fitted == [] and refused == (
        "no trend is fitted: it needs two resolved dense rungs of different sizes at one tokens a step; the resolved "
        "dense rungs run 512, 2,048 tokens a step, so size and batch cannot be told apart")
    fitted, refused = fit_rungs([at_512[0], rung(10 ** 7, 1.2, (1.2,) * 4, resolved=False)])
    assert fitted == [] and refused.endswith("r10000000 is unresolved (a side's search did not converge)")
