"""Compare training runs (e.g. Muon vs AdamW): loss curves, leading steps, summary tables.

    python scripts/compare_runs.py outputs/muon_gpt_tiny/RUN outputs/adamw_gpt_tiny/RUN
    python scripts/compare_runs.py outputs/multirun/2030-01-01_12-00-00     # a whole sweep
    python scripts/compare_runs.py SWEEP --longer outputs/multirun/<AdamW at 1.25x, 1.5x, 2x>

Each argument is a run dir (metrics.jsonl, or TensorBoard events in tb/) or a sweep dir of
runs; from sweeps the best lr per optimizer (lowest final val loss) is kept, and a table of
every run's final losses is printed. The first selected run is A (Muon when present), the
second B. --longer takes runs of B's optimizer with longer schedules and reports the
schedule-length ratio at which B's final loss reaches A's. Writes PNGs and summary.md (the
printed tables) into --out.

Losses are only comparable on the same tokens: runs whose corpus ids (environment.json)
differ are refused unless --allow-mixed-corpora is given. summary.md names the corpus and
the environment of every compared run.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eval.compare import (  # noqa: E402
    Run, best_per_optimizer, ewm, final_step, find_runs, in_run_ratio, leading_steps, load_run,
    mixed_corpora, schedule_ratio,
)

BEST_KEY = "val/val/loss"


def loss_keys(runs: list[Run]) -> list[str]:
    keys = {k for r in runs for k in r.series if k.endswith("/loss")}
    return sorted(keys, key=lambda k: (k != "train/loss", k != BEST_KEY, k))


def eval_keys(runs: list[Run]) -> list[str]:
    """Held-out losses: val first, then each OOD set."""
    return [k for k in loss_keys(runs) if k != "train/loss"]


def smoothed(run: Run, key: str, alpha: float):
    steps, values = run.series[key]
    return steps, (ewm(values, alpha) if key == "train/loss" else values)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_losses(runs: list[Run], keys: list[str], alpha: float, out: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for run in runs:
            if key in run.series:
                ax.plot(*smoothed(run, key, alpha), label=run.label)
        ax.set_title(key + (f" (EWM alpha={alpha})" if key == "train/loss" else ""))
        ax.set_xlabel("step")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "losses.png", dpi=80)
    plt.close(fig)
    return out / "losses.png"


def plot_leading_steps(a: Run, b: Run, keys: list[str], alpha: float, out: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(len(keys), 2, figsize=(10, 3.5 * len(keys)), squeeze=False)
    for row, key in zip(axes, keys):
        if key not in a.series or key not in b.series:
            continue
        leads = leading_steps(smoothed(a, key, alpha), smoothed(b, key, alpha))
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


def plot_family(runs: list[Run], prefix: str, title: str, out: Path, name: str) -> Path | None:
    """One panel per metric under `prefix` (e.g. each parameter kind's update RMS), every run
    in each panel. None when no run logged the family."""
    keys = sorted({k for r in runs for k in r.series if k.startswith(prefix)})
    if not keys:
        return None
    plt = _pyplot()
    cols = min(3, len(keys))
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for run in runs:
            if key in run.series:
                ax.plot(*run.series[key], label=run.label)
        ax.set_title(key[len(prefix):])
        ax.set_xlabel("step")
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    axes.flat[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out / name, dpi=80)
    plt.close(fig)
    return out / name


def fmt(value: float | None, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def sweep_table(runs: list[Run], best: list[Run], keys: list[str]) -> list[str]:
    lines = ["| optimizer | lr | " + " | ".join(f"final {k}" for k in keys) + " |",
             "| --- | ---: | " + " | ".join("---:" for _ in keys) + " |"]
    for run in sorted(runs, key=lambda r: (r.optimizer, r.lr if r.lr is not None else 0.0)):
        mark = " (best)" if any(run is r for r in best) else ""
        lr = "-" if run.lr is None else f"{run.lr:g}"
        lines.append(f"| {run.optimizer}{mark} | {lr} | " + " | ".join(fmt(run.final(k)) for k in keys) + " |")
    return lines


def in_run_table(a: Run, b: Run, keys: list[str], alpha: float) -> list[str]:
    lines = ["| loss | A final | B final | B steps | A steps | ratio B/A | at the final loss of |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for key in keys:
        if key not in a.series or key not in b.series:
            continue
        r = in_run_ratio(smoothed(a, key, alpha), smoothed(b, key, alpha))
        cells = ["-", "-", "-", "-"] if r is None else [
            f"{r.steps_b:.4g}", f"{r.steps_a:.4g}", f"{r.ratio:.3f}", r.reference]
        lines.append(f"| {key} | {a.final(key):.4f} | {b.final(key):.4f} | " + " | ".join(cells) + " |")
    return lines


def honest_table(a: Run, b: Run, longer: list[Run], keys: list[str]) -> list[str]:
    runs_b = sorted([b] + longer, key=lambda r: final_step(r, BEST_KEY) or 0)
    steps_a = final_step(a, BEST_KEY)
    lengths = [(final_step(r, BEST_KEY) or 0) / steps_a for r in runs_b]
    lines = ["| loss | A final | " + " | ".join(f"B at {x:g}x" for x in lengths) + " | schedule ratio B/A |",
             "| --- | ---: | " + " | ".join("---:" for _ in lengths) + " | ---: |"]
    for key in keys:
        finals = [r.final(key) for r in runs_b]
        if a.final(key) is None or any(f is None for f in finals):
            continue
        s = schedule_ratio(a.final(key), lengths, finals)  # type: ignore[arg-type]
        if s.ratio is None:
            ratio = f"> {s.lengths[-1]:g} (not reached)"
        elif s.ratio == s.lengths[0] and s.finals[0] <= s.target:
            ratio = f"<= {s.lengths[0]:g}"
        else:
            ratio = f"{s.ratio:.3f}"
        lines.append(f"| {key} | {a.final(key):.4f} | " + " | ".join(f"{f:.4f}" for f in finals) + f" | {ratio} |")
    return lines


def runs_section(a: Run, b: Run, longer: list[Run], mixed: str | None) -> list[str]:
    """The corpus and environment of every compared run: what the figures below are on."""
    lines = ["## Runs", ""]
    if mixed:
        lines += [f"**Mixed corpora (--allow-mixed-corpora): {mixed}.** Loss differences below mix "
                  "the optimizers' effect with the data's.", ""]
    else:
        lines += [f"Corpus: {a.corpus} (every run)", ""]
    lines += [f"- A = {a.describe()}", f"- B = {b.describe()}"]
    lines += [f"- B, longer: {run.describe()}" for run in longer]
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--alpha", type=float, default=0.05, help="EWM smoothing of train/loss (default 0.05)")
    parser.add_argument("--out", type=Path, default=Path("comparison"))
    parser.add_argument("--longer", nargs="+", type=Path, default=[],
                        help="runs (or sweep dirs) of B's optimizer with longer schedules, for the schedule ratio")
    parser.add_argument("--allow-mixed-corpora", action="store_true",
                        help="compare runs whose corpus ids differ (their losses are on other tokens)")
    args = parser.parse_args()

    loaded = [load_run(p) for arg in args.runs for p in find_runs(arg)]
    swept = len(loaded) > len(args.runs)
    runs = best_per_optimizer(loaded, BEST_KEY) if swept else loaded
    runs.sort(key=lambda r: r.optimizer != "muon")
    if len(runs) < 2:
        sys.exit(f"error: need two runs to compare, found {[r.label for r in runs]}")
    a, b = runs[0], runs[1]
    longer = [load_run(p) for arg in args.longer for p in find_runs(arg)]
    for run in longer:
        if run.optimizer != b.optimizer:
            sys.exit(f"error: --longer run {run.path} is {run.optimizer}, not B's optimizer {b.optimizer}")
    if longer and final_step(a, BEST_KEY) is None:
        sys.exit(f"error: run {a.path} logged no {BEST_KEY}, which the schedule ratio needs")
    mixed = mixed_corpora(loaded + longer)
    if mixed and not args.allow_mixed_corpora:
        sys.exit(f"error: {mixed}; pass --allow-mixed-corpora to compare them anyway")

    args.out.mkdir(parents=True, exist_ok=True)
    keys = loss_keys(runs)
    written = [plot_losses(runs, keys, args.alpha, args.out),
               plot_leading_steps(a, b, keys, args.alpha, args.out),
               plot_family(runs, "optim/update_rms/", "update RMS / lr, per parameter kind", args.out,
                           "update_rms.png"),
               plot_family(runs, "model/output_rms/", "output RMS of each block (residual stream)", args.out,
                           "output_rms.png"),
               plot_family(runs, "attn/max_logit/", "max attention logit per layer", args.out,
                           "max_attn_logit.png")]
    for path in written:
        if path is not None:
            print(f"wrote {path}")

    report = runs_section(a, b, longer, mixed)
    if swept:
        report += ["## Sweep: final losses of every run", ""]
        report += sweep_table(loaded, runs, eval_keys(loaded)) + [""]
    report += [f"## In-run leading steps: A = {a.label}, B = {b.label}", "",
               f"A: {a.path}", f"B: {b.path}", ""]
    if len(runs) > 2:
        report += [f"(plotted but not compared: {', '.join(r.label for r in runs[2:])})", ""]
    report += in_run_table(a, b, keys, args.alpha) + [""]
    if longer:
        report += [f"## Schedule ratio: {b.optimizer} with longer schedules vs A's final loss", ""]
        report += honest_table(a, b, longer, eval_keys(runs)) + [""]
    (args.out / "summary.md").write_text("\n".join(report))
    print("\n" + "\n".join(report))
    print(f"wrote {args.out / 'summary.md'}")


if __name__ == "__main__":
    main()
