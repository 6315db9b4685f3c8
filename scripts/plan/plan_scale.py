"""What Muon costs from 8 to 1,024 GPUs: memory, traffic, Newton-Schulz load and step time.

    python scripts/plan/plan_scale.py --model gpt_8b --vocab 128256 --tokens-per-step 4194304
    python scripts/plan/plan_scale.py --model moe_16b --vocab 163840 --hardware a100_sxm --gpus 64 256
    python scripts/plan/plan_scale.py --model gpt_124m n_layers=24 d_model=1024 --seq-len 1024
    python scripts/plan/plan_scale.py --model gpt_8b --activation-checkpointing full --loss-chunks 8 --memory-gb 141

For every GPU count, every feasible (dp, tp) layout (TP inside a node, dividing the heads and
hidden sizes) and each design of planning/scale_plan.py (four ZeRO-1 ones, FSDP2 and HSDP), it
writes one row: rank 0's memory (planning/memory_plan.planned_memory: parameters, gradients with
ZeRO's buffers, optimizer state, activations at the forward-backward peak, under
--activation-checkpointing and --loss-chunks, and the step's peak, which decides whether the
layout fits), DP and TP bytes, Newton-Schulz FLOPs of the busiest rank and the mean (our
design's from the real LPT plan), and the predicted optimizer step and whole step, with the
optimizer's share of it. Bytes and FLOPs are exact; times come from the hardware profile
(conf/hardware/<name>.yaml) and the alpha-beta model of planning/collectives.py, calibrated where
this project could measure (lab/BENCHMARKS.md). scripts/plan/estimate_memory.py checks one layout's
memory against the real model and optimizer, measured under FakeTensorMode.

Writes <out>/plan.md (every row; --all prints them too), prints the fastest layout that fits in
memory per design and GPU count, and draws <out>/overhead.png: the optimizer's share of the step against the GPU
count, one line per design, each at its fastest fitting layout.
"""
from __future__ import annotations

import argparse
from dataclasses import fields, replace
from pathlib import Path

from planning.scale_plan import DESIGNS, Hardware, Step, ep_sizes, local_params, predict, predict_ep, tp_sizes
from model.config import CHECKPOINTING_MODES, ModelConfig
from model.presets import preset_config
from scripts.refuse import refuse

GB = 1e9


def parse_overrides(cfg: ModelConfig, overrides: list[str]) -> ModelConfig:
    types = {f.name: f.type for f in fields(ModelConfig)}
    changes = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in types:
            refuse(f"model override {item!r}: expected key=value with a ModelConfig key")
        kind = {"int": int, "float": float, "bool": lambda v: v.lower() == "true"}.get(str(types[key]), str)
        changes[key] = kind(value)
    return replace(cfg, **changes)


def plan(cfg: ModelConfig, hw: Hardware, gpus: list[int], tokens_per_step: int, seq_len: int,
         micro_batch: int, checkpointing: str = "none", loss_chunks: int = 1) -> dict[int, list[Step]]:
    """Every (layout, design) Step for each GPU count."""
    out: dict[int, list[Step]] = {}
    params_by_tp = {}
    for n in gpus:
        out[n] = []
        for tp in tp_sizes(cfg, n, hw):
            dp = n // tp
            if tokens_per_step % (dp * seq_len):
                continue  # every DP rank needs whole sequences
            params = params_by_tp.setdefault((tp, 1), local_params(cfg, tp))
            out[n] += predict(cfg, hw, dp, tp, tokens_per_step, seq_len, micro_batch, params, checkpointing,
                              loss_chunks).values()
            for ep in ep_sizes(cfg, dp) if cfg.n_experts else ():  # expert parallelism
                params = params_by_tp.setdefault((tp, ep), local_params(cfg, tp, ep))
                out[n] += predict_ep(cfg, hw, dp, tp, ep, tokens_per_step, seq_len, micro_batch, params,
                                     checkpointing, loss_chunks).values()
    return out


def fastest_fitting(steps: list[Step], design: str, memory_gb: float) -> Step | None:
    fit = [s for s in steps if s.design == design and s.memory_total <= memory_gb * GB]
    return min(fit, key=lambda s: s.step_s) if fit else None


def table(steps: list[Step], memory_gb: float) -> list[str]:
    head = ("| GPUs | dp x tp | design | params GB | grads GB | state GB | act GB | peak GB | fits | DP MB | TP MB "
            "| EP MB | NS GFLOP max / mean | idle owners | opt ms | step ms | opt share |")
    lines = [head, "| " + " | ".join(["---"] * (head.count("|") - 1)) + " |"]
    for s in steps:
        m = s.memory
        idle = str(s.row.idle_ranks) if s.design == "muon-ours" else "-"
        lines.append(
            f"| {s.dp * s.tp} | {s.layout()} | {s.design} | {m['params'] / GB:.2f} | {m['grads'] / GB:.2f} | "
            f"{m['optimizer_state'] / GB:.2f} | {m['activations'] / GB:.2f} | {s.memory_total / GB:.2f} | "
            f"{'yes' if s.memory_total <= memory_gb * GB else 'no'} | {s.row.dp_bytes / 1e6:,.0f} | "
            f"{s.row.tp_bytes / 1e6:,.0f} | {s.row.ep_bytes / 1e6:,.0f} | "
            f"{s.row.ns_max / 1e9:,.1f} / {s.row.ns_mean / 1e9:,.1f} | {idle} | "
            f"{s.optimizer_s * 1e3:.1f} | {s.step_s * 1e3:.1f} | {100 * s.overhead:.1f}% |"
        )
    return lines


def plot(best: dict[str, dict[int, Step]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for design in DESIGNS:
        points = sorted(best[design].items())
        if points:
            ax.plot([n for n, _ in points], [100 * s.overhead for _, s in points], marker="o", label=design)
    ax.set_xscale("log", base=2)
    counts = sorted({n for per_design in best.values() for n in per_design})
    ax.set_xticks(counts, [str(n) for n in counts])
    ax.set_xlabel("GPUs")
    ax.set_ylabel("optimizer step, % of the training step")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt_124m", help="a conf/model preset")
    parser.add_argument("overrides", nargs="*", help="model keys, e.g. n_layers=24 d_model=1024")
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--tokens-per-step", type=int, default=2**20)
    parser.add_argument("--seq-len", type=int, default=0, help="default: the preset's max_seq_len")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per forward pass")
    parser.add_argument("--gpus", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512, 1024])
    parser.add_argument("--hardware", default="h100_sxm", help="conf/hardware/<name>.yaml, or a path")
    parser.add_argument("--memory-gb", type=float, default=0.0,
                        help="GPU memory a layout must fit in (default: the hardware profile's hbm_gb)")
    parser.add_argument("--activation-checkpointing", choices=CHECKPOINTING_MODES, default="none")
    parser.add_argument("--loss-chunks", type=int, default=1, help="model.loss_chunks: the loss in this many slices")
    parser.add_argument("--out", type=Path, default=Path("plan"))
    parser.add_argument("--all", action="store_true", help="also print every row (what plan.md holds)")
    args = parser.parse_args()

    try:
        cfg = parse_overrides(preset_config(args.model, args.vocab), args.overrides)
        hw = Hardware.load(args.hardware)
    except (FileNotFoundError, ValueError) as err:
        refuse(str(err))
    if args.loss_chunks < 1:
        refuse(f"--loss-chunks={args.loss_chunks} must be >= 1 (model.loss_chunks)")
    if args.memory_gb < 0:
        refuse(f"--memory-gb={args.memory_gb} must be > 0 (0: the hardware profile's)")
    memory_gb = args.memory_gb or hw.hbm_gb
    seq_len = args.seq_len or cfg.max_seq_len
    steps = plan(cfg, hw, args.gpus, args.tokens_per_step, seq_len, args.micro_batch, args.activation_checkpointing,
                 args.loss_chunks)
    title = (f"{cfg.name}, {args.tokens_per_step:,} tokens/step, seq {seq_len}, micro-batch {args.micro_batch}, "
             f"checkpointing {args.activation_checkpointing}, loss chunks {args.loss_chunks}, {hw.name}")
    args.out.mkdir(parents=True, exist_ok=True)
    lines = [f"# Scale plan: {title}", ""]
    best: dict[str, dict[int, Step]] = {d: {} for d in DESIGNS}
    print(f"{title}: fastest layout that fits in {memory_gb:g} GB, per design")
    print("| GPUs | design | dp x tp | GB/rank | DP GB | EP GB | NS GFLOP max / mean | idle owners | opt ms | step ms "
          "| opt share |")
    print("| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n, at_n in steps.items():
        lines += [f"## {n} GPUs", ""] + (table(at_n, memory_gb) if at_n else ["no feasible layout"]) + [""]
        for design in DESIGNS:
            if not any(step.design == design for step in at_n):
                continue  # a design this model has no layout for (EP without experts)
            s = fastest_fitting(at_n, design, memory_gb)
            if s is None:
                print(f"| {n} | {design} | no layout fits | | | | | | | | |")
                continue
            best[design][n] = s
            idle = str(s.row.idle_ranks) if design == "muon-ours" else "-"
            print(f"| {n} | {design} | {s.layout()} | {s.memory_total / GB:.1f} | {s.row.dp_bytes / GB:.2f} | "
                  f"{s.row.ep_bytes / GB:.2f} | "
                  f"{s.row.ns_max / 1e9:,.1f} / {s.row.ns_mean / 1e9:,.1f} | {idle} | {s.optimizer_s * 1e3:.1f} | "
                  f"{s.step_s * 1e3:.1f} | {100 * s.overhead:.1f}% |")
    (args.out / "plan.md").write_text("\n".join(lines) + "\n")
    if args.all:
        print("\n" + "\n".join(lines))
    plot(best, title, args.out / "overhead.png")
    print(f"wrote {args.out / 'plan.md'} and {args.out / 'overhead.png'}")


if __name__ == "__main__":
    main()
