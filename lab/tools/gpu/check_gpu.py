"""One GPU check that fits in ten minutes on one H100 or H200: `make check-gpu`.

    make check-gpu PY=python3 SETUP= OUT_DIR=/path/to/out     # on a GPU image with its own torch
    python3 lab/tools/gpu/check_gpu.py --out check-gpu --plain ../shared/bench/plain_gpt_step.py
    python3 lab/tools/gpu/check_gpu.py --dry-run                     # the steps, commands, limits and budget
    python3 lab/tools/gpu/check_gpu.py --only gpt_1b moe_1b          # some steps again, optional ones too

The steps, in this order, each in its own process group with its own time limit. Two run
*alongside* the steps after them (they measure no speed, so they may share the GPU): they start,
the next steps start at once, and the check waits for them before the first step that times
something, which always has the machine to itself.

  machine         GPU, driver, python, torch, torchao, CUDA, hydra, transformers, pytest-xdist, commit
  compare-bf16    alongside: the fair study's tuned choice rerun in bf16 (lab/tools/gpu/reference_bf16.py:
                  lab/results/fair's largest dense rung, every budget, 3 fresh seeds, 4 runs at a time,
                  the same report), into <out>/compare-bf16/; goal: at most 240 s
  gpt_1b-loss     alongside: bench_train.py --losses, gpt_1b eager, micro-batch 2 x 1024, Muon, bf16
                  and FP8 from the same seed and batches, 200 steps each (lr schedule of 200 steps):
                  train and val loss; goal: FP8 within 1% of bf16
  test-gpu        pytest -m gpu (what `make test-gpu` runs), on pytest-xdist workers where installed
  plain           the plain step (plain_gpt_step.py) at batch 16 x 1024: the yardstick of every
                  tokens/s below; looked for at --plain, $PLAIN_STEP, shared/bench/ inside the
                  repository and ../shared/bench/ beside it, and skipped, saying where it looked,
                  when it is in none of them
  gpt_124m        bench_train.py, our AdamW and Muon, compiled bf16, batch 16 x 1024 (16,384 tokens
                  per optimizer step), without the reference and the census (time); goal: AdamW at
                  least 1.00x the plain step
  muon-step       bench_optimizer.py at gpt_124m in bf16: the Muon step against its FLOP floor;
                  goal: at most 3.5 ms
  gpt_1b          bench_train.py --one-at-a-time, gpt_1b compiled, bf16 and FP8 (--fp8, default
                  tensorwise), AdamW and Muon, at the micro-batch the planner picks for the GPU
                  (--batch-size plan: planning/memory_plan.planned_memory within the conf/hardware
                  profile's memory; 15 x 4096 on an H200), 2 warm-up and 3 timed steps each:
                  tokens/s, MFU, peak memory; goal: FP8 at least 1.2x bf16's tokens/s
  moe_1b          bench_train.py, moe_1b with Muon, batch 8 x 2048; goal: MFU at least 35%

FP8 recipe: tensorwise, not rowwise. At gpt_1b's width trainer.fp8_filter=auto (model/fp8.py,
by torchao's own measurements) converts under rowwise only the MLP's w_gate and w_up, 48% of
the model FLOPs, which would have to run 1.53x faster, casts included, for the step to reach
1.2x; under tensorwise every block linear but wk and wv, 84% (1.25x suffices).

Optional steps, left out of the default set because the budget no longer fits them (each runs
with --only NAME): gpt_124m_0.5M (Muon / AdamW at 0.5M tokens per step: 0.984 on 2026-11-26;
40 s), ns-method (bench_ns_method.py's table; muon-step's ns_method=auto row covers the goal;
16 s), ep-dispatch (bench_ep_dispatch.py, expert parallelism's cost on one GPU; not a goal
here; up to 120 s) and dry-runs (dry_run_layouts.py, one rank of gpt_8b, moe_16b and gpt_1b
layouts over fake process groups beside the planner; up to 420 s, most of the budget alone).

The budget (--budget, 530 s: one 10-minute command less wheels and copying): each step's
expected seconds on an H200 (`expect_s`: measured on 2026-11-26 where the step ran then, else
estimated) add up to about 520 s, the alongside steps counted as overlapping test-gpu;
--dry-run prints the sum. Every step runs whether or not an earlier one failed; its time limit
is its own or what is left of the budget, whichever is less, and a step the budget can no
longer fit is skipped, saying so: moe_1b, last, is the first to go (its figures stand from two
earlier runs). A step that runs past its limit is stopped with its whole process group.

Written to --out (default $OUT_DIR, else check-gpu/): NN_<step>.log, each step's full output,
and summary.md, rewritten after every step so that it is complete up to the last step that
ended even if the check itself is killed: the machine, each step's result and time, the test
counts with the names of failures, tokens/s against the plain step, Muon / AdamW, the Muon step
time, the gpt_1b table (bf16 against FP8), the bf16 comparison's tables, and a line per goal.
After every step the whole of --out is also packed into one archive, --archive (default
<out>.tar.gz beside it), so that a killed check still leaves one file to copy back.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Optional

from scripts import REPO
from lab.tools.gpu.check_gpu_logs import (  # re-exported: tests read them through this module
    bench_rows, markdown_tables, muon_over_adamw, number, plain_figures, pytest_outcome, read, table_blocks,
)
from lab.tools.gpu.check_gpu_report import StepLog, goal_lines, section_compare, section_gpt_1b
from lab.tools.gpu.check_gpu_steps import (  # re-exported: tests read them through this module
    DEFAULT_FP8, PLAIN_NAME, Step, expected_s, find_plain, plan,
)
from lab.tools.gpu.process_group import start, wait_or_stop

DEFAULT_BUDGET_S = 530  # of one 10-minute command, leaving time to install wheels and copy logs back


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
    archive: Optional[Path] = None  # default: <out>.tar.gz

    @property
    def archive_path(self) -> Path:
        return self.archive or self.out.with_name(self.out.name + ".tar.gz")


# ----------------------------------------------------------------------------- running


def launch(step: Step, log: Path) -> tuple[Optional[subprocess.Popen], IO[str]]:
    """Start the step, its output into its log (the command first); no process when it cannot
    start (e.g. no such python: this step fails, the next ones still run)."""
    f = open(log, "w")
    f.write(f"$ {step.command}\n")
    f.flush()
    try:
        return start(step.argv, f, REPO), f
    except OSError as err:
        f.write(f"[check_gpu: could not start: {err}]\n")
        return None, f


def finish(proc: Optional[subprocess.Popen], f: IO[str], limit_s: float, started: float) -> tuple[Optional[int], float, bool]:
    """(exit code, seconds, timed out) of a launched step, stopped with its whole process group
    (pytest-xdist workers, torch.compile's workers) once `limit_s` from `started` have passed."""
    rc, timed_out = (127, False) if proc is None else wait_or_stop(proc, limit_s - (time.monotonic() - started))
    if timed_out:
        f.write(f"\n[check_gpu: stopped after {limit_s:.0f} s, the step's time limit]\n")
    f.close()
    return rc, time.monotonic() - started, timed_out


Beside = tuple[Result, Optional[subprocess.Popen], IO[str], float]  # an alongside step in flight


def settle(r: Result, rc: Optional[int], seconds: float, timed_out: bool) -> None:
    r.rc, r.seconds = rc, seconds
    r.status = "timed out" if timed_out else ("ok" if r.rc == 0 else "failed")


def report(check: Check, r: Result) -> None:
    """The step's end: a progress line, summary.md and the archive."""
    progress(check, f"{r.step.name}: {r.status}" + (f" (rc {r.rc})" if r.status == "failed" else "")
             + (f" in {r.seconds:.0f} s" if r.seconds else "") + (f": {r.note}" if r.note else ""))
    write_summary(check)
    write_archive(check)


def join(check: Check, beside: list[Beside], wait: bool = True) -> None:
    """Report the alongside steps in flight that have ended (each stopped at its own limit),
    and with `wait` wait for all of them. Polled, so each step's time is its own end's."""
    while beside:
        for item in list(beside):
            r, proc, f, started = item
            if proc is None or proc.poll() is not None or time.monotonic() - started >= r.limit_s:
                settle(r, *finish(proc, f, r.limit_s, started))
                report(check, r)
                beside.remove(item)
        if not wait or not beside:
            return
        time.sleep(0.2)


def run_foreground(check: Check, r: Result, beside: list[Beside]) -> None:
    """Run step `r` to its end or its limit, reporting the alongside steps as they end meanwhile."""
    started = time.monotonic()
    proc, f = launch(r.step, r.log)
    while proc is not None and proc.poll() is None and time.monotonic() - started < r.limit_s:
        join(check, beside, wait=False)
        time.sleep(0.1)
    settle(r, *finish(proc, f, r.limit_s, started))


def run_all(check: Check, steps: list[Step]) -> list[Result]:
    """Every step in turn, whatever became of the ones before; summary.md and the archive after each."""
    check.out.mkdir(parents=True, exist_ok=True)
    check.results = [Result(s, check.out / f"{i:02d}_{s.name}.log") for i, s in enumerate(steps)]
    beside: list[Beside] = []
    for r in check.results:
        if r.step.timed and beside:
            progress(check, "waiting for " + ", ".join(b[0].step.name for b in beside) + " (a timed step is next)")
            join(check, beside)
        left = check.budget_s - (time.monotonic() - check.started)
        if r.step.skip_reason:
            r.status, r.note = "skipped", r.step.skip_reason
        elif left < r.step.min_s:
            r.status, r.note = "skipped", f"{left:.0f} s left of the {check.budget_s:.0f} s budget, needs {r.step.min_s} s"
        else:
            r.limit_s = min(r.step.limit_s, left)
            r.status = "running"
            write_summary(check)
            progress(check, f"{r.step.name}: running{' alongside the next steps' if r.step.alongside else ''}, "
                            f"time limit {r.limit_s:.0f} s")
            if r.step.alongside:
                started = time.monotonic()
                beside.append((r, *launch(r.step, r.log), started))
                continue
            run_foreground(check, r, beside)
        report(check, r)
    join(check, beside)
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
    state = f"in progress: {', '.join(running)} {'is' if len(running) == 1 else 'are'} running" if running else (
        "finished" if all(r.status not in ("pending", "running") for r in check.results) else "in progress")
    out = [f"# GPU check ({check.started_at})", "",
           f"`{check.command}`: {state}, {elapsed:.0f} s of a {check.budget_s:.0f} s budget so far.", ""]
    machine = by_name.get("machine")
    if machine and machine.status not in ("pending", "running", "skipped"):
        text = "\n".join(line for line in read(machine.log).splitlines()[1:] if line.strip())
        out += ["## Machine", "", "```text", text, "```", ""]
    out += steps_table(check)
    logs = step_logs(check)
    out += goal_lines(logs)
    if "test-gpu" in by_name:
        out += section_tests(by_name["test-gpu"])
    if {"plain", "gpt_124m", "gpt_124m_0.5M"} & by_name.keys():
        out += section_throughput(by_name)
    if {"muon-step", "ns-method"} & by_name.keys():
        lines = muon_step_lines(by_name)
        out += ["## Muon step at gpt_124m (84 matrices), bf16", ""] + (lines or ["No figure found in the logs."]) + [""]
    if {"gpt_1b", "gpt_1b-loss"} & by_name.keys():
        out += section_gpt_1b(logs)
    if "compare-bf16" in by_name:
        out += section_compare(logs)
    if "muon-step" in by_name:
        out += section_tables("bench_optimizer.py, gpt_124m, bf16", by_name["muon-step"])
    if "ns-method" in by_name:
        out += section_tables("Newton-Schulz method (bench_ns_method.py --dtype bf16 --stack 0)", by_name["ns-method"])
    for name in ("gpt_124m", "gpt_124m_0.5M", "moe_1b"):  # gpt_1b: its own section above
        if name in by_name:
            out += section_tables(f"bench_train.py: {by_name[name].step.what}", by_name[name], keep="| model |")
    if "dry-runs" in by_name:
        out += section_tables(f"Dry runs: {by_name['dry-runs'].step.what}", by_name["dry-runs"])
    if "ep-dispatch" in by_name:
        out += section_tables(f"bench_ep_dispatch.py: {by_name['ep-dispatch'].step.what}", by_name["ep-dispatch"])
    return "\n".join(out)


def step_logs(check: Check) -> dict[str, StepLog]:
    """Each step as lab/tools/gpu/check_gpu_report.py reads it: its log once it ran, else why not."""
    return {r.step.name: StepLog("" if r.status in ("pending", "running", "skipped") else read(r.log),
                                 not_run(r) if r.status in ("pending", "running", "skipped") else "",
                                 r.seconds, r.step.what) for r in check.results}


def write_archive(check: Check) -> None:
    """The whole of --out as one .tar.gz, replaced whole: the file to copy back, even from a
    check killed half-way."""
    target = check.archive_path
    tmp = target.with_name(target.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(check.out, arcname=check.out.name, filter=lambda info: None if info.name.endswith(".tmp") else info)
    tmp.replace(target)


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


def print_plan(steps: list[Step], left_out: list[Step], budget_s: float, out: Path, archive: Path, note: str) -> None:
    """--dry-run: each step's command, limits and expected seconds, their expected total
    against the budget, and the optional steps left out with the reason for each."""
    print(f"budget {budget_s:.0f} s; output in {out}, archive {archive}")
    if note:
        print(note)
    for s in steps:
        how = "alongside the next steps, " if s.alongside else "timed, alone on the machine, " if s.timed else ""
        print(f"\n{s.name} ({how}time limit {s.limit_s} s, skipped with under {s.min_s} s left, "
              f"expected {s.expect_s} s): {s.what}")
        print(f"  not run: {s.skip_reason}" if s.skip_reason else f"  $ {s.command}")
    total = expected_s(steps)
    print(f"\nexpected about {total:.0f} s of the {budget_s:.0f} s budget (alongside steps overlap the steps "
          f"after them up to the next timed one){'' if total <= budget_s else ': OVER THE BUDGET'}")
    for s in left_out:
        print(f"\noptional, not run (--only {s.name}; time limit {s.limit_s} s, expected {s.expect_s} s): "
              f"{s.what}: {s.optional}")


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
    ap.add_argument("--only", nargs="+", default=None,
                    help="run only these steps, optional ones included (machine always runs)")
    ap.add_argument("--fp8", default=DEFAULT_FP8, choices=("rowwise", "tensorwise"),
                    help=f"trainer.fp8 recipe of the gpt_1b steps (default {DEFAULT_FP8})")
    ap.add_argument("--archive", default=None, help="the .tar.gz of --out (default: <out>.tar.gz beside it)")
    ap.add_argument("--python", default=sys.executable, help="python of the steps (default: this one)")
    ap.add_argument("--dry-run", action="store_true", help="print the steps, their commands and the budget; run nothing")
    args = ap.parse_args(argv)

    plain, looked = find_plain(args.plain)
    workers = args.xdist if importlib.util.find_spec("xdist") is not None else 0
    every = plan(args.python, plain, looked, workers, Path(args.out).resolve(), args.fp8)
    if args.only:
        unknown = set(args.only) - {s.name for s in every}
        if unknown:
            ap.error(f"--only: unknown step(s) {', '.join(sorted(unknown))}; the steps are "
                     + ", ".join(s.name for s in every))
    steps = [s for s in every if s.name == "machine" or (s.name in args.only if args.only else not s.optional)]
    check = Check(Path(args.out).resolve(), args.budget, "lab/tools/gpu/check_gpu.py " + shlex.join(argv or sys.argv[1:]),
                  archive=Path(args.archive).resolve() if args.archive else None)
    if args.dry_run:
        print_plan(steps, [s for s in every if s.optional and s not in steps], args.budget, check.out,
                   check.archive_path,
                   "" if workers or not args.xdist else "pytest-xdist is not installed here: test-gpu runs serially")
        return 0
    results = run_all(check, steps)
    progress(check, f"summary: {check.out / 'summary.md'}; archive: {check.archive_path}")
    return 0 if all(r.status == "ok" for r in results if not r.step.skip_reason) else 1


if __name__ == "__main__":
    sys.exit(main())
