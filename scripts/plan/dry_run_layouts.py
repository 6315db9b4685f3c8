"""One rank of each large layout, run for real on the device at hand, beside the planner and the
FakeTensor estimate: does the rank fit, and how long is its compute per step?

    python scripts/plan/dry_run_layouts.py --out dry-runs            # every row below, on this device
    python scripts/plan/dry_run_layouts.py --rows gpt_1b-none --steps 2
    python scripts/plan/dry_run_layouts.py --list

For each row, in its own processes:
  simulate   train.py with parallel.simulate_world: rank 0 of the layout over fake process
             groups (trainer/simulation/one_rank.py), a few real steps on the device; its last metrics row
             gives the peak device memory (allocated and reserved) and perf/simulated_step_s,
             the rank's compute per step (a real rank also waits for communication)
  estimate   scripts/plan/estimate_memory.py --json: the same rank's memory under FakeTensorMode,
             nothing allocated, and the planner's figure for it (planning/memory_plan.py)
The estimates need no GPU: they run on the CPU while the simulations hold the GPU.

Printed (and written to --out/dry_runs.md): a table of measured peak, planner and estimate,
with their ratios. On a CPU the measured peak is the process's resident set, which also holds
Python and its libraries: compare the ratios on a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from scripts import REPO

GIB = 1 << 30


@dataclass(frozen=True)
class Row:
    """One layout to check: rank 0 of dp_shard x tp (ep carved from dp_shard) on `model`."""

    name: str
    model: str
    dp_shard: int
    checkpointing: str
    tp: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return self.dp_shard * self.tp

    def layout(self) -> str:
        parts = [f"dp_shard {self.dp_shard}"] + ([f"tp {self.tp}"] if self.tp > 1 else [])
        return " x ".join(parts) + (f", ep {self.ep}" if self.ep > 1 else "")


# The layouts users plan, one rank each (issue: gpt_8b and moe_16b on 8 GPUs, gpt_1b per mode).
ROWS = (
    Row("gpt_8b-full", "gpt_8b", 8, "full"),
    Row("moe_16b-ep8", "moe_16b", 8, "none", ep=8),
    Row("gpt_1b-none", "gpt_1b", 8, "none"),
    Row("gpt_1b-full", "gpt_1b", 8, "full"),
    Row("gpt_1b-selective", "gpt_1b", 8, "selective"),
)


def simulate_argv(py: str, row: Row, run_dir: Path, batch: int, seq_len: int, steps: int, vocab: int) -> list[str]:
    """train.py as rank 0 of `row`'s layout: bf16, no compile, no eval beyond one batch, no
    checkpoint (a simulation writes none), a metrics row every step."""
    return [py, str(REPO / "train.py"), f"model={row.model}", f"parallel.simulate_world={row.world}",
            f"parallel.dp_shard={row.dp_shard}", f"parallel.tp={row.tp}", f"parallel.ep={row.ep}",
            f"trainer.activation_checkpointing={row.checkpointing}", f"trainer.batch_size={batch}",
            f"trainer.seq_len={seq_len}", f"trainer.max_steps={steps}", "trainer.precision=bf16",
            # A fixed MFU denominator: the start-up matmul measurement is not what this run is for.
            "trainer.peak_tflops=989", "logger.interval=1", "logger.progress=lines", "logger.tensorboard=false",
            "logger.wandb.mode=disabled", "eval.interval=0", "eval.batches=1", f"eval.batch_size={batch}",
            # Run even where the plan says the rank does not fit the card: measuring the plan is the point.
            "parallel.simulate_force=true", f"data.vocab_size={vocab}", f"hydra.run.dir={run_dir}"]


def estimate_argv(py: str, row: Row, batch: int, seq_len: int, vocab: int) -> list[str]:
    return [py, str(REPO / "scripts" / "plan" / "estimate_memory.py"), "--model", row.model, "--vocab-size", str(vocab),
            "--dp-shard", str(row.dp_shard), "--tp", str(row.tp), "--ep", str(row.ep), "--batch-size", str(batch),
            "--seq-len", str(seq_len), "--activation-checkpointing", row.checkpointing, "--json"]


def last_training_row(metrics: Path) -> Optional[dict]:
    """The last metrics.jsonl row that carries the simulation's figures."""
    if not metrics.exists():
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "perf/simulated_step_s" in r]
    return rows[-1] if rows else None


def ratio(a: Optional[float], b: Optional[float]) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def gib(x: Optional[float]) -> str:
    return f"{x / GIB:.2f}" if x else "-"


def render(results: list[dict], batch: int, seq_len: int, vocab: int, device: str) -> str:
    lines = [f"Rank 0 of each layout, muon, bf16, micro-batch {batch} x {seq_len}, vocab {vocab}, on {device}. "
             "measured: the simulation's peak (CUDA: allocated by tensors / reserved by the allocator; CPU: "
             "resident set); plan: planning/memory_plan.py; estimate: FakeTensor (scripts/plan/estimate_memory.py).", "",
             "| row | layout | checkpointing | measured allocated GiB | reserved GiB | plan GiB | estimate GiB "
             "| measured / plan | measured / estimate | compute s/step | tokens/s (this rank) | notes |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in results:
        row: Row = r["row"]
        measured = r.get("allocated") or r.get("reserved")
        step_s = r.get("step_s")
        cells = [row.name, row.layout(), row.checkpointing, gib(r.get("allocated")), gib(r.get("reserved")),
                 gib(r.get("plan")), gib(r.get("estimate")), ratio(measured, r.get("plan")),
                 ratio(measured, r.get("estimate")), f"{step_s:.3f}" if step_s else "-",
                 f"{batch * seq_len / step_s:,.0f}" if step_s else "-", "; ".join(r.get("notes", []))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(argv: list[str], log: Path, timeout_s: float, env: dict) -> tuple[Optional[int], float]:
    start = time.monotonic()
    with open(log, "w") as f:
        f.write("$ " + " ".join(argv) + "\n")
        f.flush()
        try:
            rc = subprocess.run(argv, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\n[dry_run_layouts: stopped after {timeout_s:.0f} s]\n")
            rc = None
    return rc, time.monotonic() - start


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="dry-runs", help="directory for the logs, the run dirs and dry_runs.md")
    ap.add_argument("--rows", nargs="+", default=None, help="some rows only (default: all; see --list)")
    ap.add_argument("--list", action="store_true", help="print the rows and exit")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3, help="training steps per simulation (the last one is timed)")
    ap.add_argument("--vocab-size", type=int, default=8192, help="the embedded corpus's tokenizer (data.vocab_size)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per simulation")
    ap.add_argument("--no-estimate", action="store_true", help="skip the FakeTensor estimates")
    ap.add_argument("--python", default=sys.executable)
    args = ap.parse_args(argv)
    by_name = {r.name: r for r in ROWS}
    if args.list:
        for r in ROWS:
            print(f"{r.name}: {r.model}, rank 0 of {r.layout()}, checkpointing {r.checkpointing}")
        return 0
    unknown = set(args.rows or []) - by_name.keys()
    if unknown:
        ap.error(f"--rows: unknown {', '.join(sorted(unknown))}; the rows are {', '.join(by_name)}")
    rows = [by_name[n] for n in args.rows] if args.rows else list(ROWS)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    env.pop("WORLD_SIZE", None)  # a simulation is one process, never part of a launch

    # The estimates run on the CPU, all at once, while the simulations take the device in turn.
    estimates: dict[str, subprocess.Popen] = {}
    if not args.no_estimate:
        cpu_env = {**env, "CUDA_VISIBLE_DEVICES": ""}
        for row in rows:
            f = open(out / f"estimate_{row.name}.json", "w")
            estimates[row.name] = subprocess.Popen(estimate_argv(args.python, row, args.batch_size, args.seq_len,
                                                                 args.vocab_size), cwd=REPO, stdout=f,
                                                   stderr=open(out / f"estimate_{row.name}.log", "w"), env=cpu_env)
    results = []
    device = "cuda" if _has_cuda(args.python) else "cpu"
    for row in rows:
        run_dir = out / f"run_{row.name}"
        rc, seconds = run(simulate_argv(args.python, row, run_dir, args.batch_size, args.seq_len, args.steps,
                                        args.vocab_size), out / f"simulate_{row.name}.log", args.timeout, env)
        result: dict = {"row": row, "notes": []}
        last = last_training_row(run_dir / "metrics.jsonl")
        if last is None:
            result["notes"].append(f"simulation {'timed out' if rc is None else f'exit {rc}'} in {seconds:.0f} s, "
                                   f"no metrics (see simulate_{row.name}.log)")
        else:
            result.update(allocated=last.get("mem/peak_allocated_bytes"), reserved=last.get("mem/peak_reserved_bytes"),
                          step_s=last.get("perf/simulated_step_s"))
        results.append(result)
        print(f"[dry_run_layouts] {row.name}: {'ok' if last else 'no result'} in {seconds:.0f} s", flush=True)
    for result in results:
        name = result["row"].name
        if name not in estimates:
            continue
        try:
            estimates[name].wait(timeout=max(1.0, args.timeout))
            data = json.loads((out / f"estimate_{name}.json").read_text())
            result.update(estimate=data["estimate"]["peak"], plan=data["plan"]["total"])
        except (subprocess.TimeoutExpired, ValueError, KeyError) as err:
            estimates[name].kill()
            result["notes"].append(f"no estimate ({type(err).__name__}; see estimate_{name}.log)")
    text = render(results, args.batch_size, args.seq_len, args.vocab_size, device)
    (out / "dry_runs.md").write_text(text + "\n")
    print(text)
    return 0 if all(r.get("step_s") for r in results) else 1


def _has_cuda(py: str) -> bool:
    probe = subprocess.run([py, "-c", "import torch; print(torch.cuda.is_available())"], capture_output=True, text=True)
    return probe.stdout.strip() == "True"


if __name__ == "__main__":
    sys.exit(main())
