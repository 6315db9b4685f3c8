"""The data settings checked at start-up, before any corpus is read: every key's value, the
packages an `hf` source needs, the local paths and files named. Each problem is one line naming
its key (DataConfigError / MissingPackageError)."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Optional

from data.config import DataConfig, EvalSourceConfig
from data.manifest import TOPICS_FILE
from data.sources import (
    DATA_FILE_SUFFIXES, EVAL_KINDS, EVAL_NAME, LOCAL_PREFIXES, MIN_VOCAB_SIZE, SOURCE_NAMES, DataConfigError,
    local_data_files, stdlib_root,
)


class MissingPackageError(ValueError):
    """A setting needs an optional package that is not installed; reported as one line."""


def require_package(package: str, setting: str, switch_off: str) -> None:
    """Raise MissingPackageError, naming `setting` and both ways out, if `package` cannot be
    imported. Found without importing it, so a start-up check costs nothing."""
    try:
        found = importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # an import hook refusing it; a module left half-imported
        found = False
    if not found:
        raise MissingPackageError(
            f"{setting} needs the {package} package, which is not installed: install the requirements "
            f"(pip install -r requirements.txt), or {switch_off}"
        )


def check_data_packages(cfg: DataConfig) -> None:
    """The `datasets` package an hf source needs, checked at start-up rather than found
    missing when the corpus is loaded."""
    if cfg.name == "hf":
        require_package("datasets", "data=hf", "train on the embedded corpus with data=stdlib")
    for name, ecfg in cfg.eval_sets.items():
        if ecfg.kind == "hf":
            require_package("datasets", f"data.eval_sets.{name}.kind=hf", f"drop that set with ~data.eval_sets.{name}")


def check_data_config(cfg: DataConfig) -> None:
    """Fail fast, with one line naming the key, on anything wrong in `cfg`.

    Cheap (no dataset loading, only file-system checks), so it runs at start-up before
    any model or data work.
    """
    if cfg.name not in SOURCE_NAMES:
        raise DataConfigError(f"data.name: unknown source {cfg.name!r} (expected stdlib or hf)")
    if cfg.tokenizer is None and cfg.vocab_size < MIN_VOCAB_SIZE:
        raise DataConfigError(f"data.vocab_size must be >= {MIN_VOCAB_SIZE} (got {cfg.vocab_size})")
    if not 0 < cfg.val_fraction < 1:
        raise DataConfigError(f"data.val_fraction must be in (0, 1) (got {cfg.val_fraction})")
    if not 0 <= cfg.tune_fraction < 1:
        raise DataConfigError(f"data.tune_fraction must be in [0, 1) (got {cfg.tune_fraction})")
    if not cfg.val_fraction + cfg.tune_fraction < 1:
        raise DataConfigError(f"data.tune_fraction: data.val_fraction + data.tune_fraction must be < 1, to leave "
                              f"documents for training (got {cfg.val_fraction} + {cfg.tune_fraction})")
    if cfg.tokenizer_train_bytes < 1:
        raise DataConfigError(f"data.tokenizer_train_bytes must be >= 1 (got {cfg.tokenizer_train_bytes})")
    if not cfg.cache_dir:
        raise DataConfigError("data.cache_dir: must not be empty")
    _check_max_docs("data", cfg.max_docs)
    if cfg.tokenizer is not None:
        _check_local_path("data.tokenizer", cfg.tokenizer)
    if cfg.stdlib_root is not None and not (Path(cfg.stdlib_root).expanduser() / "os.py").is_file():
        raise DataConfigError(f"data.stdlib_root: {cfg.stdlib_root} is not a standard library directory (no os.py)")
    if cfg.name == "hf":
        _check_hf_source("data", cfg.path, cfg.data_files)
    for name, ecfg in cfg.eval_sets.items():
        _check_eval_set(name, ecfg, cfg.stdlib_root, cfg.tune_fraction)


def _check_eval_set(name: str, ecfg: EvalSourceConfig, stdlib_dir: Optional[str], tune_fraction: float) -> None:
    key = f"data.eval_sets.{name}"
    if name == "val":
        raise DataConfigError(f"{key}: the name 'val' is reserved for the in-domain split")
    # Both would be logged as val/tune/loss; with no tune split the name is free, as it always was.
    if name == "tune" and tune_fraction > 0:
        raise DataConfigError(f"{key}: the name 'tune' is reserved for the tuning split "
                              f"(data.tune_fraction={tune_fraction})")
    if not EVAL_NAME.fullmatch(name):
        raise DataConfigError(f"{key}: eval set names may only use letters, digits, '_' and '-'")
    if ecfg.kind not in EVAL_KINDS:
        raise DataConfigError(f"{key}.kind: unknown kind {ecfg.kind!r} (expected pydoc_topics or hf)")
    _check_max_docs(key, ecfg.max_docs)
    if ecfg.kind == "hf":
        _check_hf_source(key, ecfg.path, ecfg.data_files)
    topics = stdlib_root(stdlib_dir) / TOPICS_FILE
    if ecfg.kind == "pydoc_topics" and not topics.is_file():
        raise DataConfigError(
            f"{key}: {topics} does not exist (this Python's distribution leaves pydoc_data out); "
            "point data.stdlib_root at a full standard library or drop the eval set"
        )


def _check_max_docs(key: str, max_docs: Optional[int]) -> None:
    if max_docs is not None and max_docs < 1:
        raise DataConfigError(f"{key}.max_docs must be >= 1 or null (got {max_docs})")


def _check_local_path(key: str, path: str) -> None:
    # A hub dataset id never ends in a data file suffix, so "corpus/a.txt" is a local file
    # even without a leading "./".
    looks_local = path.startswith(LOCAL_PREFIXES) or Path(path).suffix.lower() in DATA_FILE_SUFFIXES
    if looks_local and not Path(path).expanduser().exists():
        raise DataConfigError(f"{key}: no such file or directory: {path}")


def _check_hf_source(key: str, path: Optional[str], data_files: Optional[list[str]]) -> None:
    if not path:
        raise DataConfigError(
            f"{key}.path: required for an hf source (a hub dataset, a builder like text, a local path)"
        )
    _check_local_path(f"{key}.path", path)
    for pattern, matches in local_data_files(path, data_files).items():
        if not matches:
            raise DataConfigError(f"{key}.data_files: no such file: {pattern}")
