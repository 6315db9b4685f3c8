"""Counting skipped (non-finite) steps on the device, read by the host only at sync points.

A step whose gradients are NaN/inf is dropped by the optimizers on the device; the host learns
of it at its next sync point (a logging step, a checkpoint, the end). Counting there, rather
than with an `.item()` per step, keeps the step free of host syncs. Besides the count, the
counter tracks the longest run of consecutive skips: one bad batch now and then is noise that
`trainer.nonfinite=skip` is meant to absorb, a long run of them is a run that has diverged.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SkipReport:
    """What the device counted since the previous collect."""

    skipped: int  # steps skipped since the previous collect
    first: int  # the first of them (1-based step number); 0 when none
    longest_run: int  # the longest run of consecutive skips in that window (or still going)
    through: int  # the latest step noted (0: none yet)


class SkipCounter:
    # One small device tensor, read with a single transfer: [skipped, first, current run,
    # longest run].
    SKIPPED = 0

    def __init__(self, device: torch.device) -> None:
        self.counts = torch.zeros(4, dtype=torch.long, device=device)
        self.through = 0

    def collect(self) -> SkipReport:
        """Read and reset the window (a host sync). A run of skips still going carries over,
        so a run that spans two windows is measured whole."""
        skipped, first, current, longest = self.counts.tolist()
        self.counts = torch.tensor([0, 0, current, current], dtype=torch.long, device=self.counts.device)
        return SkipReport(skipped, first, longest, self.through)


def flag_step(grad_norm: torch.Tensor, step_loss: torch.Tensor, loss_window: torch.Tensor, counts: torch.Tensor,
              step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A training step's bookkeeping on the device, as one function of tensors so that under
    trainer.compile on a GPU it runs as one or two fused kernels, not about 18 launches.

    Returns found_inf (1.0 where the global gradient norm is not finite: the optimizers skip
    the step), the logging window [sum, count] with this step's loss added if finite, and
    SkipCounter's counts with step `step` (1-based) noted."""
    found_inf = (~torch.isfinite(grad_norm)).float()
    finite = torch.isfinite(step_loss)
    loss_window = loss_window + torch.stack([torch.where(finite, step_loss, 0.0), finite.float()])
    bad = found_inf.to(torch.long)
    skipped, first, current, longest = counts.unbind()
    current = (current + bad) * bad
    # Elementwise ops and one stack, no indexed writes: this runs on every training step.
    counts = torch.stack([skipped + bad, torch.where((first == 0) & (bad != 0), step, first),
                          current, torch.maximum(longest, current)])
    return found_inf, loss_window, counts
