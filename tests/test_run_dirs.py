"""A run dir holds one run: a simulation and a training run refuse each other's dir, a fresh
start sets aside the rows an earlier start logged, and a finished run says so and stops before
any start-up work, writing nothing."""
from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from tests import job_return
from tests.conftest import REPO
from tests.prestarted import run_python
from trainer.run.sinks import METRICS_FILE, SET_ASIDE_FILE
from trainer.simulation.one_rank import ROW_FLAG

TINY = [
    "model=gpt_tiny", "trainer.max_steps=2", "trainer.batch_size=2", "trainer.seq_len=32", "trainer.precision=fp32",
    "trainer.device=cpu", "trainer.peak_tflops=1", "eval.batches=1", "eval.batch_size=2", "logger.interval=1",
    "logger.wandb.mode=disabled", "logger.tensorboard=true", "logger.progress=none", "optim.muon.ns_dtype=fp32",
    f"data.cache_dir={REPO / '.cache' / 'data'}",
]
SIMULATION = ["parallel.simulate_world=2", "parallel.dp_shard=2"]


def train(*args: str) -> subprocess.CompletedProcess:
    return run_python(["train.py", *args, *TINY], timeout=900)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file and dir under `directory`, with its size and modification time."""
    return {p.relative_to(directory).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*"))}


def error_line(proc: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A 2-step run, finished, in the dir of a sweep's job (<sweep>/job), whose dir an earlier
    start killed before its first checkpoint had left rows 1-3 and a torn line in. It scores
    eval.objective=val/ood_prose/loss, and what main() returned is in <sweep>/returned.json."""
    run_dir = tmp_path_factory.mktemp("sweep") / "job"
    run_dir.mkdir()
    killed = "".join(json.dumps({"step": s, "tokens": 64 * s, "train/loss": 9.0}) + "\n" for s in (1, 2, 3))
    (run_dir / METRICS_FILE).write_text(killed + '{"step": 4, "tok')
    proc = train(f"hydra.run.dir={run_dir}", "eval.objective=val/ood_prose/loss",
                 *job_return.overrides(run_dir.parent / "returned.json"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, proc


def test_a_fresh_start_sets_aside_the_rows_an_earlier_start_logged(finished):
    """Before: metrics.jsonl read 1, 2, 3, (torn), 1, 2, with nothing set aside or said."""
    run_dir, proc = finished
    assert [r["step"] for r in rows(run_dir / METRICS_FILE)] == [1, 2]
    aside = (run_dir / SET_ASIDE_FILE).read_text().splitlines()
    assert [json.loads(line)["step"] for line in aside[:3]] == [1, 2, 3] and aside[3] == '{"step": 4, "tok'
    assert ("metrics.jsonl: set aside 3 rows (steps 1-3) and 1 torn line that an earlier start of this run logged, "
            "in metrics.set_aside.jsonl: this run starts from step 0 (no checkpoint to resume from)") in proc.stdout


def test_main_returns_the_metric_eval_objective_names(finished):
    """Before: the final val/val/loss whatever eval.objective said, so a tuning study would
    have been scored on the split it reports."""
    run_dir, _ = finished
    final = rows(run_dir / METRICS_FILE)[-1]
    assert final["val/ood_prose/loss"] != final["val/val/loss"]
    assert job_return.read(run_dir.parent / "returned.json") == final["val/ood_prose/loss"]


def test_relaunching_a_finished_run_says_so_and_writes_nothing(finished, tmp_path):
    """Before: the whole start-up, "resumed from step 2", and a new TensorBoard event file
    without a scalar."""
    run_dir, _ = finished
    before = snapshot(run_dir)
    assert [p.name for p in (run_dir / "tb").iterdir()] and "train.log" in before
    proc = train(f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    checkpoint = run_dir / "checkpoints" / "step_00000002"
    assert proc.stdout.splitlines() == [
        f"hydra.run.dir={run_dir}: the run reached its trainer.max_steps=2 at step 2 (checkpoint {checkpoint}); "
        "nothing to train. To train on, raise trainer.max_steps, e.g. trainer.max_steps=4"]
    assert snapshot(run_dir) == before
    # Resumed from elsewhere: the same line, naming what was typed, and no new run dir.
    proc = train(f"hydra.run.dir={tmp_path / 'next'}", f"checkpoint.resume={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(f"checkpoint.resume={run_dir}: the run reached its trainer.max_steps=2 at step 2")
    assert not (tmp_path / "next").exists() and snapshot(run_dir) == before
    # A sweep's finished job says so too, and scores what the run logged at its end of the
    # metric its eval.objective names.
    returned = tmp_path / "returned.json"
    proc = train("-m", f"hydra.sweep.dir={run_dir.parent}", "hydra.sweep.subdir=job", "eval.objective=train/loss",
                 *job_return.overrides(returned))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"run dir {run_dir} (a job of hydra.sweep.dir): the run reached its trainer.max_steps=2" in proc.stdout
    assert "resumed from" not in proc.stdout
    after = snapshot(run_dir)
    assert {k: v for k, v in after.items() if k not in before} == {}  # Hydra rewrote .hydra/ and the log, no more
    assert {k for k in before if after[k] != before[k]} <= {".hydra", ".hydra/config.yaml", ".hydra/hydra.yaml",
                                                            ".hydra/overrides.yaml", "train.log", ""}
    from trainer.run.kind import Finished

    final = rows(run_dir / METRICS_FILE)[-1]
    assert job_return.read(returned) == final["train/loss"] != final["val/val/loss"]
    assert Finished(checkpoint, 2, 2, "").recorded_objective() == final["val/val/loss"]
    assert Finished(checkpoint, 2, 2, "").recorded_objective("val/ood_prose/loss") == final["val/ood_prose/loss"]
    assert math.isnan(Finished(checkpoint, 1, 1, "").recorded_objective())  # step 1 ran no eval
    assert Finished(checkpoint, 1, 1, "").recorded_objective("train/loss") == rows(run_dir / METRICS_FILE)[0][
        "train/loss"]


def test_a_finished_run_whose_checkpoint_fails_its_digests_is_left_to_the_start_up(finished, tmp_path):
    """Its step alone would say "finished"; the start-up falls back to an older checkpoint, or
    stops naming the damage, as for any run."""
    import shutil

    from tests.conftest import compose
    from trainer.config import to_dataclass
    from trainer.run.kind import finished_run

    run_dir = tmp_path / "copy"
    shutil.copytree(finished[0], run_dir)
    cfg = to_dataclass(compose([a for a in TINY if not a.startswith("hydra")]))
    assert finished_run(cfg, run_dir, "here").step == 2
    shard = next((run_dir / "checkpoints" / "step_00000002").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-1])  # truncated
    assert finished_run(cfg, run_dir, "here") is None


def test_a_simulation_refuses_a_training_runs_dir(finished):
    """Before: it rewrote environment.json as a simulation's and appended its rows to the run's."""
    run_dir, _ = finished
    before = snapshot(run_dir)
    proc = train(f"hydra.run.dir={run_dir}", *SIMULATION)
    assert proc.returncode == 2
    assert error_line(proc) == (
        f"error: hydra.run.dir={run_dir}: holds a training run (checkpoints/step_00000002, 2 rows of a training run "
        "in metrics.jsonl, 3 rows of a training run in metrics.set_aside.jsonl, a training run's environment.json); "
        "a simulation (parallel.simulate_world=2) must not mix its records into it: give the simulation a dir of its "
        "own (another hydra.run.dir)")
    assert snapshot(run_dir) == before


def test_a_training_run_refuses_a_simulations_dir(tmp_path):
    """Before: it started fresh and appended its rows to the simulated ones. The dir is as a
    simulation leaves it (tests/test_simulate.py checks these records on a real one)."""
    (tmp_path / METRICS_FILE).write_text("".join(json.dumps({"step": s, "tokens": 64 * s, **ROW_FLAG}) + "\n"
                                                 for s in (1, 2)))
    (tmp_path / "environment.json").write_text(json.dumps(
        {"world_size": 2, "simulation": {"simulate_world": 2, "simulate_rank": 0, "processes": 1}}))
    before = snapshot(tmp_path)
    proc = train(f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2
    assert error_line(proc) == (
        f'error: hydra.run.dir={tmp_path}: holds a simulation\'s records (2 rows marked "simulated": 1 in '
        'metrics.jsonl, the "simulation" entry of environment.json); a training run must not mix its records with '
        "them: give this run a dir of its own (another hydra.run.dir)")
    assert snapshot(tmp_path) == before
