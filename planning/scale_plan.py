"""What a training step costs per GPU, for four ZeRO-1 optimizer designs, at any layout.

Exact from shapes alone: the bytes every collective moves and the Newton-Schulz FLOPs each
rank runs (our design's LPT plan is the real one, optim/zero_plan.py). Predicted from a
hardware profile (conf/hardware/*.yaml): times, by the alpha-beta model of planning/collectives.py,
a matmul rate and an HBM bandwidth. Each design's per-rank memory is planning/memory_plan.py's
(planned_memory: the step's peak, under activation checkpointing and chunked loss as asked).
lab/tools/bench/bench_comm.py prints the exact part at the layouts this machine runs;
scripts/plan/plan_scale.py prints all of it from 8 to 1,024 GPUs.

Designs, per optimizer step and per rank:
  adamw-zero1   AdamW, flat ZeRO-1: reduce-scatter grads + all-gather params.
  muon-ours     every Muon matrix owned whole by one DP rank, owners balanced by LPT on
                Newton-Schulz cost, AdamW filling the rest (optim/zero_plan.py).
  moonlight     a flat, concatenated partition: matrices that cross a DP shard boundary are
                DP-gathered and orthogonalised by every rank that holds part of them.
  megatron-poc  a bucketed layout that splits every parameter across DP: every matrix is
                DP-gathered and every DP rank repeats every Newton-Schulz.
  adamw-fsdp    FSDP2 over all of DP (parallel.dp_shard = dp), AdamW on the shards.
  muon-fsdp     the same with our sharded Muon (optim/muon/row_sharded.py): whole matrices at LPT
                owners, reached by two all-to-alls.
  adamw-hsdp    HSDP: FSDP2 within a node (dp_shard = GPUs per node / TP), replicas across nodes.
  muon-hsdp     the same with our sharded Muon.
  adamw-ep      MoE models, expert parallelism (parallel.ep): each rank holds n_experts / ep whole
                experts; ZeRO-1 over DP for the dense parameters and over the ranks holding the
                same experts for the experts; the routed tokens travel by all-to-all.
  muon-ep       the same with our ZeRO-1 Muon (each expert stack owned whole).

Conventions: gradients and parameters move in fp32 (4 bytes); the baselines' extra momentum
gathers in bf16 (2 bytes), as Moonlight and the Megatron proof of concept do. Byte counts are
the full buffer of each collective (parallel/comm.py). TP bytes are the Newton-Schulz TP traffic
of tp_mode=gather (the momentum all-gather of TP-sharded matrices). Newton-Schulz FLOPs:
5 steps of 4 m^2 n + 2 m^3 per m x n matrix (m <= n), on full matrices.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from planning.collectives import Link, all_reduce_s, ring_all_gather_s, ring_reduce_scatter_s
from eval.flops import train_flops_per_token
# The parameter inventory and the memory formulas live in planning/memory_plan.py (local_params and
# fsdp_memory are still importable from here, where this module's users found them).
from planning.memory_plan import (ROOT_UNIT, Local, fsdp_memory, fsdp_padded_numel, fsdp_unit_numels, local_params,
                              planned_memory)
from model.config import ModelConfig
from parallel.mesh import Layout
from optim.zero_plan import ParamSpec, ZeroPlan, build_plan

DESIGNS = ("adamw-zero1", "muon-ours", "moonlight", "megatron-poc", "adamw-fsdp", "muon-fsdp", "adamw-hsdp",
           "muon-hsdp", "adamw-ep", "muon-ep")
FSDP_DESIGNS = DESIGNS[4:8]
EP_DESIGNS = DESIGNS[8:]
REPO = Path(__file__).resolve().parents[1]
# HBM bytes per owned element of one optimizer update (fp32): AdamW reads p, g, m, v and writes
# p, m, v; Muon reads g, m, the orthogonalised update and p, and writes m, the Newton-Schulz
# input and p (the Newton-Schulz matmuls themselves are counted as FLOPs).
ADAMW_BYTES_PER_ELEMENT = 28
MUON_BYTES_PER_ELEMENT = 32


# ---- FSDP2 (parallel/fsdp.py, optim/muon/row_sharded.py): per-rank bytes ----


def fsdp_dp_bytes(params: list[Local], n: int, micro_batches: int = 1, param_bytes: int = 2,
                  reshard_after_forward: bool = True) -> dict[str, float]:
    """Per rank and optimizer step, as parallel/comm.py counts FSDP2's collectives (an
    all-gather by its output, a reduce-scatter by its input): every micro-batch gathers each
    block's parameters before its forward and, resharded after it, again before its backward,
    and the root's once (it stays gathered to the backward); the gradients are reduce-scattered
    once a step, in fp32."""
    units = fsdp_unit_numels(params, n)
    per_micro = sum(numel * (1 if unit == ROOT_UNIT or not reshard_after_forward else 2)
                    for unit, numel in units.items())
    return {"all_gather": micro_batches * per_micro * param_bytes, "reduce_scatter": 4 * sum(units.values())}


def muon_exchange_bytes_per_rank(params: list[Local], n: int, ns_bytes: int = 2) -> float:
    """ShardedMuon's two all-to-alls, per rank on average (optim/muon/row_sharded.exchange_bytes
    over the group, divided by n): each 2-D matrix once to its owner in fp32, once back in the
    Newton-Schulz dtype. Expert stacks stay where they are."""
    if n == 1:
        return 0.0
    return (4 + ns_bytes) * sum(p.numel for p in params if p.muon and len(p.shape) == 2) / n


def tp_gather_bytes(p: Local, tp: int) -> int:
    return 4 * p.full_numel if (p.muon and p.tp_sharded and tp > 1) else 0


def our_plan(params: list[Local], dp: int) -> ZeroPlan:
    """The ZeRO-1 plan ZeroOptimizer builds for these parameters (owners by LPT)."""
    return build_plan([ParamSpec(i, p.numel, p.matrices if p.muon else ()) for i, p in enumerate(params)], dp)


@dataclass
class DesignRow:
    """One design's optimizer work per step and per rank (bytes and FLOPs are exact)."""

    dp_bytes: float  # reduce-scatter + all-gather of the flat buffer, plus any momentum gathers
    extra_dp_bytes: float  # of which momentum gathers (bf16), beyond AdamW ZeRO-1's traffic
    tp_bytes: float  # Newton-Schulz momentum all-gathers over TP, mean per rank
    ns_max: float  # Newton-Schulz FLOPs of the busiest rank
    ns_mean: float
    state: float  # optimizer-state bytes of the largest rank
    muon_elements: float  # Muon elements the busiest rank updates (elementwise work)
    adamw_elements: float
    plan_costs: list[int] = field(default_factory=list)  # muon-ours: LPT cost per rank
    idle_ranks: int = 0  # muon-ours: DP ranks that own no Muon matrix
    ep_bytes: float = 0.0  # EP designs: the token all-to-alls' bytes (what the rank sends)


def design_rows(params: list[Local], dp: int, tp: int) -> dict[str, DesignRow]:
    total = sum(p.numel for p in params)
    muon_ps = [p for p in params if p.muon]
    rows: dict[str, DesignRow] = {}

    flat = math.ceil(total / dp) * dp
    rows["adamw-zero1"] = DesignRow(2 * 4 * flat, 0, 0, 0, 0, 8 * flat / dp, 0, flat / dp)

    plan = our_plan(params, dp)
    ns = [sum(params[s.param].ns_flops for s in r.muon) for r in plan.ranks]
    muon_el = [sum(s.length for s in r.muon) for r in plan.ranks]
    adamw_el = [sum(s.length for s in r.adamw) for r in plan.ranks]
    # Muon: momentum; AdamW: two moments, and a 4-byte step count per piece.
    state = [4 * m + 8 * a + 4 * len(r.adamw) for m, a, r in zip(muon_el, adamw_el, plan.ranks)]
    tpb = [sum(tp_gather_bytes(params[s.param], tp) for s in r.muon) for r in plan.ranks]
    busiest = max(range(dp), key=lambda r: ns[r])
    rows["muon-ours"] = DesignRow(2 * 4 * plan.total, 0, sum(tpb) / dp, max(ns), sum(ns) / dp, max(state),
                                  muon_el[busiest], adamw_el[busiest], [r.ns_cost for r in plan.ranks],
                                  sum(1 for r in plan.ranks if not r.muon))

    # Moonlight: flat partition in parameter order, chunk = ceil(total / dp).
    chunk = math.ceil(total / dp)
    ns_r, extra, tp_r, state_r = [0.0] * dp, 0, [0.0] * dp, [0.0] * dp
    muon_r, adamw_r = [0.0] * dp, [0.0] * dp
    offset = 0
    for p in params:
        first, last = offset // chunk, (offset + p.numel - 1) // chunk
        for r in range(first, last + 1):
            part = min(offset + p.numel, (r + 1) * chunk) - max(offset, r * chunk)
            state_r[r] += (4 if p.muon else 8) * part
            if p.muon:
                ns_r[r] += p.ns_flops
                tp_r[r] += tp_gather_bytes(p, tp)
                muon_r[r] += p.numel  # a crossing matrix is updated whole by each holder
            else:
                adamw_r[r] += part
        if p.muon and last > first:
            extra += 2 * p.numel  # bf16 DP all-gather of the momentum
        offset += p.numel
    busiest = max(range(dp), key=lambda r: ns_r[r])
    rows["moonlight"] = DesignRow(2 * 4 * flat + extra, extra, sum(tp_r) / dp, max(ns_r), sum(ns_r) / dp,
                                  max(state_r), muon_r[busiest], adamw_r[busiest])

    # Megatron PoC: every parameter split over DP, every matrix gathered, NS on every rank.
    ns_all = sum(p.ns_flops for p in muon_ps)
    extra = sum(2 * p.numel for p in muon_ps) if dp > 1 else 0
    muon_total = sum(p.numel for p in muon_ps)
    rows["megatron-poc"] = DesignRow(2 * 4 * flat + extra, extra, sum(tp_gather_bytes(p, tp) for p in muon_ps),
                                     ns_all, ns_all, sum((4 if p.muon else 8) * p.numel for p in params) / dp,
                                     muon_total, (total - muon_total) / dp)
    return rows


@dataclass(frozen=True)
class Hardware:
    """A GPU and its node, as conf/hardware/<name>.yaml describes them (sources there)."""

    name: str
    matmul_tflops: float  # achieved dense matmul rate in the training precision
    hbm_gb: float
    hbm_tb_s: float
    nvlink_gb_s: float  # per GPU and direction
    nvlink_latency_us: float
    ib_gb_s: float  # per GPU and direction (one NIC per GPU)
    ib_latency_us: float
    gpus_per_node: int

    @classmethod
    def load(cls, name_or_path: str) -> "Hardware":
        path = Path(name_or_path)
        if not path.suffix:
            path = REPO / "conf" / "hardware" / f"{name_or_path}.yaml"
        if not path.exists():
            known = ", ".join(sorted(p.stem for p in (REPO / "conf" / "hardware").glob("*.yaml")))
            raise FileNotFoundError(f"hardware profile {name_or_path!r}: no {path} (known: {known})")
        fields = yaml.safe_load(path.read_text())
        missing = [f for f in cls.__dataclass_fields__ if f not in fields]
        if missing:
            raise ValueError(f"{path}: missing {', '.join(missing)}")
        return cls(**{f: fields[f] for f in cls.__dataclass_fields__})

    @property
    def matmul_flops(self) -> float:
        return self.matmul_tflops * 1e12

    @property
    def hbm_bytes_s(self) -> float:
        return self.hbm_tb_s * 1e12

    @property
    def nvlink(self) -> Link:
        return Link(self.nvlink_gb_s * 1e9, self.nvlink_latency_us * 1e-6)

    @property
    def ib(self) -> Link:
        return Link(self.ib_gb_s * 1e9, self.ib_latency_us * 1e-6)

    def dp_link(self, dp: int, tp: int) -> Link:
        """TP ranks fill a node first, so a DP group stays inside one node only when the
        whole job does."""
        return self.nvlink if dp * tp <= self.gpus_per_node else self.ib


@dataclass(frozen=True)
class MicroBatch:
    """One rank's forward pass, as the memory plan needs it (planning/memory_plan.planned_memory):
    `batch_size` sequences of `seq_len` tokens, bf16, with activation checkpointing and the
    loss's chunks as the trainer would run them."""

    cfg: ModelConfig
    batch_size: int
    seq_len: int
    checkpointing: str = "none"
    loss_chunks: int = 1

    def memory(self, layout: Layout, optim: str) -> dict[str, float]:
        return planned_memory(self.cfg, layout, optim, self.batch_size, self.seq_len, self.checkpointing,
                              self.loss_chunks)


@dataclass
class Step:
    """One (design, layout): per-rank memory (bytes; "total" the peak) and predicted times (seconds)."""

    design: str
    dp: int
    tp: int
    row: DesignRow
    memory: dict[str, float]
    times: dict[str, float]
    ep: int = 1

    def layout(self) -> str:
        """ "dp x tp", and the EP size where there is one """
        return f"{self.dp} x {self.tp}" + (f", ep {self.ep}" if self.ep > 1 else "")

    @property
    def optimizer_s(self) -> float:
        return sum(v for k, v in self.times.items() if k.startswith("opt_"))

    @property
    def step_s(self) -> float:
        return sum(self.times.values())

    @property
    def overhead(self) -> float:
        """The optimizer step (its DP/TP traffic included) as a fraction of the whole step."""
        return self.optimizer_s / self.step_s

    @property
    def memory_total(self) -> float:
        """The rank's peak (planned_memory's total; the parts peak at different moments)."""
        return self.memory["total"]


def tp_sizes(cfg: ModelConfig, gpus: int, hw: Hardware) -> list[int]:
    """TP sizes that divide every split dimension, the GPU count, and fit in one node."""
    sizes = []
    tp = 1
    while tp <= min(gpus, hw.gpus_per_node):
        dims = [cfg.n_heads, cfg.n_kv_heads, cfg.ffn_hidden] + ([cfg.expert_hidden or cfg.ffn_hidden] if cfg.n_experts else [])
        if gpus % tp == 0 and all(d % tp == 0 for d in dims):
            sizes.append(tp)
        tp *= 2
    return sizes


def predict(cfg: ModelConfig, hw: Hardware, dp: int, tp: int, tokens_per_step: int, seq_len: int,
            micro_batch: int, params: Optional[list[Local]] = None, checkpointing: str = "none",
            loss_chunks: int = 1) -> dict[str, Step]:
    """Every design at one layout. `micro_batch` sequences per rank per forward pass, under
    activation checkpointing `checkpointing` and the loss in `loss_chunks` slices."""
    params = params if params is not None else local_params(cfg, tp)
    rows = design_rows(params, dp, tp)
    local_numel = sum(p.numel for p in params)
    tokens_per_rank = tokens_per_step / dp
    micro_steps = max(1, math.ceil(tokens_per_rank / (seq_len * micro_batch)))
    micro = MicroBatch(cfg, micro_batch, seq_len, checkpointing, loss_chunks)
    # This trainer's ZeRO-1 designs, as planned_memory has them; the two baselines differ in
    # their optimizer state and flat buffers only.
    zero1 = {optim: micro.memory(Layout(dp_replicate=dp, tp=tp), optim) for optim in ("adamw", "muon")}

    compute = train_flops_per_token(cfg, seq_len) * tokens_per_step / (dp * tp * hw.matmul_flops)
    # Megatron-style TP: an all-reduce of the block's bf16 output after attention and after the
    # MLP in the forward, and of the input gradient before each in the backward.
    per_call = 2 * seq_len * micro_batch * cfg.d_model
    tp_act = 4 * cfg.n_layers * micro_steps * all_reduce_s(per_call, tp, hw.nvlink) if tp > 1 else 0.0
    dp_link = hw.dp_link(dp, tp)

    steps = {}
    for design, row in rows.items():
        flat = row.dp_bytes - row.extra_dp_bytes
        times = {
            "compute": compute,
            "tp_activations": tp_act,
            # ZeRO-1: the gradient reduce-scatter and the parameter all-gather are not
            # overlapped with compute in this trainer (gather_buckets=1), so they count here.
            "opt_dp_reduce_scatter": ring_reduce_scatter_s(flat / 2, dp, dp_link),
            "opt_dp_all_gather": ring_all_gather_s(flat / 2, dp, dp_link),
            "opt_dp_momentum_gather": ring_all_gather_s(row.extra_dp_bytes, dp, dp_link) if row.extra_dp_bytes else 0.0,
            "opt_tp_momentum_gather": ring_all_gather_s(row.tp_bytes, tp, hw.nvlink),
            "opt_newton_schulz": row.ns_max / hw.matmul_flops,
            "opt_elementwise": (ADAMW_BYTES_PER_ELEMENT * row.adamw_elements
                                + MUON_BYTES_PER_ELEMENT * row.muon_elements) / hw.hbm_bytes_s,
        }
        # The design's own flat fp32 buffer (gradients in, parameters back: one of its two
        # collectives' bytes, padding included), its reduced gradient segment and its send
        # buffer. Ours pads to whole-matrix segments; the even splits pad to dp elements.
        flat_bytes = flat / 2
        zero_buffers = flat_bytes + 2 * flat_bytes / dp if dp > 1 else 0.0
        base = zero1["adamw" if design == "adamw-zero1" else "muon"]
        memory = dict(base, grads=4 * local_numel + zero_buffers, optimizer_state=row.state)
        # state and buffers are held through the whole step: the peak moves with them
        memory["total"] += memory["grads"] + row.state - base["grads"] - base["optimizer_state"]
        steps[design] = Step(design, dp, tp, row, memory, times)
    for design in FSDP_DESIGNS:
        step = fsdp_step(design, params, hw, dp, tp, micro_steps, compute, tp_act, micro)
        if step is not None:
            steps[design] = step
    return steps


def fsdp_step(design: str, params: list[Local], hw: Hardware, dp: int, tp: int, micro_steps: int,
              compute: float, tp_act: float, micro: MicroBatch) -> Optional[Step]:
    """An FSDP2 design (dp_shard = dp) or an HSDP one (dp_shard = the node's GPUs over TP,
    replicated across nodes), with our sharded Muon or AdamW; None where HSDP's groups do not
    divide the layout. Bytes are fsdp_dp_bytes and muon_exchange_bytes_per_rank, the formulas
    tests/test_fsdp_training.py checks against a counted run, memory planned_memory's; bf16
    all-gathers. FSDP2 overlaps its all-gathers (prefetched) and reduce-scatters (in the
    backward) with compute, so only what compute cannot hide counts; ShardedMuon's exchange,
    Newton-Schulz and TP gathers run in the optimizer step, like ZeRO-1's."""
    optim = design.split("-")[0]
    hsdp = design.endswith("hsdp")
    shard = min(dp, max(1, hw.gpus_per_node // tp)) if hsdp else dp
    if dp % shard or (hsdp and shard == dp):
        return None  # HSDP needs more than one node's worth of data parallelism
    replicate = dp // shard
    shard_link = hw.nvlink if shard * tp <= hw.gpus_per_node else hw.ib
    dp_bytes = fsdp_dp_bytes(params, shard, micro_steps, param_bytes=2)
    memory = fsdp_memory(params, shard, optim)
    shard_grads = memory["grads"]
    overlapped = (ring_all_gather_s(dp_bytes["all_gather"], shard, shard_link)
                  + ring_reduce_scatter_s(dp_bytes["reduce_scatter"], shard, shard_link)
                  + (all_reduce_s(shard_grads, replicate, hw.ib) if replicate > 1 else 0.0))
    exchange = muon_exchange_bytes_per_rank(params, shard) if optim == "muon" else 0.0
    if optim == "muon":
        plan = our_plan(params, shard)
        ns = [sum(params[s.param].ns_flops for s in r.muon) for r in plan.ranks]
        tp_bytes = sum(tp_gather_bytes(params[s.param], tp) for r in plan.ranks for s in r.muon) / shard
        ns_max, ns_mean = max(ns), sum(ns) / shard
    else:
        tp_bytes = ns_max = ns_mean = 0.0
    muon_elements = sum(fsdp_padded_numel(p.shape, shard) // shard for p in params if p.muon and optim == "muon")
    adamw_elements = sum(fsdp_padded_numel(p.shape, shard) // shard for p in params) - muon_elements
    total_dp = dp_bytes["all_gather"] + dp_bytes["reduce_scatter"] + (2 * shard_grads if replicate > 1 else 0.0)
    row = DesignRow(total_dp + exchange, exchange, tp_bytes, ns_max, ns_mean, memory["optimizer_state"],
                    muon_elements, adamw_elements)
    times = {
        "compute": compute,
        "tp_activations": tp_act,
        "dp_not_overlapped": max(0.0, overlapped - compute),
        # the two all-to-alls: each rank sends (n - 1) / n of its buffer, as in a ring
        "opt_dp_muon_exchange": ring_reduce_scatter_s(exchange, shard, shard_link) if exchange else 0.0,
        "opt_tp_momentum_gather": ring_all_gather_s(tp_bytes, tp, hw.nvlink),
        "opt_newton_schulz": ns_max / hw.matmul_flops,
        "opt_elementwise": (ADAMW_BYTES_PER_ELEMENT * adamw_elements
                            + MUON_BYTES_PER_ELEMENT * muon_elements) / hw.hbm_bytes_s,
    }
    # Between the micro-batches of an accumulation FSDP2 keeps the gradients unsharded (fp32):
    # no reduce-scatter until the last one.
    accumulated = 4 * sum(p.numel for p in params) if micro_steps > 1 else 0.0
    mem = micro.memory(Layout(dp_replicate=replicate, dp_shard=shard, tp=tp), optim)
    mem["grads"] += accumulated
    mem["total"] += accumulated
    return Step(design, dp, tp, row, mem, times)


# ---- Expert parallelism (parallel/expert_parallel.py, optim/zero.py's expert domain) ----


def ep_all_to_all_bytes(cfg: ModelConfig, tokens: int, tp: int, act_bytes: int = 2) -> float:
    """Bytes one rank's token all-to-alls count in one micro-batch of `tokens` tokens, on
    average over the EP group, as parallel/expert_parallel.ep_bytes counts them: every MoE
    layer sends its rows to the experts (tokens x top_k / tp, each TP rank its part) and the
    outputs back, forward and backward (4 x rows x d_model), plus the n_experts int64 counts.
    What a rank receives equals what it sends on average; routing imbalance shifts it."""
    n_moe = cfg.n_layers - cfg.n_dense_layers if cfg.n_experts > 0 else 0
    rows = tokens * cfg.top_k / tp
    return n_moe * (4 * rows * cfg.d_model * act_bytes + 8 * cfg.n_experts)


def ep_step(design: str, cfg: ModelConfig, params: list[Local], hw: Hardware, dp: int, tp: int, ep: int,
            micro_steps: int, tokens_micro: int, compute: float, tp_act: float, micro: MicroBatch) -> Step:
    """An EP design at (dp, tp, ep): `params` from local_params(cfg, tp, ep). ZeRO-1 runs two
    plans, as optim/zero.py does: the dense parameters over DP, this EP rank's experts over the
    dp / ep ranks that hold the same ones (each expert stack owned whole, no gather). Each MoE
    layer's all-to-alls (5 a layer and micro-batch, 4 carrying rows) run on the critical path,
    within a node where ep x tp GPUs fit in one; under TP the experts are replicated over it and
    their fp32 gradients all-reduced over TP once per micro-batch."""
    optim = design.split("-")[0]
    dense = [p for p in params if not p.expert]
    experts = [p for p in params if p.expert]
    edp = dp // ep

    def share(group: list[Local], n: int) -> tuple[int, list[float], list[float], list[float], list[float]]:
        """(flat buffer elements, and per rank: NS FLOPs, state bytes, Muon and AdamW elements),
        from the plan ZeroOptimizer builds (AdamW alone: flat pieces only)."""
        if not group:
            return 0, [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
        plan = build_plan([ParamSpec(i, p.numel, p.matrices if p.muon and optim == "muon" else ())
                           for i, p in enumerate(group)], n)
        ns = [sum(group[s.param].ns_flops for s in r.muon) for r in plan.ranks]
        muon_el = [float(sum(s.length for s in r.muon)) for r in plan.ranks]
        adamw_el = [float(sum(s.length for s in r.adamw)) for r in plan.ranks]
        state = [4 * m + 8 * a + 4 * len(r.adamw) for m, a, r in zip(muon_el, adamw_el, plan.ranks)]
        return plan.total, ns, state, muon_el, adamw_el

    dense_flat, dense_ns, dense_state, dense_muon, dense_adamw = share(dense, dp)
    expert_flat, expert_ns, expert_state, expert_muon, expert_adamw = share(experts, edp)
    # DP rank d holds EP rank d % ep's experts, as edp rank d // ep.
    ns = [dense_ns[d] + expert_ns[d // ep] for d in range(dp)]
    state = [dense_state[d] + expert_state[d // ep] for d in range(dp)]
    busiest = max(range(dp), key=lambda d: (ns[d], state[d]))
    tp_bytes = sum(tp_gather_bytes(p, tp) for p in dense if p.muon) / dp if optim == "muon" else 0.0
    a2a = micro_steps * ep_all_to_all_bytes(cfg, tokens_micro, tp)
    row = DesignRow(2 * 4 * (dense_flat + expert_flat), 0, tp_bytes, max(ns), sum(ns) / dp, max(state),
                    dense_muon[busiest] + expert_muon[busiest // ep], dense_adamw[busiest] + expert_adamw[busiest // ep],
                    ep_bytes=a2a)
    ep_link = hw.nvlink if ep * tp <= hw.gpus_per_node else hw.ib
    dp_link = hw.dp_link(dp, tp)
    n_moe = cfg.n_layers - cfg.n_dense_layers
    calls = 4 * n_moe * micro_steps  # the row-carrying all-to-alls; the counts' are latency only
    per_call = a2a / calls if calls else 0.0
    expert_numel = sum(p.numel for p in experts)
    times = {
        "compute": compute,
        "tp_activations": tp_act,
        "ep_all_to_all": calls * ring_reduce_scatter_s(per_call, ep, ep_link) + n_moe * micro_steps * (ep - 1) * ep_link.latency,
        "ep_expert_grads_over_tp": micro_steps * all_reduce_s(4 * expert_numel, tp, hw.nvlink) if tp > 1 else 0.0,
        "opt_dp_reduce_scatter": (ring_reduce_scatter_s(4 * dense_flat, dp, dp_link)
                                  + ring_reduce_scatter_s(4 * expert_flat, edp, dp_link)),
        "opt_dp_all_gather": ring_all_gather_s(4 * dense_flat, dp, dp_link) + ring_all_gather_s(4 * expert_flat, edp, dp_link),
        "opt_tp_momentum_gather": ring_all_gather_s(tp_bytes, tp, hw.nvlink),
        "opt_newton_schulz": max(ns) / hw.matmul_flops,
        "opt_elementwise": (ADAMW_BYTES_PER_ELEMENT * row.adamw_elements
                            + MUON_BYTES_PER_ELEMENT * row.muon_elements) / hw.hbm_bytes_s,
    }
    return Step(design, dp, tp, row, micro.memory(Layout(dp_replicate=dp, tp=tp, ep=ep), optim), times, ep)


def ep_sizes(cfg: ModelConfig, dp: int) -> list[int]:
    """EP sizes above 1 that divide the data-parallel ranks and the experts."""
    return [ep for ep in (2 ** i for i in range(1, 12)) if ep <= dp and dp % ep == 0 and cfg.n_experts % ep == 0]


def predict_ep(cfg: ModelConfig, hw: Hardware, dp: int, tp: int, ep: int, tokens_per_step: int, seq_len: int,
               micro_batch: int, params: Optional[list[Local]] = None, checkpointing: str = "none",
               loss_chunks: int = 1) -> dict[str, Step]:
    """The EP designs at one (dp, tp, ep) layout, with predict's compute and TP terms."""
    params = params if params is not None else local_params(cfg, tp, ep)
    micro_steps = max(1, math.ceil(tokens_per_step / dp / (seq_len * micro_batch)))
    micro = MicroBatch(cfg, micro_batch, seq_len, checkpointing, loss_chunks)
    compute = train_flops_per_token(cfg, seq_len) * tokens_per_step / (dp * tp * hw.matmul_flops)
    per_call = 2 * seq_len * micro_batch * cfg.d_model
    tp_act = 4 * cfg.n_layers * micro_steps * all_reduce_s(per_call, tp, hw.nvlink) if tp > 1 else 0.0
    return {d: ep_step(d, cfg, params, hw, dp, tp, ep, micro_steps, seq_len * micro_batch, compute, tp_act, micro)
            for d in EP_DESIGNS}
