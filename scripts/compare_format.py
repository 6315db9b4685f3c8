"""compare_runs.py's formatting: numbers, estimates and markdown tables, and the key the best lr
of a sweep is chosen by."""
from __future__ import annotations

BEST_KEY = "val/val/loss"


def markdown_table(head: list[str], rows: list[list[str]]) -> list[str]:
    """A table with a text first column and numbers, right-aligned, in the others."""
    return ["| " + " | ".join(head) + " |", "| --- | " + " | ".join("---:" for _ in head[1:]) + " |"] + [
        "| " + " | ".join(row) + " |" for row in rows]


def fmt(value: float | None, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def fmt_estimate(est, spec: str = ".4f") -> str:
    return "-" if est is None else est.format(spec)
