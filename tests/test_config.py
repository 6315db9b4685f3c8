"""Config contract: presets compose, bad keys and types fail naming the key, bad values too."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hydra.errors import ConfigCompositionException

from tests.conftest import REPO, compose, requires
from tests.prestarted import run_python
from trainer.config import ConfigError, TrainConfig, to_dataclass, validate


@pytest.mark.parametrize("preset", ["gpt_tiny", "gpt_small", "gpt_124m"])
def test_presets_compose_and_validate(preset):
    cfg = to_dataclass(compose([f"model={preset}"]))
    assert isinstance(cfg, TrainConfig)
    assert cfg.model.name == preset
    validate(cfg)


def test_gpt_small_is_in_the_10_to_20m_range():
    from dataclasses import replace

    from model.gpt import GPT

    cfg = to_dataclass(compose(["model=gpt_small"]))
    n = GPT(replace(cfg.model, vocab_size=cfg.data.vocab_size)).num_params()
    assert 10e6 <= n <= 20e6, n


def test_contract_keys_exist():
    cfg = compose()
    for key in [
        "seed", "optim.lr", "optim.weight_decay", "optim.warmup_steps", "optim.min_lr",
        "optim.schedule", "trainer.max_steps", "trainer.batch_size", "trainer.seq_len",
        "trainer.grad_accum", "trainer.precision", "trainer.compile", "trainer.device",
        "eval.interval", "eval.batches", "logger.interval", "logger.wandb.mode",
        "logger.wandb.project", "logger.tensorboard", "parallel.tp",
    ]:
        node = cfg
        for part in key.split("."):
            assert part in node, key
            node = node[part]


def test_optimizers_share_lr_wd_and_schedule_defaults():
    muon = to_dataclass(compose(["optim=muon"])).optim
    adamw = to_dataclass(compose(["optim=adamw"])).optim
    for field in ("lr", "weight_decay", "warmup_steps", "min_lr", "schedule", "grad_clip"):
        assert getattr(muon, field) == getattr(adamw, field), field
    assert (muon.name, adamw.name) == ("muon", "adamw")


def test_misspelled_override_names_the_key():
    with pytest.raises(ConfigCompositionException) as err:
        compose(["trainer.max_stepz=5"])
    assert "trainer.max_stepz" in str(err.value)


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigCompositionException) as err:
        compose(["trainer.batch_size=many"])
    assert "trainer.batch_size" in str(err.value) + str(err.value.__cause__)


def test_unknown_preset_is_reported():
    with pytest.raises(Exception) as err:
        compose(["model=gpt_huge"])
    assert "gpt_huge" in str(err.value)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["trainer.seq_len=4096"], "trainer.seq_len"),
        (["trainer.batch_size=0"], "trainer.batch_size"),
        (["trainer.grad_accum=0"], "trainer.grad_accum"),
        (["trainer.precision=fp16"], "trainer.precision"),
        (["optim.muon.ns_dtype=fp16"], "optim.muon.ns_dtype"),
        (["optim.schedule=linear"], "optim.schedule"),
        (["optim.min_lr=1.0"], "optim.min_lr"),
        (["model.n_kv_heads=3"], "model.n_kv_heads"),
        (["+optim.weight_decay_overrides.nrom=0.0"], "optim.weight_decay_overrides.nrom"),
        (["logger.wandb.mode=sometimes"], "logger.wandb.mode"),
        (["optim.gather_buckets=0"], "optim.gather_buckets"),
        (["parallel.backend=mpi"], "parallel.backend"),
        (["parallel.timeout_s=0"], "parallel.timeout_s"),
        (["optim.qk_clip.enabled=true", "optim.qk_clip.tau=0"], "optim.qk_clip.tau"),
        (["optim.qk_clip.enabled=true", "model.qk_norm=true"], "model.qk_norm"),
        # out of range: each used to end in a traceback, or (grad_clip) to switch clipping off
        (["optim.muon.momentum=1.5"], "optim.muon.momentum"),
        (["optim.beta1=-0.1"], "optim.beta1"),
        (["optim.beta2=1.5"], "optim.beta2"),
        (["optim.eps=0"], "optim.eps"),
        (["optim.muon.eps=0"], "optim.muon.eps"),
        (["optim.muon.ns_steps=0"], "optim.muon.ns_steps"),
        (["optim.weight_decay=-0.1"], "optim.weight_decay"),
        (["optim.grad_clip=-1"], "optim.grad_clip"),
        (["model.d_model=0"], "model.d_model"),
        (["model.ffn_hidden=0"], "model.ffn_hidden"),
    ],
)
def test_validate_names_the_offending_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        validate(to_dataclass(compose(overrides)))
    assert key in str(err.value)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return run_python(["train.py", *args, "logger.wandb.mode=disabled"], timeout=120)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["trainer.seq_len=100000"], "trainer.seq_len"),
        (["data=hf", "data.path=text", "data.data_files=[/nonexistent/corpus.txt]"], "/nonexistent/corpus.txt"),
        (["trainer.batch_size=0"], "trainer.batch_size"),
        (["data=hf", "data.path=corpus/missing.txt"], "data.path: no such file or directory"),
    ],
)
def test_cli_reports_bad_values_in_one_line_without_traceback(args, needle):
    proc = run_cli(*args)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1, proc.stderr
    assert needle in error_lines[0]


@pytest.mark.parametrize("bad, line", [
    ("optim.muon.ns_dtype=fp16", "error: optim.muon.ns_dtype: unknown value 'fp16'"),
    ("optim.muon.coefficients=bogus", "error: optim.muon.coefficients: unknown value 'bogus'"),
    ("optim.muon.tp_mode=bogus", "error: optim.muon.tp_mode: unknown value 'bogus' (expected one of gather, gram)"),
    ("optim.muon.adjust_lr=bogus", "error: optim.muon.adjust_lr: unknown value 'bogus'"),
    ("optim.muon.ns_method=bogus", "error: optim.muon.ns_method: unknown value 'bogus' (expected one of standard, gram, auto)"),
    ("optim.muon.normuon_beta2=1.5", "error: optim.muon.normuon_beta2 must lie in [0, 1), got 1.5"),
    ("optim.grad_clip=-1", "error: optim.grad_clip=-1.0 must be >= 0 (0 turns clipping off)"),
    ("model.d_model=0", "error: model.d_model must be >= 1, got 0"),
    ("model.score_func=bogus", "error: model.score_func: unknown value 'bogus' (expected one of sigmoid, softmax)"),
    ("+trainer.max_step=3", "error: trainer.max_step: no such key (did you mean trainer.max_steps?)"),
    ("+optim.muon.coefs=1", "error: optim.muon.coefs: no such key (did you mean optim.muon.coefficients?)"),
    ("logger.wandb.mode=online", "error: logger.wandb.mode=online: no wandb credentials"),
])
def test_bad_values_fail_in_one_line_before_any_data_work(tmp_path, bad, line):
    """Before: these failed after the corpus and the model were built (a 26-line traceback),
    or were accepted (a dense model's score_func, a `+key` Hydra's own typo message suggests)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB")}
    env["HOME"] = str(tmp_path)  # no ~/.netrc with wandb credentials
    cache = tmp_path / "cache"
    proc = run_python(["train.py", f"hydra.run.dir={tmp_path / 'run'}", "optim=muon", bad, f"data.cache_dir={cache}"],
                      env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(line), proc.stderr[-2000:]
    assert not cache.exists()  # no tokenizer, no tokens: nothing was built


def test_wandb_credentials_come_from_the_environment_or_netrc(tmp_path, monkeypatch):
    from trainer.config import wandb_credentials_found

    for key in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert not wandb_credentials_found()
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    (tmp_path / "netrc").chmod(0o600)
    assert wandb_credentials_found()
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    assert not wandb_credentials_found()
    monkeypatch.setenv("WANDB_API_KEY", "x")
    assert wandb_credentials_found()


def test_help_names_every_preset_the_most_changed_keys_and_the_readme():
    """`python train.py --help` is our page (conf/hydra/help/train.yaml), not Hydra's dump of
    the whole config: it must not fall behind the presets in conf/ or the defaults."""
    import re

    proc = run_python(["train.py", "--help"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    page = proc.stdout
    assert "README.md" in page and len(page.splitlines()) < 40
    for group in ("model", "optim", "data", "experiment", "hydra/launcher"):
        for option in sorted((REPO / "conf" / group).glob("*.yaml")):
            assert re.search(rf"\b{option.stem}\b", page), (group, option.stem)
    defaults = to_dataclass(compose([]))
    most_changed = page.split("The keys changed most:")[1].split("\n\n")[0]
    shown = dict(re.findall(r"^  (\S+)=(\S+)\s{2,}", most_changed, flags=re.M))
    assert shown.keys() == {"optim.lr", "trainer.max_steps", "trainer.batch_size", "trainer.precision", "seed"}
    for key, value in shown.items():
        node = defaults
        for part in key.split("."):
            node = getattr(node, part)
        assert str(node) == value or float(node) == float(value), (key, node, value)


def test_cli_unknown_preset_fails_before_training():
    proc = run_cli("model=gpt_huge")
    assert proc.returncode != 0
    assert "gpt_huge" in proc.stderr
    assert "Traceback" not in proc.stderr


@requires("datasets", "data=hf")
def test_cli_data_errors_found_while_loading_are_one_line_too(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("one line of text\n" * 50)
    proc = run_cli(f"hydra.run.dir={tmp_path / 'run'}", "data=hf", "data.path=text",
                   f"data.data_files=[{corpus}]", "data.text_field=body",
                   f"data.cache_dir={tmp_path / 'cache'}")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and "data.text_field" in error_lines[0], proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("bad", ["trainer.batch_size=0", "trainer.device=cuda"])
def test_torchrun_config_errors_are_one_line_from_rank_0(tmp_path, bad):
    """Every rank reads the same config: rank 0 says what is wrong, the others exit quietly.
    trainer.device=cuda with more ranks than GPUs stops before any rank touches CUDA."""
    gpus = torch.cuda.device_count()
    nproc = max(2, gpus + 1)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
         "train.py", f"hydra.run.dir={tmp_path}", bad, "logger.wandb.mode=disabled"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    if bad == "trainer.batch_size=0":
        assert "trainer.batch_size" in errors[0]
    elif gpus == 0:
        assert "no CUDA device is visible" in errors[0] and "trainer.device=cpu" in errors[0]
    else:
        assert f"{nproc} processes on this node" in errors[0] and f"{gpus} visible GPU" in errors[0]
    assert 'train.py", line' not in proc.stderr  # no traceback from our code (torchrun prints its own)


@pytest.mark.slow
def test_torchrun_hydra_composition_errors_come_once(tmp_path):
    """A misspelled key fails in the preflight, before Hydra runs: rank 0 says it alone, in one
    line (the other ranks find the same failure and exit quietly), and torchrun's summary names
    that line once, as the root cause, not again for the rank it ended."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "train.py", f"hydra.run.dir={tmp_path}", "trainer.max_stepz=5"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode != 0
    said = "error: trainer.max_stepz: no such key (did you mean trainer.max_steps?)"
    assert proc.stderr.splitlines().count(said) == 1, proc.stderr[-3000:]  # rank 0's own line
    summary = proc.stderr.split("Root Cause")
    assert len(summary) == 2 and summary[1].count(said) == 1, proc.stderr[-3000:]
    assert proc.stderr.count(said) == 2, proc.stderr[-3000:]
