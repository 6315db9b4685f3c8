"""Run a function in N spawned processes on gloo, the way torchrun would lay them out."""
from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # world_size processes share 2 cores
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result: Any = fn(rank, world_size, *args)
        payload = ("ok", result)
    except BaseException:  # report any failure to the parent with its traceback
        payload = ("error", traceback.format_exc())
    finally:
        dist.destroy_process_group()
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(payload, f)


def run_distributed(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    """fn(rank, world_size, *args) on every rank; returns the per-rank results.

    `fn` must be importable (module level) and its results picklable (CPU tensors are).
    """
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(world_size, free_port(), out_dir, fn, args),
                           nprocs=world_size, join=True, start_method="spawn")
        results = []
        for rank in range(world_size):
            with open(Path(out_dir) / f"rank{rank}.pkl", "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results.append(value)
    return results
