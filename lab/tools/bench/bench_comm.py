"""Optimizer communication, Newton-Schulz work and state per rank, for four ZeRO-1 designs.

    python lab/tools/bench/bench_comm.py                      # gpt_small at DP in {2, 4}, TP in {1, 2}
    python lab/tools/bench/bench_comm.py --model gpt_tiny --layouts 2x1 2x2 --no-measure

The designs (adamw-zero1, muon-ours, moonlight, megatron-poc) and their conventions are
described in planning/scale_plan.py, which computes every row from the layouts; this script prints
them, and measures our row: each layout with world size <= --max-world is run for real (gloo,
spawned processes, one optimizer step of the real ZeroOptimizer on random gradients); the bytes
counted by parallel/comm.py and the real plan's per-rank Newton-Schulz load must equal the
computed ones. scripts/plan/plan_scale.py adds memory and predicted times, from 8 to 1,024 GPUs.
"""
from __future__ import annotations

import argparse
from typing import Callable, Optional

import torch

from planning.scale_plan import design_rows, local_params
from model.config import ModelConfig
from model.presets import preset_config
from model.gpt import GPT


def _measure_worker(rank: int, world: int, cfg: ModelConfig, tp: int, ep: int = 1, optim: str = "muon") -> dict[str, float]:
    from parallel.comm import COUNTER
    from model.parallelize import parallelize_moe, parallelize_tp
    from optim.config import OptimConfig
    from optim.zero import ZeroOptimizer
    from parallel.mesh import build_mesh

    mesh = build_mesh(tp, ep=ep)
    torch.manual_seed(0)
    model = parallelize_moe(parallelize_tp(GPT(cfg), mesh.tp_group, split_experts=ep == 1), mesh.ep_group,
                            mesh.tp_group, mesh.dp_group)
    opt = ZeroOptimizer(model, OptimConfig(name=optim), cfg, mesh)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    COUNTER.reset()
    opt.prepare_grads(1.0)
    opt.step()
    # (under EP the experts' own ZeRO-1 runs over "edp")
    dp_rs_ag = sum(v for (label, op), v in COUNTER.bytes.items() if label in ("dp", "edp") and op != "all_reduce")
    tp_bytes = sum(v for (label, op), v in COUNTER.bytes.items() if label == "tp" and op == "all_gather")
    return {"dp_bytes": dp_rs_ag, "tp_bytes": tp_bytes, "state": opt.state_bytes(),
            "plan_costs": [r.ns_cost for r in opt.plan.ranks]}


def measure(cfg: ModelConfig, dp: int, tp: int, ep: int = 1, optim: str = "muon",
            launch: Optional[Callable[..., list]] = None) -> dict[str, float]:
    """One counted ZeroOptimizer step on dp * tp gloo ranks. `launch(fn, world_size, *args)`
    runs them (default: lab/tools/spawn.py's fresh processes; the tests pass their pool)."""
    if launch is None:
        from lab.tools.spawn import run_ranks as launch
    per_rank = launch(_measure_worker, dp * tp, cfg, tp, ep, optim)
    return {
        "dp_bytes": per_rank[0]["dp_bytes"],
        "tp_bytes": sum(r["tp_bytes"] for r in per_rank[::tp]) / dp,  # one TP rank per DP rank
        "state": max(r["state"] for r in per_rank),
        "plan_costs": per_rank[0]["plan_costs"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt_small")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--layouts", nargs="+", default=["2x1", "4x1", "2x2", "4x2"], help="DPxTP")
    parser.add_argument("--max-world", type=int, default=4, help="measure layouts up to this world size")
    parser.add_argument("--no-measure", action="store_true")
    args = parser.parse_args()
    cfg = preset_config(args.model, args.vocab)

    print(f"model {args.model} (vocab {args.vocab}); per optimizer step, per rank")
    print("| DPxTP | design | DP bytes | vs AdamW | TP bytes | NS GFLOP max | NS max / (total/DP) | state MB/rank | measured |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for layout in args.layouts:
        dp, tp = (int(x) for x in layout.split("x"))
        rows = design_rows(local_params(cfg, tp), dp, tp)
        base = rows["adamw-zero1"].dp_bytes
        ns_total_over_dp = rows["megatron-poc"].ns_max / dp
        measured = None
        if not args.no_measure and dp * tp <= args.max_world:
            measured = measure(cfg, dp, tp)
        for name, r in rows.items():
            note = ""
            if name == "muon-ours" and measured is not None:
                ok = measured["dp_bytes"] == r.dp_bytes and measured["tp_bytes"] == r.tp_bytes
                same_plan = measured["plan_costs"] == r.plan_costs
                note = (f"DP {measured['dp_bytes']:,.0f} / TP {measured['tp_bytes']:,.0f} bytes: "
                        f"{'equal' if ok else 'DIFFERENT'}; per-rank NS load: {'equal' if same_plan else 'DIFFERENT'}")
            ratio = r.ns_max / ns_total_over_dp if ns_total_over_dp else 0
            print(f"| {layout} | {name} | {r.dp_bytes:,.0f} | {r.dp_bytes / base:.3f} | {r.tp_bytes:,.0f} | "
                  f"{r.ns_max / 1e9:.2f} | {ratio:.3f} | {r.state / 1e6:.2f} | {note} |")


if __name__ == "__main__":
    main()
