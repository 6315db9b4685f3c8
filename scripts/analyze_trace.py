"""Where the step time goes, per rank, from the traces of `profile.enabled=true`.

    python scripts/analyze_trace.py outputs/muon_gpt_small/RUN            # or RUN/traces
    python scripts/analyze_trace.py outputs/adamw_gpt_small/RUN outputs/muon_gpt_small/RUN

For each rank, over the profiled steps (per step, and as a fraction of the step): compute,
communication, optimizer (its non-communicating part), eval and idle time, which add up to
the step; the whole optimizer step including its collectives; and the communication time of
each collective. Given two runs A and B (e.g. AdamW and Muon) it also prints the
communication-time ratio B/A, each run's optimizer overhead (optimizer step / step time) and
their difference, and the optimizer state memory of each (mem/optim_state_bytes from
metrics.jsonl). See eval/trace_stats.py for exactly how time is attributed.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from eval.trace_stats import CATEGORIES, Comparison, RankStats, analyze_run, compare, run_dir_of


def label(path: Path) -> str:
    """The run's optimizer name when its Hydra config says, else the dir name."""
    from eval.compare import load_run

    run_dir = run_dir_of(path)
    try:
        return load_run(run_dir).optimizer
    except FileNotFoundError:
        return run_dir.name


def cell(r: RankStats, value: float) -> str:
    return f"{r.per_step_ms(value):9.2f} {100 * r.fraction(value):5.1f}%"


def print_run(name: str, path: Path, ranks: list[RankStats]) -> None:
    steps = ranks[0].steps
    print(f"{name}: {path}  ({ranks[0].timeline} timeline, steps {steps[0]}-{steps[-1]}, "
          f"{len(ranks)} rank(s)); ms per step and % of the step")
    columns = list(CATEGORIES) + ["optim step"]
    print(f"{'rank':>4} {'step ms':>9} " + " ".join(f"{c:>16}" for c in columns))
    for r in ranks:
        values = [r.parts[c] for c in CATEGORIES] + [r.optimizer_step]
        print(f"{r.rank:>4} {r.per_step_ms(r.step_time):9.2f} " + " ".join(f"{cell(r, v):>16}" for v in values))
    ops = sorted({op for r in ranks for op in r.comm_by_op})
    if ops:
        print("communication by collective:")
        print(f"{'rank':>4} " + " ".join(f"{op:>18}" for op in ops))
        for r in ranks:
            print(f"{r.rank:>4} " + " ".join(f"{cell(r, r.comm_by_op.get(op, 0.0)):>18}" for op in ops))
    print()


def mib(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value / 2**20:.2f} MiB"


def print_comparison(names: tuple[str, str], c: Comparison) -> None:
    a, b = names
    ratio = "n/a" if c.comm_ratio is None else f"{c.comm_ratio:.3f}"
    print(f"comparison, A = {a}, B = {b} (means over ranks):")
    print(f"  communication time per step: A {c.comm_ms[0]:.2f} ms, B {c.comm_ms[1]:.2f} ms, ratio B/A {ratio}")
    print(f"  optimizer overhead (optimizer step / step): A {100 * c.overhead[0]:.2f}%, "
          f"B {100 * c.overhead[1]:.2f}%, B - A {c.overhead_difference:+.2f} points")
    state_ratio = ("n/a" if None in c.state_bytes or not c.state_bytes[0]
                   else f"{c.state_bytes[1] / c.state_bytes[0]:.3f}")
    print(f"  optimizer state memory (rank 0): A {mib(c.state_bytes[0])}, B {mib(c.state_bytes[1])}, "
          f"ratio B/A {state_ratio}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_a", type=Path, help="run dir or its traces/ dir")
    parser.add_argument("run_b", type=Path, nargs="?", help="a second run to compare with (B/A)")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON instead")
    args = parser.parse_args()

    paths = [p for p in (args.run_a, args.run_b) if p is not None]
    try:
        runs = [analyze_run(p) for p in paths]
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    comparison = compare(runs[0], runs[1], paths[0], paths[1]) if len(runs) == 2 else None
    if args.json:
        out = {"runs": [{"path": str(p), "ranks": [asdict(r) for r in ranks]} for p, ranks in zip(paths, runs)]}
        if comparison is not None:
            out["comparison"] = {**asdict(comparison), "overhead_difference": comparison.overhead_difference}
        print(json.dumps(out, indent=1))
        return
    names = [label(p) for p in paths]
    for i, (path, ranks) in enumerate(zip(paths, runs)):
        print_run(f"{'AB'[i]} ({names[i]})" if len(runs) == 2 else names[i], path, ranks)
    if comparison is not None:
        print_comparison((names[0], names[1]), comparison)


if __name__ == "__main__":
    main()
