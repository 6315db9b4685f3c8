"""Train a GPT with Muon or AdamW.

    python train.py                                   # defaults: conf/config.yaml
    python train.py model=gpt_small optim=adamw       # pick presets
    python train.py -m optim=muon,adamw optim.lr=1e-3,3e-3   # Hydra multirun sweep
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from data.sources import check_data_config
from model.moe import check_moe_config
from model.parallelize import check_tp_divisibility
from trainer.loop import NonFiniteLoss, Trainer
from trainer.mesh import check_mesh_shape, destroy_mesh, world_size_from_env
from trainer.config import register_configs, to_dataclass, validate

register_configs()
log = logging.getLogger("train")


def one_line(err: Exception) -> str:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    full_key = getattr(err, "full_key", None)
    return f"{full_key}: {first}" if full_key and full_key not in first else first


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    try:
        typed = to_dataclass(cfg)
        validate(typed)
        check_mesh_shape(world_size_from_env(), typed.parallel.tp)
        check_moe_config(typed.model)
        check_tp_divisibility(typed.model, typed.parallel.tp)
        check_data_config(typed.data)
    except (ValueError, OmegaConfBaseException) as err:
        # Bad input is the user's to fix: one line naming the key, not a traceback.
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {one_line(err)}", file=sys.stderr)
        sys.exit(2)

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    log.info("run dir: %s", run_dir)
    try:
        final = Trainer(typed, run_dir).train()
    except NonFiniteLoss as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(3)
    finally:
        # A multirun sweep runs the next job in this process: leave no group behind.
        destroy_mesh()
    # The return value is what Hydra sweepers optimise: the final in-domain val loss.
    return final.get("val/val/loss", float("nan"))


if __name__ == "__main__":
    main()
