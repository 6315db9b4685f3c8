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
Dense models become LlamaForCausalLM (Qwen3ForCausalLM with QK-norm), sigmoid-routed MoE
models Glm4MoeForCausalLM; see model/hf_export.py for why, and for what is refused.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from model.config import ModelConfig  # noqa: E402
from model.hf_export import ExportError, export, model_config  # noqa: E402
from trainer import checkpoint_files  # noqa: E402
from trainer.run_env import RUN_TOKENIZER_DIR  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_checkpoint(path: Path, allow_suspect: bool = False) -> Path:
    """The checkpoint that `path` (a checkpoint, a checkpoints/ dir or a run dir) names: for a
    directory, its newest checkpoint that is not suspect (after a divergence stop, `last_good`;
    with `allow_suspect`, `latest`). A suspect checkpoint named outright is refused unless
    `allow_suspect`."""
    if path.is_dir() and not checkpoint_files.is_sharded(path):
        directory = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        found = checkpoint_files.checkpoints_in(directory)
        latest = directory / "latest"
        if allow_suspect and latest.exists() and (directory / latest.read_text().strip()) in found:
            return directory / latest.read_text().strip()
        trusted = found[0] if allow_suspect and found else checkpoint_files.newest_trusted(directory)
        if trusted is None:
            raise checkpoint_files.CheckpointError(
                f"{path}: no checkpoint found in this directory" if not found else
                f"{directory}: no checkpoint is known good (all are listed in {checkpoint_files.SUSPECT_FILE}); "
                "pass --allow-suspect to use the newest anyway")
        return trusted
    if not allow_suspect:
        checkpoint_files.refuse_suspect(path, "--allow-suspect")
    return path  # checkpoint_files.load names a missing one itself


def load_run(path: Path, allow_suspect: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """(model config, parameters and persistent buffers, the run's resolved config)."""
    state = checkpoint_files.load(resolve_checkpoint(path, allow_suspect))
    config = state["config"]
    return model_config(config["model"]), state["params"] | state["buffers"], config


def run_tokenizer(config: dict[str, Any], override: Optional[str] = None, source: Optional[Path] = None):
    """The tokenizer the run trained with: `override` (a tokenizer.json file, or a directory
    or name AutoTokenizer loads) if given; else the copy in the run dir of the checkpoint
    `source` names (runs save one at start-up, so export works from any directory); else,
    for runs from before that, the one the run's data config names (a pretrained tokenizer,
    or the BPE the trainer built in data.cache_dir)."""
    from data.config import DataConfig
    from data.pipeline import resolve_cache_dir
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


def main(argv: Optional[list[str]] = None) -> int:
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
        arch = export(cfg, tensors, tokenizer, args.out_dir, DTYPES[args.dtype])
    except (checkpoint_files.CheckpointError, ExportError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {arch} ({cfg.name}, {args.dtype}) to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
