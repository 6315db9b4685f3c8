"""The fixture for tests whose fp32 matmuls must run in true fp32 on CUDA.

One definition for every test module that needs it: import `true_fp32_matmuls` into the
module and request it by name.
"""
from __future__ import annotations

from typing import Iterator

import pytest

from trainer.device import tf32_allowed


@pytest.fixture
def true_fp32_matmuls() -> Iterator[None]:
    """TF32 off for one test, then the flags as they were. A Trainer earlier in the same
    pytest process (an xdist worker runs many tests) leaves trainer.tf32's default, TF32 on,
    behind it, and TF32 rounds a matmul's fp32 inputs to 10 mantissa bits.

    Through trainer.device's allow_tf32 flags, as the Trainer sets them, not
    torch.set_float32_matmul_precision: after the Trainer's flags that reads "high", putting
    "high" back would also switch CPU oneDNN matmuls to TF32, and mixing the two APIs makes
    torch.get_float32_matmul_precision() raise. CPU matmuls are fp32 either way."""
    with tf32_allowed(False):
        yield
