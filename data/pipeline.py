"""From a DataConfig to a tokenizer and token arrays, building only what the cache lacks."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
from transformers import PreTrainedTokenizerBase

from data.cache import cached_tokens
from data.config import DataConfig
from data.sources import Source, check_data_config, eval_source, train_val_sources
from data.tokenizer import (
    build_trained,
    load_pretrained,
    load_trained,
    tokenizer_hash,
    trained_tokenizer_path,
)

log = logging.getLogger("data")


@dataclass
class PreparedData:
    tokenizer: PreTrainedTokenizerBase
    vocab_size: int  # len(tokenizer)
    eos_id: int
    train: np.ndarray  # 1-D token memmap
    eval_sets: dict[str, np.ndarray]  # "val" first, then each cfg.eval_sets name in order


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
    start = time.perf_counter()
    build_trained(path, train, cfg.vocab_size, cfg.tokenizer_train_bytes)
    tokenizer = load_trained(path)
    log.info("tokenizer: trained a byte-level BPE (vocab %d) in %.1fs -> %s",
             len(tokenizer), time.perf_counter() - start, path)
    return tokenizer


def get_tokens(
    cache_dir: Path, name: str, source: Source, tokenizer: PreTrainedTokenizerBase, tokenizer_id: str
) -> np.ndarray:
    start = time.perf_counter()
    tokens, built = cached_tokens(cache_dir, name, source, tokenizer, tokenizer_id)
    if built:
        log.info("%s: built %d tokens (%s) in %.1fs -> %s",
                 name, len(tokens), tokens.dtype, time.perf_counter() - start, tokens.filename)
    else:
        log.info("%s: reused %d tokens (%s) from %s", name, len(tokens), tokens.dtype, tokens.filename)
    return tokens


def check_lengths(train: np.ndarray, eval_sets: dict[str, np.ndarray], seq_len: int) -> None:
    """Fail now, naming the split, rather than at the first batch.

    Training needs two window offsets at least (see TrainBatches), evaluation one window.
    """
    needs = {"train": (train, seq_len + 2)}
    needs.update((name, (tokens, seq_len + 1)) for name, tokens in eval_sets.items())
    for name, (tokens, needed) in needs.items():
        if len(tokens) < needed:
            raise ValueError(f"data split {name!r} has {len(tokens)} tokens; seq_len {seq_len} needs {needed}")


def prepare_data(cfg: DataConfig, seq_len: Optional[int] = None) -> PreparedData:
    """Tokenizer plus train and eval token arrays for `cfg`; with `seq_len`, also check their lengths."""
    check_data_config(cfg)
    cache_dir = resolve_cache_dir(cfg.cache_dir)
    train_source, val_source = train_val_sources(cfg)
    tokenizer = get_tokenizer(cfg, train_source, cache_dir)
    tokenizer_id = tokenizer_hash(tokenizer)
    sources: dict[str, Source] = {"val": val_source}
    sources.update((name, eval_source(name, ecfg)) for name, ecfg in cfg.eval_sets.items())
    train = get_tokens(cache_dir, "train", train_source, tokenizer, tokenizer_id)
    eval_sets = {
        name: get_tokens(cache_dir, name, source, tokenizer, tokenizer_id) for name, source in sources.items()
    }
    if seq_len is not None:
        check_lengths(train, eval_sets, seq_len)
    return PreparedData(tokenizer, len(tokenizer), tokenizer.eos_token_id, train, eval_sets)
