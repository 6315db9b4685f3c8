"""A Hydra callback that writes down what train.py's main() returned, for a test to read: Hydra
hands the value to a sweeper and prints it nowhere.

    +hydra.callbacks.job_return._target_=tests.job_return.WriteReturn
    +hydra.callbacks.job_return.path=/some/file.json
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback


class WriteReturn(Callback):
    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_job_end(self, config: Any, job_return: JobReturn, **kwargs: Any) -> None:
        # _return_value: the return_value property re-raises a failed job's exception.
        value = job_return._return_value if job_return.status == JobStatus.COMPLETED else "failed"
        self.path.write_text(json.dumps(value))  # NaN is written as NaN, which json.loads reads back


def overrides(path: Path) -> list[str]:
    """The command-line overrides that make a train.py run write its return value to `path`."""
    return ["+hydra.callbacks.job_return._target_=tests.job_return.WriteReturn",
            f"+hydra.callbacks.job_return.path={path}"]


def read(path: Path) -> Any:
    return json.loads(path.read_text())
