"""torchrun, ending with our one line and the failed rank's own exit code.

    python scripts/torchrun.py --standalone --nproc_per_node=8 train.py model=gpt_124m parallel.tp=2

The same arguments as `torchrun`, which it runs. When a rank fails, torchrun prints its own
report (its log lines, its Python traceback, a summary whose Root Cause is that rank) and exits 1
whatever the rank said. This ends instead with the rank's one `error:` line, after torchrun's
report, and exits with the rank's code: 2 for bad input, 3 for divergence, 130 or 143 for
Ctrl-C or SIGTERM (docs/outputs.md). A rank that failed without our line (a crash, a kill) leaves
torchrun's report as the last word, and its exit code.

torchrun copies the failed rank's error file (train.py writes its line there: trainer/run/
launch.py) to its own, TORCHELASTIC_ERROR_FILE, which this sets and reads.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional


def root_cause(error_file: Path) -> tuple[Optional[str], Optional[int]]:
    """(the failed rank's line, its exit code) from torchrun's error file; None where absent."""
    try:
        record = json.loads(error_file.read_text())
    except (OSError, ValueError):
        return None, None
    message = record.get("message") if isinstance(record, dict) else None
    if not isinstance(message, dict):
        return None, None
    line = message.get("message")
    code = message.get("errorCode")
    return (line if isinstance(line, str) else None), (code if isinstance(code, int) else None)


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="torchrun-") as tmp:
        error_file = Path(tmp) / "error.json"
        env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file)}
        # Ctrl-C reaches torchrun and its ranks from the terminal; this only waits for their end.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        code = subprocess.run([sys.executable, "-m", "torch.distributed.run", *argv], env=env).returncode
        if code == 0:
            return 0
        line, rank_code = root_cause(error_file)
    if line is None or not line.startswith("error: "):
        return code
    print(line, file=sys.stderr)
    return rank_code or code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
