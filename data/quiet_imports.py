"""Start-up noise of the optional libraries, held back in one place: every entry point that may
import torchao (train.py's path through model/fp8.py, and scripts/export_hf.py and
scripts/generate.py, whose transformers models import it) calls `quiet_library_noise` first.

What is held back, and why it is noise rather than news:
- torchao's "Failed to load .../torchao/_C_*.so" warnings, one per CUDA kernel library, and its
  "Detected no triton" warning, when torch is a CPU build: those kernels cannot run without
  CUDA, and nothing here asks for them;
- torch's "<enum ...> is an Enum subclass and is now natively supported by torch.compile ...
  Calling register_constant() on Enum subclasses is deprecated" warnings, one per enum torchao
  registers the old way: a note to torchao's authors.
Only these lines: every other warning of these loggers still shows.

Imports nothing of the project, nor torch (whose build it reads once torch is loaded), so that
any package may call it.
"""
from __future__ import annotations

import logging
import re
import sys

# What each logger says that is noise (matched against the formatted message), and whether it
# is noise only on a CPU build of torch: a CUDA build that cannot load its CUDA kernels, or finds
# no triton, has something to say.
NOISE = {
    "torchao": (re.compile(r"^Failed to load \S*torchao/_C\S*\.so\b"), True),
    "torchao.kernel.intmm": (re.compile(r"Detected no triton"), True),
    "torch.utils._pytree": (re.compile(r"is an Enum subclass and is now natively supported by torch\.compile"), False),
}


class _DropNoise(logging.Filter):
    def __init__(self, logger: str) -> None:
        super().__init__()
        self.pattern, self.cpu_only = NOISE[logger]

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.pattern.search(record.getMessage()):
            return True
        torch = sys.modules.get("torch")
        return self.cpu_only and torch is not None and torch.version.cuda is not None


def quiet_library_noise() -> None:
    """Drop the lines above from here on (idempotent): a filter on each logger that says them, so
    that the imports which log them are quiet wherever they happen, inside transformers included."""
    for name in NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) for f in logger.filters):
            logger.addFilter(_DropNoise(name))
