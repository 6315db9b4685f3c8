"""Our GPT and MoE as Hugging Face `transformers` models: which architecture, config, weights.

Each model exports to the transformers architecture that computes exactly what it computes,
so the exported model needs no custom code:

- dense, no QK-norm: `LlamaForCausalLM` (pre-norm RMSNorm, split q/k/v, rotate-half RoPE,
  GQA, SwiGLU, untied head).
- dense with QK-norm: `Qwen3ForCausalLM`. Llama cannot express QK-norm; Qwen3 is Llama plus
  an RMSNorm over head_dim on every query and key head before RoPE, with the model's eps,
  which is our QK-norm exactly.
- MoE with sigmoid scores: `Glm4MoeForCausalLM` with n_group = topk_group = 1 (so its
  group-limited selection keeps every expert). Its router computes sigmoid scores in fp32,
  selects the top-k on score + e_score_correction_bias, gates with the unbiased scores
  normalised over the top-k (+1e-20) times routed_scaling_factor; shared experts are one
  SwiGLU of width moe_intermediate_size * n_shared_experts; the first first_k_dense_replace
  layers are dense; attention is plain GQA with optional QK-norm. That is model/moe.py.
  The near misses: DeepseekV3 routes the same but its attention is MLA (low-rank, normed
  K/V and a shared RoPE key), not GQA; Dots1 routes the same but always has QK-norm.
- MoE with softmax scores: no exact match exists, so export refuses (see `architecture`).

Weights are renamed (and the routed experts' gate and up matrices fused, transformers'
in-memory layout) into a transformers model built on the meta device, which `save_pretrained`
then writes as safetensors in the architecture's own on-disk layout.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import warnings
from pathlib import Path
from typing import Any, Mapping

import torch

from model.config import ModelConfig
from model.gpt import GPT


class ExportError(ValueError):
    """A model that no transformers architecture computes exactly, or inconsistent inputs."""


LLAMA, QWEN3, GLM4_MOE = "LlamaForCausalLM", "Qwen3ForCausalLM", "Glm4MoeForCausalLM"

SOFTMAX_REFUSAL = (
    "model.score_func=softmax cannot be exported: no transformers architecture routes like "
    "this model, which selects the top-k experts on softmax score + selection bias and gates "
    "with the softmax scores (not renormalised over the top-k) times routed_scaling. "
    "Glm4Moe, DeepseekV3 and Dots1 score with sigmoid; Ernie4_5_Moe has the selection bias "
    "but always renormalises the gates over the top-k and has no routed scaling; Qwen3Moe and "
    "Mixtral have no selection bias and no shared experts; Qwen2Moe gates its shared expert "
    "with a learned sigmoid. Train with model.score_func=sigmoid to export to Glm4Moe."
)


def architecture(cfg: ModelConfig) -> str:
    """The transformers class that computes exactly what `cfg`'s model does, or ExportError."""
    if cfg.n_experts == 0:
        return QWEN3 if cfg.qk_norm else LLAMA
    if cfg.score_func != "sigmoid":
        raise ExportError(SOFTMAX_REFUSAL)
    if cfg.n_experts < 2:
        # Glm4Moe scores its (single) expert group by its top-2 experts.
        raise ExportError(f"model.n_experts={cfg.n_experts}: Glm4Moe needs at least 2 routed experts")
    return GLM4_MOE


def model_config(values: Mapping[str, Any]) -> ModelConfig:
    """A ModelConfig from a checkpoint's saved `config["model"]` (unknown keys ignored)."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in values.items() if k in known})


def hf_config(cfg: ModelConfig, eos_token_id: int | None) -> Any:
    """The transformers config of `architecture(cfg)` with every field that changes the maths
    set explicitly (the architectures' defaults differ from ours, e.g. Glm4Moe's partial RoPE)."""
    import transformers

    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ffn_hidden,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": 1.0},
        attention_bias=False,
        tie_word_embeddings=False,
        initializer_range=cfg.init_std,
        # No BOS: our documents are only separated by EOS. No pad id in the model config
        # either, since transformers would make it the embedding's padding_idx (frozen row).
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=None,
    )
    arch = architecture(cfg)
    if arch == LLAMA:
        return transformers.LlamaConfig(**common, mlp_bias=False)
    if arch == QWEN3:
        return transformers.Qwen3Config(**common, use_sliding_window=False)
    return transformers.Glm4MoeConfig(
        **common,
        moe_intermediate_size=cfg.expert_hidden or cfg.ffn_hidden,
        num_experts_per_tok=cfg.top_k,
        n_routed_experts=cfg.n_experts,
        n_shared_experts=cfg.n_shared_experts,
        routed_scaling_factor=cfg.routed_scaling,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=cfg.n_dense_layers,
        norm_topk_prob=True,
        use_qk_norm=cfg.qk_norm,
        num_mtp_layers=0,
    )


# Our parameter name suffix inside block i -> transformers' inside model.layers.i.
BLOCK_RENAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "mlp.w_gate.weight": "mlp.gate_proj.weight",
    "mlp.w_up.weight": "mlp.up_proj.weight",
    "mlp.w_down.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.expert_bias": "mlp.gate.e_score_correction_bias",
    "mlp.experts.w_down": "mlp.experts.down_proj",
    "mlp.shared.w_gate.weight": "mlp.shared_experts.gate_proj.weight",
    "mlp.shared.w_up.weight": "mlp.shared_experts.up_proj.weight",
    "mlp.shared.w_down.weight": "mlp.shared_experts.down_proj.weight",
}
TOP_RENAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "final_norm.weight": "model.norm.weight",
    "head.weight": "lm_head.weight",
}


# Fused into one transformers tensor per layer (see hf_state_dict).
FUSED_EXPERTS = ("mlp.experts.w_gate", "mlp.experts.w_up")


def hf_state_dict(cfg: ModelConfig, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our full logical parameters and persistent buffers under transformers' names.

    Raises ExportError if any tensor of ours has no destination, so a model change that this
    mapping does not know about fails loudly instead of being dropped from the export.
    """
    out: dict[str, torch.Tensor] = {}
    unmapped = []
    for name, tensor in tensors.items():
        layer, _, suffix = name.removeprefix("blocks.").partition(".")
        if name in TOP_RENAMES:
            out[TOP_RENAMES[name]] = tensor
        elif name.startswith("blocks.") and suffix in BLOCK_RENAMES:
            out[f"model.layers.{layer}.{BLOCK_RENAMES[suffix]}"] = tensor
        elif not (name.startswith("blocks.") and suffix in FUSED_EXPERTS):
            unmapped.append(name)
    if unmapped:
        raise ExportError(f"no transformers name for: {', '.join(sorted(unmapped))}")
    # transformers holds each layer's routed experts as one [E, 2 * hidden, d] matrix, gate
    # rows first (its forward splits it with chunk(2)); ours keeps gate and up apart for Muon.
    for i in range(cfg.n_layers):
        gate, up = (tensors.get(f"blocks.{i}.{suffix}") for suffix in FUSED_EXPERTS)
        if gate is not None and up is not None:
            out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
    return out


def shared_expert_placeholders(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Glm4Moe always builds a shared expert; with n_shared_experts = 0 its width is 0 and its
    output exactly zero, which is our model without one. Its empty weights fill those keys."""
    if architecture(cfg) != GLM4_MOE or cfg.n_shared_experts:
        return {}
    d = cfg.d_model
    shapes = {"gate_proj": (0, d), "up_proj": (0, d), "down_proj": (d, 0)}
    return {
        f"model.layers.{i}.mlp.shared_experts.{proj}.weight": torch.zeros(shape)
        for i in range(cfg.n_dense_layers, cfg.n_layers)
        for proj, shape in shapes.items()
    }


def build_hf_model(
    cfg: ModelConfig, tensors: Mapping[str, torch.Tensor], eos_token_id: int | None, dtype: torch.dtype
) -> Any:
    """The transformers model holding our weights (cast to `dtype`; the expert selection bias
    stays fp32, as transformers keeps it), for `save_pretrained`. Built on the meta device, so
    no memory or time goes into a random init that would be overwritten; its weights are ours,
    assigned, but its non-persistent RoPE buffers stay on meta: save it, do not run it."""
    import transformers

    config = hf_config(cfg, eos_token_id)
    state = hf_state_dict(cfg, tensors) | shared_expert_placeholders(cfg)
    state = {k: v if k.endswith("e_score_correction_bias") else v.to(dtype) for k, v in state.items()}
    with torch.device("meta"), warnings.catch_warnings():
        # The empty shared-expert placeholders make torch warn that their init is a no-op.
        warnings.filterwarnings("ignore", message="Initializing zero-element tensors")
        model = getattr(transformers, architecture(cfg))(config)
    result = model.load_state_dict(state, strict=False, assign=True)
    if result.missing_keys or result.unexpected_keys:
        raise ExportError(
            f"weights do not fit {architecture(cfg)}: missing {result.missing_keys}, "
            f"unexpected {result.unexpected_keys}"
        )
    model.config.dtype = dtype
    model.generation_config.pad_token_id = eos_token_id  # batched generate() pads with EOS
    return model


def export(
    cfg: ModelConfig,
    tensors: Mapping[str, torch.Tensor],
    tokenizer: Any,
    out_dir: Path,
    dtype: torch.dtype = torch.float32,
) -> str:
    """Write `out_dir` (config, safetensors weights, generation config, tokenizer) for
    `AutoModelForCausalLM` / `AutoTokenizer.from_pretrained`; return the architecture name.

    `tensors`: every parameter and persistent buffer as full logical tensors, as a
    checkpoint stores them (`params | buffers`).
    """
    if len(tokenizer) != cfg.vocab_size:
        raise ExportError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary is {cfg.vocab_size}"
        )
    model = build_hf_model(cfg, tensors, tokenizer.eos_token_id, dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)  # safetensors, in the architecture's on-disk layout
    tokenizer = copy.deepcopy(tokenizer)  # so that setting its length leaves the caller's alone
    tokenizer.model_max_length = cfg.max_seq_len
    tokenizer.save_pretrained(out_dir)
    usual_permissions(out_dir)
    return architecture(cfg)


def usual_permissions(out_dir: Path) -> None:
    """Give the export's files the mode a plain `open` gives (0644 under the usual umask):
    the weights are written through a private temp file (0600), which other users, or a serving
    container running as another user, could not read."""
    umask = os.umask(0)
    os.umask(umask)
    for path in out_dir.rglob("*"):
        if path.is_file():
            path.chmod(0o666 & ~umask)


def gpt_from_tensors(cfg: ModelConfig, tensors: Mapping[str, torch.Tensor]) -> GPT:
    """Our single-device model holding `tensors` (parameters and persistent buffers)."""
    model = GPT(cfg)
    model.load_state_dict(dict(tensors), strict=True)
    return model
