"""A fair study across model sizes: one study of scripts/fair_compare.py per rung (a dense model
at each size, an MoE beside them), read side by side. `fair_compare.py --report ROOT`, ROOT a dir
of studies, makes each study's report again and, from all of their records,

    ROOT/ladder.md            each rung's size, tokens per step and per parameter, search, and
                              speedup on val and every OOD set; what differs between the rungs
                              besides size; and the trend against size, or why there is none
    ROOT/speedup_vs_size.png  the speedups against non-embedding parameters, each rung named

`--page FILE` (README.md, lab/results.md) also rewrites the block between LADDER_BEGIN and
LADDER_END in FILE with the headline table, so a published figure is what the records give.

The trend is a least-squares line of log(speedup) against log10(non-embedding parameters) over
the dense rungs; exp(slope) is the factor the speedup gains per 10x parameters. It is fitted only
over resolved rungs (both sides' searches converged: study/search_state.py) that share one
tokens per step, at two sizes or more: otherwise a growing batch, a short search or a held
setting could make a "size" trend, and the ladder says why it fits none. Its interval resamples
each rung's bootstrap replicates independently (the rungs are separate experiments); a
replicate or estimate beyond a rung's budgets enters at its bound, and a factor or interval end
pushed by such bounds is printed as one ("or more"). p(> x1) is the one-sided p-value that the
speedup does not grow with size, the orientation of a study's p(> 1x); p(< x1) that it does not
shrink. Three sizes fit a line, not a curve: the trend summarises the sizes run, not a law.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from study.analysis import Analysis, Scale, analyse
from study.plots import short, speedup_vs_size
from study.records import PLAN_FILE, RECORDS, REPORT, VAL_KEY, StudyError, load_study
from study.report import ratio_text, write_report
from study.speedup import Comparison

LADDER_BEGIN = "<!-- fair ladder: begin (scripts/fair_compare.py --report lab/results/fair --page ...) -->"
LADDER_END = "<!-- fair ladder: end -->"
BOUND_WORDS = {"=": "", ">": " or more", "<": " or less", "?": ""}


@dataclass
class Rung:
    """One study of the ladder, as its records give it."""

    name: str                       # its dir's name
    model: str
    experts: int                    # routed experts; 0: dense
    scale: Scale
    results: dict[str, Comparison]
    resolved: bool = True
    search: str = ""                # both sides' search, in a few words

    @property
    def params(self) -> int:
        return self.scale.params

    @property
    def active(self) -> int:
        return self.scale.active


@dataclass
class Trend:
    split: str
    rungs: int
    factor: float                   # exp(slope): the speedup's factor per 10x parameters
    lo: float
    hi: float
    p_up: float                     # p(> x1): (1 + #{slope_r <= 0}) / (R + 1)
    p_down: float                   # p(< x1): (1 + #{slope_r >= 0}) / (R + 1)
    at_bound: float                 # the share of rung replicates that entered at a bound
    bound: str = "="                # "=", or ">"/"<" when censored rung estimates make the factor
                                    # a lower/upper bound, "?" when they pull both ways
    bounded_rungs: int = 0          # dense rungs whose estimate is itself a bound
    lo_bound: str = "="             # ">"/"<": that interval end is itself a bound (replicates at a
    hi_bound: str = "="             # budget's bound pushed it)

    @property
    def bound_words(self) -> str:
        return BOUND_WORDS[self.bound]


def study_dirs(root: Path) -> list[Path]:
    """The studies directly below `root` (each holds records/plan.json), by name."""
    return sorted(d for d in root.iterdir() if (d / RECORDS / PLAN_FILE).is_file()) if root.is_dir() else []


def is_ladder(root: Path) -> bool:
    return not (root / RECORDS / PLAN_FILE).is_file() and not (root / PLAN_FILE).is_file() and bool(study_dirs(root))


def rung_of(path: Path, a: Analysis) -> Rung:
    plan = a.plan
    short_of = [side for side, s in a.states.items() if not s.converged]
    search = "yes" if not short_of else "no: " + ", ".join(short_of)
    return Rung(path.name, plan["model"].get("name", path.name), int(plan["model"].get("n_experts") or 0), a.scale,
                a.results, a.resolved, search)


def _push(r: Rung, xi: float, bound: str) -> int:
    """+1 if a censored value `bound` at this rung (x offset xi) can only raise the slope, -1 lower."""
    return 1 if (bound == ">") == (xi > 0) else -1


def trend(rungs: list[Rung], split: str, replicates: int, seed: int) -> Optional[Trend]:
    """The given dense rungs' log speedup against log10 parameters (None with fewer than 2 sizes).
    Which rungs may enter is fit_rungs's to say."""
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
    pushes = {_push(r, xi, r.results[split].ratio.bound) for r, xi in zip(dense, xc) if r.results[split].ratio.censored}
    bound = "=" if not pushes else "?" if len(pushes) > 1 else ">" if pushes == {1} else "<"
    rng = np.random.default_rng([seed, 1])
    draws, bounded, end_pushes = [], 0, set()
    for r, xi in zip(dense, xc):
        values = np.array(r.results[split].draws)
        pick = values[rng.integers(0, len(values), size=replicates)]
        c = r.results[split]
        bounded += int(round((c.censored_share[0] + c.censored_share[1]) * replicates))
        for share, side in ((c.censored_share[0], "<"), (c.censored_share[1], ">")):
            if share > 0:
                end_pushes.add(_push(r, xi, side))
        draws.append(np.log(pick))
    sampled = np.sort(slopes(np.stack(draws, axis=1)))
    rank = max(1, math.floor(0.025 * (replicates + 1)))
    hi_bound = ">" if 1 in end_pushes else "="   # replicates held at a bound pulled this end in
    lo_bound = "<" if -1 in end_pushes else "="
    return Trend(split, len(dense), math.exp(point), math.exp(float(sampled[rank - 1])),
                 math.exp(float(sampled[replicates - rank])),
                 (1 + int(np.sum(sampled <= 0))) / (replicates + 1), (1 + int(np.sum(sampled >= 0))) / (replicates + 1),
                 bounded / (replicates * len(dense)), bound, sum(r.results[split].ratio.censored for r in dense),
                 lo_bound, hi_bound)


def fit_rungs(rungs: list[Rung]) -> tuple[list[Rung], Optional[str]]:
    """(the rungs a trend may be fitted over, or why there is no trend): the resolved dense rungs,
    all at one tokens per step, two sizes or more."""
    dense = [r for r in rungs if not r.experts]
    resolved = [r for r in dense if r.resolved]
    why = []
    unresolved = [r.name for r in dense if not r.resolved]
    if unresolved:
        why.append(f"{', '.join(unresolved)} {'is' if len(unresolved) == 1 else 'are'} unresolved (a side's search "
                   "did not converge)")
    steps = sorted({r.scale.tokens_per_step for r in resolved})
    every = sorted({r.scale.tokens_per_step for r in dense})
    if len(steps) > 1 or (len(every) > 1 and not fitted_ok(resolved, steps)):
        which = "resolved dense rungs" if len(steps) > 1 else "dense rungs"
        why.append(f"the {which} run " + ", ".join(f"{s:,}" for s in (steps if len(steps) > 1 else every))
                   + " tokens a step, so size and batch cannot be told apart")
    if not fitted_ok(resolved, steps):
        return [], ("no trend is fitted: it needs two resolved dense rungs of different sizes at one tokens a step; "
                    + ("; ".join(why) if why else f"{len(resolved)} resolved dense rung(s)"))
    return resolved, None


def fitted_ok(resolved: list[Rung], steps: list[int]) -> bool:
    return len({r.params for r in resolved}) >= 2 and len(steps) == 1


def params_text(n: int) -> str:
    return f"{n / 1e6:.2f}M"


def trend_line(t: Trend) -> str:
    """One line: the factor per 10x parameters, its interval and p-values, over how many sizes."""
    sizes = f"{t.rungs} dense sizes"
    if t.bounded_rungs:
        sizes += (f", {t.bounded_rungs} of them a bound" +
                  (" pulling both ways, so the factor is neither bound" if t.bound == "?" else ""))
    lo = f"x{t.lo:.2f}{BOUND_WORDS[t.lo_bound]}"
    hi = f"x{t.hi:.2f}{BOUND_WORDS[t.hi_bound]}"
    return (f"{short(t.split)}: x{t.factor:.2f}{t.bound_words} per 10x non-embedding parameters "
            f"(95% interval {lo} to {hi}; p(> x1) = {t.p_up:.4f}, p(< x1) = {t.p_down:.4f}; {sizes}"
            + (f"; {t.at_bound:.1%} of replicates at a budget's bound" if t.at_bound else "") + ")")


def headline_lines(rungs: list[Rung], trends: list[Trend], refused: Optional[str]) -> list[str]:
    """The table a page shows: per rung, its size, tokens, search and each split's speedup (an
    unresolved rung with that word, no p-value); then the trends, or why there are none."""
    splits = sorted({k for r in rungs for k in r.results}, key=lambda k: (k != VAL_KEY, k))
    head = ("| model | non-embedding params | tokens a step | tokens a param at 1x | converged | "
            + " | ".join(f"{short(k)} speedup (95% interval) | p(> 1x)" for k in splits) + " |")
    lines = [head, "|---|---:|---:|---:|---|" + "---:|---:|" * len(splits)]
    for r in rungs:
        size = params_text(r.params) + (f" ({params_text(r.active)} active)" if r.experts else "")
        cells = []
        for k in splits:
            if k not in r.results:
                cells += ["-", "-"]
                continue
            ratio, ci, _ = ratio_text(r.results[k], r.resolved)
            p = f"{r.results[k].p.get(1.0, math.nan):.4f}" if r.resolved else "-"
            cells += [f"{ratio} ({ci})", p]
        lines.append(f"| {r.model} | {size} | {r.scale.tokens_per_step:,} | {r.scale.tokens_per_param:.3g} | {r.search} | "
                     + " | ".join(cells) + " |")
    lines += ["", "Intervals: 95%, the seed noise given the chosen settings."]
    lines += [f"Trend, {trend_line(t)}." for t in trends] or [f"Trend: {refused}."]
    return lines


def confound_lines(rungs: list[Rung]) -> list[str]:
    """What the rungs differ in besides size, and which of those the dense rungs vary."""
    columns = {"tokens a step": lambda r: f"{r.scale.tokens_per_step:,}",
               "steps at 1x": lambda r: str(r.scale.steps[0]),
               "tokens a param at 1x": lambda r: f"{r.scale.tokens_per_param:.3g}",
               "tuning trials a side": lambda r: str(r.scale.trials),
               "settings tuned": lambda r: str(r.scale.dims_tuned),
               "fresh seeds": lambda r: str(r.scale.seeds),
               "share of parameters Muon steps": lambda r: "-" if r.scale.muon_share is None else f"{r.scale.muon_share:.0%}",
               "search": lambda r: r.search}
    lines = ["| rung | non-embedding params | " + " | ".join(columns) + " |",
             "|---|---:|" + "---|" * len(columns)]
    lines += [f"| {r.name} | {params_text(r.params)} | " + " | ".join(f(r) for f in columns.values()) + " |" for r in rungs]
    dense = [r for r in rungs if not r.experts]
    varied = [name for name, f in columns.items() if len({f(r) for r in dense}) > 1]
    verdict = ("Besides size, the dense rungs differ in: " + ", ".join(varied) + ". A trend across them cannot tell "
               "size from these." if varied else "The dense rungs differ in size alone.")
    return lines + ["", verdict]


def ladder_lines(rungs: list[Rung], trends: list[Trend], refused: Optional[str]) -> list[str]:
    lines = ["# Muon against AdamW across model sizes: the fair ladder", "",
             "Each rung is a study of scripts/fair_compare.py (its report: <rung>/report/comparison.md). The speedup "
             "is the tokens AdamW needs to reach Muon's final loss over Muon's, both sides tuned with the same trials "
             "and tokens; the interval is a 95% bootstrap over the seeds that also redoes the selection (the seed "
             "noise given the chosen settings). A rung whose search did not converge on a side is unresolved.", "",
             *headline_lines(rungs, trends, refused), "", "## What else differs between the rungs", "",
             *confound_lines(rungs), "", "## The rungs", "",
             "| rung | model | routed experts | non-embedding params | active | tokens at 1x | longest budget | "
             "epochs at the longest |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rungs:
        s = r.scale
        epochs = f"{s.epochs_max:.2f}" if s.epochs_max else "-"
        lines.append(f"| {r.name} | {r.model} | {r.experts} | {r.params:,} | {r.active:,} | {s.tokens_1x:,} | "
                     f"{s.steps[-1] * s.tokens_per_step:,} | {epochs} |")
    lines += ["", "The trend: least squares of log(speedup) on log10(non-embedding parameters) over the resolved dense "
              "rungs at one tokens a step; its interval resamples each rung's bootstrap replicates independently; "
              "p(> x1) is the one-sided p-value that the speedup does not grow with size, p(< x1) that it does not "
              "shrink."]
    return lines + [""]


def replace_block(text: str, block: list[str], where: str) -> str:
    """`text` with the lines between LADDER_BEGIN and LADDER_END replaced by `block`."""
    if LADDER_BEGIN not in text or LADDER_END not in text:
        raise StudyError(f"{where}: no ladder block (a line '{LADDER_BEGIN}', then '{LADDER_END}')")
    head, rest = text.split(LADDER_BEGIN, 1)
    _, tail = rest.split(LADDER_END, 1)
    return head + LADDER_BEGIN + "\n" + "\n".join(block) + "\n" + LADDER_END + tail


def read_ladder(root: Path) -> tuple[list[Rung], list[Trend], Optional[str]]:
    """Every study below `root`, each report written again, and the trends across them (or why
    there are none)."""
    rungs = []
    stats = None
    for path in study_dirs(root):
        data = load_study(path)
        analysis = analyse(data)
        write_report(data, path / REPORT, analysis)
        rungs.append(rung_of(path, analysis))
        stats = stats or data.plan["stats"]
    rungs.sort(key=lambda r: (bool(r.experts), r.params))
    fitted, refused = fit_rungs(rungs)
    splits = sorted({k for r in rungs for k in r.results}, key=lambda k: (k != VAL_KEY, k))
    trends = [t for k in splits if (t := trend(fitted, k, stats["bootstrap"], stats["seed"])) is not None]
    return rungs, trends, refused


def write_ladder(root: Path, pages: list[Path]) -> list[str]:
    """The reports, ladder.md and speedup_vs_size.png under `root`, and each page's block; the
    headline lines, for the terminal."""
    if not study_dirs(root):
        raise StudyError(f"{root}: no study below it (a dir with {RECORDS}/{PLAN_FILE})")
    texts = {page: page.read_text() for page in pages}  # every page checked before anything is written
    for page, text in texts.items():
        replace_block(text, [], str(page))
    rungs, trends, refused = read_ladder(root)
    (root / "ladder.md").write_text("\n".join(ladder_lines(rungs, trends, refused)))
    speedup_vs_size(rungs, trends, root / "speedup_vs_size.png")
    headline = headline_lines(rungs, trends, refused)
    for page, text in texts.items():
        page.write_text(replace_block(text, headline, str(page)))
    return headline
