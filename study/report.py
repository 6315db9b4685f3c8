"""The report of a fair study (scripts/fair_compare.py), made from its records alone
(study/records.py): the same records give the same report, byte for byte, on any machine
(the bootstrap is seeded, numbers are rounded as printed, no path or clock is written).

    comparison.md    the budgets spent (equal on both sides), the speedup on val and each OOD
                     set with its 95% interval and one-sided p-values, the final losses per budget
    comparison.json  the same numbers
    trials.md        every tuning and retuning run: what it tried and how it ended
    chosen.md        each side's chosen settings, at 1x and its lr at each longer budget
    loss_vs_tokens.png  each side's final losses against tokens (log), the fits and the crossing
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from study.records import OK, TUNE_KEY, Entry, StudyData, chosen_settings, final_loss
from study.speedup import Comparison, Side, compare_splits, isotonic_decreasing, mean


def reported_splits(data: StudyData) -> list[str]:
    """val/val/loss and each OOD set's loss, as the final runs logged them; never the tuning split."""
    keys = {key for series in data.series.values() for key in series
            if key.startswith("val/") and key.endswith("/loss") and key != TUNE_KEY}
    return sorted(keys, key=lambda k: (k != "val/val/loss", k))


def trials_by_ordinal(entries: list[Entry]) -> tuple[np.ndarray, np.ndarray | None, list[Entry]]:
    """(each proposal's objective, its mean over the tuning seeds; [trials, seeds] when 2+ seeds,
    else None; the first entry of each proposal), in the order the search made them."""
    by: dict[int, list[Entry]] = {}
    for e in entries:
        by.setdefault(e.ordinal, []).append(e)
    ordinals = sorted(by)
    per_seed = [[e.score for e in sorted(by[o], key=lambda e: e.seed)] for o in ordinals]
    means = np.array([math.inf if any(math.isinf(s) for s in row) else mean(row) for row in per_seed])
    seeds = np.array(per_seed) if per_seed and len(per_seed[0]) > 1 else None
    return means, seeds, [by[o][0] for o in ordinals]


def chosen_values(data: StudyData, side: str) -> dict[float, dict[str, float]]:
    """Each budget's settings of `side`, in the plan's order of budgets."""
    chosen = chosen_settings(data.entries, side)
    return {b: chosen[b] for b in data.plan["compare"]["budgets"] if b in chosen}


def side_inputs(data: StudyData, side: str, split: str) -> Side:
    plan = data.plan
    budgets, steps = plan["compare"]["budgets"], plan["compare"]["steps"]
    seeds = plan["compare"]["seeds"]
    finals = np.full((len(budgets), len(seeds)), math.inf)
    noise = []
    for i, (b, n) in enumerate(zip(budgets, steps)):
        tune_losses = []
        for j, s in enumerate(seeds):
            name = f"final/{side}/{b:g}x/seed{s}"
            series = data.series.get(name, {})
            finals[i, j] = final_loss(series, split, n)
            tune_losses.append(final_loss(series, TUNE_KEY, n))
        finite = sorted(v for v in tune_losses if math.isfinite(v))
        noise.append(float(np.std(finite, ddof=1)) if len(finite) > 1 else 0.0)
    selection, selection_seeds = [], []
    for i, b in enumerate(budgets):
        entries = data.of("tune", side) if i == 0 else data.of("retune", side, b)
        means, per_seed, _ = trials_by_ordinal(entries)
        selection.append(means)
        selection_seeds.append(per_seed)
    tokens = tuple(float(n * plan["tokens_per_step"]) for n in steps)
    return Side(tokens, finals, tuple(seeds), tuple(selection), None, tuple(selection_seeds), tuple(noise))


def comparisons(data: StudyData) -> dict[str, Comparison]:
    plan, stats = data.plan, data.plan["stats"]
    splits = reported_splits(data)
    targets = {k: side_inputs(data, plan["target"], k) for k in splits}
    bases = {k: side_inputs(data, plan["baseline"], k) for k in splits}
    return compare_splits(targets, bases, stats["bootstrap"], stats["seed"], stats["thresholds"])


def budget_lines(data: StudyData) -> list[str]:
    """Runs and tokens per side and stage: equal by construction, shown."""
    plan = data.plan
    lines = ["| stage | " + " | ".join(f"{s} runs | {s} tokens planned | {s} tokens seen" for s in
                                      (plan["target"], plan["baseline"])) + " |",
             "|---|" + "---:|" * 6]
    for stage in ("tune", "retune", "final"):
        cells = []
        for side in (plan["target"], plan["baseline"]):
            runs = data.of(stage, side)
            cells += [str(len(runs)), f"{sum(e.tokens_planned for e in runs):,}", f"{sum(e.tokens_seen for e in runs):,}"]
        lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    return lines


def ratio_text(c: Comparison) -> tuple[str, str, str]:
    ci = "-" if c.lo is None else f"{c.lo.format()} to {c.hi.format()}"
    ps = ", ".join(f"p(> {s0:g}x) = {p:.4f}" for s0, p in sorted(c.p.items()))
    return c.ratio.format(), ci, ps or "-"


def finals_lines(data: StudyData, splits: list[str]) -> list[str]:
    plan = data.plan
    lines = ["| side | budget | steps | tokens | " + " | ".join(splits) + " | diverged or crashed |",
             "|---|---:|---:|---:|" + "---:|" * len(splits) + "---:|"]
    for side in (plan["target"], plan["baseline"]):
        for b, n in zip(plan["compare"]["budgets"], plan["compare"]["steps"]):
            cells = []
            for k in splits:
                values = [final_loss(data.series.get(f"final/{side}/{b:g}x/seed{s}", {}), k, n)
                          for s in plan["compare"]["seeds"]]
                finite = sorted(v for v in values if math.isfinite(v))
                se = float(np.std(finite, ddof=1)) / math.sqrt(len(finite)) if len(finite) > 1 else 0.0
                cells.append(f"{mean(finite):.4f} ± {se:.4f}" if finite else "-")
            bad = sum(1 for e in data.of("final", side, b) if e.status != OK)
            lines.append(f"| {side} | {b:g}x | {n} | {n * plan['tokens_per_step']:,} | " + " | ".join(cells)
                         + f" | {bad} |")
    return lines


def write_report(data: StudyData, out: Path, results: dict[str, Comparison] | None = None) -> list[str]:
    """Write the report into `out` (`results`: comparisons(data), when the caller has them);
    return comparison.md's headline lines, for the terminal."""
    plan = data.plan
    out.mkdir(parents=True, exist_ok=True)
    splits = reported_splits(data)
    results = comparisons(data) if results is None else results
    t, c = plan["tuning"], plan["compare"]
    head = [f"# {plan['target']} against {plan['baseline']}: a fair comparison", "",
            f"Model {model_text(plan['model'])}, {plan['tokens_per_step']:,} tokens a step on both sides. Each side "
            f"tuned by coordinate descent over its space ({t['trials']} trials at {c['steps'][0]} steps, scored on "
            f"{t['objective']}, the tuning split data.tune_fraction={t['split_fraction']}, seeds {t['seeds']}), its lr "
            f"searched again at each longer budget ({c['retune']['trials']} trials), then rerun at every budget on "
            f"fresh seeds {c['seeds']}. Speedup: the tokens {plan['baseline']} needs to reach {plan['target']}'s final "
            f"loss over {plan['target']}'s, from a monotone fit in log tokens through end-of-schedule points; a "
            "crossing beyond the budgets run is a bound, never extrapolated.",
            *(["", *(f"- {note}." for note in plan.get("notes", [])[1:])] if plan.get("notes", [])[1:] else []),
            "", "## Speedup", "",
            "| split | speedup | 95% interval | one-sided p |", "|---|---:|---|---|"]
    head += [f"| {k} | " + " | ".join(ratio_text(results[k])) + " |" for k in splits]
    head += ["", f"The interval and p-values: {plan['stats']['bootstrap']} bootstrap replicates over the seeds, "
             "paired between the sides, each redoing the choice among the trials run (a config's tuning loss "
             "perturbed by the measured seed noise); the re-selection assumes a loss gap on the tuning split "
             "carries over to val and OOD.", ""]
    body = ["## Budgets spent (equal by construction)", "", *budget_lines(data), "",
            "## Final losses (mean ± standard error over the seeds)", "", *finals_lines(data, splits), ""]
    (out / "comparison.md").write_text("\n".join(head + body))
    (out / "comparison.json").write_text(json.dumps(
        {"splits": {k: results[k].to_dict() for k in splits}, "budget": budget_summary(data)}, indent=1,
        sort_keys=True, allow_nan=False) + "\n")
    (out / "trials.md").write_text("\n".join(trials_lines(data)) + "\n")
    (out / "chosen.md").write_text("\n".join(chosen_lines(data)) + "\n")
    plot(data, splits, results, out / "loss_vs_tokens.png")
    return [line for line in head if line.startswith("| ")]


def model_params(model: dict, vocab_size: int = 8) -> tuple[int, int]:
    """(non-embedding parameters, those one token goes through) of a plan's model config, counted
    on a model built on the meta device (no memory)."""
    import torch

    from model.config import ModelConfig
    from model.gpt import GPT

    cfg = ModelConfig(**{**model, "vocab_size": vocab_size})
    with torch.device("meta"):
        gpt = GPT(cfg)
    params = gpt.num_params(non_embedding=True)
    routed = sum(p.numel() for name, p in gpt.named_parameters() if ".experts." in name)
    active = params - routed + (routed * cfg.top_k // cfg.n_experts if cfg.n_experts else 0)
    return params, active


def model_text(model: dict) -> str:
    """The model by its shape, not only its preset's name: "gpt_tiny (4 layers, width 64,
    0.20M non-embedding parameters)", an MoE with its experts and active parameters."""
    params, active = model_params(model)
    shape = f"{model.get('n_layers')} layers, width {model.get('d_model')}, {params / 1e6:.2f}M non-embedding parameters"
    if model.get("n_experts"):
        shape += (f", {model['n_experts']} experts (top {model.get('top_k')}), {active / 1e6:.2f}M of them active "
                  "per token")
    return f"{model.get('name')} ({shape})"


def budget_summary(data: StudyData) -> dict[str, Any]:
    plan = data.plan
    return {side: {stage: {"runs": len(data.of(stage, side)),
                           "tokens_planned": sum(e.tokens_planned for e in data.of(stage, side)),
                           "tokens_seen": sum(e.tokens_seen for e in data.of(stage, side))}
                   for stage in ("tune", "retune", "final")} for side in (plan["target"], plan["baseline"])}


def trials_lines(data: StudyData) -> list[str]:
    lines = ["# Every tuning run", "", "| side | stage | budget | # | round | reason | dimension | seed | settings | "
             "outcome |", "|---|---|---:|---:|---:|---|---|---:|---|---|"]
    for e in [e for e in data.entries if e.stage != "final"]:
        outcome = f"{e.objective:.4f}" if e.status == OK else e.status + (f": {e.error}" if e.error else "")
        settings = ", ".join(f"{k}={v:.4g}" for k, v in e.values.items())
        lines.append(f"| {e.side} | {e.stage} | {e.budget:g}x | {e.ordinal} | {e.round} | {e.reason} | {e.dim or '-'} "
                     f"| {e.seed} | {settings} | {outcome} |")
    return lines


def chosen_lines(data: StudyData) -> list[str]:
    lines = ["# The settings each side chose", ""]
    for side in (data.plan["target"], data.plan["baseline"]):
        chosen = chosen_values(data, side)
        if 1.0 in chosen:
            lines.append(f"- {side} at 1x: " + ", ".join(f"{k}={v:.4g}" for k, v in chosen[1.0].items()))
        lines += [f"- {side} at {b:g}x: lr={v['lr']:.4g}" for b, v in chosen.items() if b != 1.0]
        fixed = data.plan["spaces"][side].get("fixed") or []
        if isinstance(fixed, list) and fixed:  # held dims (tuning.dims) and the side's own fixed overrides
            lines.append(f"- {side}, not tuned here: " + ", ".join(fixed))
    return lines


def plot(data: StudyData, splits: list[str], results: dict[str, Comparison], path: Path) -> list[str]:
    """Each split's final losses against tokens (log), both sides: every seed's point, the band
    the seeds span at each budget, the monotone fit through their means; the target's 1x loss
    and the tokens at which the baseline reaches it, each line labelled; a tick at every budget.
    Returns the labels drawn, for the tests."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    plan = data.plan
    target, baseline = plan["target"], plan["baseline"]
    budgets, per_step = plan["compare"]["budgets"], plan["tokens_per_step"]
    budget_tokens = [n * per_step for n in plan["compare"]["steps"]]
    labels: list[str] = []
    fig, axes = plt.subplots(1, len(splits), figsize=(5.5 * len(splits), 4.2), squeeze=False)
    for ax, split in zip(axes[0], splits):
        for side, colour in ((target, "tab:red"), (baseline, "tab:blue")):
            inputs = side_inputs(data, side, split)
            tokens = np.array(inputs.tokens)
            finite = np.where(np.isfinite(inputs.finals), inputs.finals, np.nan)
            ax.plot(np.repeat(tokens, finite.shape[1]), finite.ravel(), "o", color=colour, alpha=0.35, ms=3)
            with np.errstate(all="ignore"):
                if np.isfinite(finite).any(axis=1).all():
                    ax.fill_between(tokens, np.nanmin(finite, axis=1), np.nanmax(finite, axis=1), color=colour,
                                    alpha=0.12, lw=0, label=f"{side}: seeds' range")
            fitted = isotonic_decreasing(inputs.means)
            ax.plot(tokens, np.where(np.isfinite(fitted), fitted, np.nan), "-", color=colour,
                    label=f"{side}: mean, monotone fit")
        target_1x = isotonic_decreasing(side_inputs(data, target, split).means)[0]
        if math.isfinite(target_1x):
            ax.axhline(target_1x, color="grey", lw=0.8, ls=":", label=f"{target}'s loss at 1x ({target_1x:.3f})")
        r = results[split].ratio
        if not r.censored:  # where the slower side reaches the faster side's 1x loss
            slower, faster = (baseline, target) if r.value >= 1 else (target, baseline)
            reach = budget_tokens[0] * (r.value if r.value >= 1 else 1 / r.value)
            ax.axvline(reach, color="grey", lw=0.8, label=f"{slower} reaches {faster}'s 1x loss: {reach:,.0f} tokens")
        ax.set_xscale("log")
        ax.set_xticks(budget_tokens)
        ax.set_xticklabels([f"{b:g}x\n{t:,}" for b, t in zip(budgets, budget_tokens)], fontsize=7)
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel("tokens (budget)")
        ax.set_ylabel(split)
        ax.set_title(f"{split}: {r.format()}")
        ax.legend(fontsize=7)
        labels += [t.get_text() for t in ax.get_legend().get_texts()] + [t.get_text() for t in ax.get_xticklabels()]
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return labels
