"""What the speaking rank writes and says as a run starts: the run dir's records
(environment.json, resolved_config.yaml, the tokenizer) and the start-up lines. The training
loop calls it once, after the model, data and optimizer are built and any checkpoint restored."""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch.distributed as dist
from omegaconf import OmegaConf

from data.atomic import atomic_output
from optim.routing import routing_census
from trainer.build import model_line
from trainer.checkpoint.resume_checks import resume_changes
from trainer.pipeline import pipeline_record
from trainer.run import environment as run_env
from trainer.simulation import one_rank as simulate

log = logging.getLogger("trainer")


def write_start_records(trainer: Any, resumed: Optional[dict[str, Any]], pipelined: bool) -> dict:
    """Write the run dir's start-up records and log the start-up lines for `trainer`, the
    trainer/loop.py Trainer being built (not imported here: the loop imports this module);
    returns the environment record (what the metric sinks also send)."""
    cfg, mesh = trainer.cfg, trainer.mesh
    if simulate.simulating(cfg):
        log.warning(simulate.start_line(mesh, trainer.model_cfg.n_experts))
    environment = run_env.environment(
        trainer.device, mesh.world_size, mesh.dp, mesh.tp,
        dist.get_backend() if dist.is_initialized() else "none", trainer.data.describe(),
        dp_shard=mesh.layout.dp_shard, ep=mesh.ep,
        simulated_rank=mesh.rank if simulate.simulating(cfg) else None,
        pp=mesh.pp, pipeline=pipeline_record(cfg) if pipelined else None,
        optimizers=routing_census(trainer.model, cfg.optim.name),
    )
    # .hydra/config.yaml holds what was asked ("auto"), this file what ran (bf16 or fp32), for
    # anyone reading the run dir later.
    with atomic_output(trainer.run_dir / "resolved_config.yaml") as f:
        f.write(OmegaConf.to_yaml(OmegaConf.create(trainer.resolved_config())).encode())
    run_env.save_tokenizer(trainer.run_dir, trainer.data.tokenizer)
    run_env.record_environment(trainer.run_dir, environment, trainer.step if resumed is not None else None)
    if resumed is not None:
        for line in resume_changes(resumed["config"], trainer.data.corpus_id, cfg):
            log.warning(line)
    log.info(trainer.data.startup_line())
    log.info(model_line(trainer.model_cfg.name, trainer.params, mesh, trainer.tokens_per_step, trainer.data.corpus_id,
                        trainer.n_params))
    if trainer.fp8.recipe != "none":
        log.info(trainer.fp8.line())
    t = cfg.trainer
    log.info(
        "%.1f MFLOP per trained token; peak %.3f TFLOP/s per device (%s)",
        trainer.flops_per_token / 1e6, trainer.peak_flops / 1e12,
        "trainer.peak_tflops" if t.peak_tflops else f"measured, {t.precision} matmul",
    )
    return environment
