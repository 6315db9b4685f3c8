"""Run comparison maths: reading runs, EWM smoothing, best-lr selection, "leading steps".

Leading steps (the Moonlight authors' Muon-vs-AdamW view): for each logged step of run A,
the first step at which run B's loss is at or below A's loss there. The difference says
how many steps B needs beyond A to reach the same loss; the ratio B/A is A's step
efficiency over B. Curves are EWM-smoothed first, with a light default (alpha 0.05):
heavy smoothing (alpha 0.005) was seen to hide the real curves.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

Series = tuple[list[int], list[float]]


@dataclass
class Run:
    path: Path
    optimizer: str
    lr: Optional[float]
    series: dict[str, Series] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.optimizer} lr={self.lr:g}" if self.lr is not None else self.optimizer

    def final(self, key: str) -> Optional[float]:
        return self.series[key][1][-1] if key in self.series and self.series[key][1] else None


def _read_jsonl(path: Path) -> dict[str, Series]:
    """Every metric's (steps, values), in step order. A resumed run logs again the steps
    after the checkpoint it resumed from; the later record of a step wins, as it is the one
    the run continued from."""
    by_step: dict[str, dict[int, float]] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        for key, value in record.items():
            if key in ("step", "tokens"):
                continue
            by_step.setdefault(key, {})[int(record["step"])] = float(value)
    return {key: (sorted(points), [points[s] for s in sorted(points)]) for key, points in by_step.items()}


def _read_tensorboard(path: Path) -> dict[str, Series]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: ([e.step for e in acc.Scalars(tag)], [e.value for e in acc.Scalars(tag)])
            for tag in acc.Tags()["scalars"]}


def load_run(path: Path) -> Run:
    """A run dir: metrics.jsonl if present, else the TensorBoard events under tb/."""
    if (path / "metrics.jsonl").exists():
        series = _read_jsonl(path / "metrics.jsonl")
    elif (path / "tb").is_dir():
        series = _read_tensorboard(path / "tb")
    else:
        raise FileNotFoundError(f"{path}: no metrics.jsonl or tb/ in this run dir")
    optimizer, lr = path.name, None
    config = path / ".hydra" / "config.yaml"
    if config.exists():
        optim = (yaml.safe_load(config.read_text()) or {}).get("optim", {})
        optimizer, lr = optim.get("name", optimizer), optim.get("lr")
    return Run(path, optimizer, lr, series)


def find_runs(path: Path) -> list[Path]:
    """The run dirs at or below `path` (a single run, or a sweep dir of runs)."""
    if (path / "metrics.jsonl").exists() or (path / "tb").is_dir():
        return [path]
    found = {p.parent for p in path.rglob("metrics.jsonl")}
    found |= {p.parent for p in path.rglob("tb") if p.is_dir()}
    if not found:
        raise FileNotFoundError(f"{path}: no runs (metrics.jsonl or tb/) found here or below")
    return sorted(found)


def best_per_optimizer(runs: list[Run], key: str = "val/val/loss") -> list[Run]:
    """For each optimizer, the run with the lowest final `key` (the best lr of a sweep)."""
    best: dict[str, Run] = {}
    for run in runs:
        value = run.final(key)
        if value is None or not math.isfinite(value):
            continue  # a diverged job of the sweep (NaN never compares lower)
        if run.optimizer not in best or value < best[run.optimizer].final(key):
            best[run.optimizer] = run
    return list(best.values())


def ewm(values: list[float], alpha: float) -> list[float]:
    """Exponentially weighted mean, bias-corrected so the first points are not pulled to 0."""
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must lie in (0, 1], got {alpha}")
    out, mean, weight = [], 0.0, 0.0
    for v in values:
        mean = (1 - alpha) * mean + alpha * v
        weight = (1 - alpha) * weight + alpha
        out.append(mean / weight)
    return out


@dataclass
class Lead:
    step_a: int
    step_b: Optional[int]  # None: B never reaches A's loss

    @property
    def difference(self) -> Optional[int]:
        return None if self.step_b is None else self.step_b - self.step_a

    @property
    def ratio(self) -> Optional[float]:
        return None if self.step_b is None else self.step_b / self.step_a


def leading_steps(a: Series, b: Series) -> list[Lead]:
    """For each step of A, the first step of B whose loss is <= A's loss at that step."""
    steps_b, loss_b = b
    leads = []
    for step, loss in zip(*a):
        reached = next((s for s, v in zip(steps_b, loss_b) if v <= loss), None)
        leads.append(Lead(step, reached))
    return leads
