"""The work ``nanolab prepare`` does per block, in worker processes: documents out of raw bytes,
token ids out of documents, and each unit sent to train or validation.

Everything here is a pure function of the block and the settings, so the output does not depend
on which worker took a block or when it finished. Errors are returned, not raised: the main
process decides whether a bad document stops the run or is counted (``--skip-bad``), and a
message always names the file and the line, row or byte offset.

This module imports only NumPy and the tokenizers, so a spawned worker starts in a fraction of a
second (no torch, no Lightning).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nanolab.data.sources import Block
from nanolab.data.tokenizers import Tokenizer, TokenizerError, tokenizer_from_spec


@dataclass(frozen=True)
class EncodeSettings:
    text_field: str
    val_fraction: float
    seed: int
    dtype: str


@dataclass
class Documents:
    """The documents (or text units) of one block, with where each came from."""

    texts: list[str] = field(default_factory=list)
    units: list[int] = field(default_factory=list)  # unit index within the file
    ends: list[bool] = field(default_factory=list)  # an end-of-text follows this text
    nbytes: list[int] = field(default_factory=list)  # UTF-8 bytes of each text
    errors: list[str] = field(default_factory=list)


@dataclass
class SplitPart:
    ids: np.ndarray
    nbytes: int = 0
    docs: int = 0
    units: int = 0
    #: The last unit of this split in the block (ids, bytes, docs, and its text when it is the
    #: block's only unit): the fallback moves it when a tiny corpus left the other split empty,
    #: or cuts the text of a corpus of one unit in two.
    last: tuple[np.ndarray, int, int, str | None] | None = None


@dataclass
class BlockResult:
    train: SplitPart
    val: SplitPart
    characters: int
    errors: list[str]


_tokenizer: Tokenizer | None = None
_settings: EncodeSettings | None = None


def init_worker(
    spec: dict[str, Any] | None, settings: EncodeSettings, parent: int | None = None
) -> None:
    """Build this process's tokenizer once (a pool initializer, also called in-process).

    ``parent``: the pid of the ``prepare`` that started this worker process; the worker then
    dies with it (:func:`die_with_parent`) and ignores SIGINT and SIGTERM.
    """
    global _tokenizer, _settings
    if parent is not None:
        become_worker(parent)
    _tokenizer = tokenizer_from_spec(spec) if spec is not None else None
    _settings = settings


def become_worker(parent: int) -> None:
    """Make this process a worker of ``prepare`` ``parent``: it dies with it and ignores the
    signals that stop a command, SIGINT and SIGTERM.

    Ctrl-C reaches the whole process group, and a scheduler's SIGTERM every process of the job:
    the parent decides what they mean and ends the workers (a worker stopped by one would only
    print a traceback, or leave the parent reading a lost worker instead of its own stop: `fit`
    then failed where it was preempted). The parent holds both back while it starts a worker
    (``nanolab.processes.stop_signals_held``), so one sent before this runs is dropped here.
    """
    import signal

    die_with_parent(parent)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def die_with_parent(parent: int) -> None:
    """End this worker when ``parent`` dies, even by SIGKILL: a pool worker waits on a queue
    whose other end it holds itself, so it would wait forever, and with it the
    multiprocessing resource tracker that waits for every holder of its pipe.

    Linux: the kernel sends SIGKILL at the parent's death (``prctl(PR_SET_PDEATHSIG)``).
    Elsewhere a daemon thread polls the parent's pid every second. Either way a parent that
    died before this ran (the worker was adopted) ends the worker at once.
    """
    import ctypes
    import signal
    import sys
    import threading
    import time

    armed = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(1, signal.SIGKILL, 0, 0, 0) == 0  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != parent:
        os._exit(1)  # the parent is already gone
    if armed:
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="nanolab-parent-watch", daemon=True).start()


def _field(value: Any, path: list[str]) -> Any:
    for key in path:
        if not isinstance(value, dict) or key not in value:
            raise KeyError(key)
        value = value[key]
    return value


def documents(block: Block, text_field: str) -> Documents:
    """Decode a block into texts; bad ones become messages naming the file and line/row."""
    out = Documents()
    if block.kind == "text":
        start = 0
        for i, size in enumerate(block.unit_sizes):
            raw = block.payload[start : start + size]
            last = i == len(block.unit_sizes) - 1
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                at = block.byte_offset + start + err.start
                # The file is one document: none of it is kept (--skip-bad skips it whole).
                return Documents(
                    errors=[
                        f"{block.file_path}: not UTF-8 text (bad byte at offset {at}); convert "
                        "it with `iconv -f <encoding> -t utf-8` or pass --skip-bad"
                    ]
                )
            start += size
            whole_file = block.first_unit == 0 and block.ends_document
            # A file of only whitespace holds no text to learn from: as empty as an empty one.
            blank = whole_file and len(block.unit_sizes) == 1 and not text.strip()
            if (whole_file and not text) or blank:
                what = "the file is empty" if not text else "the file holds only whitespace"
                out.errors.append(
                    f"{block.file_path}: empty document ({what}); remove it or pass --skip-bad"
                )
                continue
            out.texts.append(text)
            out.units.append(block.first_unit + i)
            out.ends.append(last and block.ends_document)
            out.nbytes.append(size)
        return out

    path = text_field.split(".")
    if block.kind == "jsonl":
        for i, line in enumerate(block.payload.split(b"\n")):
            if not line.strip():
                continue  # blank lines (and the end of the file) are not documents
            where = f"{block.file_path} line {block.first_unit + i + 1}"
            try:
                record = json.loads(line)
            except UnicodeDecodeError:
                out.errors.append(f"{where}: not UTF-8; convert the file or pass --skip-bad")
                continue
            except json.JSONDecodeError as err:
                out.errors.append(
                    f"{where}: not valid JSON ({err.msg} at column {err.colno}); fix the line "
                    "or pass --skip-bad"
                )
                continue
            except RecursionError:
                out.errors.append(
                    f"{where}: JSON nested too deeply to read; fix the line or pass --skip-bad"
                )
                continue
            try:
                value = _field(record, path)
            except KeyError:
                keys = ", ".join(list(record)[:8]) if isinstance(record, dict) else "none"
                out.errors.append(
                    f"{where}: no field {text_field!r} (keys: {keys}); name the text field "
                    "with --text-field or pass --skip-bad"
                )
                continue
            _add_text(out, where, value, text_field, block.first_unit + i)
        return out

    for i, value in enumerate(block.payload):  # parquet rows: the top-level column's values
        where = f"{block.file_path} row {block.first_unit + i}"
        try:
            value = _field(value, path[1:])
        except KeyError:
            out.errors.append(
                f"{where}: no field {text_field!r}; name the text field with --text-field "
                "or pass --skip-bad"
            )
            continue
        _add_text(out, where, value, text_field, block.first_unit + i)
    return out


def _add_text(out: Documents, where: str, value: Any, name: str, unit: int) -> None:
    if not isinstance(value, str):
        kind = "missing (null)" if value is None else f"a {type(value).__name__}, not a string"
        out.errors.append(
            f"{where}: field {name!r} is {kind}; name the text field with --text-field or pass --skip-bad"
        )
        return
    if not value:
        out.errors.append(
            f'{where}: empty document (field {name!r} is ""); remove it or pass --skip-bad'
        )
        return
    try:
        nbytes = len(value.encode("utf-8"))
    except UnicodeEncodeError as err:  # a lone surrogate escaped in JSON ("\ud83d"): not text
        out.errors.append(
            f"{where}: field {name!r} holds an unpaired surrogate ({value[err.start]!r} at "
            f"character {err.start}), which is not text; fix the line or pass --skip-bad"
        )
        return
    out.texts.append(value)
    out.units.append(unit)
    out.ends.append(True)
    out.nbytes.append(nbytes)


_MASK = (1 << 64) - 1


def split_draw(seed: int, file_index: int, units: np.ndarray) -> np.ndarray:
    """A uniform [0, 1) number per unit, a fixed hash of (seed, file, unit): the split's coin.

    SplitMix64's finalizer over 64-bit keys; NumPy's uint64 arithmetic wraps, as it should.
    """
    key = (seed * 0x9E3779B97F4A7C15 + (file_index << 40) + 0x632BE59BD9B4E019) & _MASK
    x = units.astype(np.uint64) + np.uint64(key)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def encode_block(block: Block) -> BlockResult:
    """Token ids of a block, split into train and validation by unit, end-of-text after each
    document."""
    assert _tokenizer is not None and _settings is not None, "init_worker was not called"
    s = _settings
    docs = documents(block, s.text_field)
    dtype = np.dtype(s.dtype)
    errors = list(docs.errors)
    try:
        arrays = _tokenizer.encode_batch(docs.texts) if docs.texts else []
    except TokenizerError as err:
        return BlockResult(_empty(dtype), _empty(dtype), 0, [f"{block.file_path}: {err}"])
    _check_fits(arrays, dtype, block.file_path)
    draws = split_draw(s.seed, block.file_index, np.asarray(docs.units, dtype=np.int64))
    eot = _tokenizer.eot_id
    eot_arr = np.asarray([] if eot is None else [eot], dtype=dtype)
    pieces: dict[bool, list[np.ndarray]] = {False: [], True: []}
    parts = {False: _empty(dtype), True: _empty(dtype)}
    alone = docs.texts[0] if len(docs.texts) == 1 else None
    for ids, end, nbytes, draw in zip(arrays, docs.ends, docs.nbytes, draws, strict=True):
        is_val = bool(draw < s.val_fraction)
        part = parts[is_val]
        unit_ids = np.concatenate([ids.astype(dtype), eot_arr]) if end else ids.astype(dtype)
        pieces[is_val].append(unit_ids)
        part.nbytes += nbytes
        part.docs += int(end)
        part.units += 1
        part.last = (unit_ids, nbytes, int(end), alone)
    for is_val, part in parts.items():
        if pieces[is_val]:
            part.ids = np.concatenate(pieces[is_val])
    chars = sum(len(t) for t in docs.texts)
    return BlockResult(parts[False], parts[True], chars, errors)


def _check_fits(arrays: list[np.ndarray], dtype: np.dtype, where: str) -> None:
    """Refuse an id the bins' dtype cannot hold: ``astype`` would wrap it (65540 to 4 in
    uint16) and the model would train on other tokens than the text's. Raised, not returned:
    it is the tokenizer's fault, not a document's, so ``--skip-bad`` does not skip it."""
    top = max((int(a.max()) for a in arrays if a.size), default=0)
    if top > np.iinfo(dtype).max:
        raise TokenizerError(
            f"{where}: the tokenizer gave id {top:,}, past the {dtype.name} the dataset's "
            f"vocabulary chose (ids up to {np.iinfo(dtype).max:,}); the tokenizer.json gives ids "
            "outside its own vocabulary: fix the file or use another tokenizer"
        )


def block_alphabet(block: Block) -> tuple[str, list[str], int]:
    """The characters of a block (the ``chars`` tokenizer's first pass), as one string, with
    the block's errors and how many of its texts are kept.

    Code points are marked in a NumPy table rather than added to a Python set: ~20x faster.
    """
    assert _settings is not None, "init_worker was not called"
    docs = documents(block, _settings.text_field)
    codes = np.frombuffer("".join(docs.texts).encode("utf-32-le"), dtype=np.uint32)
    if not codes.size:
        return "", docs.errors, 0
    seen = np.zeros(int(codes.max()) + 1, dtype=bool)
    seen[codes] = True
    return "".join(map(chr, np.flatnonzero(seen).tolist())), docs.errors, len(docs.texts)


def block_sample(block: Block, keep: float) -> tuple[list[str], list[str], int]:
    """The texts of a block that the BPE training sample draws (a fixed hash, not a live RNG),
    with the block's errors and how many of its texts are kept."""
    assert _settings is not None, "init_worker was not called"
    docs = documents(block, _settings.text_field)
    kept = len(docs.texts)
    if keep >= 1.0:
        return docs.texts, docs.errors, kept
    draws = split_draw(_settings.seed + 1, block.file_index, np.asarray(docs.units, np.int64))
    return [t for t, d in zip(docs.texts, draws, strict=True) if d < keep], docs.errors, kept


def _empty(dtype: np.dtype) -> SplitPart:
    return SplitPart(np.zeros(0, dtype=dtype))
