"""Activation checkpointing (trainer.activation_checkpointing): recompute in the backward what
the forward would otherwise keep.

- "full": each transformer block runs under torch.utils.checkpoint (non-reentrant) and keeps
  only its inputs (and, in MoE blocks, its routing decisions); the backward reruns the block.
- "selective": the blocks still run under checkpoint, but a policy keeps the outputs of the
  expensive ops (SAVED_OPS below: every other matmul, attention, communication, routing) and
  the backward recomputes only the cheap pointwise work between them.

The block's `forward` is wrapped, not the block: parameter names stay what they were, which
checkpoints, the optimizers' routing by name and the metrics rely on.

What a recompute must not do twice, it checks with `recomputing()`: the MoE layer's per-step
statistics, QK-clip's per-head maxima and the eval's max-logit list are recorded by the forward
only. Collectives: a recompute under "full" issues the block's collectives again, in the order
the forward did; every rank runs the same backward graph, so every rank issues them alike.
Under "selective" their results are kept instead (CheckpointSide), so the recompute sends
nothing.
"""
from __future__ import annotations

import contextlib
import functools
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch._C._distributed_c10d import _create_work_from_future
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode_temporarily
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from model.config import CHECKPOINTING_MODES

# How a kept op's calls are kept.
ALWAYS = "always"
EVERY_OTHER = "every other call"
# In-place c10d collectives: SAC's cache returns an op's outputs, but these write into an
# argument (and dist.all_reduce returns that argument, not the op's result), so a cached call
# would leave the buffer unreduced. CheckpointSide keeps the written buffer and copies it back.
REPLAYED = "replayed"

# What "selective" keeps, and why: op name -> (how, why). The one list of the policy.
SAVED_OPS: dict[str, tuple[str, str]] = {
    # Matmuls: recomputing one costs as much as its forward, and keeping all of them would keep
    # nearly everything. Keeping every other one halves the recomputed matmul work while the
    # recompute of the rest only needs their (kept or cheap) inputs.
    "aten.mm.default": (EVERY_OTHER, "projections (nn.Linear on 2-D views)"),
    "aten.addmm.default": (EVERY_OTHER, "projections with a bias"),
    "aten.bmm.default": (EVERY_OTHER, "batched products: the explicit attention's QK^T and PV"),
    "aten._grouped_mm.default": (EVERY_OTHER, "the routed experts' grouped products"),
    "aten._scaled_mm.default": (EVERY_OTHER, "float8 projections (trainer.fp8 on a GPU)"),
    "aten._scaled_grouped_mm.default": (EVERY_OTHER, "the experts' float8 grouped products (trainer.fp8)"),
    # Attention: quadratic in the sequence to recompute; its outputs (and logsumexp) are what
    # its backward needs.
    "aten._scaled_dot_product_flash_attention.default": (ALWAYS, "SDPA, flash kernel (CUDA)"),
    "aten._scaled_dot_product_flash_attention_for_cpu.default": (ALWAYS, "SDPA on the CPU"),
    "aten._scaled_dot_product_efficient_attention.default": (ALWAYS, "SDPA, memory-efficient kernel"),
    "aten._scaled_dot_product_cudnn_attention.default": (ALWAYS, "SDPA, cuDNN kernel"),
    "aten._softmax.default": (ALWAYS, "attention probabilities of the explicit path (QK-clip on "
                                      "the CPU, model/attention_logits.py): recomputing them means "
                                      "recomputing the T x T logits"),
    "higher_order.flex_attention": (ALWAYS, "FlexAttention as torch.compile traces it (QK-clip on CUDA)"),
    # Communication: a recompute that sends again pays the network twice, and on a busy link
    # that is the slowest op of the block.
    "c10d.allreduce_.default": (REPLAYED, "TP's and the MoE aux loss's all-reduces (parallel/tp_ops.py)"),
    "c10d.alltoall_base_.default": (REPLAYED, "EP's dispatch and combine (parallel/expert_parallel.py)"),
    "_c10d_functional.all_reduce.default": (ALWAYS, "all-reduce as torch.compile traces it"),
    "_c10d_functional.reduce_scatter_tensor.default": (ALWAYS, "reduce-scatter as traced"),
    "_c10d_functional.all_gather_into_tensor.default": (ALWAYS, "all-gather as traced"),
    "_c10d_functional.all_to_all_single.default": (ALWAYS, "all-to-all as traced"),
    "_c10d_functional.wait_tensor.default": (ALWAYS, "completes the traced collectives above: a "
                                                     "kept result must not wait on work long done"),
    # Routing: the recompute must send each token to the experts the forward chose. Recomputed
    # scores may differ in the last bit, and a flipped top-k choice would change the work, and
    # under EP the sizes of the all-to-alls. Small integer tensors, so "full" keeps them too.
    "aten.topk.default": (ALWAYS, "the routed experts of each token"),
    "aten.sort.stable": (ALWAYS, "tokens sorted by expert, and the inverse order"),
    "aten.sort.default": (ALWAYS, "the same, unstable"),
}
# Ops that SAC must neither cache nor count: profiler annotations, which FSDP2's hooks (around
# EP's experts, inside a block) issue a different number of times in the forward and in the
# recompute; counted, they would shift SAC's replay of every later annotation.
UNCACHED_OPS = ("profiler._record_function_enter.default", "profiler._record_function_enter_new.default",
                "profiler._record_function_exit._RecordFunction")
# What "full" keeps besides the block's inputs: the routing decisions alone.
ROUTING_OPS = ("aten.topk.default", "aten.sort.stable", "aten.sort.default")


def _resolve(name: str) -> Any:
    """The op called `name` ("aten.mm.default"), or None where this torch build lacks it."""
    namespace, rest = name.split(".", 1)
    target: Any = getattr(torch.ops, namespace)
    for part in rest.split("."):
        target = getattr(target, part, None)
        if target is None:
            return None
    return target


def _ops(names, how: str | None = None) -> frozenset:
    found = (_resolve(n) for n in names if how is None or SAVED_OPS[n][0] == how)
    return frozenset(op for op in found if op is not None)


_ALWAYS_SAVED = _ops(SAVED_OPS, ALWAYS)
_ALTERNATE_SAVED = _ops(SAVED_OPS, EVERY_OTHER)
_REPLAYED = _ops(SAVED_OPS, REPLAYED)
_ROUTING = _ops(ROUTING_OPS)
_UNCACHED = _ops(UNCACHED_OPS)

_recompute_depth = 0


def recomputing() -> bool:
    """Whether a checkpoint's recompute is running (in the backward), not the forward itself:
    whatever the forward recorded per step (routing counts, logit maxima) is recorded already."""
    return _recompute_depth > 0


def selective_policy() -> Callable[..., CheckpointPolicy]:
    """A fresh SAC policy for one checkpointed call: keep SAVED_OPS, recompute the rest.

    The matmul counts of the forward and of the recompute are kept apart: torch releases that
    ask the policy again during the recompute (is_recompute=True) match its answers to the
    forward's call by call, and one shared count would shift every answer by the forward's
    total, keeping the wrong matmuls, so the backward would read other tensors than it saved.
    """
    matmuls = {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in _ALTERNATE_SAVED:
            index = matmuls[ctx.is_recompute]
            matmuls[ctx.is_recompute] += 1
            return CheckpointPolicy.MUST_SAVE if index % 2 == 0 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in _ALWAYS_SAVED else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def full_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Recompute everything but the routing decisions."""
    return CheckpointPolicy.MUST_SAVE if op in _ROUTING else CheckpointPolicy.PREFER_RECOMPUTE


class CheckpointSide(TorchDispatchMode):
    """One side of a checkpointed call, the forward or its recompute, around SAC's mode for it.

    It marks the recompute (`recomputing()`), and under "selective" keeps the buffers the
    in-place collectives wrote in the forward (`results`) and, in the recompute, copies them
    back instead of communicating again.
    """

    # Higher-order ops (FlexAttention on CUDA) pass through to SAC's mode, which handles them.
    supports_higher_order_operators = True

    def __init__(self, sac: TorchDispatchMode, results: deque | None, is_recompute: bool) -> None:
        super().__init__()
        self.sac, self.results, self.is_recompute = sac, results, is_recompute

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # like SAC's own modes: compiled regions inside a block run under it

    # torch.compile hands its region id to the forward context; it belongs to SAC's mode.
    @property
    def ac_graph_id(self) -> Any:
        return getattr(self.sac, "ac_graph_id", None)

    @ac_graph_id.setter
    def ac_graph_id(self, value: Any) -> None:
        self.sac.ac_graph_id = value

    def __enter__(self):
        global _recompute_depth
        self.sac.__enter__()
        if self.is_recompute:
            _recompute_depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        global _recompute_depth
        try:
            super().__exit__(*exc)
        finally:
            if self.is_recompute:
                _recompute_depth -= 1
            self.sac.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _UNCACHED:
            with self._beneath_sac():
                return func(*args, **kwargs)
        if self.results is None or func not in _REPLAYED:
            return func(*args, **kwargs)
        # These ops write their first argument (a tensor, or a list of one for all-reduce), and
        # return their work, after the list where they take one.
        takes_list = isinstance(args[0], (list, tuple))
        written = args[0][0] if takes_list else args[0]
        with self._beneath_sac():
            if not self.is_recompute:
                out = func(*args, **kwargs)
                # Detached: the buffer is the output of a TP / EP autograd Function, whose graph
                # holds this checkpoint, and a reference back would be a cycle Python cannot free.
                self.results.append(Replay(written.detach(), written._version))
                return out
            kept = self.results.popleft()
            if kept.version != kept.buffer._version or kept.buffer.shape != written.shape:
                raise RuntimeError(f"activation checkpointing: the result of {func} kept from the forward was "
                                   "changed in place since, or does not fit the recompute's buffer")
            # A kept matmul output that the collective reduced in place (a row-parallel
            # projection's) comes back from SAC's cache holding the result already.
            if written.data_ptr() != kept.buffer.data_ptr():
                written.copy_(kept.buffer)
            return (args[0], completed_work()) if takes_list else completed_work()

    def _beneath_sac(self):
        """SAC's mode off the stack for one op (it lies just below this mode): the op is neither
        cached nor counted by it, and the modes below still see it."""
        return _pop_mode_temporarily()


@dataclass
class Replay:
    """An in-place collective's result in the forward: the buffer it wrote, and that buffer's
    version then, to catch a later in-place change."""

    buffer: torch.Tensor
    version: int


def completed_work() -> Any:
    """A finished c10d work, in the boxed form the c10d ops return, for a replayed collective."""
    done = torch.futures.Future()
    done.set_result(None)
    return _create_work_from_future(done).boxed()


class RecomputeMark:
    """The recompute's context where no dispatch mode is needed: it only marks the recompute."""

    def __enter__(self) -> None:
        global _recompute_depth
        _recompute_depth += 1

    def __exit__(self, *exc) -> None:
        global _recompute_depth
        _recompute_depth -= 1


def _tracing() -> bool:
    """Whether torch.compile is tracing the block (AOT autograd's proxy mode is on; the test
    torch.utils.checkpoint makes too): the contexts must then be dispatch modes, and SAC's mode
    tags each traced op with the policy's choice for the partitioner."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None


def checkpoint_contexts(mode: str, routes: bool) -> tuple[Any, Any]:
    """torch.utils.checkpoint's context_fn: the forward's and the recompute's contexts.
    `routes`: the block has a MoE layer, whose routing decisions are kept."""
    if mode == "full" and not routes and not _tracing():
        # Nothing to keep but the inputs: no dispatch mode, whose Python call on every op would
        # cost an eager step more than the recompute itself.
        return contextlib.nullcontext(), RecomputeMark()
    policy = selective_policy() if mode == "selective" else full_policy
    forward, recompute = create_selective_checkpoint_contexts(policy)
    results = deque() if mode == "selective" else None
    return CheckpointSide(forward, results, False), CheckpointSide(recompute, results, True)


@dataclass
class CheckpointedForward:
    """A block's own forward, run under torch.utils.checkpoint. Assigned as the block's
    `forward` attribute: the module, its parameters' names and its hooks (FSDP2's) stay."""

    forward: Callable[..., torch.Tensor]
    mode: str
    routes: bool = False  # the block has a MoE layer

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        return checkpoint(self.forward, *args, use_reentrant=False,
                          context_fn=functools.partial(checkpoint_contexts, self.mode, self.routes), **kwargs)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Checkpoint every block of `model` in place under `mode` (none, full, selective).

    Call after TP / EP (the blocks' layers are then final) and before compile and FSDP2, which
    wrap the checkpointed blocks.
    """
    if mode not in CHECKPOINTING_MODES:
        raise ValueError(f"trainer.activation_checkpointing: unknown mode {mode!r} "
                         f"(expected one of {', '.join(CHECKPOINTING_MODES)})")
    if mode == "none":
        return
    for block in model.blocks:
        if isinstance(block.forward, CheckpointedForward):
            raise ValueError("trainer.activation_checkpointing: the model's blocks are checkpointed already")
        # A MoE layer is told by its router: model/moe.py imports this module, not the reverse.
        routes = hasattr(block.mlp, "router")
        block.forward = CheckpointedForward(block.forward, mode, routes)
