"""The CPU suite checks the same thing on any machine: a run that selects no gpu test hides the
GPUs from itself and from every process it starts (tests/conftest.py, pytest_configure)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import gpu_tests_excluded
from tests.distributed import run_distributed


@pytest.mark.parametrize("markexpr, excluded", [
    ("not slow and not gpu", True),  # make test
    ("slow and not gpu", True),  # make test-slow
    ("not gpu", True),
    ("not (gpu or slow)", True),
    ("gpu", False),  # make test-gpu
    ("", False),  # make test-all: no -m
    ("not slow", False),  # selects the gpu tests that are not slow
    ("slow or gpu", False),
    ("not (slow and gpu)", False),
    ("slow and not gpu or gpu and not slow", False),
])
def test_which_marker_expressions_select_no_gpu_test(markexpr, excluded):
    assert gpu_tests_excluded(markexpr) is excluded


def what_cuda_looks_like(*_) -> tuple:
    return os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.is_available(), torch.cuda.device_count()


PROBE = "import os, torch; print(repr((os.environ.get('CUDA_VISIBLE_DEVICES'), torch.cuda.is_available(), " \
        "torch.cuda.device_count())))"


def test_gpus_are_hidden_from_the_run_a_spawned_rank_and_a_subprocess(cuda_visibility):
    hidden, found = cuda_visibility
    here = what_cuda_looks_like()
    if hidden:
        assert here == ("", False, 0)
    else:  # make test-gpu or test-all: the machine's GPUs, as the run found them
        assert here[0] == found
    # Spawned gloo ranks and train.py / torchrun subprocesses inherit the environment.
    assert run_distributed(what_cuda_looks_like, 1) == [here]
    probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.strip() == repr(here)
