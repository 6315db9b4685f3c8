"""TP (and DP) model equivalence: a sharded model computes what the single-process model does.

Each rank rebuilds the single-process reference from the same seed, so a rank compares its
gathered results with the reference on the same inputs, in fp32.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model.config import ModelConfig
from model.gpt import GPT
from model.parallelize import check_tp_divisibility, parallelize_tp, tp_split_dim
from parallel.tp_layers import padded_vocab, vocab_parallel_cross_entropy
from parallel.tp_ops import gather_from_tp
from optim.grad_ops import average_gradients, clip_gradients
from tests.distributed import run_distributed
from tests.closeness import check
from parallel.mesh import build_mesh

VOCAB = 97  # not divisible by 2 or 4: exercises the vocabulary padding


def model_cfg(**kw) -> ModelConfig:
    base = dict(n_layers=2, d_model=32, n_heads=4, n_kv_heads=4, ffn_hidden=64, max_seq_len=32,
                vocab_size=VOCAB, qk_norm=True)
    base.update(kw)
    return ModelConfig(**base)


def gathered(param: torch.Tensor, tensor: torch.Tensor, group, logical_rows: int) -> torch.Tensor:
    dim = getattr(param, "tp_split_dim", None)
    if dim is None:
        return tensor
    full = gather_from_tp(tensor.contiguous(), dim, group)
    return full[:logical_rows] if dim == 0 and full.shape[0] > logical_rows else full


def _equivalence_worker(rank: int, world: int, tp: int, n_kv_heads: int) -> dict[str, float]:
    mesh = build_mesh(tp)
    cfg = model_cfg(n_kv_heads=n_kv_heads)
    torch.manual_seed(0)
    reference = GPT(cfg)
    torch.manual_seed(0)
    model = parallelize_tp(GPT(cfg), mesh.tp_group)

    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, VOCAB, (2 * mesh.dp, 12), generator=gen)
    tgt = torch.randint(0, VOCAB, (2 * mesh.dp, 12), generator=gen)
    mine = slice(2 * mesh.dp_rank, 2 * mesh.dp_rank + 2)

    ref_logits = reference(idx[mine])
    ref_loss = reference(idx, tgt)
    ref_loss.backward()

    errors = {}
    with torch.no_grad():
        logits = model(idx[mine])
    errors["logits"] = ((logits - ref_logits).norm() / ref_logits.norm()).item()
    loss = model(idx[mine], tgt[mine])
    loss.backward()
    average_gradients(list(model.parameters()), mesh.dp_group)
    loss_avg = loss.detach().clone()
    torch.distributed.all_reduce(loss_avg, group=mesh.dp_group)
    errors["loss"] = abs(loss_avg.item() / mesh.dp - ref_loss.item()) / ref_loss.item()

    for name, param in model.named_parameters():
        expected = tp_split_dim(name) if mesh.tp > 1 else None
        assert param.tp_split_dim == expected, name

    ref_params = dict(reference.named_parameters())
    worst = 0.0
    for name, param in model.named_parameters():
        ref = ref_params[name]
        w = gathered(param, param.detach(), mesh.tp_group, ref.shape[0])
        g = gathered(param, param.grad, mesh.tp_group, ref.shape[0])
        assert w.shape == ref.shape, name
        assert torch.equal(w, ref.detach()), f"TP-invariant init broken for {name}"
        worst = max(worst, ((g - ref.grad).norm() / ref.grad.norm()).item())
    errors["grads"] = worst

    # The global gradient norm is that of the reference model.
    norm = clip_gradients(list(model.parameters()), 0.0, mesh.tp_group)
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf"))
    errors["grad_norm"] = abs(norm.item() - ref_norm.item()) / ref_norm.item()
    return errors


@pytest.mark.parametrize("tp, dp", [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)])
def test_tp_dp_model_equals_single_process(tp, dp):
    results = run_distributed(_equivalence_worker, tp * dp, tp, 2 if tp <= 2 else 4)
    for rank, errors in enumerate(results):
        for what, err in errors.items():
            check(f"rank {rank}: {what} relative error", err, 1e-5)


def _cross_entropy_worker(rank: int, world: int, vocab: int) -> float:
    mesh = build_mesh(world)
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 7, vocab, generator=gen) * 4
    targets = torch.randint(0, vocab, (5, 7), generator=gen)
    padded = torch.full((5, 7, padded_vocab(vocab, world)), 123.0)  # padding must be ignored
    padded[..., :vocab] = logits
    shard = padded.chunk(world, dim=-1)[rank].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(shard, targets, rank * shard.shape[-1], vocab, mesh.tp_group)
    loss.backward()
    full = logits.clone().requires_grad_(True)
    expected = F.cross_entropy(full.flatten(0, 1), targets.flatten())
    expected.backward()
    grad_ref = torch.cat([full.grad, torch.zeros(5, 7, padded.shape[-1] - vocab)], -1).chunk(world, -1)[rank]
    return max(abs(loss.item() - expected.item()), (shard.grad - grad_ref).abs().max().item())


@pytest.mark.parametrize("world, vocab", [(2, 10), (4, 10), (4, 12)])
def test_vocab_parallel_cross_entropy_equals_f_cross_entropy(world, vocab):
    for err in run_distributed(_cross_entropy_worker, world, vocab):
        check("relative error", err, 1e-5)


def test_tp_divisibility_errors_name_the_key():
    for kw, key in [(dict(n_heads=6, n_kv_heads=6, d_model=48), "model.n_heads"),
                    (dict(n_kv_heads=2), "model.n_kv_heads"),
                    (dict(ffn_hidden=66), "model.ffn_hidden")]:
        with pytest.raises(ValueError, match=key):
            check_tp_divisibility(model_cfg(**kw), 4)
