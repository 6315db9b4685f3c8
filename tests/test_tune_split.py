"""The tuning split (data.tune_fraction): the hash band above val's, minus, for the embedded
corpus, every chunk another split holds or shares a run of lines with, and the modules that are
near-copies of others; nothing moves while it is 0."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from data.cache import cache_key
from data.config import DataConfig, EvalSourceConfig
from data.hashing import digest, split_side
from data.manifest import CorpusPart, Manifest, code_chunks, chunk_key
from data.token_streams import check_lengths, prepare_data
from data.source_checks import check_data_config
from data.sources import DataConfigError, HashSplit, StdlibSource, eval_source, train_val_sources
from data.tokenizer import trained_tokenizer_path
from data.tune_split import (DEDUP, RUN_LINES, TuneSplit, foreign_chunk_keys, line_runs, normal_lines,
                             tune_chunk_keys, tune_source, unshared_chunks)

TUNE = 0.05  # the fraction a study uses
WINDOW = 32  # tokens: a run of text long enough that a model can learn it by heart
# The band's modules that share most of their text with other splits' modules, left out whole.
NEAR_COPIES = ["asyncio/selector_events.py", "encodings/iso8859_16.py", "encodings/johab.py",
               "encodings/shift_jis.py", "encodings/utf_8.py", "wsgiref/headers.py"]


def doc_ids(source) -> list[str]:
    return [doc_id for doc_id, _ in source.documents()]


def documents_in(tokens: np.ndarray, tokenizer) -> list[str]:
    """A token array cut back into its documents' texts (each ends with EOS)."""
    ids = np.asarray(tokens, dtype=np.int64)
    ends = np.flatnonzero(ids == tokenizer.eos_token_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokenizer.decode(ids[s:e].tolist()) for s, e in zip(starts, ends)]


def token_documents(tokens: np.ndarray, eos: int) -> list[np.ndarray]:
    """A token array cut into its documents' tokens, without the EOS that ends each."""
    ids = np.asarray(tokens, dtype=np.int64)
    ends = np.flatnonzero(ids == eos)
    return [doc[:-1] for doc in np.split(ids, ends + 1)[:-1]]


def windows(doc: np.ndarray) -> list[bytes]:
    """Every WINDOW consecutive tokens of one document, at each position (as bytes, to set)."""
    if len(doc) < WINDOW:
        return []
    return [row.tobytes() for row in np.lib.stride_tricks.sliding_window_view(doc, WINDOW)]


def shared_windows(docs: list[np.ndarray], others: list[np.ndarray]) -> int:
    """How many windows of `docs` (by position) also occur in one of `others`."""
    seen = {w for doc in others for w in windows(doc)}
    return sum(w in seen for doc in docs for w in windows(doc))


def runs_of_lines(text: str) -> set[tuple[str, ...]]:
    """RUN_LINES consecutive non-blank lines, whitespace collapsed: written again here, the plain
    way, so that the rule is checked by other code than its own."""
    lines = [" ".join(line.split()) for line in text.splitlines() if line.strip()]
    return {tuple(lines[i:i + RUN_LINES]) for i in range(len(lines) - RUN_LINES + 1)}


def test_split_side_puts_tune_in_the_band_right_above_val():
    key = "json/__init__.py"  # hash_fraction 0.18704 (tests/test_data.py's golden value)
    assert split_side(key, 0.2) == "val"
    assert split_side(key, 0.1, 0.1) == "tune"
    assert split_side(key, 0.1, 0.08) == "train"
    assert split_side(key, 0.18) == "train"  # no tune band: only val and train
    assert split_side(key, 0.2, 0.5) == "val"  # a tune band never takes from val


# ---- the shipped manifest, without tokenising ----


@pytest.fixture(scope="module")
def shipped():
    """The embedded corpus split at the default val_fraction, with and without a tune split."""
    cfg = DataConfig(tune_fraction=TUNE)
    train, val = train_val_sources(cfg)
    tune = tune_source(cfg, train)
    old_train, old_val = train_val_sources(DataConfig())
    return {"train": train, "val": val, "tune": tune, "old_train": old_train, "old_val": old_val,
            "manifest": Manifest.load()}


def test_tune_documents_are_in_no_other_split_and_val_keeps_its_own(shipped):
    train, val, tune = (doc_ids(shipped[part]) for part in ("train", "val", "tune"))
    ood = doc_ids(eval_source("ood_prose", EvalSourceConfig()))
    band = [d for d in shipped["manifest"].stdlib.documents if split_side(d, 0.05, TUNE) == "tune"]
    assert len(band) == 19 and len(val) == 15 and len(ood) > 50
    assert not set(band) & (set(train) | set(val) | set(ood))
    assert sorted(train + val + band) == sorted(shipped["manifest"].stdlib.documents)
    # tune is the band without its near-copies, which no split takes.
    assert tune == [d for d in band if d not in NEAR_COPIES] and len(tune) == 13
    # val's documents and text are today's; train lost exactly the band's modules.
    assert list(shipped["val"].documents()) == list(shipped["old_val"].documents())
    assert sorted(doc_ids(shipped["old_train"])) == sorted(train + band)


def test_no_tune_chunk_is_held_by_another_split(shipped):
    manifest = shipped["manifest"]
    elsewhere = {key for part in ("train", "val") for doc_id in doc_ids(shipped[part])
                 for key in manifest.stdlib.documents[doc_id]}
    elsewhere |= {key for keys in manifest.pydoc_topics.documents.values() for key in keys}
    assert foreign_chunk_keys(manifest, 0.05, TUNE) == elsewhere
    band = [d for d in manifest.stdlib.documents if split_side(d, 0.05, TUNE) == "tune"]
    band_keys = [key for d in band for key in manifest.stdlib.documents[d]]
    # The premise: modules of the band share boilerplate chunks with train and val modules.
    assert len(band_keys) == 453 and len(set(band_keys) & elsewhere) == 23
    assert sum(key in elsewhere for key in band_keys) == 453 - 423
    # Cut again from the text tune is built of, not only read from the manifest.
    built = [chunk_key(chunk) for _, text in shipped["tune"].documents() for chunk in code_chunks(text)]
    assert len(built) == 361 and not set(built) & elsewhere


def test_no_run_of_lines_in_tune_is_in_another_split(shipped):
    """What the rule guarantees, read from the built text of every split: no RUN_LINES
    consecutive non-blank lines of tune are in a train, val or OOD document."""
    ood = eval_source("ood_prose", EvalSourceConfig())
    elsewhere = {run for source in (shipped["train"], shipped["val"], ood)
                 for _, text in source.documents() for run in runs_of_lines(text)}
    tuned = dict(shipped["tune"].documents())
    assert sum(len(runs_of_lines(text) & elsewhere) for text in tuned.values()) == 0
    # The premise: the band's pinned text shares runs, most of them in the near-copies.
    band = {d: t for d, t in shipped["old_train"].base.documents() if split_side(d, 0.05, TUNE) == "tune"}
    shared = {d: len(runs_of_lines(t) & elsewhere) for d, t in band.items()}
    assert sum(shared.values()) == 364 and sum(shared[d] for d in NEAR_COPIES) == 353
    # What it costs: tune keeps 74% of the band's text (102,087 of 137,634 characters).
    assert (sum(map(len, tuned.values())), sum(map(len, band.values()))) == (102_087, 137_634)


def test_the_tune_split_is_pinned_by_the_manifest(shipped):
    """A change to how tune is carved (the band, the dropped chunks, the line rule) changes this digest."""
    kept = tune_chunk_keys(StdlibSource(manifest=shipped["manifest"]), 0.05, TUNE)
    assert list(kept) == doc_ids(shipped["tune"])
    assert sum(map(len, kept.values())) == 361
    assert digest(kept) == "ebebabe6eb0d3f8d3a3cd92b36168e65"


def test_without_a_tune_split_fingerprints_and_cache_keys_are_todays(shipped):
    """Pinned from the code before data.tune_fraction existed, for the default config: the
    same tokenizer dir and token caches, so the same corpus id (07fe11cb26fb)."""
    cfg = DataConfig()
    train, val = shipped["old_train"], shipped["old_val"]
    content = shipped["manifest"].stdlib.sha256  # the text built, as the manifest records it
    for split in (train, val):
        assert split.fingerprint() == {"split": split.part, "val_fraction": 0.05,
                                       "source": {"kind": "stdlib", "content": content}}
    assert (digest(train.fingerprint()), digest(val.fingerprint())) == (
        "aebe5a78acdaf7aaf2ce31dff2e0d3dd", "87d81d79e6116f8e832f429bc0ca6ce7")
    path = trained_tokenizer_path(Path("cache"), train, cfg.vocab_size, cfg.tokenizer_train_bytes)
    assert path.parent.name == "tokenizer-4a82aac444ac2bf31117164724a22c4a"
    ood = eval_source("ood_prose", cfg.eval_sets["ood_prose"])
    keys = [cache_key(source.fingerprint(), "tokenizer-id") for source in (train, val, ood)]
    assert keys == ["7310e027c7bee7606b9bc9b6736bfe38", "db3e7408a196f570883b46caea5ba64f",
                    "05e772cb430fbab872451b819599b9f8"]
    assert tune_source(cfg, train) is None


def test_a_tune_split_changes_the_train_fingerprint_not_vals(shipped):
    train, val, tune = shipped["train"], shipped["val"], shipped["tune"]
    assert train.fingerprint() == {**shipped["old_train"].fingerprint(), "tune_fraction": TUNE}
    assert val.fingerprint() == shipped["old_val"].fingerprint()
    fp = tune.fingerprint()
    assert (fp["split"], fp["tune_fraction"], fp["dedup"]) == ("tune", TUNE, DEDUP)
    assert fp["source"] == train.base.fingerprint() and len(fp["content"]) == 64


def test_an_empty_tune_band_says_how_the_split_fell():
    # No module of the first 26 (by path) falls in the 0.05-0.10 band; asyncio/log.py, the 27th, does.
    hint = TuneSplit(StdlibSource(limit=26), 0.05, TUNE).empty_hint
    assert hint == ("; data.tune_fraction=0.05 holds out 0 of the source's 26 documents: read more documents "
                    "(data.max_docs), or raise data.tune_fraction")
    assert doc_ids(TuneSplit(StdlibSource(limit=27), 0.05, TUNE)) == ["asyncio/log.py"]


# ---- a synthetic manifest: which chunks are dropped ----


SHARED_DEF = "def close(self):\n    return None\n"
VAL, BAND = 0.25, 0.4  # wide bands, so that a dozen modules fill each side


def module(name: str, *defs: str) -> str:
    return f'"""Module {name}."""\n\n\n' + "\n\n".join(defs)


def own_def(name: str) -> str:
    return f"def only_in_{name.replace('.', '_')}(x):\n    return x + {len(name)}\n"


def in_band(stem: str) -> str:
    """The first module name `<stem><i>.py` that falls in the tune band."""
    return next(f"{stem}{i}.py" for i in range(100) if split_side(f"{stem}{i}.py", VAL, BAND) == "tune")


@pytest.fixture
def synthetic(tmp_path):
    """Twelve modules, each with a def of its own and the same boilerplate def; in the tune band,
    one module that is only a pydoc topic's paragraph and one made of the boilerplate alone."""
    names = [f"m{i}.py" for i in range(12)]
    texts = {name: module(name, own_def(name), SHARED_DEF) for name in names}
    texts[in_band("prose")] = "Shared prose paragraph.\n"
    texts[in_band("boiler")] = SHARED_DEF
    for name, text in texts.items():
        (tmp_path / name).write_text(text)
    topics = {"t": "Other prose.\n\nShared prose paragraph.\n"}  # the last paragraph: no blank line after it
    manifest = Manifest(CorpusPart.common("code", {n: [t] for n, t in texts.items()}),
                        CorpusPart.common("prose", {n: [t] for n, t in topics.items()}))
    return tmp_path, manifest, texts


def test_a_tune_module_drops_the_chunks_other_splits_hold(synthetic):
    root, manifest, texts = synthetic
    sides = {name: split_side(name, VAL, BAND) for name in texts}
    tuned = [n for n in texts if sides[n] == "tune" and n.startswith("m")]
    # The premise: the band holds plain modules, and the boilerplate also sits in train and val.
    assert len(tuned) >= 2 and {"train", "val"} <= {sides[n] for n in texts if n.startswith("m")}
    base = StdlibSource(root=root, manifest=manifest)
    built = dict(TuneSplit(base, VAL, BAND).documents())
    # Each tune module keeps its header and its own def, not the boilerplate def; the module that is
    # a topic's paragraph (OOD) and the one that is only boilerplate are left out whole.
    assert built == {n: module(n, own_def(n)) + "\n\n" for n in sorted(tuned)}
    assert SHARED_DEF not in "".join(built.values())


def test_chunks_are_dropped_by_the_whole_manifest_not_the_max_docs_prefix(synthetic):
    root, manifest, texts = synthetic
    # Read alone, a one-module prefix holds no other split: its boilerplate is dropped all the same.
    first_tune = next(n for n in sorted(texts) if n.startswith("m") and split_side(n, VAL, BAND) == "tune")
    limit = sorted(manifest.stdlib.documents).index(first_tune) + 1
    built = dict(TuneSplit(StdlibSource(limit=limit, root=root, manifest=manifest), VAL, BAND).documents())
    assert built[first_tune] == module(first_tune, own_def(first_tune)) + "\n\n"


def on_side(stem: str, side: str) -> str:
    """The first module name `<stem><i>.py` that falls on `side`."""
    return next(f"{stem}{i}.py" for i in range(100) if split_side(f"{stem}{i}.py", VAL, BAND) == side)


def test_a_tune_chunk_sharing_a_run_of_lines_goes_though_no_chunk_matches(tmp_path):
    trained, tuned, near = on_side("t", "train"), on_side("u", "tune"), on_side("n", "tune")
    table = "TABLE = (\n" + "".join(f"    {i},\n" for i in range(20)) + ")\n"
    add = "def add(a, b):\n    total = a + b\n    total *= 2\n    return total\n"
    prose = "Three lines of help text\nthat a pydoc topic holds\nand a docstring copies.\n"
    owns = [own_def(f"{tuned}{i}") for i in range(6)]
    # add's body as a method (indented anew, under another name), and the topic's lines as a docstring:
    # no chunk of the other splits matches either, but each repeats RUN_LINES lines of one.
    method = "class K:\n    def plus(self, a, b):\n" + "".join("    " + line for line in add.splitlines(True)[1:])
    quoted = 'def helped():\n    """\n' + "".join("    " + line for line in prose.splitlines(True)) + '    """\n'
    texts = {trained: module(trained, add, table), tuned: module(tuned, *owns, method, quoted),
             # trained with one line changed: it keeps only its docstring, a tenth of its text.
             near: module(near, add.replace("*= 2", "*= 3"), table)}
    for name, text in texts.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "pydoc_data").mkdir()
    (tmp_path / "pydoc_data" / "topics.py").write_text(f"topics = {{'help': {prose!r}}}\n")
    manifest = Manifest(CorpusPart.common("code", {n: [t] for n, t in texts.items()}),
                        CorpusPart.common("prose", {"help": [prose]}))
    built = dict(TuneSplit(StdlibSource(root=tmp_path, manifest=manifest), VAL, BAND).documents())
    # tuned keeps its own defs and the class line, not the method nor the docstring; near goes whole.
    assert built == {tuned: module(tuned, *owns, "class K:\n")}


def test_lines_are_compared_with_ascii_whitespace_collapsed():
    assert normal_lines("  x   =\t1  \n\n \x0c \r\n    y\r\n") == ["x = 1", "y"]
    # Other spaces and line breaks are text: str.split() and str.splitlines() follow the Unicode
    # tables of the CPython that runs them.
    assert normal_lines("a\u00a0 b\u2028c\n") == ["a\u00a0 b\u2028c"]


def test_a_chunk_the_interpreter_lacks_breaks_the_runs_of_lines():
    assert line_runs(["a\nb\n", "c\n"]) == {("a", "b", "c")}
    assert line_runs(["a\nb\n", None, "c\nd\n\ne\n"]) == {("c", "d", "e")}


def test_chunks_are_dropped_until_no_run_of_lines_is_shared():
    chunks = [("p", "p\nq\n"), ("x", "x\ny\nz\n"), ("s", "s\n"), ("t", "t\nu\nv\n")]
    # x holds a shared run; without it p and s meet in another, which drops both.
    assert unshared_chunks(chunks, {("x", "y", "z"), ("p", "q", "s")}) == [("t", "t\nu\nv\n")]
    assert unshared_chunks(chunks, set()) == chunks


class Lines:
    """A source without a manifest, split by content as HFSource is."""

    def __init__(self, lines: list[str]):
        self.lines = lines

    def fingerprint(self) -> dict:
        return {"kind": "lines", "n": len(self.lines)}

    def documents(self):
        return iter([(str(i), text) for i, text in enumerate(self.lines)])

    def split_key(self, doc_id: str, text: str) -> str:
        return text


def test_a_source_without_a_manifest_gets_the_band_alone():
    lines = [f"line {i} " * 3 for i in range(200)]
    source = Lines(lines)
    tune = TuneSplit(source, 0.1, 0.2)
    by_side = {side: [t for _, t in HashSplit(source, side, 0.1, 0.2).documents()] for side in ("train", "val")}
    tuned = [t for _, t in tune.documents()]
    assert 20 < len(tuned) < 60 and tuned == [t for t in lines if split_side(t, 0.1, 0.2) == "tune"]
    assert sorted(tuned + by_side["train"] + by_side["val"]) == sorted(lines)
    assert tune.fingerprint() == {"split": "tune", "val_fraction": 0.1, "tune_fraction": 0.2, "dedup": None,
                                  "source": {"kind": "lines", "n": 200}}


# ---- start-up checks ----


@pytest.mark.parametrize("overrides, said", [
    ({"tune_fraction": -0.1}, "data.tune_fraction must be in [0, 1) (got -0.1)"),
    ({"tune_fraction": 1.0}, "data.tune_fraction must be in [0, 1) (got 1.0)"),
    ({"tune_fraction": float("nan")}, "data.tune_fraction must be in [0, 1) (got nan)"),
    ({"val_fraction": 0.5, "tune_fraction": 0.5}, "data.tune_fraction: data.val_fraction + data.tune_fraction must "
                                                  "be < 1, to leave documents for training (got 0.5 + 0.5)"),
    ({"tune_fraction": 0.05, "eval_sets": {"tune": EvalSourceConfig()}},
     "data.eval_sets.tune: the name 'tune' is reserved for the tuning split (data.tune_fraction=0.05)"),
])
def test_bad_tune_settings_are_one_line_naming_the_key(overrides, said):
    with pytest.raises(DataConfigError) as err:
        check_data_config(DataConfig(**overrides))
    assert str(err.value) == said


def test_an_eval_set_may_be_called_tune_when_there_is_no_tune_split():
    check_data_config(DataConfig(eval_sets={"tune": EvalSourceConfig()}))
    check_data_config(DataConfig(tune_fraction=0.9, val_fraction=0.05))


def test_a_tune_split_too_short_for_seq_len_names_tune_fraction():
    tokens = np.zeros(100, dtype=np.uint16)
    with pytest.raises(DataConfigError) as err:
        check_lengths(tokens, {"val": tokens, "tune": tokens[:10]}, 64, 0.05, 0.02)
    assert str(err.value) == ("data split 'tune' has 10 tokens; trainer.seq_len=64 needs 65: use a shorter "
                              "trainer.seq_len or more text, or a larger data.tune_fraction (now 0.02)")


# ---- the pipeline ----


SMALL = {"max_docs": 60, "vocab_size": 1024}  # the first 60 modules, a small vocabulary: quick


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The first 60 modules prepared with and without a tune split (one cache for both)."""
    settings = {**SMALL, "cache_dir": str(tmp_path_factory.mktemp("tune") / "cache")}
    cfg = DataConfig(**settings, tune_fraction=TUNE)
    return cfg, prepare_data(cfg, seq_len=64), prepare_data(DataConfig(**settings), seq_len=64)


def test_prepare_data_adds_tune_after_val_with_its_own_corpus_id(prepared):
    cfg, with_tune, without = prepared
    assert list(with_tune.eval_sets) == ["val", "tune", "ood_prose"]
    assert list(without.eval_sets) == ["val", "ood_prose"] and "tune" not in without.split_sha256
    assert set(with_tune.split_sha256) == {"train", "val", "tune", "ood_prose"}
    assert with_tune.corpus_id != without.corpus_id
    # Tokens hold exactly the split's text; the band's three modules of the first 60 are not trained
    # on, and one of them, a near-copy, is not in tune either.
    train, val = train_val_sources(cfg)
    tune = tune_source(cfg, train)
    assert doc_ids(tune) == ["asyncio/log.py", "asyncio/windows_events.py"]
    assert [d for d in doc_ids(train.base) if split_side(d, 0.05, TUNE) == "tune"] == [
        "asyncio/log.py", "asyncio/selector_events.py", "asyncio/windows_events.py"]
    tok = with_tune.tokenizer
    assert documents_in(with_tune.eval_sets["tune"], tok) == [text for _, text in tune.documents()]
    assert documents_in(with_tune.train, tok) == [text for _, text in train.documents()]
    assert documents_in(with_tune.eval_sets["val"], tok) == documents_in(without.eval_sets["val"], without.tokenizer)


def test_no_window_of_tune_tokens_is_in_train_or_val(prepared):
    """The guarantee tokenised: no WINDOW tokens of tune occur in train or val, where the band's
    text, tokenised the same way, has 692 such windows."""
    cfg, with_tune, _ = prepared
    tok, eos = with_tune.tokenizer, with_tune.eos_id
    tune = token_documents(with_tune.eval_sets["tune"], eos)
    train, val = token_documents(with_tune.train, eos), token_documents(with_tune.eval_sets["val"], eos)
    assert [len(doc) for doc in tune] == [57, 6482]
    assert shared_windows(tune, train) == shared_windows(tune, val) == 0
    base = train_val_sources(cfg)[0].base
    band = [text for d, text in base.documents() if split_side(d, 0.05, TUNE) == "tune"]
    band_tokens = [np.asarray(ids) for ids in tok(band, add_special_tokens=False)["input_ids"]]
    assert shared_windows(band_tokens, train) == 692 and shared_windows(band_tokens, val) == 0
