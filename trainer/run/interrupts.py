"""Ctrl-C or SIGTERM before training starts: exit 130 or 143 (128 + the signal's number, what a
shell or a scheduler expects) without a traceback, and without losing the signal.

Standard library only: train.py and scripts/fair_compare.py install the handler before they
import torch, which alone takes seconds.
"""
from __future__ import annotations

import signal

# 128 + SIGINT: what a shell expects of a command ended by Ctrl-C, during start-up or training
# (trainer/run/preemption.py: after the checkpoint).
INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT
HANDLED = (signal.SIGINT, signal.SIGTERM)

# The exit code of the signal that came during start-up (0: none); SIGTERM's outranks Ctrl-C's.
_interrupted = 0


def _on_signal_during_start_up(signum, frame) -> None:
    global _interrupted
    _interrupted = max(_interrupted, 128 + int(signum))
    raise SystemExit(_interrupted)


def install_start_up_handler() -> None:
    """Ctrl-C or SIGTERM during start-up (imports, the corpus, the model) has nothing to save:
    exit. Once training runs, trainer/run/preemption.py takes both over and checkpoints first."""
    for sig in HANDLED:
        signal.signal(sig, _on_signal_during_start_up)


def interrupted() -> int:
    """The exit code of a signal the start-up handler took (0: none): a study asks it before it
    starts each run, since the handler's SystemExit can be lost (below)."""
    return _interrupted


def exit_if_interrupted_during_start_up() -> None:
    """Exit 130 (143) if Ctrl-C (SIGTERM) came during start-up. The handler's SystemExit
    normally ends the run where it lands, but an exception raised by a signal handler is lost
    where it lands in code that discards errors (C code that clears them): once, under load, a
    run went on to train after Ctrl-C, with nothing on stderr (twice under a loaded test suite).
    The flag cannot be lost: Trainer.train checks it before it writes anything, and the
    preemption handler before it takes the signals over."""
    if _interrupted:
        raise SystemExit(_interrupted)
