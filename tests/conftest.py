"""Shared test helpers: compose the real Hydra config exactly as train.py does."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# Tests never talk to wandb's servers.
os.environ.setdefault("WANDB_MODE", "disabled")
# Two cores: keep intra-op threads fixed so timings and reductions are repeatable.
torch.set_num_threads(2)


def requires(module: str, what: str) -> pytest.MarkDecorator:
    """Skip, saying why, where an installed-by-requirements package is missing.

    requirements.txt installs all of these, so CI and `make test` run these tests; a bare GPU
    image used with its own python (no datasets, wandb or Hydra launcher plugins) skips them.
    """
    try:
        missing = importlib.util.find_spec(module) is None
    except ModuleNotFoundError:  # its parent package is missing too
        missing = True
    return pytest.mark.skipif(missing, reason=f"needs {module} for {what}; not installed here (requirements.txt has it)")


def compose(overrides: list[str] | None = None):
    """The composed DictConfig for `overrides`, as `python train.py <overrides>` sees it."""
    from hydra import compose as hydra_compose, initialize_config_dir

    from trainer.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides or [])


@pytest.fixture
def compose_cfg():
    return compose


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """Keep `datasets`' own arrow cache inside the test's directory (and skip, saying so,
    where `datasets` is not installed)."""
    datasets = pytest.importorskip("datasets", reason="data=hf loads files with datasets; not installed here "
                                                      "(requirements.txt has it)")

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
