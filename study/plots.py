"""The fair study's figures, each drawn from what study/analysis.py and study/ladder.py worked out:

    loss_vs_tokens.png    a study's final losses against tokens, both sides, with the seeds' band
    speedup_vs_trials.png a study's speedup replayed with the first k tuning trials a side
    speedup_vs_size.png   a ladder's speedups against parameters, each rung named

Each returns the labels it drew, for the tests; the PNGs carry no clock (byte-stable per build).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from study.analysis import Analysis, side_inputs
from study.records import VAL_KEY
from study.speedup import isotonic_decreasing


def short(split: str) -> str:
    """val/val/loss -> val; val/ood_prose/loss -> ood_prose."""
    return split.split("/")[1] if split.count("/") == 2 else split


def loss_vs_tokens(analysis: Analysis, path: Path) -> list[str]:
    """Each split's final losses against tokens (log), both sides: every seed's point, the band
    the seeds span at each budget, the monotone fit through their means; the target's 1x loss
    and the tokens at which the baseline reaches it, each line labelled; a tick at every budget.
    Returns the labels drawn, for the tests."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    data, splits, results = analysis.data, analysis.splits, analysis.results
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


def speedup_vs_trials(analysis: Analysis, path: Path) -> list[str]:
    """Each split's speedup had both sides stopped tuning after their first k trials (k = 1 ..
    trials; study/sensitivity.py), against k on a log axis: flat at the right end means more
    trials would not have moved it. A bound is drawn at its value, as a triangle."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    labels = []
    for split, colour in zip(analysis.splits, ("tab:red", "tab:blue", "tab:green", "tab:purple")):
        ratios = analysis.replayed[split]
        if not ratios:
            continue
        ks = np.arange(1, len(ratios) + 1)
        ax.plot(ks, [r.value for r in ratios], "-", color=colour, label=short(split))
        bounded = [(k, r.value, r.bound) for k, r in zip(ks, ratios) if r.censored]
        for k, value, bound in bounded:
            ax.plot([k], [value], "^" if bound == ">" else "v", color=colour, ms=5)
        labels.append(short(split))
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tuning trials a side, k (the first k of the search)")
    ax.set_ylabel("speedup (tokens)")
    ax.set_title("The speedup had tuning stopped after k trials")
    if labels:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return labels


def speedup_vs_size(rungs: list[Any], trends: list[Any], path: Path) -> list[str]:
    """Speedup against non-embedding parameters (log-log): each split's estimate with its
    interval, each rung named beside its points, MoE at its active parameters, and each split's
    fitted trend through the dense rungs. Returns the rung labels drawn, for the tests."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    splits = sorted({k for r in rungs for k in r.results}, key=lambda k: (k != VAL_KEY, k))
    colours = dict(zip(splits, ("tab:red", "tab:blue", "tab:green", "tab:purple")))
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    named = []
    for i, k in enumerate(splits):
        for r in rungs:
            if k not in r.results:
                continue
            c = r.results[k]
            x = r.active * (1 + 0.03 * (i - (len(splits) - 1) / 2))  # side by side, not on top
            y = c.ratio.value  # a censored estimate or interval end at its bound, drawn as an arrow
            err = [[y - c.lo.value], [c.hi.value - y]] if c.lo is not None else None
            marker = {">": "^", "<": "v"}.get(c.ratio.bound, "s" if r.experts else "o")
            ax.errorbar([x], [y], yerr=err, fmt=marker, color=colours.get(k, "grey"), capsize=3,
                        mfc="white" if r.experts else colours.get(k, "grey"),
                        label=short(k) if r is rungs[0] else None)
            for end, bound, caret in ((c.hi, ">", "^"), (c.lo, "<", "v")):  # an interval end beyond the budgets
                if end is not None and end.bound == bound:
                    ax.plot([x], [end.value], caret, color=colours.get(k, "grey"), ms=7)
            if i == 0:
                label = r.name if r.resolved else f"{r.name} (unresolved)"
                named.append(ax.annotate(label, (x, y), textcoords="offset points", xytext=(6, 5), fontsize=7))
    for t in trends:
        dense = [r for r in rungs if not r.experts and t.split in r.results]
        xs = np.array([min(r.params for r in dense), max(r.params for r in dense)])
        centre = np.mean([math.log10(r.params) for r in dense])
        mid = np.mean([math.log(r.results[t.split].ratio.value) for r in dense])
        ys = np.exp(mid + math.log(t.factor) * (np.log10(xs) - centre))
        ax.plot(xs, ys, "--", color=colours.get(t.split, "grey"), lw=1,
                label=f"{short(t.split)} trend: x{t.factor:.2f}{t.bound_words} per 10x")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    low, high = ax.get_ylim()  # speedups span less than a decade: label them on a linear-looking grid
    ax.set_yticks([v for v in (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.4, 1.6, 1.8, 2.0, 2.5, 3.0) if low <= v <= high])
    ax.set_ylim(low, high)
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.2gx"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("non-embedding parameters (MoE, open square: active; triangle: a bound)")
    ax.set_ylabel("speedup of Muon over AdamW (tokens)")
    ax.set_title("Muon against AdamW, both tuned alike")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return [text.get_text() for text in named]
