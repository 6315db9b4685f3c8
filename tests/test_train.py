"""End to end: train.py on the embedded corpus writes the contract's outputs, loss falls."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.prestarted import run_python
from tests.closeness import check_relative


def train(run_dir: Path, *overrides: str) -> list[dict]:
    proc = run_python(["train.py", f"hydra.run.dir={run_dir}", "logger.wandb.mode=disabled", "trainer.device=cpu",
                       *overrides], timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def adamw_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    run_dir = tmp_path_factory.mktemp("adamw")
    records = train(
        run_dir, "model=gpt_tiny", "optim=adamw", "trainer.max_steps=20", "trainer.batch_size=8",
        "trainer.seq_len=128", "eval.interval=10", "eval.batches=2", "logger.interval=5",
        "optim.warmup_steps=5", "trainer.precision=fp32",
    )
    return run_dir, records


def test_twenty_step_run_loss_falls_and_metrics_are_logged(adamw_run):
    run_dir, records = adamw_run
    train_losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert [r["step"] for r in records if "train/loss" in r] == [5, 10, 15, 20]
    assert train_losses[-1] < train_losses[0] - 0.5, train_losses
    last = records[-1]
    for key in ("val/val/loss", "val/ood_prose/loss", "perf/tokens_per_s", "perf/step_s", "optim/lr"):
        assert key in last, key
    assert last["tokens"] == 20 * 8 * 128
    assert last["perf/tokens_per_s"] > 0
    # Model FLOP/s over the peak measured at start-up: a fraction, and never zero.
    assert all(0 < r["perf/mfu"] <= 1 for r in records if "perf/tokens_per_s" in r)
    # val loss was logged twice (step 10 and the end) and improved
    val = [r["val/val/loss"] for r in records if "val/val/loss" in r]
    assert len(val) == 2 and val[1] < val[0]
    # OOD prose is a different distribution from Python code: its loss is higher
    assert last["val/ood_prose/loss"] > last["val/val/loss"]


def test_tensorboard_gets_the_same_metric_names(adamw_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, records = adamw_run
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    logged = {k for r in records for k in r if k not in ("step", "tokens")}
    assert logged <= tags
    steps = [e.step for e in acc.Scalars("train/loss")]
    assert steps == [5, 10, 15, 20]


def test_composed_config_is_saved_by_hydra(adamw_run):
    import yaml

    run_dir, _ = adamw_run
    saved = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
    assert saved["optim"]["name"] == "adamw"
    assert saved["trainer"]["max_steps"] == 20
    assert "optim=adamw" in (run_dir / ".hydra" / "overrides.yaml").read_text()


def test_muon_run_logs_every_health_metric_with_sane_values(tmp_path):
    records = train(
        tmp_path, "model=gpt_tiny", "optim=muon", "trainer.max_steps=12", "trainer.batch_size=8",
        "trainer.seq_len=128", "eval.interval=0", "eval.batches=2", "logger.interval=6",
        "optim.warmup_steps=2", "trainer.precision=fp32", "optim.muon.ns_dtype=fp32",
    )
    last = records[-1]
    kinds = ["attn_q", "attn_k", "attn_v", "attn_o", "mlp_in", "mlp_out", "embed", "head", "norm"]
    for kind in kinds:
        assert last[f"model/weight_rms/{kind}"] > 0
        assert f"optim/update_rms/{kind}" in last
    # Muon with match_rms_adamw: applied update RMS / lr near 0.2 on the hidden matrices
    # (a little under: NS leaves singular values of low-rank directions below 1).
    for kind in ["attn_q", "attn_k", "attn_v", "mlp_in", "mlp_out"]:
        assert 0.1 < last[f"optim/update_rms/{kind}"] < 0.26, (kind, last[f"optim/update_rms/{kind}"])
    assert 0.9 < last["model/weight_rms/norm"] < 1.1  # gammas start at 1 and move slowly
    for i in range(2):
        assert 0 < last[f"model/output_rms/layer_{i}"] < 10
        assert 0 < abs(last[f"attn/max_logit/layer_{i}"]) < 50
    assert 0.5 < last["model/output_rms/final"] < 2  # RMSNorm output with gammas near 1
    assert last["optim/grad_norm"] > 0
    assert last["perf/optim_step_s"] > 0
    # Muon keeps one momentum buffer per matrix, AdamW two moments (+ step) per tensor.
    assert last["mem/optim_state_bytes"] > 0


@pytest.mark.slow
def test_compiled_training_matches_eager(tmp_path):
    common = ["model=gpt_tiny", "optim=adamw", "trainer.max_steps=4", "trainer.batch_size=4",
              "trainer.seq_len=64", "eval.interval=0", "eval.batches=1", "logger.interval=1",
              "trainer.precision=fp32", "logger.tensorboard=false"]
    eager = train(tmp_path / "eager", *common)
    compiled = train(tmp_path / "compiled", *common, "trainer.compile=true")
    for a, b in zip(eager, compiled):
        check_relative("train/loss", b["train/loss"], a["train/loss"], 1e-4)


def test_a_schedule_that_decays_to_zero_completes_its_last_step(tmp_path):
    """Cosine to min_lr=0 reaches lr 0 on the last step, where update RMS / lr is undefined:
    the run must still log that step, evaluate and save its checkpoint."""
    records = train(
        tmp_path, "model=gpt_tiny", "optim=muon", "trainer.max_steps=6", "trainer.batch_size=2",
        "trainer.seq_len=64", "eval.interval=0", "eval.batches=1", "logger.interval=1",
        "optim.warmup_steps=2", "optim.min_lr=0.0", "trainer.precision=fp32", "optim.muon.ns_dtype=fp32",
    )
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    last = records[-1]
    assert last["optim/lr"] == 0.0
    assert "val/val/loss" in last and "model/output_rms/final" in last
    assert not any(k.startswith("optim/update_rms/") for k in last)
    assert all(records[i]["optim/update_rms/mlp_in"] > 0 for i in range(1, 5))
    assert (tmp_path / "checkpoints" / "step_00000006").exists()


def test_the_run_records_its_corpus_id_and_environment(adamw_run):
    import platform

    import yaml
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    run_dir, _ = adamw_run
    env = json.loads((run_dir / "environment.json").read_text())
    corpus_id = env["corpus"]["id"]
    assert len(corpus_id) == 12
    assert yaml.safe_load((run_dir / "resolved_config.yaml").read_text())["corpus_id"] == corpus_id
    log = (run_dir / "train.log").read_text()
    assert f"corpus {corpus_id}: train " in log and f"tokens per step; corpus {corpus_id}" in log
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    head = git.stdout.strip() if git.returncode == 0 else None  # None: run from an unpacked tarball
    assert env["git"]["commit"] == head
    assert isinstance(env["git"]["dirty"], bool) if head else env["git"]["dirty"] is None
    assert env["python"] == platform.python_version() and env["torch"] and env["device_type"] == "cpu"
    assert env["world_size"] == 1 and env["layout"] == {"dp": 1, "tp": 1, "backend": "none", "dp_shard": 1, "ep": 1}
    assert set(env["corpus"]["splits"]) == {"train", "val", "ood_prose"}
    assert all(split["tokens"] > 1000 and len(split["sha256"]) == 64 for split in env["corpus"]["splits"].values())
    assert [m["pinned"] for m in env["corpus"]["manifest"]] == [True, True]
    assert "resumes" not in env

    # TensorBoard's hparams hold the corpus id beside the config, in the run's own event file.
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    contents = acc.PluginTagToContent("hparams")
    start = next(plugin_data_pb2.HParamsPluginData.FromString(c) for c in contents.values()
                 if plugin_data_pb2.HParamsPluginData.FromString(c).HasField("session_start_info"))
    hparams = start.session_start_info.hparams
    assert hparams["corpus_id"].string_value == corpus_id
    assert hparams["environment.git.commit"].string_value == (head or "null")
    assert hparams["optim.name"].string_value == "adamw"


def test_train_log_holds_the_step_loss_and_eval_lines(adamw_run):
    """Before: train.log had the start-up lines and "saved checkpoint", but no step, loss or eval line."""
    run_dir, records = adamw_run
    text = (run_dir / "train.log").read_text()
    for record in records:
        if "train/loss" in record:
            assert f"step {record['step']}/20 | loss {record['train/loss']:.4f} |" in text
    evals = [r for r in records if "val/val/loss" in r]
    assert len(evals) == 2
    for record in evals:
        assert f"step {record['step']}: val/val/loss {record['val/val/loss']:.4f}" in text
