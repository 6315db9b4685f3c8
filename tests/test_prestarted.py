"""tests/prestarted.py must be indistinguishable from `subprocess.run([sys.executable, ...])`
in everything the suite asserts on: exit status, stdout, stderr, argv, sys.path, cwd, env."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests import prestarted
from tests.prestarted import run_python, start_python

# Where no server runs (not Linux), commands run as plain subprocesses: only these two tests
# are about the server itself.
SERVED = pytest.mark.skipif(not prestarted.FORK_SERVES, reason="commands run as plain subprocesses here (no pidfd)")

SCRIPT = """\
import atexit, os, sys, threading, time
print("argv", sys.argv)
print("path0", sys.path[0])
print("file", __file__, __name__)
print("cwd", os.getcwd())
print("env", os.environ.get("PRESTARTED_PROBE"))
atexit.register(lambda: print("atexit ran"))
threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined"))).start()
print("to stderr", file=sys.stderr)
what = sys.argv[1]
if what == "raise":
    raise ValueError("bad value")
if what == "exit-text":
    sys.exit("said on the way out")
if what == "interrupt":
    raise KeyboardInterrupt
sys.exit(int(what))
"""


def plain(argv, cwd, env):
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("how", ["0", "3", "raise", "exit-text", "interrupt"])
def test_a_script_ends_as_under_a_fresh_interpreter(tmp_path, how):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    workdir = tmp_path / "work"
    workdir.mkdir()
    env = {**os.environ, "PRESTARTED_PROBE": "seen"}
    argv = [os.path.relpath(script, workdir), how]
    ours, theirs = run_python(argv, cwd=workdir, env=env, timeout=60), plain(argv, workdir, env)
    assert (ours.returncode, ours.stdout, ours.stderr) == (theirs.returncode, theirs.stdout, theirs.stderr)
    assert ours.returncode == {"0": 0, "3": 3, "raise": 1, "exit-text": 1, "interrupt": -signal.SIGINT}[how]
    assert "thread joined\natexit ran" in ours.stdout and f"path0 {tmp_path}" in ours.stdout
    assert f"file {workdir / argv[0]} __main__" in ours.stdout and "env seen" in ours.stdout


@pytest.mark.parametrize("argv", [
    ["-c", "import sys; print(sys.argv, repr(sys.path[0]), __name__); raise ValueError(1)", "a", "b"],
    ["-m", "json.tool", "--no-such-flag"],
])
def test_c_and_m_run_as_under_a_fresh_interpreter(tmp_path, argv):
    ours, theirs = run_python(argv, cwd=tmp_path, timeout=60), plain(argv, tmp_path, dict(os.environ))
    assert (ours.returncode, ours.stdout, ours.stderr) == (theirs.returncode, theirs.stdout, theirs.stderr)
    assert ours.returncode != 0


@SERVED
def test_the_project_is_imported_once_and_forked_per_command():
    program = "import sys; print('torch' in sys.modules, 'trainer.loop' in sys.modules)"
    assert run_python(["-c", program], timeout=60).stdout == "True True\n"
    assert subprocess.run([sys.executable, "-c", program], capture_output=True, text=True).stdout == "False False\n"


@SERVED
def test_an_import_time_variable_gets_a_server_of_its_own_when_asked_again():
    program = "import os, torch; print(os.environ.get('TORCH_PRESTARTED_PROBE'), torch.get_num_threads() > 0)"
    before = set(prestarted._servers)
    env = {**os.environ, "TORCH_PRESTARTED_PROBE": "1"}
    assert run_python(["-c", program], env=env, timeout=60).stdout == "1 True\n"
    assert set(prestarted._servers) == before  # a one-off: a plain subprocess
    assert run_python(["-c", program], env=env, timeout=60).stdout == "1 True\n"
    added = set(prestarted._servers) - before
    try:
        assert len(added) == (0 if len(before) >= prestarted.MAX_SERVERS else 1)
        assert all(dict(key).get("TORCH_PRESTARTED_PROBE") == "1" for key in added)
    finally:
        for key in added:
            prestarted._servers.pop(key).close()


def test_a_command_past_its_timeout_is_killed_and_raises():
    with pytest.raises(subprocess.TimeoutExpired):
        run_python(["-c", "import time; print('started', flush=True); time.sleep(60)"], timeout=1)
    assert run_python(["-c", "print('next')"], timeout=60).stdout == "next\n"  # the server goes on


def test_commands_run_side_by_side_and_take_signals_as_processes(tmp_path):
    """One command holds on while another runs to its end; signals reach the command's own
    process (its handler runs, or the signal kills it), as with subprocess.Popen."""
    handler = ("import signal, sys, time\n"
               "signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))\n"
               "open(sys.argv[1], 'w').close()\n"
               "time.sleep(60)\n")
    ready = tmp_path / "ready"
    waiting = start_python(["-c", handler, str(ready)])
    plain_sleep = start_python(["-c", "import time; time.sleep(60)"])
    assert run_python(["-c", "print('beside them')"], timeout=60).stdout == "beside them\n"
    assert waiting.poll() is None and plain_sleep.poll() is None
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    waiting.send_signal(signal.SIGTERM)
    plain_sleep.send_signal(signal.SIGTERM)
    assert waiting.wait(timeout=60) == 143
    assert plain_sleep.wait(timeout=60) == -signal.SIGTERM
    assert os.path.exists(f"/proc/{waiting.pid}") is False


def test_where_no_fork_can_serve_commands_are_plain_subprocesses(monkeypatch):
    monkeypatch.setattr(prestarted, "FORK_SERVES", False)
    before = dict(prestarted._servers)
    done = run_python(["-c", "import sys; print('plain'); sys.exit(3)"], timeout=60)
    assert (done.returncode, done.stdout) == (3, "plain\n")
    started = start_python(["-c", "print('popen')"])
    assert isinstance(started, subprocess.Popen)
    assert started.communicate(timeout=60) == ("popen\n", "")
    assert prestarted._servers == before
