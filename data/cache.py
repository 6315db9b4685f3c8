"""Token caches: one split as a flat memmapped token array, built once and shared by all runs.

A cache is two files named by its key: `<name>-<key>.bin`, the raw tokens, and
`<name>-<key>.json`, its meta (key, dtype, n_tokens, and the sha256 of the tokens, from
which the corpus id is made without reading them again). The key hashes the source's
fingerprint and the tokenizer, so a changed corpus or tokenizer gets a new cache instead
of a stale one. Both files are written atomically, the meta last: a meta on disk means
its tokens are complete, and a size that does not match the meta means damage.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional

import numpy as np
from transformers import PreTrainedTokenizerBase

from data.atomic import atomic_output
from data.hashing import digest
from data.sources import DataConfigError, Document, Source

log = logging.getLogger("data")
# How often a long tokenization reports how far it got.
PROGRESS_EVERY_S = 10.0

# Bump when the layout changes (e.g. how documents are separated) to invalidate old caches.
# 2: the meta holds the tokens' sha256.
CACHE_FORMAT = 2
# Documents per tokenizer call: large enough for the backend to use every core.
ENCODE_BATCH_DOCS = 256


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype holding every id: caches are read at every step. Little
    endian whatever the machine, so that a cache's bytes (and their hash) are the same everywhere."""
    return np.dtype("<u2" if vocab_size <= 2**16 else "<u4")


def cache_key(source_fingerprint: dict, tokenizer_id: str) -> str:
    return digest({"format": CACHE_FORMAT, "source": source_fingerprint, "tokenizer": tokenizer_id})


@dataclass(frozen=True)
class CachePaths:
    tokens: Path
    meta: Path

    @classmethod
    def of(cls, cache_dir: Path, name: str, key: str) -> CachePaths:
        stem = cache_dir / "tokens" / f"{name}-{key}"
        return cls(stem.with_suffix(".bin"), stem.with_suffix(".json"))


@dataclass(frozen=True)
class TokenSplit:
    tokens: np.memmap
    sha256: str  # of the raw token bytes (dtype included: see token_dtype)
    built: bool  # False: reused from the cache


def load_tokens(paths: CachePaths, key: str, dtype: np.dtype) -> Optional[TokenSplit]:
    """The cached tokens, or None when missing, stale or damaged (then they need a rebuild)."""
    try:
        meta = json.loads(paths.meta.read_text())
        n_tokens = int(meta["n_tokens"])
        sha256 = str(meta["sha256"])
        if meta["key"] != key or meta["dtype"] != dtype.name or n_tokens < 1:
            return None
        if paths.tokens.stat().st_size != n_tokens * dtype.itemsize:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return TokenSplit(np.memmap(paths.tokens, dtype=dtype, mode="r", shape=(n_tokens,)), sha256, built=False)


def encode_documents(docs: Iterable[Document], tokenizer: PreTrainedTokenizerBase) -> Iterator[list[int]]:
    """Token ids of the documents, in batches, with EOS after each document."""
    eos = tokenizer.eos_token_id
    # Empty documents are skipped: they would add nothing but a lone EOS.
    for texts in _batches((text for _, text in docs if text), ENCODE_BATCH_DOCS):
        # split_special_tokens: a document that contains the literal EOS string must not
        # produce an EOS id mid-document. verbose=False: documents longer than the
        # tokenizer's model_max_length are expected here; they are windowed later.
        encoded = tokenizer(texts, add_special_tokens=False, split_special_tokens=True, verbose=False)
        flat: list[int] = []
        for doc in encoded["input_ids"]:
            flat.extend(doc)
            flat.append(eos)
        yield flat


def _batches(items: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def build_tokens(
    paths: CachePaths, key: str, name: str, source: Source, tokenizer: PreTrainedTokenizerBase
) -> TokenSplit:
    """Tokenize `source` into the cache, streaming to disk so memory does not grow with the corpus."""
    dtype = token_dtype(len(tokenizer))
    n_tokens = 0
    digest = hashlib.sha256()
    log.info("%s: tokenizing, once; the tokens are cached in %s", name, paths.tokens)
    start = last_report = time.perf_counter()
    with atomic_output(paths.tokens) as f:
        for ids in encode_documents(source.documents(), tokenizer):
            # np.asarray raises on ids that do not fit the dtype rather than wrapping them.
            data = np.asarray(ids, dtype=dtype).tobytes()
            f.write(data)
            digest.update(data)
            n_tokens += len(ids)
            if time.perf_counter() - last_report >= PROGRESS_EVERY_S:
                last_report = time.perf_counter()
                log.info("%s: %d tokens so far (%.0fs)", name, n_tokens, last_report - start)
    if n_tokens == 0:
        paths.tokens.unlink()
        hint = getattr(source, "empty_hint", "")
        raise DataConfigError(f"data split {name!r} has no text (its source yielded no non-empty documents){hint}")
    meta = {"key": key, "dtype": dtype.name, "n_tokens": n_tokens, "sha256": digest.hexdigest()}
    with atomic_output(paths.meta) as f:
        f.write(json.dumps(meta, indent=1).encode("utf-8"))
    tokens = np.memmap(paths.tokens, dtype=dtype, mode="r", shape=(n_tokens,))
    return TokenSplit(tokens, meta["sha256"], built=True)


def cached_tokens(
    cache_dir: Path, name: str, source: Source, tokenizer: PreTrainedTokenizerBase, tokenizer_id: str
) -> TokenSplit:
    """The tokens of `source` from the cache, building them if needed."""
    key = cache_key(source.fingerprint(), tokenizer_id)
    paths = CachePaths.of(cache_dir, name, key)
    cached = load_tokens(paths, key, token_dtype(len(tokenizer)))
    return cached if cached is not None else build_tokens(paths, key, name, source, tokenizer)
