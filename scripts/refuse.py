"""How a script refuses bad input: one line on stderr naming what is wrong, and exit code 2,
train.py's code for it, so that a wrapper tells a mistake in the command (2) from a crash (1)."""
from __future__ import annotations

import sys
from typing import NoReturn

BAD_INPUT = 2


def refuse(line: str) -> NoReturn:
    """Print `error: <line>` to stderr and exit with BAD_INPUT."""
    print(f"error: {line}", file=sys.stderr)
    sys.exit(BAD_INPUT)
