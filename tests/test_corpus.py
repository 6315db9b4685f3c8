"""The pinned embedded corpus: chunking, the manifest, identical builds on stripped and full
standard libraries, what a build reports when it lacks pinned text, and the corpus id."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

import data.manifest as manifest_module
from data.cache import token_dtype
from data.config import DataConfig
from data.manifest import (
    CorpusPart,
    Manifest,
    chunk_key,
    code_chunks,
    common_chunks,
    is_stripped,
    prose_chunks,
    select,
)
from data.token_streams import corpus_id, prepare_data
from data.source_checks import check_data_config
from data.sources import DataConfigError, PydocTopicsSource, StdlibSource

REPO = Path(__file__).resolve().parent.parent
MAKE_MANIFEST = REPO / "scripts" / "make_corpus_manifest.py"


# ---- chunking ----

CODE = '''"""Module doc."""
import os


@decorator
@other(1)
def first(x):
    return x


class Thing:
    """A class."""

    def method(self):
        pass

    async def run(self):
        await self.method()
X = 1
'''


def test_code_chunks_cut_before_defs_and_keep_decorators_with_their_function():
    chunks = code_chunks(CODE)
    assert "".join(chunks) == CODE
    starts = [c.splitlines()[0] for c in chunks]
    assert starts == ['"""Module doc."""', "@decorator", "class Thing:", "    def method(self):",
                      "    async def run(self):"]
    assert chunks[1].splitlines()[:3] == ["@decorator", "@other(1)", "def first(x):"]
    assert chunks[-1].endswith("X = 1\n")


def test_prose_chunks_are_paragraphs_with_their_blank_lines():
    text = "Title\n*****\n\nFirst para\nline two.\n\n\n   indented example\n\nLast."
    chunks = prose_chunks(text)
    assert "".join(chunks) == text
    assert chunks == ["Title\n*****\n\n", "First para\nline two.\n\n\n", "   indented example\n\n", "Last."]


def test_common_chunks_keep_the_first_versions_order_and_the_smallest_count():
    a = "A\n\nB\n\nA\n\nC\n\n"
    b = "C\n\nA\n\nB\n\nD\n\n"  # C moved, A once, D new
    assert common_chunks([a, b], prose_chunks) == ["A\n\n", "B\n\n", "C\n\n"]


def test_select_takes_the_pinned_chunks_in_manifest_order_and_counts_the_missing():
    keys = [chunk_key(c) for c in ("A\n\n", "B\n\n", "C\n\n")]
    reordered = select("doc", "C\n\nX\n\nB\n\nA\n\n", keys, prose_chunks)
    assert (reordered.text, reordered.missing) == ("A\n\nB\n\nC\n\n", 0)
    changed = select("doc", "A\n\nB2\n\nC\n\n", keys, prose_chunks)
    assert (changed.text, changed.missing) == ("A\n\nC\n\n", 1)
    assert select("doc", None, keys, prose_chunks).missing == 3


def test_stripped_parts_are_recognised():
    for rel in ("test/test_os.py", "idlelib/editor.py", "tkinter/__init__.py", "turtle.py",
                "ensurepip/__init__.py", "lib2to3/main.py", "pydoc_data/topics.py", "a/__pycache__/b.py"):
        assert is_stripped(rel), rel
    for rel in ("os.py", "json/decoder.py", "email/mime/text.py", "testing_helper.py"):
        assert not is_stripped(rel), rel


# ---- synthetic standard libraries ----


def module_text(i: int, changed: str = "") -> str:
    functions = "".join(
        f"\n\ndef function_{i}_{j}(value, scale={j}):\n"
        f'    """Return value {j} times over for module {i}{changed if j == 2 else ""}."""\n'
        f"    result = [value * scale for _ in range({i + j})]\n"
        f"    return sum(result) + {i * j}\n"
        for j in range(5)
    )
    return f'"""Synthetic module number {i}."""\nimport math\n{functions}'


TOPICS = {
    "assert": "The assert statement\n\nAssert statements are a way to insert checks.\n\nThey may be off.\n",
    "if": "The if statement\n\nThe if statement is used for conditional execution.\n",
    "while": "The while statement\n\nRepeats a block while a condition holds.\n\nSee also for.\n",
}


def stdlib_files(modules: int = 12, changed: dict[int, str] | None = None, topics=None) -> dict[str, bytes]:
    changed = changed or {}
    files = {f"mod{i}.py": module_text(i, changed.get(i, "")).encode() for i in range(modules)}
    files["os.py"] = b'"""Stand-in for os."""\nsep = "/"\n'
    files["pkg/__init__.py"] = b"from pkg.util import helper\n"
    files["pkg/util.py"] = b"def helper(a, b):\n    return a + b\n\n\ndef other():\n    return None\n"
    files["pydoc_data/topics.py"] = f"topics = {topics if topics is not None else TOPICS!r}\n".encode()
    return files


STRIPPED_EXTRAS = {
    "test/test_mod0.py": b"import unittest\n\n\ndef test_it():\n    assert True\n",
    "test/legacy_encoding.py": "s = 'caf\xe9'\n".encode("latin-1"),
    "idlelib/editor.py": b"class Editor:\n    pass\n",
    "tkinter/__init__.py": b"def Tk():\n    return None\n",
    "turtle.py": b"def forward(n):\n    return n\n",
    "ensurepip/__init__.py": b"def bootstrap():\n    pass\n",
    "site-packages/thirdparty.py": b"def vendored():\n    pass\n",
}


def write_tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def make_manifest(out: Path, *roots: Path) -> Manifest:
    args = [f"v{i}={root}" for i, root in enumerate(roots)]
    done = subprocess.run([sys.executable, str(MAKE_MANIFEST), *args, "--out", str(out)],
                          capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return Manifest.load(out)


@pytest.fixture
def libraries(tmp_path, monkeypatch):
    """Two packagings of one release (full, and stripped of the optional parts), the next
    release (one function and one paragraph changed, a module added), and the pinned manifest
    made from the full one and the next release, installed as the corpus manifest."""
    full = write_tree(tmp_path / "full", {**stdlib_files(), **STRIPPED_EXTRAS})
    stripped = write_tree(tmp_path / "stripped", stdlib_files())
    next_topics = {**TOPICS, "if": TOPICS["if"].replace("conditional", "conditional (changed)")}
    nxt = stdlib_files(changed={3: " (changed)"}, topics=next_topics)
    nxt["mod_new.py"] = b"def brand_new():\n    return 1\n"
    # A release packaged as a zip (as Pyodide ships it) is read like a directory.
    zipped = tmp_path / "next.zip"
    with zipfile.ZipFile(zipped, "w") as z:
        for rel, data in nxt.items():
            z.writestr(rel, data)
    manifest = make_manifest(tmp_path / "manifest.json", full, zipped)
    monkeypatch.setattr(manifest_module, "MANIFEST_PATH", tmp_path / "manifest.json")
    return {"full": full, "stripped": stripped, "manifest": manifest, "tmp": tmp_path}


def test_manifest_pins_only_text_every_release_shares(libraries):
    manifest = libraries["manifest"]
    docs = manifest.stdlib.documents
    assert sorted(docs) == sorted(["os.py", "pkg/__init__.py", "pkg/util.py", *(f"mod{i}.py" for i in range(12))])
    assert not any(is_stripped(d) for d in docs)  # no test/, idlelib, tkinter, turtle, ...
    # mod3's changed function is left out, its other four functions and header kept.
    assert len(docs["mod3.py"]) == len(docs["mod4.py"]) - 1 == 5
    assert len(manifest.pydoc_topics.documents["if"]) == 1  # the changed paragraph is out
    assert manifest.sources == ["v0", "v1"]


def corpus_cfg(tmp, root: Path, **overrides) -> DataConfig:
    settings = {"cache_dir": str(tmp / "cache"), "vocab_size": 512, "val_fraction": 0.3, "stdlib_root": str(root)}
    return DataConfig(**{**settings, **overrides})


def test_full_and_stripped_libraries_build_the_same_tokens_and_id(libraries):
    tmp = libraries["tmp"]
    full = prepare_data(corpus_cfg(tmp, libraries["full"]))
    # A separate cache: the stripped build must make its own tokens, not reuse the full one's.
    stripped = prepare_data(corpus_cfg(tmp, libraries["stripped"], cache_dir=str(tmp / "cache2")))
    assert len(full.train) > 1000 and len(full.eval_sets["val"]) > 100 and len(full.eval_sets["ood_prose"]) > 20
    assert np.array_equal(full.train, stripped.train)
    for name in ("val", "ood_prose"):
        assert np.array_equal(full.eval_sets[name], stripped.eval_sets[name])
    assert full.tokenizer_id == stripped.tokenizer_id and full.vocabulary_id == stripped.vocabulary_id
    assert full.corpus_id == stripped.corpus_id and len(full.corpus_id) == 12
    assert [r.pinned for r in full.reports] == [r.pinned for r in stripped.reports] == [True, True]
    text = full.tokenizer.decode(np.asarray(full.train, dtype=np.int64).tolist())
    assert "function_1_4" in text and "(changed)" not in text
    assert "unittest" not in text and "Editor" not in text and "vendored" not in text


def test_a_library_lacking_pinned_text_reports_it_and_gets_another_id(libraries, caplog):
    tmp = libraries["tmp"]
    pinned = prepare_data(corpus_cfg(tmp, libraries["full"]))
    # An older patch release: one pinned function of mod7 differs, pkg/util.py is absent.
    older = stdlib_files(changed={7: " (older)"})
    del older["pkg/util.py"]
    root = write_tree(tmp / "older", older)
    with caplog.at_level("WARNING", logger="data"):
        other = prepare_data(corpus_cfg(tmp, root))
    stdlib_report = other.reports[0]
    assert stdlib_report.missing == {"mod7.py": 1, "pkg/util.py": 2} and not stdlib_report.pinned
    assert other.reports[1].pinned
    assert any("lacks 3 of the" in m and "mod7.py (1)" in m for m in caplog.messages)
    assert other.corpus_id != pinned.corpus_id
    # The tokenizer learns from the (changed) training text, so the prose is the same text in
    # other tokens: the id covers the tokenizer too.
    assert other.tokenizer_id != pinned.tokenizer_id and other.vocabulary_id != pinned.vocabulary_id
    prose = [d.tokenizer.decode(np.asarray(d.eval_sets["ood_prose"], dtype=np.int64).tolist()) for d in (other, pinned)]
    assert prose[0] == prose[1]


def test_the_shipped_manifest_is_built_exactly_by_this_interpreter():
    """CI's interpreter is one of those the manifest covers: it must build the pinned text."""
    stdlib, topics = StdlibSource(), PydocTopicsSource()
    for source in (stdlib, topics):
        report = source.report()
        assert report.pinned and not report.missing, report.line()
    manifest = Manifest.load()
    assert sum(len(t.encode()) for _, t in stdlib.documents()) == manifest.stdlib.size_bytes
    assert not any(is_stripped(d) for d in manifest.stdlib.documents)
    assert len(manifest.sources) >= 8 and any("3.10" in s for s in manifest.sources)
    assert any("3.13" in s for s in manifest.sources)


def test_stdlib_root_and_missing_topics_fail_fast(tmp_path):
    with pytest.raises(DataConfigError, match=r"^data.stdlib_root: .*\(no os.py\)"):
        check_data_config(DataConfig(stdlib_root=str(tmp_path)))
    root = write_tree(tmp_path / "lib", {"os.py": b"x = 1\n"})
    with pytest.raises(DataConfigError, match=r"^data.eval_sets.ood_prose: .*pydoc_data/topics.py does not exist"):
        check_data_config(DataConfig(stdlib_root=str(root)))
    check_data_config(DataConfig(stdlib_root=str(root), eval_sets={}))


# ---- token hashes and the corpus id ----


def test_cache_meta_holds_the_sha256_of_the_token_bytes(libraries):
    data = prepare_data(corpus_cfg(libraries["tmp"], libraries["full"]))
    metas = {p.name.split("-")[0]: json.loads(p.read_text())
             for p in (libraries["tmp"] / "cache" / "tokens").glob("*.json")}
    assert set(metas) == {"train", "val", "ood_prose"}
    for name, meta in metas.items():
        raw = np.asarray(data.train if name == "train" else data.eval_sets[name], dtype=token_dtype(data.vocab_size))
        assert meta["sha256"] == hashlib.sha256(raw.tobytes()).hexdigest() == data.split_sha256[name]
    # Reused from the cache: the same hashes and id without re-tokenizing.
    assert prepare_data(corpus_cfg(libraries["tmp"], libraries["full"])).corpus_id == data.corpus_id


def test_corpus_id_does_not_change_with_the_tokenizer_libraries_serialisation(libraries):
    """A tokenizers release that writes one more field into a tokenizer's spec (0.23 added
    model.ignore_merges) changes the cache key, which hashes the whole spec, but must not
    change the corpus id of the same vocabulary and tokens."""
    from data.tokenizer import tokenizer_hash, vocabulary_hash

    data = prepare_data(corpus_cfg(libraries["tmp"], libraries["full"]))
    spec = json.loads(data.tokenizer.backend_tokenizer.to_str())
    spec["model"]["a_field_of_another_release"] = False

    class AsAnotherReleaseWritesIt:
        is_fast = True

        def __init__(self, tokenizer):
            self.get_vocab = tokenizer.get_vocab
            self.backend_tokenizer = self

        def to_str(self) -> str:
            return json.dumps(spec)

    other = AsAnotherReleaseWritesIt(data.tokenizer)
    assert tokenizer_hash(other) != data.tokenizer_id
    assert vocabulary_hash(other) == data.vocabulary_id
    assert corpus_id(vocabulary_hash(other), data.split_sha256) == data.corpus_id


def test_corpus_id_names_every_split_and_the_vocabulary():
    splits = {"train": "a" * 64, "val": "b" * 64, "ood_prose": "c" * 64}
    base = corpus_id("tok", splits)
    assert base == corpus_id("tok", dict(reversed(list(splits.items()))))
    assert corpus_id("tok2", splits) != base
    for name in splits:
        assert corpus_id("tok", {**splits, name: "d" * 64}) != base
    assert corpus_id("tok", {**splits, "extra": "e" * 64}) != base


def test_corpus_part_round_trips_through_json():
    part = CorpusPart.common("code", {"m.py": [CODE, CODE.replace("X = 1", "X = 2")]})
    assert CorpusPart.from_json(json.loads(json.dumps(part.to_json()))) == part
    assert len(part.documents["m.py"]) == len(code_chunks(CODE)) - 1


def test_report_of_a_prefix_and_of_a_text_whose_hash_disagrees(libraries):
    manifest = libraries["manifest"]
    prefix = StdlibSource(root=libraries["full"], limit=3, manifest=manifest).report()
    assert prefix.pinned and prefix.limited and prefix.documents == 3
    assert prefix.line().startswith("stdlib: the first 3 documents (max_docs), all ")
    manifest.stdlib.sha256 = "0" * 64  # what a chunk-key collision would look like
    whole = StdlibSource(root=libraries["full"], manifest=manifest).report()
    assert not whole.pinned and not whole.missing and "sha256 differs" in whole.line()


def test_a_library_with_none_of_the_pinned_text_says_where_it_looked(libraries):
    files = {"os.py": b"other = 1\n", "pydoc_data/topics.py": stdlib_files()["pydoc_data/topics.py"]}
    root = write_tree(libraries["tmp"] / "foreign", files)
    with pytest.raises(ValueError, match=r"'train' has no text .*: 0 of the 15 documents the corpus manifest "
                                         r"pins were found under .*foreign; point data.stdlib_root at"):
        prepare_data(corpus_cfg(libraries["tmp"], root))


def _gather_corpus_ids(rank: int, world_size: int) -> str:
    from trainer.build import check_same_corpus
    from parallel.mesh import Mesh

    mesh = Mesh(rank=rank, world_size=world_size)
    check_same_corpus("aaaaaaaaaaaa", mesh)  # every rank agrees: no error
    try:
        check_same_corpus("aaaaaaaaaaaa" if rank < 2 else "bbbbbbbbbbbb", mesh)
    except DataConfigError as err:
        return str(err)
    return "no error"


def test_ranks_that_built_different_corpora_all_stop_naming_them():
    from tests.distributed import run_distributed

    messages = run_distributed(_gather_corpus_ids, 3)
    assert len(set(messages)) == 1, messages
    assert messages[0].startswith("the ranks built different corpora (corpus aaaaaaaaaaaa on ranks 0, 1; "
                                  "corpus bbbbbbbbbbbb on ranks 2)")


def test_a_document_is_cut_again_only_when_its_text_changed():
    """select keeps its cuts per text (a second Trainer in a process skips them): the same text
    gives the kept selection, a changed one is cut afresh, with what it now lacks counted."""
    text = "def a():\n    return 1\n\n\ndef b():\n    return 2\n"
    keys = [chunk_key(c) for c in code_chunks(text)]
    first = select("doc.py", text, keys, code_chunks)
    assert select("doc.py", "".join(text), list(keys), code_chunks) is first
    changed = select("doc.py", text.replace("return 2", "return 3"), keys, code_chunks)
    assert changed is not first and changed.missing == 1 and "return 3" not in changed.text
    assert (first.text, first.missing) == (text, 0)
