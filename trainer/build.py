"""The parts a Trainer is built from, each built the same way on every rank: the data (once
per node) and the model (from the seed alone, each rank drawing only its part)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Optional

import torch

from data.token_streams import PreparedData, prepare_data
from data.sources import DataConfigError
from eval.flops import device_peak_flops
from model.activation_checkpoint import apply_activation_checkpointing
from model.fp8 import FP8Report, convert_to_fp8, fp8_unsupported, refresh_weight_scales
from model.gpt import GPT
from model.init import InitRule, RankParts, materialize
from model.moe import moe_layers
from model.parallelize import parallelize_moe, parallelize_tp
from model.pipeline_split import StageModule, keep_stages
from parallel.comm import all_gather_object, barrier, world
from parallel.fsdp import apply_fsdp, fsdp_mesh, local_rows
from parallel.mesh import Mesh
from trainer import device as dev
from trainer.config import TrainConfig, reshard_after_forward
from trainer.pipeline import StagePlan, stage_modules, stage_plan

log = logging.getLogger("trainer")


def build_model(cfg: TrainConfig, vocab_size: int, mesh: Mesh, device: torch.device) -> GPT:
    """This rank's part of the model of seed `cfg.seed`: its TP shard, its experts under EP,
    its FSDP2 rows under dp_shard, on `device` (under a pipeline: build_pipeline_model).

    Built and sharded on the meta device, then given storage on `device` and filled one
    parameter at a time by the initialisation rule (model/init.py), which draws each logical
    tensor whole and keeps this rank's part: every layout holds exactly the weights of the
    single-process model of the same seed, and start-up memory does not grow with the model.
    """
    return build_pipeline_model(cfg, vocab_size, mesh, device).model


@dataclass
class BuiltModel:
    model: GPT
    stages: list[StageModule]  # this rank's pipeline stages ([] without a pipeline)
    plan: Optional[StagePlan]  # None without a pipeline
    fp8: FP8Report  # what trainer.fp8 converted
    n_params: int  # the whole model's (every stage's, TP slice and expert), as one process holds it


def build_pipeline_model(cfg: TrainConfig, vocab_size: int, mesh: Mesh, device: torch.device) -> BuiltModel:
    """build_model, and under a pipeline (parallel.pp > 1) this rank's stages: the model then
    holds only their layers, under their whole-model names, and each stage is its own FSDP2
    root. Without one: the model, no stages, no plan."""
    model_cfg = replace(cfg.model, vocab_size=vocab_size)
    with torch.device("meta"):
        model = GPT(model_cfg, init_seed=cfg.seed)
    logical_shapes = {name: p.shape for name, p in model.named_parameters()}
    n_params = sum(shape.numel() for shape in logical_shapes.values())
    plan = stage_plan(cfg, mesh.pp_rank) if mesh.pp > 1 else None
    if plan is not None:
        keep_stages(model, plan.blocks, plan.holds_first, plan.holds_last)
    model = parallelize_tp(model, mesh.tp_group, split_experts=mesh.ep == 1)
    model = parallelize_moe(model, mesh.ep_group, mesh.tp_group, mesh.dp_group)
    # FP8 swaps the linears on the meta model, before FSDP2 wraps them: its float8 all-gather
    # is set up on the weights FSDP2 then shards (model/fp8.py). A GPU without float8 units stops here.
    if cfg.trainer.fp8 != "none" and (reason := fp8_unsupported(device)) is not None:
        raise dev.DeviceError(f"trainer.fp8={cfg.trainer.fp8}: {reason}")
    fp8 = convert_to_fp8(model, cfg.trainer.fp8, cfg.trainer.fp8_filter, mesh.layout.dp_shard > 1, device,
                         cfg.trainer.precision)
    # Checkpoint wrapping before FSDP2 (and compile, later, per block): the order that composes.
    apply_activation_checkpointing(model, cfg.trainer.activation_checkpointing)
    stages = stage_modules(model, plan) if plan is not None else []
    if mesh.layout.dp_shard > 1:
        # FSDP2 over what TP left on this rank: bf16 compute from fp32 master weights under
        # trainer.precision=bf16, fp32 gradient reduction either way.
        param_dtype = torch.bfloat16 if cfg.trainer.precision == "bf16" else None
        experts = [layer.experts for _, layer in moe_layers(model)] if mesh.ep > 1 else []
        # Under a pipeline each stage is a root: torch's stage drives its gradient sync.
        for root in stages or [model]:
            mine = [e for e in experts if any(e is m for m in root.modules())]
            blocks = root.blocks.values() if stages else model.blocks
            apply_fsdp(root, blocks, fsdp_mesh(mesh.device_mesh), param_dtype, reshard_after_forward(cfg.parallel),
                       mine, fsdp_mesh(mesh.expert_mesh, "expert_shard") if mine else None)
    materialize(model, logical_shapes, InitRule.of(model_cfg, cfg.seed), device,
                RankParts.of(mesh.tp_group, mesh.ep_group))
    if fp8.all_gather:  # the scales of the weights just drawn, for the first forward's all-gather
        refresh_weight_scales(stages or [model])
    return BuiltModel(model, stages, plan, fp8, n_params)


def prepare_data_once(cfg: TrainConfig, mesh: Mesh) -> PreparedData:
    """Each node's local rank 0 builds the tokenizer and token caches while the node's other
    ranks wait, then every rank
    opens them. (The cache writes are atomic, so concurrent builders would be safe too;
    waiting just avoids doing the work world-size times.)"""
    if dev.local_rank() != 0:
        barrier(world(), "setup")
    data = prepare_data(cfg.data, cfg.trainer.seq_len)
    if dev.local_rank() == 0:
        barrier(world(), "setup")
    if mesh.world_size > 1:
        check_same_corpus(data.corpus_id, mesh)
    return data


def check_same_corpus(corpus_id: str, mesh: Mesh) -> None:
    """Each node builds its own data with its own interpreter and libraries: ranks whose tokens
    differ would train one model on several corpora without a word, so they stop here."""
    # Over the host group where there is one: NCCL moves objects through the GPU.
    ids = all_gather_object(corpus_id, mesh.host_group or world(), "setup")
    if len(set(ids)) > 1:
        by_id: dict[str, list[int]] = {}
        for rank, cid in enumerate(ids):
            by_id.setdefault(str(cid), []).append(rank)
        named = "; ".join(f"corpus {cid} on ranks {', '.join(map(str, ranks))}" for cid, ranks in by_id.items())
        raise DataConfigError(
            f"the ranks built different corpora ({named}): their Python standard libraries or tokenizer "
            "libraries differ (see the corpus manifest warnings); give every node the same environment"
        )


def model_line(name: str, params: list[torch.Tensor], mesh: Mesh, tokens_per_step: int, corpus_id: str,
               n_params: Optional[int] = None) -> str:
    """The start-up line: the model's parameters and this rank's share of them (its pipeline
    stages, FSDP2 rows, TP slices and EP experts), and the whole layout as the parallel.* keys
    name it. `n_params`: the whole model's count, which a pipeline rank, holding only its
    stages, cannot count from `params` (build_pipeline_model's BuiltModel.n_params)."""
    total = sum(getattr(p, "logical_numel", p.numel()) for p in params)  # TP/EP: the logical size
    if mesh.pp > 1 and n_params is not None:
        total = n_params
    mine = sum(local_rows(p.detach())[0].numel() for p in params)
    layout = mesh.layout
    pp = f"pp={layout.pp} " if layout.pp > 1 else ""
    return (f"model {name}: {total / 1e6:.2f}M parameters, {mine / 1e6:.2f}M on this rank; mesh "
            f"{pp}dp_replicate={layout.dp_replicate} dp_shard={layout.dp_shard} tp={layout.tp} ep={layout.ep}; "
            f"{tokens_per_step} tokens per step; corpus {corpus_id}")


def measured_peak_flops(device: torch.device, precision: str, speaks: bool) -> float:
    """This device's matmul FLOP/s in `precision`, measured once at start-up (perf/mfu's
    denominator where trainer.peak_tflops is 0).

    The ranks measure together (hence the barrier), so ranks sharing a machine measure the
    share of it they will train with, not a moment when the others were idle.
    """
    barrier(world(), "setup")
    if speaks:
        log.info("measuring this device's %s matmul peak for perf/mfu (trainer.peak_tflops=<TFLOP/s> "
                 "skips it)", precision)
    start = time.perf_counter()
    peak = device_peak_flops(device, precision)
    if speaks:
        log.info("peak measured in %.1fs", time.perf_counter() - start)
    return peak
