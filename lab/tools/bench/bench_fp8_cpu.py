"""Why trainer.fp8 emulates its float8 matmuls off CUDA (model/fp8.py's linear_config): one
Float8Linear's forward and backward on this CPU with torch's _scaled_mm against torchao's
emulation (the same float8 casts, the product in fp32), interleaved.

    python lab/tools/bench/bench_fp8_cpu.py [--shape 512 64 192] [--repeats 10]
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from model.fp8 import torchao_float8


def step_s(emulate: bool, recipe: str, tokens: int, inputs: int, outputs: int, repeats: int) -> float:
    float8 = torchao_float8()
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(inputs, outputs, bias=False))
    config = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    float8.convert_to_float8_training(layer, config=config)
    x = torch.randn(tokens, inputs, requires_grad=True)
    layer(x).sum().backward()  # first-call costs
    start = time.perf_counter()
    for _ in range(repeats):
        layer(x).sum().backward()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", type=int, nargs=3, default=[512, 64, 192], metavar=("TOKENS", "IN", "OUT"))
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; tokens x in x out = {args.shape}")
    print("| recipe | _scaled_mm ms | emulated ms | _scaled_mm / emulated |")
    print("| --- | ---: | ---: | ---: |")
    for recipe in ("tensorwise", "rowwise"):
        native = step_s(False, recipe, *args.shape, args.repeats)
        emulated = step_s(True, recipe, *args.shape, args.repeats)
        print(f"| {recipe} | {native * 1e3:.1f} | {emulated * 1e3:.1f} | {native / emulated:.0f}x |")


if __name__ == "__main__":
    main()
