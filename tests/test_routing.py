"""The routing table: which optimizer and which family each parameter of gpt_tiny gets."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from model.gpt import GPT
from optim.routing import kind_of, route_parameters
from tests.conftest import compose
from trainer.config import to_dataclass


def tiny_model() -> GPT:
    cfg = to_dataclass(compose(["model=gpt_tiny"]))
    return GPT(replace(cfg.model, vocab_size=256))


def test_gpt_tiny_routing_table_is_exactly_as_specified():
    table = {r.name: (r.kind, r.optimizer) for r in route_parameters(tiny_model(), "muon")}
    expected = {"embed.weight": ("embed", "adamw"), "head.weight": ("head", "adamw"),
                "final_norm.weight": ("norm", "adamw")}
    for i in range(2):
        p = f"blocks.{i}."
        expected.update({
            p + "attn_norm.weight": ("norm", "adamw"),
            p + "mlp_norm.weight": ("norm", "adamw"),
            p + "attn.wq.weight": ("attn_q", "muon"),
            p + "attn.wk.weight": ("attn_k", "muon"),
            p + "attn.wv.weight": ("attn_v", "muon"),
            p + "attn.wo.weight": ("attn_o", "muon"),
            p + "mlp.w_gate.weight": ("mlp_in", "muon"),
            p + "mlp.w_up.weight": ("mlp_in", "muon"),
            p + "mlp.w_down.weight": ("mlp_out", "muon"),
        })
    assert table == expected


def test_adamw_run_routes_everything_to_adamw():
    routes = route_parameters(tiny_model(), "adamw")
    assert {r.optimizer for r in routes} == {"adamw"}
    assert len(routes) == len(list(tiny_model().parameters()))


def test_qk_norm_gammas_are_norms():
    assert kind_of("blocks.0.attn.q_norm.weight") == "norm"
    assert kind_of("blocks.3.attn.k_norm.weight") == "norm"


def test_parameter_matching_no_rule_is_an_error_naming_it():
    model = tiny_model()
    model.blocks[0].extra = torch.nn.Linear(4, 4, bias=False)
    with pytest.raises(ValueError, match="blocks.0.extra.weight"):
        route_parameters(model, "muon")
