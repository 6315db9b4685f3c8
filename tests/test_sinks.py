"""Metric sinks: jsonl, TensorBoard and an offline wandb run receive the same records."""
from __future__ import annotations

import json

from tests.conftest import requires
from trainer.config import LoggerConfig, WandbConfig
from trainer.sinks import MetricSinks


@requires("wandb", "the wandb sink")
def test_all_three_sinks_receive_the_metrics(tmp_path):
    cfg = LoggerConfig(tensorboard=True, wandb=WandbConfig(mode="offline", project="test"))
    sinks = MetricSinks(tmp_path, cfg, "unit", {"optim": {"lr": 0.01}, "corpus_id": "c0ffee123456"})
    sinks.log(1, 100, {"train/loss": 5.0, "val/val/loss": 5.5})
    sinks.log(2, 200, {"train/loss": 4.0})
    sinks.close()

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records == [
        {"step": 1, "tokens": 100, "train/loss": 5.0, "val/val/loss": 5.5},
        {"step": 2, "tokens": 200, "train/loss": 4.0},
    ]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 5.0), (2, 4.0)]
    assert [(e.step, e.value) for e in acc.Scalars("tokens")] == [(1, 100.0), (2, 200.0)]

    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    data_files = list(runs[0].glob("*.wandb"))
    assert len(data_files) == 1, "the offline run holds its data file"
    # The run file is a binary record log; the metric names and the config keys are in it.
    blob = data_files[0].read_bytes()
    assert b"train/loss" in blob and b"val/val/loss" in blob and b"optim" in blob
    assert b"c0ffee123456" in blob  # the corpus id is in the run's config


def test_the_environment_record_keeps_the_first_start_and_appends_resumes(tmp_path):
    from trainer.run_env import read_environment, record_environment, summary_line

    first = {"python": "3.11.7", "torch": "2.13.0", "cuda": None, "device": "cpu model", "world_size": 1,
             "layout": {"dp": 1, "tp": 1}, "git": {"commit": "abcdef1234567890", "dirty": False},
             "corpus": {"id": "aaaaaaaaaaaa"}}
    record_environment(tmp_path, first)
    assert read_environment(tmp_path) == first
    moved = {**first, "device": "NVIDIA H100", "cuda": "13.0", "world_size": 8, "layout": {"dp": 4, "tp": 2}}
    record = record_environment(tmp_path, moved, resumed_at=120)
    assert read_environment(tmp_path) == record
    assert {k: v for k, v in record.items() if k != "resumes"} == first
    assert record["resumes"] == [{"step": 120, **moved}]
    # A fresh start (not a resume) replaces a stale record instead of appending to it.
    record_environment(tmp_path, moved)
    assert read_environment(tmp_path) == moved
    assert summary_line(moved) == "commit abcdef1234; Python 3.11.7, torch 2.13.0, CUDA 13.0; NVIDIA H100 x 8 (dp 4, tp 2)"
    assert read_environment(tmp_path / "nowhere") is None


def test_wandb_runs_are_named_and_plot_against_tokens(tmp_path, monkeypatch):
    """The sink names the run as configured and declares tokens the x-axis of every metric."""
    import sys
    import types

    calls = []

    class FakeRun:
        def define_metric(self, name, **kwargs):
            calls.append(("define_metric", name, kwargs))

        def log(self, record, step):
            calls.append(("log", record, step))

        def finish(self):
            calls.append(("finish",))

    fake = types.SimpleNamespace(init=lambda **kwargs: calls.append(("init", kwargs)) or FakeRun())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = LoggerConfig(tensorboard=False, wandb=WandbConfig(mode="offline", project="p", group="sweep",
                                                            name="adamw_gpt_tiny optim.lr=0.001"))
    sinks = MetricSinks(tmp_path, cfg, "adamw_gpt_tiny", {})
    sinks.log(1, 100, {"train/loss": 5.0})
    sinks.close()
    init = calls[0][1]
    assert (init["name"], init["group"]) == ("adamw_gpt_tiny optim.lr=0.001", "sweep")
    assert ("define_metric", "tokens", {}) in calls
    assert ("define_metric", "*", {"step_metric": "tokens"}) in calls
    assert ("log", {"tokens": 100, "train/loss": 5.0}, 1) in calls
