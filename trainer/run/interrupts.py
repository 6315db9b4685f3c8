"""Ctrl-C before training starts: exit 130 (128 + SIGINT, what a shell expects) without a
traceback, and without losing the signal.

Standard library only: train.py installs the handler before it imports torch, which alone
takes seconds.
"""
from __future__ import annotations

import signal

# 128 + SIGINT: what a shell expects of a command ended by Ctrl-C, during start-up or training
# (trainer/run/preemption.py: after the checkpoint).
INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT

_interrupted = False


def _on_sigint_during_start_up(signum, frame) -> None:
    global _interrupted
    _interrupted = True
    raise SystemExit(INTERRUPTED_EXIT_CODE)


def install_start_up_handler() -> None:
    """Ctrl-C during start-up (imports, the corpus, the model) has nothing to save: exit.
    Once training runs, trainer/run/preemption.py takes SIGINT over and checkpoints first."""
    signal.signal(signal.SIGINT, _on_sigint_during_start_up)


def exit_if_interrupted_during_start_up() -> None:
    """Exit 130 if Ctrl-C came during start-up. The handler's SystemExit normally ends the
    run where it lands, but an exception raised by a signal handler is lost where it lands in
    code that discards errors (C code that clears them): once, under load, a run went on to
    train after Ctrl-C, with nothing on stderr (twice under a loaded test suite). The flag
    cannot be lost: Trainer.train checks it before it writes anything, and the preemption
    handler before it takes SIGINT over."""
    if _interrupted:
        raise SystemExit(INTERRUPTED_EXIT_CODE)
