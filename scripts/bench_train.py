"""Training throughput (tokens/s) of model presets in fp32 and bf16, measured side by side.

    python scripts/bench_train.py                       # gpt_tiny and gpt_small, fp32 and bf16
    python scripts/bench_train.py --models gpt_small --precisions bf16 --steps 10 optim=adamw

Trailing arguments are Hydra overrides applied to every configuration. Each configuration runs
the real Trainer's train step (forward, backward, clip, optimizer) on the embedded corpus; the
configurations are interleaved round by round so drifting machine load hits them alike.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hydra import compose, initialize_config_dir  # noqa: E402

from trainer.config import register_configs, to_dataclass, validate  # noqa: E402
from trainer.loop import Trainer  # noqa: E402


def build(model: str, precision: str, overrides: list[str], run_dir: Path) -> Trainer:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", [f"model={model}", f"trainer.precision={precision}",
                                 "logger.wandb.mode=disabled", *overrides])
    typed = to_dataclass(cfg)
    validate(typed)
    return Trainer(typed, run_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["gpt_tiny", "gpt_small"])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    register_configs()

    with tempfile.TemporaryDirectory() as tmp:
        trainers = {
            (m, p): build(m, p, args.overrides, Path(tmp))
            for m in args.models for p in args.precisions
        }
        times: dict[tuple[str, str], list[float]] = {k: [] for k in trainers}
        for trainer in trainers.values():  # warm-up: first-touch allocations, kernel choice
            trainer.train_step(measure=False)
        for _ in range(args.rounds):
            for key, trainer in trainers.items():
                start = time.perf_counter()
                for _ in range(args.steps):
                    trainer.train_step(measure=False)
                times[key].append((time.perf_counter() - start) / args.steps)

    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {cpu}")
    print(f"overrides: {' '.join(args.overrides) or '(none)'}")
    print("| model | precision | tokens/step | step s (median) | tokens/s |")
    print("| --- | --- | --- | --- | --- |")
    for (model, precision), samples in times.items():
        tokens = trainers[(model, precision)].tokens_per_step
        step_s = statistics.median(samples)
        print(f"| {model} | {precision} | {tokens} | {step_s:.3f} | {tokens / step_s:,.0f} |")


if __name__ == "__main__":
    main()
