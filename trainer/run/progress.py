"""Progress display: a tqdm bar on a terminal, plain periodic lines in logs and CI. Whatever the
console shows, the step, loss and eval lines also go to the job log (train.log)."""
from __future__ import annotations

import logging
import sys
import time
from typing import Optional

from tqdm import tqdm


def _fmt_duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def job_log_only() -> logging.Logger:
    """A logger that writes to the job's log files (Hydra's train.log) and not to the console,
    which has its own bar or lines. Re-pointed each time: each job of a sweep has its own file."""
    logger = logging.getLogger("progress")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.handlers = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    return logger


class Progress:
    def __init__(self, total_steps: int, start_step: int, mode: str, prefix: Optional[str] = None) -> None:
        if mode == "auto":
            mode = "bar" if sys.stdout.isatty() else "lines"
        self.mode = mode
        self.total = total_steps
        self.start_step = start_step
        self.start_time = time.perf_counter()
        self.prefix = f"[{prefix}] " if prefix else ""
        self.bar = (tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, desc=prefix)
                    if mode == "bar" else None)
        self.log = job_log_only()

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def report(self, step: int, loss: float, tokens_per_s: float) -> None:
        """Called on logging steps, with `step` the number of steps completed."""
        done = step - self.start_step
        elapsed = time.perf_counter() - self.start_time
        eta = elapsed / max(done, 1) * (self.total - step)
        line = f"step {step}/{self.total} | loss {loss:.4f} | {tokens_per_s:,.0f} tok/s | eta {_fmt_duration(eta)}"
        self.log.info(line)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}")
        elif self.mode == "lines":
            print(self.prefix + line, flush=True)

    def message(self, text: str) -> None:
        self.log.info(text)
        if self.bar is not None:
            self.bar.write(self.prefix + text)
        elif self.mode != "none":
            print(self.prefix + text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
