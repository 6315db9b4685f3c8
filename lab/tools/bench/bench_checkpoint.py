"""What a checkpoint save costs the training loop: synchronous vs checkpoint.async_save.

    python lab/tools/bench/bench_checkpoint.py                      # gpt_small, DP=2 on gloo, 3 rounds
    python lab/tools/bench/bench_checkpoint.py --model gpt_tiny --dp 2 --rounds 5

Every rank builds the real Trainer (the configured model, fp32, the embedded corpus) once.
A round runs the same stretch of training steps three times, in turn: without a save, with a
synchronous save after the first step, and with an asynchronous one; each stretch ends by
committing the checkpoint (waiting for a background write to finish, hashing, renaming), so
a write that outlasts the stretch is charged to it. Reported, as medians over rounds: the
stretch's wall time for each, the cost of a save (the stretch minus the save-less stretch of
the same round), and how long the save call itself blocked the loop. A stretch's time is the
slowest rank's.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from scripts import REPO
from lab.tools.bench.bench_common import machine_info
from lab.tools.spawn import run_ranks

MODES = ("none", "sync", "async")


def _worker(rank: int, world: int, model: str, batch: int, seq_len: int, steps: int, rounds: int,
            run_dir: str) -> dict[str, list[tuple[float, float]]]:
    from dataclasses import replace

    from hydra import compose, initialize_config_dir

    from trainer.config import register_configs, to_dataclass
    from trainer.loop import Trainer
    from parallel.mesh import build_mesh

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = to_dataclass(compose(config_name="config", overrides=[
            f"model={model}", "trainer.precision=fp32", "optim.muon.ns_dtype=fp32", "trainer.device=cpu",
            f"trainer.batch_size={batch}", f"trainer.seq_len={seq_len}", "trainer.max_steps=100000",
            "logger.wandb.mode=disabled", "logger.tensorboard=false", "logger.progress=none",
            "checkpoint.keep=1", "eval.interval=0",
        ]))
    trainer = Trainer(cfg, Path(run_dir), build_mesh(cfg.parallel.tp))
    for _ in range(2):  # warm-up: optimizer state exists, first-step costs paid
        trainer.train_step(measure=False)
    out: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    for _ in range(rounds):
        for mode in MODES:
            trainer.cfg = replace(trainer.cfg, checkpoint=replace(trainer.cfg.checkpoint, async_save=mode == "async"))
            dist.barrier()
            start = time.perf_counter()
            blocked = 0.0
            for i in range(steps):
                trainer.train_step(measure=False)
                if i == 0 and mode != "none":
                    t0 = time.perf_counter()
                    trainer.save_checkpoint(final=False)
                    blocked = time.perf_counter() - t0
            trainer.checkpoints.commit()
            dist.barrier()
            out[mode].append((time.perf_counter() - start, blocked))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt_small")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=6, help="training steps per timed stretch")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as run_dir:
        per_rank = run_ranks(_worker, args.dp, args.model, args.batch, args.seq_len, args.steps,
                                   args.rounds, run_dir)
        sizes = sorted(Path(run_dir, "checkpoints").glob("step_*"))
        size_mb = sum(f.stat().st_size for f in sizes[-1].iterdir()) / 1e6 if sizes else float("nan")
    # A stretch lasts as long as its slowest rank.
    wall = {m: [max(r[m][i][0] for r in per_rank) for i in range(args.rounds)] for m in MODES}
    blocked = {m: [max(r[m][i][1] for r in per_rank) for i in range(args.rounds)] for m in MODES}
    print(f"# {machine_info()}")
    print(f"# {args.model}, DP={args.dp} (gloo), {args.batch} x {args.seq_len} tokens per rank, "
          f"{args.steps} steps per stretch, {args.rounds} rounds; checkpoint {size_mb:.1f} MB")
    print("| save | stretch s | save cost s | save call blocked s |")
    print("| --- | ---: | ---: | ---: |")
    for m in MODES:
        cost = statistics.median(w - n for w, n in zip(wall[m], wall["none"]))
        print(f"| {m} | {statistics.median(wall[m]):.2f} | {cost if m != 'none' else 0:.2f} | "
              f"{statistics.median(blocked[m]):.2f} |")


if __name__ == "__main__":
    main()
