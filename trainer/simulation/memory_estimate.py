"""One rank's memory in one training step of any layout, measured without allocating it.

`estimate_memory` builds this project's real model (trainer/build.py's build_model: TP, EP,
activation checkpointing, FSDP2, the chunked loss) and real optimizer (optim/builder.py's
build_optimizer) for rank `rank` of the layout, over torch's fake process groups
(parallel/mesh.py, init_simulated_mesh), entirely under FakeTensorMode: every tensor has its
real shape, dtype and aliasing but no storage, so an 8B model's step costs seconds of CPU and no
memory. It runs a training step as trainer/loop.py does (forward under autocast, backward,
prepare_grads, the optimizer step, zero_grad) under torch's FSDP2 memory tracker
(torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker; mem_tracker.MemTracker where FSDP2
is not applied), which follows every storage from its allocation to its release. The step
measured is a run's first, whose optimizer step makes the optimizer state; `steady` then puts
that state where a later step has it (through the forward and backward, and in the optimizer
step from its start: each state tensor's making is known), which is exact where a second
step would cost a third more.

What it reports, per rank (bytes; scripts/plan/estimate_memory.py prints them):
  params           the rank's fp32 parameters (FSDP2: its shards)
  grads            its fp32 gradients once the backward is done (FSDP2: the sharded ones), and
                   under ZeRO-1 the optimizer's flat buffers (where planning/memory_plan.py counts them)
  optimizer_state  the optimizer's state tensors (OptimizerSet.state_bytes)
  activations      the activations and their gradients at the forward-backward peak (the
                   tracker's "Activation" and "Temp" then)
  gathered         the most FSDP2 holds gathered at once (the bf16 all-gather outputs and the
                   unsharded parameters made from them)
  peak             the largest total of everything live, at any point of the step
and, for each phase (the forward and backward, the optimizer), the tracker's categories at
that phase's peak, and when the forward returns.

Caveats (torch 2.13, CPU build), each found by running it (the pieces that handle them:
trainer/simulation/gpu_stand_ins.py):
- The device is the CPU. Fake CUDA tensors can be made, but autograd asks the CUDA runtime for
  their device, which a CPU-only build lacks, and torch.autocast("cuda") turns itself off. So
  the step runs CPU kernels under CPU autocast; where their memory differs from the GPU's, the
  estimate follows the GPU:
  * F.rms_norm: the CPU decomposes it into five ops and also keeps the normalised product,
    CUDA's fused kernel keeps only the input and 1/rms: `gpu_kernels` swaps in
    `fused_rms_norm`, which keeps what the fused kernel keeps;
  * Newton-Schulz (optim/muon/newton_schulz.py): the CPU cuts a batch of matrices into cache-sized
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
  token and MoE layer that a real run keeps (planning/memory_plan.py counts them).
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
  of its cost, is replaced by the step's peak and each phase's (`_StepTracking`), and its
  module tracker watches FSDP2's units (or the root) only; torch's ModTracker fails on a
  forward that runs a backward of its own (the chunked loss): `_StepModTracker` lets that pass.
  Without FSDP2 a checkpointed block's recompute then counts as "Temp", not "Activation".
- The tracker labels what FSDP2 gathers "Unsharded Param" (the parameters, views of the
  all-gather output) and "All Gather" (the output while FSDP2 keeps it, until the next
  all-gather); their sum is `gathered`. The backward's allocations are "Temp" (gradients of
  activations, FSDP2's fp32 copies of gradients for the reduce-scatter), the unsharded
  parameters' gradients "Unsharded Grad"; under FSDP2 a checkpointed block's recompute counts
  as "Activation" (the tracker sees the unit's forward hook in the backward).
- Process groups and the swapped settings above are global state: one estimate at a time in a
  process. Each call makes its own fake group and destroys it at the end, so calls may follow
  one another; scripts/plan/estimate_memory.py runs one per process.
- Cost: 4-16 s of CPU an estimate for gpt_1b to moe_16b (2-core machine), about a quarter of
  it building the model, the rest the fake dispatch and the tracker, op by op.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed._tools.mod_tracker import ModTracker
from torch.distributed.fsdp import FSDPModule

from trainer.simulation.gpu_stand_ins import BalancedRouting, fake_mode, gpu_kernels, gpu_newton_schulz
from model.presets import preset_config
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
    vocab_size: int = 0  # 0: the preset's own vocabulary (model/presets.py PRESET_VOCAB)
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


# ---- The tracker, told of our optimizer ----


class _StepModTracker(ModTracker):
    """torch's ModTracker (which module runs, forward or backward), for the modules the tracker
    asks about only (`watched`: FSDP2's units, or the root without FSDP2): its hooks on every
    module call cost a tenth of an estimate, and whether the backward runs it reads from
    autograd itself. And for a forward that runs a backward of its own: the chunked loss
    (model/chunked_loss.py) takes each slice's gradients with torch.autograd.grad, whose end
    resets the tracker's stack of running modules; the modules still running then leave names
    the stack no longer holds, which are let go where the tracker would fail the run."""

    def __init__(self, watched: Callable[[nn.Module], bool]) -> None:
        super().__init__()
        self.watched = watched

    def _fw_pre_hook(self, mod, input):
        if self.watched(mod):
            super()._fw_pre_hook(mod, input)

    def _fw_post_hook(self, mod, input, output):
        if self.watched(mod):
            super()._fw_post_hook(mod, input, output)

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

    def _init_step_tracking(self, routing: BalancedRouting, watched: Callable[[nn.Module], bool]) -> None:
        self._mod_tracker = _StepModTracker(watched)
        self.routing = routing
        # The tracker's own category keys (enum members) that make each part.
        self._part_keys = {name: [k for k in self._ref_class if k.value in labels]
                           for name, labels in PART_CATEGORIES.items()}
        self.maxima: dict[str, int] = {}
        self.phase_peaks: dict[str, dict[str, int]] = {}
        self._ops = 0  # ops dispatched so far: when each storage was made
        self._optimizer_trace: list[tuple[int, dict]] = []  # (op, live bytes by category) in the optimizer

    def _track(self, reftype, t: torch.Tensor) -> None:
        super()._track(reftype, t)
        if not self._in_opt:
            return  # the optimizer state is made in the optimizer phase: what `steady` needs
        for st in get_untyped_storages(t):
            winfo = self._WINFO.get(st, (None, None))[0]
            if winfo is not None and not hasattr(winfo, "made_at"):
                winfo.made_at = self._ops

    def current(self) -> dict[str, int]:
        """This device's bytes by tracker category, "Total" included."""
        snap = self.get_tracker_snapshot("current").get(CPU, {})
        return {_label(k): int(v) for k, v in snap.items()}

    def _update_peak_stats(self, peak_state) -> None:
        """After every op. Replaces the tracker's own bookkeeping of each module's peak, which
        walks every tracked module per op and is most of the tracker's cost; the estimate needs
        only the step's peak and each part's maximum. Reads the live counts in place."""
        self._ops += 1
        now = self._curr_mem_snap.get(CPU)
        if not now:
            return
        for name, keys in self._part_keys.items():
            value = sum(now.get(k, 0) for k in keys)
            if value > self.maxima.get(name, 0):
                self.maxima[name] = value
        if self._in_opt:
            self._optimizer_trace.append((self._ops, dict(now)))
        elif now["Total"] > self.phase_peaks.get("forward_backward", {}).get("Total", 0):
            self.phase_peaks["forward_backward"] = {_label(k): v for k, v in now.items() if v}

    @property
    def opt_label(self) -> str:
        """The optimizer state's category ("OptState" under FSDP2, else "Optstate")."""
        return next(k for k in (_label(c) for c in self._ref_class) if k.lower() == "optstate")

    def steady(self, state: Iterable[torch.Tensor]) -> int:
        """Turn the first step's peaks into a steady step's, given the optimizer `state` that
        step made; returns its bytes. A steady step holds all of it through the forward and
        backward, and through its optimizer step from the start, where the first step made it
        on the way (each state storage's making is known: `_track`)."""
        made = {}
        for t in state:
            for st in get_untyped_storages(t):
                winfo = self._WINFO.get(st, (None, None))[0]
                if winfo is not None:
                    made[id(winfo)] = (getattr(winfo, "made_at", 0), winfo.mem_consumed)
        total = sum(size for _, size in made.values())
        fb, opt_label = self.phase_peaks["forward_backward"], self.opt_label
        fb[opt_label] = fb.get(opt_label, 0) + total
        fb["Total"] += total
        times, so_far, best = sorted(made.values()), 0, None
        i = 0
        for op, now in self._optimizer_trace:
            while i < len(times) and times[i][0] <= op:
                so_far += times[i][1]
                i += 1
            missing = total - so_far
            if best is None or now["Total"] + missing > best[0]:
                best = (now["Total"] + missing, now, missing)
        if best is not None:
            peak = {_label(k): v for k, v in best[1].items() if v}
            peak[opt_label] = peak.get(opt_label, 0) + best[2]
            peak["Total"] = best[0]
            self.phase_peaks["optimizer"] = peak
        return total

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
        self._init_step_tracking(routing, lambda module: isinstance(module, FSDPModule))


class StepTracker(_StepTracking, MemTracker):
    """MemTracker for a model without FSDP2: its hooks on the root alone track every parameter
    and gradient (the root's parameters are all of them)."""

    def __init__(self, model: nn.Module, routing: BalancedRouting) -> None:
        super().__init__()
        self._init_step_tracking(routing, lambda module: module is model)
        self.track_external(model)

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
    tracker = StepFSDPTracker(model, routing) if sharded else StepTracker(model, routing)
    tokens = torch.randint(0, vocab, (spec.batch_size, spec.seq_len))
    targets = torch.randint(0, vocab, (spec.batch_size, spec.seq_len))
    with tracker:
        with tracker.optimizer_phase():
            optimizer = build_optimizer(model, cfg.optim, cfg.model, mesh)
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
            optimizer.zero_grad()  # in the phase: torch's zero_grad dispatches profiler ops
        tracker.steady(optimizer.state_tensors())
    state = optimizer.state_bytes()
    after_forward[tracker.opt_label] = after_forward.get(tracker.opt_label, 0) + state
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
