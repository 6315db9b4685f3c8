"""Compare training runs (e.g. Muon vs AdamW): loss curves, leading steps, summary tables.

    python scripts/compare_runs.py outputs/muon_gpt_tiny/RUN outputs/adamw_gpt_tiny/RUN
    python scripts/compare_runs.py outputs/multirun/2030-01-01_12-00-00     # a whole sweep
    python scripts/compare_runs.py SWEEP --longer outputs/multirun/<AdamW at 1.25x, 1.5x, 2x>
    python scripts/compare_runs.py MUON_SEEDS ADAMW_SEEDS --longer LONGER_SEEDS   # seeds per arm

Each argument is a run dir (metrics.jsonl, or TensorBoard events in tb/) or a sweep dir of
runs; from sweeps the best lr per optimizer (lowest final val loss) is kept, and a table of
every run's final losses is printed. A best lr at either end of the lrs swept is warned about
(stderr and summary.md), naming the side to extend the grid to: the grid must contain it. The
first selected run is A (Muon when present), the second B. --longer takes runs of B's
optimizer with longer schedules and reports the schedule-length ratio at which B's final loss
reaches A's. Writes PNGs and summary.md (the printed tables) into --out, among them each arm's output RMS by layer at the end of its runs
(output_rms_by_layer.png and its table), for every run that logged model/output_rms/, and a
table of each arm's weight RMS per parameter kind and largest attention logit at the end of its
runs, for every run that logged model/weight_rms/ or attn/max_logit/.

Seeds: runs whose configs differ only in `seed` (and in where they log, checkpoint or profile,
or their parallel layout) and that ran equally long form one arm. Its curves are the mean over
the seeds with a band of +- one standard error; its final losses, the best lr (by mean) and
both ratios are reported as mean +- standard error with a 95% interval (Student's t). The
in-run ratio is taken within each pair of runs with the same seed; the schedule ratio's error
comes from the delta method (eval/seeds.py).

Losses are only comparable on the same tokens and in the same arithmetic: runs whose corpus
ids (environment.json) differ are refused unless --allow-mixed-corpora is given, and arms whose
precisions (trainer.precision as it ran, from resolved_config.yaml) differ unless
--allow-mixed-precision is given; either refusal is one line, exit code 2. summary.md names
the corpus, the precision and the environment of every compared run.

The in-run table states each loss's logging interval: its steps are crossings interpolated
between logged points, so a ratio whose two crossings lie within one interval of each other
is marked as not distinguishable from 1. Curves with few logged points are drawn with markers.
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Optional

from eval.compare import Run, best_per_optimizer, find_runs, grid_edge_warnings, load_run, mixed_corpora
from eval.run_precision import arm_precision, mixed_precisions, run_precision
from eval.seeds import Arm, group_arms, in_run_ratio_over_seeds, paired_difference, schedule_ratio_over_seeds
from scripts.compare_format import BEST_KEY, fmt, fmt_estimate
from scripts.compare_plots import plot_family, plot_leading_steps, plot_losses, smoothing
from scripts.compare_profiles import (
    MAX_LOGIT, OUTPUT_RMS, depth_profiles, output_rms_section, plot_output_rms_by_layer, weights_profiles,
    weights_section,
)
from scripts.refuse import refuse

# What compared runs must share, each with the flag that lets them differ anyway.
MIX_FLAGS = {"corpus": "--allow-mixed-corpora", "precision": "--allow-mixed-precision"}


def loss_keys(runs: list[Run]) -> list[str]:
    keys = {k for r in runs for k in r.series if k.endswith("/loss")}
    return sorted(keys, key=lambda k: (k != "train/loss", k != BEST_KEY, k))


def eval_keys(runs: list[Run]) -> list[str]:
    """Held-out losses: val first, then each OOD set; not the tuning split (val/tune/loss, of
    runs with data.tune_fraction), which is for choosing settings, never a reported figure."""
    return [k for k in loss_keys(runs) if k not in ("train/loss", "val/tune/loss")]


def sweep_table(arms: list[Arm], best: list[Arm], keys: list[str], with_steps: bool = False) -> list[str]:
    """Every arm's final losses; with several seeds, a seeds column and mean +- standard error;
    `with_steps` adds each arm's length (for the longer schedules, tuned per length)."""
    seeded = any(len(arm.runs) > 1 for arm in arms)
    head = (["optimizer"] + (["steps"] if with_steps else []) + ["lr"] + (["seeds"] if seeded else [])
            + [f"final {k}" for k in keys])
    lines = ["| " + " | ".join(head) + " |", "| --- | " + " | ".join("---:" for _ in head[1:]) + " |"]
    for arm in sorted(arms, key=lambda r: (r.optimizer, (r.final_step(BEST_KEY) or 0) if with_steps else 0,
                                           r.lr if r.lr is not None else 0.0)):
        mark = " (best)" if any(arm is r for r in best) else ""
        cells = [f"{arm.optimizer}{mark}"] + ([fmt(arm.final_step(BEST_KEY), "d")] if with_steps else [])
        cells.append("-" if arm.lr is None else f"{arm.lr:g}")
        if seeded:
            cells.append(",".join(str(s) for s in arm.seeds))
        cells += [fmt_estimate(arm.final_estimate(k)) for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def best_per_length(arms: list[Arm]) -> list[Arm]:
    """B at each schedule length: its best lr there (lowest mean final val loss). A longer
    schedule usually wants a lower lr, so reusing the lr tuned at 1x would flatter A."""
    by_length: dict[int, list[Arm]] = {}
    for arm in arms:
        by_length.setdefault(arm.final_step(BEST_KEY) or 0, []).append(arm)
    return [best for length in sorted(by_length) for best in best_per_optimizer(by_length[length], BEST_KEY)]


def fmt_interval(value: float, se: float | None, half_width: float | None, spec: str = ".3f",
                 ci_spec: str = ".2f") -> str:
    """`1.557`, or `1.557 ± 0.048 (95% CI 1.40 to 1.71)` when the seeds give an error (the
    standard error in `spec` without its sign)."""
    if se is None:
        return format(value, spec)
    text = f"{format(value, spec)} ± {format(se, spec.lstrip('+'))}"
    if half_width is not None:
        text += f" (95% CI {format(value - half_width, ci_spec)} to {format(value + half_width, ci_spec)})"
    return text


def logging_interval(run: Run, key: str) -> Optional[int]:
    """Steps between a run's logged points of `key`: the commonest gap in its metrics (the
    last step is logged off the grid, so not the last gap), the larger one on a tie. A series
    of one point has no gap; then its config's interval (eval.interval for the val/ losses,
    logger.interval for the rest), None when that is absent too (or 0: only at the end)."""
    steps = run.series[key][0] if key in run.series else []
    gaps = Counter(later - earlier for earlier, later in zip(steps, steps[1:]))
    if gaps:
        return max(gaps, key=lambda gap: (gaps[gap], gap))
    section = "eval" if key.startswith("val/") else "logger"
    interval = (run.config.get(section) or {}).get("interval")
    return int(interval) if interval else None


def resolution(arms: list[Arm], key: str) -> Optional[int]:
    """The coarsest logging interval of `key` among the arms' runs: the precision to which a
    crossing step of theirs is known (it is interpolated between logged points)."""
    intervals = [logging_interval(run, key) for arm in arms for run in arm.runs]
    return max((i for i in intervals if i is not None), default=None)


def within_resolution(steps_b: float, steps_a: float, interval: Optional[int]) -> bool:
    """Whether B's and A's crossings lie within one logging interval of each other: then the
    data cannot tell their ratio from 1."""
    return interval is not None and abs(steps_b - steps_a) <= interval


RESOLUTION_NOTE = ("Resolution: B and A steps are crossings interpolated between logged points, so each is "
                   "known to about one logging interval (\"logged every\", the coarser of A's and B's). A ratio "
                   "marked \"within resolution\" has its two crossings within one interval of each other: at this "
                   "resolution it cannot be told from 1.")


def in_run_table(a: Arm, b: Arm, keys: list[str], alpha: float) -> list[str]:
    """Per loss, the in-run ratio of each seed pair of A and B, as mean +- standard error, with
    the logging interval that bounds how finely the steps (and so the ratio) are known."""
    lines = ["| loss | A final | B final | logged every | B steps | A steps | ratio B/A | at the final loss of |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for key in keys:
        r = in_run_ratio_over_seeds(a, b, key, smoothing(alpha))
        if r is None and (a.final(key) is None or b.final(key) is None):
            continue
        interval = resolution([a, b], key)
        cells = [fmt(interval, "d")]
        if r is None:
            cells += ["-", "-", "-", "-"]
        else:
            ratio = fmt_interval(r.ratio.mean, r.ratio.se, r.ratio.half_width_95)
            if within_resolution(r.steps_b, r.steps_a, interval):
                ratio += ", within resolution"
            cells += [f"{r.steps_b:.4g}", f"{r.steps_a:.4g}", ratio, r.reference]
        lines.append(f"| {key} | {fmt_estimate(a.final_estimate(key))} | {fmt_estimate(b.final_estimate(key))} | "
                     + " | ".join(cells) + " |")
    return lines + ["", RESOLUTION_NOTE]


def schedule_lengths(a: Arm, arms_b: list[Arm]) -> list[float]:
    """Each of B's schedules (`arms_b`, ascending) as a multiple of A's."""
    steps_a = a.final_step(BEST_KEY)
    return [(arm.final_step(BEST_KEY) or 0) / steps_a for arm in arms_b]


def ratio_cell(target, lengths: list[float], finals) -> str:
    """The schedule ratio B/A at which B's final loss reaches `target`, with its interval."""
    s = schedule_ratio_over_seeds(target, lengths, finals)
    if s.ratio is None:
        return f"> {s.lengths[-1]:g} (not reached)"
    if s.ratio == s.lengths[0] and s.finals[0].mean <= s.target.mean:
        return f"<= {s.lengths[0]:g}"
    return fmt_interval(s.ratio, s.se, s.half_width_95)


def honest_table(a: Arm, arms_b: list[Arm], keys: list[str]) -> list[str]:
    """B's final at each length (`arms_b`, one per length, ascending) against A's final."""
    lengths = schedule_lengths(a, arms_b)
    lines = ["| loss | A final | " + " | ".join(f"B at {x:g}x" for x in lengths) + " | schedule ratio B/A |",
             "| --- | ---: | " + " | ".join("---:" for _ in lengths) + " | ---: |"]
    for key in keys:
        target, finals = a.final_estimate(key), [arm.final_estimate(key) for arm in arms_b]
        if target is None or any(f is None for f in finals):
            continue
        ratio = ratio_cell(target, lengths, finals)
        lines.append(f"| {key} | {target.format()} | " + " | ".join(f.format() for f in finals) + f" | {ratio} |")
    lrs = ", ".join(f"{x:g}x {'-' if arm.lr is None else format(arm.lr, 'g')}" for x, arm in zip(lengths, arms_b))
    return lines + ["", f"B's lr at each length: {lrs}"]


def family(arm: Arm) -> str:
    """The base optimizer of a setting: "muon" for "muon+normuon"."""
    return arm.optimizer.split("+")[0]


def pick_pair(selected: list[Arm]) -> tuple[Arm, Arm, list[Arm]]:
    """A (plain Muon, else a Muon variant), B (plain AdamW, else an AdamW variant) and the other
    settings. Without both families, the first two of: the Muon settings (plain first), the
    AdamW settings (plain first), any others."""
    def order(arm: Arm) -> tuple[int, int, str]:
        return ({"muon": 0, "adamw": 1}.get(family(arm), 2), 0 if arm.optimizer == family(arm) else 1, arm.optimizer)

    ordered = sorted(selected, key=order)
    muons = [r for r in ordered if family(r) == "muon"]
    adamws = [r for r in ordered if family(r) == "adamw"]
    a, b = (muons[0], adamws[0]) if muons and adamws else ordered[:2]
    rest = sorted((r for r in selected if r is not a and r is not b), key=lambda r: r.optimizer)
    return a, b, rest


def plain_base(arm: Arm, arms: list[Arm]) -> Arm | None:
    """The plain setting of `arm`'s family among `arms` ("muon" for "muon+normuon"); None for a
    plain setting itself, or when its family's plain setting did not run."""
    if arm.optimizer == family(arm):
        return None
    return next((x for x in arms if x.optimizer == family(arm)), None)


def fmt_difference(est) -> str:
    """`-0.0727 ± 0.0100 (95% CI -0.116 to -0.030)`: a paired difference with its interval."""
    return "-" if est is None else fmt_interval(est.mean, est.se, est.half_width_95, "+.4f", "+.3f")


# What a step of each setting costs, in seconds: the whole step and the optimizer's part. Only
# comparable between runs on one machine, one job at a time or equally loaded.
STEP_COSTS = ("perf/step_s", "perf/optim_step_s")


def settings_table(a: Arm, b: Arm, rest: list[Arm], arms_b: list[Arm], keys: list[str]) -> list[str]:
    """Every optimizer setting at its best lr: final losses (mean +- se over seeds); for each
    variant, its difference from the plain setting of its family, paired by seed; with B's
    longer schedules, the schedule ratio B needs to reach each setting's final loss; and, where
    the runs logged them, the median step and optimizer-step times."""
    keys = [k for k in keys if k != "train/loss"] or keys
    arms = [a, b, *rest]
    paired = any(plain_base(arm, arms) is not None for arm in arms)
    head = ["setting", "lr", "seeds"] + [f"final {k}" for k in keys]
    if paired:
        head += [f"vs plain, paired by seed, {k}" for k in keys]
    lengths = schedule_lengths(a, arms_b) if arms_b else []
    if lengths:
        head += [f"schedule ratio, {k}" for k in keys]
    costs = [k for k in STEP_COSTS if any(k in run.series for arm in arms for run in arm.runs)]
    head += [f"median {k}" for k in costs]
    lines = ["| " + " | ".join(head) + " |", "| --- | " + " | ".join("---:" for _ in head[1:]) + " |"]
    for arm in arms:
        cells = [arm.optimizer + (" (A)" if arm is a else " (B)" if arm is b else ""),
                 "-" if arm.lr is None else f"{arm.lr:g}", ",".join(str(x) for x in arm.seeds)]
        cells += [fmt_estimate(arm.final_estimate(k)) for k in keys]
        if paired:
            base = plain_base(arm, arms)
            cells += ["-" if base is None else fmt_difference(paired_difference(arm, base, k)) for k in keys]
        if lengths:
            for key in keys:
                target, finals = arm.final_estimate(key), [x.final_estimate(key) for x in arms_b]
                cells.append("-" if arm is b or target is None or None in finals
                             else ratio_cell(target, lengths, finals))
        cells += [fmt_estimate(arm.median_estimate(k), ".3f") for k in costs]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def refuse_mixed(mixed: dict[str, Optional[str]], args: argparse.Namespace) -> None:
    """Exit 2 with one line on the first thing (a key of MIX_FLAGS) that the compared runs do not
    share, unless its --allow-mixed-* flag was given: checked before anything is written."""
    for what, line in mixed.items():
        flag = MIX_FLAGS[what]
        if line and not getattr(args, flag.lstrip("-").replace("-", "_")):
            refuse(f"{line}; pass {flag} to compare them anyway")


def mixtures(runs: list[Run], arms: list[Arm]) -> dict[str, Optional[str]]:
    """For each key of MIX_FLAGS, the line naming how the compared runs differ in it (None when
    they do not)."""
    return {"corpus": mixed_corpora(runs), "precision": mixed_precisions(arms)}


def shared_lines(arms: list[Arm], mixed: dict[str, Optional[str]]) -> list[str]:
    """The corpus and the precision every run shares, or a bold line for each that is mixed
    (with its --allow-mixed-* flag): whatever differs is part of every loss difference below."""
    corpus = (f"**Mixed corpora (--allow-mixed-corpora): {mixed['corpus']}.** Loss differences below mix "
              "the optimizers' effect with the data's." if mixed["corpus"] else f"Corpus: {arms[0].corpus} (every run)")
    precision = (f"**Mixed precisions (--allow-mixed-precision): {mixed['precision']}.** Loss differences below "
                 "mix the optimizers' effect with the arithmetic's." if mixed["precision"]
                 else f"Precision: {arm_precision(arms[0])} (every run)")
    return [corpus, "", precision, ""]


def describe(run: Run) -> str:
    """Run.describe() with the run's precision after its label: "muon lr=0.01: precision fp32;
    corpus ...; <environment> (<path>)"."""
    rest = run.describe().removeprefix(f"{run.label}: ")
    return f"{run.label}: precision {run_precision(run)}; {rest}"


def runs_section(a: Arm, b: Arm, longer: list[Arm], mixed: dict[str, Optional[str]]) -> list[str]:
    """The corpus, precision and environment of every compared run: what the figures below are on."""
    lines = ["## Runs", ""] + shared_lines([a, b, *longer], mixed)
    for side, arm in (("A", a), ("B", b)):
        for run in arm.runs:
            seed = f" seed {run.seed}" if len(arm.runs) > 1 else ""
            lines.append(f"- {side}{seed} = {describe(run)}")
    lines += [f"- B, longer: {describe(run)}" for arm in longer for run in arm.runs]
    return lines + [""]


def warned(lines: list[str]) -> list[str]:
    """Each line as a warning on stderr, and as summary.md's lines for it."""
    for line in lines:
        print(f"warning: {line}", file=sys.stderr)
    return [f"**Warning: {line}.**" for line in lines] + ([""] if lines else [])


def write_sweep_only(arms: list[Arm], best: list[Arm], runs: list[Run], unfinished: list[str], out: Path,
                     args: argparse.Namespace) -> None:
    """summary.md for runs of a single optimizer: the corpus and precision, every run's final
    losses with the best lr marked (per schedule length when the lengths differ), and what was
    left out."""
    mixed = mixtures(runs, arms)
    refuse_mixed(mixed, args)
    lengths = {arm.final_step(BEST_KEY) for arm in arms}
    if len(lengths) > 1:  # tuned per length: each length's grid is its own
        best = best_per_length(arms)
        edges = grid_edge_warnings(arms, best, lambda arm: arm.final_step(BEST_KEY))
    else:
        edges = grid_edge_warnings(arms, best)
    report = ["## Runs", ""] + shared_lines(arms, mixed)
    report += [f"- {describe(run)}" for run in runs] + [""]
    if unfinished:
        report += ["Not compared, unfinished (fewer steps logged than trainer.max_steps):", ""]
        report += [f"- {reason}" for reason in unfinished] + [""]
    report += [f"## Sweep of {best[0].optimizer}: final losses of every run (one optimizer, nothing to compare)", ""]
    report += warned(edges) + sweep_table(arms, best, eval_keys(runs), with_steps=len(lengths) > 1) + [""]
    out.mkdir(parents=True, exist_ok=True)
    # every lr of the sweep: how the lr moves the activations is what such a sweep can show
    profiles = depth_profiles(arms)
    report += output_rms_section(arms, profiles) + weights_section(arms, weights_profiles(arms))
    plotted = plot_output_rms_by_layer(profiles, out)
    if plotted is not None:
        print(f"wrote {plotted}")
    (out / "summary.md").write_text("\n".join(report))
    print("\n".join(report))
    print(f"wrote {out / 'summary.md'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--alpha", type=float, default=0.05, help="EWM smoothing of train/loss (default 0.05)")
    parser.add_argument("--out", type=Path, default=Path("comparison"))
    parser.add_argument("--longer", nargs="+", type=Path, default=[],
                        help="runs (or sweep dirs) of B's optimizer with longer schedules, for the schedule ratio")
    parser.add_argument(MIX_FLAGS["corpus"], action="store_true",
                        help="compare runs whose corpus ids differ (their losses are on other tokens)")
    parser.add_argument(MIX_FLAGS["precision"], action="store_true",
                        help="compare arms that ran in different precisions (bf16 vs fp32, or unknown)")
    args = parser.parse_args()

    try:
        loaded = [load_run(p) for arg in args.runs for p in find_runs(arg)]
    except FileNotFoundError as err:  # a path with no runs under it
        refuse(str(err))
    try:
        longer_runs = [load_run(p) for arg in args.longer for p in find_runs(arg)]
    except FileNotFoundError as err:
        refuse(f"--longer {err}")
    # A run still going (or stopped early) would enter the tables as a shorter schedule.
    unfinished = [run.unfinished() for run in loaded + longer_runs if run.unfinished()]
    for reason in unfinished:
        print(f"warning: not compared, unfinished: {reason}", file=sys.stderr)
    loaded = [run for run in loaded if not run.unfinished()]
    longer_runs = [run for run in longer_runs if not run.unfinished()]
    try:
        arms, longer = group_arms(loaded), group_arms(longer_runs)
    except ValueError as err:
        refuse(str(err))
    swept = len(loaded) > len(args.runs)
    selected = best_per_optimizer(arms, BEST_KEY) if swept else arms
    if len(selected) < 2 and swept and not longer:
        # An lr sweep of one optimizer (tuning it alone, or at one longer schedule): its table
        # is the result, and there is no second optimizer to compare it with.
        write_sweep_only(arms, selected, loaded, unfinished, args.out, args)
        return
    if len(selected) < 2:
        refuse(f"need two runs to compare, found {[r.label for r in selected]}")
    a, b, rest = pick_pair(selected)
    selected = [a, b, *rest]
    for arm in longer:
        if arm.optimizer != b.optimizer:
            refuse(f"--longer run {arm.path} is {arm.optimizer}, not B's optimizer {b.optimizer}")
    if longer and a.final_step(BEST_KEY) is None:
        refuse(f"run {a.path} logged no {BEST_KEY}, which the schedule ratio needs")
    mixed = mixtures(loaded + longer_runs, arms + longer)
    refuse_mixed(mixed, args)

    args.out.mkdir(parents=True, exist_ok=True)
    runs = [run for arm in selected for run in arm.runs]
    keys = loss_keys(runs)
    profiles = depth_profiles(selected)
    written = [plot_losses(selected, keys, args.alpha, args.out),
               plot_leading_steps(a, b, keys, args.alpha, args.out),
               plot_family(selected, "optim/update_rms/", "update RMS / lr, per parameter kind", args.out,
                           "update_rms.png"),
               plot_family(selected, OUTPUT_RMS, "output RMS of each block (residual stream)", args.out,
                           "output_rms.png"),
               plot_output_rms_by_layer(profiles, args.out),
               plot_family(selected, MAX_LOGIT, "max attention logit per layer", args.out,
                           "max_attn_logit.png"),
               # QK-clip runs only (optim.qk_clip.enabled; tau=inf records without clipping):
               # the training batches' largest logit before and after the clip, heads clipped
               plot_family(selected, "optim/qk_clip/", "QK-clip, every logged step", args.out, "qk_clip.png"),
               # MoE runs only: how evenly each layer's router spreads tokens, and how far the
               # aux-loss-free bias had to move to get there
               plot_family(selected, "moe/load_imbalance/", "MoE load imbalance (max / mean tokens per expert)",
                           args.out, "moe_load_imbalance.png"),
               plot_family(selected, "moe/bias_spread/", "MoE expert bias spread (max - min)", args.out,
                           "moe_expert_bias.png")]
    for path in written:
        if path is not None:
            print(f"wrote {path}")

    report = runs_section(a, b, longer, mixed)
    if unfinished:
        report += ["Not compared, unfinished (fewer steps logged than trainer.max_steps):", ""]
        report += [f"- {reason}" for reason in unfinished] + [""]
    arms_b = best_per_length([b] + longer) if longer else []
    report += warned((grid_edge_warnings(arms, selected) if swept else [])
                     + grid_edge_warnings([b] + longer, arms_b, lambda arm: arm.final_step(BEST_KEY)))
    if swept:
        report += ["## Sweep: final losses of every run", ""]
        report += sweep_table(arms, selected, eval_keys(loaded)) + [""]
    report += [f"## In-run leading steps: A = {a.label}, B = {b.label}", "",
               f"A: {', '.join(str(r.path) for r in a.runs)}", f"B: {', '.join(str(r.path) for r in b.runs)}", ""]
    report += in_run_table(a, b, keys, args.alpha) + [""]
    if rest:
        report += ["## Every optimizer setting, at its best lr", ""]
        report += settings_table(a, b, rest, arms_b, eval_keys(loaded)) + [""]
    if longer:
        if len(arms_b) < len(longer) + 1:  # several lrs at some length: show the tuning
            report += [f"## Longer schedules: every lr of {b.optimizer}, the best per length marked", ""]
            report += sweep_table([b] + longer, arms_b, eval_keys(runs), with_steps=True) + [""]
        report += [f"## Schedule ratio: {b.optimizer} with longer schedules vs A's final loss", ""]
        report += honest_table(a, arms_b, eval_keys(runs)) + [""]
    report += output_rms_section(selected, profiles) + weights_section(selected, weights_profiles(selected))
    (args.out / "summary.md").write_text("\n".join(report))
    print("\n" + "\n".join(report))
    print(f"wrote {args.out / 'summary.md'}")


if __name__ == "__main__":
    main()
