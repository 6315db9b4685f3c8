"""Data package: sources and splits, the BPE, token caches, batch loaders, the pipeline."""
from __future__ import annotations

import json
import re
import logging
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from data.cache import cache_key, encode_documents, token_dtype
from data.config import DataConfig, EvalSourceConfig
from data.hashing import hash_fraction, hash_hex
from data.loader import TrainBatches, eval_batches
from data.manifest import Manifest
from data.token_streams import prepare_data
from data.source_checks import check_data_config
from data.sources import (
    DataConfigError,
    HashSplit,
    HFSource,
    PydocTopicsSource,
    StdlibSource,
    is_held_out,
    train_val_sources,
)
from data.tokenizer import (
    EOS_TOKEN,
    load_pretrained,
    load_trained,
    tokenizer_hash,
    train_bpe,
    trained_tokenizer_path,
    training_sample,
)
from tests.closeness import approx

ROUND_TRIP_TEXTS = [
    "def f(x):\n    return {'a': [1, 2.5e-3, None]}  # comment\n",
    "class A(B, metaclass=M):\n\tpass\r\n\r\n",
    "héllo wörld — naïve café; Ελληνικά; русский; 中文字符; 日本語のテキスト; 한국어",
    "emoji 🐍🚀👩‍👩‍👧 flags 🇫🇷 combining é (e + U+0301), RTL שלום مرحبا",
    "   leading and trailing spaces   ",
    "\n\n\n\t\t  \u00a0nbsp\u200bzero-width\u3000ideographic space\n",
    "control \x00\x01\x7f chars and a lone \\ backslash",
    f"a literal {EOS_TOKEN} inside text",
    "",
]


def small_stdlib_texts(n_files: int = 40) -> list[str]:
    return [text for _, text in StdlibSource(limit=n_files).documents()]


@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory):
    """A 512-token BPE trained on a slice of the stdlib, loaded as the pipeline loads it."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(train_bpe(small_stdlib_texts(), 512).to_str())
    return load_trained(path)


def small_stdlib_config(cache_dir: Path, **overrides) -> DataConfig:
    settings = {"cache_dir": str(cache_dir), "max_docs": 60, "val_fraction": 0.2, "vocab_size": 512}
    return DataConfig(**{**settings, **overrides})


def cache_actions(caplog) -> dict[str, str]:
    """What the pipeline logged per artefact: {"train": "built", "val": "reused", ...}."""
    messages = [m for m in caplog.messages if not m.startswith("corpus manifest:")]
    return {name.rstrip(":"): action for name, action, *_ in (m.split(" ") for m in messages)}


def documents_in(tokens: np.ndarray, tokenizer) -> list[str]:
    """Decode a token array back into its documents (each is followed by EOS)."""
    ids = np.asarray(tokens, dtype=np.int64)
    ends = np.flatnonzero(ids == tokenizer.eos_token_id)
    assert len(ends) and ends[-1] == len(ids) - 1, "the array must end with EOS"
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokenizer.decode(ids[s:e].tolist()) for s, e in zip(starts, ends)]


# ---- tokenizer ----


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_bpe_round_trips_any_text(small_tokenizer, text):
    ids = small_tokenizer.encode(text)
    assert small_tokenizer.decode(ids) == text


def test_bpe_vocab_and_eos(small_tokenizer):
    assert len(small_tokenizer) == 512
    assert small_tokenizer.eos_token == EOS_TOKEN
    assert small_tokenizer.convert_ids_to_tokens(small_tokenizer.eos_token_id) == EOS_TOKEN
    # Merges learned from code: indentation and keywords compress below one token per byte.
    text = "    def __init__(self):\n        return None\n"
    assert len(small_tokenizer.encode(text)) < len(text.encode()) / 2


def test_literal_eos_in_a_document_is_text_not_a_separator(small_tokenizer):
    docs = [("a", f"x {EOS_TOKEN} y"), ("b", "z")]
    ids = [i for batch in encode_documents(docs, small_tokenizer) for i in batch]
    eos = small_tokenizer.eos_token_id
    assert ids.count(eos) == 2 and ids[-1] == eos
    first_end = ids.index(eos)
    assert small_tokenizer.decode(ids[:first_end]) == f"x {EOS_TOKEN} y"
    assert small_tokenizer.decode(ids[first_end + 1 : -1]) == "z"


def test_training_sample_is_hash_ordered_and_within_budget():
    docs = [(f"doc{i}", f"text number {i} " * (i % 7 + 1)) for i in range(200)]
    assert sum(len(t.encode()) for _, t in docs) > 1000
    sample = training_sample(docs, 1000)
    assert sum(len(t.encode()) for t in sample) == 1000
    shuffled = docs[:]
    random.Random(0).shuffle(shuffled)
    assert training_sample(shuffled, 1000) == sample
    by_hash = sorted(docs, key=lambda d: hash_hex(d[0]))
    assert sample[:-1] == [t for _, t in by_hash[: len(sample) - 1]]
    assert by_hash[len(sample) - 1][1].startswith(sample[-1])  # the last one is cut to fit
    assert sorted(training_sample(docs, 10**9)) == sorted(t for _, t in docs)


# ---- sources ----


def test_split_hash_is_stable_and_not_python_hash():
    # Golden value: blake2b of the relative path, the same on every machine and process.
    assert hash_fraction("json/__init__.py") == approx(0.1870375286333544, abs=1e-15)
    assert is_held_out("json/__init__.py", 0.2) and not is_held_out("json/__init__.py", 0.18)


def test_stdlib_train_val_split():
    base = StdlibSource()
    all_ids = [doc_id for doc_id, _ in base.documents()]
    assert all_ids == list(Manifest.load().stdlib.documents)
    assert len(all_ids) > 400 and all(i.endswith(".py") and "\\" not in i for i in all_ids)

    def split(fraction: float) -> tuple[list[str], list[str]]:
        train, val = (HashSplit(base, part, fraction) for part in ("train", "val"))
        return [d for d, _ in train.documents()], [d for d, _ in val.documents()]

    train, val = split(0.05)
    assert not set(train) & set(val)
    assert sorted(train + val) == sorted(all_ids)
    assert 0.02 < len(val) / len(all_ids) < 0.09
    assert split(0.05) == (train, val)
    # A module's side is a fixed property of its path: a larger fraction only adds modules.
    assert set(val) < set(split(0.1)[1])


# ---- loader ----


@pytest.fixture
def ramp() -> np.ndarray:
    return np.arange(20_000, dtype=np.uint16)


def test_train_batches_are_reproducible_per_step(ramp):
    batches = TrainBatches(ramp, seq_len=16, global_batch=8, seed=3)
    rows = batches.global_batch(5)
    assert rows.dtype == torch.int64 and rows.shape == (8, 17)
    assert torch.equal(rows, TrainBatches(ramp, 16, 8, seed=3).global_batch(5))
    assert not torch.equal(rows, batches.global_batch(6))
    assert not torch.equal(rows, TrainBatches(ramp, 16, 8, seed=4).global_batch(5))
    # Windows are consecutive tokens (the ramp makes each row count up by one).
    assert torch.equal(rows[:, 1:] - rows[:, :-1], torch.ones(8, 16, dtype=torch.int64))


def test_micro_batch_targets_are_inputs_shifted(ramp):
    x, y = TrainBatches(ramp, 16, 8, seed=0).micro_batch(0, 0, 0, 1, 1)
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert torch.equal(y, x + 1)


def test_batch_split_over_ranks_and_micro_steps_covers_the_same_sequences(ramp):
    per_rank, step = 4, 11
    batches = TrainBatches(ramp, 16, 2 * per_rank, seed=7)

    def rows(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[int, ...]]:
        return sorted(tuple(r) for x, _ in parts for r in x.tolist())

    dp2 = rows([batches.micro_batch(step, 0, rank, 2, 1) for rank in range(2)])
    dp1_double = rows([batches.micro_batch(step, 0, 0, 1, 1)])
    dp1_accum2 = rows([batches.micro_batch(step, micro, 0, 1, 2) for micro in range(2)])
    assert dp2 == dp1_double == dp1_accum2
    assert dp2 == sorted(tuple(r) for r in batches.global_batch(step)[:, :-1].tolist())
    # Distinct blocks: the two ranks do not get the same rows.
    rank0, rank1 = (batches.micro_batch(step, 0, rank, 2, 1)[0] for rank in range(2))
    assert not torch.equal(rank0, rank1)


def test_train_batches_offsets_span_the_whole_range():
    tokens = np.arange(18, dtype=np.uint16)  # seq_len + 2: exactly two possible offsets
    batches = TrainBatches(tokens, seq_len=16, global_batch=64, seed=0)
    assert set(batches.global_batch(0)[:, 0].tolist()) == {0, 1}
    with pytest.raises(ValueError, match="seq_len"):
        TrainBatches(tokens[:17], seq_len=16, global_batch=1, seed=0)
    with pytest.raises(ValueError, match="divisible"):
        batches.micro_batch(0, 0, 0, 5, 1)


def test_eval_batches_are_fixed_and_evenly_spread(ramp):
    first = eval_batches(ramp, seq_len=16, batch_size=4, n_batches=3)
    second = eval_batches(ramp, seq_len=16, batch_size=4, n_batches=3)
    assert len(first) == 3
    for (x1, y1), (x2, y2) in zip(first, second):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
        assert x1.shape == (4, 16) and torch.equal(y1, x1 + 1)
    starts = torch.cat([x[:, 0] for x, _ in first]).tolist()
    assert starts[0] == 0 and starts[-1] + 17 == len(ramp)  # first to last token
    gaps = np.diff(starts)
    assert gaps.min() >= 17 and gaps.max() - gaps.min() <= 1  # disjoint, even spacing


def test_eval_batches_on_a_small_set_overlap_and_too_small_fails():
    tokens = np.arange(40, dtype=np.uint16)
    batches = eval_batches(tokens, seq_len=16, batch_size=4, n_batches=2)
    starts = torch.cat([x[:, 0] for x, _ in batches]).tolist()
    assert len(starts) == 8 and starts[0] == 0 and starts[-1] == 40 - 17
    assert starts == torch.cat([x[:, 0] for x, _ in eval_batches(tokens, 16, 4, 2)]).tolist()
    with pytest.raises(ValueError, match="fewer than seq_len"):
        eval_batches(tokens[:16], seq_len=16, batch_size=1, n_batches=1)


# ---- token cache and pipeline (stdlib) ----


def test_token_dtype_widens_past_65536():
    assert token_dtype(512) == np.uint16
    assert token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32
    assert token_dtype(151_000) == np.uint32


def test_prepare_stdlib_tokens_hold_the_split_documents(tmp_path):
    cfg = small_stdlib_config(tmp_path / "cache")
    data = prepare_data(cfg, seq_len=64)
    assert list(data.eval_sets) == ["val", "ood_prose"]
    assert data.vocab_size == len(data.tokenizer) == 512
    assert data.eos_id == data.tokenizer.eos_token_id
    assert isinstance(data.train, np.memmap) and data.train.dtype == np.uint16 and data.train.mode == "r"
    train_source, val_source = train_val_sources(cfg)
    assert documents_in(data.train, data.tokenizer) == [t for _, t in train_source.documents() if t]
    assert documents_in(data.eval_sets["val"], data.tokenizer) == [t for _, t in val_source.documents() if t]
    pinned_prose = [t for _, t in PydocTopicsSource().documents()]
    assert len(pinned_prose) > 50
    assert documents_in(data.eval_sets["ood_prose"], data.tokenizer) == pinned_prose
    too_long = len(data.eval_sets["val"])
    with pytest.raises(DataConfigError, match=f"'val' has {too_long} tokens; trainer.seq_len={too_long} needs "
                       f"{too_long + 1}: .*data.val_fraction \\(now {cfg.val_fraction}; train has {len(data.train)} tokens"):
        prepare_data(cfg, seq_len=too_long)


def cache_files(cache_dir: Path) -> dict[str, int]:
    """Every file under cache_dir with its modification time."""
    return {p.relative_to(cache_dir).as_posix(): p.stat().st_mtime_ns for p in cache_dir.rglob("*") if p.is_file()}


def test_cache_is_reused_written_atomically_and_repaired(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="data")
    cache_dir = tmp_path / "cache"
    cfg = small_stdlib_config(cache_dir)
    first = prepare_data(cfg)
    built = cache_files(cache_dir)
    assert not [name for name in built if name.endswith(".tmp")]
    assert sorted(Path(name).suffix for name in built) == [".bin"] * 3 + [".json"] * 4

    caplog.clear()
    second = prepare_data(cfg)
    assert cache_files(cache_dir) == built
    assert set(cache_actions(caplog).values()) == {"reused"} and len(cache_actions(caplog)) == 4
    assert np.array_equal(first.train, second.train)

    train_bin = Path(second.train.filename)
    expected = np.array(second.train)
    with open(train_bin, "r+b") as f:
        f.truncate(train_bin.stat().st_size - 2)
    val_meta = Path(second.eval_sets["val"].filename).with_suffix(".json")
    val_meta.write_text("{not json")
    caplog.clear()
    repaired = prepare_data(cfg)
    assert cache_actions(caplog) == {
        "tokenizer": "reused", "train": "built", "val": "built", "ood_prose": "reused"
    }
    assert np.array_equal(repaired.train, expected)
    assert json.loads(val_meta.read_text())["n_tokens"] == len(first.eval_sets["val"])
    assert not [p for p in cache_dir.rglob("*.tmp")]


def test_a_first_run_says_what_it_builds_before_building_it(tmp_path, caplog, monkeypatch):
    """The first run trains a tokenizer and tokenizes the corpus (minutes on the full corpus):
    each step is announced before it starts, with where its result is cached, reports its
    progress, and says how long it took."""
    import data.cache

    monkeypatch.setattr(data.cache, "PROGRESS_EVERY_S", 0.0)  # report after every batch
    caplog.set_level("INFO", logger="data")
    cfg = small_stdlib_config(tmp_path / "cache")
    prepare_data(cfg)
    lines = caplog.messages
    first = {key: next(i for i, m in enumerate(lines) if m.startswith(key)) for key in (
        "tokenizer: training a byte-level BPE (vocab 512)", "tokenizer: trained",
        "train: tokenizing, once; the tokens are cached in", "train: built", "val: tokenizing", "val: built")}
    assert first["tokenizer: training a byte-level BPE (vocab 512)"] < first["tokenizer: trained"]
    assert first["train: tokenizing, once; the tokens are cached in"] < first["train: built"]
    assert first["val: tokenizing"] < first["val: built"]
    assert str(tmp_path / "cache") in lines[first["tokenizer: training a byte-level BPE (vocab 512)"]]
    progress = [m for m in lines if m.startswith("train: ") and "tokens so far" in m]
    assert progress and all(re.fullmatch(r"train: \d+ tokens so far \(\d+s\)", m) for m in progress)
    assert re.search(r"in \d+\.\ds", lines[first["train: built"]])


def test_a_different_tokenizer_gets_a_different_cache(tmp_path, small_tokenizer):
    cfg = small_stdlib_config(tmp_path / "cache")
    a = prepare_data(cfg)
    b = prepare_data(small_stdlib_config(tmp_path / "cache", vocab_size=600))
    assert len(b.tokenizer) == 600
    assert Path(a.train.filename) != Path(b.train.filename)
    assert tokenizer_hash(a.tokenizer) != tokenizer_hash(b.tokenizer)
    fingerprint = {"kind": "test"}
    assert cache_key(fingerprint, tokenizer_hash(a.tokenizer)) != cache_key(
        fingerprint, tokenizer_hash(small_tokenizer)
    )
    # The hash describes the tokenizer, not its state: a fresh load that has encoded
    # nothing yet hashes like the one the pipeline used.
    path = trained_tokenizer_path(tmp_path / "cache", train_val_sources(cfg)[0], 512, cfg.tokenizer_train_bytes)
    assert tokenizer_hash(load_trained(path)) == tokenizer_hash(a.tokenizer)


# ---- data=hf on local files ----


def write_corpus(path: Path) -> list[str]:
    words = ["alpha", "beta", "gamma", "delta", "über", "naïve", "函数", "tree", "river", "stone"]
    lines = [f"line {i}: the {words[i % 10]} and {words[i * 7 % 10]} count {i * 13 % 97}." for i in range(400)]
    lines += lines[:20]  # duplicates must land on the same side as their originals
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return lines


def hf_config(tmp_path: Path, corpus: Path, **overrides) -> DataConfig:
    settings = {
        "name": "hf", "path": "text", "data_files": [str(corpus)], "vocab_size": 512, "val_fraction": 0.1,
        "cache_dir": str(tmp_path / "cache"), "eval_sets": {},
    }
    return DataConfig(**{**settings, **overrides})


@pytest.mark.parametrize("as_dict", [False, True])
def test_hf_a_save_to_disk_directory_loads_with_load_from_disk(tmp_path, hf_cache, as_dict):
    """Before: a 38-line traceback ending in "use load_from_disk", and no option for it."""
    import datasets

    texts = [f"saved document {i}: words and more words" for i in range(40)]
    saved = datasets.Dataset.from_dict({"text": texts})
    if as_dict:
        saved = datasets.DatasetDict({"train": saved, "validation": saved.select(range(3))})
    saved.save_to_disk(str(tmp_path / "saved"))
    source = HFSource("data", str(tmp_path / "saved"), split="train")
    assert [t for _, t in source.documents()] == texts
    if as_dict:
        with pytest.raises(DataConfigError, match=r"^data.split: no split 'test' in .*saved \(splits: train, validation\)"):
            list(HFSource("data", str(tmp_path / "saved"), split="test").documents())
    data = prepare_data(hf_config(tmp_path, tmp_path / "saved", path=str(tmp_path / "saved"), data_files=None,
                                  val_fraction=0.2), seq_len=8)
    assert len(data.train) > 0 and len(data.eval_sets["val"]) > 0


def test_a_pretrained_tokenizer_that_cannot_be_loaded_is_one_line_naming_the_key():
    """Before: offline, a 114-line traceback from the HTTP client down."""
    with pytest.raises(DataConfigError) as err:
        load_pretrained(str(Path("/nonexistent") / "tokenizer-dir"))
    message = str(err.value)
    assert message.startswith("data.tokenizer: cannot load '/nonexistent/tokenizer-dir'") and "\n" not in message
    assert "save_pretrained" in message and "HF_HUB_OFFLINE=1" in message


def closed_port() -> int:
    """A local port nothing listens on: connecting to it is refused at once."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def hub_down(tmp_path, monkeypatch):
    """HF_ENDPOINT (as huggingface_hub read it) at a closed local port, no offline switch set,
    and an empty hub cache of the test's own; returns the endpoint."""
    from huggingface_hub import constants

    endpoint = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    return endpoint


def fill_hub_cache(cache: Path, repo_id: str, tokenizer) -> None:
    """The hub cache as a download of a tokenizer-only `repo_id` leaves it: refs/main names a
    snapshot, and .no_exist records that the repo has no config.json."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    tokenizer.save_pretrained(repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / ".no_exist" / commit).mkdir(parents=True)
    (repo / ".no_exist" / commit / "config.json").touch()


def test_an_unreachable_hub_is_one_line_within_5_s_and_no_retries(hub_down, capfd):
    """Before: about 50 s and twenty retry warnings, each printed twice, then the error."""
    start = time.perf_counter()
    with pytest.raises(DataConfigError) as err:
        load_pretrained("org/tiny-tok")
    assert time.perf_counter() - start < 5
    message = str(err.value)
    port = hub_down.rsplit(":", 1)[1]
    assert message.startswith(f"data.tokenizer: cannot load 'org/tiny-tok' (the Hugging Face hub at {hub_down} is "
                              f"unreachable: connection to 127.0.0.1:{port} refused; it is not in the cache ")
    assert "\n" not in message and "save_pretrained" in message and "HF_HUB_OFFLINE=1" in message
    out, errors = capfd.readouterr()
    assert "Retry" not in out + errors and "Retrying" not in out + errors


def test_a_hub_that_does_not_answer_is_given_up_on_at_the_timeout(monkeypatch):
    """A resolver or a route that hangs (no refusal, no answer) costs the timeout, no more."""
    import data.hub

    def hang(address, timeout=None):
        time.sleep(3)  # longer than the probe waits
        raise OSError("unreachable")

    monkeypatch.setattr(data.hub.socket, "create_connection", hang)
    start = time.perf_counter()
    status = data.hub.probe_hub("http://hub.invalid:8080", timeout_s=0.3)
    assert time.perf_counter() - start < 1.0
    assert status.describe() == ("the Hugging Face hub at http://hub.invalid:8080 is unreachable: no answer from "
                                 "hub.invalid:8080 within 0.3 s")


def test_a_listening_hub_is_reachable():
    import socket

    from data.hub import probe_hub

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert probe_hub(f"http://127.0.0.1:{server.getsockname()[1]}").reachable


def test_a_cached_hub_tokenizer_loads_when_the_hub_is_unreachable(hub_down, tmp_path, small_tokenizer, caplog):
    fill_hub_cache(tmp_path / "hub", "org/tiny-tok", small_tokenizer)
    caplog.set_level(logging.WARNING, logger="data")
    start = time.perf_counter()
    tokenizer = load_pretrained("org/tiny-tok")
    assert time.perf_counter() - start < 5
    assert tokenizer.get_vocab() == small_tokenizer.get_vocab() and tokenizer.eos_token == EOS_TOKEN
    assert caplog.messages == [f"data.tokenizer: the Hugging Face hub at {hub_down} is unreachable: connection to "
                               f"127.0.0.1:{hub_down.rsplit(':', 1)[1]} refused: loaded 'org/tiny-tok' from the "
                               "local cache"]


def test_offline_mode_reads_the_cache_without_probing(hub_down, tmp_path, small_tokenizer, monkeypatch):
    import data.tokenizer

    def no_probe(*args, **kwargs):
        raise AssertionError("HF_HUB_OFFLINE is set: the hub is not to be asked")

    monkeypatch.setattr(data.tokenizer, "probe_hub", no_probe)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataConfigError, match=r"^data.tokenizer: cannot load 'org/tiny-tok' \(HF_HUB_OFFLINE is "
                                              r"set; it is not in the cache "):
        load_pretrained("org/tiny-tok")
    fill_hub_cache(tmp_path / "hub", "org/tiny-tok", small_tokenizer)
    assert load_pretrained("org/tiny-tok").get_vocab() == small_tokenizer.get_vocab()


def test_a_local_tokenizer_dir_loads_without_asking_the_hub(hub_down, tmp_path, small_tokenizer, monkeypatch):
    import data.tokenizer

    monkeypatch.setattr(data.tokenizer, "probe_hub", lambda *a, **k: pytest.fail("a local dir needs no hub"))
    small_tokenizer.save_pretrained(tmp_path / "saved")
    assert load_pretrained(str(tmp_path / "saved")).get_vocab() == small_tokenizer.get_vocab()


@pytest.mark.parametrize("streaming", [False, True])
def test_a_hub_dataset_with_the_hub_unreachable_is_one_line_naming_the_key(hub_down, hf_cache, streaming):
    start = time.perf_counter()
    with pytest.raises(DataConfigError) as err:
        HFSource("data.eval_sets.web", "org/some-dataset", streaming=streaming).dataset
    assert time.perf_counter() - start < 5
    message = str(err.value)
    unreachable = f"the Hugging Face hub at {hub_down} is unreachable: connection to 127.0.0.1:{hub_down.rsplit(':', 1)[1]}"
    if streaming:
        assert message.startswith(f"data.eval_sets.web.path: cannot stream 'org/some-dataset': {unreachable}")
        assert "data.eval_sets.web.streaming=false" in message
    else:
        assert message.startswith(f"data.eval_sets.web.path: cannot load 'org/some-dataset' ({unreachable}")
        assert "not in the cache" in message and "HF_HUB_OFFLINE=1" in message
    assert "\n" not in message


def test_only_hub_names_ask_the_hub(tmp_path):
    from data.sources import needs_hub

    (tmp_path / "corpus.txt").write_text("x")
    assert needs_hub("HuggingFaceFW/fineweb-edu", None) and needs_hub("wikitext", None)
    assert not needs_hub("text", [str(tmp_path / "corpus.txt")]) and not needs_hub(str(tmp_path / "corpus.txt"), None)
    assert needs_hub("parquet", ["hf://datasets/org/x/data/*.parquet"])
    assert not needs_hub("./missing-dir", None)


def test_hf_local_text_files_with_an_hf_eval_set(tmp_path, hf_cache):
    corpus = tmp_path / "corpus.txt"
    lines = write_corpus(corpus)
    bodies = [f"Wiki paragraph {i}: prose about rivers and stones, ünïcödé." for i in range(30)]
    wiki = tmp_path / "wiki.jsonl"
    wiki.write_text("".join(json.dumps({"id": i, "body": b}) + "\n" for i, b in enumerate(bodies)))
    cfg = hf_config(tmp_path, corpus, eval_sets={
        "wiki-1": EvalSourceConfig(kind="hf", path="json", data_files=[str(wiki)], text_field="body"),
    })
    data = prepare_data(cfg, seq_len=32)
    assert list(data.eval_sets) == ["val", "wiki-1"]
    val_lines = [line for line in lines if is_held_out(line, 0.1)]
    train_lines = [line for line in lines if not is_held_out(line, 0.1)]
    assert 0 < len(val_lines) < len(lines) / 4
    assert documents_in(data.train, data.tokenizer) == train_lines
    assert documents_in(data.eval_sets["val"], data.tokenizer) == val_lines
    assert documents_in(data.eval_sets["wiki-1"], data.tokenizer) == bodies


def test_hf_max_docs_limits_records(tmp_path, hf_cache):
    corpus = tmp_path / "corpus.txt"
    lines = write_corpus(corpus)
    data = prepare_data(hf_config(tmp_path, corpus, max_docs=100))
    docs = documents_in(data.train, data.tokenizer) + documents_in(data.eval_sets["val"], data.tokenizer)
    assert sorted(docs) == sorted(lines[:100])


def test_hf_missing_data_file_fails_fast_naming_it(tmp_path):
    missing = tmp_path / "no" / "such.txt"
    cfg = hf_config(tmp_path, missing)
    with pytest.raises(DataConfigError, match="data.data_files: no such file: .*no/such.txt"):
        check_data_config(cfg)
    with pytest.raises(DataConfigError, match="such.txt"):
        prepare_data(cfg)
    assert not (tmp_path / "cache").exists()


def test_hf_missing_text_field_names_it_and_the_fields(tmp_path, hf_cache):
    corpus = tmp_path / "corpus.txt"
    write_corpus(corpus)
    with pytest.raises(DataConfigError, match=r"data.text_field: no field 'content'.*fields: text"):
        prepare_data(hf_config(tmp_path, corpus, text_field="content"))


def test_relative_and_glob_data_files_resolve_from_the_working_directory(tmp_path, monkeypatch):
    write_corpus(tmp_path / "part1.txt")
    monkeypatch.chdir(tmp_path)
    check_data_config(hf_config(tmp_path, Path("part1.txt")))
    check_data_config(DataConfig(name="hf", path="text", data_files=["part*.txt"]))
    with pytest.raises(DataConfigError, match="part9.txt"):
        check_data_config(DataConfig(name="hf", path="text", data_files=["part9.txt"]))


def test_pretrained_tokenizer_from_a_local_dir(tmp_path, small_tokenizer, hf_cache):
    small_tokenizer.save_pretrained(tmp_path / "pretrained")
    corpus = tmp_path / "corpus.txt"
    lines = write_corpus(corpus)
    # vocab_size is ignored (and not checked) with a pretrained tokenizer.
    data = prepare_data(hf_config(tmp_path, corpus, tokenizer=str(tmp_path / "pretrained"), vocab_size=0))
    assert data.vocab_size == 512 and data.eos_id == small_tokenizer.eos_token_id
    first = next(line for line in lines if not is_held_out(line, 0.1))
    expected = small_tokenizer.encode(first) + [data.eos_id]
    assert data.train[: len(expected)].tolist() == expected


def test_pretrained_tokenizer_without_eos_is_rejected(tmp_path, small_tokenizer):
    path = tmp_path / "tokenizer.json"
    small_tokenizer.backend_tokenizer.save(str(path))
    PreTrainedTokenizerFast(tokenizer_file=str(path)).save_pretrained(tmp_path / "no_eos")
    with pytest.raises(ValueError, match="data.tokenizer: .*no EOS token"):
        load_pretrained(str(tmp_path / "no_eos"))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"name": "foo"}, "data.name: unknown source 'foo' (expected stdlib or hf)"),
        ({"vocab_size": 100}, "data.vocab_size must be >= 512"),
        ({"val_fraction": 0.0}, "data.val_fraction"),
        ({"max_docs": 0}, "data.max_docs"),
        ({"name": "hf"}, "data.path: required"),
        ({"name": "hf", "path": "/nonexistent/dir"}, "data.path: no such file or directory: /nonexistent/dir"),
        # relative, no "./": a data file suffix still marks it as local, not a hub id
        ({"name": "hf", "path": "corpus/missing.txt"}, "data.path: no such file or directory: corpus/missing.txt"),
        ({"tokenizer": "./no_such_tokenizer"}, "data.tokenizer: no such file or directory"),
        ({"eval_sets": {"val": EvalSourceConfig()}}, "data.eval_sets.val:"),
        ({"eval_sets": {"a/b": EvalSourceConfig()}}, "data.eval_sets.a/b:"),
        ({"eval_sets": {"w": EvalSourceConfig(kind="wiki")}}, "data.eval_sets.w.kind: unknown kind 'wiki'"),
        ({"eval_sets": {"w": EvalSourceConfig(kind="hf", path="text", data_files=["/nope/w.txt"])}},
         "data.eval_sets.w.data_files: no such file: /nope/w.txt"),
    ],
)
def test_check_data_config_names_the_key(overrides, message):
    with pytest.raises(DataConfigError) as err:
        check_data_config(DataConfig(**overrides))
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_default_config_passes_checks():
    check_data_config(DataConfig())
    # A hub dataset id is not checked against the local file system.
    check_data_config(DataConfig(name="hf", path="HuggingFaceFW/fineweb-edu", data_files=["s/*.parquet"]))


# ---- the full default corpus ----


def test_full_stdlib_corpus(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="data")
    cfg = DataConfig(cache_dir=str(tmp_path / "cache"))
    start = time.perf_counter()
    data = prepare_data(cfg, seq_len=256)
    cold = time.perf_counter() - start
    assert data.vocab_size == 8192 and data.train.dtype == np.uint16
    # The pinned corpus (lab/results.md and the experiment configs rely on its size).
    assert len(data.train) > 1_100_000
    assert len(data.eval_sets["val"]) > 30_000
    assert len(data.eval_sets["ood_prose"]) > 60_000
    # Code compresses: well under one token per 3 bytes of the pinned source.
    assert len(data.train) < Manifest.load().stdlib.size_bytes / 3
    assert [r.pinned for r in data.reports] == [True, True]

    assert cache_actions(caplog) == {
        "tokenizer": "trained", "train": "built", "val": "built", "ood_prose": "built"
    }
    caplog.clear()
    start = time.perf_counter()
    warm = prepare_data(cfg, seq_len=256)
    warm_seconds = time.perf_counter() - start
    assert np.array_equal(warm.eval_sets["val"], data.eval_sets["val"])
    assert set(cache_actions(caplog).values()) == {"reused"}
    print(f"full stdlib: cold {cold:.1f}s, warm {warm_seconds:.2f}s")
    assert warm_seconds < 5, f"warm start took {warm_seconds:.1f}s (cold {cold:.1f}s)"
