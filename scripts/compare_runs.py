"""Compare training runs (e.g. Muon vs AdamW): loss curves, leading steps, summary table.

    python scripts/compare_runs.py outputs/muon_gpt_tiny/RUN outputs/adamw_gpt_tiny/RUN
    python scripts/compare_runs.py outputs/multirun/2030-01-01_12-00-00     # a whole sweep

Each argument is a run dir (metrics.jsonl, or TensorBoard events in tb/) or a sweep dir of
runs; from sweeps the best lr per optimizer (lowest final val loss) is kept. The first
selected run is A (Muon when present), the second B. Writes PNGs into --out and prints a
summary table.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eval.compare import Run, best_per_optimizer, ewm, find_runs, leading_steps, load_run  # noqa: E402


def loss_keys(runs: list[Run]) -> list[str]:
    keys = {k for r in runs for k in r.series if k.endswith("/loss")}
    return sorted(keys, key=lambda k: (k != "train/loss", k != "val/val/loss", k))


def plot(runs: list[Run], keys: list[str], alpha: float, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for run in runs:
            if key in run.series:
                steps, values = run.series[key]
                ax.plot(steps, ewm(values, alpha) if key == "train/loss" else values, label=run.label)
        ax.set_title(key + (f" (EWM alpha={alpha})" if key == "train/loss" else ""))
        ax.set_xlabel("step")
        ax.legend()
    fig.tight_layout()
    written.append(out / "losses.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)

    a, b = runs[0], runs[1]
    fig, axes = plt.subplots(len(keys), 2, figsize=(10, 3.5 * len(keys)), squeeze=False)
    for row, key in zip(axes, keys):
        if key not in a.series or key not in b.series:
            continue
        leads = leading_steps(smoothed(a, key, alpha), smoothed(b, key, alpha))
        reached = [l for l in leads if l.step_b is not None]
        row[0].plot([l.step_a for l in reached], [l.difference for l in reached])
        row[0].set_title(f"{key}: {b.label} steps - {a.label} steps")
        row[1].plot([l.step_a for l in reached], [l.ratio for l in reached])
        row[1].axhline(1.0, color="grey", lw=0.5)
        row[1].set_title(f"{key}: ratio {b.label} / {a.label}")
        for ax in row:
            ax.set_xlabel(f"{a.label} step")
    fig.tight_layout()
    written.append(out / "leading_steps.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)
    return written


def smoothed(run: Run, key: str, alpha: float):
    steps, values = run.series[key]
    return steps, (ewm(values, alpha) if key == "train/loss" else values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--alpha", type=float, default=0.05, help="EWM smoothing of train/loss (default 0.05)")
    parser.add_argument("--out", type=Path, default=Path("comparison"))
    args = parser.parse_args()

    loaded = [load_run(p) for arg in args.runs for p in find_runs(arg)]
    runs = best_per_optimizer(loaded) if len(loaded) > len(args.runs) else loaded
    runs.sort(key=lambda r: r.optimizer != "muon")
    if len(runs) < 2:
        sys.exit(f"error: need two runs to compare, found {[r.label for r in runs]}")
    args.out.mkdir(parents=True, exist_ok=True)
    keys = loss_keys(runs)
    for path in plot(runs, keys, args.alpha, args.out):
        print(f"wrote {path}")

    a, b = runs[0], runs[1]
    print(f"\nA = {a.label} ({a.path}), B = {b.label} ({b.path})")
    if len(runs) > 2:
        print(f"(plotted but not in the leading-step summary: {', '.join(r.label for r in runs[2:])})")
    print("| loss | A final | B final | B steps to A's final | A steps | ratio B/A |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for key in keys:
        if key not in a.series or key not in b.series:
            continue
        last = leading_steps(smoothed(a, key, args.alpha), smoothed(b, key, args.alpha))[-1]
        reached = "not reached" if last.step_b is None else str(last.step_b)
        ratio = "-" if last.ratio is None else f"{last.ratio:.3f}"
        print(f"| {key} | {a.final(key):.4f} | {b.final(key):.4f} | {reached} | {last.step_a} | {ratio} |")


if __name__ == "__main__":
    main()
