"""scripts/check_gpu.py (`make check-gpu`) without a GPU: its log readers on excerpts of the
logs of our 2026-11-25 H200 run (../shared/gpu_runs/2026-11-25_h200/), and its orchestration
with stand-in steps: every step runs after a failure or a timeout, the budget skips what no
longer fits, and summary.md is there after every step."""
from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from scripts import check_gpu
from scripts.check_gpu import Check, Result, Step

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
    assert t["seconds"] == pytest.approx(85.66)


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
    assert ratios.keys() == {16384} and ratios[16384] == pytest.approx(494105 / 577695)
    assert check_gpu.number("**1.12x**") == 1.12 and check_gpu.number("") is None


def _result(tmp_path: Path, name: str, text: str, status: str = "ok", rc: int = 0) -> Result:
    log = tmp_path / f"{name}.log"
    log.write_text(f"$ the command of {name}\n{text}")
    return Result(Step(name, name, ["true"], 1, 0), log, status=status, rc=rc, seconds=1.0)


def test_summary_of_the_h200_logs(tmp_path):
    check = Check(tmp_path, 530, "scripts/check_gpu.py")
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


def test_dry_run_names_every_step_and_a_missing_plain_step(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(check_gpu, "REPO", tmp_path / "repo")
    monkeypatch.delenv("PLAIN_STEP", raising=False)
    assert check_gpu.main(["--dry-run", "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    for name in ("machine", "test-gpu", "plain", "gpt_124m", "gpt_124m_0.5M", "ns-method", "muon-step", "moe_1b",
                 "ep-dispatch"):
        assert f"\n{name} (time limit" in out
    assert "plain_gpt_step.py not found" in out and str(tmp_path / "shared" / "bench") in out
    assert "-m pytest -m gpu" in out and "--tokens-per-step 524288" in out
    assert "bench_ns_method.py --dtype bf16 --stack 0" in out and "--models moe_1b" in out
    assert "bench_ep_dispatch.py --model moe_1b" in out
    assert not (tmp_path / "o").exists()  # a dry run writes nothing
