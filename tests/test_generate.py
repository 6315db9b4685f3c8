"""Generation: our KV cache reproduces full recomputation, and greedy decoding agrees with the
exported transformers model's own generate()."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from model.config import ModelConfig
from model.hf_export import export
from scripts.generate import cache_argument, generate, gpt_step, hf_step, next_token
from tests.test_export import preset, random_model, tokenizer  # noqa: F401  (tokenizer is a fixture)
from tests.closeness import check

VOCAB = 97

# Our calls into transformers must use the arguments it documents now: a deprecated one
# (`past_key_values`, which warns it goes in 5.40) fails here before it fails users.
pytestmark = pytest.mark.filterwarnings("error::FutureWarning")


def tiny(**overrides) -> ModelConfig:
    base = dict(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=64, vocab_size=VOCAB)
    return ModelConfig(**(base | overrides))


@pytest.mark.parametrize("overrides", [
    {},  # GQA
    {"n_kv_heads": 4, "qk_norm": True},
    {"n_experts": 4, "top_k": 2, "n_shared_experts": 1, "n_dense_layers": 1},
])
def test_cached_decoding_equals_full_recompute(overrides):
    model = random_model(tiny(**overrides))
    idx = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache()
    with torch.no_grad():
        full = model(idx)
        # a prompt, then a multi-token chunk after cached positions (the offset causal mask),
        # then one token at a time
        chunks = [model(idx[:, :9], cache=cache), model(idx[:, 9:16], cache=cache)]
        chunks += [model(idx[:, i : i + 1], cache=cache) for i in range(16, 30)]
    assert cache.length == 30
    diff = (torch.cat(chunks, dim=1) - full).abs().max().item()
    check("difference", diff, 1e-5)


def test_positions_past_the_cache_or_rope_tables_are_refused():
    model = random_model(tiny(max_seq_len=16)).eval()
    with torch.no_grad():
        cache = model.new_cache(8)
        model(torch.zeros(1, 8, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="KV cache holds 8 positions"):
            model(torch.zeros(1, 1, dtype=torch.long), cache=cache)
        cache = model.new_cache()
        model(torch.zeros(1, 10, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="17 positions exceed model.max_seq_len=16"):
            model(torch.zeros(1, 7, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="17 positions exceed model.max_seq_len=16"):
            model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("name", ["gpt_tiny", "moe_tiny"])
def test_greedy_generation_cache_no_cache_and_transformers_agree(tmp_path, tokenizer, name):  # noqa: F811
    model = random_model(preset(name, len(tokenizer)))
    export(model.cfg, model.state_dict(), tokenizer, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    prompt = torch.randint(0, len(tokenizer), (2, 5), generator=torch.Generator().manual_seed(3))
    n = 24
    cached = generate(gpt_step(model), prompt, n)
    recomputed = generate(gpt_step(model, use_cache=False), prompt, n)
    theirs_loop = generate(hf_step(hf), prompt, n)
    with torch.no_grad():
        theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                             do_sample=False, eos_token_id=None)
    assert cached.shape == (2, 5 + n)
    assert torch.equal(cached, recomputed)
    assert torch.equal(cached, theirs_loop)
    assert torch.equal(cached, theirs)
    assert len(set(cached[:, 5:].flatten().tolist())) > 3  # not one token repeated


def test_the_kv_cache_goes_by_the_name_the_models_forward_takes(tmp_path, tokenizer):  # noqa: F811
    class EarlierRelease(torch.nn.Module):  # transformers 5 before the rename
        def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs):
            raise NotImplementedError

    assert cache_argument(EarlierRelease()) == "past_key_values"
    model = random_model(preset("gpt_tiny", len(tokenizer)))
    export(model.cfg, model.state_dict(), tokenizer, tmp_path)
    assert cache_argument(AutoModelForCausalLM.from_pretrained(tmp_path)) == "cache"  # this release


def test_sampling_is_seeded_and_cache_independent():
    model = random_model(tiny())
    prompt = torch.randint(0, VOCAB, (3, 4), generator=torch.Generator().manual_seed(0))
    a = generate(gpt_step(model), prompt, 20, temperature=0.8, top_k=10, seed=5)
    b = generate(gpt_step(model, use_cache=False), prompt, 20, temperature=0.8, top_k=10, seed=5)
    c = generate(gpt_step(model), prompt, 20, temperature=0.8, top_k=10, seed=6)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(generate(gpt_step(model), prompt, 20, temperature=1.0, top_k=1),
                       generate(gpt_step(model), prompt, 20))  # top-1 sampling is greedy


def test_top_k_sampling_only_draws_the_k_likeliest_tokens():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    allowed = logits.topk(5, dim=-1).indices
    gen = torch.Generator().manual_seed(0)
    draws = torch.cat([next_token(logits, 2.0, 5, gen) for _ in range(200)], dim=1)
    for row in range(4):
        assert set(draws[row].tolist()) == set(allowed[row].tolist())  # all 5, and only those
    assert torch.equal(next_token(logits, 0.0, 0, gen)[:, 0], logits.argmax(-1))


def test_generation_stops_once_every_row_emitted_eos():
    model = random_model(tiny())
    prompt = torch.randint(0, VOCAB, (1, 4), generator=torch.Generator().manual_seed(0))
    greedy = generate(gpt_step(model), prompt, 20)
    eos = greedy[0, 6].item()  # pretend the third generated token is EOS
    stopped = generate(gpt_step(model), prompt, 20, eos_id=eos)
    first = greedy[0, 4:].tolist().index(eos)
    assert torch.equal(stopped, greedy[:, : 4 + first + 1])


@pytest.mark.parametrize("flag, value, line", [
    ("--max-new-tokens", "-5", "error: --max-new-tokens must be >= 1, got -5"),
    ("--num-samples", "0", "error: --num-samples must be >= 1, got 0"),
    ("--temperature", "-1", "error: --temperature must be >= 0, got -1.0"),
])
def test_bad_generation_options_are_one_line_before_the_checkpoint_is_read(tmp_path, capsys, flag, value, line):
    from scripts.generate import main

    assert main([str(tmp_path / "no_such_run"), flag, value]) == 2
    assert capsys.readouterr().err.splitlines() == [line]
