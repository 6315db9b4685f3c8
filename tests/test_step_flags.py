"""trainer/skips.py's flag_step: a step's skip flag, loss window and skip counts, the same
eagerly and compiled (as trainer.compile runs it on a GPU)."""
from __future__ import annotations

import math

import pytest
import torch

from trainer.skips import SkipCounter, flag_step

NORMS = [1.0, math.nan, math.inf, 2.0, math.nan, 0.5]
LOSSES = [3.0, math.nan, 2.0, math.inf, 1.0, 4.0]


def run(fn) -> tuple[list[float], torch.Tensor, torch.Tensor]:
    window, counts, flags = torch.zeros(2), torch.zeros(4, dtype=torch.long), []
    for step, (norm, loss) in enumerate(zip(NORMS, LOSSES), start=1):
        found_inf, window, counts = fn(torch.tensor(norm), torch.tensor(loss), window, counts, step)
        flags.append(found_inf.item())
    return flags, window, counts


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_flags_window_and_skip_counts(compiled):
    flags, window, counts = run(torch.compile(flag_step) if compiled else flag_step)
    assert flags == [0.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    assert window.tolist() == [3.0 + 2.0 + 1.0 + 4.0, 4.0]  # the finite losses, and how many
    counter = SkipCounter(torch.device("cpu"))
    counter.counts, counter.through = counts, len(NORMS)
    report = counter.collect()
    assert (report.skipped, report.first, report.longest_run) == (3, 2, 2)
