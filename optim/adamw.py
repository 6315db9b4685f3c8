"""The AdamW both optimizers build (for the embedding, the head, norms and router, and for
everything under optim=adamw)."""
from __future__ import annotations

from typing import Any

import torch

from optim.config import OptimConfig


def build_adamw(groups: list[dict[str, Any]], cfg: OptimConfig) -> torch.optim.AdamW:
    """torch's fused AdamW: the whole step is one kernel over all its tensors (the default
    for-each implementation launches several per step, and on CPU the per-tensor one reads
    each step count back to the host), with the same update rule."""
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)
