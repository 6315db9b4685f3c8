"""The AdamW both optimizers build (for the embedding, the head, norms and router, and for
everything under optim=adamw)."""
from __future__ import annotations

from typing import Any

import torch

from optim.config import OptimConfig


class CautiousAdamW(torch.optim.AdamW):
    """AdamW whose decoupled weight decay acts only where the Adam update and the weight agree
    in sign (Cautious Weight Decay, arXiv 2510.12402):

        W = W - lr * wd * W * [u * W > 0] - lr * u,    u = m_hat / (sqrt(v_hat) + eps)

    The fused kernel steps with weight decay 0; u * W > 0 is read off the step it took
    (W_before - W_after = lr * u, with the same sign as u), and the masked decay, computed from
    the weights before the step, is applied after it. A step the kernel skipped (`found_inf`)
    leaves W unchanged, so nothing is decayed either. Costs one copy of the stepped tensors.
    Where lr * u is below W's rounding step (|lr * u| < 2^-24 |W| for fp32 weights), W does
    not move and that coordinate is not decayed, where the paper's rule would decay it; Adam's
    normalised update is rarely that small."""

    @torch.no_grad()
    def step(self, closure=None):
        decays = [g["weight_decay"] for g in self.param_groups]
        stepped = [[p for p in g["params"] if p.grad is not None] for g in self.param_groups]
        before = [torch._foreach_mul(ps, 1.0) if ps and wd else [] for ps, wd in zip(stepped, decays)]
        for group in self.param_groups:
            group["weight_decay"] = 0.0
        try:
            loss = super().step(closure)
        finally:
            for group, wd in zip(self.param_groups, decays):
                group["weight_decay"] = wd
        for group, params, olds, wd in zip(self.param_groups, stepped, before, decays):
            if not olds:
                continue
            moved = torch._foreach_sub(olds, params)  # lr * u
            torch._foreach_mul_(moved, olds)
            masks = [m > 0 for m in moved]
            torch._foreach_mul_(olds, masks)
            torch._foreach_add_(params, olds, alpha=-group["lr"] * wd)
        return loss


def merged_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The families' groups, one per distinct setting: torch's fused AdamW launches its kernel,
    its step-count increment and its skip (found_inf) once per group, so nine families with
    two settings cost 27 launches a step where 6 do. "kind" lists the families merged."""
    merged: dict[str, dict[str, Any]] = {}
    for group in groups:
        settings = {k: v for k, v in group.items() if k not in ("params", "kind")}
        key = repr(sorted(settings.items()))
        into = merged.setdefault(key, {"params": [], "kind": [], **settings})
        into["params"] = [*into["params"], *group["params"]]
        into["kind"].append(group.get("kind"))
    for group in merged.values():
        group["kind"] = "+".join(str(kind) for kind in group["kind"])
    return list(merged.values())


def build_adamw(groups: list[dict[str, Any]], cfg: OptimConfig) -> torch.optim.AdamW:
    """torch's fused AdamW: the whole step is one kernel over all its tensors (the default
    for-each implementation launches several per step, and on CPU the per-tensor one reads
    each step count back to the host), with the same update rule; with optim.cautious_wd,
    the cautious decay around it. Families with the same settings share a group."""
    cls = CautiousAdamW if cfg.cautious_wd else torch.optim.AdamW
    return cls(merged_groups(groups), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)
