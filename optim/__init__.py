"""Optimizers: Muon (optim.muon) built on the pure functions of optim.newton_schulz."""
from optim.muon import Muon
from optim.newton_schulz import (
    COEFFICIENTS,
    coefficients_for,
    momentum_update,
    muon_scale,
    newton_schulz,
)

__all__ = [
    "COEFFICIENTS",
    "Muon",
    "coefficients_for",
    "momentum_update",
    "muon_scale",
    "newton_schulz",
]
