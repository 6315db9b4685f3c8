"""A checkpoint that does not fit on the disk stops the run in one line, with nothing lost: no
partial files left, the step's metrics row written, the last good checkpoint named."""
from __future__ import annotations

import errno
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.test_checkpoint import COMMON, make_trainer
from tests.test_faults import error_line
from trainer.checkpoint import files as checkpoint_files
from trainer.checkpoint.keeper import DiskFull


def logged_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_an_injected_enospc_at_the_write_stops_in_one_line_with_nothing_lost(tmp_path, monkeypatch):
    import torch.distributed.checkpoint.filesystem as dcp_files

    trainer = make_trainer(tmp_path, ["trainer.batch_size=2", "checkpoint.interval=2", "trainer.max_steps=4"])
    write_item = dcp_files._write_item

    def full_disk(transforms, stream, data, write_item_, storage_key, serialization_format):
        if ".step_00000004.partial" in str(getattr(stream, "name", "")):
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_item(transforms, stream, data, write_item_, storage_key, serialization_format)

    monkeypatch.setattr(dcp_files, "_write_item", full_disk)
    with pytest.raises(DiskFull) as caught:
        trainer.train()
    message = str(caught.value)
    directory = tmp_path / "checkpoints"
    assert message.startswith(f"{directory}: no space for checkpoint step_00000004: it needs about ")
    needed = int(message.split("needs about ")[1].split()[0])
    assert needed >= checkpoint_files.checkpoints_in(directory)[0].stat().st_size
    assert message.endswith(f"Last good checkpoint: {directory / 'step_00000002'}.")
    assert "\n" not in message
    assert not list(directory.glob(".*partial"))
    assert [p.name for p in checkpoint_files.checkpoints_in(directory)] == ["step_00000002"]
    assert (directory / "latest").read_text() == "step_00000002"
    assert logged_steps(tmp_path) == [1, 2, 3, 4]


def tmpfs_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-r", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                           capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not tmpfs_works(), reason="no user namespace to mount a small tmpfs in; "
                    "test_an_injected_enospc_at_the_write covers the same case")
def test_a_full_tmpfs_stops_the_run_with_exit_2_and_one_line(tmp_path):
    """A 4 MB tmpfs holds the first checkpoint of gpt_tiny (2.5 MB at TEST_VOCAB) but not the second. Before:
    a 107-line traceback ending in `inline_container.cc`, no word of space, a .partial dir left
    behind and the step's metrics row missing."""
    mount, copy = tmp_path / "mnt", tmp_path / "copy"
    mount.mkdir()
    train = " ".join([sys.executable, "train.py", f"hydra.run.dir={mount}/run", *COMMON,
                      "trainer.batch_size=2", "checkpoint.interval=2", "trainer.max_steps=4"])
    script = (f"mount -t tmpfs -o size=4m tmpfs {mount} && {train}; rc=$?; "
              f"cp -a {mount}/run {copy}; exit $rc")
    proc = subprocess.run(["unshare", "-r", "-m", "sh", "-c", script], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = error_line(proc)
    directory = mount / "run" / "checkpoints"
    assert line.startswith(f"error: {directory}: no space for checkpoint step_00000004: it needs about ")
    assert line.endswith(f"Last good checkpoint: {directory / 'step_00000002'}.")
    # The warning came a checkpoint early: after step 2's, the free space was short of a second.
    assert "the next checkpoint needs about" in proc.stdout
    assert not list((copy / "checkpoints").glob(".*partial"))
    assert [p.name for p in checkpoint_files.checkpoints_in(copy / "checkpoints")] == ["step_00000002"]
    assert logged_steps(copy) == [1, 2, 3, 4]
