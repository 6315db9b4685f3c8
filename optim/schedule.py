"""Learning-rate schedules: linear warmup, then cosine, warmup-stable-decay, or constant."""
from __future__ import annotations

import math

from optim.config import OptimConfig


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based) of a run of `max_steps` steps."""
    if step < cfg.warmup_steps:
        # (step + 1): the first step already moves, instead of wasting a step at lr = 0.
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "cosine":
        span = max(1, max_steps - 1 - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if cfg.schedule == "wsd":
        decay_steps = max(1, round(cfg.wsd_decay_fraction * max_steps))
        decay_start = max(cfg.warmup_steps, max_steps - decay_steps)
        if step < decay_start:
            return cfg.lr
        progress = min(1.0, (step - decay_start + 1) / (max_steps - decay_start))
        return cfg.lr + (cfg.min_lr - cfg.lr) * progress
    raise ValueError(f"optim.schedule: unknown schedule {cfg.schedule!r}")
