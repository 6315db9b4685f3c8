"""What a study says as it goes: one line per run, "run k of N", and when the study will end.

The end is estimated from the runs trained so far in this pass: a run's seconds are fitted as
a start-up cost plus a cost per step (least squares, both >= 0), and the runs and steps still
to come are priced with it. Runs taken from the records cost nothing and count as done.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Optional

PREFIX = "[fair]"


def say(line: str) -> None:
    print(f"{PREFIX} {line}", flush=True)


def minutes(seconds: float) -> str:
    """1m05s; 2h03m past an hour."""
    seconds = max(0.0, seconds)
    whole = int(seconds // 60)
    return f"{whole // 60}h{whole % 60:02d}m" if whole >= 60 else f"{whole}m{int(seconds % 60):02d}s"


def run_cost(trained: list[tuple[int, float]]) -> Optional[tuple[float, float]]:
    """(seconds a run costs besides its steps, seconds per step) from (steps, seconds) of the
    runs trained so far; None before the first. With one length of run seen, a run's time is
    taken to grow with its steps alone (the start-up cannot be told apart yet)."""
    if not trained:
        return None
    steps = [float(s) for s, _ in trained]
    secs = [float(t) for _, t in trained]
    n = len(trained)
    mean_s, mean_t = math.fsum(steps) / n, math.fsum(secs) / n
    spread = math.fsum((s - mean_s) ** 2 for s in steps)
    if spread == 0:
        return 0.0, mean_t / max(mean_s, 1.0)
    per_step = math.fsum((s - mean_s) * (t - mean_t) for s, t in zip(steps, secs)) / spread
    per_step = max(per_step, 0.0)
    start_up = max(mean_t - per_step * mean_s, 0.0)
    if start_up == 0.0:  # refit through the origin
        per_step = math.fsum(s * t for s, t in zip(steps, secs)) / math.fsum(s * s for s in steps)
    return start_up, per_step


@dataclass
class StudyProgress:
    """The study's runs as they come: `total` planned runs of `total_steps` steps in all."""

    total: int
    total_steps: int
    done: int = 0
    done_steps: int = 0
    started: float = field(default_factory=time.monotonic)
    trained: list[tuple[int, float]] = field(default_factory=list)

    def count(self, steps: int, seconds: Optional[float]) -> str:
        """Count one run (`seconds` None: taken from the records); "run k of N" and the time
        left, for its line."""
        self.done += 1
        self.done_steps += steps
        if seconds is not None:
            self.trained.append((steps, seconds))
        return f"run {self.done} of {max(self.total, self.done)}"

    def left(self) -> Optional[float]:
        """Seconds until the last planned run ends; None before a run was trained here."""
        cost = run_cost(self.trained)
        if cost is None:
            return None
        start_up, per_step = cost
        runs = max(self.total - self.done, 0)
        steps = max(self.total_steps - self.done_steps, 0)
        return runs * start_up + steps * per_step

    def clock(self) -> str:
        """"12m03s in, about 40m left" (or just the time in, before an estimate exists)."""
        text = f"{minutes(time.monotonic() - self.started)} in"
        left = self.left()
        if left is not None and self.done < self.total:
            text += f", about {minutes(left)} left"
        return text
