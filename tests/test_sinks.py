"""Metric sinks: jsonl, TensorBoard and an offline wandb run receive the same records."""
from __future__ import annotations

import json

from tests.conftest import requires
from trainer.config import LoggerConfig, WandbConfig
from trainer.sinks import MetricSinks


@requires("wandb", "the wandb sink")
def test_all_three_sinks_receive_the_metrics(tmp_path):
    cfg = LoggerConfig(tensorboard=True, wandb=WandbConfig(mode="offline", project="test"))
    sinks = MetricSinks(tmp_path, cfg, "unit", {"optim": {"lr": 0.01}})
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

    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    data_files = list(runs[0].glob("*.wandb"))
    assert len(data_files) == 1, "the offline run holds its data file"
    # The run file is a binary record log; the metric names and the config keys are in it.
    blob = data_files[0].read_bytes()
    assert b"train/loss" in blob and b"val/val/loss" in blob and b"optim" in blob
