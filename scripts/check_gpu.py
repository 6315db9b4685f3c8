"""One GPU check that fits in ten minutes on one H100 or H200: `make check-gpu`.

    make check-gpu PY=python3 SETUP= OUT_DIR=/path/to/out     # on a GPU image with its own torch
    python3 scripts/check_gpu.py --out check-gpu --plain ../shared/bench/plain_gpt_step.py
    python3 scripts/check_gpu.py --dry-run                     # the steps, commands and time limits
    python3 scripts/check_gpu.py --only gpt_124m moe_1b        # some steps again

The steps, in this order, each in its own process with its own time limit:

  machine         GPU, driver, python, torch, CUDA, hydra, transformers, pytest-xdist, commit
  test-gpu        pytest -m gpu (what `make test-gpu` runs), on pytest-xdist workers where installed
  plain           the plain step (plain_gpt_step.py) at batch 16 x 1024: the yardstick every
                  tokens/s below is divided by; looked for at --plain, $PLAIN_STEP,
                  shared/bench/ inside the repository and ../shared/bench/ beside it, and
                  skipped, saying where it looked, when it is in none of them
  gpt_124m        bench_train.py, our AdamW and Muon beside scripts/reference_gpt.py, compiled
                  bf16, batch 16 x 1024 (16,384 tokens per optimizer step), with the census
  gpt_124m_0.5M   the same at 524,288 tokens per optimizer step (32 micro-batches of 16 x 1024)
  ns-method       bench_ns_method.py --dtype bf16 --stack 0: standard against Gram Newton-Schulz
  muon-step       bench_optimizer.py at gpt_124m in bf16: the Muon step against its FLOP floor
  moe_1b          bench_train.py, moe_1b with Muon, batch 8 x 2048 (fewer rounds than bench-gpu)
  ep-dispatch     bench_ep_dispatch.py at moe_1b, 8 x 2048, bf16: expert parallelism's code path
                  on a group of one rank against off (the dispatch's own cost, its host sync included)
  dry-runs        dry_run_layouts.py: rank 0 of gpt_8b (dp_shard 8, full checkpointing), moe_16b
                  (ep 8 x dp_shard 8) and gpt_1b (dp_shard 8; none, full, selective) run for real
                  over fake process groups, their peak memory beside the planner and the
                  FakeTensor estimate, and each rank's compute time per step

The whole check has one time budget (--budget seconds). Every step runs whether or not an
earlier one failed; its time limit is its own or what is left of the budget, whichever is less,
and a step the budget can no longer fit is skipped, saying so. A step that runs past its limit
is stopped with its whole process group (pytest-xdist workers, compile workers).

Written to --out (default $OUT_DIR, else check-gpu/): NN_<step>.log, each step's full output,
and summary.md, rewritten after every step so that it is complete up to the step that ran
last even if the check itself is killed: the machine, each step's result and time, the test
counts with the names of failures, tokens/s against the plain step, Muon / AdamW at both
batch sizes, the Muon step time, the Newton-Schulz method table and moe_1b's row.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.check_gpu_logs import (  # noqa: E402  (re-exported: tests read them through this module)
    bench_rows, markdown_tables, muon_over_adamw, number, plain_figures, pytest_outcome, read, table_blocks,
)
PLAIN_NAME = "plain_gpt_step.py"
DEFAULT_BUDGET_S = 530  # of one 10-minute command, leaving time to install wheels and copy logs back
KILL_GRACE_S = 10  # after SIGTERM, before SIGKILL

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
for name in ("torch", "triton", "hydra", "omegaconf", "transformers", "xdist"):
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

    @property
    def command(self) -> str:
        return self.shown or shlex.join(self.argv)


@dataclass
class Result:
    step: Step
    log: Path
    status: str = "pending"  # pending, running, ok, failed, timed out, skipped
    rc: Optional[int] = None
    seconds: float = 0.0
    limit_s: float = 0.0
    note: str = ""


@dataclass
class Check:
    out: Path
    budget_s: float
    command: str
    results: list[Result] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    started_at: str = field(default_factory=lambda: datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))


# ----------------------------------------------------------------------------- the steps


def find_plain(explicit: Optional[str]) -> tuple[Optional[Path], list[str]]:
    """The plain step's path, and every place looked at (for the summary when none has it)."""
    candidates = [explicit, os.environ.get("PLAIN_STEP"), str(REPO / "shared" / "bench" / PLAIN_NAME),
                  str(REPO.parent / "shared" / "bench" / PLAIN_NAME)]
    looked = [c for c in candidates if c]
    return next((Path(c).resolve() for c in looked if Path(c).is_file()), None), looked


def plan(py: str, plain: Optional[Path], looked: list[str], xdist_workers: int,
         out: Path = Path("check-gpu")) -> list[Step]:
    script = lambda name: str(REPO / "scripts" / name)  # noqa: E731
    gpt_124m = [py, script("bench_train.py"), "--models", "gpt_124m", "--modes", "compiled",
                "--precisions", "bf16", "--optims", "adamw", "muon", "--batch-size", "16", "--seq-len", "1024"]
    # The marker expression is `make test-gpu`'s; -rfEs lists failures, errors and skip reasons.
    tests = [py, "-m", "pytest", "-m", "gpu", "-q", "--tb=short", "-rfEs", "-p", "no:cacheprovider"]
    if xdist_workers > 0:
        tests += ["-n", str(xdist_workers)]
    steps = [
        Step("machine", "GPU, driver and library versions", [py, "-c", MACHINE_SNIPPET], 60, 5,
             shown=f"{py} -c <MACHINE_SNIPPET of scripts/check_gpu.py>"),
        Step("test-gpu", "pytest -m gpu" + (f", {xdist_workers} xdist workers" if xdist_workers else ", serial"),
             tests, 200, 60),
        Step("plain", "the plain step, batch 16 x 1024, compiled bf16",
             [py, str(plain) if plain else PLAIN_NAME, "--muon"], 120, 45,
             "" if plain else f"{PLAIN_NAME} not found (looked at: {', '.join(looked)}); "
                              "set PLAIN_STEP or --plain"),
        Step("gpt_124m", "bench_train gpt_124m, 16,384 tokens per optimizer step, census",
             [*gpt_124m, "--warmup", "3", "--rounds", "3", "--steps", "10", "--census"], 200, 90),
        # One optimizer step per round is 32 micro-batches, about a second on an H100.
        Step("gpt_124m_0.5M", "bench_train gpt_124m, 524,288 tokens per optimizer step (32 micro-batches)",
             [*gpt_124m, "--tokens-per-step", "524288", "--warmup", "2", "--rounds", "3", "--steps", "1"], 180, 60),
        Step("ns-method", "bench_ns_method, bf16, whole stacks",
             [py, script("bench_ns_method.py"), "--dtype", "bf16", "--stack", "0"], 90, 20),
        Step("muon-step", "bench_optimizer gpt_124m, bf16",
             [py, script("bench_optimizer.py"), "--model", "gpt_124m", "--dtypes", "bf16", "--warmup", "3",
              "--repeats", "10"], 150, 30),
        Step("moe_1b", "bench_train moe_1b with Muon, batch 8 x 2048",
             [py, script("bench_train.py"), "--models", "moe_1b", "--modes", "compiled", "--precisions", "bf16",
              "--optims", "muon", "--batch-size", "8", "--seq-len", "2048", "--warmup", "2", "--rounds", "2",
              "--steps", "5", "--no-reference"], 200, 100),
        Step("ep-dispatch", "bench_ep_dispatch moe_1b, batch 8 x 2048, bf16, EP path on against off",
             [py, script("bench_ep_dispatch.py"), "--model", "moe_1b", "--batch", "8", "--seq-len", "2048",
              "--warmup", "2", "--repeats", "5"], 120, 40),
        # One rank of each large layout over fake process groups, beside the planner and the
        # FakeTensor estimate (scripts/dry_run_layouts.py): does it fit, and its compute per step.
        Step("dry-runs", "one-rank dry runs: gpt_8b dp_shard 8 full; moe_16b ep 8 x dp_shard 8; gpt_1b dp_shard 8 "
             "none / full / selective", [py, script("dry_run_layouts.py"), "--out", str(out / "dry-runs"), "--timeout", "100"],
             420, 120),
    ]
    return steps


# ----------------------------------------------------------------------------- running


def run_step(step: Step, log: Path, limit_s: float) -> tuple[Optional[int], float, bool]:
    """(exit code, seconds, timed out). The step runs in a session of its own, so a timeout
    stops its children too (pytest-xdist workers, torch.compile's worker processes)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    with open(log, "w") as f:
        f.write(f"$ {step.command}\n")
        f.flush()
        try:
            proc = subprocess.Popen(step.argv, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        except OSError as err:  # e.g. no such python: this step fails, the next ones still run
            f.write(f"[check_gpu: could not start: {err}]\n")
            return 127, time.monotonic() - start, False
        try:
            rc = proc.wait(timeout=limit_s)
            return rc, time.monotonic() - start, False
        except subprocess.TimeoutExpired:
            for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                try:
                    proc.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
            f.write(f"\n[check_gpu: stopped after {limit_s:.0f} s, the step's time limit]\n")
            return proc.returncode, time.monotonic() - start, True


def run_all(check: Check, steps: list[Step]) -> list[Result]:
    """Every step in turn, whatever became of the ones before; summary.md after each."""
    check.out.mkdir(parents=True, exist_ok=True)
    check.results = [Result(s, check.out / f"{i:02d}_{s.name}.log") for i, s in enumerate(steps)]
    for r in check.results:
        left = check.budget_s - (time.monotonic() - check.started)
        if r.step.skip_reason:
            r.status, r.note = "skipped", r.step.skip_reason
        elif left < r.step.min_s:
            r.status, r.note = "skipped", f"{left:.0f} s left of the {check.budget_s:.0f} s budget, needs {r.step.min_s} s"
        else:
            r.limit_s = min(r.step.limit_s, left)
            r.status = "running"
            write_summary(check)
            progress(check, f"{r.step.name}: running, time limit {r.limit_s:.0f} s")
            r.rc, r.seconds, timed_out = run_step(r.step, r.log, r.limit_s)
            r.status = "timed out" if timed_out else ("ok" if r.rc == 0 else "failed")
        progress(check, f"{r.step.name}: {r.status}" + (f" (rc {r.rc})" if r.status == "failed" else "")
                 + (f" in {r.seconds:.0f} s" if r.seconds else "") + (f": {r.note}" if r.note else ""))
        write_summary(check)
    return check.results


def progress(check: Check, line: str) -> None:
    print(f"[check_gpu t={time.monotonic() - check.started:.0f}s] {line}", flush=True)


# ----------------------------------------------------------------------------- the summary


def fmt_count(counts: dict[str, int]) -> str:
    order = ("passed", "failed", "error", "skipped", "xfailed", "xpassed", "deselected")
    return ", ".join(f"{counts[k]} {k}" for k in order if counts.get(k)) or "no tests counted"


def not_run(r: Result) -> str:
    if r.status == "running":
        return f"Running now (`{r.log.name}`)."
    return f"Not run: {r.note}." if r.note else "Not run yet."


def section_tests(r: Result) -> list[str]:
    out = ["## Tests (`pytest -m gpu`)", ""]
    if r.status in ("pending", "running", "skipped"):
        return out + [not_run(r), ""]
    t = pytest_outcome(read(r.log))
    line = fmt_count(t["counts"])
    line += f" in {t['seconds']:.0f} s" if t["complete"] else " (no final summary line: counted from the progress line)"
    out += [f"**{line}** (exit code {r.rc}, {r.status}).", ""]
    if t["failures"]:
        out += ["Failures and errors:", ""] + [f"- `{name}`" for name in t["failures"]] + [""]
    skips = re.findall(r"^SKIPPED \[\d+\] (.*)$", read(r.log), re.MULTILINE)
    if skips:
        out += ["Skips:", ""] + [f"- {s}" for s in skips] + [""]
    return out


def section_throughput(by_name: dict[str, Result]) -> list[str]:
    out = ["## gpt_124m tokens/s, compiled bf16, against the plain step of the same run", ""]
    plain = plain_figures(read(by_name["plain"].log)) if "plain" in by_name else None
    if plain:
        out += [f"Plain step ({PLAIN_NAME}, batch 16 x 1024, this run): **{plain['tokens_s']:,.0f} tokens/s**, "
                f"{plain['ms']:.1f} ms/step, MFU {plain['mfu']:.1f}% (its own count, 6N + 12LdT)."]
        if "torch_muon_ms" in plain:
            out += [f"torch.optim.Muon on its {plain['torch_muon_matrices']:.0f} hidden matrices: "
                    f"{plain['torch_muon_ms']:.2f} ms/step."]
        out.append("")
    elif "plain" in by_name:
        r = by_name["plain"]
        out += [f"No plain-step figure ({r.note or r.status}): the `/ plain` column is empty.", ""]
    rows: list[dict[str, str]] = []
    for name in ("gpt_124m", "gpt_124m_0.5M"):
        if name in by_name:
            rows += bench_rows(read(by_name[name].log))
    if not rows:
        return out + ["No bench_train rows (see the steps table and the logs).", ""]
    out += ["| impl | optim | tokens/step | step s | tokens/s | MFU | ours / reference | / plain step | notes |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in rows:
        tps = number(row.get("tokens/s", ""))
        vs = f"{tps / plain['tokens_s']:.3f}" if plain and tps else ""
        out.append(f"| {row.get('impl', '')} | {row.get('optim', '')} | {row.get('tokens/step', '')} "
                   f"| {row.get('step s', '')} | {row.get('tokens/s', '')} | {row.get('MFU', '')} "
                   f"| {row.get('ours / reference', '')} | {vs} | {row.get('notes', '')} |")
    predicted = {}
    for name in ("gpt_124m", "gpt_124m_0.5M"):
        for table in markdown_tables(read(by_name[name].log)) if name in by_name else []:
            for row in table:
                if "predicted" in row and "measured" in row:
                    predicted[int(number(row["tokens/step"]) or 0)] = row["predicted"]
    ratios = muon_over_adamw(rows)
    if ratios:
        out += ["", "Muon / AdamW tokens/s (ours, measured side by side in one bench_train run): " + "; ".join(
            f"**{ratio:.3f}** at {tokens:,} tokens per optimizer step"
            + (f" (FLOP-count prediction {predicted[tokens]})" if tokens in predicted else "")
            for tokens, ratio in sorted(ratios.items())) + "."]
    return out + [""]


def section_tables(title: str, r: Optional[Result], keep: Optional[str] = None) -> list[str]:
    """The step's Markdown tables, verbatim (those whose text contains `keep`, if given)."""
    out = [f"## {title}", ""]
    if r is None:
        return out + ["Not planned.", ""]
    if r.status in ("pending", "running", "skipped"):
        return out + [not_run(r), ""]
    blocks = [b for b in table_blocks(read(r.log)) if keep is None or keep in b]
    if not blocks:
        return out + [f"No table in `{r.log.name}` ({r.status}, exit code {r.rc}).", ""]
    return out + [x for b in blocks for x in (b, "")]


def muon_step_lines(by_name: dict[str, Result]) -> list[str]:
    """The Muon step time at gpt_124m, from bench_optimizer's floor table and bench_ns_method's
    whole-step row: every `... ms` cell of those rows, labelled by its column."""
    lines = []
    sources = (("muon-step", lambda row: row.get("NS dtype") == "bf16" and "floor ms" in row),
               ("ns-method", lambda row: "whole Muon step" in " ".join(row.values())))
    for name, wanted in sources:
        if name not in by_name:
            continue
        for table in markdown_tables(read(by_name[name].log)):
            for row in table:
                if wanted(row):
                    cells = [f"{k} {v}" for k, v in row.items() if "ms" in k and v]
                    if cells:
                        lines.append(f"- {name} ({by_name[name].log.name}): " + ", ".join(cells))
    return lines


def steps_table(check: Check) -> list[str]:
    out = ["## Steps", "", "| step | what | result | s | time limit s | log |", "| --- | --- | --- | ---: | ---: | --- |"]
    for r in check.results:
        result = r.status + (f" (exit code {r.rc})" if r.status == "failed" else "") + (f": {r.note}" if r.note else "")
        out.append(f"| {r.step.name} | {r.step.what} | {result} | {r.seconds:.0f} | {r.limit_s:.0f} "
                   f"| {r.log.name if r.status not in ('pending', 'skipped') else ''} |")
    return out + [""]


def render(check: Check) -> str:
    by_name = {r.step.name: r for r in check.results}
    elapsed = time.monotonic() - check.started
    running = [r.step.name for r in check.results if r.status == "running"]
    state = f"in progress: {running[0]} is running" if running else (
        "finished" if all(r.status not in ("pending", "running") for r in check.results) else "in progress")
    out = [f"# GPU check ({check.started_at})", "",
           f"`{check.command}`: {state}, {elapsed:.0f} s of a {check.budget_s:.0f} s budget so far.", ""]
    machine = by_name.get("machine")
    if machine and machine.status not in ("pending", "running", "skipped"):
        text = "\n".join(line for line in read(machine.log).splitlines()[1:] if line.strip())
        out += ["## Machine", "", "```text", text, "```", ""]
    out += steps_table(check)
    if "test-gpu" in by_name:
        out += section_tests(by_name["test-gpu"])
    if {"plain", "gpt_124m", "gpt_124m_0.5M"} & by_name.keys():
        out += section_throughput(by_name)
    if {"muon-step", "ns-method"} & by_name.keys():
        lines = muon_step_lines(by_name)
        out += ["## Muon step at gpt_124m (84 matrices), bf16", ""] + (lines or ["No figure found in the logs."]) + [""]
    if "muon-step" in by_name:
        out += section_tables("bench_optimizer.py, gpt_124m, bf16", by_name["muon-step"])
    if "ns-method" in by_name:
        out += section_tables("Newton-Schulz method (bench_ns_method.py --dtype bf16 --stack 0)", by_name["ns-method"])
    for name in ("gpt_124m", "gpt_124m_0.5M", "moe_1b"):
        if name in by_name:
            out += section_tables(f"bench_train.py: {by_name[name].step.what}", by_name[name], keep="| model |")
    if "dry-runs" in by_name:
        out += section_tables(f"Dry runs: {by_name['dry-runs'].step.what}", by_name["dry-runs"])
    if "ep-dispatch" in by_name:
        out += section_tables(f"bench_ep_dispatch.py: {by_name['ep-dispatch'].step.what}", by_name["ep-dispatch"])
    return "\n".join(out)


def write_summary(check: Check) -> None:
    """summary.md, replaced whole (a reader never sees half a file)."""
    try:
        text = render(check)
    except Exception as err:  # a log in a form the readers do not expect must not stop the check
        text = "\n".join([f"# GPU check ({check.started_at})", "", *steps_table(check),
                          f"The rest of the summary failed: {type(err).__name__}: {err}; see the logs."])
    tmp = check.out / "summary.md.tmp"
    tmp.write_text(text)
    tmp.replace(check.out / "summary.md")


# ----------------------------------------------------------------------------- main


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT_DIR") or "check-gpu",
                    help="directory for summary.md and the logs (default: $OUT_DIR, else check-gpu)")
    ap.add_argument("--plain", default=None, help=f"path of {PLAIN_NAME} (else $PLAIN_STEP, then shared/bench/ "
                                                   "in the repository, then ../shared/bench/)")
    ap.add_argument("--budget", type=float, default=float(os.environ.get("CHECK_BUDGET_S") or DEFAULT_BUDGET_S),
                    help=f"seconds for the whole check (default {DEFAULT_BUDGET_S}, or $CHECK_BUDGET_S)")
    ap.add_argument("--xdist", type=int, default=12,
                    help="pytest-xdist workers for test-gpu where pytest-xdist is installed (0: serial)")
    ap.add_argument("--only", nargs="+", default=None, help="run only these steps (machine always runs)")
    ap.add_argument("--python", default=sys.executable, help="python of the steps (default: this one)")
    ap.add_argument("--dry-run", action="store_true", help="print the steps and their commands; run nothing")
    args = ap.parse_args(argv)

    plain, looked = find_plain(args.plain)
    workers = args.xdist if importlib.util.find_spec("xdist") is not None else 0
    steps = plan(args.python, plain, looked, workers, Path(args.out).resolve())
    if args.only:
        unknown = set(args.only) - {s.name for s in steps}
        if unknown:
            ap.error(f"--only: unknown step(s) {', '.join(sorted(unknown))}; the steps are "
                     + ", ".join(s.name for s in steps))
        steps = [s for s in steps if s.name == "machine" or s.name in args.only]
    if args.dry_run:
        print(f"budget {args.budget:.0f} s; output in {Path(args.out).resolve()}")
        if args.xdist and not workers:
            print("pytest-xdist is not installed here: test-gpu runs serially")
        for s in steps:
            print(f"\n{s.name} (time limit {s.limit_s} s, skipped with under {s.min_s} s left): {s.what}")
            print(f"  not run: {s.skip_reason}" if s.skip_reason else f"  $ {s.command}")
        return 0

    check = Check(Path(args.out).resolve(), args.budget, "scripts/check_gpu.py " + shlex.join(argv or sys.argv[1:]))
    results = run_all(check, steps)
    progress(check, f"summary: {check.out / 'summary.md'}")
    return 0 if all(r.status == "ok" for r in results if not r.step.skip_reason) else 1


if __name__ == "__main__":
    sys.exit(main())
