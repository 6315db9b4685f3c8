"""What precision a compared run trained in (scripts/compare_runs.py): bf16 and fp32 runs of one
setting reach different losses, so the comparison refuses to mix them unless told."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

from eval.compare import Run, read_yaml
from eval.seeds import Arm

# What trainer.precision can have run in. "auto" in .hydra/config.yaml is what was asked; it
# resolves per run (to bf16 where bf16 matmuls are fast), so it says nothing about what ran.
PRECISIONS = ("bf16", "fp32")


@functools.lru_cache(maxsize=None)
def _resolved_precision(run_dir: Path) -> Optional[str]:
    """trainer.precision in <run_dir>/resolved_config.yaml, which the trainer writes with "auto"
    resolved; None when the run (one from before that file) has none."""
    resolved = run_dir / "resolved_config.yaml"
    if not resolved.exists():
        return None
    return _config_precision(read_yaml(resolved))


def _config_precision(config: dict) -> Optional[str]:
    value = (config.get("trainer") or {}).get("precision")
    return value if value in PRECISIONS else None


def run_precision(run: Run) -> str:
    """What a run trained in: its resolved_config.yaml's trainer.precision, else an explicit
    bf16 or fp32 in its .hydra/config.yaml (an explicit value runs as given); "unknown" for an
    "auto" run that recorded no resolution, or a run without a config (TensorBoard only)."""
    return _resolved_precision(run.path) or _config_precision(run.config) or "unknown"


def arm_precision(arm: Arm) -> str:
    """An arm's precision; "bf16+fp32" when "auto" resolved differently for its seeds (on
    other machines), so that it matches no arm run in either alone."""
    return "+".join(sorted({run_precision(run) for run in arm.runs}))


def mixed_precisions(arms: list[Arm]) -> Optional[str]:
    """None when every run of the arms ran in one precision; else one line naming each arm and
    its precision. bf16 and fp32 runs of one setting reach different losses, so a difference
    between such arms would mix the optimizers' effect with the arithmetic's."""
    if len({run_precision(run) for arm in arms for run in arm.runs}) < 2:
        return None
    named = ", ".join(f"{arm.label} in {arm_precision(arm)} ({arm.path})" for arm in arms)
    return f"arms ran in different precisions: {named}"
