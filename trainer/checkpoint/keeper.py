"""What a run knows of its own checkpoints while it trains: which one is good to go back to,
which ones are suspect, and whether the next one fits on the disk.

trainer/checkpoint/store.py writes and finds checkpoints; this module decides, step by step, what
each one is worth:
- good (`last_good`): an eval on its weights was finite, or the step after it trained finite;
- suspect (checkpoints/suspect.json): saved after a non-finite step and before a finite eval,
  followed by a non-finite step, or left unconfirmed when the run stopped on a divergence.
  Its weights are finite, but their forward pass may not be; resume=auto, export and sampling
  pass it over;
- neither yet: the newest checkpoint, until the next step or eval tells. A preempted run
  resumes from it.
"""
from __future__ import annotations

import errno
import logging
import shutil
from pathlib import Path
from typing import Optional

from torch.distributed.checkpoint.api import CheckpointException

from trainer.checkpoint import files as checkpoint_files

from trainer.checkpoint import store as checkpoint
from trainer.checkpoint.files import CheckpointError
from trainer.checkpoint.state import state_bytes
from trainer.skips import SkipReport
from parallel.mesh import new_host_group

log = logging.getLogger("checkpoint")

MB = 1 << 20


class DiskFull(CheckpointError):
    """A checkpoint did not fit on its disk: the run stops (exit 2) with nothing lost."""


def _errnos(err: BaseException) -> set[int]:
    """The errno of every OSError in an exception's chain, including the failures that
    torch.distributed.checkpoint gathers from the ranks."""
    found, todo, seen = set(), [err], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            found.add(e.errno)
        if isinstance(e, CheckpointException):
            todo += [wrapped[0] for wrapped in e.failures.values()]
        todo += [e.__cause__, e.__context__]
    return found


def free_bytes(directory: Path) -> int:
    """Free bytes on the file system that holds `directory` (or its nearest existing parent)."""
    while not directory.exists():
        directory = directory.parent
    return shutil.disk_usage(directory).free


def _size_on_disk(path: Optional[Path]) -> int:
    if path is None or not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class CheckpointKeeper:
    """The trainer's checkpoints: saving them, and recording what each one is worth."""

    def __init__(self, trainer, directory: Path, writes: bool = True) -> None:
        self.trainer = trainer
        self.directory = directory
        self.mesh = trainer.mesh
        # False: a run that writes no checkpoint (a simulation, trainer/simulation/one_rank.py): saving it
        # is the caller's to skip, and there is no disk space to warn about.
        self.writes = writes
        # The step of the newest checkpoint not yet known to be good: its weights are good once
        # the step after it trains finite (see `note_skips`).
        self.unconfirmed: Optional[int] = None
        # The first non-finite step not yet followed by a finite eval: checkpoints saved
        # meanwhile are suspect however the steps after them go.
        self.skipped_since_eval: Optional[int] = None
        # A checkpoint still being written (checkpoint.async_save), and the gloo group its
        # background collectives use.
        self.pending: Optional[checkpoint.PendingSave] = None
        self._async_group = None

    # ---- what each checkpoint is worth ----

    def resumed_from(self, path: Path, suspect: bool) -> None:
        """The run continues from `path`: a checkpoint of this run dir is confirmed by the next
        step like a fresh one; a suspect one (checkpoint.allow_suspect) keeps what comes after
        it suspect until an eval is finite."""
        if path.parent == self.directory:
            self.unconfirmed = self.trainer.step
            self._abandon_newer_than(self.trainer.step)
        if suspect:
            self.skipped_since_eval = self.trainer.step

    def _abandon_newer_than(self, step: int) -> None:
        """Set aside the checkpoints of this dir newer than the one the run resumed from (rank 0)."""
        if not self.mesh.is_main:
            return
        newer = [p for p in checkpoint_files.checkpoints_in(self.directory) if checkpoint_files.step_of(p) > step]
        for path in newer:
            checkpoint_files.set_aside(path, checkpoint_files.ABANDONED_SUFFIX)
        if newer:
            log.warning("resumed from step %d: the newer checkpoints %s are kept as *%s", step,
                        ", ".join(p.name for p in newer), checkpoint_files.ABANDONED_SUFFIX)

    def note_skips(self, report: SkipReport) -> None:
        """The host has read the device's skipped steps through `report.through`: confirm or
        refute the newest checkpoint, and remember the first skip until an eval is finite.
        (A save collects the counts, so a report starts at most one step after a checkpoint.)"""
        saved = self.unconfirmed
        if saved is not None and report.through > saved:
            self.unconfirmed = None
            if report.skipped and report.first == saved + 1:
                self._mark_suspect(saved, f"step {saved + 1}, the step after it, was non-finite")
            elif self.mesh.is_main:
                checkpoint_files.mark_good(self.directory, saved)
        if report.skipped and self.skipped_since_eval is None:
            self.skipped_since_eval = report.first

    def eval_was_finite(self) -> None:
        self.skipped_since_eval = None

    def diverged(self, step: int) -> None:
        """The run stops on a divergence at `step`: no checkpoint it left unconfirmed is trusted
        (rank 0 records them; every rank calls, after `commit`)."""
        if not self.mesh.is_main or not self.directory.exists():
            return
        good = checkpoint_files.last_good(self.directory)
        floor = checkpoint_files.step_of(good) if good is not None else -1
        listed = checkpoint_files.suspects(self.directory)
        for path in checkpoint_files.checkpoints_in(self.directory):
            if checkpoint_files.step_of(path) > floor and path.name not in listed:
                checkpoint_files.set_suspect(self.directory, path.name,
                                             f"not confirmed good before the run diverged at step {step}")

    def _mark_suspect(self, step: int, reason: str) -> None:
        if self.mesh.is_main:
            checkpoint_files.set_suspect(self.directory, checkpoint_files.checkpoint_path(self.directory, step).name,
                                         reason)

    def last_good_line(self) -> str:
        """The stop message's pointer back to the checkpoint to resume from."""
        good = checkpoint_files.last_good(self.directory)
        if good is not None:
            return f"Last good checkpoint: {good}."
        saved = checkpoint_files.checkpoints_in(self.directory) if self.directory.exists() else []
        if not saved:
            return f"No checkpoint was written in {self.directory}."
        return (f"No checkpoint in {self.directory} is known good ({', '.join(p.name for p in saved)} "
                "may not be: see suspect.json; checkpoint.allow_suspect=true resumes from one anyway).")

    # ---- saving ----

    def saving_words(self) -> str:
        """What stopping now involves, for the preemption message."""
        return "saving a checkpoint" if self.writes else "no checkpoint to save (a simulation)"

    def save(self, evaluated: bool, final: bool) -> None:
        """Save the current step. `evaluated`: an eval on these very weights just gave finite
        losses, so the checkpoint is good now rather than after the next step. `final`:
        nothing follows (the end of the run, a preemption), so it is written at once even
        under checkpoint.async_save. The caller has checked the state is finite."""
        if not self.writes:
            raise RuntimeError("this run writes no checkpoint (a simulation): the trainer must not save one")
        trainer, cfg = self.trainer, self.trainer.cfg.checkpoint
        self.commit()
        background = cfg.async_save and not final
        if background and self._async_group is None and self.mesh.world_size > 1:
            self._async_group = new_host_group("async_checkpoint")
        suspect = None
        if self.skipped_since_eval is not None:
            suspect = f"saved after step {self.skipped_since_eval} was non-finite, before any finite eval"
        step = trainer.step
        try:
            self.pending = checkpoint.save(
                trainer, self.directory, cfg.keep, trainer.resolved_config(), good=evaluated,
                background=background, async_group=self._async_group, suspect=suspect,
            )
        except (Exception, CheckpointException) as err:
            self._raise_if_disk_full(err, checkpoint_files.checkpoint_path(self.directory, step))
            raise
        if not background:
            self.commit()
        self.unconfirmed = None if evaluated or suspect else step

    def commit(self) -> None:
        """Finish the checkpoint being written, if any (see checkpoint.commit_pending), then
        warn when the next one will not fit."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        try:
            checkpoint.commit_pending(pending, self.mesh)
        except (Exception, CheckpointException) as err:
            self._raise_if_disk_full(err, pending.final)
            raise
        self.warn_if_next_save_will_not_fit()

    def close(self) -> None:
        import torch.distributed as dist

        if self._async_group is not None:
            dist.destroy_process_group(self._async_group)  # the next job of a sweep makes its own
            self._async_group = None

    # ---- disk space ----

    def bytes_needed(self) -> int:
        """What the next checkpoint will take: the newest one on disk, or the state's bytes
        before the first (DCP's files add a little metadata to them)."""
        newest = next(iter(checkpoint_files.checkpoints_in(self.directory)), None) if self.directory.exists() else None
        return max(state_bytes(self.trainer), _size_on_disk(newest))

    def warn_if_next_save_will_not_fit(self) -> None:
        """One line when the free space is short of the next checkpoint (rank 0). Rotation frees
        the oldest only after the new one is in place, so it does not count."""
        if not self.mesh.is_main or not self.writes:
            return
        needed, free = self.bytes_needed(), free_bytes(self.directory)
        if free < needed:
            log.warning("the next checkpoint needs about %.1f MB but %s has %.1f MB free: it will fail "
                        "(free some space, or lower checkpoint.keep)", needed / MB, self.directory, free / MB)

    def _raise_if_disk_full(self, err: BaseException, final: Path) -> None:
        """A save that failed for want of space ends in one line, with its partial files
        removed; any other failure is left to propagate."""
        partial = final.with_name(f".{final.name}.partial")
        needed = self.bytes_needed()
        if self.mesh.is_main:
            shutil.rmtree(partial, ignore_errors=True)
        free = free_bytes(self.directory)
        if not (_errnos(err) & {errno.ENOSPC, errno.EDQUOT}) and free >= needed:
            return
        raise DiskFull(
            f"{self.directory}: no space for checkpoint {final.name}: it needs about {needed} bytes and "
            f"{free} are free (the partial files were removed). {self.last_good_line()}"
        ) from err
