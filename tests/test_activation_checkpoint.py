"""Activation checkpointing (model/activation_checkpoint.py): full and selective recompute give
the loss, gradients and per-step statistics of no checkpointing, eager and compiled, in one
process and under FSDP2, TP and EP; and selective keeps what its policy says it keeps.

fp32 throughout, so "the same" is within 1e-6.
"""
from __future__ import annotations

import functools
from collections import Counter
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

from model.activation_checkpoint import (CheckpointedForward, apply_activation_checkpointing, recomputing,
                                         selective_policy)
from model.gpt import GPT
from model.moe import balance_experts, moe_layers
from optim.qk_clip import QKClip
from tests.conftest import compose
from tests.distributed import run_distributed
from tests.closeness import assert_close
from trainer.config import TrainConfig, to_dataclass

VOCAB = 97
MODES = ("full", "selective")
TOLERANCE = 1e-6


@functools.cache
def train_cfg(model: str, mode: str = "none", *overrides: str) -> TrainConfig:
    return to_dataclass(compose([f"model={model}", "seed=3", "trainer.precision=fp32",
                                 f"trainer.activation_checkpointing={mode}", *overrides]))


def plain_model(cfg: TrainConfig, mode: str) -> GPT:
    torch.manual_seed(cfg.seed)
    model = GPT(replace(cfg.model, vocab_size=VOCAB))
    apply_activation_checkpointing(model, mode)
    return model


def batch(seed: int = 1, rows: int = 2, seq: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (rows, seq), generator=gen), torch.randint(0, VOCAB, (rows, seq), generator=gen))


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def step(model: GPT, idx: torch.Tensor, tgt: torch.Tensor) -> tuple[dict, int]:
    """Loss and gradients of one forward and backward, and the bytes autograd saved for it."""
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(idx, tgt)
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: local(p.grad).clone() for n, p in model.named_parameters()}}, saved[0]


def assert_same(got: dict, expected: dict, what: str) -> None:
    assert got.keys() == expected.keys(), what
    for key, value in expected.items():
        if isinstance(value, dict):
            assert_same(got[key], value, f"{what}/{key}")
        elif isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
            assert len(got[key]) == len(value), f"{what}/{key}"
            for i, (a, b) in enumerate(zip(got[key], value)):
                assert_close(a, b, rtol=0, atol=TOLERANCE, msg=f"{what}/{key}[{i}]")
        elif isinstance(value, torch.Tensor):
            assert_close(got[key], value, rtol=0, atol=TOLERANCE, msg=f"{what}/{key}")
        else:
            assert got[key] == value, f"{what}/{key}: {got[key]} != {value}"


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_full_and_selective_give_the_loss_and_gradients_of_none_on_gpt_tiny(compiled):
    """Compiled block by block, as the trainer does with checkpointing on; aot_eager: dynamo and
    AOT autograd's partitioner (which applies the policy's choices) without inductor's CPU
    compile time. Compiled, what selective keeps goes through autograd's saved tensors, between
    full's and none's; eagerly SAC keeps it in a cache of its own, so only the sides show."""
    cfg = train_cfg("gpt_tiny")
    idx, tgt = batch()
    results, saved = {}, {}
    for mode in ("none", *MODES):
        model = plain_model(cfg, mode)
        if compiled:
            torch._dynamo.reset()
            for block in model.blocks:
                block.compile(backend="aot_eager")
        results[mode], saved[mode] = step(model, idx, tgt)
        # Names (and so checkpoints, optimizer routing, metrics) are those of the plain model.
        results[mode]["names"] = list(model.state_dict())
    assert results["none"]["loss"] > 0
    for mode in MODES:
        assert_same(results[mode], results["none"], mode)
    assert saved["full"] < saved["none"] and saved["selective"] < saved["none"], saved
    if compiled:
        assert saved["full"] < saved["selective"], saved


def moe_step(cfg: TrainConfig, mode: str) -> dict:
    """One training step's forward and backward of moe_tiny with QK-clip's capture and output-RMS
    tracking on, and everything those record."""
    model = plain_model(cfg, mode)
    QKClip(model, 100.0, None, None)
    model.track_output_rms = True
    idx, tgt = batch()
    max_logits: list[torch.Tensor] = []
    loss = model(idx, tgt, max_logit_out=max_logits)
    aux = [layer.aux_loss.detach() for _, layer in moe_layers(model)]
    loss.backward()
    out = {
        "loss": loss.detach(), "aux_loss": aux, "max_logit_out": max_logits,
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        "load": [layer.load.clone() for _, layer in moe_layers(model)],
        "entropy_sum": [layer.entropy_sum.clone() for _, layer in moe_layers(model)],
        "head_max_logit": [block.attn.head_max_logit.clone() for block in model.blocks],
        "output_rms": model.pop_output_rms(idx.numel()),
    }
    balance_experts(model, None, cfg.model.bias_update_rate, 1)
    out["expert_bias"] = [layer.expert_bias.clone() for _, layer in moe_layers(model)]
    return out


def test_moe_routing_aux_loss_qk_clip_and_output_rms_are_those_of_none():
    """The recompute routes as the forward did and records nothing twice: routing counts,
    entropy, aux loss, QK-clip maxima, the max-logit list and the output RMS are none's."""
    cfg = train_cfg("moe_tiny", "none", "model.aux_loss_coef=0.01")
    expected = moe_step(cfg, "none")
    assert expected["load"][0].sum() == 2 * 16 * cfg.model.top_k  # each token counted once
    assert len(expected["max_logit_out"]) == cfg.model.n_layers
    assert all(a > 0 for a in expected["aux_loss"])
    for mode in MODES:
        assert_same(moe_step(cfg, mode), expected, mode)


class OpCounter(TorchDispatchMode):
    """Counts the ops that run (a kept op's output, handed back from the cache, does not)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def backward_ops(mode: str, model_name: str = "gpt_tiny") -> Counter:
    model = plain_model(train_cfg(model_name), mode)
    loss = model(*batch())
    with OpCounter() as counter:
        loss.backward()
    return counter.counts


def test_selective_recomputes_every_other_matmul_and_no_attention():
    """Per dense block, 7 projections (wq wk wv wo, gate up down). Full recomputes the attention
    and the first 6 (the recompute stops once the last saved tensor, w_down's input, is back);
    selective only the 2nd, 4th and 6th (wk, wo, up) and no attention. Whatever the backward runs
    beyond none's is recompute."""
    none, full, selective = (backward_ops(mode) for mode in ("none", *MODES))
    layers = train_cfg("gpt_tiny").model.n_layers
    sdpa = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    assert full["aten.mm.default"] - none["aten.mm.default"] == 6 * layers
    assert selective["aten.mm.default"] - none["aten.mm.default"] == 3 * layers
    assert (none[sdpa], full[sdpa], selective[sdpa]) == (0, layers, 0)
    # the pointwise work is recomputed under both
    assert selective["aten.silu.default"] == full["aten.silu.default"] == none["aten.silu.default"] + layers


def test_the_recompute_routes_as_the_forward_did():
    """Both modes keep the routing decisions (top-k, the sorts by expert): the recompute reruns
    the MoE layer's router and experts but chooses no experts again."""
    for mode in MODES:
        ops = backward_ops(mode, "moe_tiny")
        assert ops["aten._grouped_mm.default"] > 0 and ops["aten.sigmoid.default"] > 0, mode  # rerun
        assert ops["aten.topk.default"] == ops["aten.sort.stable"] == ops["aten.sort.default"] == 0, mode


def test_selective_policy_counts_the_forward_and_the_recompute_apart():
    """torch releases that ask the policy again in the recompute must get the forward's answers
    call by call: a count shared between the two would shift them."""
    policy, mm = selective_policy(), torch.ops.aten.mm.default
    forward = [policy(SelectiveCheckpointContext(is_recompute=False), mm) for _ in range(5)]
    recompute = [policy(SelectiveCheckpointContext(is_recompute=True), mm) for _ in range(5)]
    save, recompute_it = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert forward == recompute == [save, recompute_it, save, recompute_it, save]
    assert policy(SelectiveCheckpointContext(is_recompute=False), torch.ops.aten.silu.default) == recompute_it


def test_profiler_annotations_only_the_recompute_makes_leave_selective_intact():
    """FSDP2's hooks around EP's experts, inside a block, annotate the recompute more often than
    the forward: SAC must not count those annotations, or it fails to replay them."""
    torch.manual_seed(0)
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)

    def body(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if recomputing():
            with torch.profiler.record_function("recompute only"):
                pass
        return ((x @ w).sin() @ w).sum()

    CheckpointedForward(body, "selective")(x, w).backward()
    grads = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    body(x, w).backward()
    assert_close(grads, (x.grad, w.grad), rtol=0, atol=TOLERANCE)


def test_an_unknown_mode_names_the_key():
    with pytest.raises(ValueError, match="trainer.activation_checkpointing"):
        apply_activation_checkpointing(plain_model(train_cfg("gpt_tiny"), "none"), "some")


# --- Distributed: built by trainer/build.py (checkpointing, then FSDP2), two ranks on gloo ---

LAYOUTS = [  # (model, tp, dp_shard, ep)
    ("gpt_tiny", 1, 2, 1),
    ("gpt_tiny", 2, 1, 1),
    ("moe_tiny", 2, 1, 1),
    ("moe_tiny", 1, 1, 2),
]
# The collectives a recompute would send again, as they reach the network: TP's and the aux
# loss's all-reduces, EP's all-to-alls.
SENT = ("c10d.allreduce_.default", "c10d.alltoall_base_.default")


def _layouts_worker(rank: int, world: int, layouts: list[tuple], modes: tuple, cfgs: dict) -> list[dict]:
    from parallel.fsdp import sync_gradients
    from parallel.mesh import build_mesh, release_subgroups
    from trainer.build import build_model

    results = []
    for model_name, tp, dp_shard, ep in layouts:
        mesh = build_mesh(tp, dp_shard=dp_shard, ep=ep)
        idx, tgt = batch(seed=10 + mesh.dp_rank)
        per_mode = {}
        for mode in modes:
            model = build_model(cfgs[(model_name, mode)], VOCAB, mesh, torch.device("cpu"))
            if dp_shard > 1:
                sync_gradients(model, True)
            loss = model(idx, tgt)
            with OpCounter() as sent:
                loss.backward()
            per_mode[mode] = {
                "loss": loss.detach(),
                "grads": {n: local(p.grad).clone() for n, p in model.named_parameters()},
                "load": [layer.load.clone() for _, layer in moe_layers(model)],
                "backward_comm": {op: sent.counts[op] for op in SENT},
            }
            del model, loss
        results.append(per_mode)
        release_subgroups(mesh)
    return results


def test_full_and_selective_equal_none_under_fsdp2_tp_and_ep():
    """Each layout as trainer/build.py builds it. Selective keeps the collectives' results, so its
    backward sends what none's does; full sends the block's forward collectives again."""
    cfgs = {(name, mode): train_cfg(name, mode, "model.aux_loss_coef=0.01")
            for name in {layout[0] for layout in LAYOUTS} for mode in ("none", *MODES)}
    for rank, per_layout in enumerate(run_distributed(_layouts_worker, 2, LAYOUTS, ("none", *MODES), cfgs)):
        for layout, per_mode in zip(LAYOUTS, per_layout, strict=True):
            expected = per_mode["none"]
            sent = sum(expected["backward_comm"].values())
            for mode in MODES:
                got = per_mode[mode]
                assert_same({k: got[k] for k in ("loss", "grads", "load")},
                            {k: expected[k] for k in ("loss", "grads", "load")}, f"rank {rank} {layout} {mode}")
                if layout[1] > 1 or layout[3] > 1:
                    resent = sum(got["backward_comm"].values())
                    if mode == "selective":
                        assert got["backward_comm"] == expected["backward_comm"], (rank, layout)
                    else:
                        assert resent > sent, (rank, layout, got["backward_comm"], expected["backward_comm"])
