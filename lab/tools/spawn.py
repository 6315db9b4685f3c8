"""Run a benchmark's function on N fresh gloo processes, laid out as torchrun would lay them.

The benchmarks' own launcher, kept apart from the test suite's (tests/distributed.py pools its
processes across hundreds of calls and checks for leaks; a benchmark starts once and measures).
"""
from __future__ import annotations

import os
import queue
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parallel.mesh import destroy_mesh

# How long the other ranks may take to finish once one has failed.
FAILED_GRACE_S = 30.0


def _rank_main(rank: int, world_size: int, rendezvous: str, fn: Callable, args: tuple, answers) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # world_size processes share the machine's cores
    try:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
        try:
            result = ("ok", fn(rank, world_size, *args))
        finally:
            destroy_mesh()  # the mesh's groups, and the default group with them
            if dist.is_initialized():
                dist.destroy_process_group()
    except BaseException:
        result = ("error", traceback.format_exc())
    answers.put((rank, result))


def run_ranks(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    """fn(rank, world_size, *args) on world_size new processes; returns the per-rank results.
    `fn` must be importable (module level), its arguments and results picklable."""
    context = mp.get_context("spawn")
    answers = context.Queue()
    with tempfile.TemporaryDirectory() as scratch:
        rendezvous = str(Path(scratch) / "rendezvous")
        processes = [context.Process(target=_rank_main, args=(rank, world_size, rendezvous, fn, args, answers))
                     for rank in range(world_size)]
        for process in processes:
            process.start()
        results: dict[int, tuple[str, Any]] = {}
        failed_at = None
        while len(results) < world_size:
            try:
                rank, result = answers.get(timeout=5.0)
                results[rank] = result
                if result[0] != "ok" and failed_at is None:
                    failed_at = time.monotonic()
                continue
            except queue.Empty:
                pass
            # A rank that died without answering (killed, or crashed in C++) never will, and the
            # peers of a failed rank may wait in a collective it never joins.
            dead = [r for r, p in enumerate(processes) if not p.is_alive() and r not in results]
            if (dead and answers.empty()) or (failed_at is not None and time.monotonic() - failed_at > FAILED_GRACE_S):
                for process in processes:
                    process.kill()
                for r in range(world_size):
                    results.setdefault(r, ("error", "no result (killed after another rank failed or exited)"))
        for process in processes:
            process.join()
    failed = [f"rank {rank} failed:\n{value}" for rank, (status, value) in sorted(results.items()) if status != "ok"]
    if failed:
        raise RuntimeError("\n".join(failed))
    return [results[rank][1] for rank in range(world_size)]
