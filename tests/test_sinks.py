"""Metric sinks: jsonl, TensorBoard and an offline wandb run receive the same records."""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys

import pytest

from data.config import DataConfig, EvalSourceConfig
from data.source_checks import MissingPackageError, check_data_packages
from tests.conftest import REPO, requires
from data.sources import DataConfigError
from trainer.config import ConfigError, LoggerConfig, TrainConfig, WandbConfig, validate
from trainer.run.sinks import (
    SET_ASIDE_FILE,
    MetricSinks,
    WandbOnlineError,
    check_sink_packages,
    set_aside_rows_after,
    start_wandb,
    wandb_destination,
)


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
    from eval.environment import read_environment, summary_line
    from trainer.run.environment import record_environment

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
        settings = types.SimpleNamespace(sync_dir=str(tmp_path / "wandb" / "offline-run-x"))
        offline = True

        def define_metric(self, name, **kwargs):
            calls.append(("define_metric", name, kwargs))

        def log(self, record, step):
            calls.append(("log", record, step))

        def finish(self):
            calls.append(("finish",))

    fake = types.SimpleNamespace(init=lambda **kwargs: calls.append(("init", kwargs)) or FakeRun(),
                                 teardown=lambda: calls.append(("teardown",)), Settings=dict)
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


# What wandb 0.31 raised after its init_timeout with no network (the run): a CommError
# whose first line is the cause, followed by advice.
NO_NETWORK = ('Timed out while retrying: Post "https://api.wandb.ai/graphql": dial tcp: lookup api.wandb.ai: '
              'no such host\nConsider increasing the init_timeout setting:\n'
              '  wandb.init(settings=wandb.Settings(init_timeout=...))')


def fail_online(monkeypatch, error: Exception) -> list[dict]:
    """wandb.init that raises `error` for mode=online, as with no network once init_timeout
    has passed, and starts a real run otherwise; returns the arguments of every call."""
    import wandb

    real_init, calls = wandb.init, []

    def init(**kwargs):
        calls.append(kwargs)
        if kwargs["mode"] == "online":
            raise error
        return real_init(**kwargs)

    monkeypatch.setattr(wandb, "init", init)
    return calls


def offline_run_dir(run_dir) -> str:
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    return str(runs[0])


def online(**keys) -> LoggerConfig:
    return LoggerConfig(tensorboard=False, wandb=WandbConfig(mode="online", project="test", group="sweep",
                                                             name="adamw lr=0.01", **keys))


@requires("wandb", "the wandb sink")
@pytest.mark.parametrize("error, reason", [
    ("comm", 'CommError: Timed out while retrying: Post "https://api.wandb.ai/graphql": dial tcp: '
             "lookup api.wandb.ai: no such host"),
    ("timeout", "TimeoutError"),  # wandb's own wait, past init_timeout, for a silent service
])
def test_an_online_start_that_fails_goes_on_offline_with_one_warning(tmp_path, monkeypatch, caplog, error, reason):
    """Before: about 95 s of waiting, then a 25-line CommError traceback and exit code 1."""
    import wandb

    calls = fail_online(monkeypatch, wandb.errors.CommError(NO_NETWORK) if error == "comm" else TimeoutError())
    caplog.set_level(logging.INFO)
    sinks = MetricSinks(tmp_path, online(init_timeout_s=7.5), "unit", {"optim": {"lr": 0.01}})
    sinks.log(1, 100, {"train/loss": 5.0})
    sinks.close()

    assert [call["mode"] for call in calls] == ["online", "offline"]
    # The offline run is the one the online run would have been: same dir, names and config.
    same = ("dir", "project", "entity", "group", "name", "config")
    assert [call[key] for key in same for call in calls[1:]] == [calls[0][key] for key in same]
    assert (calls[0]["dir"], calls[0]["group"], calls[0]["name"]) == (str(tmp_path), "sweep", "adamw lr=0.01")
    assert [call["settings"].init_timeout for call in calls] == [7.5, 7.5]

    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [f"wandb: online start failed ({reason}); the run goes on offline "
                        "(logger.wandb.require_online=true makes this an error)"]
    run = offline_run_dir(tmp_path)
    assert f"wandb: offline run in {run}; upload it with `wandb sync {run}`" in caplog.messages
    # The metrics went on into the offline run, ready for that `wandb sync`.
    blob = b"".join(f.read_bytes() for f in (tmp_path / "wandb").glob("offline-run-*/*.wandb"))
    assert b"train/loss" in blob and b"adamw lr=0.01" in blob


@requires("wandb", "the wandb sink")
def test_require_online_makes_a_failed_online_start_a_one_line_error(tmp_path, monkeypatch):
    import wandb

    calls = fail_online(monkeypatch, wandb.errors.CommError(NO_NETWORK))
    with pytest.raises(WandbOnlineError) as err:
        MetricSinks(tmp_path, online(require_online=True), "unit", {})
    assert str(err.value) == (
        'logger.wandb.require_online=true: wandb could not start online (CommError: Timed out while retrying: '
        'Post "https://api.wandb.ai/graphql": dial tcp: lookup api.wandb.ai: no such host); fix the network or '
        "the key, or let the run go on offline with logger.wandb.require_online=false"
    )
    # A DataConfigError is what train.py turns, raised by the Trainer, into this line and exit code 2.
    assert isinstance(err.value, DataConfigError)
    assert [call["mode"] for call in calls] == ["online"]
    # Stopped before any sink wrote: no offline run, no metrics file.
    assert not list((tmp_path / "wandb").glob("offline-run-*")) and not (tmp_path / "metrics.jsonl").exists()


@requires("wandb", "the wandb sink")
def test_an_offline_run_says_where_it_went(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    sinks = MetricSinks(tmp_path, LoggerConfig(tensorboard=False, wandb=WandbConfig(project="test")), "unit", {})
    sinks.close()
    run = offline_run_dir(tmp_path)
    assert os.path.isabs(run)
    where = [m for m in caplog.messages if m.startswith("wandb: ")]
    assert where == [f"wandb: offline run in {run}; upload it with `wandb sync {run}`"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@requires("wandb", "the wandb sink")
@pytest.mark.parametrize("require_online, after", [
    (False, "the run goes on offline"),
    (True, "the run stops (logger.wandb.require_online=true)"),
])
def test_an_online_start_says_how_long_it_waits_before_it_waits(tmp_path, monkeypatch, caplog, require_online, after):
    """Before: 61 s of silence without a network, and only then the warning."""
    import time
    import types

    import wandb

    said_before_init_returned: list[list[str]] = []

    def init(**kwargs):
        if kwargs["mode"] == "online":
            said_before_init_returned.append(list(caplog.messages))
            time.sleep(0.2)  # the wait for a server that does not answer, shortened
            raise wandb.errors.CommError(NO_NETWORK)
        return types.SimpleNamespace(offline=True, settings=types.SimpleNamespace(sync_dir=str(tmp_path / "run")))

    monkeypatch.setattr(wandb, "init", init)
    caplog.set_level(logging.INFO)
    cfg = WandbConfig(mode="online", init_timeout_s=42, require_online=require_online)
    if require_online:
        with pytest.raises(WandbOnlineError):
            start_wandb(tmp_path, cfg, "unit", {})
    else:
        start_wandb(tmp_path, cfg, "unit", {})
    line = ("wandb: connecting to wandb's server, waiting up to 42 s (logger.wandb.init_timeout_s); if it does "
            f"not answer, {after}")
    assert said_before_init_returned == [[line]]
    assert caplog.messages.count(line) == 1


def test_an_online_run_says_its_url(tmp_path, monkeypatch):
    """Online needs a server; the line is built from what the run reports."""
    import types

    monkeypatch.chdir(tmp_path)
    run = types.SimpleNamespace(offline=False, url="https://wandb.ai/me/test/runs/abc123",
                                settings=types.SimpleNamespace(sync_dir="wandb/run-20260101_000000-abc123"))
    assert wandb_destination(run) == ("wandb: run https://wandb.ai/me/test/runs/abc123 "
                                      f"(local files in {os.getcwd()}/wandb/run-20260101_000000-abc123)")


def test_the_wandb_init_timeout_is_checked_at_start_up():
    for seconds in (0.0, -5.0):
        with pytest.raises(ConfigError, match=rf"^logger.wandb.init_timeout_s must be >= 1, got {seconds}$"):
            validate(TrainConfig(logger=LoggerConfig(wandb=WandbConfig(init_timeout_s=seconds))))
    validate(TrainConfig(logger=LoggerConfig(wandb=WandbConfig(init_timeout_s=1.0))))


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


def test_a_resume_sets_aside_the_rows_logged_after_its_checkpoint(tmp_path, caplog):
    """Before: after a kill -9 and a resume from step 10, steps 11 and 12 twice in metrics.jsonl."""
    rows = [json.dumps({"step": s, "tokens": 64 * s, "train/loss": 5.0 - 0.1 * s}) + "\n" for s in range(1, 13)]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(rows) + '{"step": 13, "tok')  # the row the kill cut short
    caplog.set_level(logging.INFO)

    assert set_aside_rows_after(tmp_path, 10) == [11, 12]
    assert metrics.read_text() == "".join(rows[:10])  # the rows kept, byte for byte
    aside = tmp_path / SET_ASIDE_FILE
    assert aside.read_text() == rows[10] + rows[11] + '{"step": 13, "tok\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", SET_ASIDE_FILE]  # no temp file left
    assert caplog.messages == [
        f"metrics.jsonl: set aside 2 rows (steps 11-12) and 1 torn line that the stopped run logged after the "
        f"checkpoint of step 10, in {SET_ASIDE_FILE}; this run logs those steps again"]

    # The resumed run appends its own rows: one per step.
    sinks = MetricSinks(tmp_path, LoggerConfig(tensorboard=False, wandb=WandbConfig(mode="disabled")), "unit", {})
    for step in (11, 12):
        sinks.log(step, 64 * step, {"train/loss": 1.0})
    sinks.close()
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, 13))

    # A second kill and a resume from step 8: appended to what was set aside before.
    assert set_aside_rows_after(tmp_path, 8) == [9, 10, 11, 12]
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == list(range(1, 9))
    assert aside.read_text().splitlines()[:3] == [rows[10].strip(), rows[11].strip(), '{"step": 13, "tok']
    assert [json.loads(line)["step"] for line in aside.read_text().splitlines()[3:]] == [9, 10, 11, 12]

    # Nothing past the checkpoint (a resume from the last step): neither file is touched.
    before = (metrics.stat().st_mtime_ns, aside.read_bytes())
    assert set_aside_rows_after(tmp_path, 8) == []
    assert (metrics.stat().st_mtime_ns, aside.read_bytes()) == before
    assert set_aside_rows_after(tmp_path / "fresh", 5) == []  # a run dir without metrics yet
