"""Profiling: per-rank Chrome traces of a step window, and the time breakdown read from them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval import trace_stats as ts
from tests.conftest import compose
from tests.prestarted import run_python
from tests.distributed import run_distributed
from tests.closeness import approx
from trainer.config import ConfigError, to_dataclass, validate

FAST = [
    "model=gpt_tiny", "optim=muon", "optim.muon.ns_dtype=fp32", "trainer.precision=fp32",
    "trainer.device=cpu", "trainer.seq_len=32", "trainer.batch_size=1", "trainer.max_steps=3", "logger.interval=1",
    "eval.interval=0", "eval.batches=1", "eval.batch_size=2", "logger.wandb.mode=disabled",
    "logger.tensorboard=false", "logger.progress=none", "optim.warmup_steps=1",
    "profile.enabled=true", "profile.steps=[2,3]",
]
PHASES = ("forward_backward", "grad_sync", "optimizer", "eval")


def _train_worker(rank: int, world: int, run_dir: str, overrides: list[str]) -> None:
    from trainer.loop import Trainer
    from parallel.mesh import build_mesh

    cfg = to_dataclass(compose(FAST + overrides))
    Trainer(cfg, Path(run_dir), build_mesh(cfg.parallel.tp)).train()


# --- recording ------------------------------------------------------------------------


def test_single_process_run_writes_a_chrome_trace_with_our_regions(tmp_path):
    from trainer.loop import Trainer

    Trainer(to_dataclass(compose(FAST)), tmp_path).train()
    traces = sorted(p.name for p in (tmp_path / "traces").iterdir())
    assert traces == ["rank0.json"]
    trace = json.loads((tmp_path / "traces" / "rank0.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"ProfilerStep#2", "ProfilerStep#3", *PHASES} <= names
    assert "ProfilerStep#1" not in names  # only the chosen window is recorded
    stats = ts.analyze(trace)
    assert stats.steps == [2, 3] and stats.timeline == "cpu"
    assert stats.parts["compute"] > 0 and stats.parts["comm"] == 0  # one process: nothing to send
    assert stats.parts["eval"] > 0  # the last step evaluates
    assert abs(sum(stats.fractions.values()) - 1) < 1e-6


def test_regions_cost_nothing_when_no_profiler_records():
    from parallel import comm

    assert comm.region("forward_backward") is comm._NO_REGION
    assert comm._comm_region(None, "all_reduce") is comm._NO_REGION


@pytest.fixture(scope="module")
def dp2_run(tmp_path_factory) -> Path:
    """DP=2 x TP=2 on 4 gloo processes: both kinds of communication in one trace."""
    run_dir = tmp_path_factory.mktemp("dp2tp2")
    run_distributed(_train_worker, 4, str(run_dir), ["parallel.tp=2"])
    return run_dir


def test_dp2_tp2_trace_reports_compute_and_communication_on_every_rank(dp2_run):
    ranks = ts.analyze_run(dp2_run)
    assert [r.rank for r in ranks] == [0, 1, 2, 3]
    for r in ranks:
        assert r.steps == [2, 3]
        assert r.parts["compute"] > 0 and r.parts["comm"] > 0 and r.optimizer_step > 0
        assert all(0 <= f <= 1 for f in r.fractions.values())
        assert abs(sum(r.fractions.values()) - 1) < 1e-6
        # ZeRO-1: gradients are reduce-scattered, parameters all-gathered over DP.
        assert r.comm_by_op.get("dp/reduce_scatter", 0) > 0 and r.comm_by_op.get("dp/all_gather", 0) > 0
        # Row-parallel outputs are all-reduced over TP, and Muon gathers the sharded momenta.
        assert r.comm_by_op.get("tp/all_reduce", 0) > 0 and r.comm_by_op.get("tp/all_gather", 0) > 0
        assert sum(r.comm_by_op.values()) == approx(r.parts["comm"])


def test_analyze_trace_script_compares_two_runs(dp2_run):
    proc = run_python(["scripts/analyze_trace.py", str(dp2_run), str(dp2_run / "traces")], timeout=120)
    assert proc.returncode == 0, proc.stderr
    print(proc.stdout)  # the report, for reading with pytest -s
    assert "ratio B/A 1.000" in proc.stdout  # a run against itself
    assert "B - A +0.00 points" in proc.stdout
    assert "MiB" in proc.stdout  # state memory from metrics.jsonl
    assert "dp/reduce_scatter" in proc.stdout


# --- the interval maths, on synthetic traces with known answers -----------------------


def test_interval_union_intersection_and_difference():
    assert ts.union([(5, 7), (0, 2), (1, 3), (3, 4), (6, 6)]) == [(0, 4), (5, 7)]
    assert ts.intersect([(0, 4), (5, 10)], [(2, 6), (8, 12)]) == [(2, 4), (5, 6), (8, 10)]
    assert ts.subtract([(0, 10), (20, 30)], [(2, 3), (5, 22), (29, 40)]) == [(0, 2), (3, 5), (22, 29)]
    assert ts.length(ts.union([(0, 10), (2, 3), (2, 8)])) == 10  # nested: not 10 + 1 + 6


def x(name: str, start: float, end: float, tid: int = 1, cat: str = "user_annotation", **args) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": start, "dur": end - start, "pid": 1, "tid": tid, "args": args}


def test_cpu_breakdown_unions_nested_events_and_partitions_the_step():
    events = [
        x("ProfilerStep#4", 0, 100),
        x("forward_backward", 5, 45),
        x("aten::linear", 5, 20, cat="cpu_op"), x("aten::addmm", 10, 15, cat="cpu_op"),
        x("aten::mul", 25, 40, cat="cpu_op"),
        x("grad_sync", 45, 60),
        x("comm/dp/reduce_scatter", 47, 57),
        x("c10d::_reduce_scatter_base_", 48, 56, cat="cpu_op"),  # inside ours: not counted again
        x("gloo:reduce_scatter", 46, 58, tid=2),  # the backend's own thread: not this timeline
        x("optimizer", 60, 90), x("aten::mm", 61, 70, cat="cpu_op"),
        x("comm/dp/all_gather", 75, 85),
        x("c10d::allgather_", 92, 95, cat="cpu_op"),  # a collective outside our regions
        x("ProfilerStep#5", 100, 200),
        x("eval", 150, 190), x("comm/dp/all_reduce", 160, 170),
        x("aten::mm", 195, 205, cat="cpu_op"),  # runs past the last step: clipped
    ]
    s = ts.analyze({"traceEvents": events, "distributedInfo": {"rank": 3}})
    assert s.rank == 3 and s.steps == [4, 5] and s.timeline == "cpu"
    assert s.step_time == 200
    # busy: [5, 90] + [92, 95] + [150, 190] + [195, 200]
    assert s.parts == {"comm": 10 + 10 + 3 + 10, "optimizer": 30 - 10, "eval": 40 - 10,
                       "compute": (85 + 3 + 40 + 5) - 33 - 20 - 30, "idle": 200 - 133}
    assert s.optimizer_step == 30
    assert s.comm_by_op == {"dp/reduce_scatter": 10, "dp/all_gather": 10, "c10d::allgather_": 3,
                            "dp/all_reduce": 10}
    assert sum(s.fractions.values()) == approx(1)


def test_cuda_breakdown_uses_the_device_timeline_and_launch_regions():
    launch = lambda t, corr: x("cudaLaunchKernel", t, t + 1, cat="cuda_runtime", correlation=corr)  # noqa: E731
    kernel = lambda name, a, b, corr: x(name, a, b, tid=7, cat="kernel", correlation=corr)  # noqa: E731
    events = [
        x("ProfilerStep#1", 0, 100), x("forward_backward", 0, 40), launch(5, 1), launch(10, 2),
        x("optimizer", 40, 60), launch(45, 3), x("comm/dp/all_gather", 50, 55), launch(51, 4),
        x("ProfilerStep#2", 100, 150), launch(105, 5),
        # The device runs behind the host: step 1's kernels spill into step 2's window.
        kernel("gemm", 20, 50, 1), kernel("gemm", 50, 80, 2), kernel("adam", 80, 90, 3),
        kernel("ncclDevKernel_AllGather_RING_LL(args)", 90, 110, 4), kernel("gemm", 110, 130, 5),
    ]
    s = ts.analyze({"traceEvents": events})
    assert s.timeline == "cuda" and s.step_time == 150
    assert s.parts == {"comm": 20, "optimizer": 10, "eval": 0, "compute": 30 + 30 + 20, "idle": 20 + 20}
    assert s.optimizer_step == 30  # first optimizer kernel start to last optimizer kernel end
    assert s.comm_by_op == {"dp/all_gather": 20}


def test_comparison_reads_ratios_and_state_memory(tmp_path):
    def run(name: str, comm: float, optimizer: float, state: float) -> tuple[list[ts.RankStats], Path]:
        stats = ts.RankStats(0, [1, 2], "cpu", step_time=200.0, optimizer_step=optimizer)
        stats.parts["comm"] = comm
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(
            json.dumps({"step": 1, "tokens": 8, "mem/optim_state_bytes": state / 2}) + "\n"
            + json.dumps({"step": 2, "tokens": 16, "mem/optim_state_bytes": state}) + "\n"
        )
        return [stats], tmp_path / name

    (a, a_dir), (b, b_dir) = run("adamw", 40.0, 10.0, 2048.0), run("muon", 50.0, 16.0, 1024.0)
    c = ts.compare(a, b, a_dir, b_dir)
    assert c.comm_ms == (0.02, 0.025) and c.comm_ratio == approx(1.25)
    assert c.overhead == (0.05, 0.08) and c.overhead_difference == approx(3.0)
    assert c.state_bytes == (2048.0, 1024.0)


# --- configuration --------------------------------------------------------------------


@pytest.mark.parametrize("steps", ["[4,2]", "[0,2]", "[1,2,3]", "[3]"])
def test_bad_profile_steps_is_one_line_naming_the_key(steps):
    with pytest.raises(ConfigError) as err:
        validate(to_dataclass(compose([f"profile.steps={steps}"])))
    assert str(err.value).startswith("profile.steps") and "\n" not in str(err.value)


def test_profile_window_after_the_last_step_is_an_error():
    with pytest.raises(ConfigError, match="profile.steps"):
        validate(to_dataclass(compose(["profile.enabled=true", "profile.steps=[9,10]", "trainer.max_steps=5"])))


@pytest.mark.slow  # a whole CLI start; the in-process test above checks the message
def test_cli_bad_profile_steps_fails_in_one_line():
    proc = run_python(["train.py", "profile.enabled=true", "profile.steps=[5,2]", "logger.wandb.mode=disabled"],
                      timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "profile.steps" in errors[0], proc.stderr


def test_wrong_type_in_profile_steps_names_the_key():
    with pytest.raises(Exception) as err:
        compose(["profile.steps=[5,two]"])
    assert "profile.steps" in str(err.value) + str(err.value.__cause__)
