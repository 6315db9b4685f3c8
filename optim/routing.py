"""Which optimizer steps which parameter, and the family ("kind") each parameter belongs to.

Kinds name the metric families (optim/update_rms/<kind>, model/weight_rms/<kind>) and the
per-family weight-decay overrides. Muon takes every hidden matrix, each of wq, wk and wv on
its own; AdamW takes the embedding, the LM head, norm gammas and the router, whose
geometry (lookup tables, vectors, a classifier over tokens) is not what Muon's
orthogonalised update is for.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

# Ordered: the first rule whose pattern matches the parameter name decides.
ROUTING_RULES: tuple[tuple[str, str], ...] = (
    (r"(^|\.)embed\.weight$", "embed"),
    (r"(^|\.)head\.weight$", "head"),
    (r"norm\.weight$", "norm"),
    (r"\.bias$", "bias"),
    (r"\.attn\.wq\.weight$", "attn_q"),
    (r"\.attn\.wk\.weight$", "attn_k"),
    (r"\.attn\.wv\.weight$", "attn_v"),
    (r"\.attn\.wo\.weight$", "attn_o"),
    (r"\.mlp\.(shared\.)?(w_gate|w_up)\.weight$", "mlp_in"),
    (r"\.mlp\.(shared\.)?w_down\.weight$", "mlp_out"),
    (r"\.router\.", "router"),
    (r"\.experts\.", "experts"),
)

MUON_KINDS = frozenset({"attn_q", "attn_k", "attn_v", "attn_o", "mlp_in", "mlp_out", "experts"})
# Kinds whose rows are attention heads, for optim.muon.split_heads.
HEAD_KINDS = frozenset({"attn_q", "attn_k", "attn_v"})


def muon_split_rows(kind: str, split_heads: bool, head_dim: int) -> int | None:
    """The `split_rows` of a Muon group of `kind` (optim/muon/optimizer.py): one matrix per attention
    head under optim.muon.split_heads for the kinds whose rows are heads, else None (whole
    matrices). The one rule the optimizer builders and the shape count share."""
    return head_dim if split_heads and kind in HEAD_KINDS else None


def kind_of(name: str) -> str:
    for pattern, kind in ROUTING_RULES:
        if re.search(pattern, name):
            return kind
    raise ValueError(
        f"parameter {name!r} matches no routing rule in optim/routing.py; "
        "add a rule so it is assigned to Muon or AdamW"
    )


@dataclass(frozen=True)
class Route:
    name: str
    kind: str
    optimizer: str  # "muon" or "adamw"


def route_parameters(model: torch.nn.Module, optimizer_name: str) -> list[Route]:
    """The routing table for `model` under optim=<optimizer_name>, in parameter order."""
    routes = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        kind = kind_of(name)
        use_muon = optimizer_name == "muon" and kind in MUON_KINDS and param.ndim in (2, 3)
        routes.append(Route(name, kind, "muon" if use_muon else "adamw"))
    return routes

def routing_census(model: torch.nn.Module, optimizer_name: str) -> dict[str, dict[str, dict[str, int]]]:
    """{optimizer: {kind: {"tensors": n, "params": elements}}}: what each optimizer steps, as a
    run records it (environment.json), so that a comparison can show which optimizer owned
    which parameters in the runs themselves. A DTensor counts its whole (global) size."""
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    census: dict[str, dict[str, dict[str, int]]] = {}
    for route in route_parameters(model, optimizer_name):
        entry = census.setdefault(route.optimizer, {}).setdefault(route.kind, {"tensors": 0, "params": 0})
        entry["tensors"] += 1
        entry["params"] += int(sizes[route.name])
    return {opt: dict(sorted(kinds.items())) for opt, kinds in sorted(census.items())}


ALL_KINDS = frozenset(kind for _, kind in ROUTING_RULES)
