"""Optimizer communication, Newton-Schulz work and state per rank, for four ZeRO-1 designs.

    python scripts/bench_comm.py                      # gpt_small at DP in {2, 4}, TP in {1, 2}
    python scripts/bench_comm.py --model gpt_tiny --layouts 2x1 2x2 --no-measure

Rows, per optimizer step and per rank, for one model:
  adamw-zero1   AdamW, flat ZeRO-1: reduce-scatter grads + all-gather params.
  muon-ours     our layout (optim/zero_plan.py): every Muon matrix owned whole by one DP
                rank, owners balanced by LPT on Newton-Schulz cost, AdamW filling the rest.
  moonlight     a flat, concatenated partition: matrices that cross a DP shard boundary
                are DP-gathered and orthogonalised by every rank that holds part of them.
  megatron-poc  a bucketed layout that splits every parameter across DP: every matrix is
                DP-gathered and every DP rank repeats every Newton-Schulz.
The baselines are computed from their layouts. Our row is computed too, and then measured:
each layout with world size <= --max-world is run for real (gloo, spawned processes, one
optimizer step of the real ZeroOptimizer on random gradients); the bytes counted by
model/comm.py and the real plan's per-rank Newton-Schulz load must equal the computed ones.

Conventions: gradients and parameters move in fp32 (4 bytes); the baselines' extra momentum
gathers in bf16 (2 bytes), as Moonlight and the Megatron proof of concept do. Byte counts are
the full buffer of each collective (model/comm.py). TP bytes are the Newton-Schulz TP
traffic of tp_mode=gather (the momentum all-gather of TP-sharded matrices), for every row.
Newton-Schulz FLOPs: 5 steps of 4 m^2 n + 2 m^3 per m x n matrix (m <= n), full matrices.
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from model.config import ModelConfig  # noqa: E402
from model.gpt import GPT  # noqa: E402
from model.parallelize import tp_split_dim  # noqa: E402
from model.tp_layers import padded_vocab  # noqa: E402
from optim.routing import route_parameters  # noqa: E402
from optim.zero_plan import ParamSpec, build_plan  # noqa: E402

NS_STEPS = 5


@dataclass
class Local:
    """One parameter as a TP rank holds it."""

    numel: int
    muon: bool
    matrices: tuple[tuple[int, int], ...]  # the whole matrices Newton-Schulz sees (E for experts)
    tp_sharded: bool

    @property
    def ns_flops(self) -> float:
        return sum(ns_flops(r, c) for r, c in self.matrices)

    @property
    def full_numel(self) -> int:
        return sum(r * c for r, c in self.matrices)


def ns_flops(rows: int, cols: int) -> float:
    m, n = min(rows, cols), max(rows, cols)
    return NS_STEPS * (4 * m * m * n + 2 * m**3)


def local_params(cfg: ModelConfig, tp: int) -> list[Local]:
    model = GPT(cfg)
    routes = {r.name: r for r in route_parameters(model, "muon")}
    out = []
    for name, p in model.named_parameters():
        dim = tp_split_dim(name) if tp > 1 else None
        shape = list(p.shape)
        if dim is not None:
            if name.endswith(("embed.weight", "head.weight")):
                shape[0] = padded_vocab(shape[0], tp)
            shape[dim] //= tp
        matrices = ((p.shape[-2], p.shape[-1]),) * (p.shape[0] if p.ndim == 3 else 1) if p.ndim >= 2 else ()
        out.append(Local(math.prod(shape), routes[name].optimizer == "muon", matrices, dim is not None))
    return out


def tp_gather_bytes(p: Local, tp: int) -> int:
    return 4 * p.full_numel if (p.muon and p.tp_sharded and tp > 1) else 0


def rows_for(params: list[Local], dp: int, tp: int) -> dict[str, dict[str, float]]:
    total = sum(p.numel for p in params)
    muon_ps = [p for p in params if p.muon]
    rows: dict[str, dict[str, float]] = {}

    flat = math.ceil(total / dp) * dp
    rows["adamw-zero1"] = dict(dp_bytes=2 * 4 * flat, tp_bytes=0, ns_max=0, ns_mean=0, state=8 * flat / dp)

    plan = build_plan([ParamSpec(i, p.numel, p.matrices if p.muon else ()) for i, p in enumerate(params)], dp)
    ns = [sum(params[s.param].ns_flops for s in r.muon) for r in plan.ranks]
    state = [4 * sum(s.length for s in r.muon) + 8 * sum(s.length for s in r.adamw) for r in plan.ranks]
    tpb = [sum(tp_gather_bytes(params[s.param], tp) for s in r.muon) for r in plan.ranks]
    rows["muon-ours"] = dict(dp_bytes=2 * 4 * plan.total, tp_bytes=sum(tpb) / dp, ns_max=max(ns),
                             ns_mean=sum(ns) / dp, state=max(state),
                             plan_costs=[r.ns_cost for r in plan.ranks])

    # Moonlight: flat partition in parameter order, chunk = ceil(total / dp).
    chunk = math.ceil(total / dp)
    ns_r, extra, tp_r, state_r = [0.0] * dp, 0, [0.0] * dp, [0.0] * dp
    offset = 0
    for p in params:
        first, last = offset // chunk, (offset + p.numel - 1) // chunk
        for r in range(first, last + 1):
            part = min(offset + p.numel, (r + 1) * chunk) - max(offset, r * chunk)
            state_r[r] += (4 if p.muon else 8) * part
            if p.muon:
                ns_r[r] += p.ns_flops
                tp_r[r] += tp_gather_bytes(p, tp)
        if p.muon and last > first:
            extra += 2 * p.numel  # bf16 DP all-gather of the momentum
        offset += p.numel
    rows["moonlight"] = dict(dp_bytes=2 * 4 * flat + extra, tp_bytes=sum(tp_r) / dp, ns_max=max(ns_r),
                             ns_mean=sum(ns_r) / dp, state=max(state_r))

    # Megatron PoC: every parameter split over DP, every matrix gathered, NS on every rank.
    ns_all = sum(p.ns_flops for p in muon_ps)
    extra = sum(2 * p.numel for p in muon_ps) if dp > 1 else 0
    rows["megatron-poc"] = dict(dp_bytes=2 * 4 * flat + extra,
                                tp_bytes=sum(tp_gather_bytes(p, tp) for p in muon_ps), ns_max=ns_all,
                                ns_mean=ns_all, state=sum((4 if p.muon else 8) * p.numel for p in params) / dp)
    return rows


def _measure_worker(rank: int, world: int, cfg: ModelConfig, tp: int) -> dict[str, float]:
    from model.comm import COUNTER
    from model.parallelize import parallelize_tp
    from optim.config import OptimConfig
    from optim.zero import ZeroOptimizer
    from trainer.mesh import build_mesh

    mesh = build_mesh(tp)
    torch.manual_seed(0)
    model = parallelize_tp(GPT(cfg), mesh.tp_group)
    opt = ZeroOptimizer(model, OptimConfig(name="muon"), cfg, mesh)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    COUNTER.reset()
    opt.prepare_grads(1.0)
    opt.step()
    dp_rs_ag = sum(v for (label, op), v in COUNTER.bytes.items() if label == "dp" and op != "all_reduce")
    tp_bytes = sum(v for (label, op), v in COUNTER.bytes.items() if label == "tp" and op == "all_gather")
    return {"dp_bytes": dp_rs_ag, "tp_bytes": tp_bytes, "state": opt.state_bytes(),
            "plan_costs": [r.ns_cost for r in opt.plan.ranks]}


def measure(cfg: ModelConfig, dp: int, tp: int) -> dict[str, float]:
    sys.path.insert(0, str(REPO / "tests"))
    from tests.distributed import run_distributed

    per_rank = run_distributed(_measure_worker, dp * tp, cfg, tp)
    return {
        "dp_bytes": per_rank[0]["dp_bytes"],
        "tp_bytes": sum(r["tp_bytes"] for r in per_rank[::tp]) / dp,  # one TP rank per DP rank
        "state": max(r["state"] for r in per_rank),
        "plan_costs": per_rank[0]["plan_costs"],
    }


def model_config(preset: str, vocab: int) -> ModelConfig:
    from omegaconf import OmegaConf

    fields = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "model" / f"{preset}.yaml"))
    return replace(ModelConfig(**fields), vocab_size=vocab)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt_small")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--layouts", nargs="+", default=["2x1", "4x1", "2x2", "4x2"], help="DPxTP")
    parser.add_argument("--max-world", type=int, default=4, help="measure layouts up to this world size")
    parser.add_argument("--no-measure", action="store_true")
    args = parser.parse_args()
    cfg = model_config(args.model, args.vocab)

    print(f"model {args.model} (vocab {args.vocab}); per optimizer step, per rank")
    print("| DPxTP | design | DP bytes | vs AdamW | TP bytes | NS GFLOP max | NS max / (total/DP) | state MB/rank | measured |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for layout in args.layouts:
        dp, tp = (int(x) for x in layout.split("x"))
        rows = rows_for(local_params(cfg, tp), dp, tp)
        base = rows["adamw-zero1"]["dp_bytes"]
        ns_total_over_dp = rows["megatron-poc"]["ns_max"] / dp
        measured = None
        if not args.no_measure and dp * tp <= args.max_world:
            measured = measure(cfg, dp, tp)
        for name, r in rows.items():
            note = ""
            if name == "muon-ours" and measured is not None:
                ok = measured["dp_bytes"] == r["dp_bytes"] and measured["tp_bytes"] == r["tp_bytes"]
                same_plan = measured["plan_costs"] == r["plan_costs"]
                note = (f"DP {measured['dp_bytes']:,.0f} / TP {measured['tp_bytes']:,.0f} bytes: "
                        f"{'equal' if ok else 'DIFFERENT'}; per-rank NS load: {'equal' if same_plan else 'DIFFERENT'}")
            ratio = r["ns_max"] / ns_total_over_dp if ns_total_over_dp else 0
            print(f"| {layout} | {name} | {r['dp_bytes']:,.0f} | {r['dp_bytes'] / base:.3f} | {r['tp_bytes']:,.0f} | "
                  f"{r['ns_max'] / 1e9:.2f} | {ratio:.3f} | {r['state'] / 1e6:.2f} | {note} |")


if __name__ == "__main__":
    main()
