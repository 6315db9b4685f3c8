from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest

from optim.config import OptimConfig
from optim.schedule import decay_floor, lr_at, warmup_steps
from tests.closeness import approx


def test_cosine_warms_up_then_decays_to_min_lr():
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, schedule="cosine")
    lrs = [lr_at(s, cfg, 110) for s in range(110)]
    assert lrs[0] == approx(0.1)
    assert lrs[9] == approx(1.0)
    assert lrs[10] == approx(1.0)
    assert lrs[-1] == approx(0.1)
    mid = 10 + 99 // 2
    assert lrs[mid] == approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (mid - 10) / 99)))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


def test_wsd_is_flat_then_decays_linearly_over_the_last_fraction():
    cfg = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=5, schedule="wsd", wsd_decay_fraction=0.2)
    lrs = [lr_at(s, cfg, 100) for s in range(100)]
    assert all(lr == 1.0 for lr in lrs[5:80])
    assert lrs[80] == approx(1 - 1 / 20)
    assert lrs[99] == approx(0.0)
    assert all(a > b for a, b in zip(lrs[80:], lrs[81:]))


def test_constant_after_warmup():
    cfg = OptimConfig(lr=0.5, warmup_steps=2, schedule="constant")
    assert [lr_at(s, cfg, 10) for s in range(4)] == [0.25, 0.5, 0.5, 0.5]


# ---- optim.warmup_fraction and optim.min_lr_ratio ----


def test_warmup_fraction_is_a_share_of_the_run_and_wins_over_warmup_steps():
    cfg = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=50, warmup_fraction=0.1, schedule="cosine")
    assert warmup_steps(cfg, 200) == 20 and warmup_steps(cfg, 600) == 60
    lrs = [lr_at(s, cfg, 200) for s in range(200)]
    assert lrs[0] == approx(1 / 20) and lrs[19] == approx(1.0)
    assert lrs[20] == approx(1.0) and lrs[21] < 1.0  # the decay starts at step 20, not at 50
    # Ties round up: 0.25 of 10 steps is 3 (round() would give 2), 0.35 of 10 is 4.
    assert [warmup_steps(OptimConfig(warmup_fraction=f), 10) for f in (0.25, 0.35, 0.0)] == [3, 4, 0]
    assert warmup_steps(OptimConfig(warmup_steps=7), 200) == 7  # unset: the absolute key


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_min_lr_ratio_sets_the_floor_relative_to_lr_and_wins_over_min_lr(schedule):
    cfg = OptimConfig(lr=0.02, min_lr=0.5, min_lr_ratio=0.1, warmup_steps=5, schedule=schedule)
    assert decay_floor(cfg) == approx(0.002)
    lrs = [lr_at(s, cfg, 100) for s in range(100)]
    assert lrs[5] == approx(0.02)
    assert lrs[-1] == approx(0.002)
    assert all(a >= b for a, b in zip(lrs[5:], lrs[6:]))
    assert decay_floor(OptimConfig(lr=0.02, min_lr=0.001)) == 0.001  # unset: the absolute key


def test_the_not_learning_warning_waits_for_the_fractional_warmup(caplog):
    """trainer/loop.py reads the warmup through the helper: a warmup_fraction of 0.5 over 200
    steps is 100 steps, so a loss at chance at step 60 is still warming up (warmup_steps=5 is
    overridden), and at step 101 it is not."""
    from trainer.config import TrainConfig
    from trainer.loop import Trainer

    cfg = TrainConfig()
    cfg.optim.warmup_steps, cfg.optim.warmup_fraction, cfg.trainer.max_steps = 5, 0.5, 200
    stub = SimpleNamespace(cfg=cfg, _learning_checked=False, data=SimpleNamespace(vocab_size=100), speaks=True)
    caplog.set_level(logging.WARNING)
    Trainer._warn_if_not_learning(stub, 60, math.log(100))
    assert not stub._learning_checked and caplog.messages == []
    Trainer._warn_if_not_learning(stub, 101, math.log(100))
    assert stub._learning_checked
    assert len(caplog.messages) == 1 and "past optim.warmup_fraction=0.5 (100 steps)" in caplog.messages[0]
