"""Run `python <script> ...` for a test from a process that has already imported torch.

Most of the seconds of a `python train.py <bad value>` or a short training run go to importing
torch, Hydra, transformers and the project, and the suite starts such commands dozens of
times. `run_python` keeps one server process per import-time environment that has done those
imports once; each command is a fork of it, in which the script runs as `__main__` exactly as
the interpreter would run it (its own sys.argv, sys.path[0], working directory, environment,
stdin from /dev/null, stdout and stderr captured, atexit handlers and the exit code or the
killing signal), so a test asserts on the same output and exit status as from a fresh process.

What a fork cannot give is a fresh import: a variable read while a module is imported (torch's
TORCH_*, the hub's HF_*, the thread pools' OMP_*) keeps the value the server imported with.
So the server is chosen by those variables: a command whose import-time variables differ from
every running server's gets a server of its own the second time they are asked for (the first
time, and past MAX_SERVERS, it runs as a plain subprocess).
Behaviours of the interpreter itself (signal handling while importing, `-X` flags, torchrun's
process tree) are tested with plain subprocesses, not through here.
"""
from __future__ import annotations

import ast
import atexit
import gc
import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

THIS_FILE = str(Path(__file__).resolve())
REPO = Path(THIS_FILE).parents[1]

# Environment variables that a module reads while it is imported (by prefix): a server's
# imports fixed their values, so only a command that agrees on all of them may use it.
IMPORT_TIME_PREFIXES = (
    "PYTHON", "LD_", "TORCH", "PYTORCH", "CUDA", "NCCL", "OMP_", "KMP_", "GOMP", "MKL", "OPENBLAS",
    "HF_", "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS",
)
MAX_SERVERS = 3
# The server watches its children through pidfds (Linux 5.3+); elsewhere commands run as plain
# subprocesses.
FORK_SERVES = sys.platform == "linux" and hasattr(os, "pidfd_open")


def _import_time_env(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES)))


def _modules_train_py_imports() -> list[str]:
    """The modules train.py imports at its top level: what every command here would import."""
    tree = ast.parse((REPO / "train.py").read_text())
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


# ---- the server (runs in its own process: python tests/prestarted.py) ----

def _serve(conn: Connection) -> None:
    """Fork a child per request; report its pid at once and its exit status when it ends.
    Several may run at once (a test holding a run dir while another run tries it)."""
    from multiprocessing.connection import wait

    sys.path.insert(0, str(REPO))
    for name in _modules_train_py_imports():
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - a command that needs it fails in its own fork, as it would
            pass
    try:  # what scripts/compare_runs.py plots with, a second's import in every fork that compares
        import matplotlib

        matplotlib.use("Agg")  # as the script itself chooses: files, no screen
        import matplotlib.pyplot  # noqa: F401
    except Exception:  # noqa: BLE001 - a command that needs it fails in its own fork, as it would
        pass
    try:  # the default corpus cut once (data/manifest.py keeps cuts per text): a forked run reads
        # its files as ever and finds the cut of unchanged text made
        from data.sources import PydocTopicsSource, StdlibSource

        for source in (StdlibSource(), PydocTopicsSource()):
            source.selections
    except Exception:  # noqa: BLE001 - a run that needs it finds the same failure itself
        pass
    _measure_peaks_in_a_child()
    # What the imports made is set aside from the forks' garbage collections (as gc.freeze's
    # documentation advises before forking): each fork's collections then scan only its own
    # objects, and do not touch, so copy, the pages it shares with this process.
    gc.freeze()
    del sys.path[0]
    running: dict[int, tuple[int, int]] = {}  # pidfd -> (pid, request id)
    while True:
        for ready in wait([conn, *running]):
            if ready is conn:
                try:
                    request = conn.recv()
                except EOFError:  # the test process is gone
                    return
                number = request.pop("id")
                pid = os.fork()
                if pid == 0:
                    conn.close()
                    for fd in running:
                        os.close(fd)
                    _run_in_child(**request)  # never returns
                running[os.pidfd_open(pid)] = (pid, number)
                conn.send((number, "pid", pid))
            else:  # a child ended: its pidfd is readable
                pid, number = running.pop(ready)
                os.close(ready)
                _, status = os.waitpid(pid, 0)
                conn.send((number, "exit", os.waitstatus_to_exitcode(status)))


def _measure_peaks_in_a_child() -> None:
    """The CPU's matmul peak (perf/mfu's denominator) in each precision a run may train in,
    measured once for every fork: eval/flops.py keeps it per process, as for the jobs of a
    sweep, and each run would otherwise spend a second measuring it. Measured in a child: a
    process whose OpenMP threads have run must not fork (its children hang in their first
    parallel region), so this one never runs a matmul itself."""
    try:
        import torch

        from eval.flops import device_peak_flops, remember_peak
        from optim.fast_dtype import resolve_precision
    except Exception:  # noqa: BLE001 - each run measures it itself
        return
    cpu = torch.device("cpu")
    precisions = sorted({"fp32", resolve_precision("auto", cpu).precision})
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        try:
            peaks = [device_peak_flops(cpu, p) for p in precisions]
            os.write(write_end, " ".join(map(repr, peaks)).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as answer:
        said = answer.read().decode().split()
    os.waitpid(pid, 0)
    if len(said) == len(precisions):
        for precision, flops in zip(precisions, said):
            remember_peak(cpu, precision, float(flops))


def _run_in_child(argv: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    """Be `python *argv` from here on: set up the process as the interpreter would, run the
    program as __main__, then end the way the interpreter ends."""
    import atexit as child_atexit
    import importlib.machinery
    import runpy
    import threading
    import types

    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    for fd, path in ((1, out), (2, err)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(handle, fd)
        os.close(handle)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    code = 0
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            # As the interpreter sets them: __file__ is the path joined to the working
            # directory (not normalised), sys.path[0] the script's real directory.
            script = os.path.join(os.getcwd(), argv[0])
            sys.path[0] = str(Path(script).resolve().parent)
            main = types.ModuleType("__main__")
            main.__file__ = script
            main.__cached__ = None
            main.__loader__ = importlib.machinery.SourceFileLoader("__main__", script)
            sys.modules["__main__"] = main
            with open(script, "rb") as source:
                program = compile(source.read(), script, "exec")
            exec(program, main.__dict__)
    except SystemExit as exit_:
        if exit_.code is None:
            code = 0
        elif isinstance(exit_.code, int):
            code = exit_.code
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException as error:  # noqa: BLE001 - what the interpreter prints for an uncaught exception
        error.__traceback__ = _program_frames(error.__traceback__)  # what excepthook prints
        sys.excepthook(type(error), error, error.__traceback__)
        code = -signal.SIGINT if isinstance(error, KeyboardInterrupt) else 1
    # The interpreter's shutdown: wait for non-daemon threads, run atexit, flush.
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    child_atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code < 0:  # ended by Ctrl-C: as the interpreter does, die of SIGINT itself
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


def _program_frames(tb):
    """The traceback from the program's first frame on, without this file's and runpy's."""
    while tb is not None and (os.path.abspath(tb.tb_frame.f_code.co_filename) == THIS_FILE
                              or "runpy" in tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


# ---- the client (in the test process) ----

class _Server:
    def __init__(self, env: dict[str, str]):
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, THIS_FILE, str(theirs.fileno())], env=env,
                                     pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.requests = 0
        self.exits: dict[int, int] = {}  # request id -> exit status, as they arrive

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        self.conn.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def start(self, argv: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> tuple[int, int]:
        """(request id, pid) of the command, now running."""
        self.requests += 1
        self.conn.send({"id": self.requests, "argv": argv, "cwd": cwd, "env": env, "out": out, "err": err})
        while True:
            number, kind, value = self.conn.recv()
            if kind == "exit":
                self.exits[number] = value
            elif number == self.requests:
                return number, value

    def exit_status(self, number: int, timeout: float | None) -> int | None:
        """The command's exit status, or None if it is still running after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while number not in self.exits:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self.conn.poll(left):
                return None
            done, kind, value = self.conn.recv()
            assert kind == "exit", kind
            self.exits[done] = value
        return self.exits.pop(number)


_scratch: tempfile.TemporaryDirectory | None = None


def _scratch_dir() -> str:
    """Where the commands' stdout and stderr go: one directory for the test process."""
    global _scratch
    if _scratch is None:
        _scratch = tempfile.TemporaryDirectory(prefix="prestarted-")
    return _scratch.name


class Started:
    """A command started from a server: the parts of subprocess.Popen the suite uses (pid,
    args, poll, wait, communicate, send_signal, kill, returncode, and stdout and stderr to read
    once it has ended)."""

    def __init__(self, server: _Server, argv: list[str], cwd: str, env: dict[str, str]):
        self.server = server
        self.args = [sys.executable, *argv]
        out = tempfile.mkdtemp(dir=_scratch_dir())
        self._out, self._err = os.path.join(out, "stdout"), os.path.join(out, "stderr")
        self._number, self.pid = server.start(argv, cwd, env, self._out, self._err)
        self.returncode: int | None = None
        self._stdout: io.StringIO | None = None
        self._stderr: io.StringIO | None = None

    def poll(self) -> int | None:
        return self.wait(timeout=0, raise_on_timeout=False)

    def wait(self, timeout: float | None = None, raise_on_timeout: bool = True) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_status(self._number, timeout)
            if self.returncode is None and raise_on_timeout:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return self.stdout.read(), self.stderr.read()

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    @property
    def stdout(self) -> io.StringIO:
        """What the command has printed so far (whole once it has ended)."""
        if self._stdout is None or self.returncode is None:
            self._stdout = io.StringIO(_read(self._out))
        return self._stdout

    @property
    def stderr(self) -> io.StringIO:
        if self._stderr is None or self.returncode is None:
            self._stderr = io.StringIO(_read(self._err))
        return self._stderr


def _read(path: str) -> str:
    try:
        with open(path, encoding=None, errors="replace", newline=None) as f:
            return f.read()
    except FileNotFoundError:  # the child has not opened it yet
        return ""


_servers: dict[tuple[tuple[str, str], ...], _Server] = {}


@atexit.register
def _close_servers() -> None:
    for server in _servers.values():
        server.close()
    _servers.clear()


_asked: set[tuple[tuple[str, str], ...]] = set()


def _server_for(env: dict[str, str], *, first_time_too: bool = False) -> _Server | None:
    """The server whose imports saw this environment's import-time variables. It is started
    the second time an environment is asked for (a one-off, such as a test's own cache
    variable, runs as a plain subprocess instead), or the first where `first_time_too`.
    None past MAX_SERVERS, and where a fork cannot stand in for a fresh interpreter (no pidfd:
    not Linux; macOS, whose system libraries do not survive a fork of a threaded process)."""
    if not FORK_SERVES:
        return None
    key = _import_time_env(env)
    server = _servers.get(key)
    if server is not None and not server.alive():
        del _servers[key]
        server = None
    if server is None and (key in _asked or first_time_too) and len(_servers) < MAX_SERVERS:
        server = _servers[key] = _Server(env)
    _asked.add(key)
    return server


def start_python(argv: list[str], *, cwd: Path | str = REPO,
                 env: dict[str, str] | None = None) -> Started | subprocess.Popen:
    """As `subprocess.Popen([sys.executable, *argv], cwd=cwd, env=env, stdout=PIPE, stderr=PIPE,
    text=True)`, read once it has ended, and forked from a server (see run_python); that very
    Popen where no server can serve it."""
    env = dict(os.environ if env is None else env)
    server = _server_for(env, first_time_too=True)
    if server is None:
        return subprocess.Popen([sys.executable, *argv], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    return Started(server, [str(a) for a in argv], str(cwd), env)


def run_python(argv: list[str], *, cwd: Path | str = REPO, env: dict[str, str] | None = None,
               timeout: float | None = None, check: bool = False) -> subprocess.CompletedProcess:
    """As `subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True,
    text=True, timeout=timeout, check=check)`, served by a fork of a process that has imported
    torch.

    argv is a script and its arguments, or `-c <program> ...`, or `-m <module> ...`.
    """
    env = dict(os.environ if env is None else env)
    if _server_for(env) is None:
        return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout, check=check)
    started = start_python(argv, cwd=cwd, env=env)
    try:
        started.wait(timeout)
    except subprocess.TimeoutExpired:
        started.kill()
        started.wait()
        raise subprocess.TimeoutExpired(started.args, timeout or 0, output=started.stdout.read(),
                                        stderr=started.stderr.read()) from None
    done = subprocess.CompletedProcess(started.args, started.returncode, started.stdout.read(), started.stderr.read())
    shutil.rmtree(os.path.dirname(started._out), ignore_errors=True)
    if check:
        done.check_returncode()
    return done


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
