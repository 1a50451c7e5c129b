"""Which token windows each rank trains on, as a pure function of (seed, epoch, position, rank).

nanoGPT samples random offsets with replacement from a live RNG, so a resumed run sees different
batches than an uninterrupted one, and an "epoch" means nothing. Here the training stream is cut
into non-overlapping windows of ``block_size + 1`` tokens (input + shifted target); every epoch
shifts the cut by a seeded offset and visits every window exactly once in a seeded order, split
across ranks. Micro-batch ``g`` of rank ``r`` is therefore known without any state: a run resumed
after ``g`` micro-batches starts at ``g`` and sees exactly what the uninterrupted run saw.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
import torch

from nanolab.data.sizes import (
    DataTooSmallError,
    check_stream_fits,
    check_validation_fits,
    stream_windows,
)
from nanolab.data.skips import Jump, data_position


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of one epoch's window order (the same on every machine and Python)."""
    # A fixed mixing function (not Python's hash(), which is salted per process).
    return (seed * 0x9E3779B1 + epoch * 0x85EBCA77 + 0x165667B1) % (1 << 63)


class _Epochs:
    num_windows: int
    micro_batch_size: int
    world_size: int

    @property
    def batches_per_epoch(self) -> int:
        """Micro-batches each rank draws per epoch (a partial last batch is dropped)."""
        return self.num_windows // self.world_size // self.micro_batch_size

    @property
    def windows_per_pass(self) -> int:
        """Windows one pass over the training data serves: those of an epoch's order that fill
        whole micro-batches on every rank (what a run's ``epoch`` counts in)."""
        return self.batches_per_epoch * self.micro_batch_size * self.world_size


@dataclass(frozen=True)
class WindowPlan(_Epochs):
    """The window layout of one split for one (world_size, micro_batch_size)."""

    num_tokens: int
    block_size: int
    micro_batch_size: int
    world_size: int
    seed: int

    def __post_init__(self) -> None:
        check_stream_fits(self.num_tokens, self.block_size, self.micro_batch_size, self.world_size)

    @property
    def num_windows(self) -> int:
        """Windows per epoch. One block of slack is kept when the data allows, for the shift."""
        return stream_windows(self.num_tokens, self.block_size)

    @property
    def max_offset(self) -> int:
        return self.num_tokens - 1 - self.num_windows * self.block_size

    def epoch_layout(self, epoch: int) -> tuple[int, np.ndarray]:
        """(offset, permutation of window indices) for ``epoch``, made anew (uncached)."""
        return _epoch_layout(self, epoch)

    def fresh_layout(self, epoch: int) -> tuple[int, np.ndarray, int]:
        """(offset, order, stride) of ``epoch``, uncached: window ``i`` of the epoch's order
        is read at token ``offset + order[i] * stride`` (``order[i]`` widened to int64 first:
        the order is int32, :func:`window_permutation`)."""
        return (*_epoch_layout(self, epoch), self.block_size)

    def batch_starts(self, global_batch: int, rank: int) -> np.ndarray:
        """Token offsets of the windows in micro-batch ``global_batch`` (counted over all epochs)."""
        epoch, position = divmod(global_batch, self.batches_per_epoch)
        offset, share = _HELD.share(self, epoch, rank, lambda: _epoch_layout(self, epoch))
        windows = share_batch(share, position, self.micro_batch_size)
        return offset + windows * self.block_size  # int64: share_batch widens the order's int32


def rank_share(order: np.ndarray, position: int, micro: int, world: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s windows of micro-batch ``position`` in an epoch's ``order``: the
    ``micro x world`` windows of that position, dealt out round-robin, so a step's windows are
    the same set on any number of devices (N devices = N accumulated micro-batches). As int64,
    whatever the order's dtype, so token offsets computed from them cannot wrap."""
    first = position * micro * world
    return order[first + rank : first + micro * world : world].astype(np.int64)


def epoch_share(order: np.ndarray, plan: _Epochs, rank: int) -> np.ndarray:
    """Every window rank ``rank`` trains on in an epoch's ``order``, in the order it trains
    them: :func:`rank_share` of each whole micro-batch position, end to end (the windows past
    the last whole one are never trained). ``1 / world_size`` of the order, held apart from it
    so the whole order can be freed."""
    share = order[rank : plan.windows_per_pass : plan.world_size]
    return share if plan.world_size == 1 else share.copy()


def share_batch(share: np.ndarray, position: int, micro: int) -> np.ndarray:
    """Micro-batch ``position`` of a rank's :func:`epoch_share`, as int64 (what
    :func:`rank_share` gives from the whole order)."""
    return share[position * micro : (position + 1) * micro].astype(np.int64)


class _HeldShare:
    """The one epoch share a process keeps: that of the (plan, epoch, rank) it last trained on.

    A training process draws its micro-batches in order, one rank, one epoch after another, so
    it needs one epoch's share at a time; keeping earlier epochs' orders (4 bytes a window
    each: 191 MiB at 50M windows) bought nothing but memory. Plans are compared by value, so the
    plan a data module builds again for a check shares the slot with the sampler's."""

    def __init__(self) -> None:
        self._held: tuple[tuple[Any, int, int], int, np.ndarray] | None = None

    def share(
        self,
        plan: _Epochs,
        epoch: int,
        rank: int,
        layout: Callable[[], tuple[int, np.ndarray]],
    ) -> tuple[int, np.ndarray]:
        """(offset, :func:`epoch_share`) of ``plan``'s ``epoch`` for ``rank``; ``layout``
        makes the epoch's (offset, order) when the slot holds another."""
        key = (plan, epoch, rank)
        held = self._held
        if held is None or held[0] != key:
            held = self._held = None  # the old share goes before the new order is made
            offset, order = layout()
            held = self._held = (key, offset, epoch_share(order, plan, rank))
        return held[1], held[2]  # this call's own, whatever another thread holds meanwhile


_HELD = _HeldShare()


def _epoch_layout(plan: WindowPlan, epoch: int) -> tuple[int, np.ndarray]:
    g = torch.Generator().manual_seed(epoch_seed(plan.seed, epoch))
    offset = int(torch.randint(0, plan.max_offset + 1, (1,), generator=g))
    return offset, window_permutation(plan.num_windows, g)


def window_permutation(count: int, generator: torch.Generator) -> np.ndarray:
    """An epoch's order: a seeded permutation of ``range(count)``, held as int32 when the
    numbers fit (half the memory of int64: 4 bytes per window, 400 MB for 100M windows), int64
    beyond. Torch's permutation draws the same numbers for either dtype, so an order, and a
    run resumed in it, is the one earlier versions made as int64. Its slices are widened to
    int64 (:func:`rank_share`) before they are multiplied into token offsets."""
    dtype = torch.int32 if count <= np.iinfo(np.int32).max else torch.int64
    return torch.randperm(count, generator=generator, dtype=dtype).numpy()


@dataclass(frozen=True)
class IndexPlan(_Epochs):
    """The training order over ``num_windows`` fixed windows for one (world, micro-batch)."""

    num_windows: int
    micro_batch_size: int
    world_size: int
    seed: int

    def __post_init__(self) -> None:
        if self.batches_per_epoch < 1:
            raise DataTooSmallError(
                f"the training split has {self.num_windows} windows, fewer than "
                f"micro_batch_size x world_size = {self.micro_batch_size * self.world_size}; "
                "add windows or lower data.micro_batch_size"
            )

    def batch_starts(self, global_batch: int, rank: int) -> np.ndarray:
        """Window numbers of rank ``rank``'s micro-batch ``global_batch`` (over all epochs)."""
        epoch, position = divmod(global_batch, self.batches_per_epoch)
        _, share = _HELD.share(self, epoch, rank, lambda: self.fresh_layout(epoch)[:2])
        return share_batch(share, position, self.micro_batch_size)

    def fresh_layout(self, epoch: int) -> tuple[int, np.ndarray, int]:
        """(0, order, 1) of ``epoch``, uncached: the keys are the window numbers themselves."""
        return 0, _order(self.num_windows, self.seed, epoch), 1


def _order(num_windows: int, seed: int, epoch: int) -> np.ndarray:
    return window_permutation(num_windows, torch.Generator().manual_seed(epoch_seed(seed, epoch)))


class ResumableBatchSampler:
    """Yields the window starts of micro-batches ``start, start+1, ...`` for one rank, forever.

    Training is counted in steps, not epochs, so the stream has no end (Lightning treats the
    loader as infinite); ``start`` is set from the trainer's progress when a run resumes, and
    ``jumps`` carry it to where its checkpoint left the order (:mod:`nanolab.data.order`) and
    skip what a rollback left behind (:mod:`nanolab.data.skips`).
    """

    def __init__(self, plan: Any, rank: int, start: int = 0, jumps: Sequence[Jump] = ()) -> None:
        self.plan = plan
        self.rank = rank
        self.start = start
        self.jumps = list(jumps)  # data skipped by rollbacks (nanolab.data.skips)

    def position(self, consumed: int) -> int:
        """The position in the order of micro-batch ``consumed`` of this launch (what a
        checkpoint records: :func:`nanolab.data.order.order_record`)."""
        return data_position(consumed, self.jumps)

    def __iter__(self) -> Iterator[np.ndarray]:
        k = self.start
        while True:
            yield self.plan.batch_starts(self.position(k), self.rank)
            k += 1


def validation_starts(num_tokens: int, block_size: int, count: int) -> np.ndarray:
    """``count`` evenly spaced, fixed window starts over the validation split."""
    check_validation_fits(num_tokens, block_size)
    last = num_tokens - block_size - 1
    count = max(1, min(count, last + 1))
    return np.linspace(0, last, count).round().astype(np.int64)


def evaluation_batches(
    keys: np.ndarray, rank: int, world: int, micro_batch_size: int
) -> list[np.ndarray]:
    """Rank ``rank``'s batches of the validation windows ``keys``, at most
    ``micro_batch_size`` each. Every rank gets as many windows, so as many batches (a sharded
    model runs collectives in each forward) and as many windows to average: Lightning reduces
    a logged mean as the ranks' sums over the ranks' mean window count, an integer mean, so
    unequal shares would be weighed wrong. So the set is cut to a multiple of ``world``, and a
    set smaller than ``world`` is repeated until every rank has one window (the same mean as one
    device when ``world`` is a multiple of it); :func:`validation_cut` says when either changes
    what is scored."""
    count = len(keys)
    if count == 0:
        raise DataTooSmallError(
            "the validation split holds no window to score; add validation text (or windows)"
        )
    if count < world:
        keys = np.resize(keys, world)  # cyclic: windows 0..count-1, 0.., one per rank
    mine = keys[: len(keys) // world * world][rank::world]
    return [mine[i : i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]


def validation_shortfall(asked: int, held: int, where: str) -> str | None:
    """The launch's warning when ``data.val_windows`` asks for more windows than ``where``'s
    validation split holds (``held``): every evaluation then scores the whole split, fewer
    windows than the config says, and a run on a larger split would score more with the same
    config; ``None`` when the split holds as many."""
    if held >= asked:
        return None
    return (
        f"{where}: data.val_windows {asked} asks for more validation windows than its "
        f"validation split holds ({held}): each evaluation scores all {held}; set "
        f"data.val_windows {held} to say what is scored, or give the split more text"
    )


def validation_cut(count: int, world: int, where: str) -> str | None:
    """The launch's warning when ``world`` devices score ``where``'s ``count`` validation
    windows otherwise than one device does: fewer of them (cut to a multiple of ``world``), or
    some more often than others (fewer windows than devices, ``world`` not a multiple);
    ``None`` when they score the same set, each window as often."""
    if count == 0 or count % world == 0 or (count < world and world % count == 0):
        return None
    if count < world:
        return (
            f"{where}: {world} devices score its {count} validation window(s) unevenly (one per "
            f"device, some twice), one device each once: their val losses differ; set "
            f"data.val_windows to a multiple of {world}, or give the split more windows"
        )
    kept = count // world * world
    return (
        f"{where}: {world} devices score {kept} of the {count} validation windows (each device "
        f"as many), one device all {count}: their val losses differ; set data.val_windows to a "
        f"multiple of {world} ({kept} or {kept + world}) for the same set on both"
    )


# -- mixtures ----------------------------------------------------------------------------------
#: A mixture's shares are fractions with denominators up to this: the stratified slot rule is
#: integer arithmetic, the same on every machine.
SHARE_DENOMINATOR = 1_000_000
#: The smallest share of the slots a dataset of a mixture may have (``data.datasets`` refuses a
#: smaller one): below it the share's fraction is no longer near the weight given.
MIN_SHARE = 1.0 / SHARE_DENOMINATOR


def mixture_shares(weights: Sequence[float]) -> list[float]:
    """Each weight's share of their total (summing to 1): what training and the validation
    average give each dataset. Weights whose sum overflows (``1e308``) are scaled down by the
    largest first, so only the ratios matter, never the scale."""
    total = sum(weights)
    if not np.isfinite(total):
        top = max(weights)
        weights = [w / top for w in weights]
        total = sum(weights)
    return [w / total for w in weights]


def share_fractions(weights: Sequence[float]) -> list[Fraction]:
    """The exact fractions (summing to 1) of the slots each dataset of a mixture takes.

    Weights that are fractions with denominators up to :data:`SHARE_DENOMINATOR` as written
    (0.7 and 0.3, 1 and 2, any decimals with six places) keep the fractions they always had: a
    running job resumes in the very order it trained in. Any other weights (``6e-7``, ``1e-9``:
    their own fractions would round to 0 or far from the ratio) are normalised first, and their
    shares made fractions, so the ratio of the weights is what trains, whatever their scale."""
    written = [Fraction(w).limit_denominator(SHARE_DENOMINATOR) for w in weights]
    as_written = zip(written, weights, strict=True)
    if not all(f > 0 and abs(float(f) - w) <= 1e-9 * w for f, w in as_written):
        written = [
            Fraction(s).limit_denominator(SHARE_DENOMINATOR) for s in mixture_shares(weights)
        ]
    if any(f <= 0 for f in written):
        raise ValueError(f"mixture weights must be positive shares above {MIN_SHARE:g}")
    total = sum(written)
    return [f / total for f in written]


def _dataset_seed(seed: int, index: int) -> int:
    """The window-order seed of dataset ``index`` of a mixture (distinct per dataset)."""
    return (seed * 0x9E3779B1 + (index + 1) * 0xC2B2AE3D + 0x27D4EB2F) % (1 << 63)


class MixturePlan:
    """Which (dataset, window) each rank trains on when several datasets are mixed by weight.

    The training stream is a sequence of window *slots*; slot ``s`` of the single-process view
    is micro-batch ``s // B``, and a step of ``W`` ranks takes the same ``B x W`` slots as ``W``
    accumulated micro-batches (rank ``r`` takes every ``W``-th slot starting at ``r``), so the
    DDP = gradient accumulation identity holds as it does for one dataset.

    Slots go to datasets by a deterministic stratified rule, not by dice: dataset 0 takes slot
    ``s`` exactly when ``floor(p0 * (s + 1)) > floor(p0 * s)`` (``p0`` its share), so after any
    ``n`` slots it has had ``floor(p0 * n)`` of them — the weights hold over every stretch of the
    stream, not only on average — and the other datasets share the remaining slots the same way,
    one after the other. The shares are exact fractions (:func:`share_fractions`), so the rule
    is integer arithmetic and the same on every machine. The ``k``-th slot of dataset ``d`` is
    window ``k`` of that dataset's own shuffled stream (a :class:`WindowPlan` with its own seed: every window once per epoch of
    that dataset). Micro-batch ``g`` of rank ``r`` is thus a pure function of (seed, g, r): a
    resumed run sees exactly what the uninterrupted one saw.
    """

    def __init__(
        self,
        num_tokens: Sequence[int],
        weights: Sequence[float],
        block_size: int,
        micro_batch_size: int,
        world_size: int,
        seed: int,
        names: Sequence[str] | None = None,
        rows: Sequence[int] | None = None,
    ) -> None:
        if len(num_tokens) != len(weights) or not num_tokens:
            raise ValueError("a mixture needs one weight per dataset")
        names = list(names) if names is not None else [str(i) for i in range(len(num_tokens))]
        self.block_size = block_size
        self.micro_batch_size = micro_batch_size
        self.world_size = world_size
        self.seed = seed
        self.names = names
        plans: list[WindowPlan | IndexPlan] = []
        for i, n in enumerate(num_tokens):
            try:
                if rows is None:
                    plans.append(WindowPlan(int(n), block_size, 1, 1, _dataset_seed(seed, i)))
                else:  # document-aligned rows, numbered (nanolab.data.documents)
                    plans.append(IndexPlan(int(rows[i]), 1, 1, _dataset_seed(seed, i)))
            except DataTooSmallError as err:
                raise DataTooSmallError(f"dataset {names[i]}: {err}") from None
        self.plans = plans
        self.shares = share_fractions(weights)
        # Dataset d takes its share of the slots the datasets before it left over.
        self._split: list[tuple[int, int]] = []
        left = Fraction(1)
        for share in self.shares[:-1]:
            q = share / left
            self._split.append((q.numerator, q.denominator))
            left -= share
        self._layouts: dict[int, tuple[int, int, np.ndarray, int]] = {}

    @property
    def windows_per_pass(self) -> int:
        """Windows one pass over the training data serves, what a mixture's ``epoch`` counts
        in: every dataset's windows together. No dataset's own pass: at its share each goes
        through its own windows faster or slower (:meth:`served` says how far)."""
        return sum(plan.num_windows for plan in self.plans)

    def served(self, slots: int) -> list[int]:
        """Windows of each dataset the first ``slots`` slots of the stream hold, by the rule
        :meth:`slot_source` follows (dataset ``d`` takes its share of what those before it
        left over): exact counts, at once, so a dataset's own passes (its count over its
        windows) need no walk over the stream."""
        counts, left = [], max(0, int(slots))
        for num, den in self._split:
            taken = num * left // den
            counts.append(taken)
            left -= taken
        return [*counts, left]

    def slot_source(self, slot: int) -> tuple[int, int]:
        """(dataset, index in that dataset's own window stream) of global slot ``slot``."""
        r = slot
        for d, (num, den) in enumerate(self._split):
            before, after = num * r // den, num * (r + 1) // den
            if after > before:
                return d, before
            r -= before  # position among the slots the later datasets share
        return len(self._split), r

    def _layout(self, dataset: int, epoch: int) -> tuple[int, np.ndarray, int]:
        cached = self._layouts.get(dataset)
        if cached is None or cached[0] != epoch:
            # One layout per dataset: the stream moves forward, so older epochs are not kept.
            cached = (epoch, *self.plans[dataset].fresh_layout(epoch))
            self._layouts[dataset] = cached
        return cached[1], cached[2], cached[3]

    def _starts(self, dataset: int, ks: np.ndarray) -> np.ndarray:
        """Read keys (token offsets, or aligned row numbers) of windows ``ks`` of
        ``dataset``'s own stream."""
        plan = self.plans[dataset]
        epochs, positions = np.divmod(ks, plan.num_windows)
        out = np.empty(len(ks), dtype=np.int64)
        for epoch in np.unique(epochs):  # one, or two at an epoch boundary
            here = epochs == epoch
            offset, order, stride = self._layout(dataset, int(epoch))
            out[here] = offset + order[positions[here]].astype(np.int64) * stride
        return out

    def batch_starts(self, global_batch: int, rank: int) -> np.ndarray:
        """Rows of (dataset, token offset) for micro-batch ``global_batch`` of ``rank``."""
        B, W = self.micro_batch_size, self.world_size
        first = global_batch * B * W + rank
        rows = np.array([self.slot_source(first + i * W) for i in range(B)], dtype=np.int64)
        for dataset in np.unique(rows[:, 0]):
            mine = rows[:, 0] == dataset
            rows[mine, 1] = self._starts(int(dataset), rows[mine, 1])
        return rows
