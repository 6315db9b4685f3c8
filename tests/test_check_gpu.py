"""lab/tools/gpu/check_gpu.py (`make check-gpu`) without a GPU: its log readers on excerpts of the
logs of our 2026-11-25 H200 run (../shared/gpu_runs/2026-11-25_h200/), and its orchestration
with stand-in steps: every step runs after a failure or a timeout, the budget skips what no
longer fits, and summary.md is there after every step."""
from __future__ import annotations

import re
import signal
import sys
import tarfile
import time
from pathlib import Path


from lab.tools.gpu import check_gpu


from lab.tools.gpu import check_gpu_logs


from lab.tools.gpu import check_gpu_steps
from lab.tools.gpu.check_gpu import Check, Result, Step
from tests.closeness import approx

# test_gpu.log, the end of `python3 -m pytest -m gpu -q -n 12 --tb=short -rfEs`.
PYTEST_LOG = """\
bringing up nodes...

s...........................F......F......s.                             [100%]
=================================== FAILURES ===================================
___________ test_muon_compiled_updates_on_cuda_equal_the_eager_ones ____________
E   AssertionError: Tensor-likes are not close!
=========================== short test summary info ============================
FAILED tests/test_gpu.py::test_flex_attention_head_max_equals_the_explicit_logits_on_cuda[dtype1]
FAILED tests/test_gpu.py::test_muon_compiled_updates_on_cuda_equal_the_eager_ones
SKIPPED [2] tests/test_gpu.py:142: needs 2 GPUs for NCCL between processes, 1 visible
2 failed, 40 passed, 2 skipped, 143 warnings in 85.66s (0:01:25)
"""

# bench_train.log (gpt_124m, compiled bf16, --census), the result table and what follows it.
BENCH_LOG = """\
Batch 16 x 1024 tokens per step; ours: optim=adamw/muon; reference: AdamW. 3 warm-up + 3 interleaved rounds x 10 step(s), median.

| precision | F.linear 8192^2 GFLOP/s, before | after | peak used |
| --- | ---: | ---: | ---: |
| bf16 | 707575.6 | 767576.3 | 767576.3 |

| model | impl | optim | mode | precision | tokens/step | step s | tokens/s | model GFLOP/s | MFU | ours / reference | kernels/step | host syncs/step | GPU busy | peak GiB | notes |
| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |
| gpt_124m | ours | adamw | compiled | bf16 | 16384 | 0.028 | 577,695 | 348947.8 | 45.5% | 1.01 | 1003 | 0.0 | 90% | 6.94 |  |
| gpt_124m | ours | muon | compiled | bf16 | 16384 | 0.033 | 494,105 | 298457.0 | 38.9% | 0.86 | 1301 | 0.0 | 90% | 6.62 |  |
| gpt_124m | reference | adamw | compiled | bf16 | 16384 | 0.029 | 573,016 | 346122.0 | 45.1% |  | 953 | 0.0 | 92% | 6.94 |  |

Model FLOPs per trained token (eval/flops.py: 6 x active matmul weights + causal attention, seq_len 1024): gpt_124m 604.0 M.
Wall time: 70 s.
"""

# summary.log, the plain step's line.
PLAIN_LOG = ("REF compiled d=768 L=12 T=1024 B=16 V=8192: 27.7 ms/step 590,518 tok/s  MFU 49.7% of measured "
             "peak 785 TFLOP/s (6N+12LdT, N=91.2M matmul params)  mem 7.0 GiB\n")

# ns.log, its last table.
NS_LOG = """\
| model | what | standard ms | gram ms | speed-up |
| --- | --- | ---: | ---: | ---: |
| gpt_124m | whole Muon step, 84 matrices | 6 | 6 | **1.12x** |

rounds kept 63, redone for foreign CPU load 13
"""


def test_pytest_outcome_reads_counts_failures_and_time():
    t = check_gpu.pytest_outcome(PYTEST_LOG)
    assert t["complete"]
    assert t["counts"] == {"failed": 2, "passed": 40, "skipped": 2, "warning": 143}
    assert t["failures"] == [
        "tests/test_gpu.py::test_flex_attention_head_max_equals_the_explicit_logits_on_cuda[dtype1]",
        "tests/test_gpu.py::test_muon_compiled_updates_on_cuda_equal_the_eager_ones",
    ]
    assert t["seconds"] == approx(85.66)


def test_pytest_outcome_of_a_run_stopped_early_counts_the_progress_line():
    t = check_gpu.pytest_outcome("bringing up nodes...\n\ns....F..E.\n")
    assert not t["complete"] and t["seconds"] is None
    assert t["counts"] == {"passed": 7, "failed": 1, "skipped": 1, "error": 1}


def test_bench_rows_plain_step_and_muon_over_adamw():
    rows = check_gpu.bench_rows(BENCH_LOG)
    assert [(r["impl"], r["optim"]) for r in rows] == [("ours", "adamw"), ("ours", "muon"), ("reference", "adamw")]
    assert check_gpu.number(rows[0]["tokens/s"]) == 577695
    assert check_gpu.number(rows[1]["MFU"]) == 38.9
    plain = check_gpu.plain_figures(PLAIN_LOG)
    assert plain == {"ms": 27.7, "tokens_s": 590518.0, "mfu": 49.7}
    ratios = check_gpu.muon_over_adamw(rows)
    assert ratios.keys() == {16384} and ratios[16384] == approx(494105 / 577695)
    assert check_gpu.number("**1.12x**") == 1.12 and check_gpu.number("") is None


def _result(tmp_path: Path, name: str, text: str, status: str = "ok", rc: int = 0) -> Result:
    log = tmp_path / f"{name}.log"
    log.write_text(f"$ the command of {name}\n{text}")
    return Result(Step(name, name, ["true"], 1, 0), log, status=status, rc=rc, seconds=1.0)


def test_summary_of_the_h200_logs(tmp_path):
    check = Check(tmp_path, 530, "lab/tools/gpu/check_gpu.py")
    check.results = [
        _result(tmp_path, "machine", "python 3.12.3\ntorch 2.11.0+cu130\n"),
        _result(tmp_path, "test-gpu", PYTEST_LOG, "failed", 1),
        _result(tmp_path, "plain", PLAIN_LOG),
        _result(tmp_path, "gpt_124m", BENCH_LOG),
        _result(tmp_path, "ns-method", NS_LOG),
        Result(Step("moe_1b", "moe_1b", ["true"], 1, 0, "no time left"), tmp_path / "moe_1b.log", status="skipped",
               note="no time left"),
    ]
    text = check_gpu.render(check)
    assert "torch 2.11.0+cu130" in text
    assert "**40 passed, 2 failed, 2 skipped in 86 s**" in text
    assert "`tests/test_gpu.py::test_muon_compiled_updates_on_cuda_equal_the_eager_ones`" in text
    assert "needs 2 GPUs for NCCL" in text
    assert "**590,518 tokens/s**" in text
    # ours AdamW / the plain step, and Muon / AdamW at 16,384 tokens per optimizer step
    assert "| ours | adamw | 16384 | 0.028 | 577,695 | 45.5% | 1.01 | 0.978 |" in text
    assert "**0.855** at 16,384 tokens per optimizer step" in text
    assert "standard ms 6, gram ms 6" in text  # the whole Muon step's time
    assert "| moe_1b | moe_1b | skipped: no time left |" in text


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _group_alive(pgid: int) -> list[int]:
    """The processes of process group `pgid` that are still running (zombies, dead and only
    waiting for their parent to collect them, are left out)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError):  # gone while being read
            continue
        if int(pgrp) == pgid and state != "Z":
            alive.append(int(stat.parent.name))
    return alive


# The slow step: a child of its own (as pytest-xdist workers would be), both pids printed.
SLOW = ("import os, subprocess, sys, time; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print('started', os.getpid(), child.pid, flush=True); time.sleep(60)")


def test_every_step_runs_after_a_failure_and_a_timeout(tmp_path):
    steps = [
        Step("first", "fails", _python("import sys; print('ran'); sys.exit(3)"), 30, 0),
        Step("slow", "outlives its limit", _python(SLOW), 3, 0),
        Step("missing", "cannot run", ["true"], 30, 0, "the file is not there"),
        Step("absent", "cannot start", [str(tmp_path / "no-such-python")], 30, 0),
        Step("last", "passes", _python("print('| a | b |\\n| --- | --- |\\n| 1 | 2 |')"), 30, 0),
    ]
    check = Check(tmp_path / "out", 60, "test")
    results = check_gpu.run_all(check, steps)
    # The slow step ended by the SIGTERM sent to its process group, not by itself.
    assert [(r.status, r.rc) for r in results] == [("failed", 3), ("timed out", -signal.SIGTERM), ("skipped", None),
                                                   ("failed", 127), ("ok", 0)]
    assert "ran" in results[0].log.read_text()
    slow_log = results[1].log.read_text()
    assert "stopped after 3 s" in slow_log
    # The whole group went, the child too. Its SIGTERM may still be being delivered when the
    # leader's exit is seen, so the check waits for it (at most 30 s; a group alive then fails).
    leader, child = (int(x) for x in slow_log.split("started ", 1)[1].split()[:2])
    deadline = time.monotonic() + 30
    while _group_alive(leader) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _group_alive(leader) == [], (leader, child)
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "finished" in summary
    for line in ("| first | fails | failed (exit code 3) |", "| slow | outlives its limit | timed out |",
                 "| missing | cannot run | skipped: the file is not there |",
                 "| absent | cannot start | failed (exit code 127) |", "| last | passes | ok |"):
        assert line in summary


def test_a_step_the_budget_no_longer_fits_is_skipped(tmp_path):
    steps = [Step("quick", "", _python("pass"), 30, 0), Step("big", "", _python("pass"), 30, 3600)]
    results = check_gpu.run_all(Check(tmp_path, 60, "test"), steps)
    assert results[0].status == "ok"
    assert results[1].status == "skipped" and "budget" in results[1].note


def test_dry_run_lists_the_default_steps_within_the_budget_and_the_optional_ones(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(check_gpu_steps, "REPO", tmp_path / "repo")  # where find_plain looks
    monkeypatch.delenv("PLAIN_STEP", raising=False)
    assert check_gpu.main(["--dry-run", "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    default = ("machine", "compare-bf16", "gpt_1b-loss", "test-gpu", "plain", "gpt_124m", "muon-step", "gpt_1b", "moe_1b")
    starts = [out.index(f"\n{name} (") for name in default]
    assert starts == sorted(starts)  # in this order
    assert "\ncompare-bf16 (alongside the next steps, time limit 240 s" in out
    assert "\ngpt_1b (timed, alone on the machine, time limit 200 s" in out
    expected = int(re.search(r"expected about (\d+) s of the 530 s budget", out).group(1))
    assert expected == 529 and "OVER THE BUDGET" not in out
    for name in ("gpt_124m_0.5M", "ns-method", "ep-dispatch", "dry-runs"):  # listed, with the reason
        assert re.search(rf"\noptional, not run \(--only {re.escape(name)}; .*: .*(budget|420 s)", out), name
    assert "plain_gpt_step.py not found" in out and str(tmp_path / "shared" / "bench") in out
    assert "-m pytest -m gpu" in out and "--models moe_1b" in out
    assert "reference_bf16.py --out " + str(tmp_path / "o" / "compare-bf16") + " --timeout 200" in out
    assert "--fp8 none tensorwise --optims adamw muon --batch-size plan --seq-len 4096 --one-at-a-time" in out
    assert "--losses trainer.max_steps=200" in out and "--warmup 1 --rounds 1 --steps 199" in out
    assert not (tmp_path / "o").exists()  # a dry run writes nothing


def test_only_runs_an_optional_step_and_the_budget_arithmetic_overlaps_alongside_steps(tmp_path, capsys):
    assert check_gpu.main(["--dry-run", "--out", str(tmp_path / "o"), "--only", "dry-runs", "--fp8", "rowwise"]) == 0
    out = capsys.readouterr().out
    assert "\ndry-runs (timed" in out and "\ngpt_1b (" not in out and "expected about 428 s" in out
    step = lambda name, s, **kw: Step(name, "", ["true"], 1, 0, expect_s=s, **kw)  # noqa: E731
    # 10, then 100 beside 30 + 20 (the timed step waits for it), then 5: 10 + 100 + 5
    assert check_gpu.expected_s([step("a", 10), step("b", 100, alongside=True), step("c", 30), step("d", 20),
                                 step("e", 5, timed=True)]) == 115
    assert check_gpu.expected_s([step("a", 10), step("b", 100, alongside=True), step("c", 30)]) == 110


# The logs of the new steps, in the form their scripts print. The figures are made up (no GPU
# run of these steps exists yet); the tests check the summary's arithmetic on them.
GPT_1B_LOG = """\
Micro-batch from the planner: 15 x 4096 tokens, the largest whose planned peak on one GPU \
(planning/memory_plan.planned_memory) fits in 141 GB (conf/hardware/h200_sxm.yaml) for gpt_1b bf16: planned peak \
adamw 135.7 GB, muon 131.9 GB.

Micro-batch 15 x 4096 tokens; tokens per optimizer step: 61440 (1 micro-batch); ours: optim=adamw/muon; \
fp8=none/tensorwise; reference: AdamW, the same micro-batches. 2 warm-up + 1 rounds, each configuration alone, \
x 3 optimizer step(s), median.

| model | impl | optim | mode | precision | tokens/step | step s | tokens/s | model GFLOP/s | MFU | ours / reference | peak GiB | notes |
| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |
| gpt_1b | ours | adamw | compiled | bf16 | 61440 | 1.536 | 40,000 | 269785.5 | 38.5% |  | 118.20 |  |
| gpt_1b | ours | muon | compiled | bf16 | 61440 | 1.600 | 38,400 | 258994.1 | 37.0% |  | 114.90 |  |
| gpt_1b | ours | adamw | compiled | bf16+fp8 tensorwise | 61440 | 1.229 | 50,000 | 337231.9 | 48.1% |  | 110.40 |  |
| gpt_1b | ours | muon | compiled | bf16+fp8 tensorwise | 61440 | 1.391 | 44,160 | 297843.2 | 42.6% |  | 107.00 |  |
"""

GPT_1B_LOSS_LOG = """\
Micro-batch 2 x 1024 tokens; tokens per optimizer step: 2048 (1 micro-batch); ours: optim=muon; \
fp8=none/tensorwise trainer.max_steps=200; reference: AdamW, the same micro-batches. 1 warm-up + 1 interleaved \
rounds x 199 optimizer step(s), median.

| model | optim | mode | precision | tokens/step | steps trained | train/loss, last step | val/val/loss | val/ood_prose/loss |
| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |
| gpt_1b | muon | eager | bf16 | 2048 | 200 | 4.1234 | 4.5000 | 6.1000 |
| gpt_1b | muon | eager | bf16+fp8 tensorwise | 2048 | 200 | 4.1301 | 4.5180 | 6.1100 |
"""

COMPARE_LOG = """\
$ python scripts/fair_compare.py --rerun lab/results/fair/gpt_small --out check-gpu/compare-bf16 ...
| split | speedup | 95% interval | one-sided p |

reference_bf16: lab/results/fair/gpt_small rerun in bf16 into check-gpu/compare-bf16; 151 s

| split | speedup | 95% interval | one-sided p |
|---|---:|---|---|
| val/val/loss | 1.21x | 1.08x to 1.37x | p(> 1x) = 0.0012, p(> 1.1x) = 0.0610 |
| val/ood_prose/loss | 1.15x | 0.98x to 1.33x | p(> 1x) = 0.0390, p(> 1.1x) = 0.2701 |
"""

MUON_STEP_LOG = """\
## Optimizer step against its Newton-Schulz FLOP floor

| NS dtype | floor ms | ours ms | x floor | ours, compile_updates ms | x floor | ours, CUDA graphs ms | x floor | ours, compile_updates + CUDA graphs ms | x floor | ours, all three + ns_method=auto ms | x floor |
|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|
| bf16 | 2.40 | 9.81 | 4.09 | 7.02 | 2.93 | 6.90 | 2.88 | 6.05 | 2.52 | 6.17 | 2.57 |
"""

MOE_LOG = """\
| model | impl | optim | mode | precision | tokens/step | step s | tokens/s | model GFLOP/s | MFU | ours / reference | notes |
| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |
| moe_1b | ours | muon | compiled | bf16 | 16384 | 0.185 | 88,497 | 165305.3 | 22.5% |  |  |
"""


def test_the_new_steps_readers():
    rows = check_gpu.bench_rows(GPT_1B_LOG)
    assert check_gpu_logs.fp8_over_bf16(rows) == {"adamw": ("bf16+fp8 tensorwise", approx(1.25)),
                                                  "muon": ("bf16+fp8 tensorwise", approx(1.15))}
    assert check_gpu_logs.planner_line(GPT_1B_LOG).startswith("Micro-batch from the planner: 15 x 4096 tokens")
    assert check_gpu_logs.bench_row(rows, "muon", 61440, "bf16")["peak GiB"] == "114.90"
    change = check_gpu_logs.fp8_loss_change(check_gpu_logs.loss_rows(GPT_1B_LOSS_LOG), "val/val/loss")
    assert change == {"muon": ("bf16+fp8 tensorwise", approx(4.518 / 4.5 - 1))}
    ms = check_gpu_logs.muon_step_ms(MUON_STEP_LOG)
    assert ms["floor ms"] == 2.40 and ms["ours, all three + ns_method=auto ms"] == 6.17 and min(ms.values()) == 2.40
    assert check_gpu_logs.verdict(1.2, 1.2) == "**met**" and check_gpu_logs.verdict(0.011, 0.01, False) == "**not met**"


def test_summary_states_each_goal_against_the_new_steps_logs(tmp_path):
    check = Check(tmp_path, 530, "lab/tools/gpu/check_gpu.py")
    check.results = [
        _result(tmp_path, "machine", "python 3.12.3\ntorchao 0.15.0\n"),
        _result(tmp_path, "compare-bf16", COMPARE_LOG),
        _result(tmp_path, "gpt_1b-loss", GPT_1B_LOSS_LOG),
        _result(tmp_path, "test-gpu", PYTEST_LOG, "failed", 1),
        _result(tmp_path, "plain", PLAIN_LOG),
        _result(tmp_path, "gpt_124m", BENCH_LOG),
        _result(tmp_path, "muon-step", MUON_STEP_LOG),
        _result(tmp_path, "gpt_1b", GPT_1B_LOG),
        _result(tmp_path, "moe_1b", MOE_LOG),
    ]
    check.results[1].seconds = 187.0
    text = check_gpu.render(check)
    goals = text[text.index("## The goals against this run"):text.index("## Tests")]
    assert "6.17 ms (ours, all three + ns_method=auto), **not met**; fastest variant 6.05 ms" in goals
    assert "floor 2.40 ms" in goals
    assert "moe_1b with Muon, MFU at least 35%: 22.5% (88,497 tokens/s), **not met**" in goals
    assert "at least 1.00x: **0.978** (577,695 against 590,518 tokens/s), **not met**" in goals
    assert "adamw **1.250** (bf16+fp8 tensorwise), **met**; muon **1.150** (bf16+fp8 tensorwise), **not met**" in goals
    assert "muon +0.40% (bf16+fp8 tensorwise), **met**" in goals
    assert "at most 240 s: 187 s, **met**" in goals
    # the gpt_1b table: the planner's batch, each row's ratio and goal, the loss rows
    assert "Micro-batch from the planner: 15 x 4096 tokens" in text
    assert "| bf16+fp8 tensorwise | adamw | 61440 | 50,000 | 48.1% | 110.40 | **1.250** | **met** |" in text
    assert "| bf16 | muon | 61440 | 38,400 | 37.0% | 114.90 |  |  |" in text
    assert "| bf16+fp8 tensorwise | muon | 200 | 4.1301 | 4.5180 | +0.40% | **met** |" in text
    # the bf16 comparison: its honest ratio with the interval, verbatim
    assert "Took 187 s (goal: at most 240 s)" in text
    assert "| val/val/loss | 1.21x | 1.08x to 1.37x | p(> 1x) = 0.0012, p(> 1.1x) = 0.0610 |" in text
    assert "| val/ood_prose/loss | 1.15x | 0.98x to 1.33x |" in text


def test_goal_lines_say_why_a_figure_is_missing(tmp_path):
    check = Check(tmp_path, 530, "lab/tools/gpu/check_gpu.py")
    check.results = [_result(tmp_path, "machine", "python 3.12.3\n"),
                     Result(Step("gpt_1b", "gpt_1b", ["true"], 1, 0), tmp_path / "gpt_1b.log", status="skipped",
                            note="100 s left of the 530 s budget, needs 120 s"),
                     _result(tmp_path, "moe_1b", "Traceback (most recent call last):\n", "failed", 1)]
    text = check_gpu.render(check)
    assert "FP8 tokens/s at least 1.2x bf16's: no figure (Not run: 100 s left of the 530 s budget" in text
    assert "MFU at least 35%: no figure (no moe_1b row with an MFU in the log)" in text
    assert "in at most 240 s: no figure (not planned in this check)" in text


def test_alongside_steps_overlap_and_the_archive_holds_every_log(tmp_path):
    marker = tmp_path / "alongside-ended"
    steps = [
        Step("beside", "", _python(f"import time, pathlib; time.sleep(1); pathlib.Path({str(marker)!r}).touch()"), 30,
             0, alongside=True),
        Step("next", "", _python(f"import pathlib, time; print('beside still running:', not pathlib.Path({str(marker)!r})"
                                 ".exists(), flush=True); time.sleep(1.5)"), 30, 0),
        Step("timed", "", _python(f"import pathlib; print('beside ended:', pathlib.Path({str(marker)!r}).exists())"), 30,
             0, timed=True),
    ]
    check = Check(tmp_path / "out", 60, "test")
    results = check_gpu.run_all(check, steps)
    assert [r.status for r in results] == ["ok", "ok", "ok"]
    assert "beside still running: True" in results[1].log.read_text()  # it ran while the first one slept
    assert "beside ended: True" in results[2].log.read_text()  # the timed step waited for it
    assert 1.0 <= results[0].seconds < 1.4 < results[1].seconds  # each step's time is its own
    with tarfile.open(tmp_path / "out.tar.gz") as tar:
        names = set(tar.getnames())
        assert {"out/summary.md", "out/00_beside.log", "out/01_next.log", "out/02_timed.log"} <= names
        summary = tar.extractfile("out/summary.md").read().decode()
    assert "finished" in summary and "| timed |  | ok |" in summary
