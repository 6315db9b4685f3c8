"""The model presets (conf/model/*.yaml) as ModelConfigs, read as plain YAML: planners, benchmarks
and the tests build a preset's model without composing a run's config (a GPU image with its own
torch may lack omegaconf)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import yaml

from model.config import ModelConfig

PRESETS = Path(__file__).resolve().parents[1] / "conf" / "model"
# The vocabulary each large preset is documented with (its conf/model/*.yaml), else GPT-2's padded one.
PRESET_VOCAB = {"gpt_1b": 128256, "gpt_8b": 128256, "moe_16b": 163840}
DEFAULT_VOCAB = 50304


def preset_names() -> list[str]:  # the model presets there are: conf/model/*.yaml
    return sorted(p.stem for p in PRESETS.glob("*.yaml"))


def preset_config(name: str, vocab_size: int = 0) -> ModelConfig:
    """conf/model/<name>.yaml as a ModelConfig, with `vocab_size` (0: PRESET_VOCAB's, else
    DEFAULT_VOCAB); FileNotFoundError naming the known presets for an unknown name (a path too)."""
    if name not in preset_names():
        raise FileNotFoundError(f"model={name}: no such preset (known: {', '.join(preset_names())})")
    text = (PRESETS / f"{name}.yaml").read_text()
    return replace(ModelConfig(**yaml.safe_load(text)), vocab_size=vocab_size or PRESET_VOCAB.get(name, DEFAULT_VOCAB))
