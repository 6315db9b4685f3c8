"""The corpus manifest: which text of the standard library the embedded corpus takes.

CPython's standard library changes between releases, and distributions strip parts of it
(test/, idlelib, tkinter, ...), so "whatever the interpreter holds" is a different corpus
on every machine. The manifest pins one corpus instead. Each document (a module, a pydoc
topic) is cut into chunks, and the manifest lists, per document, the content keys of the
chunks that were byte-identical in every CPython it was made from (3.10 to 3.13, several
packagings; see `sources` in the file), in order. A build keeps exactly those chunks,
taken from the running interpreter's files, so every interpreter that has them produces
the same text. A chunk the interpreter lacks (a file stripped by its distribution, a
function a later patch release changed) is skipped and reported, never replaced.

Chunks are whole units, so the text stays readable: for code, a top-level or nested
def/class with its decorators (and the statements up to the next one); for prose, a
paragraph with the blank lines after it. `scripts/make_corpus_manifest.py` writes the file.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

MANIFEST_PATH = Path(__file__).with_name("corpus_manifest.json")
MANIFEST_FORMAT = 1
# 48 bits: collisions among the few hundred chunks of one document are out of reach, and
# the whole stream's sha256 in the manifest catches one anyway.
KEY_HEX_DIGITS = 12
# Parts of the standard library that distributions ship separately or leave out, and the
# packaging leftovers beside it. The manifest never takes a file from these, whatever the
# interpreters it is made from hold. pydoc_data is the OOD prose set, kept out of training.
STRIPPED_PARTS = frozenset({
    "test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "distutils", "ensurepip", "venv",
    "pydoc_data", "site-packages", "dist-packages", "__pycache__", "lib-dynload", "__phello__",
})
TOPICS_FILE = "pydoc_data/topics.py"
STRIPPED_MODULES = frozenset({"turtle.py", "__phello__.foo.py", "_distutils_system_mod.py", "sitecustomize.py"})

_CODE_CHUNK_START = re.compile(r"[ \t]*(?:@|def[ \t]|async[ \t]+def[ \t]|class[ \t])")
_DECORATOR = re.compile(r"[ \t]*@")

Splitter = Callable[[str], list[str]]


def chunk_key(chunk: str) -> str:
    return hashlib.sha256(chunk.encode("utf-8")).hexdigest()[:KEY_HEX_DIGITS]


def code_chunks(text: str) -> list[str]:
    """`text` cut before every def, class or decorator line (at any depth), except a line
    right after a decorator: a decorated function stays one chunk. Joined, they give `text`."""
    chunks: list[str] = []
    current: list[str] = []
    previous = ""
    for line in text.splitlines(keepends=True):
        if current and _CODE_CHUNK_START.match(line) and not _DECORATOR.match(previous):
            chunks.append("".join(current))
            current = []
        current.append(line)
        previous = line
    if current:
        chunks.append("".join(current))
    return chunks


def prose_chunks(text: str) -> list[str]:
    """`text` cut into paragraphs, each with the blank lines after it. Joined, they give `text`."""
    chunks: list[str] = []
    current: list[str] = []
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        current.append(line)
        next_is_text = i + 1 < len(lines) and lines[i + 1].strip()
        if not line.strip() and next_is_text:
            chunks.append("".join(current))
            current = []
    if current:
        chunks.append("".join(current))
    return chunks


SPLITTERS: dict[str, Splitter] = {"code": code_chunks, "prose": prose_chunks}


def common_chunks(versions: list[str], split: Splitter) -> list[str]:
    """The chunks of `versions[0]` found in every other version, in `versions[0]`'s order; a
    chunk repeated in a document is kept as many times as the version with fewest has it."""
    available = Counter(split(versions[0]))
    for text in versions[1:]:
        available &= Counter(split(text))
    kept: list[str] = []
    for chunk in split(versions[0]):
        if available[chunk] > 0:
            available[chunk] -= 1
            kept.append(chunk)
    return kept


@dataclass
class Selection:
    """One document as the manifest pins it, built from the running interpreter's text."""

    doc_id: str
    text: str
    missing: int  # manifest chunks this interpreter does not have (0: the pinned text)


def select(doc_id: str, text: Optional[str], keys: list[str], split: Splitter) -> Selection:
    """The chunks of `text` named by `keys`, in the manifest's order; `text` None: a missing file."""
    return _select(doc_id, text, tuple(keys), split)


def pinned_chunks(text: Optional[str], keys: Iterable[str], split: Splitter) -> list[Optional[str]]:
    """The chunks of `text` the manifest's `keys` name, in their order, as select takes
    them (a repeated chunk as often as the keys repeat it); None for a key `text`
    lacks, or for every key when `text` is None (a missing file)."""
    by_key: dict[str, str] = {}
    left: Counter[str] = Counter()
    for chunk in split(text) if text is not None else []:
        key = chunk_key(chunk)
        by_key[key] = chunk
        left[key] += 1
    chunks: list[Optional[str]] = []
    for key in keys:
        if left[key] > 0:
            left[key] -= 1
            chunks.append(by_key[key])
        else:
            chunks.append(None)
    return chunks


# Keyed by the text itself, so a document read again is cut again only if its text changed:
# every Trainer reads the corpus files (a fresh read is what keeps the corpus honest), but
# cutting and hashing them is most of a start-up's half second, and a process builds its
# Trainer more than once (every job of a sweep, every rank-call of the test suite).
@functools.lru_cache(maxsize=4096)
def _select(doc_id: str, text: Optional[str], keys: tuple[str, ...], split: Splitter) -> Selection:
    chunks = pinned_chunks(text, keys, split)
    parts = [chunk for chunk in chunks if chunk is not None]
    return Selection(doc_id, "".join(parts), len(keys) - len(parts))


def stream_digest(docs: Iterable[tuple[str, str]]) -> str:
    """sha256 of a sequence of (doc_id, text): what the manifest records of a whole corpus."""
    h = hashlib.sha256()
    for doc_id, text in docs:
        for part in (doc_id, text):
            data = part.encode("utf-8")
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
    return h.hexdigest()


@dataclass
class CorpusPart:
    """One source's section of the manifest: documents in order, each with its chunk keys."""

    splitter: str  # a SPLITTERS name
    documents: dict[str, list[str]]
    sha256: str  # stream_digest of every document's pinned text, in order
    size_bytes: int

    def to_json(self) -> dict:
        return {
            "splitter": self.splitter, "sha256": self.sha256, "size_bytes": self.size_bytes,
            "documents": {doc_id: " ".join(keys) for doc_id, keys in self.documents.items()},
        }

    @classmethod
    def from_json(cls, obj: dict) -> CorpusPart:
        docs = {doc_id: keys.split() for doc_id, keys in obj["documents"].items()}
        return cls(obj["splitter"], docs, obj["sha256"], int(obj["size_bytes"]))

    @classmethod
    def common(cls, splitter: str, versions: dict[str, list[str]]) -> CorpusPart:
        """The part pinning what every version of each document shares (documents in sorted order)."""
        split = SPLITTERS[splitter]
        documents: dict[str, list[str]] = {}
        texts: list[tuple[str, str]] = []
        for doc_id in sorted(versions):
            kept = common_chunks(versions[doc_id], split)
            if kept:
                documents[doc_id] = [chunk_key(c) for c in kept]
                texts.append((doc_id, "".join(kept)))
        size = sum(len(text.encode("utf-8")) for _, text in texts)
        return cls(splitter, documents, stream_digest(texts), size)


@dataclass
class Manifest:
    stdlib: CorpusPart
    pydoc_topics: CorpusPart
    sources: list[str] = field(default_factory=list)  # the interpreters it was made from

    def to_json(self) -> str:
        obj = {"format": MANIFEST_FORMAT, "sources": self.sources,
               "stdlib": self.stdlib.to_json(), "pydoc_topics": self.pydoc_topics.to_json()}
        return json.dumps(obj, indent=1) + "\n"

    @classmethod
    def load(cls, path: Optional[Path] = None) -> Manifest:
        path = path if path is not None else MANIFEST_PATH  # read at call time: tests swap it
        obj = json.loads(path.read_text(encoding="utf-8"))
        if obj.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"{path}: manifest format {obj.get('format')!r}, expected {MANIFEST_FORMAT}")
        return cls(CorpusPart.from_json(obj["stdlib"]), CorpusPart.from_json(obj["pydoc_topics"]),
                   list(obj.get("sources", [])))


def is_stripped(rel_path: str) -> bool:
    parts = rel_path.split("/")
    return bool(STRIPPED_PARTS.intersection(parts[:-1])) or parts[-1] in STRIPPED_MODULES


def read_topics(source: bytes, filename: str) -> dict[str, str]:
    """The `topics` dict of a pydoc_data/topics.py's source, read as a literal (never executed)."""
    tree = ast.parse(source, filename=filename)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "topics" for t in node.targets):
            return ast.literal_eval(node.value)
    raise ValueError(f"{filename}: no `topics = {{...}}` assignment")
