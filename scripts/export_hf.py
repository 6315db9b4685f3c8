"""Export a training checkpoint as a Hugging Face transformers model directory.

    python scripts/export_hf.py outputs/muon_gpt_tiny/RUN exported/gpt_tiny
    python scripts/export_hf.py outputs/muon_gpt_tiny/RUN/checkpoints/step_00000200 OUT --dtype bf16

CHECKPOINT is a checkpoint (a step_<N> dir, or an older single-file step_<N>.pt), a run's
checkpoints/ dir or a run dir (then its newest checkpoint that is not suspect: after a
divergence stop, the one `last_good` names; see docs/checkpoints.md). Checkpoints
store logical tensors whatever the (DP, TP) layout of the run that saved them, so TP- and
ZeRO-sharded runs export the same way.

The result loads with no custom code:
    AutoModelForCausalLM.from_pretrained(OUT), AutoTokenizer.from_pretrained(OUT)
and its tokenizer starts every text with the EOS token, as training saw each document start.
Dense models become LlamaForCausalLM (Qwen3ForCausalLM with QK-norm), sigmoid-routed MoE
models Glm4MoeForCausalLM; see model/hf_export.py for why, and for what is refused.
"""
from __future__ import annotations

import argparse
import copy
import sys
import warnings
from dataclasses import fields
from pathlib import Path
from typing import Any, Optional

import torch

from data.quiet_imports import quiet_library_noise
from model.config import ModelConfig
from model.hf_export import ExportError, export, model_config
from scripts.refuse import BAD_INPUT
from trainer.checkpoint import files as checkpoint_files
from trainer.run.environment import RUN_TOKENIZER_DIR

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_checkpoint(path: Path, allow_suspect: bool = False) -> Path:
    """The checkpoint that `path` (a checkpoint, a checkpoints/ dir or a run dir) names, as
    train.py's checkpoint.resume reads it (trainer/checkpoint/files.py)."""
    return checkpoint_files.resolve_checkpoint(path, allow_suspect, "--allow-suspect")


def load_run(path: Path, allow_suspect: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """(model config, parameters and persistent buffers, the run's resolved config)."""
    checkpoint = resolve_checkpoint(path, allow_suspect)
    with warnings.catch_warnings():
        # torch.distributed.checkpoint warns that it loads in a single process when no process
        # group exists: here that is the intent (a script reads a whole checkpoint), and the
        # warning would only tell a user something looks wrong.
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized",
                                category=UserWarning)
        state = checkpoint_files.load(checkpoint)
    config = state["config"]
    return model_config(config["model"]), state["params"] | state["buffers"], config


def run_tokenizer(config: dict[str, Any], override: Optional[str] = None, source: Optional[Path] = None):
    """The tokenizer the run trained with: `override` (a tokenizer.json file, or a directory
    or name AutoTokenizer loads) if given; else the copy in the run dir of the checkpoint
    `source` names (runs save one at start-up, so export works from any directory); else,
    for runs from before that, the one the run's data config names (a pretrained tokenizer,
    or the BPE the trainer built in data.cache_dir)."""
    from data.config import DataConfig
    from data.token_streams import resolve_cache_dir
    from data.sources import train_val_sources
    from data.tokenizer import load_pretrained, load_trained, trained_tokenizer_path

    if override is not None:
        return load_trained(Path(override)) if override.endswith(".json") else load_pretrained(override)
    if source is not None:
        in_run_dir = resolve_checkpoint(source, allow_suspect=True).parent.parent / RUN_TOKENIZER_DIR
        if in_run_dir.is_dir():
            return load_pretrained(str(in_run_dir))
    known = {f.name for f in fields(DataConfig)}
    data = DataConfig(**{k: v for k, v in config["data"].items() if k in known})
    if data.tokenizer is not None:
        return load_pretrained(data.tokenizer)
    train, _ = train_val_sources(data)
    path = trained_tokenizer_path(resolve_cache_dir(data.cache_dir), train, data.vocab_size,
                                  data.tokenizer_train_bytes)
    if not path.exists():
        raise FileNotFoundError(
            f"{path}: the run's tokenizer is not there (data.cache_dir is relative to where "
            "train.py ran, and a run on an older embedded corpus had another tokenizer); run from "
            "that directory or pass --tokenizer"
        )
    return load_trained(path)


def document_start_tokenizer(tokenizer):
    """A copy of `tokenizer` whose own post-processor puts its EOS token before every text, so
    that `AutoTokenizer.from_pretrained(export)(prompt)` gives the model a prompt as training
    gave it a document: after the EOS that ends the one before (data/cache.py). The template
    is saved in tokenizer.json, which every loader of a fast tokenizer reads (transformers
    rebuilds its `add_bos_token` template only when that file has none), and it replaces a
    pretrained tokenizer's own BOS template: training encoded without it. The EOS token is also
    named BOS, the role it plays. None when the tokenizer has no `tokenizers` backend."""
    from tokenizers.processors import TemplateProcessing

    if not getattr(tokenizer, "is_fast", False):
        return None
    tokenizer = copy.deepcopy(tokenizer)  # the caller's keeps encoding as training did
    eos = tokenizer.eos_token
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{eos} $A", pair=f"{eos} $A {eos} $B", special_tokens=[(eos, tokenizer.eos_token_id)])
    tokenizer.bos_token = eos
    return tokenizer


def main(argv: Optional[list[str]] = None) -> int:
    # transformers' models import torchao, whose import prints lines that are not news here
    quiet_library_noise()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="checkpoint (step_<N> dir or older .pt file), checkpoints/ dir or run dir")
    parser.add_argument("out_dir", type=Path, help="directory to write the transformers model into")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                        help="weight dtype of the export (fp32 is exact; default fp32)")
    parser.add_argument("--tokenizer", help="tokenizer.json file, or tokenizer dir/name, to use "
                        "instead of the run's")
    parser.add_argument("--allow-suspect", action="store_true", help="export a checkpoint saved after a "
                        "non-finite step (listed in checkpoints/suspect.json) all the same")
    args = parser.parse_args(argv)
    try:
        cfg, tensors, config = load_run(args.checkpoint, args.allow_suspect)
        tokenizer = run_tokenizer(config, args.tokenizer, args.checkpoint)
        with_start = document_start_tokenizer(tokenizer)
        if with_start is None:
            print(f"warning: the tokenizer ({type(tokenizer).__name__}) has no tokenizers backend, so the "
                  "export's does not add the EOS token before a prompt: add it by hand", file=sys.stderr)
        arch = export(cfg, tensors, with_start or tokenizer, args.out_dir, DTYPES[args.dtype])
    except (checkpoint_files.CheckpointError, ExportError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return BAD_INPUT
    print(f"wrote {arch} ({cfg.name}, {args.dtype}) to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
