"""Reading a run's environment record, <run_dir>/environment.json (trainer/run/environment.py writes
it): what compare_runs.py and the records put beside a run's numbers. No torch here:
comparisons read records without it."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

ENV_FILE = "environment.json"


def read_environment(run_dir: Path) -> Optional[dict[str, Any]]:
    """The run's record; None where it has none (a run from before the record existed)."""
    try:
        return json.loads((run_dir / ENV_FILE).read_text())
    except (OSError, ValueError):
        return None



def summary_line(env: dict[str, Any]) -> str:
    """One line naming what a reader of a comparison needs to know about a run's environment."""
    git = env.get("git") or {}
    commit = (git.get("commit") or "unknown")[:10] + (" (dirty)" if git.get("dirty") else "")
    layout = env.get("layout") or {}
    cuda = f", CUDA {env['cuda']}" if env.get("cuda") else ""
    return (f"commit {commit}; Python {env.get('python')}, torch {env.get('torch')}{cuda}; "
            f"{env.get('device')} x {env.get('world_size')} (dp {layout.get('dp')}, tp {layout.get('tp')}"
            + (f", FSDP2 over {layout['dp_shard']}" if layout.get("dp_shard", 1) > 1 else "")
            + (f", experts over ep {layout['ep']}" if layout.get("ep", 1) > 1 else "") + ")"
            + (f"; SIMULATED: rank {env['simulation']['simulate_rank']} alone, losses meaningless"
               if env.get("simulation") else ""))
