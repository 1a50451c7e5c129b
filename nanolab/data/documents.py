"""Document-aligned windows (``data.align: document``): every window starts at a document.

``nanolab prepare`` writes one token stream per split with the end-of-text id after every
document. Fixed windows cut from that stream start mid-document, and a model spends part of
every window predicting text whose beginning it cannot see. Aligned windows instead pack whole
documents into rows of ``block_size + 1`` tokens, as nanochat's loader does:

* The stream is split *before* every end-of-text token, so each document is a unit that begins
  with the end-of-text of the one before it, which acts as its beginning-of-sequence token (the
  first document of a split has none). Every row thus starts at a document start, and the first
  token of each document is a prediction target.
* Units are packed best-fit, in stream order through a look-ahead buffer of
  :data:`PACK_BUFFER` units: a row takes the largest buffered unit that still fits, until none
  does; then the shortest buffered unit is cropped to fill the row exactly, and the rest of it
  is dropped. Rows are never padded, so every position trains; what cropping drops is counted
  (:attr:`Packing.dropped_tokens`) and reported when a run starts.
* The packing is a function of the data and the block size only. The training order over its
  rows is the same seeded, per-epoch permutation that fixed windows use, so exact resume,
  N devices = N accumulated micro-batches and mixtures hold unchanged.

The scan that finds document boundaries reads the memory-mapped split in chunks of
:data:`SCAN_CHUNK` tokens, so memory follows the number of documents, not of tokens: about 35
bytes per document while packing (int64 arrays of the starts, the lengths and the pieces
taken), 12 per packed piece after it. On a synthetic split of 1M documents (163M tokens, rows
of 1,025) the scan and the packing take 0.85 s of CPU and 33 MiB at their peak, on 5M
documents 4.5 s and 166 MiB, besides the split's own pages of the page cache (a Python list
of ints per document, and a hash-based ``np.unique`` of the starts, took 2.2 s and 101 MiB,
13.4 s and 506 MiB). Only the first launch pays that: :mod:`nanolab.data.packing_cache` keeps the packing in the
dataset, and later launches, resumes and ranks memory-map it.
"""

from __future__ import annotations

import bisect
import itertools
from array import array
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

#: Units the best-fit packer looks ahead over (nanochat uses about a thousand documents).
PACK_BUFFER = 1000
#: Tokens read per step of the boundary scan.
SCAN_CHUNK = 1 << 24
#: Units whose sort keys the packer makes at a time.
KEY_CHUNK = 1 << 16


def unit_starts(tokens: np.ndarray, eot_id: int) -> np.ndarray:
    """Where each document unit of ``tokens`` starts: 0, then every end-of-text position (a
    unit begins with the end-of-text that closes the previous document). A stream that ends
    with an end-of-text has no unit after it."""
    found = [np.zeros(1, dtype=np.int64)]
    for at in range(0, len(tokens), SCAN_CHUNK):
        hits = np.flatnonzero(tokens[at : at + SCAN_CHUNK] == eot_id).astype(np.int64) + at
        found.append(hits[hits > 0])  # an end-of-text at 0 starts the first unit, already in
    starts = np.concatenate(found)  # ascending: chunk by chunk, each chunk's hits in order
    return starts[: np.searchsorted(starts, len(tokens) - 1)] if len(tokens) > 1 else starts[:1]


@dataclass(frozen=True)
class Packing:
    """Rows of exactly ``row_len`` tokens, each a list of stream pieces (start, length).

    Row ``r`` is pieces ``row_ptr[r]:row_ptr[r + 1]`` of ``piece_start``/``piece_len``.
    """

    row_len: int
    piece_start: np.ndarray  # int64
    piece_len: np.ndarray  # int32
    row_ptr: np.ndarray  # int64, len(rows) + 1
    documents: int
    total_tokens: int

    @property
    def rows(self) -> int:
        return len(self.row_ptr) - 1

    @property
    def used_tokens(self) -> int:
        return self.rows * self.row_len

    @property
    def dropped_tokens(self) -> int:
        """Tokens of the split no row holds (cropped document ends, the last partial row)."""
        return self.total_tokens - self.used_tokens

    def summary(self) -> str:
        share = self.dropped_tokens / max(1, self.total_tokens)
        return (
            f"{self.rows:,} rows of {self.row_len} tokens from {self.documents:,} documents; "
            f"{self.dropped_tokens:,} of {self.total_tokens:,} tokens ({share:.1%}) dropped "
            "by cropping, none padded"
        )


def pack_documents(starts: np.ndarray, total_tokens: int, row_len: int) -> Packing:
    """Best-fit packing of the units that begin at ``starts`` into rows of ``row_len`` tokens
    (the rule in the module docstring).

    Each pick depends on what the picks before it left in the look-ahead, so the picking is a
    loop; everything around it is array work. A unit is one sortable int, its length above
    its number (:func:`_unit_keys`), made chunk by chunk as the stream reaches it; the loop
    records the number of each unit it takes and the length it takes of it, in compact arrays,
    and the pieces' starts are looked up from ``starts`` at the end, all at once.
    """
    starts = np.asarray(starts, dtype=np.int64)
    units = len(starts)
    shift = max(1, units.bit_length())  # a unit number fits below the length
    numbers = (1 << shift) - 1
    incoming = _unit_keys(np.diff(starts, append=np.int64(total_tokens)), shift)
    pending = sorted(itertools.islice(incoming, PACK_BUFFER))  # (length, unit) keys
    taken = array("q")  # the unit of each piece
    taken_len = array("i")  # at most row_len
    row_ends = array("q", [0])
    while True:
        room = row_len
        first = len(taken)
        while room > 0 and pending:
            i = bisect.bisect_left(pending, (room + 1) << shift) - 1
            if i >= 0:  # the largest unit that fits whole (of equal ones, the latest)
                key = pending.pop(i)
                length = key >> shift
            else:  # none fits: crop the shortest (of equal ones, the earliest)
                key = pending.pop(0)
                length = room
            taken.append(key & numbers)
            taken_len.append(length)
            room -= length
            if (arriving := next(incoming, None)) is not None:  # the look-ahead refills
                bisect.insort(pending, arriving)
        if room > 0:  # the data ran out mid-row: the partial row is dropped
            del taken[first:], taken_len[first:]
            break
        row_ends.append(len(taken))
    return Packing(
        row_len=row_len,
        piece_start=starts[np.frombuffer(taken, dtype=np.int64)],
        piece_len=np.frombuffer(taken_len, dtype=np.intc).astype(np.int32),
        row_ptr=np.frombuffer(row_ends, dtype=np.int64).copy(),
        documents=units,
        total_tokens=int(total_tokens),
    )


def _unit_keys(lengths: np.ndarray, shift: int) -> Iterator[int]:
    """Each unit's ``length << shift | number``, in stream order: ints that sort as (length,
    number) do, made :data:`KEY_CHUNK` units at a time (never the whole split's at once)."""
    for at in range(0, len(lengths), KEY_CHUNK):
        part = lengths[at : at + KEY_CHUNK]
        numbers = np.arange(at, at + len(part), dtype=np.int64)
        if int(part.max()) < 1 << (62 - shift):  # fits an int64
            yield from ((part << shift) | numbers).tolist()
        else:  # a unit of billions of tokens: Python's ints have no top
            yield from (
                (n << shift) | u for n, u in zip(part.tolist(), numbers.tolist(), strict=True)
            )


def read_rows(packing: Packing, tokens: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``(len(rows), row_len)`` int64 tokens: each row's pieces of ``tokens``, end to end."""
    rows = np.asarray(rows, dtype=np.int64)
    first, last = packing.row_ptr[rows], packing.row_ptr[rows + 1]
    counts = last - first
    pieces = np.repeat(first, counts) + _ranks(counts)
    lengths = packing.piece_len[pieces].astype(np.int64)
    positions = np.repeat(packing.piece_start[pieces], lengths) + _ranks(lengths)
    return tokens[positions].astype(np.int64).reshape(len(rows), packing.row_len)


def _ranks(counts: np.ndarray) -> np.ndarray:
    """0..c-1 for each count c, concatenated (the offsets inside each group of a repeat)."""
    total = int(counts.sum())
    group_start = np.repeat(np.cumsum(counts) - counts, counts)
    return np.arange(total, dtype=np.int64) - group_start


def evenly_spaced(available: int, count: int) -> np.ndarray:
    """``count`` (at most ``available``) evenly spaced indices in ``[0, available)``."""
    count = max(1, min(count, available))
    return np.linspace(0, available - 1, count).round().astype(np.int64)
