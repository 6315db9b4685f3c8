"""Metric sinks: metrics.jsonl always, TensorBoard and wandb when enabled. Rank 0 only.

Every sink receives the same names, so a curve found in one is found in the others.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from trainer.config import LoggerConfig


class MetricSinks:
    def __init__(self, run_dir: Path, cfg: LoggerConfig, run_name: str, config: dict[str, Any]) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")
        self.tb = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run_dir / "tb"))
        self.wandb_run = None
        if cfg.wandb.mode != "disabled":
            import wandb

            # wandb writes its run files under <dir>/wandb.
            os.environ.setdefault("WANDB_SILENT", "true")
            self.wandb_run = wandb.init(
                dir=str(run_dir),
                mode=cfg.wandb.mode,
                project=cfg.wandb.project,
                entity=cfg.wandb.entity,
                group=cfg.wandb.group,
                name=run_name,
                config=config,
                reinit="finish_previous",
            )

    def log(self, step: int, tokens: int, metrics: dict[str, float]) -> None:
        record = {"step": step, "tokens": tokens, **metrics}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for name, value in metrics.items():
                self.tb.add_scalar(name, value, global_step=step)
        if self.wandb_run is not None:
            self.wandb_run.log({"tokens": tokens, **metrics}, step=step)

    def close(self) -> None:
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
