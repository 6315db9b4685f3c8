"""Model FLOPs per token (eval/flops.py) against hand counts and torch's own FLOP counter."""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from eval.flops import forward_flops_breakdown, measure_matmul_peak, train_flops_per_token
from model.config import ModelConfig
from model.gpt import GPT
from tests.conftest import compose
from trainer.config import ConfigError, to_dataclass, validate

VOCAB, SEQ = 100, 8
# gpt_tiny's shape: 2 layers, d_model 64, 4 heads of 16, 2 KV heads, SwiGLU hidden 192.
DENSE = ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=192, vocab_size=VOCAB)
# moe_tiny's shape: the same trunk, layer 0 dense, layer 1 with 4 experts of hidden 64,
# top-2, one shared expert.
MOE = ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=192, vocab_size=VOCAB,
                  n_experts=4, top_k=2, n_shared_experts=1, expert_hidden=64, n_dense_layers=1)


def test_dense_tiny_by_hand():
    # Weights per layer: wq 64x64 + wk 64x32 + wv 64x32 + wo 64x64 = 12,288;
    # MLP 3 x 64x192 = 36,864. Two layers 98,304, head 64x100 = 6,400: N = 104,704.
    # Causal scores + values per layer: 2 * 4 heads * 16 * (8 + 1) = 1,152; two layers 2,304.
    forward = 2 * 104_704 + 2_304
    assert forward == 211_712
    assert train_flops_per_token(DENSE, SEQ) == 3 * forward == 635_136
    parts = forward_flops_breakdown(DENSE, SEQ)
    assert parts["attn_proj"] == 2 * 2 * 12_288
    assert parts["mlp"] == 2 * 2 * 36_864
    assert parts["head"] == 2 * 6_400
    assert parts["router"] == parts["experts"] == parts["shared_experts"] == 0


def test_moe_tiny_counts_only_active_experts():
    # Layer 0 (dense): 12,288 + 36,864 = 49,152 weights.
    # Layer 1: attention 12,288, router 64x4 = 256, top-2 routed experts 2 x 3 x 64x64 = 24,576
    # (the other 2 experts' 24,576 weights are idle for this token), shared 3 x 64x64 = 12,288:
    # 49,408. Head 6,400. N_active = 104,960; attention as in the dense model, 2,304.
    forward = 2 * 104_960 + 2_304
    assert train_flops_per_token(MOE, SEQ) == 3 * forward == 636_672
    parts = forward_flops_breakdown(MOE, SEQ)
    assert (parts["router"], parts["experts"], parts["shared_experts"]) == (512, 49_152, 24_576)
    assert parts["mlp"] == 2 * 36_864  # the dense first layer only


def test_attention_term_is_causal_and_grows_with_seq_len():
    a, b = forward_flops_breakdown(DENSE, 127)["attn_scores"], forward_flops_breakdown(DENSE, 255)["attn_scores"]
    assert b - a == 2 * 2 * 64 * 128  # L * 2 * n_heads * head_dim per extra position
    # Half the full T x T square (12 * L * d * T for training), plus the diagonal.
    assert 3 * a == 6 * 2 * 64 * 128


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_projection_flops_match_torch_flop_counter(cfg):
    """torch's counter sees every nn.Linear / F.linear of a real forward + backward (not the
    fused attention or the grouped expert matmul): they must be 3x our forward count."""
    torch.manual_seed(0)
    model = GPT(cfg)
    batch = 2
    idx = torch.randint(0, VOCAB, (batch, SEQ))
    with FlopCounterMode(display=False) as counter:
        model(idx, idx).backward()
    parts = forward_flops_breakdown(cfg, SEQ)
    linear_parts = sum(v for k, v in parts.items() if k not in ("attn_scores", "experts"))
    assert counter.get_total_flops() == 3 * batch * SEQ * linear_parts


def test_vocab_must_be_known():
    with pytest.raises(ValueError, match="vocab_size"):
        train_flops_per_token(ModelConfig(), SEQ)


def test_measured_peak_is_a_positive_rate():
    peak = measure_matmul_peak(torch.device("cpu"), "fp32", seconds=0.05, size=128)
    assert math.isfinite(peak) and peak > 1e6  # any CPU does well over a MFLOP/s


def test_peak_tflops_must_not_be_negative():
    cfg = to_dataclass(compose(["trainer.peak_tflops=-1"]))
    with pytest.raises(ConfigError, match="trainer.peak_tflops"):
        validate(cfg)
    validate(to_dataclass(compose(["trainer.peak_tflops=312"])))


def test_benchmarks_refuse_an_mfu_above_100_percent_and_size_the_gpu_peak_matmul():
    from lab.tools.bench.bench_common import peak_size, percent_of_peak

    assert percent_of_peak(37.8, 100.0) == "37.8%"
    assert percent_of_peak(100.0, 100.0) == "100.0%"
    # An H100 read 3.46x a peak measured on a 1024^2 matmul: a wrong peak, not a figure.
    assert percent_of_peak(346.0, 100.0) == "n/a (>100%)"
    assert peak_size(torch.device("cuda")) == 8192
    assert peak_size(torch.device("cpu")) == 1024 and peak_size(torch.device("cpu"), on_cpu=2048) == 2048
