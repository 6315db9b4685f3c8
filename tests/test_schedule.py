from __future__ import annotations

import math


from optim.config import OptimConfig
from optim.schedule import lr_at
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
