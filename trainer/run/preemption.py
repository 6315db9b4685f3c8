"""Preemption: SIGTERM / SIGINT during training become a checkpoint at the next step boundary,
then the exit code a shell or scheduler expects of that signal: 128 + its number."""
from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

from parallel.comm import all_reduce, world
from parallel.mesh import Mesh
from trainer.run.interrupts import exit_if_interrupted_during_start_up


class Preempted(SystemExit):
    """The run stopped on SIGTERM (code 143, what a scheduler expects of a job it terminated)
    or SIGINT (130, what a shell expects of Ctrl-C) once the checkpoint of the step it stopped
    at was saved: it can be resumed from there. A Ctrl-C during start-up is a plain
    SystemExit(130) (trainer/run/interrupts.py): nothing was saved."""


class PreemptionFlag:
    """Turns SIGTERM / SIGINT into a flag checked between steps, so a preempted job saves a
    checkpoint at a step boundary instead of dying mid-step. Ranks agree on it with one
    tiny all-reduce per step, since a signal may reach them at different steps. The flag is
    the signal's number (0: none), so the ranks also agree on the exit code: SIGTERM's where
    some rank got SIGTERM (the scheduler's word outranks a Ctrl-C), else SIGINT's."""

    def __init__(self, device: torch.device = torch.device("cpu")) -> None:
        self.flag = 0
        # Without a host group the flag travels on the training device: NCCL only reduces
        # CUDA tensors.
        self.device = device
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            exit_if_interrupted_during_start_up()
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.flag = max(self.flag, int(signum))  # SIGTERM (15) outranks SIGINT (2)

    def raised(self, mesh: Mesh) -> int:
        """The exit code to stop with (0: go on), the same on every rank."""
        signum = self.flag
        if mesh.world_size > 1:
            # Over the host group where there is one: reading a flag reduced on the GPU would
            # make the host wait for the device's queue to drain, every step.
            group, device = (world(), self.device) if mesh.host_group is None else (mesh.host_group, torch.device("cpu"))
            flag = torch.tensor([float(self.flag)], device=device)
            all_reduce(flag, group, op=dist.ReduceOp.MAX, label="preemption")
            signum = int(flag.item())
        return 128 + signum if signum else 0

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
