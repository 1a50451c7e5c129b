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

import itertools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nanolab.data import tokenizers
from nanolab.data.sources import Block
from nanolab.data.tokenizers import (
    Tokenizer,
    TokenizerError,
    char_slices,
    tokenizer_from_spec,
)
from nanolab.processes import die_with_parent

#: How ``nanolab prepare`` passes any bad document: every such message ends with it.
SKIP_BAD = " or pass --skip-bad"
#: The fix of a document without text where prepare looks (``fit`` reads the field ``text``).
NAME_TEXT_FIELD = "name the text field with --text-field"


def bad_document(where: str, problem: str, fix: str) -> str:
    """A bad document's message: where it is, what is wrong, the fix, or ``--skip-bad``.
    One format, so that :func:`split_bad_document` can take prepare's own options off it for
    ``fit`` (which has none of them)."""
    return f"{where}: {problem}; {fix}{SKIP_BAD}"


def split_bad_document(message: str) -> tuple[str, str]:
    """A :func:`bad_document` message's ``where: problem`` and its fix (less ``--skip-bad``);
    any other message whole, with no fix."""
    head, _, fix = message.rpartition("; ")
    if not head or not fix.endswith(SKIP_BAD):
        return message, ""
    return head, fix.removesuffix(SKIP_BAD)


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
    #: The split's ids of the block, to be written end to end: an array per encoded slice and
    #: end-of-text, not one concatenation of them, which held a second copy of a long
    #: document's ids.
    pieces: list[np.ndarray]
    nbytes: int = 0
    docs: int = 0
    units: int = 0
    #: The last unit of this split in the block (where its ids start, its bytes, docs, and its
    #: text when it is the block's only unit): the fallback moves it when a tiny corpus left the
    #: other split empty, or cuts the text of a corpus of one unit in two.
    last: tuple[int, int, int, str | None] | None = None

    @property
    def size(self) -> int:
        """How many ids the pieces hold."""
        return sum(int(piece.size) for piece in self.pieces)

    def ids_from(self, start: int) -> list[np.ndarray]:
        """The ids from ``start`` on, as views of the pieces (no copy); an empty view when
        there are none (a unit of no ids)."""
        out = []
        for piece in self.pieces:
            if start < piece.size:
                out.append(piece[max(start, 0) :])
            start -= int(piece.size)
        return out or [piece[:0] for piece in self.pieces[-1:]]


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


class IdOutOfRange(TokenizerError):
    """The tokenizer gave an id the bins' dtype cannot hold: its fault, not a document's."""


def utf8_size(text: str) -> int:
    """The UTF-8 length of ``text``, encoded a slice at a time (a whole 60 MB JSON document
    encoded at once is a second copy of it). A lone surrogate raises UnicodeEncodeError with
    ``start`` the index in ``text``."""
    if text.isascii():
        return len(text)
    size = 0
    for at in range(0, len(text), tokenizers.SLICE_CHARS):
        try:
            size += len(text[at : at + tokenizers.SLICE_CHARS].encode("utf-8"))
        except UnicodeEncodeError as err:
            raise UnicodeEncodeError(
                err.encoding, text, at + err.start, at + err.end, err.reason
            ) from None
    return size


def _line_spans(payload: bytes) -> Iterator[tuple[int, int]]:
    """Where each line of a block starts and ends, without copying any: ``split`` held a copy of
    every line until the block was parsed."""
    start = 0
    while (end := payload.find(b"\n", start)) >= 0:
        yield start, end
        start = end + 1
    yield start, len(payload)


#: What ``bytes.strip()`` keeps: a line without any is blank.
_NON_BLANK = re.compile(rb"[^ \t\n\r\x0b\x0c]")


def _json_line(payload: bytes, start: int, end: int) -> Any:
    """``json.loads(payload[start:end])``, the line decoded as ``json.loads`` decodes bytes, but
    straight from the block: a copy of a 60 MB line was one more while it was parsed."""
    encoding = json.detect_encoding(payload[start : min(end, start + 4)])
    return json.loads(str(memoryview(payload)[start:end], encoding, "surrogatepass"))


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
                        bad_document(
                            block.file_path,
                            f"not UTF-8 text (bad byte at offset {at})",
                            "convert it with `iconv -f <encoding> -t utf-8`",
                        )
                    ]
                )
            start += size
            whole_file = block.first_unit == 0 and block.ends_document
            # A file of only whitespace holds no text to learn from: as empty as an empty one.
            # The reader tells (Block.blank): a large one is many units, in many blocks.
            if (whole_file and not text) or block.blank:
                what = "the file holds only whitespace" if block.blank else "the file is empty"
                out.errors.append(
                    bad_document(block.file_path, f"empty document ({what})", "remove it")
                )
                continue
            out.texts.append(text)
            out.units.append(block.first_unit + i)
            out.ends.append(last and block.ends_document)
            out.nbytes.append(size)
        return out

    path = text_field.split(".")
    if block.kind == "jsonl":
        for i, (start, end) in enumerate(_line_spans(block.payload)):
            if _NON_BLANK.search(block.payload, start, end) is None:
                continue  # blank lines (and the end of the file) are not documents
            where = f"{block.file_path} line {block.first_unit + i + 1}"
            try:
                record = _json_line(block.payload, start, end)
            except UnicodeDecodeError:
                out.errors.append(bad_document(where, "not UTF-8", "convert the file"))
                continue
            except json.JSONDecodeError as err:
                out.errors.append(
                    bad_document(
                        where, f"not valid JSON ({err.msg} at column {err.colno})", "fix the line"
                    )
                )
                continue
            except RecursionError:
                out.errors.append(
                    bad_document(where, "JSON nested too deeply to read", "fix the line")
                )
                continue
            try:
                value = _field(record, path)
            except KeyError:
                keys = ", ".join(list(record)[:8]) if isinstance(record, dict) else "none"
                out.errors.append(
                    bad_document(where, f"no field {text_field!r} (keys: {keys})", NAME_TEXT_FIELD)
                )
                continue
            _add_text(out, where, value, text_field, block.first_unit + i)
        return out

    for i, value in enumerate(block.payload):  # parquet rows: the top-level column's values
        where = f"{block.file_path} row {block.first_unit + i}"
        try:
            value = _field(value, path[1:])
        except KeyError:
            out.errors.append(bad_document(where, f"no field {text_field!r}", NAME_TEXT_FIELD))
            continue
        _add_text(out, where, value, text_field, block.first_unit + i)
    return out


def _add_text(out: Documents, where: str, value: Any, name: str, unit: int) -> None:
    if not isinstance(value, str):
        kind = "missing (null)" if value is None else f"a {type(value).__name__}, not a string"
        out.errors.append(bad_document(where, f"field {name!r} is {kind}", NAME_TEXT_FIELD))
        return
    if not value or value.isspace():  # only whitespace: as empty as a small blank file
        what = '""' if not value else "only whitespace"
        out.errors.append(
            bad_document(where, f"empty document (field {name!r} is {what})", "remove it")
        )
        return
    try:
        nbytes = utf8_size(value)
    except UnicodeEncodeError as err:  # a lone surrogate escaped in JSON ("\ud83d"): not text
        out.errors.append(
            bad_document(
                where,
                f"field {name!r} holds an unpaired surrogate ({value[err.start]!r} at "
                f"character {err.start}), which is not text",
                "fix the line",
            )
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
        units = _encoded(_tokenizer, docs.texts, dtype, block.file_path)
    except IdOutOfRange:
        raise
    except TokenizerError as err:
        return BlockResult(_empty(dtype), _empty(dtype), 0, [f"{block.file_path}: {err}"])
    draws = split_draw(s.seed, block.file_index, np.asarray(docs.units, dtype=np.int64))
    eot = _tokenizer.eot_id
    eot_arr = np.asarray([] if eot is None else [eot], dtype=dtype)
    parts = {False: _empty(dtype), True: _empty(dtype)}
    alone = docs.texts[0] if len(docs.texts) == 1 else None
    sizes = {False: 0, True: 0}  # ids of each split so far
    for unit, end, nbytes, draw in zip(units, docs.ends, docs.nbytes, draws, strict=True):
        is_val = bool(draw < s.val_fraction)
        part = parts[is_val]
        part.last = (sizes[is_val], nbytes, int(end), alone)
        part.pieces.extend([*unit, eot_arr] if end else unit)
        sizes[is_val] += sum(int(piece.size) for piece in unit) + (eot_arr.size if end else 0)
        part.nbytes += nbytes
        part.docs += int(end)
        part.units += 1
    del units
    for part in parts.values():
        part.pieces = _joined(part.pieces)
    chars = sum(len(t) for t in docs.texts)
    return BlockResult(parts[False], parts[True], chars, errors)


#: A piece of a split this long (a slice of a long document) is written as it is; shorter
#: ones (documents) are joined into one array.
_PIECE_IDS = 1 << 14


def _joined(pieces: list[np.ndarray]) -> list[np.ndarray]:
    """The pieces as few arrays: each run of short ones (a block's documents and their
    end-of-text ids) concatenated, so that thousands of documents are one write and one array
    to send back; a long one left alone, since concatenating it would copy its ids."""
    out: list[np.ndarray] = []
    run: list[np.ndarray] = []
    for piece in pieces:
        if piece.size < _PIECE_IDS:
            run.append(piece)
            continue
        if run:
            out.append(np.concatenate(run))
            run = []
        out.append(piece)
    if run:
        out.append(np.concatenate(run))
    return out


def _encoded(
    tok: Tokenizer, texts: list[str], dtype: np.dtype, where: str
) -> list[list[np.ndarray]]:
    """Each text's ids in the bins' dtype, as one or more pieces: the short texts in one batch,
    a text over ``SLICE_CHARS`` characters slice by slice where its tokenizer's ids cannot
    depend on the cut (:meth:`Tokenizer.encode_long`), so that memory follows the slice, not
    the document: a one-line 20 MB JSON document peaked at ~15x its size with ``chars`` and at
    ~200 bytes per token with ``bpe``."""
    out: list[list[np.ndarray]] = [[] for _ in texts]
    short = [i for i, text in enumerate(texts) if len(text) <= tokenizers.SLICE_CHARS]
    if short:
        arrays = tok.encode_batch([texts[i] for i in short])
        _check_fits(arrays, dtype, where)
        for i, ids in zip(short, arrays, strict=True):
            out[i].append(ids.astype(dtype))
    for i, text in enumerate(texts):
        if len(text) > tokenizers.SLICE_CHARS:
            for ids in tok.encode_long(text):
                _check_fits([ids], dtype, where)
                out[i].append(ids.astype(dtype))
    return out


def _check_fits(arrays: list[np.ndarray], dtype: np.dtype, where: str) -> None:
    """Refuse an id the bins' dtype cannot hold: ``astype`` would wrap it (65540 to 4 in
    uint16) and the model would train on other tokens than the text's. Raised, not returned:
    it is the tokenizer's fault, not a document's, so ``--skip-bad`` does not skip it."""
    top = max((int(a.max()) for a in arrays if a.size), default=0)
    if top > np.iinfo(dtype).max:
        raise IdOutOfRange(
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
    seen = np.zeros(0x110000, dtype=bool)  # every code point; pages untouched stay unallocated
    short = "".join(t for t in docs.texts if len(t) <= tokenizers.SLICE_CHARS)
    long = (p for t in docs.texts if len(t) > tokenizers.SLICE_CHARS for p in char_slices(t))
    for piece in itertools.chain([short], long):  # short texts at once, long ones by slices
        seen[np.frombuffer(piece.encode("utf-32-le"), dtype=np.uint32)] = True
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
    return SplitPart([])
