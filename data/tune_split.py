"""The tuning split "tune": documents held out to choose hyperparameters on, so that the
choice never sees val or the OOD sets it is then judged on (data.tune_fraction).

It is the hash band right above val's (data/hashing.py split_side): val keeps exactly its
documents, and train loses the band. No document is in two splits, but standard library
modules share text: byte-identical chunks (small boilerplate defs), and near-copies that no
whole chunk matches (encodings/iso8859_16.py is the other iso8859 codec tables with a few
characters changed; asyncio's transports repeat each other's error handling). So for the
embedded corpus a tune document keeps only the chunks that share no run of RUN_LINES
consecutive lines with any train, val or OOD (pydoc topics) document of the manifest, and a
document that would keep less than half its text is left out whole. Both come from the pinned
text alone (no tokenizer), so every CPython that builds the pinned corpus has the same tune
split. A data=hf source has no chunk manifest: its tune split is the band alone (no shared
document; partial overlaps between documents stay).
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from functools import cached_property
from typing import AbstractSet, Any, Iterable, Iterator, Optional

from data.config import DataConfig
from data.hashing import split_side
from data.manifest import SPLITTERS, Manifest, pinned_chunks, select, stream_digest
from data.sources import Document, HashSplit, PydocTopicsSource, SplittableSource, StdlibSource

# Names how tune drops shared text, in its fingerprint: bump it when that changes (RUN_LINES,
# NEAR_COPY_BELOW, how lines are normalised), so that no cache made the old way is reused.
DEDUP = "foreign-chunks+3-line-runs+half-kept-2"
# A tune chunk goes if it shares a run of this many consecutive non-blank lines with another
# split. 3 is the longest run that leaves no 32-token window of tune in train or val (vocab
# 8192, full corpus): at 4, a 3-line def signature padded by its indentation is still shared.
# Shorter runs drop text for nothing measured: 2 keeps 22,390 tokens of tune, 3 keeps 25,165.
RUN_LINES = 3
# A tune module that keeps less than this fraction of its text (in characters) is a near-copy
# of modules in the other splits: what would be left is the scattered lines where it differs
# (methods without their class), which still repeat the others line by line. It goes whole.
NEAR_COPY_BELOW = 0.5

Run = tuple[str, ...]
# Collapsed so that re-indenting or re-spacing a copy does not hide it. ASCII only, and lines
# cut at "\n" only: str.split() and str.splitlines() follow the Unicode tables of the running
# CPython, and the rule must come out the same on every one.
_SPACES = re.compile(r"\s+", re.ASCII)


def normal_lines(text: str) -> list[str]:
    """The non-blank lines of `text`, each with its runs of whitespace collapsed to one space."""
    lines = (_SPACES.sub(" ", line).strip(" ") for line in text.split("\n"))
    return [line for line in lines if line]


def line_runs(chunks: Iterable[Optional[str]]) -> set[Run]:
    """Every run of RUN_LINES consecutive normal lines in the chunks, read in order; a None
    (a chunk this interpreter lacks) breaks the lines there, so no run spans the gap: what is
    found is always a run of the pinned text."""
    runs: set[Run] = set()
    lines: list[str] = []
    for chunk in chunks:
        if chunk is None:
            lines = []
            continue
        for line in normal_lines(chunk):
            lines.append(line)
            if len(lines) >= RUN_LINES:
                runs.add(tuple(lines[-RUN_LINES:]))
    return runs


# Keyed by the text itself, as data/manifest.py's _select is: each preparation reads the files
# again, but cutting and scanning the ~500 documents of the other splits is most of tune's cost,
# and a process prepares data more than once (every job of a sweep, the test suite).
@functools.lru_cache(maxsize=1024)
def _document_runs(text: Optional[str], keys: tuple[str, ...], splitter: str) -> frozenset[Run]:
    return frozenset(line_runs(pinned_chunks(text, keys, SPLITTERS[splitter])))


def foreign_chunk_keys(manifest: Manifest, val_fraction: float, tune_fraction: float) -> frozenset[str]:
    """Chunk keys held by any manifest document outside the tune band: stdlib train and val
    documents, and every pydoc topic (the OOD set). Computed over the whole manifest, not the
    data.max_docs prefix, so it is the same on every CPython and for every prefix."""
    keys: set[str] = set()
    for doc_id, doc_keys in manifest.stdlib.documents.items():
        # A module's split key is its path (StdlibSource.split_key).
        if split_side(doc_id, val_fraction, tune_fraction) != "tune":
            keys.update(doc_keys)
    for doc_keys in manifest.pydoc_topics.documents.values():
        keys.update(doc_keys)
    return frozenset(keys)


def foreign_line_runs(stdlib: StdlibSource, val_fraction: float, tune_fraction: float) -> frozenset[Run]:
    """The line runs of the same documents as foreign_chunk_keys (the whole manifest), in their
    pinned text as read under `stdlib.root`, pydoc topics included."""
    manifest = stdlib._manifest()
    topics = PydocTopicsSource(root=stdlib.root, manifest=manifest)
    runs: set[Run] = set()
    for source in (stdlib, topics):
        part = source.part()
        for doc_id, keys in part.documents.items():
            if source is topics or split_side(doc_id, val_fraction, tune_fraction) != "tune":
                runs.update(_document_runs(source.raw_text(doc_id), tuple(keys), part.splitter))
    return frozenset(runs)


def unshared_chunks(chunks: list[tuple[str, str]], foreign: AbstractSet[Run]) -> list[tuple[str, str]]:
    """The (key, text) chunks of one document without those that a foreign run touches, read
    from the text they make together. Dropping a chunk joins its neighbours' lines into new
    runs, so it is read again until no run is shared; a run across two chunks drops both, which
    needs no rule for which one to keep."""
    kept = chunks
    while True:
        lines: list[str] = []
        owner: list[int] = []  # the index in `kept` of each line's chunk
        for i, (_, text) in enumerate(kept):
            for line in normal_lines(text):
                lines.append(line)
                owner.append(i)
        shared = {owner[j] for start in range(len(lines) - RUN_LINES + 1)
                  if tuple(lines[start:start + RUN_LINES]) in foreign
                  for j in range(start, start + RUN_LINES)}
        if not shared:
            return kept
        kept = [chunk for i, chunk in enumerate(kept) if i not in shared]


def tune_chunk_keys(stdlib: StdlibSource, val_fraction: float, tune_fraction: float) -> dict[str, list[str]]:
    """The stdlib documents of the tune split, in manifest order (the whole manifest's, not the
    data.max_docs prefix), each with the chunk keys it keeps, in order: not a chunk another
    split holds, nor one in a run of lines another split has; a document left with less than
    NEAR_COPY_BELOW of its text, or none, is left out."""
    part = stdlib.part()
    foreign_keys = foreign_chunk_keys(stdlib._manifest(), val_fraction, tune_fraction)
    foreign_runs = foreign_line_runs(stdlib, val_fraction, tune_fraction)
    split = SPLITTERS[part.splitter]
    kept: dict[str, list[str]] = {}
    for doc_id, doc_keys in part.documents.items():
        if split_side(doc_id, val_fraction, tune_fraction) != "tune":
            continue
        texts = pinned_chunks(stdlib.raw_text(doc_id), doc_keys, split)
        present = [(key, text) for key, text in zip(doc_keys, texts) if text is not None]
        chunks = unshared_chunks([(key, text) for key, text in present if key not in foreign_keys], foreign_runs)
        # Measured against the text this interpreter builds, which is the pinned text where it has it all.
        size = sum(len(text) for _, text in chunks)
        if chunks and size >= NEAR_COPY_BELOW * sum(len(text) for _, text in present):
            kept[doc_id] = [key for key, _ in chunks]
    return kept


@dataclass
class TuneSplit:
    """The tune side of `base`: for the embedded corpus, its tune-band documents without the
    text other splits share; for any other source, its tune-band documents."""

    base: SplittableSource
    val_fraction: float
    tune_fraction: float

    @property
    def stdlib(self) -> Optional[StdlibSource]:
        """The base, when it is the embedded corpus (which has a manifest to drop chunks by)."""
        return self.base if isinstance(self.base, StdlibSource) else None

    @cached_property
    def pinned_keys(self) -> Optional[dict[str, list[str]]]:
        """tune_chunk_keys for the embedded corpus; None for a source without a manifest."""
        if self.stdlib is None:
            return None
        return tune_chunk_keys(self.stdlib, self.val_fraction, self.tune_fraction)

    def band(self) -> HashSplit:
        return HashSplit(self.base, "tune", self.val_fraction, self.tune_fraction)

    def documents(self) -> Iterator[Document]:
        stdlib, keys = self.stdlib, self.pinned_keys
        if stdlib is None or keys is None:
            yield from self.band().documents()
            return
        split = SPLITTERS[stdlib.part().splitter]
        # stdlib.selections is the data.max_docs prefix: tune takes its documents from it only.
        for s in stdlib.selections:
            if s.doc_id in keys:
                kept = select(s.doc_id, stdlib.raw_text(s.doc_id), keys[s.doc_id], split)
                if kept.text:
                    yield s.doc_id, kept.text

    def fingerprint(self) -> dict[str, Any]:
        fp: dict[str, Any] = {"split": "tune", "val_fraction": self.val_fraction,
                              "tune_fraction": self.tune_fraction, "dedup": None, "source": self.base.fingerprint()}
        if self.pinned_keys is not None:
            # What is dropped depends on the whole manifest's text, pydoc topics included, which the
            # base's fingerprint does not cover: the text itself does (it is cheap to build).
            fp["dedup"] = DEDUP
            fp["content"] = stream_digest(self.documents())
        return fp

    @property
    def empty_hint(self) -> str:
        """Read only when tune came out empty: how the band fell, counted again."""
        stdlib, keys = self.stdlib, self.pinned_keys
        if stdlib is None or keys is None:
            return self.band().empty_hint
        band = [s.doc_id for s in stdlib.selections
                if split_side(s.doc_id, self.val_fraction, self.tune_fraction) == "tune"]
        shared = sum(doc_id not in keys for doc_id in band)
        why = f" ({shared} of them left out as near-copies of other splits' text)" if shared else ""
        # Where the interpreter lacks modules, the base says where it looked.
        lacking = stdlib.empty_hint if any(not s.text for s in stdlib.selections) else ""
        return (f"; data.tune_fraction={self.tune_fraction} holds out {len(band)} of the source's "
                f"{len(stdlib.selections)} documents{why}: read more documents (data.max_docs), or raise "
                f"data.tune_fraction{lacking}")


def tune_source(cfg: DataConfig, train: HashSplit) -> Optional[TuneSplit]:
    """The tune split of `train`'s base source; None when data.tune_fraction is 0."""
    if cfg.tune_fraction == 0:
        return None
    return TuneSplit(train.base, cfg.val_fraction, cfg.tune_fraction)
