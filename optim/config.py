"""Optimizer configuration: the schema behind conf/optim/*.yaml.

optim=muon and optim=adamw share every default here (lr, weight decay, schedule), so a
comparison between them changes exactly one thing: which optimizer steps the hidden matrices.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

from optim.muon.options import MuonOptions


@dataclass
class QKClipConfig:
    # QK-clip (Kimi K2's MuonClip): after each optimizer step, a head whose largest
    # pre-softmax logit over the step's forward passes exceeded `tau` has its W_q (and W_k)
    # rows scaled so that logit becomes tau (see optim/qk_clip.py). Any optimizer; off by default.
    enabled: bool = False
    tau: float = 100.0


@dataclass
class OptimConfig:
    # "muon": Muon on hidden matrices + AdamW on the rest; "adamw": AdamW on everything.
    name: str = "adamw"
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup_steps: int = 20
    # Warmup as a fraction of trainer.max_steps: floor(fraction * max_steps + 0.5) steps, so a
    # longer run warms up for as many more steps. Set, it wins over warmup_steps; null: warmup_steps.
    warmup_fraction: Optional[float] = None
    # Floor of the decay phase (absolute learning rate).
    min_lr: float = 3e-4
    # The decay floor as a fraction of the peak lr: min_lr_ratio * lr, so it follows an lr sweep.
    # Set, it wins over min_lr; null: min_lr. optim/schedule.py resolves both keys.
    min_lr_ratio: Optional[float] = None
    # "cosine": linear warmup then cosine to the floor; "wsd": warmup, constant, then a linear
    # decay to the floor over the last `wsd_decay_fraction` of the run; "constant".
    schedule: str = "cosine"
    wsd_decay_fraction: float = 0.2
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    # Clip the global gradient norm to this value; 0 disables clipping.
    grad_clip: float = 1.0
    # Weight decay per parameter family (attn_q, mlp_in, embed, norm, ...); families not
    # listed use `weight_decay`. Moonlight decays RMSNorm gammas too, so norms are not exempt.
    weight_decay_overrides: Dict[str, float] = field(default_factory=dict)
    # Learning-rate multiplier per parameter family (embed, head, norm, router, attn_o, mlp_out,
    # ...) on the schedule's lr; families not listed take 1x. Under optim=muon the AdamW side
    # (embed, head, norm, router) shares Muon's lr by default (Moonlight's update-RMS matching);
    # this is the knob that gives it an lr of its own, as modded-nanogpt and nanochat do.
    lr_overrides: Dict[str, float] = field(default_factory=dict)
    # Cautious weight decay (arXiv 2510.12402), for Muon and AdamW parameters alike: decay a
    # coordinate only where the optimizer's update and the weight have the same sign.
    cautious_wd: bool = False
    # ZeRO-1 (data parallel > 1): split the parameter all-gather after the step into this many
    # buckets, each launched asynchronously as soon as its matrices are updated, so the
    # transfer overlaps the Newton-Schulz of later buckets. 1: one all-gather after the whole
    # step. See lab/BENCHMARKS.md for the side-by-side measurement behind the default.
    gather_buckets: int = 1
    muon: MuonOptions = field(default_factory=MuonOptions)
    qk_clip: QKClipConfig = field(default_factory=QKClipConfig)

    def group_settings(self, kind: str) -> dict[str, float]:
        """What a parameter group of family `kind` takes from the config: its weight decay and
        its lr multiplier (OptimizerSet.set_lr applies it)."""
        return {"weight_decay": self.weight_decay_overrides.get(kind, self.weight_decay),
                "lr_scale": self.lr_overrides.get(kind, 1.0)}

    def param_groups(self, by_kind: dict[str, list], muon: bool, head_dim: int) -> list[dict]:
        """One param group per parameter family, for either optimizer: the builders' one rule
        (optim/builder.py, optim/zero.py, optim/sharded.py add where their parameters live).
        A Muon group also gets its head split (optim.muon.split_heads)."""
        from optim.routing import muon_split_rows

        groups = []
        for kind, params in by_kind.items():
            group = {"params": list(params), "kind": kind, **self.group_settings(kind)}
            if muon:
                group["split_rows"] = muon_split_rows(kind, self.muon.split_heads, head_dim)
            groups.append(group)
        return groups
