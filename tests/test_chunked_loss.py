"""model.loss_chunks (model/chunked_loss.py): the head and loss a slice of tokens at a time give
the whole loss and gradients, plain, under TP's vocabulary-parallel loss, under FSDP2, under
torch.compile and under bf16 autocast, and never hold the whole [tokens, vocab] logits."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from model.chunked_loss import chunked_head_loss
from model.gpt import GPT
from model.parallelize import parallelize_tp
from parallel.fsdp import apply_fsdp
from parallel.mesh import build_mesh
from model.presets import preset_config
from tests.distributed import run_distributed
from tests.closeness import check, check_relative

VOCAB = 97  # odd: TP 2 pads the head's vocabulary
BATCH, SEQ = 2, 50  # 100 tokens: 3 chunks of 34, 33, 33


def tiny_model(preset: str = "gpt_tiny", chunks: int = 1) -> GPT:
    torch.manual_seed(0)
    return GPT(replace(preset_config(preset, VOCAB), loss_chunks=chunks))


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen), torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)


def loss_and_grads(model: GPT, chunks: int, idx: torch.Tensor, tgt: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The loss with model.loss_chunks=chunks, every parameter's gradient (full tensors under
    FSDP2) and, as "hidden", the gradient of the final norm's output."""
    model.cfg.loss_chunks = chunks
    model.zero_grad(set_to_none=True)
    hidden: list[torch.Tensor] = []

    def keep(_module, _inputs, out: torch.Tensor) -> None:
        out.retain_grad()
        hidden.append(out)

    hook = model.final_norm.register_forward_hook(keep)
    loss = model(idx, tgt)
    loss.backward()
    hook.remove()
    grads = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
             for name, p in model.named_parameters()}
    grads["hidden"] = hidden[0].grad.clone()
    return loss.detach(), grads


def max_errors(a: tuple[torch.Tensor, dict], b: tuple[torch.Tensor, dict]) -> tuple[float, float]:
    """(|loss difference|, largest |gradient difference| over every gradient)."""
    assert a[1].keys() == b[1].keys()
    return (a[0] - b[0]).abs().item(), max((a[1][k] - b[1][k]).abs().max().item() for k in a[1])


class VocabTensors(TorchDispatchMode):
    """The most tokens of any vocabulary-wide tensor ([..., vocab], not a view) an op made,
    in the forward and in the backward."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.phase = vocab, "forward"
        self.most = {"forward": 0, "backward": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.ndim >= 2 and t.shape[-1] == self.vocab:
                    self.most[self.phase] = max(self.most[self.phase], t.numel() // self.vocab)
        return out


def vocab_peaks(model: GPT, chunks: int, idx: torch.Tensor, tgt: torch.Tensor, vocab: int) -> dict[str, int]:
    model.cfg.loss_chunks = chunks
    with VocabTensors(vocab) as seen:
        loss = model(idx, tgt)
        seen.phase = "backward"
        loss.backward()
    return seen.most


@pytest.mark.parametrize("preset, chunks", [("gpt_tiny", 3), ("gpt_tiny", 4), ("moe_tiny", 3)])
def test_chunked_loss_equals_whole_loss_and_gradients(preset, chunks):
    """Every parameter's gradient and the final hidden state's, fp32; the MoE aux loss is
    added after the head's loss as before. 3 does not divide the 100 tokens."""
    model = tiny_model(preset)
    idx, tgt = batch()
    whole = loss_and_grads(model, 1, idx, tgt)
    chunked = loss_and_grads(model, chunks, idx, tgt)
    loss_err, grad_err = max_errors(chunked, whole)
    check("loss", loss_err, 1e-6)
    check("gradients", grad_err, 1e-6)
    with torch.no_grad():  # evaluation takes the slices' losses without gradients
        check("loss", abs(model(idx, tgt).item() - whole[0].item()), 1e-6)


@pytest.mark.parametrize("chunks", [1, 3, 4, 130])
def test_chunked_head_loss_function_equals_whole(chunks):
    """The function itself, 1 chunk included, and more chunks than tokens (empty slices); its
    gradients are held once, so a second backward is refused."""
    torch.manual_seed(0)
    head = GPT(preset_config("gpt_tiny", VOCAB)).head
    hidden = torch.randn(BATCH, SEQ, head.in_features, requires_grad=True)
    _, tgt = batch()
    expected = head.loss(head(hidden), tgt)
    grad_hidden, grad_weight = torch.autograd.grad(expected, (hidden, head.weight))
    loss = chunked_head_loss(head, hidden, tgt, chunks) * 2.5  # the incoming gradient scales both
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backpropagated twice"):  # not silently scaled twice
        loss.backward()
    check("loss", abs(loss.item() - 2.5 * expected.item()), 2.5e-6)
    check("hidden grad", (hidden.grad - 2.5 * grad_hidden).abs().max().item(), 1e-6)
    check("head grad", (head.weight.grad - 2.5 * grad_weight).abs().max().item(), 1e-6)


@pytest.mark.parametrize("chunks", [3, 4])
def test_logits_are_never_whole(chunks):
    """The largest vocabulary-wide tensor holds ceil(tokens / N) tokens in the forward and no
    more in the backward; unchunked, all of them (so the recorder sees whole logits)."""
    model = tiny_model()
    idx, tgt = batch()
    tokens = idx.numel()
    assert vocab_peaks(model, 1, idx, tgt, VOCAB) == {"forward": tokens, "backward": tokens}
    peaks = vocab_peaks(model, chunks, idx, tgt, VOCAB)
    assert peaks["forward"] == math.ceil(tokens / chunks)
    assert peaks["backward"] <= math.ceil(tokens / chunks)


def test_chunked_loss_under_compile_equals_whole():
    """torch.compile runs the chunked head eagerly (a graph break) around the compiled blocks.
    aot_eager: dynamo and AOT autograd as in training, without inductor's CPU compile time."""
    model = tiny_model()
    idx, tgt = batch()
    whole = loss_and_grads(model, 1, idx, tgt)
    model.cfg.loss_chunks = 4
    compiled = torch.compile(model, backend="aot_eager")
    model.zero_grad(set_to_none=True)
    loss = compiled(idx, tgt)
    loss.backward()
    check("loss", abs(loss.item() - whole[0].item()), 1e-6)
    for name, p in model.named_parameters():
        check(name, (p.grad - whole[1][name]).abs().max().item(), 1e-6)


def test_bf16_autocast_chunked_loss_is_close_to_whole():
    """Under bf16 autocast the head's matmuls run in bf16 (8 significant bits: round-to-nearest
    is off by up to 2^-9 = 0.2%) and the loss in fp32. The head weight's gradient is a bf16
    matmul's sum over tokens: whole, rounded once; chunked, each slice's partial sum rounded
    (then added in fp32). The two differ by about one bf16 rounding, 2^-8 = 0.4% at most (2.3e-3
    of its norm here), so 1e-2 of each gradient's norm bounds them, while a wrong slice weight
    or a lost slice would be off by a quarter or more. The loss, an fp32 mean over bf16 logits
    that may round differently when a kernel splits its rows otherwise, gets 1e-3."""
    model = tiny_model()
    idx, tgt = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        whole = loss_and_grads(model, 1, idx, tgt)
        chunked = loss_and_grads(model, 4, idx, tgt)
    check_relative("loss", chunked[0].item(), whole[0].item(), 1e-3)
    for name, grad in whole[1].items():
        err = ((chunked[1][name] - grad).float().norm() / grad.float().norm()).item()
        check(f"{name}: relative error", err, 1e-2)


def _parallel_worker(rank: int, world: int) -> dict[str, float]:
    """TP 2 (vocabulary-parallel head and loss), then FSDP2 over the same 2 ranks."""
    errors: dict[str, float] = {}
    idx, tgt = batch()

    mesh = build_mesh(tp=2)
    tp_model = parallelize_tp(tiny_model(), mesh.tp_group)
    whole = loss_and_grads(tp_model, 1, idx, tgt)
    errors["tp loss"], errors["tp grads"] = max_errors(loss_and_grads(tp_model, 3, idx, tgt), whole)
    reference = loss_and_grads(tiny_model(), 1, idx, tgt)[0]
    errors["tp loss vs single process"] = abs(whole[0].item() - reference.item())
    local_vocab = tp_model.head.weight.shape[0]
    errors["tp whole logits tokens"] = vocab_peaks(tp_model, 1, idx, tgt, local_vocab)["forward"]
    peaks = vocab_peaks(tp_model, 3, idx, tgt, local_vocab)
    errors["tp chunked logits tokens"] = max(peaks.values())

    shard_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    fsdp_model = tiny_model()
    apply_fsdp(fsdp_model, fsdp_model.blocks, shard_mesh)
    idx, tgt = batch(seed=2 + rank)  # each rank its own tokens: the gradients are reduced
    whole = loss_and_grads(fsdp_model, 1, idx, tgt)
    errors["fsdp loss"], errors["fsdp grads"] = max_errors(loss_and_grads(fsdp_model, 4, idx, tgt), whole)
    return errors


def test_chunked_loss_under_tp_and_fsdp_equals_whole():
    for rank, errors in enumerate(run_distributed(_parallel_worker, 2)):
        assert errors.pop("tp whole logits tokens") == BATCH * SEQ, rank
        assert errors.pop("tp chunked logits tokens") == math.ceil(BATCH * SEQ / 3), rank
        check(f"rank {rank}: tp loss vs single process", errors.pop("tp loss vs single process"), 1e-5)
        for what, err in errors.items():
            check(f"rank {rank}: {what}", err, 1e-6)
