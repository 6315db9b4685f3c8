"""QK-clip: the per-head maximum it records, the factors it applies, and its parallel runs."""
from __future__ import annotations

import math

import pytest
import torch

from model.attention_logits import explicit_attention_with_head_max
from model.gpt import GPT, apply_rope
from optim.qk_clip import QKClip
from tests.distributed import run_distributed
from tests.test_model import tiny
from tests.test_parallel_training import _train_worker, losses, read_metrics, train_in_process
from tests.closeness import approx, assert_close, check_relative


def hand_head_max(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """[layer, head] largest causal logit, written out position by position."""
    seq = idx.shape[1]
    cos, sin = model.rope_cos[:seq], model.rope_sin[:seq]
    out = []
    inputs: list[torch.Tensor] = []
    hooks = [b.attn.register_forward_pre_hook(lambda m, args: inputs.append(args[0])) for b in model.blocks]
    with torch.no_grad():
        model(idx)
        for block, x in zip(model.blocks, inputs):
            attn = block.attn
            q = attn.wq(x).view(*idx.shape, attn.n_heads, attn.head_dim).transpose(1, 2)
            k = attn.wk(x).view(*idx.shape, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            group = attn.n_heads // attn.n_kv_heads
            row = []
            for h in range(attn.n_heads):
                scores = q[:, h] @ k[:, h // group].transpose(-1, -2) / math.sqrt(attn.head_dim)
                row.append(max(scores[:, i, : i + 1].max().item() for i in range(seq)))
            out.append(row)
    for hook in hooks:
        hook.remove()
    return torch.tensor(out)


def clip_one_step(n_kv_heads: int):
    """A model whose layer 0, head 1 has logits far above every other head's; one clipped step."""
    torch.manual_seed(0)
    model = GPT(tiny(n_kv_heads=n_kv_heads))
    head_dim = model.cfg.head_dim
    with torch.no_grad():
        model.blocks[0].attn.wq.weight[head_dim : 2 * head_dim] *= 40.0
    idx = torch.randint(0, 97, (2, 12))
    before = hand_head_max(model, idx)
    others = before.clone()
    others[0, 1] = -math.inf
    tau = float(others.max()) * 2
    assert before[0, 1] > 2 * tau  # the forced head, and only it, is over tau
    clip = QKClip(model, tau, None, None)
    wq = [b.attn.wq.weight.detach().clone() for b in model.blocks]
    wk = [b.attn.wk.weight.detach().clone() for b in model.blocks]
    model(idx, idx).backward()  # records the maxima; no optimizer step, so only the clip moves weights
    recorded = torch.stack([b.attn.head_max_logit.clone() for b in model.blocks])
    clip.apply()
    return model, idx, clip, tau, before, recorded, wq, wk


@pytest.mark.parametrize("n_kv_heads", [4, 2], ids=["mha", "gqa"])
def test_a_head_over_tau_has_its_rows_scaled_by_the_hand_computed_factor(n_kv_heads):
    model, idx, clip, tau, before, recorded, wq, wk = clip_one_step(n_kv_heads)
    assert_close(recorded, before.float(), rtol=1e-5, atol=1e-5)
    gamma = tau / before[0, 1].item()
    head_dim = model.cfg.head_dim
    expected_q = wq[0].clone()
    expected_k = wk[0].clone()
    if n_kv_heads == 4:  # one key head per query head: sqrt(gamma) on each side
        expected_q[head_dim : 2 * head_dim] *= math.sqrt(gamma)
        expected_k[head_dim : 2 * head_dim] *= math.sqrt(gamma)
    else:  # the key is shared with head 0: the query takes all of gamma, the key none
        expected_q[head_dim : 2 * head_dim] *= gamma
    assert_close(model.blocks[0].attn.wq.weight, expected_q, rtol=1e-6, atol=0)
    assert_close(model.blocks[0].attn.wk.weight, expected_k, rtol=1e-6, atol=0)
    assert_close(model.blocks[1].attn.wq.weight, wq[1], rtol=0, atol=0)
    assert_close(model.blocks[1].attn.wk.weight, wk[1], rtol=0, atol=0)
    # On the same batch the clipped head now peaks exactly at tau, and its layer's other heads
    # as before (later layers see a changed input, so their logits move).
    after = hand_head_max(model, idx)
    assert after[0, 1].item() == approx(tau, rel=1e-5)
    others = [h for h in range(4) if h != 1]
    assert_close(after[0, others], before[0, others], rtol=1e-5, atol=1e-6)
    metrics = {k: float(v) for k, v in clip.metrics().items()}
    assert metrics["optim/qk_clip/heads_clipped"] == 1
    assert metrics["optim/qk_clip/max_logit"] == approx(before.max().item(), rel=1e-5)
    assert metrics["optim/qk_clip/max_logit_after"] == approx(tau, rel=1e-5)
    # the maxima start again from nothing for the next step
    assert all(torch.isinf(b.attn.head_max_logit).all() for b in model.blocks)


def test_a_skipped_step_clips_nothing():
    torch.manual_seed(0)
    model = GPT(tiny())
    clip = QKClip(model, 1e-6, None, None)  # every head is over this tau
    model(torch.randint(0, 97, (2, 8)), torch.randint(0, 97, (2, 8))).backward()
    weights = [p.detach().clone() for p in model.parameters()]
    clip.apply(found_inf=torch.tensor(1.0))
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    assert float(clip.metrics()["optim/qk_clip/heads_clipped"]) == 0
    clip.apply(found_inf=torch.tensor(0.0))  # nothing recorded since: nothing to clip either
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))


def test_recording_attention_gives_the_sdpa_output_and_gradients():
    torch.manual_seed(0)
    # fp64, so that the comparison is of the formulas, not of two summation orders.
    q, k, v = (torch.randn(2, h, 10, 8, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    out, head_max = explicit_attention_with_head_max(q, k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    # The logits are computed in fp32 (as under bf16 autocast): fp32 agreement, not fp64.
    assert_close(out, ref, rtol=1e-6, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        assert_close(g, r, rtol=1e-5, atol=1e-6)
    scores = q.detach() @ k.detach().repeat_interleave(2, dim=1).transpose(-1, -2) / math.sqrt(8)
    visible = torch.ones(10, 10, dtype=torch.bool).tril()
    assert_close(head_max, scores[..., visible].amax(dim=(0, 2)).float(), rtol=1e-6, atol=1e-6)


def test_clip_off_never_takes_the_recording_path(monkeypatch, tmp_path):
    import model.gpt
    import trainer.loop

    def forbidden(*args, **kwargs):
        raise AssertionError("the clip's code ran with optim.qk_clip.enabled=false")

    monkeypatch.setattr(model.gpt, "attention_with_head_max", forbidden)
    monkeypatch.setattr(trainer.loop, "QKClip", forbidden)
    records = train_in_process(tmp_path, ["optim=muon", "trainer.batch_size=2", "trainer.max_steps=3"])
    assert not any(k.startswith("optim/qk_clip") for r in records for k in r)


# Large initial weights give logits up to ~30, where the attention pattern (and so the loss)
# depends on them; tau=1 clips every head at step 1 and a few heads at nearly every step after,
# so any disagreement between ranks in the maxima or the factors shows in the losses.
CLIP = ["optim=muon", "optim.muon.ns_dtype=fp32", "optim.qk_clip.enabled=true", "optim.qk_clip.tau=1",
        "model.init_std=0.3"]


@pytest.fixture(scope="module")
def clipped_single(tmp_path_factory) -> list[dict]:
    return train_in_process(tmp_path_factory.mktemp("clip_single"), CLIP + ["trainer.batch_size=4"])


def assert_same_clipped_run(parallel: list[dict], single: list[dict]) -> None:
    assert len(losses(single)) == len(losses(parallel)) == 10
    clipped = losses(single, "optim/qk_clip/heads_clipped")
    assert clipped[0] == 8 and sum(c > 0 for c in clipped) >= 8, clipped  # 2 layers x 4 heads at first
    for key, tol in (("train/loss", 1e-5), ("optim/qk_clip/max_logit", 1e-4), ("optim/qk_clip/max_logit_after", 1e-4)):
        for step, (x, y) in enumerate(zip(losses(parallel, key), losses(single, key)), start=1):
            check_relative(f"{key} at step {step}", x, y, tol)
    assert losses(parallel, "optim/qk_clip/heads_clipped") == clipped
    for record in single:
        if "optim/qk_clip/max_logit_after" in record:
            expected = min(record["optim/qk_clip/max_logit"], 1.0)
            assert record["optim/qk_clip/max_logit_after"] == approx(expected, rel=1e-5)


def test_dp2_zero1_with_the_clip_tracks_the_single_process_run(tmp_path, clipped_single):
    run_distributed(_train_worker, 2, str(tmp_path), CLIP + ["trainer.batch_size=2"])
    parallel = read_metrics(tmp_path)
    assert_same_clipped_run(parallel, clipped_single)
    # The per-head maxima cross DP once per step, 2 layers x 4 heads of fp32, and nothing else
    # the clip does crosses DP: the same run without the clip moves exactly that much less.
    off_dir = tmp_path / "clip_off"
    off_dir.mkdir()
    run_distributed(_train_worker, 2, str(off_dir), [o for o in CLIP if "qk_clip" not in o] + ["trainer.batch_size=2"])
    unclipped = read_metrics(off_dir)
    for key, extra in (("comm/dp/all_reduce_bytes", 2 * 4 * 4), ("comm/dp/all_reduce_calls", 1)):
        assert parallel[-1][key] - unclipped[-1][key] == approx(extra, abs=1e-9), key


@pytest.mark.parametrize("tp_mode", ["gather", "gram"])
def test_tp2_with_the_clip_tracks_the_single_process_run(tmp_path, clipped_single, tp_mode):
    run_distributed(_train_worker, 2, str(tmp_path), CLIP + ["trainer.batch_size=4", "parallel.tp=2",
                                                              f"optim.muon.tp_mode={tp_mode}"])
    assert_same_clipped_run(read_metrics(tmp_path), clipped_single)


def test_compiled_training_with_the_clip_equals_eager(tmp_path, clipped_single):
    """The recorded maxima are a buffer the compiled forward mutates in place."""
    compiled = train_in_process(tmp_path, CLIP + ["trainer.batch_size=4", "trainer.compile=true"])
    assert_same_clipped_run(compiled, clipped_single)
