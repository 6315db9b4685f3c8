"""From a DataConfig to a tokenizer and token arrays, building only what the cache lacks."""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
from transformers import PreTrainedTokenizerBase

from data.cache import TokenSplit, cached_tokens
from data.config import DataConfig
from data.hashing import digest
from data.source_checks import check_data_config
from data.sources import CorpusReport, DataConfigError, PinnedSource, Source, eval_source, train_val_sources
from data.tune_split import tune_source
from data.tokenizer import (
    build_trained,
    load_pretrained,
    load_trained,
    tokenizer_hash,
    vocabulary_hash,
    trained_tokenizer_path,
)

log = logging.getLogger("data")


# Long enough that two corpora never share one by chance, short enough to read in a log line.
CORPUS_ID_HEX_DIGITS = 12


def corpus_id(vocabulary_id: str, split_sha256: dict[str, str]) -> str:
    """Names the exact token streams of every split and the vocabulary they index: two runs
    with the same id trained and were evaluated on the same tokens, meaning the same text."""
    return digest({"vocabulary": vocabulary_id, "splits": split_sha256})[:CORPUS_ID_HEX_DIGITS]


@dataclass
class PreparedData:
    tokenizer: PreTrainedTokenizerBase
    vocab_size: int  # len(tokenizer)
    eos_id: int
    train: np.ndarray  # 1-D token memmap
    # "val" first, then "tune" (with data.tune_fraction > 0), then each cfg.eval_sets name in order
    eval_sets: dict[str, np.ndarray]
    tokenizer_id: str  # tokenizer_hash: keys the token caches
    vocabulary_id: str  # vocabulary_hash: part of the corpus id
    split_sha256: dict[str, str]  # "train", "val", "tune" if any, each eval set -> sha256 of its tokens
    # Manifest-pinned sources (the embedded corpus): how this interpreter's build compares.
    reports: list[CorpusReport]

    @property
    def corpus_id(self) -> str:
        return corpus_id(self.vocabulary_id, self.split_sha256)

    def split_tokens(self) -> dict[str, int]:
        return {"train": len(self.train), **{name: len(tokens) for name, tokens in self.eval_sets.items()}}

    def describe(self) -> dict[str, Any]:
        """The corpus for run records: its id, the size and hash of each split, the manifest check."""
        sizes = self.split_tokens()
        return {
            "id": self.corpus_id,
            "vocabulary": self.vocabulary_id,
            "splits": {name: {"tokens": sizes[name], "sha256": sha} for name, sha in self.split_sha256.items()},
            "manifest": [asdict(report) for report in self.reports],
        }

    def startup_line(self) -> str:
        sizes = ", ".join(f"{name} {n:,}" for name, n in self.split_tokens().items())
        return f"corpus {self.corpus_id}: {sizes} tokens (vocab {self.vocab_size})"


def resolve_cache_dir(cache_dir: str) -> Path:
    # Joining onto the working directory keeps absolute paths as they are.
    return Path.cwd() / Path(cache_dir).expanduser()


def get_tokenizer(cfg: DataConfig, train: Source, cache_dir: Path) -> PreTrainedTokenizerBase:
    if cfg.tokenizer is not None:
        tokenizer = load_pretrained(cfg.tokenizer)
        log.info("tokenizer: pretrained %s (vocab %d)", cfg.tokenizer, len(tokenizer))
        return tokenizer
    path = trained_tokenizer_path(cache_dir, train, cfg.vocab_size, cfg.tokenizer_train_bytes)
    if path.exists():
        tokenizer = load_trained(path)
        log.info("tokenizer: reused %s (vocab %d)", path, len(tokenizer))
        return tokenizer
    # The first run's slow steps say what they do before doing it: nothing else prints meanwhile.
    log.info("tokenizer: training a byte-level BPE (vocab %d) on up to %.0f MB of the train split, "
             "once; it is cached in %s", cfg.vocab_size, cfg.tokenizer_train_bytes / 1e6, path.parent)
    start = time.perf_counter()
    build_trained(path, train, cfg.vocab_size, cfg.tokenizer_train_bytes)
    tokenizer = load_trained(path)
    log.info("tokenizer: trained a byte-level BPE (vocab %d) in %.1fs -> %s",
             len(tokenizer), time.perf_counter() - start, path)
    return tokenizer


def get_tokens(
    cache_dir: Path, name: str, source: Source, tokenizer: PreTrainedTokenizerBase, tokenizer_id: str
) -> TokenSplit:
    start = time.perf_counter()
    split = cached_tokens(cache_dir, name, source, tokenizer, tokenizer_id)
    tokens = split.tokens
    if split.built:
        log.info("%s: built %d tokens (%s) in %.1fs -> %s",
                 name, len(tokens), tokens.dtype, time.perf_counter() - start, tokens.filename)
    else:
        log.info("%s: reused %d tokens (%s) from %s", name, len(tokens), tokens.dtype, tokens.filename)
    return split


def check_against_manifest(sources: list[Source]) -> list[CorpusReport]:
    """Report, for each manifest-pinned source, whether this interpreter built the pinned text."""
    reports = []
    for source in sources:
        if isinstance(source, PinnedSource):
            report = source.report()
            (log.info if report.pinned else log.warning)("corpus manifest: %s", report.line())
            reports.append(report)
    return reports


def check_lengths(train: np.ndarray, eval_sets: dict[str, np.ndarray], seq_len: int, val_fraction: float,
                  tune_fraction: float = 0.0) -> None:
    """Fail now, naming the split, rather than at the first batch.

    Training needs two window offsets at least (see TrainBatches), evaluation one window.
    """
    needs = {"train": (train, seq_len + 2)}
    needs.update((name, (tokens, seq_len + 1)) for name, tokens in eval_sets.items())
    for name, (tokens, needed) in needs.items():
        if len(tokens) < needed:
            fix = "a shorter trainer.seq_len or more text"
            if name in ("train", "val"):
                fix += f", or another data.val_fraction (now {val_fraction}; train has {len(train)} tokens)"
            elif name == "tune":
                fix += f", or a larger data.tune_fraction (now {tune_fraction})"
            raise DataConfigError(
                f"data split {name!r} has {len(tokens)} tokens; trainer.seq_len={seq_len} needs {needed}: use {fix}"
            )


def prepare_data(cfg: DataConfig, seq_len: Optional[int] = None) -> PreparedData:
    """Tokenizer plus train and eval token arrays for `cfg`; with `seq_len`, also check their lengths."""
    check_data_config(cfg)
    cache_dir = resolve_cache_dir(cfg.cache_dir)
    train_source, val_source = train_val_sources(cfg)
    tokenizer = get_tokenizer(cfg, train_source, cache_dir)
    tokenizer_id = tokenizer_hash(tokenizer)
    sources: dict[str, Source] = {"val": val_source}
    tune = tune_source(cfg, train_source)
    if tune is not None:
        sources["tune"] = tune
    sources.update((name, eval_source(name, ecfg, cfg.stdlib_root)) for name, ecfg in cfg.eval_sets.items())
    # The val and tune splits share the train split's base source: one report covers them.
    reports = check_against_manifest([train_source.base, *sources.values()])
    splits = {"train": get_tokens(cache_dir, "train", train_source, tokenizer, tokenizer_id)}
    splits.update(
        (name, get_tokens(cache_dir, name, source, tokenizer, tokenizer_id)) for name, source in sources.items()
    )
    train = splits["train"].tokens
    eval_sets = {name: split.tokens for name, split in splits.items() if name != "train"}
    if seq_len is not None:
        check_lengths(train, eval_sets, seq_len, cfg.val_fraction, cfg.tune_fraction)
    return PreparedData(
        tokenizer, len(tokenizer), tokenizer.eos_token_id, train, eval_sets, tokenizer_id,
        vocabulary_hash(tokenizer), {name: split.sha256 for name, split in splits.items()}, reports,
    )
