"""Preemption: SIGTERM / SIGINT during training become a checkpoint at the next step boundary."""
from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

from parallel.comm import all_reduce, world
from parallel.mesh import Mesh
from trainer.interrupts import exit_if_interrupted_during_start_up

PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM, what a scheduler expects of a job it terminated


class PreemptionFlag:
    """Turns SIGTERM / SIGINT into a flag checked between steps, so a preempted job saves a
    checkpoint at a step boundary instead of dying mid-step. Ranks agree on it with one
    tiny all-reduce per step, since a signal may reach them at different steps."""

    def __init__(self, device: torch.device = torch.device("cpu")) -> None:
        self.flag = False
        # Without a host group the flag travels on the training device: NCCL only reduces
        # CUDA tensors.
        self.device = device
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            exit_if_interrupted_during_start_up()
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.flag = True

    def raised(self, mesh: Mesh) -> bool:
        if mesh.world_size == 1:
            return self.flag
        # Over the host group where there is one: reading a flag reduced on the GPU would make
        # the host wait for the device's queue to drain, every step.
        group, device = (world(), self.device) if mesh.host_group is None else (mesh.host_group, torch.device("cpu"))
        flag = torch.tensor([float(self.flag)], device=device)
        all_reduce(flag, group, op=dist.ReduceOp.MAX, label="preemption")
        return bool(flag.item())

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
