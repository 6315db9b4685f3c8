"""A command in a process group of its own, its output into a file, stopped whole when it runs
past its time: what `make check-gpu` (lab/tools/gpu/check_gpu.py) does with each step, and
lab/tools/gpu/reference_bf16.py with each of its sweeps. A group, because the command's children
(pytest-xdist workers, torch.compile's compile workers, Hydra's jobs) must go with it."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path
from typing import IO, Optional

KILL_GRACE_S = 10  # after SIGTERM, before SIGKILL


def start(argv: list[str], out: IO[str], cwd: Path, env: Optional[dict[str, str]] = None) -> subprocess.Popen:
    """Start `argv` in a session of its own (so the group can be stopped as one), stdout and
    stderr into `out`; OSError when it cannot start (no such program)."""
    return subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=True)


def wait_or_stop(proc: subprocess.Popen, timeout_s: float) -> tuple[Optional[int], bool]:
    """(exit code, timed out): wait at most `timeout_s` seconds, then SIGTERM the whole group,
    and SIGKILL it KILL_GRACE_S later if it is still there."""
    try:
        return proc.wait(timeout=max(timeout_s, 0.0)), False
    except subprocess.TimeoutExpired:
        pass
    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    return proc.returncode, True
