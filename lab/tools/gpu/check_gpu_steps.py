"""What `make check-gpu` runs (lab/tools/gpu/check_gpu.py, whose docstring says what each step is
for and why the list is what it is): the steps, their commands, time limits and expected
seconds, and the check's expected total."""
from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from scripts import REPO

PLAIN_NAME = "plain_gpt_step.py"
DEFAULT_FP8 = "tensorwise"  # why not rowwise: lab/tools/gpu/check_gpu.py's docstring

# Prints the machine; run as a step of its own, so the check's own process never touches CUDA.
MACHINE_SNIPPET = r"""
import importlib, platform, subprocess
print("python", platform.python_version())
try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                          "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout.strip()
    print("nvidia-smi:", out or "no output")
except (OSError, subprocess.SubprocessError) as err:
    print("nvidia-smi: not run:", err)
for name in ("torch", "triton", "torchao", "hydra", "omegaconf", "transformers", "xdist"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except ImportError:
        print(name, "absent")
import torch
print("torch cuda", torch.version.cuda, "| cuda available", torch.cuda.is_available(),
      "| devices", torch.cuda.device_count())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device 0:", p.name, f"{p.total_memory / 2**30:.0f} GiB, compute capability {p.major}.{p.minor}")
try:
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True, timeout=30).stdout.strip()
    print("commit", rev.stdout.strip() or "unknown (no git)", "+ uncommitted changes" if dirty else "")
except (OSError, subprocess.SubprocessError):
    print("commit unknown (no git)")
"""


@dataclass
class Step:
    name: str
    what: str
    argv: list[str]
    limit_s: int  # the step's own time limit
    min_s: int  # skipped when less than this is left of the budget
    skip_reason: str = ""  # set when the step cannot run at all (e.g. the plain step is missing)
    shown: str = ""  # the command as logs and --dry-run show it, where argv is unwieldy
    expect_s: int = 0  # its expected seconds on an H200: --dry-run's budget arithmetic
    alongside: bool = False  # runs beside the steps after it, up to the next timed one
    timed: bool = False  # measures speed: starts only once every alongside step has ended
    optional: str = ""  # why it is not in the default set (it runs with --only)

    @property
    def command(self) -> str:
        return self.shown or shlex.join(self.argv)


# ----------------------------------------------------------------------------- the steps


def find_plain(explicit: Optional[str]) -> tuple[Optional[Path], list[str]]:
    """The plain step's path, and every place looked at (for the summary when none has it)."""
    candidates = [explicit, os.environ.get("PLAIN_STEP"), str(REPO / "shared" / "bench" / PLAIN_NAME),
                  str(REPO.parent / "shared" / "bench" / PLAIN_NAME)]
    looked = [c for c in candidates if c]
    return next((Path(c).resolve() for c in looked if Path(c).is_file()), None), looked


def plan(py: str, plain: Optional[Path], looked: list[str], xdist_workers: int,
         out: Path = Path("check-gpu"), fp8: str = DEFAULT_FP8) -> list[Step]:
    """Every step, the optional ones too, in the order they run."""
    script = lambda name: str(REPO / "scripts" / name)  # noqa: E731
    bench = [py, script("bench/bench_train.py")]
    gpt_124m = [*bench, "--models", "gpt_124m", "--modes", "compiled", "--precisions", "bf16", "--optims", "adamw",
                "muon", "--batch-size", "16", "--seq-len", "1024"]
    # The marker expression is `make test-gpu`'s; -rfEs lists failures, errors and skip reasons.
    tests = [py, "-m", "pytest", "-m", "gpu", "-q", "--tb=short", "-rfEs", "-p", "no:cacheprovider"]
    if xdist_workers > 0:
        tests += ["-n", str(xdist_workers)]
    compare = out / "compare-bf16"
    return [
        Step("machine", "GPU, driver and library versions", [py, "-c", MACHINE_SNIPPET], 30, 5,
             shown=f"{py} -c <MACHINE_SNIPPET of lab/tools/gpu/check_gpu.py>", expect_s=8),
        Step("compare-bf16", "the fair study's tuned choice rerun in bf16: its largest dense rung, 3 fresh seeds, "
             "the same report", [py, script("gpu/reference_bf16.py"), "--out", str(compare), "--timeout", "200"],
             240, 120, expect_s=150, alongside=True),
        Step("gpt_1b-loss", f"bench_train gpt_1b eager, 2 x 1024, Muon, bf16 and FP8 {fp8}, 200 steps, losses",
             [*bench, "--models", "gpt_1b", "--modes", "eager", "--precisions", "bf16", "--fp8", "none", fp8,
              "--optims", "muon", "--batch-size", "2", "--seq-len", "1024", "--warmup", "1", "--rounds", "1",
              "--steps", "199", "--no-reference", "--losses", "trainer.max_steps=200"], 200, 90, expect_s=90,
             alongside=True),
        Step("test-gpu", "pytest -m gpu" + (f", {xdist_workers} xdist workers" if xdist_workers else ", serial"),
             tests, 150, 60, expect_s=110),
        Step("plain", "the plain step, batch 16 x 1024, compiled bf16",
             [py, str(plain) if plain else PLAIN_NAME, "--muon"], 60, 30,
             "" if plain else f"{PLAIN_NAME} not found (looked at: {', '.join(looked)}); "
                              "set PLAIN_STEP or --plain", expect_s=36, timed=True),
        Step("gpt_124m", "bench_train gpt_124m, 16,384 tokens per optimizer step",
             [*gpt_124m, "--no-reference", "--warmup", "2", "--rounds", "2", "--steps", "10"], 90, 45, expect_s=50,
             timed=True),
        Step("muon-step", "bench_optimizer gpt_124m, bf16",
             [py, script("bench/bench_optimizer.py"), "--model", "gpt_124m", "--dtypes", "bf16", "--warmup", "2",
              "--repeats", "5"], 80, 30, expect_s=45, timed=True),
        Step("gpt_1b", f"bench_train gpt_1b compiled, bf16 and FP8 {fp8}, AdamW and Muon, the planner's batch",
             [*bench, "--models", "gpt_1b", "--modes", "compiled", "--precisions", "bf16", "--fp8", "none", fp8,
              "--optims", "adamw", "muon", "--batch-size", "plan", "--seq-len", "4096", "--one-at-a-time",
              "--no-reference", "--warmup", "2", "--rounds", "1", "--steps", "3"], 200, 120, expect_s=140, timed=True),
        Step("moe_1b", "bench_train moe_1b with Muon, batch 8 x 2048",
             [*bench, "--models", "moe_1b", "--modes", "compiled", "--precisions", "bf16", "--optims", "muon",
              "--batch-size", "8", "--seq-len", "2048", "--warmup", "2", "--rounds", "1", "--steps", "5",
              "--no-reference"], 150, 100, expect_s=100, timed=True),
        # Optional: the budget no longer fits them (the module's docstring says why each).
        Step("gpt_124m_0.5M", "bench_train gpt_124m, 524,288 tokens per optimizer step (32 micro-batches)",
             [*gpt_124m, "--tokens-per-step", "524288", "--warmup", "2", "--rounds", "3", "--steps", "1"], 180, 60,
             expect_s=40, timed=True, optional="40 s the budget no longer has; Muon / AdamW at 0.5M tokens stands from 2026-11-26 (0.984)"),
        Step("ns-method", "bench_ns_method, bf16, whole stacks",
             [py, script("bench/bench_ns_method.py"), "--dtype", "bf16", "--stack", "0"], 90, 20, expect_s=16, timed=True,
             optional="16 s the budget no longer has; muon-step's ns_method=auto row covers the Muon step goal"),
        Step("ep-dispatch", "bench_ep_dispatch moe_1b, batch 8 x 2048, bf16, EP path on against off",
             [py, script("bench/bench_ep_dispatch.py"), "--model", "moe_1b", "--batch", "8", "--seq-len", "2048",
              "--warmup", "2", "--repeats", "5"], 120, 40, expect_s=90, timed=True,
             optional="up to 120 s the budget no longer has; expert parallelism's cost on one GPU is not a goal here"),
        # One rank of each large layout over fake process groups, beside the planner and the
        # FakeTensor estimate (scripts/plan/dry_run_layouts.py): does it fit, and its compute per step.
        Step("dry-runs", "one-rank dry runs: gpt_8b dp_shard 8 full; moe_16b ep 8 x dp_shard 8; gpt_1b dp_shard 8 "
             "none / full / selective", [py, script("plan/dry_run_layouts.py"), "--out", str(out / "dry-runs"), "--timeout",
                                         "100"], 420, 120, expect_s=420, timed=True,
             optional="up to 420 s, most of the budget on its own"),
    ]


def expected_s(steps: list[Step]) -> float:
    """The check's expected seconds: steps one after the other, alongside steps overlapping
    the steps after them up to the next timed one, which waits for them."""
    now, beside = 0.0, []
    for s in steps:
        if s.alongside:
            beside.append(now + s.expect_s)
            continue
        if s.timed:
            now, beside = max([now, *beside]), []
        now += s.expect_s
    return max([now, *beside])
