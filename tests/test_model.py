"""Model properties: causality, RoPE's relative-position property, GQA == MHA, metrics."""
from __future__ import annotations

import torch

from model.config import ModelConfig
from model.gpt import GPT, apply_rope, rope_tables
from tests.closeness import assert_close, check


def tiny(**overrides) -> ModelConfig:
    base = dict(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=64, vocab_size=97)
    base.update(overrides)
    return ModelConfig(**base)


def test_changing_a_future_token_leaves_past_logits_unchanged():
    torch.manual_seed(0)
    model = GPT(tiny()).eval()
    idx = torch.randint(0, 97, (2, 16))
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 97
    with torch.no_grad():
        a, b = model(idx), model(changed)
    assert_close(a[:, :10], b[:, :10], rtol=0, atol=0)
    assert (a[:, 10:] - b[:, 10:]).abs().max() > 1e-4  # the change is visible from there on


def test_rope_scores_depend_only_on_relative_position():
    torch.manual_seed(0)
    head_dim, max_len = 16, 64
    cos, sin = rope_tables(head_dim, max_len, 10000.0)
    q = torch.randn(head_dim)
    k = torch.randn(head_dim)

    def score(pos_q: int, pos_k: int) -> torch.Tensor:
        rq = apply_rope(q.view(1, 1, 1, -1), cos[pos_q : pos_q + 1], sin[pos_q : pos_q + 1])
        rk = apply_rope(k.view(1, 1, 1, -1), cos[pos_k : pos_k + 1], sin[pos_k : pos_k + 1])
        return (rq * rk).sum()

    reference = score(7, 3)
    for shift in (1, 10, 40):
        assert_close(score(7 + shift, 3 + shift), reference, rtol=1e-5, atol=1e-5)
    # and it is not position-blind: a different offset gives a different score
    assert (score(9, 3) - reference).abs() > 1e-3
    # rotation preserves norms
    rq = apply_rope(q.view(1, 1, 1, -1), cos[5:6], sin[5:6])
    assert_close(rq.norm(), q.norm())


def test_gqa_equals_mha_with_repeated_kv_heads():
    torch.manual_seed(0)
    gqa = GPT(tiny(n_heads=4, n_kv_heads=2)).eval()
    mha = GPT(tiny(n_heads=4, n_kv_heads=4)).eval()
    state = gqa.state_dict()
    head_dim = 32 // 4
    for key, value in state.items():
        if key.endswith(("attn.wk.weight", "attn.wv.weight")):
            # kv head j serves query heads 2j and 2j+1: repeat each head's rows twice.
            heads = value.view(2, head_dim, 32)
            state[key] = heads.repeat_interleave(2, dim=0).reshape(4 * head_dim, 32)
    mha.load_state_dict(state)
    idx = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        assert_close(gqa(idx), mha(idx), rtol=1e-5, atol=1e-5)


def test_loss_is_mean_cross_entropy_of_logits():
    torch.manual_seed(0)
    model = GPT(tiny()).eval()
    idx = torch.randint(0, 97, (2, 12))
    tgt = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        logits = model(idx)
        expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt.flatten())
        assert_close(model(idx, tgt), expected)


def test_output_rms_matches_direct_computation():
    torch.manual_seed(0)
    model = GPT(tiny(qk_norm=True)).eval()
    idx = torch.randint(0, 97, (3, 10))
    outputs = []
    hooks = [b.register_forward_hook(lambda m, i, o: outputs.append(o)) for b in model.blocks]
    hooks.append(model.final_norm.register_forward_hook(lambda m, i, o: outputs.append(o)))
    model.track_output_rms = True
    with torch.no_grad():
        model(idx)
    for h in hooks:
        h.remove()
    rms = model.pop_output_rms(n_tokens=3 * 10)
    expected = torch.stack([o.pow(2).mean().sqrt() for o in outputs])
    assert_close(rms, expected, rtol=1e-5, atol=1e-6)
    assert model.output_sq_sum.abs().sum() == 0  # reset after reading
    assert abs(rms[-1].item() - 1.0) < 0.05  # RMSNorm output with unit gamma has RMS ~1


def test_max_logit_matches_explicit_attention_scores():
    torch.manual_seed(0)
    cfg = tiny(n_layers=1)
    model = GPT(cfg).eval()
    idx = torch.randint(0, 97, (2, 9))
    found: list[torch.Tensor] = []
    with torch.no_grad():
        model(idx, max_logit_out=found)
        attn = model.blocks[0].attn
        x = model.blocks[0].attn_norm(model.embed(idx))
        q = attn.wq(x).view(2, 9, 4, 8).transpose(1, 2)
        k = attn.wk(x).view(2, 9, 2, 8).transpose(1, 2)
        cos, sin = model.rope_cos[:9], model.rope_sin[:9]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        best = -float("inf")
        for h in range(4):
            scores = q[:, h] @ k[:, h // 2].transpose(-1, -2) / 8**0.5
            for i in range(9):
                best = max(best, scores[:, i, : i + 1].max().item())
    assert len(found) == 1
    check("max logit", abs(found[0].item() - best), 1e-5)


def test_residual_projections_use_depth_scaled_init():
    torch.manual_seed(0)
    model = GPT(tiny(n_layers=8, d_model=256, ffn_hidden=512, init_std=0.02))
    wo = model.blocks[0].attn.wo.weight
    wq = model.blocks[0].attn.wq.weight
    assert abs(wq.std().item() - 0.02) < 0.002
    assert abs(wo.std().item() - 0.02 / 4) < 0.0005
    assert torch.all(model.final_norm.weight == 1)
