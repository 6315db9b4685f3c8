"""MoE layer: routing and outputs against a slow per-token reference, balancing, Muon, TP."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from model import moe as moe_module
from model.config import ModelConfig
from model.gpt import GPT
from model.moe import MoE, balance_experts, check_moe_config, moe_layers
from model.parallelize import check_tp_divisibility, parallelize_tp
from optim.builder import build_optimizer
from optim.config import OptimConfig
from optim.muon.options import MuonOptions
from optim.muon.optimizer import Muon
from tests.distributed import run_distributed
from tests.test_distributed_muon import parallel_tolerance, worst_relative_error
from tests.test_tensor_parallel import gathered
from tests.closeness import assert_close, check, check_relative
from parallel.mesh import Mesh, build_mesh

CFG = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=32,
                  vocab_size=61, n_experts=4, top_k=2, n_shared_experts=1, expert_hidden=16,
                  n_dense_layers=1, routed_scaling=1.7)


def reference_moe(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert: the definition the fast layer must match."""
    out = torch.zeros_like(x)
    e = layer.experts
    for n in range(x.shape[0]):
        logits = layer.router.weight @ x[n]
        scores = logits.sigmoid() if layer.score_func == "sigmoid" else logits.softmax(-1)
        chosen = (scores + layer.expert_bias).topk(layer.top_k).indices
        gates = scores[chosen]
        if layer.score_func == "sigmoid":
            gates = gates / gates.sum()
        for g, k in zip(gates * layer.routed_scaling, chosen.tolist()):
            h = F.silu(e.w_gate[k] @ x[n]) * (e.w_up[k] @ x[n])
            out[n] += g * (e.w_down[k] @ h)
        if layer.shared is not None:
            out[n] += layer.shared(x[n])
    return out


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("bias", [
    [0.3, -0.2, 0.0, 0.1],  # selection must use it
    [0.0, 50.0, 0.0, 50.0],  # experts 0 and 2 get no token: empty groups between full ones
], ids=["mixed", "empty-experts"])
def test_moe_outputs_and_gradients_equal_the_slow_reference(score_func, grouped, bias, monkeypatch):
    if not grouped:
        monkeypatch.setattr(moe_module, "grouped_mm_usable", lambda x, w: False)
    torch.manual_seed(0)
    layer = MoE(replace(CFG, score_func=score_func))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    layer.expert_bias.copy_(torch.tensor(bias))
    x = torch.randn(2, 7, 32)
    fast = layer(x)
    fast_grads = torch.autograd.grad(fast.pow(2).sum(), list(layer.parameters()))
    slow = reference_moe(layer, x.view(-1, 32)).view(2, 7, 32)
    slow_grads = torch.autograd.grad(slow.pow(2).sum(), list(layer.parameters()))
    assert_close(fast, slow, rtol=1e-5, atol=1e-5)
    # Whole-tensor relative error: the sorted dispatch sums in another order than the
    # per-token loop, which moves single near-cancelling elements by ~1e-5 absolute.
    for a, b in zip(fast_grads, slow_grads):
        check_relative("output", a, b, 1e-5)


def test_dense_first_layers_and_routing_kinds():
    model = GPT(CFG)
    assert not isinstance(model.blocks[0].mlp, MoE) and isinstance(model.blocks[1].mlp, MoE)
    opt = build_optimizer(model, OptimConfig(name="muon"), CFG)
    kinds = {kind: name for name, o in opt.optimizers.items() for g in o.param_groups for kind in g["kind"].split("+")}
    assert kinds["experts"] == "muon" and kinds["router"] == "adamw"
    assert kinds["mlp_in"] == "muon"  # dense layer 0 and the shared expert
    assert "blocks.1.mlp.expert_bias" in model.state_dict()  # checkpointed, not a parameter
    assert all("expert_bias" not in n for n, _ in model.named_parameters())


def test_muon_orthogonalises_each_expert_on_its_own():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 16, 32))
    w.grad = torch.randn(4, 16, 32)
    singles = [torch.nn.Parameter(w.detach()[e].clone()) for e in range(4)]
    for e, s in enumerate(singles):
        s.grad = w.grad[e].clone()
    kw = dict(lr=0.05, weight_decay=0.1, ns_dtype="fp32")
    Muon([w], **kw).step()
    Muon(singles, **kw).step()
    for e in range(4):
        assert_close(w.detach()[e], singles[e].detach(), rtol=1e-5, atol=1e-6)


def test_bias_balancing_reduces_load_imbalance_on_skewed_input():
    torch.manual_seed(0)
    layer = MoE(replace(CFG, n_shared_experts=0))
    with torch.no_grad():
        layer.router.weight.normal_(std=0.1)
        layer.router.weight[0] += 0.5  # expert 0 wins for inputs along the all-ones direction
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([torch.nn.Module()])
    model.blocks[0].mlp = layer
    x = torch.randn(1, 256, 32) * 0.5 + 1.0
    imbalance = []
    for _ in range(200):
        layer(x)
        stats = balance_experts(model, None, rate=0.01, n_micro_batches=1)
        imbalance.append(stats["moe/load_imbalance/layer_0"].item())
    assert imbalance[0] > 1.8, imbalance[0]
    assert max(imbalance[-20:]) < 1.3, imbalance[-20:]
    assert layer.expert_bias[0] < 0  # the favoured expert was pushed down


def test_aux_loss_is_one_when_perfectly_balanced_and_added_to_the_loss():
    layer = MoE(replace(CFG, aux_loss_coef=1.0))
    scores = torch.full((8, 4), 0.5)
    counts = torch.tensor([4, 4, 4, 4])
    check("balance loss", abs(layer.balance_loss(scores, counts).item() - 1.0), 1e-6)
    torch.manual_seed(0)
    model = GPT(replace(CFG, aux_loss_coef=0.5))
    idx = torch.randint(0, 61, (2, 9))
    with_aux = model(idx[:, :-1], idx[:, 1:])
    aux = moe_layers(model)[0][1].aux_loss
    model.eval()
    without = model(idx[:, :-1], idx[:, 1:])
    assert_close(with_aux, without + aux)


@pytest.mark.parametrize("kw, key", [
    (dict(top_k=5), "model.top_k"), (dict(score_func="relu"), "model.score_func"),
    (dict(n_dense_layers=3), "model.n_dense_layers"),
])
def test_invalid_expert_settings_name_the_key(kw, key):
    with pytest.raises(ValueError, match=key):
        check_moe_config(replace(CFG, **kw))


def test_expert_width_not_divisible_by_tp_is_an_error():
    with pytest.raises(ValueError, match="model.expert_hidden"):
        check_tp_divisibility(replace(CFG, expert_hidden=17), 2)


def _moe_parallel_worker(rank: int, world: int, tp: int) -> tuple[float, float]:
    """The worst relative parameter error (or absolute expert-bias error) against the single
    process, and its tolerance (tests/test_distributed_muon.py parallel_tolerance)."""
    mesh = build_mesh(tp)
    # AdamW eps=1e-4 for the router, as in tests/test_distributed_muon.py: its gradients here
    # are ~1e-6, where eps=1e-8 turns fp32 summation-order differences between TP and
    # single-process into 1.3e-5 relative update differences; this tests the data flow.
    cfg = OptimConfig(name="muon", lr=0.02, eps=1e-4, muon=MuonOptions(ns_dtype="fp32"))
    gen = torch.Generator().manual_seed(7)
    data = [torch.randint(0, 61, (4, 13), generator=gen) for _ in range(3)]

    def run(model, opt, dp_rank, dp, accumulate=1):
        per = 4 // dp
        for rows in data:
            mine = rows[dp_rank * per : (dp_rank + 1) * per]
            for micro in mine.chunk(accumulate):
                (model(micro[:, :-1], micro[:, 1:]) / accumulate).backward()
            opt.prepare_grads(1.0)
            opt.step()
            opt.zero_grad()
            balance_experts(model, opt.mesh.dp_group, 0.01, accumulate)

    def single(accumulate: int) -> GPT:
        torch.manual_seed(0)
        reference = GPT(CFG)
        run(reference, build_optimizer(reference, cfg, CFG, Mesh()), 0, 1, accumulate)
        return reference

    reference = single(1)
    torch.manual_seed(0)
    model = parallelize_tp(GPT(CFG), mesh.tp_group)
    run(model, build_optimizer(model, cfg, CFG, mesh), mesh.dp_rank, mesh.dp)
    ref = dict(reference.named_parameters())
    worst = worst_relative_error({n: gathered(p, p.detach(), mesh.tp_group, ref[n].shape[0])
                                  for n, p in model.named_parameters()}, ref)
    bias_err = (model.blocks[1].mlp.expert_bias - reference.blocks[1].mlp.expert_bias).abs().max().item()
    floor = worst_relative_error(dict(single(2).named_parameters()), ref)
    return max(worst, bias_err), parallel_tolerance(floor)


@pytest.mark.parametrize("dp, tp", [(1, 2), (2, 2), (2, 1)])
def test_moe_tp_and_distributed_muon_equal_single_process(dp, tp):
    for rank, (err, tolerance) in enumerate(run_distributed(_moe_parallel_worker, dp * tp, tp)):
        check(f"rank {rank}: relative parameter error", err, tolerance)


def test_router_scores_are_fp32_under_bf16_autocast():
    torch.manual_seed(0)
    layer = MoE(CFG)
    x = torch.randn(64, CFG.d_model)
    expected = F.linear(x, layer.router.weight).sigmoid()
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        ids, gates, scores = layer.route(x)
    assert scores.dtype == gates.dtype == torch.float32
    # the same fp32 numbers as without autocast (bf16 logits would be off by ~1e-3)
    assert_close(scores, expected, rtol=0, atol=1e-6)


def test_compiled_fp32_moe_layer_equals_eager():
    """torch._grouped_mm's CPU kernel takes fp32 but its compile-time rule does not: under
    torch.compile the layer must fall back to the per-expert loop and compute the same."""
    torch.manual_seed(0)
    layer = GPT(CFG).blocks[1].mlp
    x = torch.randn(2, 8, CFG.d_model)
    assert_close(torch.compile(layer)(x), layer(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n_experts, ep, line", [
    (4, 3, "model.n_experts=4 is not divisible by parallel.ep=3: every EP rank must hold the same number of experts"),
    (0, 2, "parallel.ep=2 needs a MoE model (model.n_experts > 0); model.name=x has no experts"),
])
def test_expert_parallelism_that_does_not_fit_the_model_is_one_line(n_experts, ep, line):
    from model.parallelize import check_ep

    with pytest.raises(ValueError) as err:
        check_ep(replace(CFG, name="x", n_experts=n_experts, top_k=min(CFG.top_k, max(1, n_experts))), ep)
    assert str(err.value) == line
    check_ep(replace(CFG, n_experts=4), 2)  # fits
