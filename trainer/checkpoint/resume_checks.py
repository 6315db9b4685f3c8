"""What a resumed run changes against the checkpoint it resumes: said in one warning each, since
each makes the run after the resume a different experiment from its first part."""
from __future__ import annotations

from typing import Any

from trainer.config import TrainConfig

# The keys that shape the learning-rate schedule from the step on: changing one on a resume
# changes every later step's lr (a longer max_steps stretches the decay, for instance).
SCHEDULE_KEYS = ("trainer.max_steps", "optim.schedule", "optim.lr", "optim.min_lr", "optim.min_lr_ratio",
                 "optim.warmup_steps", "optim.warmup_fraction", "optim.wsd_decay_fraction", "optim.lr_overrides")
# Keys a checkpoint may predate, with the value such a run had: it trained as if they were null.
ADDED_LATER = {"optim.min_lr_ratio": None, "optim.warmup_fraction": None}
_MISSING = object()


def _value(config: dict[str, Any], dotted: str) -> Any:
    """The value at `dotted`; _MISSING where the config has no such key (an older checkpoint's)."""
    for part in dotted.split("."):
        if not isinstance(config, dict) or part not in config:
            return ADDED_LATER.get(dotted, _MISSING)
        config = config[part]
    return config


def corpus_change(saved_config: dict[str, Any], corpus_id: str) -> list[str]:
    saved = saved_config.get("corpus_id")
    if saved is None or saved == corpus_id:
        return []
    return [f"resumed on corpus {corpus_id}, but the checkpoint was trained on corpus {saved}: the steps after "
            "the resume see other data (see environment.json)"]


def schedule_changes(saved_config: dict[str, Any], cfg: TrainConfig) -> list[str]:
    """One line naming every schedule key whose value differs from the checkpoint's, old -> new."""
    from dataclasses import asdict

    now = asdict(cfg)
    changed = [(k, _value(saved_config, k), _value(now, k)) for k in SCHEDULE_KEYS]
    # A null is a value here (a fraction set or cleared): only a key the checkpoint lacks is skipped.
    changed = [(k, old, new) for k, old, new in changed if old is not _MISSING and old != new]
    if not changed:
        return []
    named = ", ".join(f"{k} {old} -> {new}" for k, old, new in changed)
    return [f"resumed with another learning-rate schedule than the checkpoint's ({named}): every step from the "
            "resume on follows the new one"]


def fp8_change(saved_config: dict[str, Any], cfg: TrainConfig) -> list[str]:
    """One line when trainer.fp8 (or, with FP8 on both sides, trainer.fp8_filter) differs from the
    checkpoint's: the weights load either way (they stay in high precision, model/fp8.py), so
    nothing else would tell that the matmuls after the resume run in another precision."""
    trainer = saved_config.get("trainer") or {}
    old, new = trainer.get("fp8"), cfg.trainer.fp8
    if old is None:  # a checkpoint from before trainer.fp8
        return []
    if old != new:
        return [f"resumed with trainer.fp8={new}, but the checkpoint was trained with trainer.fp8={old}: the block "
                "matmuls from the resume on run in another precision (the weights carry over unchanged)"]
    old_filter, new_filter = trainer.get("fp8_filter"), cfg.trainer.fp8_filter
    if new != "none" and old_filter is not None and old_filter != new_filter:
        return [f"resumed with trainer.fp8_filter={new_filter}, but the checkpoint was trained with "
                f"trainer.fp8_filter={old_filter}: other block linears run in float8 from the resume on"]
    return []


def resume_changes(saved_config: dict[str, Any], corpus_id: str, cfg: TrainConfig) -> list[str]:
    """Every warning a resume gives against the checkpoint's config (`saved_config`): the corpus,
    the learning-rate schedule, FP8."""
    return corpus_change(saved_config, corpus_id) + schedule_changes(saved_config, cfg) + fp8_change(saved_config, cfg)
