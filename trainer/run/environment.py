"""The run's environment record: <run_dir>/environment.json.

What a run's numbers depend on beyond its config: the code (git commit, and whether the
tree had changes), the software (Python, torch, CUDA), the hardware (device, world size and
layout) and the exact corpus (its id, the size and hash of every split, and how this
interpreter's build compared with the corpus manifest). Written by rank 0 when the run
starts; a resumed run keeps the first record and appends its own under "resumes", so a
run that moved to another machine or corpus midway says so.
"""
from __future__ import annotations

import contextlib
import json
import platform
import socket
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from data.atomic import atomic_output
from eval.environment import ENV_FILE, read_environment

if TYPE_CHECKING:
    import torch

# torch is imported where a record is made, not here: scripts/compare_runs.py reads records
# without it.

# The run's tokenizer, saved into its run dir so that export and sampling work from anywhere.
RUN_TOKENIZER_DIR = "tokenizer"
REPO_ROOT = Path(__file__).resolve().parents[2]
GIT_TIMEOUT_S = 10


def _git(*args: str) -> Optional[str]:
    try:
        # --no-optional-locks: `git status` must not take the index lock a user's own git
        # command may need at the same moment.
        done = subprocess.run(["git", "--no-optional-locks", *args], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=GIT_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def git_state() -> dict[str, Any]:
    """The commit the code came from and whether tracked files differed from it (None: not a
    git checkout). Untracked files do not count: outputs and caches live in the tree."""
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None}
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit.strip(), "dirty": None if status is None else bool(status.strip())}


def package_versions(names: tuple[str, ...]) -> dict[str, Optional[str]]:
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, Optional[str]] = {}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def cpu_name() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    return platform.processor() or platform.machine() or "unknown"


def device_name(device: torch.device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def environment(device: torch.device, world_size: int, dp: int, tp: int, backend: str,
                corpus: dict[str, Any], dp_shard: int = 1, ep: int = 1,
                simulated_rank: Optional[int] = None, pp: int = 1,
                pipeline: Optional[dict[str, Any]] = None,
                optimizers: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """`simulated_rank`: this process ran alone as that rank of the `world_size`-rank layout
    (parallel.simulate_world, trainer/simulation/one_rank.py), None for a training run. `pipeline`: under
    a pipeline (pp > 1), its schedule and stage split (trainer/pipeline.py pipeline_record),
    recorded in the layout with pp; without one the layout has no pp key, as every record
    written before pipelines existed (a reader takes pp as 1). `optimizers`: which optimizer steps
    which parameter family (optim/routing.py routing_census; rank 0's stage under a pipeline)."""
    import torch

    record = {
        "git": git_state(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        # What else decides the tokens and the numbers: the tokenizer library, and numpy.
        "packages": package_versions(("tokenizers", "transformers", "numpy")),
        "device": device_name(device),
        "device_type": device.type,
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "world_size": world_size,
        # dp_shard: the data-parallel ranks that shard the parameters (FSDP2), of dp; ep: the
        # data-parallel ranks that spread the experts among them
        "layout": {"dp": dp, "tp": tp, "backend": backend, "dp_shard": dp_shard, "ep": ep,
                   **({"pp": pp, **(pipeline or {})} if pp > 1 else {})},
        "corpus": corpus,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if optimizers is not None:
        record["optimizers"] = optimizers
    if simulated_rank is not None:
        # Its losses mean nothing: one process over fake process groups, no data exchanged.
        record["simulation"] = {"simulate_world": world_size, "simulate_rank": simulated_rank, "processes": 1}
    return record


def record_environment(run_dir: Path, env: dict[str, Any], resumed_at: Optional[int] = None) -> dict[str, Any]:
    """Write the record of a fresh run, or append a resumed start to the existing one; returns the file's record."""
    previous = read_environment(run_dir) if resumed_at is not None else None
    if previous is None:
        record = dict(env)
        if resumed_at is not None:  # resumed from another run's checkpoint (checkpoint.resume=<path>)
            record["resumed_at_step"] = resumed_at
    else:
        record = previous
        record.setdefault("resumes", []).append({"step": resumed_at, **env})
    with atomic_output(run_dir / ENV_FILE) as f:
        f.write((json.dumps(record, indent=1) + "\n").encode("utf-8"))
    return record


def save_tokenizer(run_dir: Path, tokenizer) -> Path:
    """Copy the tokenizer into <run_dir>/tokenizer (once: a resumed run keeps the first copy).
    Written to a temporary dir and renamed, so the dir is complete or absent."""
    import shutil
    import tempfile

    target = run_dir / RUN_TOKENIZER_DIR
    if target.is_dir():
        return target
    run_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=run_dir, prefix=f".{RUN_TOKENIZER_DIR}."))
    try:
        tokenizer.save_pretrained(str(staging))
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
