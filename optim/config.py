"""Optimizer configuration: the schema behind conf/optim/*.yaml.

optim=muon and optim=adamw share every default here (lr, weight decay, schedule), so a
comparison between them changes exactly one thing: which optimizer steps the hidden matrices.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional


@dataclass
class MuonConfig:
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    # "classic": the quintic (3.4445, -4.7750, 2.0315) every step;
    # "polar_express": per-step coefficients (Amsel et al., 2025).
    coefficients: str = "classic"
    # Newton-Schulz compute dtype: "bf16" (as in practice on GPUs), "fp32", or "auto": bf16 where
    # the device has bf16 matrix hardware (CUDA compute capability 8.0+; CPUs with AMX bf16), else fp32.
    ns_dtype: str = "auto"
    # "match_rms_adamw": lr * 0.2 * sqrt(max(A, B)), so Muon shares AdamW's lr and wd;
    # "spectral": lr * sqrt(max(1, A / B)); "none": lr as is.
    adjust_lr: str = "match_rms_adamw"
    # Orthogonalise wq / wk / wv one attention head at a time instead of whole.
    split_heads: bool = False
    # How TP-sharded matrices reach Newton-Schulz whole: "gather" all-gathers the momentum
    # shards and orthogonalises the full matrix on every TP rank; "gram" iterates on the
    # shards and all-reduces the small Gram matrix each step (see optim/muon/newton_schulz.py).
    tp_mode: str = "gather"
    eps: float = 1e-7
    # "standard", or "gram": Gram Newton-Schulz (iterates on the small Gram matrix, with a
    # restart after the second step) for matrices whose aspect ratio makes it cheaper, above
    # about 1.5; square ones stay standard. Under tp_mode=gram it also all-reduces the Gram
    # matrix once per restart segment instead of every step. See optim/muon/newton_schulz.py.
    # "auto": Gram or standard per matrix shape, whichever measured faster on this device at
    # start-up (optim/muon/ns_choice.py); the choice is written into ns_by_shape.
    ns_method: str = "standard"
    # With ns_method=auto: {"ROWSxCOLS": "gram" or "standard"} per matrix shape Muon
    # orthogonalises (TP shards iterated as shards under tp_mode=gram: "ROWSxCOLS_shard_rows"
    # or "_shard_cols"). Start-up measures the shapes missing here, and the resolved config
    # records them all; a resumed run keeps its checkpoint's. Empty otherwise.
    ns_by_shape: Dict[str, str] = field(default_factory=dict)
    # On CUDA, replay each stack's Newton-Schulz as a CUDA graph recorded at the second step
    # (one launch instead of ~20 per stack; optim/muon/ns_graphs.py). Costs memory: each stack's
    # buffer is kept between steps (the sum of all stacks, not the largest one at a time), and
    # the graphs hold a memory pool for the iterations' scratch buffers (at least those of the
    # largest stack). Both are released at the end of each job, in a sweep too.
    cuda_graphs: bool = False
    # NorMuon (arXiv 2510.05491): divide each row (column, for wide matrices) of the
    # orthogonalised update by the root of its running mean square, then restore the update's
    # norm. See optim/muon/normuon.py.
    normuon: bool = False
    normuon_beta2: float = 0.95


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
    muon: MuonConfig = field(default_factory=MuonConfig)
    qk_clip: QKClipConfig = field(default_factory=QKClipConfig)

    def group_settings(self, kind: str) -> dict[str, float]:
        """What a parameter group of family `kind` takes from the config: its weight decay and
        its lr multiplier (OptimizerSet.set_lr applies it). The one rule every builder uses."""
        return {"weight_decay": self.weight_decay_overrides.get(kind, self.weight_decay),
                "lr_scale": self.lr_overrides.get(kind, 1.0)}
