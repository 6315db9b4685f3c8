"""Atomic file writes, so concurrent readers (data-parallel ranks) never see partial files."""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Iterator


@contextlib.contextmanager
def atomic_output(path: Path) -> Iterator[BinaryIO]:
    """A binary file that appears at `path` complete, or not at all.

    The data goes to a unique temp file in the same directory (same filesystem, so the
    final os.replace is atomic) and is fsynced before the rename (so a crash cannot leave
    a renamed but still empty file). Concurrent writers each use their own temp file and
    the last rename wins, which is harmless when they write the same content.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp creates the file private (0600); caches are shared like ordinary files.
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
