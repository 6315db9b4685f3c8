"""One rank's memory in a training step of any layout, measured on this machine's CPU without
allocating it (trainer/simulation/memory_estimate.py: the real model and optimizer under FakeTensorMode),
next to what the planner predicts for it (planning/memory_plan.planned_memory).

    python scripts/plan/estimate_memory.py --model gpt_8b --dp-shard 8 --tp 8
    python scripts/plan/estimate_memory.py --model moe_16b --dp-shard 8 --ep 8 --seq-len 4096 --json
    python scripts/plan/estimate_memory.py --model gpt_1b --dp-shard 8 --activation-checkpointing full --loss-chunks 8

The layout's world size is dp_replicate x dp_shard x tp (EP is carved out of the data-parallel
ranks); --rank picks the rank measured. One estimate per process: process groups are global.
Every bad value is one line naming its flag (exit code 2) before anything is built, a layout too
large to estimate too (planning/layout_limits.py): the estimate's work grows with every rank.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from planning.layout_limits import oversized
from trainer.simulation.memory_estimate import OPTIMIZERS, PRECISIONS, EstimateSpec, estimate_memory, train_config
from model.presets import preset_config, preset_names
from planning.memory_plan import planned_memory
from model.config import CHECKPOINTING_MODES
from parallel.mesh import Layout
from scripts.refuse import refuse
from trainer.config import ConfigError, nearest

GB = 1e9
# The default sequence length, where the model's max_seq_len allows it: the presets' 4k context.
SEQ_LEN = 4096
# The flag that sets each config key the estimate's checks may name (trainer/simulation/memory_estimate.py
# train_config), so that a message names what the user typed.
FLAGS = {"parallel.dp_replicate": "--dp-replicate", "parallel.dp_shard": "--dp-shard", "parallel.tp": "--tp",
         "parallel.ep": "--ep", "parallel.simulate_rank": "--rank", "trainer.batch_size": "--batch-size",
         "trainer.seq_len": "--seq-len", "model.loss_chunks": "--loss-chunks"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt_8b", help="a conf/model preset")
    parser.add_argument("--vocab-size", type=int, default=0, help="default: the preset's documented vocabulary")
    parser.add_argument("--dp-replicate", type=int, default=1)
    parser.add_argument("--dp-shard", type=int, default=8)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per rank per micro-batch")
    parser.add_argument("--seq-len", type=int, default=None,
                        help=f"tokens per sequence (default: {SEQ_LEN}, or the model's max_seq_len where shorter)")
    parser.add_argument("--optim", choices=OPTIMIZERS, default="muon")
    parser.add_argument("--precision", choices=PRECISIONS, default="bf16")
    parser.add_argument("--activation-checkpointing", choices=CHECKPOINTING_MODES, default="none")
    parser.add_argument("--loss-chunks", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print the estimate and the plan as JSON")
    return parser.parse_args(argv)


def check_flags(args: argparse.Namespace) -> None:
    """Refuse a bad flag in one line naming it, before anything is built; fill in --seq-len."""
    if args.model not in preset_names():
        close = nearest(Path(args.model).stem, preset_names())  # a path to a preset's file names its stem
        hint = f"did you mean {close}? " if close else ""
        refuse(f"--model {args.model}: no such preset ({hint}known: {', '.join(preset_names())})")
    for flag, value, minimum in (("--dp-replicate", args.dp_replicate, 1), ("--dp-shard", args.dp_shard, 1),
                                 ("--tp", args.tp, 1), ("--ep", args.ep, 1), ("--batch-size", args.batch_size, 1),
                                 ("--seq-len", args.seq_len, 1), ("--loss-chunks", args.loss_chunks, 1),
                                 ("--vocab-size", args.vocab_size, 0)):
        if value is not None and value < minimum:
            refuse(f"{flag} {value}: must be at least {minimum}")
    max_len = preset_config(args.model).max_seq_len
    if args.seq_len is None:
        args.seq_len = min(SEQ_LEN, max_len)
    elif args.seq_len > max_len:
        refuse(f"--seq-len {args.seq_len}: more than {args.model}'s max_seq_len {max_len}")
    world = args.dp_replicate * args.dp_shard * args.tp
    sizes = f"--dp-replicate {args.dp_replicate} x --dp-shard {args.dp_shard} x --tp {args.tp}"
    too_large = oversized(preset_config(args.model, args.vocab_size), Layout(args.dp_replicate, args.dp_shard, args.tp,
                          args.ep), f"--dp-shard {args.dp_shard}", sizes)
    if too_large is not None:
        refuse(too_large)
    if not 0 <= args.rank < world:
        refuse(f"--rank {args.rank}: the layout has {world} ranks ({sizes}), numbered 0 to {world - 1}")


def flag_words(line: str) -> str:
    """A check's line with each config key the flags set named as its flag: "--tp 3", not
    "parallel.tp=3"."""
    for key, flag in FLAGS.items():
        line = re.sub(rf"\b{re.escape(key)}=(\S+?)(?=[\s,;:)]|$)", rf"{flag} \1", line)
        line = re.sub(rf"\b{re.escape(key)}\b", flag, line)
    return line


def spec_of(args: argparse.Namespace) -> EstimateSpec:
    return EstimateSpec(model=args.model, vocab_size=args.vocab_size, dp_replicate=args.dp_replicate,
                        dp_shard=args.dp_shard, tp=args.tp, ep=args.ep, rank=args.rank, batch_size=args.batch_size,
                        seq_len=args.seq_len, optim=args.optim, precision=args.precision,
                        activation_checkpointing=args.activation_checkpointing, loss_chunks=args.loss_chunks)


def plan_of(spec: EstimateSpec) -> dict[str, float]:
    return planned_memory(preset_config(spec.model, spec.vocab_size),
                          Layout(spec.dp_replicate, spec.dp_shard, spec.tp, spec.ep), spec.optim, spec.batch_size,
                          spec.seq_len, spec.activation_checkpointing, spec.loss_chunks, spec.precision)


def table(estimate: dict, plan: dict[str, float]) -> list[str]:
    lines = ["| part | estimate GB | plan GB | plan vs estimate |", "| --- | ---: | ---: | ---: |"]
    for name in ("params", "grads", "optimizer_state", "activations", "gathered", "peak"):
        measured, planned = estimate[name], plan["total" if name == "peak" else name]
        diff = f"{100 * (planned / measured - 1):+.1f}%" if measured else "-"
        lines.append(f"| {name} | {measured / GB:.3f} | {planned / GB:.3f} | {diff} |")
    for phase, parts in estimate["phase_peaks"].items():
        shown = ", ".join(f"{k} {v / GB:.2f}" for k, v in parts.items() if k != "Total" and v >= GB / 1000)
        lines.append(f"peak of the {phase.replace('_', ' and ')}: {parts['Total'] / GB:.3f} GB ({shown})")
    return lines


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    check_flags(args)
    spec = spec_of(args)
    try:
        train_config(spec)  # the checks that values fit together, before anything is built
        plan = plan_of(spec)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        refuse(flag_words(str(err)))
    estimate = estimate_memory(spec).to_dict()
    if args.json:
        print(json.dumps({"estimate": estimate, "plan": plan}, indent=1))
        return
    layout = (f"dp_replicate {spec.dp_replicate} x dp_shard {spec.dp_shard} x tp {spec.tp}"
              + (f", ep {spec.ep}" if spec.ep > 1 else ""))
    print(f"{spec.model}, rank {spec.rank} of {layout}; {spec.batch_size} x {spec.seq_len} tokens, {spec.optim}, "
          f"{spec.precision}, checkpointing {spec.activation_checkpointing}, loss chunks {spec.loss_chunks} "
          f"(estimated in {estimate['seconds']:.1f} s)")
    print("\n".join(table(estimate, plan)))


if __name__ == "__main__":
    main()
