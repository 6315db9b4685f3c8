"""Data configuration: the schema behind conf/data/*.yaml."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional


@dataclass
class EvalSourceConfig:
    """One named evaluation set besides the in-domain "val" split.

    kind="pydoc_topics": English prose bundled with the interpreter (no network), from
    data.stdlib_root's pydoc_data/topics.py, as the corpus manifest pins it.
    kind="hf": anything `datasets.load_dataset` reads (hub name or local files).
    """

    kind: str = "pydoc_topics"
    path: Optional[str] = None
    dataset_config: Optional[str] = None
    data_files: Optional[List[str]] = None
    split: str = "train"
    text_field: str = "text"
    max_docs: Optional[int] = None


@dataclass
class DataConfig:
    # "stdlib": the running interpreter's standard library sources; "hf": load_dataset.
    name: str = "stdlib"
    # Size of the byte-level BPE trained on the training split (ignored when
    # `tokenizer` names a pretrained one).
    vocab_size: int = 8192
    # Fraction of documents (stdlib: modules) held out as the in-domain "val" set.
    val_fraction: float = 0.05
    # Fraction of documents held out as the tuning split "tune" (logged as val/tune/loss), for
    # picking hyperparameters without touching val: the hash band just above val's, so val keeps
    # its documents. 0 carves no tune split and leaves the corpus id as it was.
    tune_fraction: float = 0.0
    # Where tokenizers and token caches live; relative paths are taken from the
    # directory train.py is launched in, so every run and every rank shares them.
    cache_dir: str = ".cache/data"
    # The BPE is trained on at most this many bytes of training text (a deterministic
    # prefix of the shuffled-by-hash document order); encoding always covers everything.
    tokenizer_train_bytes: int = 64_000_000
    # data=stdlib: the standard library directory to read (the one holding os.py); null: the
    # running interpreter's. Only the text the corpus manifest pins is taken from it.
    stdlib_root: Optional[str] = None
    # Read at most this many documents (stdlib: modules in path order; hf: records in
    # dataset order) before the val split; null reads everything.
    max_docs: Optional[int] = None
    # data=hf source; see datasets.load_dataset.
    path: Optional[str] = None
    dataset_config: Optional[str] = None
    data_files: Optional[List[str]] = None
    split: str = "train"
    text_field: str = "text"
    streaming: bool = False
    # A pretrained tokenizer (AutoTokenizer name or local dir); null trains our own BPE.
    tokenizer: Optional[str] = None
    # OOD evaluation sets, by name; each is logged as val/<name>/loss.
    eval_sets: Dict[str, EvalSourceConfig] = field(
        default_factory=lambda: {"ood_prose": EvalSourceConfig(kind="pydoc_topics")}
    )
