"""Run a function in N processes on gloo, the way torchrun would lay them out.

The processes are kept between calls, one set per world size, for the whole pytest run:
starting a process and importing torch and the project costs seconds per rank, several times
the work of most distributed tests, and the suite makes hundreds of such calls. A set's
processes fork from a server that has imported both once (multiprocessing's fork server;
spawned where there is none). What a call
sees is still what a fresh launch would give it: a new default process group over a new file
store, the environment, thread count and default seed of a fresh rank, and no process group,
compiled graph or DTensor cache left by the call before. A call that leaks a process group, or
whose rank dies, takes its set of processes down with it; the next call starts a fresh one.
"""
from __future__ import annotations

import atexit
import gc
import os
import pickle
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
# Imported before any group exists: its functions' `group=group.WORLD` defaults are evaluated
# at import, and imported after init_process_group (trainer.checkpoint.store pulls it in through
# torch.distributed.checkpoint) they would hold the default group past destroy_process_group.
import torch.distributed.nn.functional  # noqa: F401

from parallel.mesh import destroy_mesh
from tests import closeness

# gloo's threads: a device's socket loop and a group's workers. They end when their process
# group is freed; see _leftover_gloo_threads.
GLOO_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop")
# The longest one call may take before its processes are killed: a rank stuck in a collective
# that its peers never join would otherwise hang the suite.
CALL_TIMEOUT_S = 900.0


def _leftover_gloo_threads() -> list[str]:
    """Names of this process's gloo threads still running ([] where /proc is absent).

    After destroy_process_group every group should be gone. One that something still
    references keeps its worker threads until interpreter shutdown, and a worker that only
    then drops a finished collective's tensors must take the GIL to free them: Python ends
    that thread (pthread_exit) inside a noexcept destructor and the process dies of SIGABRT,
    "terminate called without an active exception". That happens only when the thread runs
    late (a busy machine), so the harness fails on the leaked group itself, every time.
    """
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return []
    names = []
    for task in tasks.iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # the thread ended while we looked
            continue
    return sorted(n for n in names if n in GLOO_THREADS)


# How long a freed group's threads may take to end. A gloo worker can still hold a finished
# collective's work (and through it the group's device) for a moment after
# destroy_process_group returns; on a loaded machine that moment once outlasted an immediate
# look (CI: gloo_tcp_loop seen right after a call that leaked nothing). A group something
# still references keeps its threads for good, so the check still catches every real leak.
SETTLE_S = 5.0


def _settled_gloo_threads() -> list[str]:
    """The gloo threads still running once freed groups have had SETTLE_S to end theirs.
    Polled often, collecting garbage now and then: freed groups' threads end within
    milliseconds, and a collection costs more than that."""
    deadline = time.monotonic() + SETTLE_S
    polls = 0
    while True:
        leftover = _leftover_gloo_threads()
        if not leftover or time.monotonic() > deadline:
            return leftover
        polls += 1
        if polls % 20 == 0:
            gc.collect()
        time.sleep(0.005)


def _run_call(rank: int, world_size: int, rendezvous: str, fn: Callable, args: tuple) -> tuple[str, Any]:
    """One call on this rank, between a fresh default group and its destruction."""
    # A file store in this call's own directory: no port to pick, so concurrent runs (pytest -n,
    # another checkout's tests) cannot meet in one rendezvous or race for a port; and a new
    # store per call, so group names restarting at 0 never meet the last call's keys.
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    closeness.take()  # comparisons a failed call left unreported
    try:
        # The call's numeric comparisons go back with its result, to be recorded for its test.
        payload: tuple[str, Any] = ("ok", (fn(rank, world_size, *args), closeness.take()))
    except BaseException:  # report any failure to the parent with its traceback
        payload = ("error", traceback.format_exc())
    else:
        # No rank frees its groups before every rank has them whole. Gloo connects a group pair
        # by pair, and a rank whose side of a pair is done returns from new_group while its
        # peer may still be connecting: freed then, the peer's connect fails ("Connection
        # closed by peer") and it hangs in its retries until the call's timeout (CI: a group
        # made as fn returned). A rank whose fn failed skips this and frees its groups at once,
        # which ends the others' barrier: its traceback is the call's answer.
        try:
            dist.barrier()
        except Exception:
            pass
    finally:
        # Groups fn built and dropped in reference cycles go now, with the interpreter whole,
        # and so do those that DTensor's caches hold (after FSDP2).
        gc.collect()
        destroy_mesh()
    if "torch._dynamo" in sys.modules:  # the next call compiles its own functions
        torch._dynamo.reset()
    return payload


def _serve(rank: int, world_size: int, conn: Connection, env: dict[str, str]) -> None:
    """A rank's loop: (rendezvous, fn, args) in, ("ok", result) or ("error", traceback) out.
    `env`: the test process's environment as the ranks start, which a spawned process would
    have inherited."""
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    fresh_env = dict(os.environ)
    fresh_seed = torch.initial_seed()  # a fresh process's default generator seed
    while True:
        message = conn.recv_bytes()
        if not message:
            return
        rendezvous, fn, args = pickle.loads(message)
        os.environ.clear()
        os.environ.update(fresh_env)
        torch.set_num_threads(1)  # world_size processes share 2 cores
        torch.manual_seed(fresh_seed)
        payload = _run_call(rank, world_size, rendezvous, fn, args)
        leftover = _settled_gloo_threads()
        if leftover and payload[0] == "ok":
            payload = ("error", f"a process group outlived destroy_process_group (gloo threads still running: "
                                f"{', '.join(leftover)}): something still references it, e.g. a module first "
                                "imported after init_process_group whose defaults captured group.WORLD")
        conn.send_bytes(pickle.dumps(payload))
        # What survived the call (imports, caches) is set aside from later collections, which
        # then scan only what the next call allocates: a full collection of a process that has
        # imported torch takes a tenth of a second or more, and every call collects.
        gc.freeze()
        if leftover:
            # Skip the interpreter shutdown those threads can abort in: the parent reports the
            # leak above and starts fresh processes for the next call.
            os._exit(0)


# What a rank imports before its first call, once, in the server its processes fork from: a
# spawned rank spent seconds importing torch and the trainer, each time a set of ranks started.
RANK_PRELOAD = ["tests.distributed", "trainer.loop"]
REPO = Path(__file__).resolve().parents[1]


def start_fork_server() -> None:
    """Start the fork server the ranks come from (its imports run beside whatever runs next)."""
    _rank_context()


def _rank_context():
    """Processes forked from multiprocessing's fork server, which has imported RANK_PRELOAD (and
    run no OpenMP thread, so forking it is safe), where the platform has one; spawned elsewhere."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    from multiprocessing import forkserver

    context = mp.get_context("forkserver")
    context.set_forkserver_preload(RANK_PRELOAD)
    # The fork server imports its preload with the environment's path: the repository's
    # packages must be on it. Set for its start alone; it is started once.
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), path) if p)
    try:
        forkserver.ensure_running()
    finally:
        if path is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = path
    return context


@dataclass
class _Ranks:
    """One set of serving processes for one world size."""
    world_size: int
    processes: list = field(default_factory=list)
    connections: list[Connection] = field(default_factory=list)
    scratch: tempfile.TemporaryDirectory = field(default_factory=tempfile.TemporaryDirectory)
    calls: int = 0

    @classmethod
    def start(cls, world_size: int) -> "_Ranks":
        ranks = cls(world_size)
        context = _rank_context()
        for rank in range(world_size):
            parent_end, child_end = context.Pipe()
            process = context.Process(target=_serve, args=(rank, world_size, child_end, dict(os.environ)), daemon=True)
            process.start()
            child_end.close()
            ranks.processes.append(process)
            ranks.connections.append(parent_end)
        return ranks

    def call(self, fn: Callable, args: tuple) -> list[tuple[str, Any]]:
        self.calls += 1
        rendezvous = str(Path(self.scratch.name) / f"rendezvous{self.calls}")
        message = pickle.dumps((rendezvous, fn, args))
        for conn in self.connections:
            conn.send_bytes(message)
        deadline = time.monotonic() + CALL_TIMEOUT_S
        return [self._answer(rank, conn, deadline) for rank, conn in enumerate(self.connections)]

    def _answer(self, rank: int, conn: Connection, deadline: float) -> tuple[str, Any]:
        process = self.processes[rank]
        while not conn.poll(0.2):
            if not process.is_alive() and not conn.poll(0):
                raise RankDied(f"rank {rank} died (exit code {process.exitcode}) before answering")
            if time.monotonic() > deadline:
                raise RankDied(f"rank {rank} gave no answer in {CALL_TIMEOUT_S:.0f} s")
        try:
            return pickle.loads(conn.recv_bytes())
        except EOFError:
            raise RankDied(f"rank {rank} died (exit code {process.exitcode}) while answering") from None

    def healthy(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    def stop(self) -> None:
        for conn in self.connections:
            try:
                conn.send_bytes(b"")
            except OSError:
                pass
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        for conn in self.connections:
            conn.close()
        self.scratch.cleanup()


class RankDied(RuntimeError):
    """A serving rank ended or hung during a call."""


_RANKS: dict[int, _Ranks] = {}


@atexit.register
def _stop_all() -> None:
    while _RANKS:
        _RANKS.popitem()[1].stop()


def run_distributed(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    """fn(rank, world_size, *args) on every rank; returns the per-rank results.

    `fn` must be importable (module level), and its arguments and results picklable (CPU
    tensors are). fn may change module state in the rank's process for its own use, but must
    undo it: the process serves later calls (environment, seed and thread count are reset).
    """
    ranks = _RANKS.get(world_size)
    if ranks is None or not ranks.healthy():
        if ranks is not None:
            ranks.stop()
        ranks = _RANKS[world_size] = _Ranks.start(world_size)
    try:
        answers = ranks.call(fn, args)
    except BaseException:  # a dead or hung rank, or an interrupt: these processes are done
        _RANKS.pop(world_size).stop()
        raise
    if any(status != "ok" for status, _ in answers):
        # A failed call may leave its processes in any state (a leaked process group ends its
        # rank after answering): the next call gets fresh ones.
        _RANKS.pop(world_size).stop()
    results = []
    for rank, (status, value) in enumerate(answers):
        if status != "ok":
            raise AssertionError(f"rank {rank} failed:\n{value}")
        result, comparisons = value
        closeness.adopt(comparisons)
        results.append(result)
    return results
