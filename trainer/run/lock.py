"""One run per run dir: a lock file, `<run_dir>/.lock`, held for the run's life.

Two runs given the same run dir (the same TRAIN_RUN_ID twice, a SLURM requeue overlapping the
live job) would interleave their metrics.jsonl rows, overwrite each other's checkpoints and
config, and race each other's renames. The first to create the lock runs; the second stops with
one line naming the holder (host, pid, start time) before it writes anything into the dir.

The lock is a small JSON file, created whole and at once (a complete temp file hard-linked to
the lock's name: the link fails if the name exists), so a reader never sees it half written.
The holder rewrites it every HEARTBEAT_S seconds (a daemon thread), and removes it when the run
ends, normally or not. A lock left behind by a killed run is stale, and the next run takes it
over with a warning:

- on this host, when the holder's pid is gone, or is now another process (the lock keeps the
  process's start time, since pids are reused; the warning names the process found instead);
- on another host, whose pids cannot be asked, when its heartbeat is over STALE_AFTER_S old;
- under torchrun, when it was left by an earlier attempt of the same launch (torchrun stops
  every worker of an attempt before it starts the next).

Only rank 0 of a multi-process launch takes the lock; the other ranks only look at it, and stop
only when another launch holds it (the lock names the launch it belongs to).
"""
from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Mapping

from trainer.run.launch import RUN_ID_ENV

LOCK_NAME = ".lock"
# How often the holder rewrites its heartbeat, and how old a heartbeat must be before a run on
# another host takes the lock over. Ten missed beats: a run stalled by a slow file system or a
# long compile is not mistaken for a dead one, and a run killed on another node blocks its
# relaunch for five minutes at most (on the same host the pid check frees it at once).
HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0
# Held while a stale lock is removed, so that two runs taking over the same stale lock cannot
# each remove the other's fresh one. It lives for milliseconds; one older than this was left by
# a run killed inside that window.
TAKEOVER_NAME = ".lock.takeover"
TAKEOVER_ABANDONED_S = 60.0
# How long a run waits for another run's takeover of a stale lock to finish.
TAKEOVER_WAIT_S = 10.0

log = logging.getLogger(__name__)


class RunLocked(ValueError):
    """Another live run holds the run dir. A ValueError: train.py reports it as bad input,
    in one line, and exits 2."""


@dataclass(frozen=True)
class Holder:
    """The lock file's content: who holds the run dir, since when, and whether still alive."""

    host: str
    pid: int
    started: str  # ISO time the lock was taken
    heartbeat: str  # ISO time the holder last rewrote the lock
    token: str  # tells two locks apart even when the rest is alike
    launch: str | None = None  # the multi-process launch it belongs to (see launch_id)
    attempt: int = 0  # torchrun's restart count of that launch
    boot_id: str | None = None  # the host's boot: a pid from before a reboot is gone
    pid_start: int | None = None  # the process's start time in clock ticks: a reused pid differs

    def describe(self) -> str:
        return f"host {self.host}, pid {self.pid}, started {self.started}"


def _iso_now() -> str:
    return datetime.now().astimezone().isoformat(timespec="seconds")


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def _process_start(pid: int) -> int | None:
    """The process's start time (clock ticks after boot) from /proc; None where there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        # The command name in parentheses may hold spaces: the fields follow its last ")".
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def launch_id(env: Mapping[str, str]) -> str | None:
    """What the ranks of one launch share and no concurrent launch does.

    torchrun's rendezvous id ("none" is the static rendezvous's placeholder, shared by
    unrelated launches); a SLURM step, with its requeue count, since a requeued job keeps its id;
    else the rendezvous address, which no two live launches can bind. None for one process.
    """
    run_id = env.get("TORCHELASTIC_RUN_ID", "none")
    if run_id != "none":
        return f"torchrun:{run_id}"
    if env.get("SLURM_JOB_ID"):
        return f"slurm:{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '')}.{env.get('SLURM_RESTART_COUNT', '0')}"
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return f"master:{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    return None


def _attempt(env: Mapping[str, str]) -> int:
    try:
        return int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def this_process(env: Mapping[str, str]) -> Holder:
    now = _iso_now()
    return Holder(host=socket.gethostname(), pid=os.getpid(), started=now, heartbeat=now,
                  token=uuid.uuid4().hex, launch=launch_id(env), attempt=_attempt(env),
                  boot_id=_boot_id(), pid_start=_process_start(os.getpid()))


def read_holder(path: Path) -> Holder | None:
    """The lock's holder; None when there is no lock. A lock that is not ours to read (written
    by hand, or by another program) is an unknown holder, judged by the file's age alone."""
    try:
        text = path.read_text()
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        return None
    try:
        fields = json.loads(text)
        return Holder(**{k: v for k, v in fields.items() if k in Holder.__dataclass_fields__})
    except (ValueError, TypeError, AttributeError):
        written = datetime.fromtimestamp(mtime).astimezone().isoformat(timespec="seconds")
        return Holder(host="unknown (unreadable lock file)", pid=0, started="unknown", heartbeat=written,
                      token=f"unreadable:{mtime!r}:{len(text)}")


def _tick_time(ticks: int) -> str:
    """A /proc start time (clock ticks after boot) as local ISO time, for a reader."""
    try:
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        seconds = boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, IndexError, ValueError):
        return f"{ticks} clock ticks after boot"
    return datetime.fromtimestamp(seconds).astimezone().isoformat(timespec="seconds")


# Enough of a command line to recognise the program, short enough for one log line.
COMMAND_SHOWN_CHARS = 80


def _command_line(pid: int) -> str:
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        text = " ".join(a.decode(errors="replace") for a in args if a)
        if not text:  # a kernel thread or a zombie: only its name
            text = f"[{Path(f'/proc/{pid}/comm').read_text().strip()}]"
    except OSError:
        return "command line unreadable"
    return text if len(text) <= COMMAND_SHOWN_CHARS else text[: COMMAND_SHOWN_CHARS - 3] + "..."


def _pid_check(pid: int, pid_start: int | None) -> str | None:
    """None while the holder's process may still be running; else what was found in its place:
    no process, or (pids are reused) another process, told apart by its start time."""
    if not isinstance(pid, int) or pid <= 0:
        return "its pid is gone"  # os.kill(0, ...) would ask about this process's own group
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "its pid is gone"
    except PermissionError:
        pass  # another user's process: alive
    if pid_start is not None:
        now = _process_start(pid)
        if now is not None and now != pid_start:
            return (f"its pid {pid} is now another process (`{_command_line(pid)}`, started {_tick_time(now)}; "
                    f"the lock's process started {_tick_time(pid_start)})")
    return None


def _heartbeat_age(holder: Holder, now: float) -> float:
    try:
        return now - datetime.fromisoformat(holder.heartbeat).timestamp()
    except (TypeError, ValueError):
        return float("inf")


def stale_reason(holder: Holder, me: Holder, now: float | None = None,
                 stale_after_s: float = STALE_AFTER_S) -> str | None:
    """Why the holder's lock no longer counts, or None while the holder may still be running."""
    if me.launch is not None and holder.launch == me.launch and holder.attempt < me.attempt:
        return f"left by attempt {holder.attempt} of this launch, which torchrun has stopped"
    if holder.host == me.host:
        if holder.boot_id and me.boot_id and holder.boot_id != me.boot_id:
            return "left before this host restarted"
        return _pid_check(holder.pid, holder.pid_start)
    age = _heartbeat_age(holder, time.time() if now is None else now)
    if age > stale_after_s:
        return f"its heartbeat is {age:.0f} s old (stale after {stale_after_s:.0f} s)"
    return None


def refusal(run_dir: Path, holder: Holder, me: Holder) -> str:
    """The one line a refused run prints."""
    beat = ""
    if holder.host != me.host:
        beat = f", last heartbeat {max(0.0, _heartbeat_age(holder, time.time())):.0f} s ago"
    return (f"run dir {run_dir} is in use by another run ({holder.describe()}{beat}): give this run "
            f"another hydra.run.dir or {RUN_ID_ENV}, or wait for that run to end")


def _write_temp(path: Path, holder: Holder) -> Path:
    tmp = path.with_name(f"{LOCK_NAME}.{holder.token}.tmp")
    tmp.write_text(json.dumps(asdict(holder), indent=1) + "\n")
    return tmp


def _create(path: Path, holder: Holder) -> bool:
    """Create the lock, whole, unless one exists: False then."""
    tmp = _write_temp(path, holder)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def _remove_stale(path: Path, stale: Holder) -> bool:
    """Remove the stale lock, unless another run is at it. True when the lock is gone (the
    caller then creates its own, which still fails if a third run got there first)."""
    mutex = path.with_name(TAKEOVER_NAME)
    try:
        os.close(os.open(mutex, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        with contextlib.suppress(OSError):
            if time.time() - mutex.stat().st_mtime > TAKEOVER_ABANDONED_S:
                mutex.unlink()
        return False
    try:
        current = read_holder(path)
        if current is not None and current.token != stale.token:
            return False  # someone took it over meanwhile: look at it again
        path.unlink(missing_ok=True)
        return True
    finally:
        mutex.unlink(missing_ok=True)


_held: dict[str, "RunLock"] = {}


def _key(run_dir: Path) -> str:
    return os.path.realpath(run_dir)


def held(run_dir: Path) -> "RunLock | None":
    """The lock on `run_dir` if this process holds it."""
    return _held.get(_key(run_dir))


def release_all() -> None:
    """Every lock this process still holds: at exit, whatever way the run ended (train.py also
    releases its locks itself, in `finally`, as each run or job ends)."""
    for lock in list(_held.values()):
        lock.release()


atexit.register(release_all)


class RunLock:
    """The lock on one run dir, held by this process until release()."""

    def __init__(self, run_dir: Path, me: Holder, took_over: str | None, created_dir: bool,
                 heartbeat_s: float) -> None:
        self.run_dir = run_dir
        self.path = run_dir / LOCK_NAME
        self.me = me
        self.took_over = took_over  # the warning to log: whose stale lock this run took over
        self.created_dir = created_dir
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, args=(heartbeat_s,), daemon=True,
                                      name=f"run-lock-heartbeat {run_dir.name}")
        self._beat.start()

    @classmethod
    def acquire(cls, run_dir: Path, env: Mapping[str, str] = os.environ, heartbeat_s: float = HEARTBEAT_S,
                stale_after_s: float = STALE_AFTER_S) -> "RunLock":
        """Take the lock on `run_dir` (made if missing), or raise RunLocked naming its live holder.
        A refused run writes nothing: it looks at the lock before it makes any file."""
        run_dir = Path(run_dir)
        path = run_dir / LOCK_NAME
        me = this_process(env)
        took_over = None
        deadline = time.monotonic() + TAKEOVER_WAIT_S
        while True:
            holder = read_holder(path)
            if holder is not None:
                reason = stale_reason(holder, me, stale_after_s=stale_after_s)
                if reason is None:
                    raise RunLocked(refusal(run_dir, holder, me))
                if not _remove_stale(path, holder):
                    if time.monotonic() > deadline:
                        raise RunLocked(f"run dir {run_dir}: another run has been taking over the stale lock "
                                        f"{path} for {TAKEOVER_WAIT_S:.0f} s; if no run is using the dir, remove "
                                        f"{path.with_name(TAKEOVER_NAME)}")
                    time.sleep(0.05)
                    continue
                took_over = f"took over the stale lock of run dir {run_dir} ({holder.describe()}): {reason}"
            created_dir = not run_dir.is_dir()
            run_dir.mkdir(parents=True, exist_ok=True)
            try:
                if _create(path, me):
                    break
            except FileNotFoundError:
                continue  # the dir went (an unused dir another run cleaned up): make it again
            # Another run created it since we looked: look again (it is live, or we say why not).
        lock = cls(run_dir, me, took_over, created_dir, heartbeat_s)
        _held[_key(run_dir)] = lock
        return lock

    def _heartbeat(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                current = read_holder(self.path)
                if current is None or current.token != self.me.token:
                    # Judged stale (stalled past STALE_AFTER_S, seen from another host) and taken over.
                    log.error("lost the lock of run dir %s to %s: another run may now write into this dir",
                              self.run_dir, current.describe() if current else "nobody")
                    return
                self.me = replace(self.me, heartbeat=_iso_now())
                os.replace(_write_temp(self.path, self.me), self.path)
            except OSError as err:
                log.warning("could not refresh the lock of run dir %s: %s", self.run_dir, err)

    def release(self) -> None:
        """Remove the lock, if it is still ours. A forked child (a data worker) never removes
        its parent's lock."""
        if _held.get(_key(self.run_dir)) is not self or os.getpid() != self.me.pid:
            return
        del _held[_key(self.run_dir)]
        self._stop.set()
        self._beat.join(timeout=5)  # a beat after the removal would make the lock again
        current = read_holder(self.path)
        if current is not None and current.token == self.me.token:
            self.path.unlink(missing_ok=True)
        if self.created_dir:
            with contextlib.suppress(OSError):
                self.run_dir.rmdir()  # only if empty: a dir made for a run that never wrote to it


def claim(run_dir: Path, env: Mapping[str, str] = os.environ) -> RunLock | None:
    """Rank 0 (or a single process) takes the lock; the other ranks of a launch look at it and
    raise RunLocked only when another launch's run holds it. They never write: rank 0 may not
    have taken it yet, and if rank 0 is refused it stops the launch."""
    if env.get("RANK", env.get("SLURM_PROCID", "0")) == "0":
        return RunLock.acquire(run_dir, env)
    holder = read_holder(Path(run_dir) / LOCK_NAME)
    if holder is None:
        return None
    me = this_process(env)
    if me.launch is not None and holder.launch == me.launch:
        return None  # our own rank 0's lock (or its earlier attempt's, which it takes over)
    if stale_reason(holder, me) is not None:
        return None  # rank 0 takes it over
    raise RunLocked(refusal(Path(run_dir), holder, me))


def planned_run_dir(argv: list[str], config_dir: str) -> tuple[Path, list[str]] | None:
    """The run dir Hydra is about to make for this command line, and the overrides that hold
    Hydra to it, composed before Hydra runs: Hydra writes .hydra/ and the job log into the dir
    before train.py's main() starts, so a refused run must be stopped before then.

    A dir stamped by the clock (${now:...}) could get another second when Hydra composes it
    again: it is pinned with a hydra.run.dir override. None where this cannot be judged (a
    multirun, --help or --cfg, another config, a command line Hydra will refuse): main() takes
    the lock then, once Hydra has named the dir.
    """
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    from trainer.run.preflight import compose, read_command_line

    line = read_command_line(argv)
    if line is None or line.multirun or not line.plain:
        return None
    try:
        cfg = compose(line.overrides, config_dir, hydra_node=True)
        if OmegaConf.select(cfg, "hydra.mode") == RunMode.MULTIRUN:
            return None
        expression = str(OmegaConf.to_container(cfg.hydra.run, resolve=False)["dir"])
        run_dir = str(cfg.hydra.run.dir)
    except Exception:
        return None
    pin = []
    if "now:" in expression and not any(c in run_dir for c in "'\\$"):
        pin = [f"hydra.run.dir='{run_dir}'"]
    return Path(os.path.abspath(run_dir)), pin
