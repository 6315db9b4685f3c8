"""Where pipeline parallelism pays: per-rank memory and predicted step time of layouts with and
without pp, for one model on N GPUs (planning/pipeline_plan.py's schedule costs on top of
planning/memory_plan.py's memory and the planner's compute rate).

    python scripts/plan/pp_plan.py --model gpt_8b --gpus 64
    python scripts/plan/pp_plan.py --model moe_16b --gpus 64 --checkpointing full

Every row trains the same global batch (--tokens-per-step) in bf16 with Muon under ZeRO-1 over
its dp ranks. Memory: rank 0's static part (parameters, gradients, optimizer state, ZeRO-1
buffers) is planned_memory's for a stage of n_layers / pp blocks (the embedding and the head
counted whole, an upper bound for any stage), and its activations are one micro-batch's times
the micro-batches the schedule keeps in flight on rank 0. Time: the step's model FLOPs spread
over every GPU at the hardware's matmul rate, stretched by the bubble, plus each run's first and
last hop between stages over InfiniBand (the rest overlaps compute). Every row has tp 1, and the
DP traffic (scripts/plan/plan_scale.py models it) is left out of all of them: the rows differ in
the pipeline's costs only. TP instead of pp is scripts/plan/plan_scale.py's table.
"""
from __future__ import annotations

import argparse
from dataclasses import replace

from eval.flops import train_flops_per_token
from planning.memory_plan import planned_memory
from planning.pipeline_plan import PipelineCost, p2p_bytes
from planning.scale_plan import Hardware
from parallel.mesh import Layout
from model.presets import preset_config

GIB = 1024**3
LAYOUTS = [  # (pp, tp, schedule, stages per rank)
    (1, 1, None, 1), (2, 1, "1f1b", 1), (4, 1, "1f1b", 1), (4, 1, "interleaved_1f1b", 2),
    (4, 1, "interleaved_zero_bubble", 2), (8, 1, "1f1b", 1), (8, 1, "interleaved_1f1b", 2),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt_8b")
    parser.add_argument("--hardware", default="h100_sxm")
    parser.add_argument("--gpus", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per pipeline micro-batch")
    parser.add_argument("--tokens-per-step", type=int, default=4 * 1024 * 1024)
    parser.add_argument("--checkpointing", default="none")
    parser.add_argument("--vocab", type=int, default=128256, help="vocabulary size (Llama 3's tokenizer)")
    args = parser.parse_args()
    cfg, hw = preset_config(args.model, args.vocab), Hardware.load(args.hardware)
    compute_s = train_flops_per_token(cfg, args.seq_len) * args.tokens_per_step / (args.gpus * hw.matmul_flops)
    print(f"# {args.model} on {args.gpus} x {hw.name}, {args.tokens_per_step} tokens per step, seq {args.seq_len}, "
          f"micro-batches of {args.micro_batch}, Muon, ZeRO-1, checkpointing {args.checkpointing}")
    print("| pp x dp x tp | schedule | micro-batches per run | bubble | in flight (rank 0) | "
          "static GiB | activations GiB | total GiB | P2P GB/step | step s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for pp, tp, schedule, v in LAYOUTS:
        dp = args.gpus // (pp * tp)
        if dp < 1 or cfg.n_layers < pp * v:
            continue
        sequences = args.tokens_per_step // (args.seq_len * dp)  # per dp rank per step
        stage = replace(cfg, n_layers=-(-cfg.n_layers // pp), n_dense_layers=min(cfg.n_dense_layers, -(-cfg.n_layers // pp)))
        one = planned_memory(stage, Layout(dp_replicate=dp, tp=tp), "muon", args.micro_batch, args.seq_len,
                             args.checkpointing)
        static = one["total"] - one["activations"]
        if schedule is None:
            # Without a pipeline each forward holds one micro-batch, accumulated over the step.
            flight, bubble, p2p, step_s, m = 1.0, 0.0, 0.0, compute_s, sequences // args.micro_batch
        else:
            m = sequences // args.micro_batch
            cost = PipelineCost(schedule, pp, m, v)
            flight, bubble = cost.peak_in_flight, cost.bubble
            p2p = p2p_bytes(pp, 0, m, args.micro_batch, args.seq_len, cfg.d_model, 2, v)
            hop = args.micro_batch * args.seq_len * cfg.d_model * 2 / hw.ib.bandwidth + hw.ib.latency
            step_s = cost.step_time(compute_s, 2 * hop)
        acts = one["activations"] * flight
        print(f"| {pp} x {dp} x {tp} | {schedule or '-'} | {m} | {100 * bubble:.1f}% | {flight:.1f} | "
              f"{static / GIB:.1f} | {acts / GIB:.1f} | {(static + acts) / GIB:.1f} | {p2p / 1e9:.2f} | {step_s:.2f} |")


if __name__ == "__main__":
    main()
