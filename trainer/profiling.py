"""Per-rank torch.profiler Chrome traces of a window of optimizer steps.

`profile.enabled=true profile.steps=[a,b]` records steps a..b (1-based, inclusive) on every
rank into <run_dir>/traces/rank<R>.json. Each step is a `ProfilerStep#<step>` region (the
name profiler tools use for iterations); the loop marks its phases with parallel.comm.region
(names in eval/trace_stats.py), and every collective is a `comm/<group>/<op>` region.
scripts/analyze_trace.py turns the traces into time fractions.

Outside the window nothing is recorded and `region` is a no-op, so profiling costs nothing
unless it is on, and only the chosen steps pay the profiler's overhead.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import torch

from eval.trace_stats import STEP_PREFIX
from trainer import device as dev
from trainer.config import ProfileConfig

log = logging.getLogger("profile")


def trace_path(trace_dir: Path, rank: int) -> Path:
    return trace_dir / f"rank{rank}.json"


class StepProfiler:
    """Call `begin(step)` before and `end(step)` after each optimizer step, `close()` at the end."""

    def __init__(self, cfg: ProfileConfig, trace_dir: Path, rank: int, device: torch.device) -> None:
        self.first, self.last = cfg.steps
        self.enabled = cfg.enabled
        self.path = trace_path(trace_dir, rank)
        self.device = device
        self.profiler: Optional[torch.profiler.profile] = None
        self.step_region: Optional[torch.profiler.record_function] = None

    def begin(self, step: int) -> None:
        # A run resumed inside the window records the rest of it.
        if self.enabled and self.profiler is None and self.first <= step <= self.last:
            self.profiler = torch.profiler.profile(activities=dev.profiler_activities(self.device))
            self.profiler.start()
        if self.profiler is not None:
            self.step_region = torch.profiler.record_function(f"{STEP_PREFIX}{step}")
            self.step_region.__enter__()

    def end(self, step: int) -> bool:
        """Close the step's region; True when this step ended the window and the trace was
        written (which took time the caller may not want to count as training)."""
        if self.profiler is None:
            return False
        self._close_step()
        if step >= self.last:
            self._finish()
            return True
        return False

    def close(self) -> None:
        """End of training, normal or not: a window cut short is still written."""
        if self.profiler is not None:
            self._close_step()
            self._finish()

    def _close_step(self) -> None:
        if self.step_region is not None:
            self.step_region.__exit__(None, None, None)
            self.step_region = None

    def _finish(self) -> None:
        assert self.profiler is not None
        # Queued kernels must finish inside the recording, or the last step loses its tail.
        dev.synchronize(self.device)
        self.profiler.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.profiler.export_chrome_trace(str(self.path))
        log.info("wrote profiler trace %s", self.path)
        self.profiler = None
        self.enabled = False  # one window per run
