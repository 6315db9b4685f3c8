"""Document sources: each yields (doc_id, text) in a deterministic order.

Every source also has a `fingerprint()`: a cheap, JSON-able description of its content
that goes into the tokenizer and token-cache keys, so a changed corpus is never served
from a stale cache. This module imports neither torch nor `datasets` at import time:
train.py calls `check_data_config` before loading either.
"""
from __future__ import annotations

import glob
import logging
import re
import sysconfig
from dataclasses import dataclass, field
from functools import cached_property
from itertools import islice
from pathlib import Path
from typing import Any, ClassVar, Iterable, Iterator, Optional, Protocol

from data.config import DataConfig, EvalSourceConfig
from data.file_checks import explain_load_failure
from data.hashing import hash_fraction, split_side
from data.hub import offline_mode, offline_variable, probe_hub
from data.manifest import SPLITTERS, TOPICS_FILE, CorpusPart, Manifest, Selection, read_topics, select, stream_digest

log = logging.getLogger("data")

Document = tuple[str, str]

SOURCE_NAMES = ("stdlib", "hf")
EVAL_KINDS = ("pydoc_topics", "hf")
# A byte-level BPE starts from 256 byte tokens plus the EOS token; below this there is
# hardly any room left for merges.
MIN_VOCAB_SIZE = 512
# Eval set names become metric names (val/<name>/loss) and cache file names.
EVAL_NAME = re.compile(r"[A-Za-z0-9_-]+")
# Hub dataset ids never start like this; such a path is meant to be a local one.
LOCAL_PREFIXES = ("/", "./", "../", "~")
DATA_FILE_SUFFIXES = frozenset({".txt", ".json", ".jsonl", ".csv", ".tsv", ".parquet", ".arrow", ".gz", ".zst", ".xz", ".bz2"})
# Rows fetched from a `datasets` dataset at a time: per-row access is slow.
HF_BATCH_ROWS = 1000


class DataConfigError(ValueError):
    """A data configuration problem, reported to the user as one line naming the key."""


class Source(Protocol):
    def fingerprint(self) -> dict[str, Any]: ...

    def documents(self) -> Iterator[Document]: ...


class SplittableSource(Source, Protocol):
    def split_key(self, doc_id: str, text: str) -> str:
        """What decides a document's train/val side."""
        ...


def is_held_out(split_key: str, val_fraction: float) -> bool:
    """Whether a document belongs to the val side.

    A fixed hash per document, not a random draw: the side is the same on every machine
    and run, and train and val can never overlap.
    """
    return hash_fraction(split_key) < val_fraction


@dataclass
class HashSplit:
    """One side ("train", "val" or "tune") of a hash split of `base` (see split_side)."""

    base: SplittableSource
    part: str
    val_fraction: float
    tune_fraction: float = 0.0

    def fingerprint(self) -> dict[str, Any]:
        fp = {"split": self.part, "val_fraction": self.val_fraction, "source": self.base.fingerprint()}
        # Only where it changes the documents: with no tune split (or for val, whose band it
        # leaves alone), fingerprints, and so cache keys and the corpus id, stay as before it existed.
        if self.tune_fraction > 0 and self.part != "val":
            fp["tune_fraction"] = self.tune_fraction
        return fp

    @property
    def empty_hint(self) -> str:
        """Read only when this side came out empty: how the split fell, counted again."""
        sides = [self.side(doc_id, text) for doc_id, text in self.base.documents()]
        base_hint = getattr(self.base, "empty_hint", "")
        if not sides:
            return base_hint  # nothing to split: the source itself is empty
        key = "data.tune_fraction" if self.part == "tune" else "data.val_fraction"
        fraction = self.tune_fraction if self.part == "tune" else self.val_fraction
        side = "leaves for training" if self.part == "train" else "holds out"
        return (f"; {key}={fraction} {side} {sides.count(self.part)} of the source's {len(sides)} documents: "
                f"give it more text, or change {key}{base_hint}")

    def side(self, doc_id: str, text: str) -> str:
        return split_side(self.base.split_key(doc_id, text), self.val_fraction, self.tune_fraction)

    def documents(self) -> Iterator[Document]:
        for doc_id, text in self.base.documents():
            if self.side(doc_id, text) == self.part:
                yield doc_id, text


def stdlib_root(configured: Optional[str] = None) -> Path:
    """The standard library to read: `configured` (data.stdlib_root) or the running interpreter's."""
    if configured is not None:
        return Path(configured).expanduser()
    return Path(sysconfig.get_paths()["stdlib"])


@dataclass
class CorpusReport:
    """How a pinned source's build compares with the manifest."""

    source: str
    documents: int  # documents read (all the manifest's, or the first data.max_docs)
    chunks: int  # chunks the manifest pins for these documents
    missing: dict[str, int]  # doc_id -> pinned chunks this interpreter lacks
    limited: bool  # data.max_docs cut the corpus short
    pinned: bool  # every pinned chunk found (and, read whole, the manifest's sha256 matched)

    def line(self) -> str:
        if self.missing:
            n_missing = sum(self.missing.values())
            worst = sorted(self.missing.items(), key=lambda item: (-item[1], item[0]))
            listed = ", ".join(f"{doc} ({n})" for doc, n in worst[:8])
            more = f" and {len(worst) - 8} more" if len(worst) > 8 else ""
            return (f"{self.source}: this interpreter lacks {n_missing} of the {self.chunks} chunks the "
                    f"manifest pins, in {len(worst)} documents: {listed}{more}. They were skipped, so this "
                    "corpus (and its id) differs from the published one")
        if not self.pinned:
            return (f"{self.source}: every pinned chunk was found, but the text's sha256 differs from the "
                    "manifest's (a chunk-key collision): this corpus differs from the published one")
        first = f"the first {self.documents} documents (max_docs)" if self.limited else f"{self.documents} documents"
        return f"{self.source}: {first}, all {self.chunks} chunks the manifest pins"


@dataclass
class PinnedSource:
    """Documents as the corpus manifest pins them, built from the running interpreter's text."""

    kind: ClassVar[str]
    limit: Optional[int] = None
    manifest: Optional[Manifest] = None  # None: data/corpus_manifest.json

    def part(self) -> CorpusPart:
        raise NotImplementedError

    def raw_text(self, doc_id: str) -> Optional[str]:
        """The interpreter's text of one document; None where it has none."""
        raise NotImplementedError

    def _manifest(self) -> Manifest:
        if self.manifest is None:
            self.manifest = Manifest.load()
        return self.manifest

    @cached_property
    def selections(self) -> list[Selection]:
        part = self.part()
        split = SPLITTERS[part.splitter]
        doc_ids = list(part.documents)[: self.limit]
        return [select(doc_id, self.raw_text(doc_id), part.documents[doc_id], split) for doc_id in doc_ids]

    def documents(self) -> Iterator[Document]:
        for s in self.selections:
            if s.text:
                yield s.doc_id, s.text

    @property
    def empty_hint(self) -> str:
        """Why a pinned source can come out empty, for the error that says it did."""
        found = sum(1 for s in self.selections if s.text)
        return (f": {found} of the {len(self.selections)} documents the corpus manifest pins were found under "
                f"{getattr(self, 'root', '?')}; point data.stdlib_root at a CPython 3.10-3.13 standard library")

    @cached_property
    def content_digest(self) -> str:
        """sha256 of the built text, as the manifest records a whole corpus's."""
        return stream_digest(self.documents())

    def fingerprint(self) -> dict[str, Any]:
        # The text itself: it is built anyway, and a hash of it cannot go stale.
        return {"kind": self.kind, "content": self.content_digest}

    def report(self) -> CorpusReport:
        part = self.part()
        missing = {s.doc_id: s.missing for s in self.selections if s.missing}
        limited = len(self.selections) < len(part.documents)
        # Read whole, the text must be the manifest's to the byte; a prefix has no recorded hash.
        pinned = not missing and (limited or self.content_digest == part.sha256)
        chunks = sum(len(part.documents[s.doc_id]) for s in self.selections)
        return CorpusReport(self.kind, len(self.selections), chunks, missing, limited, pinned)


@dataclass
class StdlibSource(PinnedSource):
    """Standard-library modules as the manifest pins them; doc_id is the path relative to `root`."""

    kind: ClassVar[str] = "stdlib"
    root: Path = field(default_factory=stdlib_root)

    def part(self) -> CorpusPart:
        return self._manifest().stdlib

    def raw_text(self, doc_id: str) -> Optional[str]:
        try:
            return (self.root / doc_id).read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            return None

    def split_key(self, doc_id: str, text: str) -> str:
        return doc_id


@dataclass
class PydocTopicsSource(PinnedSource):
    """The English help texts of `pydoc_data.topics` as the manifest pins them, by topic name."""

    kind: ClassVar[str] = "pydoc_topics"
    root: Path = field(default_factory=stdlib_root)

    def part(self) -> CorpusPart:
        return self._manifest().pydoc_topics

    @cached_property
    def topics(self) -> dict[str, str]:
        path = self.root / TOPICS_FILE
        return read_topics(path.read_bytes(), str(path)) if path.is_file() else {}

    def raw_text(self, doc_id: str) -> Optional[str]:
        return self.topics.get(doc_id)


def is_remote(pattern: str) -> bool:
    return "://" in pattern


def data_files_base(path: Optional[str]) -> Optional[Path]:
    """Where `datasets` looks for relative data_files of `path`; None when they are in a hub repo."""
    if path is not None:
        local = Path(path).expanduser()
        if local.is_dir():
            return local
        if "/" in path and not path.startswith(LOCAL_PREFIXES):
            return None
    # A builder name ("text", "json", ...): data_files are relative to the working directory.
    return Path.cwd()


def builder_names() -> frozenset[str]:
    """The dataset builders `datasets` ships ("text", "json", "parquet", ...): a path naming
    one reads data_files, not a hub repository."""
    # No public accessor lists them; this module-level table is what load_dataset consults.
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

    return frozenset(_PACKAGED_DATASETS_MODULES)


def needs_hub(path: str, data_files: Optional[list[str]]) -> bool:
    """Whether loading `path` asks the Hugging Face hub: a hub dataset id, or a builder reading
    hf:// data files. A local file or directory, or a builder over local files, does not."""
    if Path(path).expanduser().exists() or path.startswith(LOCAL_PREFIXES):
        return False
    if path in builder_names():
        return any(pattern.startswith("hf://") for pattern in data_files or [])
    return not is_remote(path)


def local_data_files(path: Optional[str], data_files: Optional[list[str]]) -> dict[str, list[Path]]:
    """Each local data_files pattern mapped to the files it matches (sorted)."""
    base = data_files_base(path)
    if base is None or not data_files:
        return {}
    return {
        pattern: sorted(Path(p) for p in glob.glob(str(base / Path(pattern).expanduser()), recursive=True))
        for pattern in data_files
        if not is_remote(pattern)
    }


def is_saved_dataset(path: Optional[str]) -> bool:
    """Whether `path` is a directory that `datasets`' save_to_disk wrote (a Dataset or a
    DatasetDict)."""
    if not path:
        return False
    local = Path(path).expanduser()
    return (local / "state.json").is_file() or (local / "dataset_dict.json").is_file()


@dataclass
class HFSource:
    """A `datasets.load_dataset` split; doc_id is the record index.

    `key` is the config key this source comes from ("data", "data.eval_sets.<name>"),
    so errors name what the user has to fix.
    """

    key: str
    path: str
    dataset_config: Optional[str] = None
    data_files: Optional[list[str]] = None
    split: str = "train"
    text_field: str = "text"
    streaming: bool = False
    max_docs: Optional[int] = None

    @cached_property
    def dataset(self) -> Any:
        import datasets

        try:
            if is_saved_dataset(self.path):
                return self._load_saved(datasets)
            if needs_hub(self.path, self.data_files):
                return self._load_from_hub(datasets)
            return self._load(datasets)
        except DataConfigError:
            raise
        except Exception as err:  # what `datasets` raises names neither the file nor the problem
            raise self._load_error(err) from err

    def _load(self, datasets: Any) -> Any:
        return datasets.load_dataset(
            self.path, self.dataset_config,
            data_files=self.data_files, split=self.split, streaming=self.streaming,
        )

    def _load_from_hub(self, datasets: Any) -> Any:
        """Through the hub only when it answers (data/hub.py): otherwise from `datasets`' cache,
        or one line saying so, instead of a minute of retries."""
        switch = offline_variable()
        if switch is not None:
            with offline_mode():  # the variable may be newer than the libraries' reading of it
                return self._load_cached(datasets, f"{switch} is set")
        status = probe_hub()
        if status.reachable:
            return self._load(datasets)
        if self.streaming:
            raise DataConfigError(f"{self.key}.path: cannot stream {self.path!r}: {status.describe()}; "
                                  f"set {self.key}.streaming=false to read a copy in the local cache, or "
                                  "point it at local files")
        with offline_mode():
            dataset = self._load_cached(datasets, status.describe())
        log.warning("%s.path: %s: loaded %r from the local cache", self.key, status.describe(), self.path)
        return dataset

    def _load_cached(self, datasets: Any, why: str) -> Any:
        try:
            return self._load(datasets)
        except Exception as err:  # offline, `datasets` blames the network whatever was missing
            raise DataConfigError(
                f"{self.key}.path: cannot load {self.path!r} ({why}; it is not in the cache "
                f"{datasets.config.HF_DATASETS_CACHE}). Offline, point {self.key}.path at local files or a "
                "save_to_disk directory, or fill the cache where the hub is reachable and set HF_HUB_OFFLINE=1"
            ) from err

    def _load_saved(self, datasets: Any) -> Any:
        """A directory `Dataset.save_to_disk` / `DatasetDict.save_to_disk` wrote, which
        `load_dataset` refuses (it says to use `load_from_disk`)."""
        loaded = datasets.load_from_disk(str(Path(self.path).expanduser()))
        if isinstance(loaded, datasets.DatasetDict):
            if self.split not in loaded:
                raise DataConfigError(f"{self.key}.split: no split {self.split!r} in {self.path} "
                                      f"(splits: {', '.join(loaded)})")
            loaded = loaded[self.split]
        return loaded.to_iterable_dataset() if self.streaming else loaded

    def _load_error(self, err: Exception) -> DataConfigError:
        return DataConfigError(f"{self.key}: cannot load {self.path!r}: "
                               f"{explain_load_failure(self._local_files(), self.path, err)}")

    def _local_files(self) -> list[Path]:
        """The local files this source reads, in order (none for a hub dataset)."""
        files = [p for matches in local_data_files(self.path, self.data_files).values() for p in matches]
        local = Path(self.path).expanduser()
        if not files and local.is_file():
            files = [local]
        elif not files and local.is_dir() and self.path not in ("json", "text", "csv", "parquet"):
            files = sorted(p for p in local.rglob("*") if p.is_file() and not p.name.startswith("."))
        return files

    def fingerprint(self) -> dict[str, Any]:
        files = local_data_files(self.path, self.data_files)
        fp: dict[str, Any] = {
            "kind": "hf",
            "path": self.path,
            "dataset_config": self.dataset_config,
            "split": self.split,
            "text_field": self.text_field,
            "streaming": self.streaming,
            "max_docs": self.max_docs,
            "data_files": self.data_files,
            "file_stats": [_file_stat(p) for matches in files.values() for p in matches],
        }
        if not self.streaming:
            # `datasets` fingerprints a prepared dataset by its content and origin; no public
            # accessor exists, so the attribute is read directly.
            fp["dataset"] = self.dataset._fingerprint
        return fp

    def documents(self) -> Iterator[Document]:
        texts = islice(self._texts(), self.max_docs)
        for index, text in enumerate(texts):
            if text is None:  # a null field is a missing document, not an error
                continue
            if not isinstance(text, str):
                raise DataConfigError(
                    f"{self.key}.text_field: field {self.text_field!r} holds {type(text).__name__}, not text"
                )
            yield str(index), text

    def split_key(self, doc_id: str, text: str) -> str:
        # By content, not index: duplicated documents land on the same side.
        return text

    def _texts(self) -> Iterator[Any]:
        ds = self.dataset
        if ds.column_names is not None:
            self._require_text_field(ds.column_names)
            ds = ds.select_columns([self.text_field])
        batches = ds.iter(batch_size=HF_BATCH_ROWS)
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except Exception as err:  # a streaming dataset parses its files only here
                raise self._load_error(err) from err
            # A streaming dataset may only reveal its columns here.
            self._require_text_field(batch)
            yield from batch[self.text_field]

    def _require_text_field(self, columns: Iterable[str]) -> None:
        columns = list(columns)
        if self.text_field not in columns:
            raise DataConfigError(
                f"{self.key}.text_field: no field {self.text_field!r} in {self.path!r}"
                f" (fields: {', '.join(columns)})"
            )


def _file_stat(path: Path) -> list[Any]:
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


def train_val_sources(cfg: DataConfig) -> tuple[HashSplit, HashSplit]:
    """The train and in-domain val sides of the configured source (the tune side, between
    them, is data/tune_split.py's)."""
    base: SplittableSource
    if cfg.name == "stdlib":
        base = StdlibSource(limit=cfg.max_docs, root=stdlib_root(cfg.stdlib_root))
    else:
        base = HFSource(
            "data", cfg.path, cfg.dataset_config, cfg.data_files, cfg.split, cfg.text_field, cfg.streaming,
            cfg.max_docs,
        )
    return (HashSplit(base, "train", cfg.val_fraction, cfg.tune_fraction),
            HashSplit(base, "val", cfg.val_fraction, cfg.tune_fraction))


def eval_source(name: str, ecfg: EvalSourceConfig, stdlib_dir: Optional[str] = None) -> Source:
    """One named eval set; `stdlib_dir` is data.stdlib_root, where pydoc_topics are read."""
    if ecfg.kind == "pydoc_topics":
        return PydocTopicsSource(limit=ecfg.max_docs, root=stdlib_root(stdlib_dir))
    return HFSource(
        f"data.eval_sets.{name}", ecfg.path, ecfg.dataset_config, ecfg.data_files, ecfg.split,
        ecfg.text_field, max_docs=ecfg.max_docs,
    )
