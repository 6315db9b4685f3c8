"""One rank's memory in one training step of any layout, measured without allocating it.

`estimate_memory` builds this project's real model (trainer/build.py's build_model: TP, EP,
activation checkpointing, FSDP2, the chunked loss) and real optimizer (optim/builder.py's
build_optimizer) for rank `rank` of the layout, over torch's fake process groups
(parallel/mesh.py, init_simulated_mesh), entirely under FakeTensorMode: every tensor has its
real shape, dtype and aliasing but no storage, so an 8B model's step costs seconds of CPU and no
memory. It runs a training step as trainer/loop.py does (forward under autocast, backward,
prepare_grads, the optimizer step, zero_grad) under torch's FSDP2 memory tracker
(torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker; mem_tracker.MemTracker where FSDP2
is not applied), which follows every storage from its allocation to its release. An optimizer
step on zero gradients goes first, so that the measured step is a steady one: the optimizer
state (and ZeRO-1's buffers) are there through its forward and backward, as from a run's
second step on.

What it reports, per rank (bytes; scripts/estimate_memory.py prints them):
  params           the rank's fp32 parameters (FSDP2: its shards)
  grads            its fp32 gradients once the backward is done (FSDP2: the sharded ones), and
                   under ZeRO-1 the optimizer's flat buffers (where eval/memory_plan.py counts them)
  optimizer_state  the optimizer's state tensors (OptimizerSet.state_bytes)
  activations      the activations and their gradients at the forward-backward peak (the
                   tracker's "Activation" and "Temp" then)
  gathered         the most FSDP2 holds gathered at once (the bf16 all-gather outputs and the
                   unsharded parameters made from them)
  peak             the largest total of everything live, at any point of the step
and, for each phase (the forward and backward, the optimizer), the tracker's categories at
that phase's peak, and when the forward returns.

Caveats (torch 2.13, CPU build), each found by running it:
- The device is the CPU. Fake CUDA tensors can be made, but autograd asks the CUDA runtime for
  their device, which a CPU-only build lacks, and torch.autocast("cuda") turns itself off. So
  the step runs CPU kernels under CPU autocast; where their memory differs from the GPU's, the
  estimate follows the GPU:
  * F.rms_norm: the CPU decomposes it into five ops and also keeps the normalised product,
    CUDA's fused kernel keeps only the input and 1/rms: `gpu_kernels` swaps in
    `fused_rms_norm`, which keeps what the fused kernel keeps;
  * Newton-Schulz (optim/newton_schulz.py): the CPU cuts a batch of matrices into cache-sized
    runs and keeps its scratch buffers for the next call; a GPU takes the whole batch and frees
    them: `gpu_newton_schulz` sets the module's two CPU settings so.
  The rest agrees: SDPA takes the CPU's flash kernel, which like CUDA's keeps the output and
  the row log-sum-exp (no T x T scores), and autocast casts the matmuls to bf16 on both. The
  CPU allocator does not round sizes (CUDA's rounds to 512 bytes: negligible here), and nothing
  counts the caching allocator's fragmentation, the CUDA context, NCCL's buffers or cuBLAS's
  workspace (a few GB a GPU).
- Fake process groups move no data (parallel/comm.py): under EP the all-to-alls are a local
  copy, not a collective, so the "selective" policy, which keeps the all-to-alls' results,
  finds none here: the estimate then misses k x d_model x (residual + compute bytes) per
  token and MoE layer that a real run keeps (eval/memory_plan.py counts them).
- Expert parallelism reads the routed-token counts to the host (parallel/expert_parallel.py);
  a fake tensor has no values. `BalancedRouting` answers those reads with perfectly balanced
  counts: every expert gets tokens x top_k / n_experts of this rank's pairs. A skewed rank
  holds more. MoE models are estimated in bf16 only: torch's grouped matmul has no fp32 shape
  rule, and the fp32 fallback reads the counts to the host too.
- FakeTensorMode keeps a weak reference to every tensor it makes, and nn.Module.to_empty swaps
  fake parameters, which torch refuses for tensors with weak references: build_model's
  materialize would fail. `fake_mode` drops those weak references for tensors made by ops
  (fresh outputs, which nothing looks up again).
- FSDPMemTracker's optimizer hooks need a torch.optim.Optimizer; ours is an OptimizerSet of
  several, so the tracker is told when the optimizer phase runs (`optimizer_phase`), and the
  state is read from OptimizerSet.state_bytes. Its bookkeeping of every module's peak, most
  of its cost, is replaced by the step's peak and each phase's (`_StepTracking`). torch's
  ModTracker fails on a forward that runs a backward of its own (the chunked loss):
  `_NestedBackwardModTracker` lets that pass.
- The tracker labels what FSDP2 gathers "Unsharded Param" (the parameters, views of the
  all-gather output) and "All Gather" (the output while FSDP2 keeps it, until the next
  all-gather); their sum is `gathered`. The backward's allocations are "Temp" (gradients of
  activations, FSDP2's fp32 copies of gradients for the reduce-scatter), the unsharded
  parameters' gradients "Unsharded Grad"; under FSDP2 a checkpointed block's recompute counts
  as "Activation" (the tracker sees the unit's forward hook in the backward).
- Process groups and the swapped settings above are global state: one estimate at a time in a
  process. Each call makes its own fake group and destroys it at the end, so calls may follow
  one another; scripts/estimate_memory.py runs one per process.
- Cost: 4-16 s of CPU an estimate for gpt_1b to moe_16b (2-core machine), about a quarter of
  it building the model, the rest the fake dispatch and the tracker, op by op.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorConverter, FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed._tools.mod_tracker import ModTracker
from torch.distributed.fsdp import FSDPModule

from eval.memory_plan import preset_config
from model.moe import MoE
from optim import newton_schulz
from optim.builder import build_optimizer
from model.parallelize import check_ep, check_tp_divisibility
from parallel.mesh import check_layout, init_simulated_mesh
from trainer import device as dev
from trainer.build import build_model
from trainer.config import TrainConfig, layout_keys, validate

CPU = torch.device("cpu")
OPTIMIZERS = ("muon", "adamw")
PRECISIONS = ("bf16", "fp32")


@dataclass(frozen=True)
class EstimateSpec:
    """What to estimate: a model preset, a layout and the rank in it, one micro-batch."""

    model: str = "gpt_8b"
    vocab_size: int = 0  # 0: the preset's own vocabulary (eval/memory_plan.PRESET_VOCAB)
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    ep: int = 1
    rank: int = 0
    batch_size: int = 1
    seq_len: int = 4096
    optim: str = "muon"
    precision: str = "bf16"
    activation_checkpointing: str = "none"
    loss_chunks: int = 1

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp


@dataclass
class MemoryEstimate:
    """One rank's memory in one steady training step, bytes by part (see the module doc)."""

    spec: EstimateSpec
    params: int
    grads: int
    optimizer_state: int
    activations: int
    gathered: int
    peak: int
    # Each phase's peak ("forward_backward", "optimizer"): the tracker's categories then, "Total" included.
    phase_peaks: dict[str, dict[str, int]] = field(default_factory=dict)
    after_forward: dict[str, int] = field(default_factory=dict)  # the categories when the forward has returned
    seconds: float = 0.0

    PARTS = ("params", "grads", "optimizer_state", "activations", "gathered")

    def parts(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.PARTS}

    def to_dict(self) -> dict[str, Any]:
        return {"spec": asdict(self.spec), **self.parts(), "peak": self.peak, "phase_peaks": self.phase_peaks,
                "after_forward": self.after_forward, "seconds": self.seconds}


def train_config(spec: EstimateSpec) -> TrainConfig:
    """The TrainConfig a run of `spec` would have, checked by trainer.config.validate and the
    layout's own checks: a bad value raises ConfigError or ValueError in one line naming its
    key, before anything is built."""
    if spec.optim not in OPTIMIZERS:
        raise ValueError(f"optim={spec.optim!r}: expected one of {', '.join(OPTIMIZERS)}")
    if spec.precision not in PRECISIONS:
        raise ValueError(f"trainer.precision={spec.precision!r}: expected one of {', '.join(PRECISIONS)} "
                         "(an estimate has no device to choose for auto)")
    model = replace(preset_config(spec.model, spec.vocab_size), loss_chunks=spec.loss_chunks)
    if model.n_experts and spec.precision == "fp32":
        raise ValueError(f"trainer.precision=fp32 with model={spec.model}: fake tensors take the experts' grouped "
                         "matmul in bf16 only (torch has no fp32 shape rule for it); estimate MoE models in bf16")
    base = TrainConfig()
    cfg = replace(
        base, model=model,
        # ns_dtype: what "auto" picks on a GPU (bf16 Newton-Schulz); on the CPU it would time a matmul.
        optim=replace(base.optim, name=spec.optim, muon=replace(base.optim.muon, ns_dtype=spec.precision)),
        trainer=replace(base.trainer, precision=spec.precision, batch_size=spec.batch_size, seq_len=spec.seq_len,
                        grad_accum=1, device="cpu", activation_checkpointing=spec.activation_checkpointing),
        parallel=replace(base.parallel, dp_replicate=spec.dp_replicate, dp_shard=spec.dp_shard, tp=spec.tp,
                         ep=spec.ep, simulate_world=spec.world_size, simulate_rank=spec.rank),
    )
    validate(cfg)
    check_layout(spec.world_size, layout_keys(cfg.parallel))
    check_tp_divisibility(model, spec.tp, split_experts=spec.ep == 1)
    check_ep(model, spec.ep)
    return cfg


# ---- FakeTensorMode that module.to / to_empty can work under ----


class _FreshOutputConverter(FakeTensorConverter):
    """Does not memoise the fake tensors it wraps around ops' fresh meta outputs: the memo's
    weak reference is what makes torch.utils.swap_tensors (nn.Module.to, to_empty) refuse a
    fake parameter. Those outputs are new tensors that no later conversion looks up; real
    tensors brought into the mode are still memoised."""

    def set_tensor_memo(self, t: torch.Tensor, v: torch.Tensor) -> None:
        if t.device.type != "meta":
            super().set_tensor_memo(t, v)


def fake_mode() -> FakeTensorMode:
    mode = FakeTensorMode()
    old = mode.fake_tensor_converter
    mode.fake_tensor_converter = _FreshOutputConverter(copy_data=old.meta_converter.copy_data, export=old.export)
    return mode


# ---- What the GPU's kernels keep, where the CPU's differ ----


class FusedRMSNorm(torch.autograd.Function):
    """RMSNorm keeping for its backward what CUDA's fused kernel keeps (the input and 1/rms),
    where the CPU's decomposition also keeps the normalised product."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, weight)
        y = x * rstd
        return y * weight if weight is not None else y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        normed = x * rstd
        g = grad * weight if weight is not None else grad
        grad_x = rstd * (g - normed * (g * normed).mean(-1, keepdim=True))
        grad_w = (grad * normed).flatten(0, -2).sum(0) if weight is not None and ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def fused_rms_norm(x: torch.Tensor, normalized_shape: list[int], weight: Optional[torch.Tensor] = None,
                   eps: Optional[float] = None) -> torch.Tensor:
    """F.rms_norm with CUDA's memory behaviour (FusedRMSNorm) over a trailing dimension."""
    if len(normalized_shape) != 1:
        return _CPU_RMS_NORM(x, normalized_shape, weight, eps)
    return FusedRMSNorm.apply(x, weight, torch.finfo(x.dtype).eps if eps is None else eps)


_CPU_RMS_NORM = F.rms_norm


@contextlib.contextmanager
def gpu_kernels() -> Iterator[None]:
    """F.rms_norm as CUDA runs it, for the model's RMSNorm (model/gpt.py calls F.rms_norm). The
    function itself is swapped, not intercepted by a TorchFunctionMode: the recompute of a
    checkpointed block runs in the backward, outside any such mode, and must run the same ops
    as the forward did."""
    F.rms_norm = fused_rms_norm
    try:
        yield
    finally:
        F.rms_norm = _CPU_RMS_NORM


@contextlib.contextmanager
def gpu_newton_schulz() -> Iterator[None]:
    """Newton-Schulz's scratch memory as on a GPU, by optim/newton_schulz.py's two CPU settings:
    whole batches of matrices at once (the CPU cuts them into cache-sized runs,
    CPU_WORKING_SET_BYTES), and scratch buffers freed when done (the CPU keeps the most recent
    ones for the next call, _CPU_BUFFERS_KEPT)."""
    kept = newton_schulz.CPU_WORKING_SET_BYTES, newton_schulz._CPU_BUFFERS_KEPT
    newton_schulz.CPU_WORKING_SET_BYTES, newton_schulz._CPU_BUFFERS_KEPT = None, 0
    try:
        yield
    finally:
        newton_schulz.CPU_WORKING_SET_BYTES, newton_schulz._CPU_BUFFERS_KEPT = kept
        newton_schulz.release_buffers()


class BalancedRouting:
    """Answers the host reads of expert parallelism's routed-token counts (the tracker passes
    them here), which fake tensors cannot, with balanced counts: `per_expert` pairs for every
    expert, set before each MoE layer's forward (`watch`). Any other read of a value to the host
    is an error."""

    def __init__(self) -> None:
        self.per_expert: Optional[int] = None

    def watch(self, model: nn.Module, tp_rank: int, tp: int) -> None:
        for layer in model.modules():
            if isinstance(layer, MoE):
                layer.register_forward_pre_hook(self._pre_hook(layer, tp_rank, tp))

    def _pre_hook(self, layer: MoE, tp_rank: int, tp: int):
        def hook(module: nn.Module, args: tuple) -> None:
            pairs = args[0].shape[0] * args[0].shape[1] * layer.top_k
            # Under TP each rank sends its contiguous part of the sorted pairs (MoE._experts_over_ep).
            per_rank = -(-pairs // tp)
            lo = min(pairs, tp_rank * per_rank)
            part = min(pairs, lo + per_rank) - lo
            if part % layer.n_experts:
                raise ValueError(f"an EP estimate routes {part} (token, expert) pairs per rank evenly over "
                                 f"model.n_experts={layer.n_experts}: choose a batch_size x seq_len that makes them divide")
            self.per_expert = part // layer.n_experts
        return hook

    def host_value(self) -> int:
        if self.per_expert is None:
            raise RuntimeError("the step read a tensor's value to the host outside expert parallelism's "
                               "dispatch: a fake tensor has none")
        return self.per_expert


# ---- The tracker, told of our optimizer ----


class _NestedBackwardModTracker(ModTracker):
    """torch's ModTracker (which module runs, forward or backward), for a forward that runs a
    backward of its own: the chunked loss (model/chunked_loss.py) takes each slice's gradients
    with torch.autograd.grad. That backward's end resets the tracker's stack of running modules,
    and the modules still running then leave names the stack no longer holds: those are let go,
    where the tracker would fail the run."""

    def _get_pop_fn(self, w_mod, name, is_bw):
        pop = super()._get_pop_fn(w_mod, name, is_bw)

        def fn(*args):
            if name in self.parents or self.is_bw:
                pop(*args)

        return fn


class _StepTracking:
    """What both trackers add: each phase's peak and the most gathered at once (the tracker
    keeps the categories at each module's peak only), an optimizer phase for an OptimizerSet,
    and the answers fake tensors cannot give (BalancedRouting)."""

    def _init_step_tracking(self, routing: BalancedRouting) -> None:
        self._mod_tracker = _NestedBackwardModTracker()
        self.routing = routing
        self.reset_maxima()

    def reset_maxima(self) -> None:
        # The tracker's own category keys (enum members) that make each part.
        self._part_keys = {name: [k for k in self._ref_class if k.value in labels]
                           for name, labels in PART_CATEGORIES.items()}
        self.maxima: dict[str, int] = {}
        self.phase_peaks: dict[str, dict[str, int]] = {}

    def current(self) -> dict[str, int]:
        """This device's bytes by tracker category, "Total" included."""
        snap = self.get_tracker_snapshot("current").get(CPU, {})
        return {_label(k): int(v) for k, v in snap.items()}

    def _update_peak_stats(self, peak_state) -> None:
        """After every op. Replaces the tracker's own bookkeeping of each module's peak, which
        walks every tracked module per op and is most of the tracker's cost; the estimate needs
        only the step's peak and each part's maximum. Reads the live counts in place."""
        now = self._curr_mem_snap.get(CPU)
        if not now:
            return
        for name, keys in self._part_keys.items():
            value = sum(now.get(k, 0) for k in keys)
            if value > self.maxima.get(name, 0):
                self.maxima[name] = value
        phase = "optimizer" if self._in_opt else "forward_backward"
        if now["Total"] > self.phase_peaks.get(phase, {}).get("Total", 0):
            self.phase_peaks[phase] = {_label(k): v for k, v in now.items() if v}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Asking a tensor its device allocates nothing: past the tracker's bookkeeping (a third
        # of the ops a step dispatches).
        if func is torch.ops.prim.device.default:
            return func(*args, **(kwargs or {}))
        if func is torch.ops.aten._local_scalar_dense.default:
            return self.routing.host_value()
        return super().__torch_dispatch__(func, types, args, kwargs)

    @contextlib.contextmanager
    def optimizer_phase(self) -> Iterator[None]:
        """What is allocated inside counts as the optimizer's (the tracker's OPT category)."""
        self._in_opt = True
        try:
            yield
        finally:
            self._in_opt = False


class StepFSDPTracker(_StepTracking, FSDPMemTracker):
    def __init__(self, model: nn.Module, routing: BalancedRouting) -> None:
        super().__init__(model)
        self._init_step_tracking(routing)


class StepTracker(_StepTracking, MemTracker):
    def __init__(self, routing: BalancedRouting) -> None:
        super().__init__()
        self._init_step_tracking(routing)

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        # A module called again within one forward (the chunked loss calls the head once per
        # slice) has its parameters tracked already; the tracker would refuse the second call
        # as a second iteration.
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            return
        super()._pre_fw_hook(module, inputs)

    def _register_global_optimizer_hook(self) -> None:
        """None: torch's optimizer hooks would end the optimizer phase after the first of the
        OptimizerSet's optimizers; `optimizer_phase` spans them all."""


def _label(category: Any) -> str:
    return category.value if hasattr(category, "value") else str(category)


# Which tracker categories make each reported part (FSDP2's names, then MemTracker's).
PART_CATEGORIES: dict[str, tuple[str, ...]] = {
    "gathered": ("Unsharded Param", "All Gather"),
}


# ---- The estimate ----


def estimate_memory(spec: EstimateSpec) -> MemoryEstimate:
    """Rank spec.rank's memory in one steady training step of spec's layout (module doc).
    Makes, and at the end destroys, this process's fake process group."""
    cfg = train_config(spec)
    start = time.perf_counter()
    mesh = init_simulated_mesh(layout_keys(cfg.parallel), spec.world_size, spec.rank, CPU)
    try:
        with fake_mode(), gpu_newton_schulz():
            return _measure(cfg, spec, mesh, start)
    finally:
        dist.destroy_process_group()


def _measure(cfg: TrainConfig, spec: EstimateSpec, mesh, start: float) -> MemoryEstimate:
    vocab = cfg.model.vocab_size
    model = build_model(cfg, vocab, mesh, CPU)
    routing = BalancedRouting()
    routing.watch(model, mesh.tp_rank, mesh.tp)
    sharded = isinstance(model, FSDPModule)
    tracker: StepFSDPTracker | StepTracker
    if sharded:
        tracker = StepFSDPTracker(model, routing)
    else:
        tracker = StepTracker(routing)
        tracker.track_external(model)
    tokens = torch.randint(0, vocab, (spec.batch_size, spec.seq_len))
    targets = torch.randint(0, vocab, (spec.batch_size, spec.seq_len))
    with tracker:
        with tracker.optimizer_phase():
            optimizer = build_optimizer(model, cfg.optim, cfg.model, mesh)
            # A step on zero gradients: the optimizer state exists from here on, as in a run.
            for p in model.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
            optimizer.prepare_grads(cfg.optim.grad_clip)
            optimizer.step()
            optimizer.zero_grad()
        tracker.reset_maxima()
        with gpu_kernels():  # the backward too: a checkpointed block reruns its forward there
            with dev.autocast(CPU, cfg.trainer.precision):
                loss = model(tokens, targets)
            after_forward = tracker.current()
            loss.backward()
            del loss
        after_backward = tracker.current()
        with tracker.optimizer_phase():
            optimizer.prepare_grads(cfg.optim.grad_clip)
            optimizer.step()
        after_step = tracker.current()
        optimizer.zero_grad()
    state = optimizer.state_bytes()
    grads = sum(after_backward.get(c, 0) for c in ("Sharded Grad", "Unsharded Grad", "Gradient"))
    at_peak = tracker.phase_peaks["forward_backward"]
    # Under ZeRO-1 the optimizer also holds flat gradient buffers beside its state.
    buffers = max(0, after_step.get("OptState", after_step.get("Optstate", 0)) - state)
    return MemoryEstimate(
        spec=spec,
        params=sum(after_step.get(c, 0) for c in ("Sharded Param", "Parameter")),
        grads=grads + buffers,
        optimizer_state=state,
        # what the activations and their gradients take at the forward-backward peak
        activations=at_peak.get("Activation", 0) + at_peak.get("Temp", 0),
        gathered=tracker.maxima.get("gathered", 0),
        peak=max(p["Total"] for p in tracker.phase_peaks.values()),
        phase_peaks=tracker.phase_peaks,
        after_forward={k: v for k, v in after_forward.items() if v and k != "Total"},
        seconds=time.perf_counter() - start,
    )
