"""The tokenizer: a byte-level BPE trained on the training split, or a pretrained one."""
from __future__ import annotations

import heapq
import json
import logging
from pathlib import Path
from typing import Iterable, Optional

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from data.atomic import atomic_output
from data.hashing import digest, hash_hex
from data.hub import hub_cache_dir, offline_variable, probe_hub
from data.sources import LOCAL_PREFIXES, DataConfigError, Document, Source

log = logging.getLogger("data")

EOS_TOKEN = "<|endoftext|>"
# Bump when training changes in a way that makes earlier tokenizers wrong to reuse.
BPE_FORMAT = 1


def training_sample(docs: Iterable[Document], max_bytes: int) -> list[str]:
    """Texts of the documents with the smallest doc_id hashes, in hash order, `max_bytes` in total.

    Hash order is a shuffle that is the same everywhere, so the sample mixes the whole
    corpus instead of taking its alphabetically first part. A heap keeps only the
    documents that can still be in the sample, so memory stays near `max_bytes` even for
    corpora far larger than that. The last document is cut to fit the budget exactly.
    """
    heap: list[tuple[int, int, str]] = []  # (-hash, size in bytes, text): the largest hash on top
    total = 0
    for doc_id, text in docs:
        size = len(text.encode("utf-8"))
        heapq.heappush(heap, (-int(hash_hex(doc_id), 16), size, text))
        total += size
        while total - heap[0][1] >= max_bytes:
            total -= heapq.heappop(heap)[1]
    sample: list[str] = []
    budget = max_bytes
    for _, size, text in sorted(heap, reverse=True):
        if size > budget:
            text = text.encode("utf-8")[:budget].decode("utf-8", errors="ignore")
        sample.append(text)
        budget -= size
        if budget <= 0:
            break
    return sample


def train_bpe(texts: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE: every string encodes (no unknown tokens) and decodes back exactly."""
    tokenizer = Tokenizer(models.BPE())
    # No prefix space: it would change the text, and decode(encode(x)) must give x back.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        # All 256 bytes, even those absent from the sample, so any text stays encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer, length=len(texts))
    return tokenizer


def load_trained(path: Path) -> PreTrainedTokenizerFast:
    # Spaces before punctuation are text too: the clean-up would break round trips.
    return PreTrainedTokenizerFast(
        tokenizer_file=str(path), eos_token=EOS_TOKEN, clean_up_tokenization_spaces=False
    )


# What to do when a pretrained tokenizer cannot be had, for every error line that says so.
PRETRAINED_FIX = ("point data.tokenizer at a directory that AutoTokenizer.save_pretrained wrote, or fill the "
                  "Hugging Face cache where the hub is reachable and set HF_HUB_OFFLINE=1")


def load_pretrained(name: str) -> PreTrainedTokenizerBase:
    """A local directory, else a hub name: from the hub when it answers, from the local cache
    alone when the user asked for offline mode or the hub does not answer (see data/hub.py)."""
    local = Path(name).expanduser()
    if local.exists():
        tokenizer = _from_pretrained(name, str(local), local_files_only=True)
    elif name.startswith(LOCAL_PREFIXES):
        raise DataConfigError(f"data.tokenizer: cannot load {name!r} (no such directory). Offline, {PRETRAINED_FIX}")
    elif (switch := offline_variable()) is not None:
        tokenizer = _from_pretrained(name, name, local_files_only=True,
                                     why=f"{switch} is set; it is not in the cache {hub_cache_dir()}")
    else:
        status = probe_hub()
        if status.reachable:
            tokenizer = _from_pretrained(name, name)
        else:
            tokenizer = _from_pretrained(name, name, local_files_only=True,
                                         why=f"{status.describe()}; it is not in the cache {hub_cache_dir()}")
            log.warning("data.tokenizer: %s: loaded %r from the local cache", status.describe(), name)
    if tokenizer.eos_token_id is None:
        raise DataConfigError(f"data.tokenizer: {name!r} has no EOS token, which separates documents")
    return tokenizer


def _from_pretrained(name: str, source: str, local_files_only: bool = False,
                     why: Optional[str] = None) -> PreTrainedTokenizerBase:
    """AutoTokenizer.from_pretrained, failing in one line; `why` says why a cache-only load
    failed (the library's own message blames the network either way)."""
    try:
        return AutoTokenizer.from_pretrained(source, local_files_only=local_files_only)
    except (OSError, ValueError) as err:
        # From the hub, a failure is a ~100-line traceback from the HTTP client down.
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataConfigError(
            f"data.tokenizer: cannot load {name!r} ({why or first}). Offline, {PRETRAINED_FIX}"
        ) from err


def trained_tokenizer_path(cache_dir: Path, train: Source, vocab_size: int, max_bytes: int) -> Path:
    key = digest({"format": BPE_FORMAT, "vocab_size": vocab_size, "max_bytes": max_bytes,
                  "source": train.fingerprint()})
    return cache_dir / f"tokenizer-{key}" / "tokenizer.json"


def build_trained(path: Path, train: Source, vocab_size: int, max_bytes: int) -> None:
    bpe = train_bpe(training_sample(train.documents(), max_bytes), vocab_size)
    with atomic_output(path) as f:
        f.write(bpe.to_str().encode("utf-8"))


def vocabulary_hash(tokenizer: PreTrainedTokenizerBase) -> str:
    """The tokenizer's vocabulary (token -> id), for the corpus id. Unlike tokenizer_hash it
    does not change with the library's serialisation format: a field a new `tokenizers`
    release adds must not make identical token streams look like another corpus. What else
    decides the tokens (merges, pre-tokenizer) shows in the token streams themselves."""
    return digest(sorted(tokenizer.get_vocab().items()))


def tokenizer_hash(tokenizer: PreTrainedTokenizerBase) -> str:
    """Identifies what the tokenizer does, for token-cache keys."""
    if not tokenizer.is_fast:
        return digest({"class": type(tokenizer).__name__, "vocab": sorted(tokenizer.get_vocab().items())})
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    # Padding and truncation are call-time settings that transformers stores in the
    # backend; they do not change how a document is tokenized here.
    spec.pop("padding", None)
    spec.pop("truncation", None)
    return digest(spec)
