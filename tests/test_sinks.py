"""Metric sinks: jsonl, TensorBoard and an offline wandb run receive the same records."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from data.config import DataConfig, EvalSourceConfig
from data.sources import MissingPackageError, check_data_packages
from tests.conftest import REPO, requires
from trainer.config import LoggerConfig, WandbConfig
from trainer.sinks import MetricSinks, check_sink_packages


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

    fake = types.SimpleNamespace(init=lambda **kwargs: calls.append(("init", kwargs)) or FakeRun(),
                                 teardown=lambda: calls.append(("teardown",)))
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
    # finish() only informs wandb's service; teardown() waits until it has written the run's
    # file (without it, 1 close in 6 left the offline .wandb file holding only its header).
    assert calls[-2:] == [("finish",), ("teardown",)]


# Installed first on sys.meta_path by a sitecustomize.py on PYTHONPATH, so that `import wandb`
# fails exactly as on a machine without it (the same exception and message).
HIDE_WANDB = """
import sys


class HideWandb:
    def find_spec(self, name, path=None, target=None):
        if name == "wandb" or name.startswith("wandb."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, HideWandb())
"""

WAYS_OUT = "install the requirements (pip install -r requirements.txt), or "


def test_a_missing_wandb_stops_the_run_at_start_up_in_one_line(tmp_path):
    """Before: the corpus was built and the matmul peak measured, then a ModuleNotFoundError
    traceback came out of MetricSinks."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(HIDE_WANDB)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(hide), os.environ.get("PYTHONPATH")]))}
    probe = subprocess.run([sys.executable, "-c", "import wandb"], capture_output=True, text=True, env=env, timeout=60)
    assert probe.stderr.splitlines()[-1] == "ModuleNotFoundError: No module named 'wandb'"

    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    proc = subprocess.run(
        [sys.executable, "train.py", f"hydra.run.dir={run_dir}", f"data.cache_dir={cache}", "trainer.device=cpu",
         "logger.tensorboard=false"],
        cwd=REPO, capture_output=True, text=True, timeout=120, env=env,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [
        "error: logger.wandb.mode=offline needs the wandb package, which is not installed: "
        + WAYS_OUT + "switch wandb off with logger.wandb.mode=disabled"
    ]
    # Nothing was built and nothing measured.
    assert not cache.exists() and not (run_dir / "tokenizer").exists()
    log = proc.stdout + "".join(p.read_text() for p in run_dir.glob("*.log"))
    assert "measuring" not in log and "tokenizer" not in log, log[-2000:]


def hide(monkeypatch, package: str, how: str = "none") -> None:
    """find_spec as on a machine without `package` ("none"), or behind an import hook that
    refuses it ("raise")."""
    real = importlib.util.find_spec

    def find_spec(name, package_=None):
        if name == package:
            if how == "raise":
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None
        return real(name, package_)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


@pytest.mark.parametrize("how", ["none", "raise"])
def test_a_missing_tensorboard_names_the_switch(monkeypatch, how):
    hide(monkeypatch, "tensorboard", how)
    off = WandbConfig(mode="disabled")
    with pytest.raises(MissingPackageError) as err:
        check_sink_packages(LoggerConfig(tensorboard=True, wandb=off))
    assert str(err.value) == ("logger.tensorboard=true needs the tensorboard package, which is not installed: "
                              + WAYS_OUT + "switch TensorBoard off with logger.tensorboard=false")
    check_sink_packages(LoggerConfig(tensorboard=False, wandb=off))  # switched off: not needed


def test_sinks_switched_off_need_no_packages(monkeypatch):
    hide(monkeypatch, "wandb")
    with pytest.raises(MissingPackageError, match="^logger.wandb.mode=online needs the wandb package"):
        check_sink_packages(LoggerConfig(tensorboard=False, wandb=WandbConfig(mode="online")))
    check_sink_packages(LoggerConfig(tensorboard=False, wandb=WandbConfig(mode="disabled")))


@pytest.mark.parametrize("how", ["none", "raise"])
def test_a_missing_datasets_names_data_hf_and_the_embedded_corpus(monkeypatch, how):
    hide(monkeypatch, "datasets", how)
    with pytest.raises(MissingPackageError) as err:
        check_data_packages(DataConfig(name="hf", path="text", data_files=["corpus.txt"]))
    assert str(err.value) == ("data=hf needs the datasets package, which is not installed: "
                              + WAYS_OUT + "train on the embedded corpus with data=stdlib")
    wiki = DataConfig(eval_sets={"wiki": EvalSourceConfig(kind="hf", path="text", data_files=["wiki.txt"])})
    with pytest.raises(MissingPackageError, match=r"^data.eval_sets.wiki.kind=hf needs the datasets package.*"
                                                  r"or drop that set with ~data.eval_sets.wiki$"):
        check_data_packages(wiki)
    check_data_packages(DataConfig())  # the embedded corpus and the bundled prose need no datasets
