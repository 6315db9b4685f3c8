"""Run a function in N spawned processes on gloo, the way torchrun would lay them out."""
from __future__ import annotations

import gc
import os
import pickle
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
# Imported before any group exists: its functions' `group=group.WORLD` defaults are evaluated
# at import, and imported after init_process_group (trainer.checkpoint pulls it in through
# torch.distributed.checkpoint) they would hold the default group past destroy_process_group.
import torch.distributed.nn.functional  # noqa: F401

from parallel.mesh import destroy_mesh

# gloo's threads: a device's socket loop and a group's workers. They end when their process
# group is freed; see _leftover_gloo_threads.
GLOO_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop")


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


def _worker(rank: int, world_size: int, rendezvous: str, out_dir: str, fn: Callable, args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # world_size processes share 2 cores
    # A file store in this call's own directory: no port to pick, so concurrent runs (pytest -n,
    # another checkout's tests) cannot meet in one rendezvous or race for a port.
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    try:
        result: Any = fn(rank, world_size, *args)
        payload = ("ok", result)
    except BaseException:  # report any failure to the parent with its traceback
        payload = ("error", traceback.format_exc())
    finally:
        # Groups fn built and dropped in reference cycles go now, with the interpreter whole,
        # and so do those that DTensor's caches hold (after FSDP2).
        gc.collect()
        destroy_mesh()
    leftover = _leftover_gloo_threads()
    if leftover and payload[0] == "ok":
        payload = ("error", f"a process group outlived destroy_process_group (gloo threads still running: "
                            f"{', '.join(leftover)}): something still references it, e.g. a module first "
                            "imported after init_process_group whose defaults captured group.WORLD")
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(payload, f)
    if leftover:
        # Skip the interpreter shutdown those threads can abort in, so that the parent reports
        # the leak above rather than a signal.
        os._exit(0)


def run_distributed(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    """fn(rank, world_size, *args) on every rank; returns the per-rank results.

    `fn` must be importable (module level) and its results picklable (CPU tensors are).
    """
    with tempfile.TemporaryDirectory() as out_dir:
        rendezvous = str(Path(out_dir) / "rendezvous")
        mp.start_processes(_worker, args=(world_size, rendezvous, out_dir, fn, args),
                           nprocs=world_size, join=True, start_method="spawn")
        results = []
        for rank in range(world_size):
            with open(Path(out_dir) / f"rank{rank}.pkl", "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results.append(value)
    return results
