"""Learning-rate schedules: linear warmup, then cosine, warmup-stable-decay, or constant."""
from __future__ import annotations

import math

from optim.config import OptimConfig


def warmup_steps(cfg: OptimConfig, max_steps: int) -> int:
    """The warmup's length in steps: optim.warmup_fraction of the run when set, else
    optim.warmup_steps. Rounded half up, not with round(), whose ties go to the even number
    (0.25 of 10 steps would warm up for 2, 0.35 of 10 for 4)."""
    if cfg.warmup_fraction is None:
        return cfg.warmup_steps
    return int(math.floor(cfg.warmup_fraction * max_steps + 0.5))


def decay_floor(cfg: OptimConfig) -> float:
    """The lr the decay ends at: optim.min_lr_ratio x optim.lr when set, else optim.min_lr."""
    return cfg.min_lr if cfg.min_lr_ratio is None else cfg.min_lr_ratio * cfg.lr


def warmup_words(cfg: OptimConfig, max_steps: int) -> str:
    """The warmup as the key that set it, for a message: "optim.warmup_steps=20", or
    "optim.warmup_fraction=0.1 (20 steps)"."""
    if cfg.warmup_fraction is None:
        return f"optim.warmup_steps={cfg.warmup_steps}"
    return f"optim.warmup_fraction={cfg.warmup_fraction:g} ({warmup_steps(cfg, max_steps)} steps)"


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based) of a run of `max_steps` steps."""
    warmup, floor = warmup_steps(cfg, max_steps), decay_floor(cfg)
    if step < warmup:
        # (step + 1): the first step already moves, instead of wasting a step at lr = 0.
        return cfg.lr * (step + 1) / warmup
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "cosine":
        span = max(1, max_steps - 1 - warmup)
        progress = min(1.0, (step - warmup) / span)
        return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if cfg.schedule == "wsd":
        decay_steps = max(1, round(cfg.wsd_decay_fraction * max_steps))
        decay_start = max(warmup, max_steps - decay_steps)
        if step < decay_start:
            return cfg.lr
        progress = min(1.0, (step - decay_start + 1) / (max_steps - decay_start))
        return cfg.lr + (floor - cfg.lr) * progress
    raise ValueError(f"optim.schedule: unknown schedule {cfg.schedule!r}")
