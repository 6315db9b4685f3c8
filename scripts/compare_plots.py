"""compare_runs.py's figures of whole curves: the losses (mean over seeds with a band of +- one
standard error), the leading steps, a family of per-layer or per-kind metrics."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from eval.compare import Run, ewm, leading_steps
from eval.seeds import Arm
# Below this many logged points a bare line hides where the points are, and a single point
# draws nothing at all: such curves get a marker at every point.
FEW_POINTS = 20


def smoothed(run: Run, key: str, alpha: float):
    steps, values = run.series[key]
    return steps, (ewm(values, alpha) if key == "train/loss" else values)


def smoothing(alpha: float):
    """smoothed() as a run's curve of a metric, the form Arm and the seed ratios take."""
    return lambda run, key: smoothed(run, key, alpha)


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def point_marker(n_points: int) -> Optional[str]:
    """A marker for a curve of few points (a short run's, or a val loss logged twice), none for
    a dense one, where markers would bury the line."""
    return "o" if n_points < FEW_POINTS else None


def plot_curve(ax, arm: Arm, key: str, curve_of=None) -> None:
    """The arm's mean curve, and a band of +- one standard error when it has several seeds."""
    curve = arm.curve(key, curve_of)
    if curve is None:
        return
    steps, means, ses = curve
    (line,) = ax.plot(steps, means, label=arm.label, marker=point_marker(len(steps)), markersize=4)
    if len(arm.runs) > 1:
        ax.fill_between(steps, [m - s for m, s in zip(means, ses)], [m + s for m, s in zip(means, ses)],
                        color=line.get_color(), alpha=0.25, lw=0)


def add_legend(fig, axes, n_arms: int) -> None:
    """Up to three arms: a legend in each panel. More (a sweep of settings) would cover the
    curves, so one legend for the figure goes below it, and savefig must be told to keep it
    (bbox_inches="tight")."""
    if n_arms <= 3:
        for ax in axes:
            if ax.get_legend_handles_labels()[0]:
                ax.legend()
        return
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=min(3, n_arms), frameon=False)


def plot_losses(arms: list[Arm], keys: list[str], alpha: float, out: Path) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for arm in arms:
            plot_curve(ax, arm, key, smoothing(alpha))
        ax.set_title(key + (f" (EWM alpha={alpha})" if key == "train/loss" else ""))
        ax.set_xlabel("step")
    add_legend(fig, list(axes[0]), len(arms))
    if any(len(arm.runs) > 1 for arm in arms):
        fig.suptitle("mean over seeds, band +- one standard error")
    fig.tight_layout()
    fig.savefig(out / "losses.png", dpi=80, bbox_inches="tight")
    plt.close(fig)
    return out / "losses.png"


def plot_leading_steps(a: Arm, b: Arm, keys: list[str], alpha: float, out: Path) -> Path:
    """Leading steps between the two arms' mean curves (each seed's curve smoothed first)."""
    plt = pyplot()
    fig, axes = plt.subplots(len(keys), 2, figsize=(10, 3.5 * len(keys)), squeeze=False)
    for row, key in zip(axes, keys):
        mean_a, mean_b = a.mean_series(key, smoothing(alpha)), b.mean_series(key, smoothing(alpha))
        if mean_a is None or mean_b is None:
            continue
        leads = leading_steps(mean_a, mean_b)
        reached = [l for l in leads if l.step_b is not None]
        row[0].plot([l.step_a for l in reached], [l.difference for l in reached], marker=".")
        row[0].set_title(f"{key}: steps B - A")
        row[1].plot([l.step_a for l in reached], [l.ratio for l in reached], marker=".")
        row[1].axhline(1.0, color="grey", lw=0.5)
        row[1].set_title(f"{key}: steps B / A")
        for ax in row:
            ax.set_xlabel("step of A")
    fig.suptitle(f"steps B needs to reach A's loss: A = {a.label}, B = {b.label}")
    fig.tight_layout()
    fig.savefig(out / "leading_steps.png", dpi=80)
    plt.close(fig)
    return out / "leading_steps.png"


def plot_family(arms: list[Arm], prefix: str, title: str, out: Path, name: str) -> Path | None:
    """One panel per metric under `prefix` (e.g. each parameter kind's update RMS), every arm
    in each panel. None when no run logged the family."""
    keys = sorted({k for arm in arms for r in arm.runs for k in r.series if k.startswith(prefix)})
    if not keys:
        return None
    plt = pyplot()
    cols = min(3, len(keys))
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for arm in arms:
            plot_curve(ax, arm, key)
        ax.set_title(key[len(prefix):])
        ax.set_xlabel("step")
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    add_legend(fig, [axes.flat[0]], len(arms))
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out / name, dpi=80, bbox_inches="tight")
    plt.close(fig)
    return out / name


# Each block's output RMS (the residual stream after it) and the final normed state's, as the
# trainer logs them at logging steps (docs/outputs.md).
