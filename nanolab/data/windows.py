"""Which token windows each rank trains on, as a pure function of (seed, epoch, position, rank).

nanoGPT samples random offsets with replacement from a live RNG, so a resumed run sees different
batches than an uninterrupted one, and an "epoch" means nothing. Here the training stream is cut
into non-overlapping windows of ``block_size + 1`` tokens (input + shifted target); every epoch
shifts the cut by a seeded offset and visits every window exactly once in a seeded order, split
across ranks. Micro-batch ``g`` of rank ``r`` is therefore known without any state: a run resumed
after ``g`` micro-batches starts at ``g`` and sees exactly what the uninterrupted run saw.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch


class DataTooSmallError(ValueError):
    """The split holds fewer windows than one step of all ranks needs."""


def _epoch_seed(seed: int, epoch: int) -> int:
    # A fixed mixing function (not Python's hash(), which is salted per process).
    return (seed * 0x9E3779B1 + epoch * 0x85EBCA77 + 0x165667B1) % (1 << 63)


@dataclass(frozen=True)
class WindowPlan:
    """The window layout of one split for one (world_size, micro_batch_size)."""

    num_tokens: int
    block_size: int
    micro_batch_size: int
    world_size: int
    seed: int

    def __post_init__(self) -> None:
        if self.num_tokens < self.block_size + 1:
            raise DataTooSmallError(
                f"the training split has {self.num_tokens} tokens, fewer than one block "
                f"(block_size {self.block_size} + 1); add text or lower model.block_size"
            )
        if self.batches_per_epoch < 1:
            raise DataTooSmallError(
                f"the training split has {self.num_windows} windows of {self.block_size + 1} "
                f"tokens, fewer than micro_batch_size x world_size = "
                f"{self.micro_batch_size * self.world_size}; add text or lower data.micro_batch_size"
            )

    @property
    def num_windows(self) -> int:
        """Windows per epoch. One block of slack is kept when the data allows, for the shift."""
        n = (self.num_tokens - 1) // self.block_size
        return n - 1 if n >= 2 else n

    @property
    def max_offset(self) -> int:
        return self.num_tokens - 1 - self.num_windows * self.block_size

    @property
    def batches_per_epoch(self) -> int:
        """Micro-batches each rank draws per epoch (a partial last batch is dropped)."""
        return self.num_windows // self.world_size // self.micro_batch_size

    def epoch_layout(self, epoch: int) -> tuple[int, np.ndarray]:
        """(offset, permutation of window indices) for ``epoch``."""
        return _epoch_layout(self, epoch)

    def batch_starts(self, global_batch: int, rank: int) -> np.ndarray:
        """Token offsets of the windows in micro-batch ``global_batch`` (counted over all epochs)."""
        epoch, position = divmod(global_batch, self.batches_per_epoch)
        offset, order = self.epoch_layout(epoch)
        B, W = self.micro_batch_size, self.world_size
        first = position * B * W
        windows = order[first + rank : first + B * W : W]
        return offset + windows * self.block_size


@lru_cache(maxsize=4)
def _epoch_layout(plan: WindowPlan, epoch: int) -> tuple[int, np.ndarray]:
    g = torch.Generator().manual_seed(_epoch_seed(plan.seed, epoch))
    offset = int(torch.randint(0, plan.max_offset + 1, (1,), generator=g))
    order = torch.randperm(plan.num_windows, generator=g).numpy()
    return offset, order


class ResumableBatchSampler:
    """Yields the window starts of micro-batches ``start, start+1, ...`` for one rank, forever.

    Training is counted in steps, not epochs, so the stream has no end (Lightning treats the
    loader as infinite); ``start`` is set from the trainer's progress when a run resumes.
    """

    def __init__(self, plan: WindowPlan, rank: int, start: int = 0) -> None:
        self.plan = plan
        self.rank = rank
        self.start = start

    def __iter__(self) -> Iterator[np.ndarray]:
        g = self.start
        while True:
            yield self.plan.batch_starts(g, self.rank)
            g += 1


def validation_starts(num_tokens: int, block_size: int, count: int) -> np.ndarray:
    """``count`` evenly spaced, fixed window starts over the validation split."""
    last = num_tokens - block_size - 1
    if last < 0:
        raise DataTooSmallError(
            f"the validation split has {num_tokens} tokens, fewer than one block "
            f"(block_size {block_size} + 1); add text, raise val_fraction or lower block_size"
        )
    count = max(1, min(count, last + 1))
    return np.linspace(0, last, count).round().astype(np.int64)
