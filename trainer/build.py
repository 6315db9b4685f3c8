"""The parts a Trainer is built from, each built the same way on every rank: the data (once
per node) and the model (from the seed alone, then sharded)."""
from __future__ import annotations

from dataclasses import replace

import torch

from data.pipeline import PreparedData, prepare_data
from data.sources import DataConfigError
from model.gpt import GPT
from model.moe import moe_layers
from model.parallelize import parallelize_moe, parallelize_tp
from parallel.comm import all_gather_object, barrier, world
from parallel.fsdp import apply_fsdp, fsdp_mesh
from parallel.mesh import Mesh
from trainer import device as dev
from trainer.config import TrainConfig


def build_model(cfg: TrainConfig, vocab_size: int, mesh: Mesh, device: torch.device) -> GPT:
    """The full model from the seed alone, then this rank's TP shard of it (and, under EP, its
    experts).

    Initialising the full model on every rank before sharding is what makes a TP=T run hold
    exactly the weights of a TP=1 run with the same seed.
    """
    torch.manual_seed(cfg.seed)
    model = parallelize_tp(GPT(replace(cfg.model, vocab_size=vocab_size)), mesh.tp_group, split_experts=mesh.ep == 1)
    model = parallelize_moe(model, mesh.ep_group, mesh.tp_group, mesh.dp_group).to(device)
    if mesh.layout.dp_shard > 1:
        # FSDP2 over what TP left on this rank: bf16 compute from fp32 master weights under
        # trainer.precision=bf16, fp32 gradient reduction either way.
        param_dtype = torch.bfloat16 if cfg.trainer.precision == "bf16" else None
        experts = [layer.experts for _, layer in moe_layers(model)] if mesh.ep > 1 else []
        apply_fsdp(model, model.blocks, fsdp_mesh(mesh.device_mesh), param_dtype, cfg.parallel.reshard_after_forward,
                   experts, fsdp_mesh(mesh.expert_mesh, "expert_shard") if experts else None)
    return model


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
