"""Which Newton-Schulz iteration runs on which matrix shape, and what each costs.

The standard quintic and Gram Newton-Schulz (optim/muon/newton_schulz.py's docstring) compute the
same polar factor in exact arithmetic; they differ in multiply-adds, which this file counts
(standard_macs, gram_macs), and in speed on a device, which optim/muon/ns_choice.py measures. A
matrix shape is named by NSShape's key in optim.muon.ns_by_shape; use_gram and iteration_for
turn optim.muon.ns_method into the iteration a shape runs.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

# "auto": Gram or standard per matrix shape, as measured on the device (optim/muon/ns_choice.py) and
# handed over as `by_shape`.
NS_METHODS = ("standard", "gram", "auto")
# The two iterations a method resolves to per matrix shape (iteration_for).
ITERATIONS = ("standard", "gram")

# Gram Newton-Schulz restarts after these iterations (counted from 1). The authors restart
# after the second: the first two steps grow the smallest singular values the most (by up to
# a^2, 12x for classic and 33x for Polar Express), so Q's norm stays that small per segment.
GRAM_RESTART_AFTER = (2,)


def standard_macs(n: int, m: int, steps: int) -> int:
    """Multiply-adds of `steps` standard iterations on an n x m matrix whose Gram matrix is
    n x n: per step A = X X^T (n^2 m), A A (n^3) and B X (n^2 m)."""
    return steps * (2 * n * n * m + n ** 3)


def gram_macs(n: int, m: int, steps: int) -> int:
    """Multiply-adds of Gram Newton-Schulz with its restarts, as _iterate_gram does it: R from
    X (n^2 m) per segment; per step R^2 for Z, Z Q (not in a segment's first step) and Z R Z
    (not in its last); at each restart and at the end, Q X (n^2 m)."""
    starts = [0] + [r for r in GRAM_RESTART_AFTER if 0 < r < steps]
    ends = starts[1:] + [steps]
    total = 0
    for lo, hi in zip(starts, ends):
        total += n * n * m  # R = X X^T
        for i in range(lo, hi):
            total += n ** 3 + (n ** 3 if i > lo else 0) + (2 * n ** 3 if i < hi - 1 else 0)
        total += n * n * m  # X = Q X
    return total


def gram_pays(n: int, m: int, steps: int) -> bool:
    """Whether Gram Newton-Schulz costs fewer multiply-adds than the standard iteration on an
    n x m matrix whose Gram matrix is n x n (n <= m unless a TP split decides the side). With
    5 steps and one restart it does once m / n passes 1.5; square matrices gain nothing."""
    return gram_macs(n, m, steps) < standard_macs(n, m, steps)


_SHARD_SUFFIX = {0: "_shard_rows", 1: "_shard_cols"}
_KEY = re.compile(r"^([1-9][0-9]*)x([1-9][0-9]*)(_shard_rows|_shard_cols)?$")


@dataclass(frozen=True)
class NSShape:
    """A matrix as Newton-Schulz sees it: rows x cols whole, or with `split` 0 / 1 this rank's
    rows x cols shard of a matrix split over TP along its rows / cols and iterated as shards
    (tp_mode=gram, newton_schulz_sharded). Its `key` ("768x2048", "384x2048_shard_rows")
    names it in optim.muon.ns_by_shape."""

    rows: int
    cols: int
    split: int | None = None

    @property
    def key(self) -> str:
        return f"{self.rows}x{self.cols}{_SHARD_SUFFIX.get(self.split, '')}"

    @staticmethod
    def parse(key: str) -> "NSShape":
        match = _KEY.match(str(key))
        if match is None:
            raise ValueError(
                f"optim.muon.ns_by_shape: bad shape {key!r} (expected ROWSxCOLS, e.g. 768x2048, "
                f"optionally with _shard_rows or _shard_cols)"
            )
        split = {v: k for k, v in _SHARD_SUFFIX.items()}.get(match.group(3))
        return NSShape(int(match.group(1)), int(match.group(2)), split)

    def gram_sides(self) -> tuple[int, int]:
        """(n, m): the side of the Gram matrix the iteration forms, and the other side. Whole
        matrices use the short side; shards use the side that sums over the shards."""
        if self.split is None:
            return min(self.rows, self.cols), max(self.rows, self.cols)
        return (self.cols, self.rows) if self.split == 0 else (self.rows, self.cols)


def use_gram(method: str, shape: NSShape, steps: int, by_shape: Mapping[str, str] | None = None) -> bool:
    """Whether a matrix of `shape` runs Gram Newton-Schulz: never for "standard"; where it
    costs fewer multiply-adds for "gram"; as `by_shape` (shape key -> "gram" / "standard",
    measured by optim/muon/ns_choice.py) says for "auto", which must name the shape."""
    if method == "standard":
        return False
    if method == "gram":
        return gram_pays(*shape.gram_sides(), steps)
    if method != "auto":
        raise ValueError(f"optim.muon.ns_method: unknown method {method!r} (expected {', '.join(NS_METHODS)})")
    choice = (by_shape or {}).get(shape.key)
    if choice is None:
        raise ValueError(
            f"optim.muon.ns_method=auto: no choice for {shape.key} matrices in optim.muon.ns_by_shape "
            f"(has {sorted(by_shape or {})}); the trainer measures every shape of the model at start-up, "
            f"elsewhere see optim/muon/ns_choice.py"
        )
    return choice == "gram"


def iteration_for(method: str, shape: NSShape, steps: int, by_shape: Mapping[str, str] | None = None) -> str:
    """"gram" or "standard": the iteration `method` runs on matrices of `shape` (use_gram).
    Callers that orthogonalise many matrices of one shape (Muon's stacks) resolve it once and
    hand it to newton_schulz as `iteration`."""
    return "gram" if use_gram(method, shape, steps, by_shape) else "standard"


def check_iteration(iteration: str) -> str:
    """`iteration` if it names one of ITERATIONS; else a ValueError naming it."""
    if iteration not in ITERATIONS:
        raise ValueError(f"newton_schulz: unknown iteration {iteration!r} (expected {' or '.join(ITERATIONS)})")
    return iteration
