"""Failures that used to pass without a word or with a traceback: a run dir that cannot be
written, and a run that never learns."""
from __future__ import annotations

import json
import logging
import math
import signal
from pathlib import Path

import pytest

from tests.conftest import compose
from tests.test_checkpoint import COMMON, make_trainer
from trainer.config import to_dataclass
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


def test_a_signal_during_the_last_steps_evaluation_stops_the_run_once_it_is_complete(tmp_path, monkeypatch):
    """Before: a Ctrl-C after the last step's check (during its evaluation or checkpoint) was
    lost: the run returned as if nothing had happened, and a fair study went on to its next run.
    Now the run ends as it would (its row and checkpoint written), then stops with 130."""
    from trainer.run.preemption import Preempted

    trainer = make_trainer(tmp_path, ["trainer.batch_size=2", "trainer.max_steps=2", "checkpoint.interval=0"])
    evaluate = trainer.evaluate

    def evaluate_through_a_ctrl_c():
        signal.raise_signal(signal.SIGINT)
        return evaluate()

    monkeypatch.setattr(trainer, "evaluate", evaluate_through_a_ctrl_c)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(Preempted) as stopped:
        trainer.train()
    assert stopped.value.code == 130
    assert signal.getsignal(signal.SIGINT) is before  # handed back
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 2 and "val/val/loss" in rows[-1]  # the run is complete
    assert (tmp_path / "checkpoints" / "latest").read_text().startswith("step_00000002")


def test_a_trial_evaluates_only_its_sets_and_keeps_no_end_checkpoint(tmp_path):
    """eval.sets and checkpoint.at_end=false, as a fair study's trials run: the tuning set alone
    is evaluated and logged, and no checkpoint is written at the end."""
    trainer = make_trainer(tmp_path, ["trainer.batch_size=2", "trainer.max_steps=2", "checkpoint.interval=0",
                                      "data.tune_fraction=0.05", "eval.sets=[tune]", "checkpoint.at_end=false"])
    assert list(trainer.eval_sets) == ["tune"]
    final = trainer.train()
    assert "val/tune/loss" in final and "val/val/loss" not in final and "val/ood_prose/loss" not in final
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


@pytest.mark.parametrize("overrides, said", [
    (["eval.sets=[vall]"], "eval.sets: no eval set 'vall' (did you mean val? known: val, ood_prose)"),
    (["eval.sets=[]"], "eval.sets: empty; list the sets to evaluate (val, ood_prose), or null for all"),
    (["data.tune_fraction=0.05", "eval.objective=val/tune/loss", "eval.sets=[val]"],
     "eval.sets=['val'] leaves out tune, which eval.objective=val/tune/loss reads"),
])
def test_eval_sets_that_cannot_be_are_one_line(overrides, said):
    from trainer.config import ConfigError, validate

    with pytest.raises(ConfigError) as err:
        validate(to_dataclass(compose(COMMON + overrides)))
    assert str(err.value) == said


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
