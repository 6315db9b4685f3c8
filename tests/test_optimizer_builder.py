"""The combined Muon + AdamW optimizer: groups, weight decay, state, resume."""
from __future__ import annotations

import copy

import torch

from model.config import ModelConfig
from model.gpt import GPT
from optim.builder import build_optimizer
from optim.config import OptimConfig
from optim.muon.options import MuonOptions
from optim.routing import MUON_KINDS
from tests.closeness import assert_close

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
    adamw_kinds = {kind for g in opt.optimizers["adamw"].param_groups for kind in g["kind"].split("+")}
    assert muon_kinds == MUON_KINDS - {"experts"}
    assert adamw_kinds == {"embed", "head", "norm"}
    # The families share one group where their settings agree: one fused AdamW launch.
    assert len(opt.optimizers["adamw"].param_groups) == 1
    assert all(g["weight_decay"] == 0.1 for g in opt.param_groups)  # norms included


def test_weight_decay_overrides_and_split_heads():
    cfg = OptimConfig(name="muon", weight_decay_overrides={"norm": 0.0, "attn_q": 0.05},
                      muon=MuonOptions(split_heads=True))
    opt = build_optimizer(model(), cfg, CFG)
    by_kind = {kind: g for g in opt.param_groups for kind in g["kind"].split("+")}
    assert by_kind["norm"]["weight_decay"] == 0.0
    assert by_kind["embed"] is by_kind["head"] and by_kind["norm"] is not by_kind["embed"]
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
    assert_close(m.final_norm.weight, torch.full_like(m.final_norm.weight, 0.95))


def test_state_dict_round_trip_resumes_identically():
    cfg = OptimConfig(name="muon", muon=MuonOptions(ns_dtype="fp32"))
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


def test_adamw_families_merged_into_one_group_step_exactly_as_apart():
    """Merging groups of equal settings changes the launches, not the arithmetic."""
    from optim.adamw import build_adamw

    cfg = OptimConfig(name="adamw", lr=0.01, weight_decay=0.1, weight_decay_overrides={"norm": 0.0})
    merged_model, apart_model = model(), model()
    merged = build_adamw([{"params": list(ps), "kind": k, **cfg.group_settings(k)}
                          for k, ps in _families(merged_model).items()], cfg)
    apart = [torch.optim.AdamW([{"params": list(ps), **cfg.group_settings(k)}], lr=cfg.lr,
                               betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)
             for k, ps in _families(apart_model).items()]
    assert sorted(g["kind"] for g in merged.param_groups) == ["embed+head+blocks", "norm"]
    for seed in range(3):
        for m, opts in ((merged_model, [merged]), (apart_model, apart)):
            gen = torch.Generator().manual_seed(seed)
            idx = torch.randint(0, 61, (2, 16), generator=gen)
            m(idx[:, :-1], idx[:, 1:]).backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()
    for a, b in zip(merged_model.parameters(), apart_model.parameters()):
        assert torch.equal(a, b)


def _families(m: GPT) -> dict[str, list[torch.Tensor]]:
    """Four families in order: embed, head, the blocks' matrices, the norms."""
    norms = [p for n, p in m.named_parameters() if "norm" in n]
    blocks = [p for n, p in m.named_parameters() if n.startswith("blocks.") and "norm" not in n]
    return {"embed": [m.embed.weight], "head": [m.head.weight], "blocks": blocks, "norm": norms}
