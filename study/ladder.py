"""A fair study across model sizes: one study of scripts/fair_compare.py per rung (a dense model
at each size, an MoE beside them), read side by side. `fair_compare.py --report ROOT`, ROOT a dir
of studies, makes each study's report again and, from all of their records,

    ROOT/ladder.md            each rung's size and tokens, its speedup on val and every OOD set
                              with the 95% interval and p-value, and the trend against size
    ROOT/speedup_vs_size.png  the speedups against non-embedding parameters, with their
                              intervals and the fitted trend

`--page FILE` (README.md, lab/results.md) also rewrites the block between LADDER_BEGIN and
LADDER_END in FILE with the headline table, so a published figure is what the records give.

The trend is a least-squares line of log(speedup) against log10(non-embedding parameters) over
the dense rungs; exp(slope) is the factor the speedup gains per 10x parameters. Its interval
resamples each rung's bootstrap replicates independently (the rungs are separate experiments,
with their own seeds and tuning); a replicate beyond a rung's budgets enters at its bound, and
the share of those is printed. A rung whose estimate itself lies beyond its budgets (AdamW never
reached Muon's loss: "> 2.00x") enters at that bound too, so the fitted factor is a bound: at
least that when the censored rungs all push the slope up (a '>' above the mean size, a '<'
below it), at most that when they all push it down. Three sizes fit a line, not a curve: the
trend is a summary of the sizes run, not a law.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from study.records import PLAN_FILE, RECORDS, REPORT, StudyData, StudyError, load_study
from study.speedup import Comparison
from study.report import comparisons, model_params, ratio_text, write_report

LADDER_BEGIN = "<!-- fair ladder: begin (scripts/fair_compare.py --report lab/results/fair --page ...) -->"
LADDER_END = "<!-- fair ladder: end -->"
VAL = "val/val/loss"


@dataclass
class Rung:
    """One study of the ladder, as its records give it."""

    name: str                       # its dir's name
    model: str
    experts: int                    # routed experts; 0: dense
    params: int                     # non-embedding parameters (every expert's)
    active: int                     # non-embedding parameters one token goes through
    tokens_1x: int
    tokens_max: int                 # the longest budget's tokens
    train_tokens: Optional[int]     # the corpus's training split, from a run's environment.json
    seeds: int
    trials: int                     # tuning trials per side
    results: dict[str, Comparison]

    @property
    def tokens_per_param(self) -> float:
        return self.tokens_1x / self.active


@dataclass
class Trend:
    split: str
    rungs: int
    factor: float                   # exp(slope): the speedup's factor per 10x parameters
    lo: float
    hi: float
    p_no_decline: float             # one-sided: (1 + #{slope_r >= 0}) / (R + 1)
    at_bound: float                 # the share of rung replicates that entered at a bound
    bound: str = "="                # "=", or ">"/"<" when censored rung estimates make the factor
                                    # a lower/upper bound, "?" when they pull both ways
    bounded_rungs: int = 0          # dense rungs whose estimate is itself a bound


def study_dirs(root: Path) -> list[Path]:
    """The studies directly below `root` (each holds records/plan.json), by name."""
    return sorted(d for d in root.iterdir() if (d / RECORDS / PLAN_FILE).is_file()) if root.is_dir() else []


def is_ladder(root: Path) -> bool:
    return not (root / RECORDS / PLAN_FILE).is_file() and not (root / PLAN_FILE).is_file() and bool(study_dirs(root))


def rung_of(path: Path, data: StudyData, results: dict[str, Comparison]) -> Rung:
    from eval.environment import read_environment

    plan = data.plan
    params, active = model_params(plan["model"])
    steps, per_step = plan["compare"]["steps"], plan["tokens_per_step"]
    train_tokens = None
    for e in data.entries:
        env = read_environment(path / RECORDS / e.name) or {}
        train_tokens = ((env.get("corpus") or {}).get("splits") or {}).get("train", {}).get("tokens")
        if train_tokens:
            break
    return Rung(path.name, plan["model"].get("name", path.name), int(plan["model"].get("n_experts") or 0), params,
                active, steps[0] * per_step, steps[-1] * per_step, train_tokens, len(plan["compare"]["seeds"]),
                int(plan["tuning"]["trials"]), results)


def trend(rungs: list[Rung], split: str, replicates: int, seed: int) -> Optional[Trend]:
    """The dense rungs' log speedup against log10 parameters (None with fewer than 2 rungs)."""
    dense = [r for r in rungs if not r.experts and split in r.results and r.results[split].draws]
    x = np.array([math.log10(r.params) for r in dense])
    if len(set(x.tolist())) < 2:  # a line needs two sizes
        return None
    xc = x - x.mean()

    def slopes(y: np.ndarray) -> np.ndarray:  # y: [..., rungs]
        return (y - y.mean(axis=-1, keepdims=True)) @ xc / float(xc @ xc)

    point = float(slopes(np.array([math.log(r.results[split].ratio.value) for r in dense])))
    # A censored estimate enters at its bound; raising a '>' rung above the mean size (or a '<'
    # rung below it) could only raise the slope, so the factor is then a lower bound.
    pushes = {1 if (r.results[split].ratio.bound == ">") == (xi > 0) else -1
              for r, xi in zip(dense, xc) if r.results[split].ratio.censored}
    bound = "=" if not pushes else "?" if len(pushes) > 1 else ">" if pushes == {1} else "<"
    rng = np.random.default_rng([seed, 1])
    draws, bounded = [], 0
    for r in dense:
        values = np.array(r.results[split].draws)
        pick = values[rng.integers(0, len(values), size=replicates)]
        c = r.results[split]
        bounded += int(round((c.censored_share[0] + c.censored_share[1]) * replicates))
        draws.append(np.log(pick))
    sampled = np.sort(slopes(np.stack(draws, axis=1)))
    rank = max(1, math.floor(0.025 * (replicates + 1)))
    return Trend(split, len(dense), math.exp(point), math.exp(float(sampled[rank - 1])),
                 math.exp(float(sampled[replicates - rank])),
                 (1 + int(np.sum(sampled >= 0))) / (replicates + 1), bounded / (replicates * len(dense)),
                 bound, sum(r.results[split].ratio.censored for r in dense))


def params_text(n: int) -> str:
    return f"{n / 1e6:.2f}M"


FACTOR_BOUND = {"=": "", ">": " or more", "<": " or less", "?": ""}


def trend_line(t: Trend) -> str:
    """One line: the factor per 10x parameters, its interval and p-value, over how many sizes."""
    sizes = f"{t.rungs} dense sizes"
    if t.bounded_rungs:
        sizes += (f", {t.bounded_rungs} of them a bound" +
                  (" pulling both ways, so the factor is neither bound" if t.bound == "?" else ""))
    return (f"{short(t.split)}: x{t.factor:.2f}{FACTOR_BOUND[t.bound]} per 10x non-embedding parameters "
            f"(95% interval x{t.lo:.2f} to x{t.hi:.2f}; p(no decline) = {t.p_no_decline:.4f}; {sizes}"
            + (f"; {t.at_bound:.1%} of replicates at a budget's bound" if t.at_bound else "") + ")")


def headline_lines(rungs: list[Rung], trends: list[Trend]) -> list[str]:
    """The table a page shows: per rung, its size and each split's speedup; then the trends."""
    splits = sorted({k for r in rungs for k in r.results}, key=lambda k: (k != VAL, k))
    head = "| model | non-embedding params | " + " | ".join(
        f"{short(k)} speedup (95% interval) | p(> 1x)" for k in splits) + " |"
    lines = [head, "|---|---:|" + "---:|---:|" * len(splits)]
    for r in rungs:
        size = params_text(r.params) + (f" ({params_text(r.active)} active)" if r.experts else "")
        cells = []
        for k in splits:
            if k not in r.results:
                cells += ["-", "-"]
                continue
            ratio, ci, _ = ratio_text(r.results[k])
            cells += [f"{ratio} ({ci})", f"{r.results[k].p.get(1.0, math.nan):.4f}"]
        lines.append(f"| {r.model} | {size} | " + " | ".join(cells) + " |")
    lines += ["", *(f"Trend, {trend_line(t)}." for t in trends)]
    return lines


def short(split: str) -> str:
    """val/val/loss -> val; val/ood_prose/loss -> ood_prose."""
    return split.split("/")[1] if split.count("/") == 2 else split


def ladder_lines(rungs: list[Rung], trends: list[Trend]) -> list[str]:
    lines = ["# Muon against AdamW across model sizes: the fair ladder", "",
             "Each rung is a study of scripts/fair_compare.py (its report: <rung>/report/comparison.md). The speedup "
             "is the tokens AdamW needs to reach Muon's final loss over Muon's, both sides tuned with the same trials "
             "and tokens; the interval is a 95% bootstrap over the seeds that also redoes the selection.", "",
             *headline_lines(rungs, trends), "", "## The rungs", "",
             "| rung | model | routed experts | non-embedding params | active | tokens at 1x | per active param | "
             "longest budget | epochs at the longest | tuning trials per side | fresh seeds |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rungs:
        epochs = f"{r.tokens_max / r.train_tokens:.2f}" if r.train_tokens else "-"
        lines.append(f"| {r.name} | {r.model} | {r.experts} | {r.params:,} | {r.active:,} | {r.tokens_1x:,} | "
                     f"{r.tokens_per_param:.3g} | {r.tokens_max:,} | {epochs} | {r.trials} | {r.seeds} |")
    lines += ["", "The trend: least squares of log(speedup) on log10(non-embedding parameters) over the dense rungs; "
              "its interval resamples each rung's bootstrap replicates independently, and p(no decline) is the "
              "one-sided p-value of a slope >= 0."]
    return lines + [""]


def plot(rungs: list[Rung], trends: list[Trend], path: Path) -> list[str]:
    """Speedup against non-embedding parameters (log-log): each split's estimate with its
    interval, each rung named beside its points, MoE at its active parameters, and each split's
    fitted trend through the dense rungs. Returns the rung labels drawn, for the tests."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    splits = sorted({k for r in rungs for k in r.results}, key=lambda k: (k != VAL, k))
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
                named.append(ax.annotate(r.name, (x, y), textcoords="offset points", xytext=(6, 5), fontsize=7))
    for t in trends:
        dense = [r for r in rungs if not r.experts and t.split in r.results]
        xs = np.array([min(r.params for r in dense), max(r.params for r in dense)])
        centre = np.mean([math.log10(r.params) for r in dense])
        mid = np.mean([math.log(r.results[t.split].ratio.value) for r in dense])
        ys = np.exp(mid + math.log(t.factor) * (np.log10(xs) - centre))
        ax.plot(xs, ys, "--", color=colours.get(t.split, "grey"), lw=1,
                label=f"{short(t.split)} trend: x{t.factor:.2f}{FACTOR_BOUND[t.bound]} per 10x")
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


def replace_block(text: str, block: list[str], where: str) -> str:
    """`text` with the lines between LADDER_BEGIN and LADDER_END replaced by `block`."""
    if LADDER_BEGIN not in text or LADDER_END not in text:
        raise StudyError(f"{where}: no ladder block (a line '{LADDER_BEGIN}', then '{LADDER_END}')")
    head, rest = text.split(LADDER_BEGIN, 1)
    _, tail = rest.split(LADDER_END, 1)
    return head + LADDER_BEGIN + "\n" + "\n".join(block) + "\n" + LADDER_END + tail


def read_ladder(root: Path) -> tuple[list[Rung], list[Trend]]:
    """Every study below `root`, each report written again, and the trends across them."""
    rungs = []
    stats = None
    for path in study_dirs(root):
        data = load_study(path)
        results = comparisons(data)
        write_report(data, path / REPORT, results)
        rungs.append(rung_of(path, data, results))
        stats = stats or data.plan["stats"]
    rungs.sort(key=lambda r: (bool(r.experts), r.params))
    splits = sorted({k for r in rungs for k in r.results}, key=lambda k: (k != VAL, k))
    trends = [t for k in splits if (t := trend(rungs, k, stats["bootstrap"], stats["seed"])) is not None]
    return rungs, trends


def write_ladder(root: Path, pages: list[Path]) -> list[str]:
    """The reports, ladder.md and speedup_vs_size.png under `root`, and each page's block; the
    headline lines, for the terminal."""
    if not study_dirs(root):
        raise StudyError(f"{root}: no study below it (a dir with {RECORDS}/{PLAN_FILE})")
    texts = {page: page.read_text() for page in pages}  # every page checked before anything is written
    for page, text in texts.items():
        replace_block(text, [], str(page))
    rungs, trends = read_ladder(root)
    (root / "ladder.md").write_text("\n".join(ladder_lines(rungs, trends)))
    plot(rungs, trends, root / "speedup_vs_size.png")
    headline = headline_lines(rungs, trends)
    for page, text in texts.items():
        page.write_text(replace_block(text, headline, str(page)))
    return headline
