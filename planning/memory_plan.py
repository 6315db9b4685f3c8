"""What one rank holds, and the memory it takes: the parameter inventory of a layout (shapes
alone, from the model built on the meta device) and the formulas for its bytes.

Two users: the scale planner's designs (planning/scale_plan.py, scripts/plan/plan_scale.py) and the dry
run (trainer/simulation/one_rank.py), both through `planned_memory`. The formulas are checked against
trainer/simulation/memory_estimate.py, which measures the real model and optimizer of a layout's rank under
FakeTensorMode (tests/test_memory_estimate.py), and the activation count against autograd's
saved tensors of a real forward (tests/test_scale_plan.py).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Optional

import torch

from model.config import CHECKPOINTING_MODES, ModelConfig
from model.gpt import GPT
from model.parallelize import tp_split_dim
from optim.routing import route_parameters
from optim.zero_plan import ParamSpec, ZeroPlan, build_plan
from parallel.mesh import Layout
from parallel.tp_layers import padded_vocab

NS_STEPS = 5
@dataclass
class Local:
    """One parameter as a TP rank holds it."""

    numel: int
    muon: bool
    matrices: tuple[tuple[int, int], ...]  # the whole matrices Newton-Schulz sees (E for experts)
    tp_sharded: bool
    shape: tuple[int, ...] = ()  # TP-local
    unit: int = -1  # its FSDP2 unit: the block's index, or ROOT_UNIT (embedding, final norm, head)
    expert: bool = False  # a routed expert stack (under EP, this rank's experts)
    kind: str = ""  # its family (optim/routing.py): the optimizers group parameters by it
    split: Optional[int] = None  # the matrix dimension TP splits (0 rows, 1 columns), or None

    @property
    def ns_flops(self) -> float:
        return sum(ns_flops(r, c) for r, c in self.matrices)

    @property
    def full_numel(self) -> int:
        return sum(r * c for r, c in self.matrices)


def ns_flops(rows: int, cols: int) -> float:
    m, n = min(rows, cols), max(rows, cols)
    return NS_STEPS * (4 * m * m * n + 2 * m**3)


def local_params(cfg: ModelConfig, tp: int, ep: int = 1) -> list[Local]:
    """Every parameter's TP-local size and Muon matrices, from shapes alone (on the meta
    device, so an 8B model costs no memory). Under EP (`ep` > 1) a rank holds n_experts / ep
    whole experts of each stack, which TP leaves whole."""
    with torch.device("meta"):
        model = GPT(cfg)
    routes = {r.name: r for r in route_parameters(model, "muon")}
    out = []
    for name, p in model.named_parameters():
        expert = ".experts." in name
        dim = tp_split_dim(name, split_experts=ep == 1) if tp > 1 else None
        shape = list(p.shape)
        if dim is not None:
            if name.endswith(("embed.weight", "head.weight")):
                shape[0] = padded_vocab(shape[0], tp)
            shape[dim] //= tp
        if expert and ep > 1:
            shape[0] //= ep
        matrices = ((p.shape[-2], p.shape[-1]),) * (shape[0] if p.ndim == 3 else 1) if p.ndim >= 2 else ()
        block = re.match(r"blocks\.(\d+)\.", name)
        route = routes[name]
        out.append(Local(math.prod(shape), route.optimizer == "muon", matrices, dim is not None,
                         tuple(shape), int(block.group(1)) if block else ROOT_UNIT, expert, route.kind,
                         None if dim is None else dim - (p.ndim - 2)))
    return out


# ---- FSDP2 (parallel/fsdp.py, optim/muon/row_sharded.py): units and memory ----

ROOT_UNIT = -1


def fsdp_padded_numel(shape: tuple[int, ...], n: int) -> int:
    """Elements FSDP2 moves for a parameter sharded n ways: dim 0 padded to a multiple of n."""
    return math.ceil(shape[0] / n) * n * math.prod(shape[1:])


def fsdp_unit_numels(params: list[Local], n: int) -> dict[int, int]:
    """Padded elements of each FSDP2 unit (a block, or the root)."""
    units: dict[int, int] = {}
    for p in params:
        units[p.unit] = units.get(p.unit, 0) + fsdp_padded_numel(p.shape, n)
    return units


def fsdp_memory(params: list[Local], n: int, optim: str, param_bytes: int = 2,
                expert_n: Optional[int] = None) -> dict[str, float]:
    """Per-rank bytes under FSDP2: fp32 parameters and gradients sharded n ways (rank 0 holds
    the most: ceil(rows / n) of each), optimizer state likewise (Muon: a momentum for its
    matrices, AdamW two moments), and the largest unit gathered for compute. Under EP the
    experts are sharded `expert_n` ways (the dp_shard ranks that hold the same experts). The
    vocabulary padding of TP is in the shapes; tied or frozen parameters are not modelled."""
    def rows(p: Local) -> int:
        ways = expert_n if p.expert and expert_n else n
        return fsdp_padded_numel(p.shape, ways) // ways

    shard = sum(rows(p) for p in params)
    muon = sum(rows(p) for p in params if p.muon and optim == "muon")
    adamw_tensors = sum(1 for p in params if not (p.muon and optim == "muon"))
    return {
        "params": 4 * shard,
        "grads": 4 * shard,
        # AdamW also keeps a 4-byte step count per tensor
        "optimizer_state": 4 * muon + 8 * (shard - muon) + 4 * adamw_tensors,
        "gathered": param_bytes * max(fsdp_unit_numels(params, n).values()),
    }


def fsdp_gathered(params: list[Local], n: int, param_bytes: int, ep: int = 1) -> dict[str, float]:
    """What FSDP2 holds gathered, bytes: "root" (the embedding, final norm and head, gathered from
    their forward to the end of the backward), "block" (the largest block unit) and "most" (the
    most at once: FSDP2 keeps each all-gather's output until the next all-gather has run, so at
    the start of the forward the root twice, its parameters and their all-gather output, and
    the first block's output; in a block's forward the root, that block and the previous
    block's output). Under EP the experts are units of their own, gathered only where they are
    sharded (dp_shard / ep > 1)."""
    units: dict[int, int] = {}
    for p in params:
        ways = n // ep if p.expert and ep > 1 else n
        if ways > 1:
            units[p.unit] = units.get(p.unit, 0) + fsdp_padded_numel(p.shape, ways)
    root = units.pop(ROOT_UNIT, 0)
    blocks = list(units.values()) or [0]
    return {"root": param_bytes * root, "block": param_bytes * max(blocks),
            "most": param_bytes * max(2 * root + blocks[0], root + 2 * max(blocks))}


# ---- Activations ----


@dataclass(frozen=True)
class Dtypes:
    """The activations' element sizes: `compute` of the matmuls' outputs (2 under bf16 autocast,
    4 in fp32) and `residual` of the residual stream (fp32, or bf16 under FSDP2's bf16
    parameters, whose gathered embedding makes it bf16)."""

    compute: int = 2
    residual: int = 4

    @classmethod
    def of(cls, precision: str, fsdp: bool) -> "Dtypes":
        if precision not in ("bf16", "fp32"):
            raise ValueError(f"trainer.precision={precision!r}: expected bf16 or fp32")
        return cls(2, 2 if fsdp else 4) if precision == "bf16" else cls(4, 4)

    def projection_inputs(self, h: int, calls: int) -> int:
        """What `calls` projections of one normed input keep of it: each its own bf16 cast of
        an fp32 input under autocast, else all of them the one input (the norm's output)."""
        return calls * 2 * h if self.compute < self.residual else self.residual * h


def block_bytes_per_token(cfg: ModelConfig, layer: int, tp: int, mode: str = "none", dt: Dtypes = Dtypes(),
                          ep: int = 1, fused_norm: bool = True) -> float:
    """Bytes block `layer` keeps for the backward per token, under activation checkpointing
    `mode` (model/activation_checkpoint.py). With h = d_model, q = n_heads * head_dim,
    kv = n_kv_heads * head_dim, H = n_heads, a = dt.compute, r = dt.residual:

    none, the tensors autograd saves, counted one by one:
      RMSNorm: its fp32 input and 1/rms (4h + 4); without a fused kernel (the CPU) also the
        normalised fp32 product (+4h)
      attention: what wq, wk, wv keep of the normed input (Dtypes.projection_inputs: a bf16
        cast each of an fp32 one, 6h); q, k, v after RoPE (a(q + 2kv)); the output and its row
        log-sum-exp (aq + 4H); wo's input, the output made contiguous (aq)
      dense SwiGLU (hidden f): the input as w_gate and w_up keep it; gate, up, silu(gate),
        their product (4af)
      MoE (E experts, top-k, expert hidden e): the router's fp32 input and scores (4h + 4E),
        the ids, sorting order and positions (3 x 8k), gates (4k + 4k + 4); per routed copy
        its input (ah), 4ae inside the expert and its fp32 output for the weighted sum (4h);
        shared experts as a SwiGLU of hidden n_shared * e; under EP the dispatch's regrouping
        indices (16k)
    full: the block's input (rh), and in MoE blocks the routing decisions the policy keeps
      (topk's values and ids, and the expert sort's values and indices: 24k, as measured)
    selective: the input, and the outputs of SAVED_OPS: every other matmul of the block in
      call order (wq, wv, w_gate, w_down; in MoE blocks wq, wv, the router's fp32 scores, the
      experts' up projection, the shared experts' w_gate and w_down), attention's output and
      log-sum-exp, the routing decisions, and the results of the collectives it replays (TP's
      all-reduces, EP's all-to-alls).
    Under TP the projections' outputs, the experts' hidden units and the vocabulary are split
    (divided by tp); the norms, their outputs and the router are replicated.
    """
    if mode not in CHECKPOINTING_MODES:
        raise ValueError(f"trainer.activation_checkpointing={mode!r}: expected one of {', '.join(CHECKPOINTING_MODES)}")
    h, hd, H, a, r = cfg.d_model, cfg.head_dim, cfg.n_heads, dt.compute, dt.residual
    q, kv = H * hd, cfg.n_kv_heads * hd
    e, k, E = cfg.expert_hidden or cfg.ffn_hidden, cfg.top_k, cfg.n_experts
    moe = cfg.n_experts > 0 and layer >= cfg.n_dense_layers
    shared = cfg.n_shared_experts * e
    if mode == "none":
        norm = (4 if fused_norm else 8) * h + 4
        attn = dt.projection_inputs(h, 3) + (a * (3 * q + 2 * kv) + 4 * H) / tp
        if not moe:
            return 2 * norm + attn + dt.projection_inputs(h, 2) + 4 * a * cfg.ffn_hidden / tp
        # the shared experts keep the normed input as the router does not (it takes an fp32 copy)
        shared_in = (dt.projection_inputs(h, 2) if r == 4 and a == 2 else (r * h if r != 4 else 0)) if shared else 0
        mlp = (4 * h + 4 * E + 32 * k + 4 + k * (a * h + 4 * a * e / tp + 4 * h)
               + (shared_in + 4 * a * shared / tp if shared else 0) + (16 * k if ep > 1 else 0))
        return 2 * norm + attn + mlp
    routing = 24 * k if moe else 0
    if mode == "full":
        return r * h + routing
    kept = r * h + (a * (q + kv + q) + 4 * H) / tp + (a * h if tp > 1 else 0)  # wq, wv, attention; wo's all-reduce
    if not moe:
        return kept + a * cfg.ffn_hidden / tp + a * h  # w_gate, w_down (its all-reduce in place)
    kept += 4 * E + routing + a * k * e / tp + (r * h if tp > 1 else 0)  # scores, routing, up, the output's all-reduce
    kept += k * h * (r + a) if ep > 1 else 0  # the rows sent to the experts and their outputs back
    return kept + (a * shared / tp + a * h if shared else 0)


def head_bytes_per_token(cfg: ModelConfig, tp: int, loss_chunks: int = 1, dt: Dtypes = Dtypes(),
                         fused_norm: bool = True) -> tuple[float, float]:
    """(bytes the final norm, the head and the loss keep for the backward per token, bytes per
    token the loss's backward adds on top at its peak). Whole (loss_chunks = 1): the norm, the
    head's input (ah), the fp32 log-softmax over the vocabulary (4V; under TP the vocabulary-
    parallel loss's fp32 shifted logits and their exponentials, 8V / tp, and its per-token
    masks and indices, 14), the token ids and targets (16); its backward then holds two fp32
    [tokens, V / tp] gradients (8V / tp). Chunked (model/chunked_loss.py): the norm, the hidden
    state's gradient (rh), the ids; one slice's logits, log-softmax and their gradients at a
    time: (loss + 8V / tp) / N."""
    h, V = cfg.d_model, padded_vocab(cfg.vocab_size, tp)
    norm = (4 if fused_norm else 8) * h + 4
    loss = 4 * V if tp == 1 else 8 * V / tp + 14
    backward = 8 * V / tp
    if loss_chunks == 1:
        return norm + dt.compute * h + loss + 16, backward
    return norm + dt.residual * h + 16 + (14 if tp > 1 else 0), (loss + backward) / loss_chunks


def activation_bytes_per_token(cfg: ModelConfig, tp: int, fused_norm: bool = True, dt: Dtypes = Dtypes(),
                               ep: int = 1) -> float:
    """Bytes of activations autograd keeps for the backward pass, per token, without
    recomputation (block_bytes_per_token's "none" for every block, and the whole loss's
    head_bytes_per_token); a test checks the sum against the saved tensors of a real forward
    pass on the CPU, tests/test_memory_estimate.py against FakeTensor estimates at scale."""
    blocks = sum(block_bytes_per_token(cfg, i, tp, "none", dt, ep, fused_norm) for i in range(cfg.n_layers))
    return blocks + head_bytes_per_token(cfg, tp, 1, dt, fused_norm)[0]


def activation_memory(cfg: ModelConfig, tp: int, tokens: int, checkpointing: str = "none", loss_chunks: int = 1,
                      dt: Dtypes = Dtypes(), ep: int = 1) -> dict[str, float]:
    """Activation bytes of one micro-batch of `tokens` tokens per rank: "kept" when the forward
    has returned, "at_loss" at the loss's backward (kept + the loss's gradients), and
    "at_recompute" while the first block of the backward runs (the blocks' kept tensors, that
    block's activations rebuilt, its gradients in flight: two residual-sized tensors)."""
    if loss_chunks < 1:
        raise ValueError(f"model.loss_chunks must be >= 1, got {loss_chunks}")
    kept_blocks = [block_bytes_per_token(cfg, i, tp, checkpointing, dt, ep) for i in range(cfg.n_layers)]
    whole = [block_bytes_per_token(cfg, i, tp, "none", dt, ep) for i in range(cfg.n_layers)]
    head, backward = head_bytes_per_token(cfg, tp, loss_chunks, dt)
    # the head weight's fp32 gradient sums the chunked loss keeps from its forward
    fixed = 4 * padded_vocab(cfg.vocab_size, tp) / tp * cfg.d_model if loss_chunks > 1 else 0.0
    rebuilt = max(w - kept for w, kept in zip(whole, kept_blocks))
    kept = tokens * (sum(kept_blocks) + head) + fixed
    return {
        "kept": kept,
        "at_loss": kept + tokens * backward,
        "at_recompute": tokens * (sum(kept_blocks) + rebuilt + 2 * dt.residual * cfg.d_model) + fixed,
    }


# ---- The optimizer step's scratch memory ----


def newton_schulz_peak(batches: list[tuple[int, int, int]], held: float, ns_bytes: int = 2,
                       peak: float = 0.0) -> tuple[float, float]:
    """(peak bytes, bytes of results kept after) of ShardedMuon's Newton-Schulz
    (optim/muon/row_sharded.py) over `batches` (count, rows, cols) of fp32 matrices in call order,
    `held` bytes alive around it. Each batch: an fp32 stack of its matrices, the result, the
    iterate and its successor (ns dtype) and two m x m Gram products (m the small side); every
    result is kept to the step's end, and a batch's stack is freed once the next one is built.
    `peak`: the step's peak so far, returned where nothing here exceeds it."""
    peak, outs, previous = max(peak, held), 0.0, 0.0
    for count, rows, cols in batches:
        elements, m = count * rows * cols, min(rows, cols)
        stack = 4 * elements
        work = 2 * ns_bytes * count * m * m + 3 * ns_bytes * elements
        peak = max(peak, held + outs + previous + stack, held + outs + stack + work)
        outs, previous = outs + ns_bytes * elements, stack
    return peak, outs


def _batches(params: list[Local], tp: int) -> list[tuple[int, int, int]]:
    """ShardedMuon's Newton-Schulz batches (count, rows, cols) of whole matrices (gathered over
    TP where it splits them), one per family and shape in first-seen order: each param group of
    one family is orthogonalised batch by batch, shape by shape."""
    batches: dict[tuple, list[int]] = {}
    for p in params:
        rows, cols = p.shape[-2:]
        if p.split is not None and tp > 1:
            rows, cols = (rows * tp, cols) if p.split == 0 else (rows, cols * tp)
        count = p.shape[0] if len(p.shape) == 3 else 1
        batches.setdefault((p.kind, rows, cols), [0, rows, cols])[0] += count
    return [tuple(b) for b in batches.values()]


def by_family(params: list[Local]) -> list[Local]:
    """Muon's parameters in the order its optimizers hold them: by family, in the order the
    families first appear, each in parameter order (optim/builder.py, optim/sharded.py)."""
    first: dict[str, int] = {}
    for i, p in enumerate(params):
        first.setdefault(p.kind, i)
    return sorted((p for p in params if p.muon), key=lambda p: first[p.kind])


def sharded_muon_step_bytes(params: list[Local], n: int, tp: int, expert_n: int) -> float:
    """Rank 0's scratch memory at the peak of a ShardedMuon step (optim/muon/row_sharded.py), bytes:
    the fp32 momentum-step inputs of all its rows; the expert stacks orthogonalised where they
    are (gathered over TP first where TP splits them); the 2-D matrices it owns (the LPT plan
    over the TP-local shapes, as ShardedMuon builds it) gathered whole in fp32, and over TP
    where split, then orthogonalised batch by batch with every result kept; the exchange back."""
    muon = by_family(params)
    if not muon:
        return 0.0

    def rows(p: Local) -> int:
        ways = expert_n if p.expert else n
        return fsdp_padded_numel(p.shape, ways) // ways

    inputs = 4 * sum(rows(p) for p in muon)
    # the expert stacks as this rank holds them: its experts (FSDP2 splits a stack by experts)
    stacks = [replace(p, shape=(-(-p.shape[0] // expert_n), *p.shape[1:]), numel=rows(p))
              for p in muon if len(p.shape) == 3]
    split_stacks = sum(p.numel for p in stacks if p.split is not None and tp > 1)
    # Gathered stacks stay referenced to the step's end; their results are kept as TP shards.
    gathered = 4 * tp * split_stacks
    peak, outs = newton_schulz_peak(_batches(stacks, tp), inputs + gathered)
    held = inputs + gathered + (outs / tp if split_stacks else outs)
    matrices = [p for p in muon if len(p.shape) == 2]
    plan = build_plan([ParamSpec(i, p.numel, (p.shape,)) for i, p in enumerate(matrices)], n)
    owned = [matrices[s.param] for s in sorted(plan.ranks[0].muon, key=lambda s: s.param)]
    local = sum(p.numel for p in owned)
    sent = sum(rows(p) for p in matrices)
    split = [p for p in owned if p.split is not None and tp > 1]
    # to the owners: the rows sent, and the rows received (fp32), then assembled into whole matrices
    peak = max(peak, held + 4 * sent + 4 * local, held + 8 * local)
    held += 4 * local
    whole = 4 * tp * sum(p.numel for p in split)  # and gathered over TP where it splits them
    peak = max(peak, held + whole + max((4 * tp * p.numel for p in split), default=0))
    held += whole
    peak, outs = newton_schulz_peak(_batches(owned, tp), held, peak=peak)
    # back: this TP rank's part of each result, the rows sent back and those received (bf16)
    return max(peak, held + outs + 2 * sum(p.numel for p in split) + 2 * local + 2 * sent)


def muon_step_bytes(params: list[Local], tp: int) -> float:
    """Scratch memory at the peak of a Muon step on whole local matrices (optim/muon/optimizer.py; under
    ZeRO-1 a rank's own matrices), bytes: one stack of same-shape matrices at a time, an fp32
    stack orthogonalised in place (its iterate pair and Gram pair on top); a TP-split stack
    gathered first (its fp32 inputs, the gathered copy and the whole matrices, a bf16 result)."""
    stacks: dict[tuple, int] = {}
    for p in params:
        rows, cols = p.shape[-2:]
        key = (rows, cols, p.split if tp > 1 else None)
        stacks[key] = stacks.get(key, 0) + (p.shape[0] if len(p.shape) == 3 else 1)
    peak = 0.0
    for (rows, cols, split), count in stacks.items():
        local = count * rows * cols
        if split is None:
            peak = max(peak, 8 * local + 4 * count * min(rows, cols) ** 2)
            continue
        whole, m = tp * local, min(rows * (tp if split == 0 else 1), cols * (tp if split == 1 else 1))
        peak = max(peak, 4 * local + 8 * whole + 6 * whole + 4 * count * m * m)
    return peak


# ---- One rank's memory ----


def zero1_memory(params: list[Local], dp: int, ep: int, optim: str) -> dict:
    """Rank 0's ZeRO-1 memory (optim/zero.py), bytes: fp32 parameters and gradients whole,
    "buffers": the flat fp32 buffer of each domain (the dense parameters over DP, under EP the
    experts over the dp / ep ranks that hold the same ones) with its reduced segment and send
    buffer, made once and kept; the state of what the plan gives rank 0; and "owned": its whole
    Muon matrices."""
    local = sum(p.numel for p in params)
    state, buffers, owned = 0.0, 0.0, []
    dense = [p for p in params if not (p.expert and ep > 1)]
    for group, n in ((dense, dp), ([p for p in params if p.expert and ep > 1], dp // ep)):
        if not group:
            continue
        plan: ZeroPlan = build_plan([ParamSpec(i, p.numel, p.matrices if p.muon and optim == "muon" else ())
                                     for i, p in enumerate(group)], n)
        mine = plan.ranks[0]
        state += 4 * sum(s.length for s in mine.muon) + 8 * sum(s.length for s in mine.adamw) + 4 * len(mine.adamw)
        buffers += 4 * plan.total * (1 + 2 / n)  # a domain of one rank has them too
        owned += [group[s.param] for s in mine.muon]
    return {"params": 4 * local, "grads": 4 * local, "buffers": buffers, "optimizer_state": state, "owned": owned}


def planned_memory(model: ModelConfig, layout: Layout, optim: str, batch_size: int, seq_len: int,
                   checkpointing: str = "none", loss_chunks: int = 1, precision: str = "bf16") -> dict[str, float]:
    """Rank 0's memory in one training step of `layout`, one micro-batch of `batch_size`
    sequences of `seq_len` tokens, bytes by part:

      params, grads, optimizer_state  fp32 parameters and gradients (FSDP2: the rank's shards;
                       ZeRO-1: whole, with its flat buffers in grads) and the optimizer's state
      activations      the activations and their gradients at the forward and backward's peak
                       (activation_memory: at the loss's backward or at the first block's
                       recompute, or under FSDP2 the root's fp32 gradients for its reduce-
                       scatter at the backward's end, whichever makes the larger total);
                       without FSDP2 under bf16 also the bf16 copies of the weights autocast
                       keeps for the backward
      gathered         the most FSDP2 holds gathered at once (fsdp_gathered)
      optimizer_step   the optimizer step's scratch memory at its peak (Newton-Schulz of the
                       matrices the rank owns, gathered whole)
      total            the peak: the larger of the forward-backward peak (parameters, state,
                       ZeRO-1's buffers, what is gathered then, activations) and the optimizer
                       step's (parameters, gradients, state and its scratch; ZeRO-1 lets the
                       gradients go once reduced into its buffers). Not the sum of the parts,
                       which peak at different moments.

    FSDP2 where layout.dp_shard > 1 (HSDP with dp_replicate > 1), ZeRO-1 where only
    dp_replicate > 1, else one rank's whole (TP-local) model. Checked against
    trainer/simulation/memory_estimate.py (tests/test_memory_estimate.py)."""
    if optim not in ("muon", "adamw"):
        raise ValueError(f"optim={optim!r}: expected muon or adamw")
    params = local_params(model, layout.tp, layout.ep)
    fsdp = layout.dp_shard > 1
    dt = Dtypes.of(precision, fsdp)
    acts = activation_memory(model, layout.tp, batch_size * seq_len, checkpointing, loss_chunks, dt, layout.ep)
    if fsdp:
        expert_n = layout.dp_shard // layout.ep
        mem = fsdp_memory(params, layout.dp_shard, optim, dt.compute, expert_n)
        units = fsdp_gathered(params, layout.dp_shard, dt.compute, layout.ep)
        gathered = units["most"]
        at_loss = units["root"] + units["block"]
        # in the blocks' backward: a block gathered and the next prefetched, and the head's
        # gradient (gathered dtype) waiting for the root's reduce-scatter at the backward's end
        in_blocks = units["root"] + 2 * units["block"] + dt.compute * sum(p.numel for p in params if p.kind == "head")
        # the backward's end: every sharded gradient but the root's, the root's gradients
        # gathered and their fp32 copy for the reduce-scatter (the tracker's "Temp")
        root = units["root"] / dt.compute
        points = [(at_loss, acts["at_loss"]), (in_blocks, acts["at_recompute"]),
                  (mem["grads"] + dt.compute * root, 4 * root)]
        step = sharded_muon_step_bytes(params, layout.dp_shard, layout.tp, expert_n) if optim == "muon" else 0.0
        persistent = mem["params"] + mem["optimizer_state"]
        optimizer = persistent + mem["grads"] + step
        grads = mem["grads"]
    else:
        if layout.dp > 1:
            mem = zero1_memory(params, layout.dp, layout.ep, optim)
            owned = mem["owned"]
        else:
            owned = [p for p in params if p.muon and optim == "muon"]
            adamw = [p for p in params if not (p.muon and optim == "muon")]
            local = 4 * sum(p.numel for p in params)
            mem = {"params": local, "grads": local, "buffers": 0.0,
                   "optimizer_state": 4 * sum(p.numel for p in owned) + 8 * sum(p.numel for p in adamw) + 4 * len(adamw)}
        step = muon_step_bytes(owned, layout.tp) if optim == "muon" else 0.0
        # bf16 autocast keeps a bf16 copy of every matmul weight (not the embedding's, nor the
        # fp32 router's) from the forward to the backward
        copies = 2 * sum(p.numel for p in params if len(p.shape) >= 2 and p.kind not in ("embed", "router"))
        acts = {k: v + (copies if precision == "bf16" else 0.0) for k, v in acts.items()}
        gathered = 0.0
        points = [(0.0, acts["at_loss"]), (0.0, acts["at_recompute"])]
        persistent = mem["params"] + mem["optimizer_state"] + mem["buffers"]
        # ZeRO-1 frees the gradients once reduced into its buffers, before it steps
        optimizer = persistent + (max(mem["grads"], step) if mem["buffers"] else mem["grads"] + step)
        grads = mem["grads"] + mem["buffers"]
    # the forward-backward peak: at the loss's backward, at the first block's recompute, or
    # (FSDP2) at the backward's end: (what is gathered or reduced then, activations then)
    held, activations = max(points, key=sum)
    return {"params": mem["params"], "grads": grads, "optimizer_state": mem["optimizer_state"],
            "activations": activations, "gathered": gathered, "optimizer_step": step,
            "total": max(persistent + held + activations, optimizer)}
