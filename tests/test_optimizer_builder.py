"""The combined Muon + AdamW optimizer: groups, weight decay, state, resume."""
from __future__ import annotations

import copy

import torch

from model.config import ModelConfig
from model.gpt import GPT
from optim.builder import build_optimizer
from optim.config import MuonConfig, OptimConfig
from optim.routing import MUON_KINDS

CFG = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=32, vocab_size=61)


def model() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def step(m: GPT, opt, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 61, (2, 16), generator=gen)
    m(idx[:, :-1], idx[:, 1:]).backward()
    opt.step()
    opt.zero_grad()


def test_groups_route_matrices_to_muon_and_decay_every_family_by_default():
    opt = build_optimizer(model(), OptimConfig(name="muon", weight_decay=0.1), CFG)
    muon_kinds = {g["kind"] for g in opt.optimizers["muon"].param_groups}
    adamw_kinds = {g["kind"] for g in opt.optimizers["adamw"].param_groups}
    assert muon_kinds == MUON_KINDS - {"experts"}
    assert adamw_kinds == {"embed", "head", "norm"}
    assert all(g["weight_decay"] == 0.1 for g in opt.param_groups)  # norms included


def test_weight_decay_overrides_and_split_heads():
    cfg = OptimConfig(name="muon", weight_decay_overrides={"norm": 0.0, "attn_q": 0.05},
                      muon=MuonConfig(split_heads=True))
    opt = build_optimizer(model(), cfg, CFG)
    by_kind = {g["kind"]: g for g in opt.param_groups}
    assert by_kind["norm"]["weight_decay"] == 0.0
    assert by_kind["attn_q"]["weight_decay"] == 0.05
    assert by_kind["embed"]["weight_decay"] == cfg.weight_decay
    for kind in ("attn_q", "attn_k", "attn_v"):
        assert by_kind[kind]["split_rows"] == CFG.head_dim
    assert "split_rows" not in by_kind["attn_o"] or by_kind["attn_o"]["split_rows"] is None


def test_norm_gammas_decay_toward_zero_with_zero_gradient():
    m = model()
    opt = build_optimizer(m, OptimConfig(name="muon", lr=0.1, weight_decay=0.5), CFG)
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    # AdamW with a zero gradient moves only by decoupled decay: w *= 1 - lr * wd
    torch.testing.assert_close(m.final_norm.weight, torch.full_like(m.final_norm.weight, 0.95))


def test_state_dict_round_trip_resumes_identically():
    cfg = OptimConfig(name="muon", muon=MuonConfig(ns_dtype="fp32"))
    m = model()
    opt = build_optimizer(m, cfg, CFG)
    for s in range(3):
        step(m, opt, s)
    saved_model = copy.deepcopy(m.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    for s in range(3, 5):
        step(m, opt, s)

    m2 = model()
    m2.load_state_dict(saved_model)
    opt2 = build_optimizer(m2, cfg, CFG)
    opt2.load_state_dict(saved_opt)
    for s in range(3, 5):
        step(m2, opt2, s)
    for (name, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), name


def test_muon_state_on_matrices_is_half_of_adamw():
    def matrix_state_bytes(name: str) -> int:
        m = model()
        opt = build_optimizer(m, OptimConfig(name=name), CFG)
        step(m, opt, 0)
        matrices = {id(p) for n, p in m.named_parameters() if p.ndim == 2 and "embed" not in n and "head" not in n}
        total = 0
        for o in opt.optimizers.values():
            for p, state in o.state.items():
                if id(p) in matrices:
                    total += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t) and t.numel() > 1)
        return total

    assert matrix_state_bytes("muon") * 2 == matrix_state_bytes("adamw")
