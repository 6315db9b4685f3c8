"""Model configuration: the schema behind conf/model/*.yaml, also used by the model itself."""
from __future__ import annotations

from dataclasses import dataclass

# trainer.activation_checkpointing's values (model/activation_checkpoint.py applies them).
CHECKPOINTING_MODES = ("none", "full", "selective")


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
    # Compute the LM head and its cross-entropy this many slices of tokens at a time, forward
    # and backward, so the [tokens, vocab] logits are never whole (model/chunked_loss.py);
    # 1 computes them at once.
    loss_chunks: int = 1
    # Set at run time from the tokenizer; a preset never needs to name it.
    vocab_size: int = 0
    # Mixture of experts (model/moe.py); n_experts = 0 is a dense model.
    n_experts: int = 0
    top_k: int = 2
    n_shared_experts: int = 0
    # Hidden width of each routed (and each shared) expert; 0 means ffn_hidden.
    expert_hidden: int = 0
    # The first n_dense_layers blocks keep a dense SwiGLU MLP.
    n_dense_layers: int = 0
    score_func: str = "sigmoid"  # "sigmoid" (DeepSeek-V3) or "softmax"
    routed_scaling: float = 1.0
    # Auxiliary-loss-free balancing: bias_e += rate * sign(mean load - load_e) per step.
    bias_update_rate: float = 1e-3
    # Optional classic load-balancing loss, added to the training loss times this weight.
    aux_loss_coef: float = 0.0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads
