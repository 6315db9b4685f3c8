"""What one run of a fair study is: the overrides it gets from the plan (its identity), its steps
and tokens at a budget, and the base config every run starts from."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional


# The configs every run composes, beside the packages (the repository's root).
CONF = Path(__file__).resolve().parent.parent / "conf"


def steps_of(steps_1x: int, budget: float) -> int:
    return max(1, int(math.floor(steps_1x * budget + 0.5)))


def override_key(text: str) -> str:
    """`+optim.lr_overrides.embed=0.3` -> optim.lr_overrides.embed; `hydra/launcher=slurm` -> hydra/launcher."""
    return text.lstrip("+~").split("=", 1)[0]


def given(overrides: list[str], key: str) -> bool:
    """Whether `overrides` set `key` (also as +key=, ++key= or ~key)."""
    return any(override_key(o) == key for o in overrides)


def run_overrides(study_train: list[str], side_overrides: list[str], fraction: float, steps: int, seed: int,
                  objective: Optional[str] = None, eval_interval: int = 0) -> list[str]:
    """The train.py overrides of one run of the study, the base's first."""
    runs = [*study_train, *side_overrides, f"data.tune_fraction={fraction}", f"trainer.max_steps={steps}",
            f"seed={seed}", f"eval.interval={eval_interval}", "checkpoint.interval=0"]
    if objective is not None:
        runs.append(f"eval.objective={objective}")
    return runs


def run_steps(plan: Any, space: Any, values: dict[str, float], budget: float) -> tuple[int, int]:
    """(steps, tokens) of one run at `budget` (`plan`: a study.plan.Plan): a trial that sets
    trainer.batch_size (a batch dimension, opened on both sides) runs as many tokens as the base
    batch would, in more or fewer steps."""
    steps, tokens_per_step = plan.steps(budget), plan.tokens_per_step
    batch = next((values[d.name] for d in space.dims if "trainer.batch_size" in d.keys), None)
    if batch:
        base = plan.compare["batch_size"]
        steps = max(1, int(math.floor(steps * base / batch + 0.5)))
        tokens_per_step = tokens_per_step * int(batch) // base
    return steps, steps * tokens_per_step


def base_config(train: list[str], fraction: float) -> Any:
    """The TrainConfig of the study's base overrides: its batch and steps, before any trial's."""
    from trainer.config import to_dataclass
    from trainer.run.preflight import compose

    return to_dataclass(compose([*train, f"data.tune_fraction={fraction}"], str(CONF)))
