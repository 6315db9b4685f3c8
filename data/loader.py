"""Batches of token windows: random for training, fixed for evaluation."""
from __future__ import annotations

import numpy as np
import torch

from data.hashing import hash_hex


def _windows(tokens: np.ndarray, starts: np.ndarray, length: int) -> torch.Tensor:
    """Rows tokens[s : s + length] for each start s, as int64."""
    index = starts[:, None] + np.arange(length)
    return torch.from_numpy(np.asarray(tokens[index], dtype=np.int64))


def _inputs_targets(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Contiguous copies, so callers can .view() them like any freshly made tensor.
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


class TrainBatches:
    """Training batches of `global_batch` windows of seq_len + 1 tokens at uniform random offsets.

    The offsets of a step come from a generator seeded by (seed, step) alone, so any
    step's batch can be recomputed without replaying earlier ones: resuming needs only
    the step number, and every data-parallel rank agrees on the batch without talking.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int) -> None:
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be a 1-D array (got shape {tokens.shape})")
        if seq_len < 1 or global_batch < 1:
            raise ValueError(f"seq_len and global_batch must be >= 1 (got {seq_len}, {global_batch})")
        if len(tokens) < seq_len + 2:
            raise ValueError(
                f"the training split has {len(tokens)} tokens, too few for windows of seq_len + 1 = "
                f"{seq_len + 1} at more than one offset; lower trainer.seq_len or use more data"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch_size = global_batch
        self.seed = seed

    def _starts(self, step: int) -> np.ndarray:
        # A hash, not seed * k + step: distinct (seed, step) pairs never share a stream.
        generator = torch.Generator().manual_seed(int(hash_hex(f"{self.seed}/{step}")[:15], 16))
        high = len(self.tokens) - self.seq_len  # exclusive: the last start is len - seq_len - 1
        return torch.randint(0, high, (self.global_batch_size,), generator=generator).numpy()

    def global_batch(self, step: int) -> torch.Tensor:
        """All windows of `step`: int64 [global_batch, seq_len + 1]."""
        return _windows(self.tokens, self._starts(step), self.seq_len + 1)

    def micro_batch(
        self, step: int, micro: int, dp_rank: int, dp_size: int, grad_accum: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of one rank's micro-step, each int64 [per_rank_batch, seq_len].

        The global batch is cut into dp_size * grad_accum contiguous blocks, one per
        (rank, micro-step), so the union over all of them is exactly the global batch:
        how the batch is split over ranks and accumulation steps does not change what a
        step trains on.
        """
        if not (0 <= dp_rank < dp_size and 0 <= micro < grad_accum):
            raise ValueError(
                f"need 0 <= dp_rank < dp_size and 0 <= micro < grad_accum (got dp_rank={dp_rank}, "
                f"dp_size={dp_size}, micro={micro}, grad_accum={grad_accum})"
            )
        blocks = dp_size * grad_accum
        if self.global_batch_size % blocks:
            raise ValueError(
                f"global batch {self.global_batch_size} is not divisible by dp_size * grad_accum = {blocks}"
            )
        per_rank = self.global_batch_size // blocks
        block = dp_rank * grad_accum + micro
        starts = self._starts(step)[block * per_rank : (block + 1) * per_rank]
        return _inputs_targets(_windows(self.tokens, starts, self.seq_len + 1))


def eval_batches(
    tokens: np.ndarray, seq_len: int, batch_size: int, n_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`n_batches` fixed (inputs, targets) batches of windows spread evenly over the whole set.

    No randomness: the same windows every call, so eval losses are comparable across
    steps and runs. Windows overlap when the set is too small to hold them side by side.
    """
    length = seq_len + 1
    if len(tokens) < length:
        raise ValueError(f"eval set has {len(tokens)} tokens, fewer than seq_len + 1 = {length}")
    starts = np.linspace(0, len(tokens) - length, batch_size * n_batches).round().astype(np.int64)
    rows = _windows(tokens, starts, length)
    return [_inputs_targets(batch) for batch in rows.split(batch_size)]
