"""Peak memory and time of the LM head and its loss, forward and backward, by model.loss_chunks.

    .venv/bin/python lab/tools/bench/bench_chunked_loss.py                    # CPU, fp32, V=128k, 8k tokens
    python3 lab/tools/bench/bench_chunked_loss.py --device cuda --precision bf16

One step is what GPT.forward and the backward do after the final norm: the head on hidden
states [1, tokens, d_model] and the mean cross-entropy (LMHead.loss as a whole for 1 chunk,
model/chunked_loss.py for more), then the backward into the hidden states and the head weight.

Peak: the most bytes of tensors the step itself made that were alive at once (the hidden
states and the weight exist before it and are not counted; the gradients it makes are). On
CUDA, torch.cuda.max_memory_allocated above what was allocated before the step. On the CPU,
which has no such counter, a dispatch mode that follows every tensor storage an operator
returns until it is freed, and takes the sum after each operator: the operators' internal
scratch buffers are not seen, the tensors between them are.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from model.chunked_loss import chunked_head_loss
from model.gpt import LMHead
from lab.tools.bench.bench_common import machine_info


class LiveBytes(TorchDispatchMode):
    """The peak of the summed sizes of the storages that operators returned and that are still
    alive, read after each operator."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # Freed storages first: a new one may reuse a freed one's address (the key).
        self.live = {key: (ref, size) for key, (ref, size) in self.live.items() if not ref.expired()}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.live.setdefault(storage._cdata, (StorageWeakRef(storage), storage.nbytes()))
        self.peak = max(self.peak, sum(size for _, size in self.live.values()))
        return out


def step(head: LMHead, hidden: torch.Tensor, targets: torch.Tensor, chunks: int, precision: str) -> None:
    """One forward and backward of the head and loss, as GPT.forward runs them."""
    with torch.autocast(hidden.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        if chunks == 1:
            loss = head.loss(head(hidden), targets)
        else:
            loss = chunked_head_loss(head, hidden, targets, chunks)
    loss.backward()


def measure(head: LMHead, hidden: torch.Tensor, targets: torch.Tensor, chunks: int,
            precision: str) -> tuple[int, float]:
    """(peak bytes the step made, seconds) of one step."""
    head.weight.grad = hidden.grad = None
    cuda = hidden.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        step(head, hidden, targets, chunks, precision)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() - before
    else:
        # Timed without the mode (its bookkeeping runs after every operator), then measured.
        start = time.perf_counter()
        step(head, hidden, targets, chunks, precision)
        seconds = time.perf_counter() - start
        head.weight.grad = hidden.grad = None
        with LiveBytes() as live:
            step(head, hidden, targets, chunks, precision)
        peak = live.peak
    head.weight.grad = hidden.grad = None
    return peak, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=131072)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=8192, help="batch x sequence")
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 8])
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=1, help="timed steps per chunk count (the median is shown)")
    args = ap.parse_args()
    if any(n < 1 for n in args.chunks):
        ap.error("--chunks must all be >= 1")
    device = torch.device(args.device)

    for key, value in machine_info().items():
        print(f"{key}: {value}")
    torch.manual_seed(0)
    head = LMHead(args.d_model, args.vocab).to(device)
    torch.nn.init.normal_(head.weight, std=0.02)
    hidden = torch.randn(1, args.tokens, args.d_model, device=device, requires_grad=True)
    targets = torch.randint(0, args.vocab, (1, args.tokens), device=device)
    logits_bytes = args.tokens * args.vocab * (2 if args.precision == "bf16" else 4)
    print(f"V={args.vocab} d={args.d_model} tokens={args.tokens} {args.precision} on {device}: "
          f"whole logits {logits_bytes / 2**30:.2f} GiB, head weight {head.weight.numel() * 4 / 2**30:.2f} GiB")

    # Warm-up on a few tokens: kernels' first-call set-up stays out of the timings.
    for chunks in args.chunks:
        step(head, hidden[:, :64].detach().requires_grad_(), targets[:, :64], min(chunks, 64), args.precision)

    rows = []
    for chunks in args.chunks:
        runs = [measure(head, hidden, targets, chunks, args.precision) for _ in range(args.repeats)]
        rows.append((chunks, max(p for p, _ in runs), statistics.median(s for _, s in runs)))
        print(f"  loss_chunks={chunks}: peak {rows[-1][1] / 2**30:.2f} GiB, {rows[-1][2] * 1e3:.1f} ms", flush=True)

    base_peak, base_time = rows[0][1], rows[0][2]
    print(f"\n| loss_chunks | peak GiB | vs {rows[0][0]} chunk(s) | ms | time vs {rows[0][0]} |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for chunks, peak, seconds in rows:
        print(f"| {chunks} | {peak / 2**30:.2f} | {peak / base_peak:.2f}x | {seconds * 1e3:.1f} | {seconds / base_time:.2f}x |")


if __name__ == "__main__":
    main()
