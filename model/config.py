"""Model configuration: the schema behind conf/model/*.yaml, also used by the model itself."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelConfig:
    name: str = "gpt_tiny"
    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    # Grouped-query attention: n_heads must be a multiple of n_kv_heads.
    n_kv_heads: int = 2
    # Hidden width of the SwiGLU MLP (the gate and up projections each have this many rows).
    ffn_hidden: int = 192
    # Longest sequence the RoPE tables are built for; trainer.seq_len must not exceed it.
    max_seq_len: int = 512
    rope_theta: float = 10000.0
    qk_norm: bool = False
    norm_eps: float = 1e-5
    # Std of the normal init of every matrix; output projections (wo, w_down) are further
    # scaled by 1/sqrt(2 * n_layers) so the residual stream does not grow with depth.
    init_std: float = 0.02
    # Set at run time from the tokenizer; a preset never needs to name it.
    vocab_size: int = 0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads
