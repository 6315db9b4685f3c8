"""Run records: committed stand-ins for run dirs that compare_runs.py reads as it reads the runs."""
from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from eval.compare import find_runs, load_run
from eval.run_records import RecordError, plan_records, record_runs
from tests.prestarted import run_python
from tests.test_compare import write_run


def curve(scale: float, steps: int) -> list[float]:
    return [scale * 10.0 / s for s in range(1, steps + 1)]


def write_protocol(root: Path) -> None:
    """Two seeds of Muon and of AdamW, and AdamW at 1.5x and 2x: every table of the summary."""
    for seed in (0, 1):
        write_run(root / "muon" / str(seed), "muon", 1e-2, curve(1.0 + 0.01 * seed, 40), corpus="c0ffee", seed=seed)
        write_run(root / "adamw" / str(seed), "adamw", 1e-3, curve(1.6 + 0.01 * seed, 40), corpus="c0ffee", seed=seed)
        for steps in (60, 80):
            write_run(root / "longer" / f"{steps}_{seed}", "adamw", 1e-3, curve(1.6 + 0.01 * seed, steps),
                      corpus="c0ffee", seed=seed)
    for run in find_runs(root):
        config = run / ".hydra" / "config.yaml"
        config.write_text(config.read_text() + f"trainer:\n  max_steps: {len(load_run(run).series['train/loss'][0])}\n")


def summary(tmp_path: Path, root: Path, name: str) -> str:
    out = tmp_path / name
    proc = run_python(["scripts/compare_runs.py", str(root / "muon"), str(root / "adamw"),
                       "--longer", str(root / "longer"), "--out", str(out)], timeout=120)
    assert proc.returncode == 0, proc.stderr
    return (out / "summary.md").read_text().replace(str(root), "ROOT")


def test_compare_runs_reads_records_exactly_as_the_run_dirs(tmp_path):
    runs, records = tmp_path / "runs", tmp_path / "records"
    write_protocol(runs)
    written = record_runs([runs / "muon", runs / "adamw", runs / "longer"], records)
    assert len(written) == 8
    assert sorted(p.relative_to(records).as_posix() for p in written)[:2] == ["adamw/0", "adamw/1"]
    # The gzipped metrics are the run's own bytes, and nothing bulky came along.
    original = (runs / "longer" / "80_1" / "metrics.jsonl").read_bytes()
    assert gzip.decompress((records / "longer" / "80_1" / "metrics.jsonl.gz").read_bytes()) == original
    assert sorted(p.name for p in (records / "longer" / "80_1").rglob("*") if p.is_file()) == [
        "config.yaml", "environment.json", "metrics.jsonl.gz"]
    from_runs = summary(tmp_path, runs, "from_runs")
    from_records = summary(tmp_path, records, "from_records")
    assert "schedule ratio B/A" in from_runs and "± " in from_runs  # seeds and the honest ratio are in it
    assert from_records == from_runs
    loaded = load_run(records / "muon" / "1")
    assert (loaded.seed, loaded.lr, loaded.corpus, loaded.optimizer) == (1, 1e-2, "c0ffee", "muon")


def test_a_sweep_is_recorded_again_as_more_of_it_finishes(tmp_path):
    runs, records = tmp_path / "runs", tmp_path / "records"
    write_run(runs / "sweep" / "seed0", "adamw", 1e-3, curve(1.0, 10))
    assert [p.name for p in record_runs([runs / "sweep"], records)] == ["seed0"]
    write_run(runs / "sweep" / "seed1", "adamw", 1e-3, curve(1.1, 10))
    assert [p.name for p in record_runs([runs / "sweep"], records)] == ["seed1"]
    assert sorted(p.name for p in (records / "sweep").iterdir()) == ["seed0", "seed1"]


def test_recording_twice_gives_the_same_bytes(tmp_path):
    write_protocol(tmp_path / "runs")
    first = tmp_path / "first"
    record_runs([tmp_path / "runs" / "muon"], first)
    second = tmp_path / "second"
    record_runs([tmp_path / "runs" / "muon"], second)
    files = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
    assert files and all((first / f).read_bytes() == (second / f).read_bytes() for f in files)


def test_unfinished_runs_and_runs_without_a_config_are_refused_before_anything_is_written(tmp_path):
    runs = tmp_path / "runs"
    write_run(runs / "done", "adamw", 1e-3, curve(1.0, 10))
    write_run(runs / "going", "adamw", 1e-3, curve(1.0, 10))
    (runs / "done" / ".hydra" / "config.yaml").write_text("optim:\n  name: adamw\ntrainer:\n  max_steps: 10\n")
    (runs / "going" / ".hydra" / "config.yaml").write_text("optim:\n  name: adamw\ntrainer:\n  max_steps: 20\n")
    with pytest.raises(RecordError, match=r"unfinished: .*going logged up to step 10 of its 20"):
        record_runs([runs], tmp_path / "records")
    assert not (tmp_path / "records").exists()
    assert [p.name for p in record_runs([runs], tmp_path / "records", skip_unfinished=True)] == ["done"]
    # Just started: its config is written and its metrics.jsonl is still empty.
    (runs / "starting" / ".hydra").mkdir(parents=True)
    (runs / "starting" / ".hydra" / "config.yaml").write_text("optim:\n  name: adamw\ntrainer:\n  max_steps: 20\n")
    (runs / "starting" / "metrics.jsonl").write_text("")
    with pytest.raises(RecordError, match=r"unfinished: .*starting logged no training step yet of its 20"):
        plan_records([runs / "starting"], tmp_path / "records")
    assert plan_records([runs / "starting"], tmp_path / "records", skip_unfinished=True) == []
    (runs / "going" / ".hydra" / "config.yaml").unlink()
    with pytest.raises(RecordError, match=r"going: no \.hydra/config\.yaml"):
        record_runs([runs], tmp_path / "records")


def test_an_existing_record_is_kept_unless_replaced(tmp_path):
    runs, records = tmp_path / "runs", tmp_path / "records"
    write_run(runs / "adamw", "adamw", 1e-3, curve(1.0, 10))
    record_runs([runs / "adamw"], records)
    assert plan_records([runs / "adamw"], records) == []  # the same record: nothing to do
    (runs / "adamw" / "metrics.jsonl").write_text('{"step": 1, "tokens": 1, "train/loss": 1.5}\n')
    with pytest.raises(RecordError, match="already holds the record of another run"):
        plan_records([runs / "adamw"], records)
    record_runs([runs / "adamw"], records, replace=True)
    assert load_run(records / "adamw").series["train/loss"] == ([1], [1.5])
    assert [p.name for p in records.iterdir()] == ["adamw"]  # no staging or old copy left behind


def test_cli_refuses_in_one_line(tmp_path):
    write_run(tmp_path / "runs" / "going", "adamw", 1e-3, curve(1.0, 5))
    config = tmp_path / "runs" / "going" / ".hydra" / "config.yaml"
    config.write_text(config.read_text() + "trainer:\n  max_steps: 9\n")
    proc = run_python(["scripts/record_runs.py", str(tmp_path / "runs"), "--into", str(tmp_path / "records")],
                      timeout=120)
    assert proc.returncode != 0 and not (tmp_path / "records").exists()
    assert proc.stderr.strip().splitlines() == [
        f"error: not recorded, unfinished: {tmp_path / 'runs' / 'going'} logged up to step 5 of its 9"]
