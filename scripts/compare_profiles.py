"""compare_runs.py's profiles at the end of the runs: each arm's output RMS by layer, its weight
RMS per parameter kind and its largest attention logit, as a figure and as tables."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, TypeVar

from eval.compare import Run
from eval.seeds import Arm, Estimate, estimate
from scripts.compare_format import BEST_KEY, fmt, fmt_estimate, markdown_table
from scripts.compare_plots import add_legend, pyplot


OUTPUT_RMS = "model/output_rms/"
OUTPUT_RMS_LAYER = re.compile(re.escape(OUTPUT_RMS) + r"layer_(\d+)")
OUTPUT_RMS_FINAL = OUTPUT_RMS + "final"


# The trainer's weight RMS per parameter kind (optim/routing.py) and each layer's largest
# pre-softmax attention logit on an eval batch (docs/outputs.md).
WEIGHT_RMS = "model/weight_rms/"
WEIGHT_RMS_KIND = re.compile(re.escape(WEIGHT_RMS) + r"(\w+)")
MAX_LOGIT = "attn/max_logit/"
MAX_LOGIT_LAYER = re.compile(re.escape(MAX_LOGIT) + r"layer_(\d+)")


@dataclass
class DepthProfile:
    """An arm's output RMS at the end of its runs, by depth: mean +- standard error over the
    seeds (of those runs that logged it) of each layer's last logged value, and of the final
    normed state's."""
    arm: Arm  # the runs it is over
    name: str  # its row and legend entry
    layers: list[tuple[int, Estimate]]  # (layer index, estimate), by index
    final: Optional[Estimate]


@dataclass
class WeightsProfile:
    """An arm's weights and attention logits at the end of its runs: mean +- standard error
    over the seeds (of those runs that logged either) of each kind's last logged weight RMS, and
    of each run's largest last logged attention logit over its layers."""
    arm: Arm  # the runs it is over
    name: str  # its row
    weight_rms: dict[str, Optional[Estimate]]  # by kind
    max_logit: Optional[Estimate]


Profile = TypeVar("Profile", DepthProfile, WeightsProfile)


def logged(run: Run, pattern: re.Pattern) -> list[str]:
    """The group of `pattern` in each of the run's metric names that it matches whole."""
    return [m.group(1) for m in map(pattern.fullmatch, run.series) if m]


def output_rms_layers(run: Run) -> list[int]:
    """The layer indices of the run's logged output RMS, in depth order (layer_10 after layer_9)."""
    return sorted(int(i) for i in logged(run, OUTPUT_RMS_LAYER))


def max_logit(run: Run) -> Optional[float]:
    """The largest of the run's last logged attn/max_logit/layer_<i>: how near the layer most at
    risk is to saturating its softmax; None when it logged none."""
    finals = [run.final(MAX_LOGIT + "layer_" + i) for i in logged(run, MAX_LOGIT_LAYER)]
    return max((v for v in finals if v is not None), default=None)


def logged_part(arm: Arm, logs: Callable[[Run], bool], with_steps: bool) -> Optional[tuple[Arm, str]]:
    """The arm of those of `arm`'s runs that `logs`, and its row name; None when no run does.
    `with_steps` names its length too (the label does not have it)."""
    runs = [run for run in arm.runs if logs(run)]
    if not runs:
        return None
    part = Arm(runs)
    return part, part.label + (f", {fmt(arm.final_step(BEST_KEY), 'd')} steps" if with_steps else "")


def depth_profile(arm: Arm, with_steps: bool = False) -> Optional[DepthProfile]:
    """The arm's output RMS by layer, over the seeds that logged it; None when none did."""
    found = logged_part(arm, lambda run: bool(output_rms_layers(run)), with_steps)
    if found is None:
        return None
    part, name = found
    layers = sorted({i for run in part.runs for i in output_rms_layers(run)})
    estimates = [(i, part.final_estimate(f"{OUTPUT_RMS}layer_{i}")) for i in layers]
    return DepthProfile(part, name, estimates, part.final_estimate(OUTPUT_RMS_FINAL))  # type: ignore[arg-type]


def weights_profile(arm: Arm, with_steps: bool = False) -> Optional[WeightsProfile]:
    """The arm's weight RMS per kind and largest attention logit, over the seeds that logged
    either; None when none did."""
    found = logged_part(arm, lambda run: bool(logged(run, WEIGHT_RMS_KIND)) or max_logit(run) is not None,
                        with_steps)
    if found is None:
        return None
    part, name = found
    kinds = sorted({kind for run in part.runs for kind in logged(run, WEIGHT_RMS_KIND)})
    return WeightsProfile(part, name, {kind: part.final_estimate(WEIGHT_RMS + kind) for kind in kinds},
                          estimate([v for v in map(max_logit, part.runs) if v is not None]))


def profiles_of(arms: list[Arm], profile: Callable[[Arm, bool], Optional[Profile]]) -> list[Profile]:
    """The profile of each arm that logged its metrics. Arms of one setting at several schedule
    lengths (a sweep of longer AdamW runs) share a label, so their names then carry the length."""
    with_steps = len({arm.final_step(BEST_KEY) for arm in arms}) > 1
    return [p for p in (profile(arm, with_steps) for arm in arms) if p is not None]


def depth_profiles(arms: list[Arm]) -> list[DepthProfile]:
    """The output RMS by layer of each arm that logged it."""
    return profiles_of(arms, depth_profile)


def weights_profiles(arms: list[Arm]) -> list[WeightsProfile]:
    """The weight RMS and largest attention logit of each arm that logged either."""
    return profiles_of(arms, weights_profile)


def error_bars(estimates: list[Estimate]) -> Optional[list[list[float]]]:
    """matplotlib's (lower, upper) yerr of +- one standard error, None with no seeds to give one.
    The lower bar stops short of 0, which a log axis cannot draw."""
    if all(est.se is None for est in estimates):
        return None
    ses = [est.se or 0.0 for est in estimates]
    return [[min(se, 0.9 * est.mean) for se, est in zip(ses, estimates)], ses]


def draw_output_rms(ax, profiles: list[DepthProfile]) -> None:
    """Each arm's layers as a line against the layer index, and its final normed state as a
    point of the same colour at one shared "final" position past the deepest layer: it is
    another quantity (after the norm), so no line joins it to the last layer."""
    from matplotlib import ticker

    final_x = max(i for p in profiles for i, _ in p.layers) + 1
    for profile in profiles:
        estimates = [est for _, est in profile.layers]
        bars = ax.errorbar([i for i, _ in profile.layers], [est.mean for est in estimates],
                           yerr=error_bars(estimates), marker="o", markersize=4, capsize=3, label=profile.name)
        if profile.final is not None:
            ax.errorbar([final_x], [profile.final.mean], yerr=error_bars([profile.final]), marker="s",
                        markersize=5, capsize=3, linestyle="none", color=bars.lines[0].get_color())
    ax.set_yscale("log")  # the final norm brings ~70 back to ~1: both ends must be readable
    # ticks at 1, 2, 5 per decade in plain numbers: the range is two decades, and powers of ten
    # alone would leave one labelled tick on it
    ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda y, _: f"{y:g}"))
    ax.set_xticks(list(range(final_x + 1)), [str(i) for i in range(final_x)] + ["final"])
    ax.set_xlabel("layer")
    ax.set_ylabel("output RMS at the last logged step")


def plot_output_rms_by_layer(profiles: list[DepthProfile], out: Path) -> Path | None:
    """output_rms_by_layer.png: draw_output_rms of every arm that logged it; None when none did."""
    if not profiles:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    draw_output_rms(ax, profiles)
    add_legend(fig, [ax], len(profiles))
    seeded = any(len(p.arm.runs) > 1 for p in profiles)
    ax.set_title("output RMS by layer, end of run" + ("\nmean over seeds, bars +- one standard error" if seeded else ""))
    fig.tight_layout()
    fig.savefig(out / "output_rms_by_layer.png", dpi=80, bbox_inches="tight")
    plt.close(fig)
    return out / "output_rms_by_layer.png"


def profile_section(title: str, metric: str, arms: list[Arm], profiles: list[Profile], body: list[str],
                    if_none: str = "") -> list[str]:
    """summary.md's section `title` with `body` (its tables of `profiles`), and a note naming the
    runs left out for not logging `metric` (runs from before the metric, TensorBoard-only runs
    without it); with no profile, one line that no run logged it, and `if_none`."""
    lines = [f"## {title}", ""]
    if not profiles:
        return lines + [f"No compared run logged {metric}{if_none}.", ""]
    kept = {id(run) for p in profiles for run in p.arm.runs}
    skipped = [run for arm in arms for run in arm.runs if id(run) not in kept]
    lines += body
    if skipped:
        lines += ["", f"Left out, no {metric} logged:", ""] + [f"- {run.path}" for run in skipped]
    return lines + [""]


def output_rms_section(arms: list[Arm], profiles: list[DepthProfile]) -> list[str]:
    """summary.md's table of the numbers in output_rms_by_layer.png, one row per arm."""
    layers = sorted({i for p in profiles for i, _ in p.layers})
    rows = [[p.name] + [fmt_estimate(dict(p.layers).get(i), ".3f") for i in layers] + [fmt_estimate(p.final, ".3f")]
            for p in profiles]
    body = [f"Each run's last logged {OUTPUT_RMS}layer_<i> and final (the normed state the head reads), "
            "mean ± standard error over the seeds (output_rms_by_layer.png).", ""]
    body += markdown_table(["setting"] + [f"layer {i}" for i in layers] + ["final"], rows)
    return profile_section("Output RMS by layer at the end of the run", f"{OUTPUT_RMS}layer_<i>", arms, profiles,
                           body, ": no output_rms_by_layer.png")


def weights_section(arms: list[Arm], profiles: list[WeightsProfile]) -> list[str]:
    """summary.md's table of each arm's weight RMS per kind and largest attention logit, one row
    per arm: whether one optimizer grows its weights, or its logits towards saturation, more."""
    # sorted: the same columns in the same order whichever order each run logged them in
    kinds = sorted({kind for p in profiles for kind in p.weight_rms})
    # 5 decimals: a matrix's weight RMS is ~0.01 to 0.1, and its seeds can differ from the 5th on
    rows = [[p.name] + [fmt_estimate(p.weight_rms.get(kind), ".5f") for kind in kinds]
            + [fmt_estimate(p.max_logit, ".2f")] for p in profiles]
    body = [f"Each run's last logged {WEIGHT_RMS}<kind> (a column per kind) and the largest of its last "
            f"logged {MAX_LOGIT}layer_<i> over the layers (max logit), mean ± standard error over the seeds.", ""]
    body += markdown_table(["setting"] + kinds + ["max logit"], rows)
    return profile_section("Weights and attention logits at the end of the run",
                           f"{WEIGHT_RMS}<kind> or {MAX_LOGIT}layer_<i>", arms, profiles, body)
