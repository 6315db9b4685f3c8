"""Failures that used to pass without a word or with a traceback: a run dir that cannot be
written, and a run that never learns."""
from __future__ import annotations

import logging
import math
import signal
from pathlib import Path

import pytest

from tests.test_checkpoint import make_trainer
from tests.test_faults import cli, error_line


@pytest.mark.parametrize("run_dir", ["/proc/no_such_dir/run", "/proc/self/run"])
def test_a_run_dir_that_cannot_be_made_is_one_line_with_exit_2(run_dir):
    """Before: Hydra's traceback and exit 1, or an error that named no key."""
    proc = cli(Path(run_dir))
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = error_line(proc)
    assert line.startswith(f"error: hydra.run.dir={run_dir}: the run dir cannot be written (")


@pytest.mark.parametrize("signals, code", [((signal.SIGINT,), 130), ((signal.SIGTERM,), 143),
                                           ((signal.SIGTERM, signal.SIGINT), 143)])
def test_a_signal_during_training_stops_it_with_128_plus_its_number(signals, code):
    """Before: Ctrl-C during training exited 143, as if a scheduler had ended the job. The
    process-level check (a run stepping, then the signal) is in tests/test_faults.py."""
    from parallel.mesh import Mesh
    from trainer.run.preemption import PreemptionFlag

    flag = PreemptionFlag()
    try:
        assert flag.raised(Mesh()) == 0
        for sig in signals:
            signal.raise_signal(sig)
        assert flag.raised(Mesh()) == code
    finally:
        flag.restore()


def not_learning_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "is not learning" in r.getMessage()]


def test_a_run_whose_loss_stays_at_ln_vocab_warns_once_after_the_warmup(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    trainer = make_trainer(tmp_path / "frozen", ["trainer.batch_size=2", "optim.lr=0", "trainer.max_steps=30",
                                                 "optim.warmup_steps=21", "checkpoint.interval=0"])
    trainer.train()
    warnings = not_learning_warnings(caplog)
    assert len(warnings) == 1, warnings
    chance = math.log(trainer.data.vocab_size)
    assert f"at step 22 is still ln(vocab_size) = {chance:.4f}" in warnings[0]
    assert "optim.warmup_steps=21" in warnings[0] and "optim.lr=0" in warnings[0]


def test_a_learning_run_gets_no_such_warning(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    make_trainer(tmp_path / "learning", ["trainer.batch_size=2", "trainer.max_steps=30",
                                         "checkpoint.interval=0"]).train()
    assert not_learning_warnings(caplog) == []
