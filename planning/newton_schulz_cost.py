"""What a Muon step costs in Newton-Schulz FLOPs, for the benchmarks' and planners' tables: a
step's matrices as Muon orthogonalises them (optim.builder.muon_ns_shapes), each with the
iteration its method picks (optim/muon/ns_method.py's multiply-add counts)."""
from __future__ import annotations

import torch

from optim.builder import muon_ns_shapes
from optim.config import OptimConfig
from optim.muon.options import MuonOptions
from optim.muon.ns_method import gram_macs, standard_macs, use_gram
from parallel.mesh import Mesh


def newton_schulz_flops(model: torch.nn.Module, muon: MuonOptions, mesh: Mesh = Mesh()) -> int:
    """Newton-Schulz FLOPs of one Muon step on `model` (a GPT: its `cfg` gives the head size)
    by optim/muon/newton_schulz.py's multiply-add counts: the matrices and shapes Muon hands to
    Newton-Schulz (optim.builder.muon_ns_shapes: experts, heads under split_heads, TP shards
    gathered whole or iterated as shards, as `mesh` lays them out), each with the iteration the
    configured method picks for its shape (use_gram; under ns_method=auto, ns_by_shape must
    hold the start-up choice, as a Trainer's resolved config does). The elementwise work is
    left out, as in model FLOPs. Fixed per optimizer step, whatever the number of tokens the
    step trains on."""
    counts = muon_ns_shapes(model, OptimConfig(name="muon", muon=muon), model.cfg, mesh)
    total = 0
    for shape, count in counts.items():
        n, m = shape.gram_sides()
        gram = use_gram(muon.ns_method, shape, muon.ns_steps, muon.ns_by_shape)
        total += 2 * count * (gram_macs if gram else standard_macs)(n, m, muon.ns_steps)
    return total
