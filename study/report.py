"""The report of a fair study (scripts/fair_compare.py), written from its records alone through
study/analysis.py: the same records give the same report, byte for byte, on any machine (the
bootstrap is seeded, numbers are rounded as printed, no path or clock is written).

    comparison.md     the speedup on val and each OOD set (its 95% interval over the seed noise
                      given the chosen settings, one-sided p-values, or "unresolved"), how well
                      each side was searched, the study's scale, which optimizer stepped which
                      parameters, the speedup read other ways, whether more tuning would move
                      it, the budgets spent and every final loss
    comparison.json   the same numbers
    trials.md         every tuning and retuning run: what it tried and how it ended
    chosen.md         each side's chosen settings, at 1x and its lr at each longer budget
    loss_vs_tokens.png, speedup_vs_trials.png   (study/plots.py)
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import numpy as np

from study.analysis import INTERVAL_WORDS, Analysis, analyse, chosen_values, model_text
from study.plots import loss_vs_tokens, speedup_vs_trials
from study.records import OK, STAGES, StudyData, final_loss
from study.screen import screen_result
from study.search_state import INIT, SearchState
from study.speedup import Comparison, mean


def ratio_text(c: Comparison, resolved: bool = True) -> tuple[str, str, str]:
    """(the speedup, its interval, its p-values): for an unresolved study the speedup carries
    that word and no p-value is given."""
    ci = "-" if c.lo is None else f"{c.lo.format()} to {c.hi.format()}"
    if not resolved:
        return f"{c.ratio.format()}, unresolved", ci, "unresolved"
    ps = ", ".join(f"p(> {s0:g}x) = {p:.4f}" for s0, p in sorted(c.p.items()))
    return c.ratio.format(), ci, ps or "-"


def inherited_text(state: SearchState) -> str:
    """The values no trial here varied, by where each was last swept: "from gpt_d256: wd=0.1;
    never swept (its init): eps=1e-08"."""
    by: dict[str, list[str]] = {}
    for d in state.inherited:
        screened = "" if d.screen_gain is None else f" (screen {d.screen_gain:+.4f})"
        by.setdefault(d.origin, []).append(d.text() + screened)
    return "; ".join(f"{'never swept, ' + origin if origin == INIT else 'from ' + origin}: {', '.join(values)}"
                     for origin, values in by.items()) or "-"


def search_lines(states: dict[str, SearchState]) -> list[str]:
    lines = ["| side | search | last round's gain | held or never swept here, and where each was last swept |",
             "|---|---|---:|---|"]
    for side, s in states.items():
        gain = "-" if s.last_gain is None else f"{s.last_gain:.4f}"
        lines.append(f"| {side} | {s.summary()} | {gain} | {inherited_text(s)} |")
    return lines


def scale_lines(a: Analysis) -> list[str]:
    s = a.scale
    epochs = "-" if s.epochs_max is None else f"{s.epochs_max:.3f}"
    share = "-" if s.muon_share is None else f"{s.muon_share:.0%}"
    lines = ["| non-embedding params | tokens a step | steps (per budget) | tokens at 1x | tokens a non-embedding "
             "param at 1x | epochs at the longest budget | share of parameters Muon steps |",
             "|---:|---:|---|---:|---:|---:|---:|",
             f"| {s.params / 1e6:.2f}M" + (f" ({s.active / 1e6:.2f}M active)" if s.active != s.params else "")
             + f" | {s.tokens_per_step:,} | {', '.join(map(str, s.steps))} | {s.tokens_1x:,} | {s.tokens_per_param:.3g} "
             f"| {epochs} | {share} |"]
    warning = s.opening_warning()
    return lines + (["", f"**The opening of training:** {warning}."] if warning else [])


def census_lines(a: Analysis) -> list[str]:
    lines = ["| side | optimizer | parameter families it steps (tensors, parameters) | read from |", "|---|---|---|---|"]
    for side, (census, source) in a.census.items():
        for optimizer, kinds in census.items():
            families = ", ".join(f"{kind} ({c['tensors']}, {c['params']:,})" for kind, c in kinds.items())
            lines.append(f"| {side} | {optimizer} | {families} | {source} |")
    return lines


def sensitivity_lines(a: Analysis) -> list[str]:
    budgets = a.plan["compare"]["budgets"]
    lines = ["| split | speedup | power law L(D) = a D^-b + c (95% interval) | anchored at " +
             ", ".join(f"{b:g}x" for b in budgets) + " |", "|---|---:|---|---|"]
    for k in a.splits:
        lines.append(f"| {k} | {a.results[k].ratio.format()} | {a.power[k].format()} | "
                     + ", ".join(r.format() for r in a.anchored[k]) + " |")
    if a.tune is not None:
        lines += ["", f"On the tuning split (what chose the settings, from the same final runs): "
                  f"{a.tune.ratio.format()} ({'-' if a.tune.lo is None else a.tune.lo.format()} to "
                  f"{'-' if a.tune.hi is None else a.tune.hi.format()})."]
    hints = [hint for k in a.splits if (hint := a.extend_hint(k))]
    return lines + ([""] + [f"- {hint}." for hint in hints] if hints else [])


def replay_lines(a: Analysis) -> list[str]:
    trials = len(a.replayed[a.splits[0]]) if a.splits else 0
    if not trials:
        return ["No tuning trials to replay (a rerun copies them; their study's report has the table)."]
    shown = sorted({k for k in (1, 2, 4, 8, 16, 32, 64, 128, trials // 2, trials) if 1 <= k <= trials})
    lines = ["| k (first trials a side) | " + " | ".join(a.splits) + " |", "|---:|" + "---:|" * len(a.splits)]
    lines += [f"| {k} | " + " | ".join(a.replayed[s][k - 1].format() for s in a.splits) + " |" for k in shown]
    moving = [f"- {s}: {why}." for s in a.splits if (why := a.moving(s))]
    verdict = (["", "**The answer is still moving** with the tuning budget:", *moving] if moving else
               ["", f"The last doubling of the trials (k = {trials // 2} to {trials}) moved no split by more than half "
                "its interval's width."])
    return lines + verdict


def budget_lines(data: StudyData) -> list[str]:
    """Runs and tokens per side and stage: equal by construction, shown."""
    plan = data.plan
    lines = ["| stage | " + " | ".join(f"{s} runs | {s} tokens planned | {s} tokens seen" for s in
                                      (plan["target"], plan["baseline"])) + " |",
             "|---|" + "---:|" * 6]
    for stage in STAGES:
        cells = []
        for side in (plan["target"], plan["baseline"]):
            runs = data.of(stage, side)
            cells += [str(len(runs)), f"{sum(e.tokens_planned for e in runs):,}", f"{sum(e.tokens_seen for e in runs):,}"]
        if stage != "screen" or any(cell != "0" for cell in cells):
            lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    return lines


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


def write_report(data: StudyData, out: Path, analysis: Optional[Analysis] = None) -> list[str]:
    """Write the report into `out` (`analysis`: analyse(data), when the caller has it); return
    comparison.md's headline lines, for the terminal."""
    a = analyse(data) if analysis is None else analysis
    plan, splits, results = data.plan, a.splits, a.results
    out.mkdir(parents=True, exist_ok=True)
    t, c = plan["tuning"], plan["compare"]
    unresolved = a.unresolved_line()
    head = [f"# {plan['target']} against {plan['baseline']}: a fair comparison", "",
            f"Model {model_text(plan['model'])}, {plan['tokens_per_step']:,} tokens a step on both sides. Each side "
            f"tuned by coordinate descent over its space ({t['trials']} trials at {c['steps'][0]} steps, scored on "
            f"{t['objective']}, the tuning split data.tune_fraction={t['split_fraction']}, seeds {t['seeds']}), its lr "
            f"searched again at each longer budget ({c['retune']['trials']} trials), then rerun at every budget on "
            f"fresh seeds {c['seeds']}. Speedup: the tokens {plan['baseline']} needs to reach {plan['target']}'s final "
            f"loss over {plan['target']}'s, from a monotone fit in log tokens through end-of-schedule points; a "
            "crossing beyond the budgets run is a bound, never extrapolated.",
            *(["", *(f"- {note}." for note in plan.get("notes", [])[1:])] if plan.get("notes", [])[1:] else []),
            *(["", f"**{unresolved}**"] if unresolved else []),
            "", "## Speedup", "",
            f"| split | speedup | 95% interval ({INTERVAL_WORDS}) | one-sided p |", "|---|---:|---|---|"]
    head += [f"| {k} | " + " | ".join(ratio_text(results[k], a.resolved)) + " |" for k in splits]
    head += ["", f"The interval and p-values cover the {INTERVAL_WORDS}: {plan['stats']['bootstrap']} bootstrap "
             "replicates over the seeds, paired between the sides, each redoing the choice among the trials run (a "
             "config's tuning loss perturbed by the measured seed noise); the re-selection assumes a loss gap on the "
             "tuning split carries over to val and OOD. They do not cover a search that stopped short: see Search.",
             ""]
    screened = screen_result(plan, data.entries)
    screen = (["", "The screen (every setting one grid step either side of the start, before the descent): "
               + "; ".join(screened.lines()) + "."] if screened else [])
    body = ["## Search", "", *search_lines(a.states), *screen, "",
            "## Scale", "", *scale_lines(a), "",
            "## Which optimizer steps which parameters", "", *census_lines(a), "",
            "## The speedup read other ways", "", *sensitivity_lines(a), "",
            "## Would more tuning move the answer?", "", *replay_lines(a), "",
            "## Budgets spent (equal by construction)", "", *budget_lines(data), "",
            "## Final losses (mean ± standard error over the seeds)", "", *finals_lines(data, splits), ""]
    (out / "comparison.md").write_text("\n".join(head + body))
    (out / "comparison.json").write_text(json.dumps(report_json(a), indent=1, sort_keys=True, allow_nan=False) + "\n")
    (out / "trials.md").write_text("\n".join(trials_lines(data)) + "\n")
    (out / "chosen.md").write_text("\n".join(chosen_lines(data)) + "\n")
    loss_vs_tokens(a, out / "loss_vs_tokens.png")
    speedup_vs_trials(a, out / "speedup_vs_trials.png")
    return [line for line in head if line.startswith("| ")]


def report_json(a: Analysis) -> dict[str, Any]:
    s = a.scale
    return {"splits": {k: a.results[k].to_dict() for k in a.splits}, "budget": budget_summary(a.data),
            "resolved": a.resolved, "search": {side: state.to_dict() for side, state in a.states.items()},
            "scale": {"params": s.params, "active": s.active, "tokens_per_step": s.tokens_per_step, "steps": s.steps,
                      "tokens_per_param": s.tokens_per_param, "epochs_max": s.epochs_max, "muon_share": s.muon_share,
                      "trials": s.trials, "dims_tuned": s.dims_tuned, "seeds": s.seeds},
            "sensitivity": {k: {"power_law": {"value": a.power[k].value, "extrapolated": a.power[k].extrapolated,
                                              "lo": a.power[k].lo, "hi": a.power[k].hi},
                                "anchored": [r.to_dict() for r in a.anchored[k]],
                                "first_k": [r.to_dict() for r in a.replayed[k]]} for k in a.splits},
            "optimizers": {side: census for side, (census, _) in a.census.items()}}


def budget_summary(data: StudyData) -> dict[str, Any]:
    plan = data.plan
    return {side: {stage: {"runs": len(data.of(stage, side)),
                           "tokens_planned": sum(e.tokens_planned for e in data.of(stage, side)),
                           "tokens_seen": sum(e.tokens_seen for e in data.of(stage, side))}
                   for stage in STAGES} for side in (plan["target"], plan["baseline"])}


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
