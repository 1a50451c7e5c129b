"""Checks a prepared dataset folder before training, and fingerprints it for resumes.

A dataset folder is ``meta.json`` plus two flat arrays of token ids (and ``tokenizer.json`` for
a bpe or hf tokenizer). If the arrays do not match what ``meta.json`` says, nothing crashes: a
uint32 file read as uint16 is a stream of ids and zeros, and the model trains all night on
garbage. So before a run every folder is checked, each failure is one line that names the file
and the fix (``nanolab fit`` turns it into exit code 2):

* ``meta.json`` is a JSON object with the keys training needs, a known dtype, a vocabulary that
  fits that dtype;
* each ``.bin`` size is a whole number of tokens and exactly ``<split>_tokens`` of them (a file
  whose size fits another dtype is named as such), and the validation split is not empty;
* token ids in a bounded, strided sample of each file are below the vocabulary size (the sample
  is a few MB however large the file: memory and time do not grow with the corpus).

:func:`check_files` returns each ``.bin``'s :data:`FileIdentity` as it checked it: the run reads
that very file (the DataModule maps it right away, and a process that maps it later verifies it),
so a folder prepared again after the check is never what the run trains on. Likewise the
tokenizer every checkpoint stores is the checked one (:func:`checked_tokenizer_spec`).

:func:`fingerprint` identifies the data a run trained on (file sizes, a hash of ``meta.json``
and a hash of 16 fixed 64 KiB blocks of each ``.bin``, cheap to recompute); the DataModule
stores it in every checkpoint and refuses to resume on data that changed underneath the run.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from nanolab.data.prepare import FORMAT, PrepareError
from nanolab.data.tokenizers import (
    FILE_TOKENIZERS,
    HFTokenizer,
    TokenizerError,
    portable_spec,
    spec_ids,
)
from nanolab.home import expand_user

SPLITS = ("train", "val")
#: dtypes a token file may have (``nanolab prepare`` writes uint16 or uint32).
TOKEN_DTYPES = ("uint8", "uint16", "uint32", "int32", "int64")
REQUIRED_KEYS = ("vocab_size", "dtype", "train_tokens", "val_tokens")

#: Tokens read per file by the id check: ``SAMPLE_CHUNKS`` evenly spaced runs of
#: ``SAMPLE_CHUNK`` tokens (4 MB of uint16 at most), or the whole file when it is smaller.
SAMPLE_CHUNK = 1 << 15
SAMPLE_CHUNKS = 64


class DataCheckError(PrepareError):
    """A dataset folder whose files do not match its ``meta.json``; the message says the fix."""


class DataChangedError(PrepareError):
    """The data under a run changed since its checkpoint was written."""


#: What identifies one file on disk: (device, inode, size, modification time in ns). A folder
#: prepared again (``nanolab prepare --force`` renames a new one into place) gives each file
#: another inode; a rewrite in place, another size or time.
FileIdentity = tuple[int, int, int, int]


def file_identity(st: os.stat_result) -> FileIdentity:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class DataReplacedError(DataCheckError):
    """A token file replaced after the run checked and fingerprinted it.

    Raised where a process maps the file later (a DataLoader worker started by spawn or
    forkserver), and re-raised in the main process by the DataLoader, which builds this class
    from the worker's whole traceback text: the message is cut back to its own last line, so the
    user still reads one line.
    """

    def __init__(self, message: str) -> None:
        lines = message.strip().splitlines()
        if len(lines) > 1:
            _, found, own = lines[-1].partition(f"{type(self).__name__}: ")
            message = own if found else lines[-1]
        super().__init__(message)


def replaced_message(path: Path) -> str:
    return (
        f"{path} was replaced after this run checked it (by `nanolab prepare --force`, or a copy "
        "over it): the run would train on other data than its token counts and checkpoints "
        "describe; rerun the command, which checks the data that is there now"
    )


def _reprepare(dataset_dir: Path) -> str:
    return f"prepare it again (`nanolab prepare <your text> -o {dataset_dir} --force`)"


def load_meta(dataset_dir: str | Path, field: str = "data.dataset_dir") -> dict[str, Any]:
    """``meta.json`` of ``dataset_dir``, checked for what training reads from it."""
    dataset_dir = Path(dataset_dir)
    path = dataset_dir / "meta.json"
    if not path.is_file():
        from nanolab.data.sources import read_from_here

        missing = None if dataset_dir.exists() else read_from_here(dataset_dir, field)
        raise DataCheckError(
            f"{field} {dataset_dir} holds no prepared dataset (meta.json)"
            + (f" and does not exist; {missing}; or" if missing else ";")
            + " run `nanolab prepare` or set data.source"
        )
    try:
        meta = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        where = f" at line {err.lineno}" if isinstance(err, json.JSONDecodeError) else ""
        raise DataCheckError(
            f"{path} is not valid JSON{where}: the dataset is damaged; {_reprepare(dataset_dir)}"
        ) from None
    except OSError as err:
        raise DataCheckError(f"cannot read {path} ({err.strerror or err})") from None
    if not isinstance(meta, dict):
        raise DataCheckError(
            f"{path} holds a JSON {type(meta).__name__}, not a dataset description; "
            f"{_reprepare(dataset_dir)}"
        )
    missing = [k for k in REQUIRED_KEYS if meta.get(k) is None]
    if missing:
        raise DataCheckError(
            f"{path} lacks {', '.join(missing)}: it is not a nanolab dataset description; "
            f"{_reprepare(dataset_dir)}"
        )
    if "format" in meta and meta["format"] != FORMAT:
        raise DataCheckError(
            f"{path} has format {meta['format']!r}, which this nanolab does not read "
            f"(it reads {FORMAT!r}); {_reprepare(dataset_dir)}"
        )
    if meta["dtype"] not in TOKEN_DTYPES:
        raise DataCheckError(
            f"{path}: dtype {meta['dtype']!r} is not a token dtype (one of "
            f"{', '.join(TOKEN_DTYPES)}); fix it in meta.json or {_reprepare(dataset_dir)}"
        )
    for key in ("vocab_size", "train_tokens", "val_tokens", "train_bytes", "val_bytes"):
        value = meta.get(key)
        if value is None and key not in REQUIRED_KEYS:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise DataCheckError(
                f"{path}: {key} must be a whole number >= 0, got {value!r}; "
                f"{_reprepare(dataset_dir)}"
            )
    if meta["vocab_size"] < 1:
        raise DataCheckError(f"{path}: vocab_size is 0; {_reprepare(dataset_dir)}")
    if meta.get("val_bytes") == 0 and meta["val_tokens"] > 0:
        # Text that encodes to tokens has bytes; val_bpb divides by this count. (Absent is an
        # older nanolab's dataset: it trains without val_bpb.)
        raise DataCheckError(
            f"{path}: val_bytes is 0 for {meta['val_tokens']:,} val_tokens, but the validation "
            f"text has bytes (val_bpb divides by them); {_reprepare(dataset_dir)}"
        )
    limit = int(np.iinfo(np.dtype(meta["dtype"])).max) + 1
    if meta["vocab_size"] > limit:
        raise DataCheckError(
            f"{path}: vocab_size {meta['vocab_size']} does not fit in dtype {meta['dtype']} "
            f"(ids up to {limit - 1}); the files were written with a wider dtype than meta.json "
            f"says: fix its dtype or {_reprepare(dataset_dir)}"
        )
    return meta


def check_files(dataset_dir: str | Path, meta: dict[str, Any]) -> dict[str, FileIdentity]:
    """Each ``.bin`` against ``meta``: size, dtype, non-empty validation split, token ids; and
    the ``tokenizer.json`` of a bpe or hf dataset is there. Returns each split's file identity
    as the check found it (before reading it)."""
    dataset_dir = Path(dataset_dir)
    dtype = np.dtype(meta["dtype"])
    checked: dict[str, FileIdentity] = {}
    for split in SPLITS:
        path = dataset_dir / f"{split}.bin"
        if not path.is_file():
            raise DataCheckError(f"{path} is missing; {_reprepare(dataset_dir)}")
        st = path.stat()
        checked[split] = file_identity(st)
        size = st.st_size
        tokens = int(meta[f"{split}_tokens"])
        if size % dtype.itemsize:
            raise DataCheckError(
                f"{path} is {size:,} bytes, not a whole number of {dtype.name} tokens "
                f"({dtype.itemsize} bytes each): it is truncated or holds another dtype; "
                f"{_reprepare(dataset_dir)}"
            )
        if size != tokens * dtype.itemsize:
            raise DataCheckError(
                f"{path} holds {size // dtype.itemsize:,} {dtype.name} tokens but meta.json says "
                f"{split}_tokens {tokens:,}{_other_dtype_hint(size, tokens, dtype)}; "
                f"{_reprepare(dataset_dir)}"
            )
        if tokens == 0:
            fix = (
                "prepare it again with a larger --val-fraction or more text"
                if split == "val"
                else "prepare it again from more text"
            )
            raise DataCheckError(f"{path} is empty: the {split} split holds no tokens; {fix}")
        check_token_ids(path, dtype, int(meta["vocab_size"]))
    _check_tokenizer_file(dataset_dir, meta)
    return checked


def _tokenizer_file(dataset_dir: Path, meta: dict[str, Any]) -> Path | None:
    """The ``tokenizer.json`` a dataset's token ids need to mean text (None: its tokenizer is
    all in ``meta.json``: bytes, chars, gpt2)."""
    spec = meta.get("tokenizer")
    if isinstance(spec, dict) and spec.get("name") in FILE_TOKENIZERS:
        return dataset_dir / HFTokenizer.FILE
    return None


def _missing_tokenizer_message(path: Path, meta: dict[str, Any]) -> str:
    name = meta["tokenizer"]["name"]
    return (
        f"{path} is missing: a {name} dataset is four files (train.bin, val.bin, meta.json and "
        f"{path.name}), and checkpoints store its tokenizer so `nanolab generate` can decode; "
        f"copy {path.name} from where the dataset was prepared, or {_reprepare(path.parent)}"
    )


def _check_tokenizer_file(dataset_dir: Path, meta: dict[str, Any]) -> None:
    path = _tokenizer_file(dataset_dir, meta)
    if path is not None and not path.is_file():
        raise DataCheckError(_missing_tokenizer_message(path, meta))


def checked_tokenizer_spec(dataset_dir: str | Path, meta: dict[str, Any]) -> dict[str, Any] | None:
    """The tokenizer of the checked ``meta`` with its file inlined, read once when the data is
    checked: every checkpoint of the run stores this one, not whatever the folder holds at save
    time (a folder prepared again during the run has another tokenizer; a lost file would fail
    the first save). None when ``meta.json`` names no tokenizer."""
    if not isinstance(meta.get("tokenizer"), dict):
        return None
    try:
        spec = portable_spec(dataset_dir, meta)
    except OSError:
        path = _tokenizer_file(Path(dataset_dir), meta) or Path(dataset_dir)
        raise DataCheckError(_missing_tokenizer_message(path, meta)) from None
    check_tokenizer_matches(Path(dataset_dir), meta, spec)
    return spec


def check_tokenizer_matches(dataset_dir: Path, meta: dict[str, Any], spec: dict[str, Any]) -> None:
    """The tokenizer ``spec`` (as read from the folder, file inlined) gives ``meta.json``'s
    vocab_size and eot_id, or DataCheckError naming the file and the fix.

    The token ids were written by the tokenizer that ``meta.json`` counted; a ``tokenizer.json``
    copied from another dataset, or a ``chars`` list cut short, would train without a word and
    then decode (generate, eval, export) every id as some other text or drop it. Building the
    tokenizer reads its vocabulary only: nothing is tokenized."""
    in_file = _tokenizer_file(dataset_dir, meta)
    where = in_file or dataset_dir / "meta.json"
    try:
        vocab, eot = spec_ids(spec)
    except TokenizerError as err:
        raise DataCheckError(
            f"{where}: cannot build the dataset's tokenizer ({err}); {_reprepare(dataset_dir)}"
        ) from None
    want_vocab, want_eot = meta["vocab_size"], meta.get("eot_id", eot)
    wrong = []
    if vocab != want_vocab:
        wrong.append(f"{vocab:,} ids where meta.json says vocab_size {want_vocab:,}")
    if eot != want_eot:
        wrong.append(
            f"no end-of-text token at meta.json's eot_id {want_eot}"
            if eot is None
            else f"end-of-text id {eot} where meta.json says eot_id {want_eot}"
        )
    if not wrong:
        return
    whose = f"{where}: its tokenizer has" if in_file is None else f"{where} has"
    copy = f"copy {in_file.name} from where the dataset was prepared, or " if in_file else ""
    raise DataCheckError(
        f"{whose} {' and '.join(wrong)}: the token ids were written by another tokenizer "
        f"and would decode as other text; {copy}{_reprepare(dataset_dir)}"
    )


def _other_dtype_hint(size: int, tokens: int, dtype: np.dtype) -> str:
    for name in TOKEN_DTYPES:
        other = np.dtype(name)
        if other.itemsize != dtype.itemsize and tokens and size == tokens * other.itemsize:
            return (
                f" ({tokens:,} tokens of {other.itemsize} bytes fill it exactly: it was "
                f"written as {other.name}, not {dtype.name})"
            )
    return ""


def sample_ranges(num_tokens: int) -> list[tuple[int, int]]:
    """Evenly spaced (start, stop) runs covering at most ``SAMPLE_CHUNKS x SAMPLE_CHUNK`` tokens,
    first and last token included; the whole file when it is that small."""
    if num_tokens <= SAMPLE_CHUNKS * SAMPLE_CHUNK:
        return [(s, min(s + SAMPLE_CHUNK, num_tokens)) for s in range(0, num_tokens, SAMPLE_CHUNK)]
    starts = np.linspace(0, num_tokens - SAMPLE_CHUNK, SAMPLE_CHUNKS).astype(np.int64)
    return [(int(s), int(s) + SAMPLE_CHUNK) for s in starts]


def check_token_ids(path: Path, dtype: np.dtype, vocab_size: int) -> int:
    """Raise if a sampled id is outside ``[0, vocab_size)``; return how many ids were read.

    Reads through a memory map one run at a time, so memory stays at one run (64 K tokens)
    whatever the file size. Also catches uint32 tokens labelled uint16 whose counts were
    doubled to match the size: read as uint16, every second id of such a file is 0.
    """
    num_tokens = path.stat().st_size // dtype.itemsize
    data = np.memmap(path, dtype=dtype, mode="r", shape=(num_tokens,))
    read = 0
    odd_all_zero, even_any_nonzero = True, False
    for start, stop in sample_ranges(num_tokens):
        run = np.asarray(data[start:stop])
        read += len(run)
        bad = (run >= vocab_size) | (run < 0) if dtype.kind == "i" else run >= vocab_size
        if bad.any():
            at = int(np.argmax(bad))
            raise DataCheckError(
                f"{path} holds token id {int(run[at])} at position {start + at:,}, but the "
                f"vocabulary has {vocab_size} ids (meta.json vocab_size): the file does not match "
                f"its meta.json (another tokenizer or dtype); {_reprepare(path.parent)}"
            )
        if dtype == np.uint16:
            odd = run[(start + 1) % 2 :: 2]
            even = run[start % 2 :: 2]
            odd_all_zero = odd_all_zero and not odd.any()
            even_any_nonzero = even_any_nonzero or bool(even.any())
    if dtype == np.uint16 and read >= 512 and odd_all_zero and even_any_nonzero:
        raise DataCheckError(
            f"{path}: every second uint16 id is 0, the pattern of uint32 tokens read as uint16; "
            f'set "dtype": "uint32" and halve the token counts in meta.json, or '
            f"{_reprepare(path.parent)}"
        )
    del data
    return read


# -- fingerprints ----------------------------------------------------------------------------
#: The content sample of a ``.bin``: this many blocks of this many bytes, at offsets fixed by the
#: file's size (the first block at 0, the last ending at the end, the rest evenly between). A
#: file no larger than their sum is hashed whole.
SAMPLE_BLOCKS = 16
SAMPLE_BLOCK_BYTES = 64 * 1024


def sampled_sha256(path: str | Path) -> str:
    """The sha256 of the size and :data:`SAMPLE_BLOCKS` blocks of ``path`` (1 MiB read,
    however large the file): an edit in place that keeps the size changes it when it touches
    a sampled block; an edit elsewhere does not."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h = hashlib.sha256(str(size).encode())
        if size <= SAMPLE_BLOCKS * SAMPLE_BLOCK_BYTES:
            h.update(f.read())
            return h.hexdigest()
        span = size - SAMPLE_BLOCK_BYTES
        for i in range(SAMPLE_BLOCKS):
            h.update(os.pread(f.fileno(), SAMPLE_BLOCK_BYTES, span * i // (SAMPLE_BLOCKS - 1)))
    return h.hexdigest()


def fingerprint(dataset_dir: str | Path) -> dict[str, Any]:
    """What identifies the data cheaply: the sha256 of ``meta.json``, each ``.bin`` size, and
    the sha256 of a fixed sample of each ``.bin``'s bytes (:func:`sampled_sha256`)."""
    dataset_dir = Path(dataset_dir)
    meta = dataset_dir / "meta.json"
    return {
        "meta_sha256": hashlib.sha256(meta.read_bytes()).hexdigest(),
        **{f"{s}.bin": (dataset_dir / f"{s}.bin").stat().st_size for s in SPLITS},
        **{f"{s}.bin_sample": sampled_sha256(dataset_dir / f"{s}.bin") for s in SPLITS},
    }


def content_identity(fingerprint: dict[str, Any]) -> str | None:
    """What a data fingerprint's datasets hold, not where they are: a short hash of each
    dataset's ``meta.json`` hash, sizes, sampled bytes and weight, in order (None: no datasets).
    The same folder named ``data`` or by its absolute path, or a byte-identical copy, is one
    identity: ``report`` compares runs by it, as a resume compares data by content."""
    datasets = fingerprint.get("datasets")
    if not isinstance(datasets, list) or not datasets:
        return None
    held = [
        {k: v for k, v in d.items() if k not in ("name", "path")}
        for d in datasets
        if isinstance(d, dict)
    ]
    text = json.dumps(held, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def data_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """How the data fingerprint ``now`` differs from ``saved`` (empty: the same data).

    Both are ``{"datasets": [{"name", "path", "weight", "meta_sha256", "train.bin", ...}]}``.
    Datasets are compared by position and content, not by path: moving a folder is no change.
    """
    before, after = saved.get("datasets") or [], now.get("datasets") or []
    if len(before) != len(after):
        return [
            f"the run trained on {len(before)} dataset(s) "
            f"({', '.join(str(d.get('path')) for d in before)}), now "
            f"{len(after)} ({', '.join(str(d.get('path')) for d in after)})"
        ]
    changes: list[str] = []
    for old, new in zip(before, after, strict=True):
        where = Path(str(new.get("path")))
        if str(old.get("path")) != str(new.get("path")) and (
            old.get("meta_sha256") != new.get("meta_sha256")
        ):  # other data under another path (a moved folder is no change): name both
            changes.append(f"the data is {where} now, was {old.get('path')}")
            continue
        for split in SPLITS:
            key = f"{split}.bin"
            if old.get(key) != new.get(key):
                changes.append(f"{where / key} is {new.get(key):,} bytes, was {old.get(key):,}")
            elif old.get(f"{key}_sample") not in (None, new.get(f"{key}_sample")):
                # An older checkpoint has no sample: its size and meta.json are all it says.
                changes.append(f"{where / key} has the same size but other bytes (rewritten)")
        if old.get("meta_sha256") != new.get("meta_sha256"):
            changes.append(f"{where / 'meta.json'} changed")
        if old.get("weight") != new.get("weight"):
            changes.append(
                f"the weight of {new.get('name')} is {new.get('weight')}, was {old.get('weight')}"
            )
    return changes


def checkpoint_data_state(ckpt_path: str | Path, key: str) -> dict[str, Any] | None:
    """The DataModule state stored under ``key`` (its class name) in a checkpoint file: what
    its ``state_dict`` returned (None if it has none).

    Opened with ``mmap`` and ``weights_only``: the tensors are not read. Sharded checkpoint
    folders are not opened here (the DataModule checks them when the trainer restores them).
    """
    state = _mapped_checkpoint(ckpt_path).get(key)
    return state if isinstance(state, dict) else None


def checkpoint_data_identity(ckpt_path: str | Path) -> str | None:
    """What the data a checkpoint file was trained on held (:func:`content_identity` of the
    fingerprint its DataModule state stored, whatever the class's name), read as
    :func:`checkpoint_data_state` reads; None when it stored none. For a run log that predates
    the start record's ``data_identity``: its checkpoint knows, where a folder's name may not."""
    for value in _mapped_checkpoint(ckpt_path).values():
        if isinstance(value, dict) and isinstance(value.get("data_fingerprint"), dict):
            return content_identity(value["data_fingerprint"])
    return None


def checkpoint_fingerprint(ckpt_path: str | Path, key: str) -> dict[str, Any] | None:
    """The data fingerprint stored under ``key`` in a checkpoint file (None if it has none),
    read as :func:`checkpoint_data_state` reads."""
    found = (checkpoint_data_state(ckpt_path, key) or {}).get("data_fingerprint")
    return found if isinstance(found, dict) else None


def data_fingerprint_of(parts: Iterable[tuple[str, str | Path, float, dict[str, Any]]]) -> dict:
    """The record of the data a run trains on, stored in every checkpoint and compared at a
    resume (:func:`data_changes`): each folder's ``(name, path, weight, fingerprint)``."""
    return {
        "version": 1,
        "datasets": [
            {"name": name, "path": str(path), "weight": weight, **prints}
            for name, path, weight, prints in parts
        ],
    }


def align_change(saved_state: Mapping[str, Any], align: str) -> str | None:
    """Why a run whose checkpoint holds the DataModule state ``saved_state`` cannot resume
    under ``data.align`` ``align`` (None: it can). A state without ``align`` predates the
    setting: its run cut windows from the stream."""
    saved = saved_state.get("align", "stream")
    if saved == align:
        return None
    return (
        f"data.align is {align}, the checkpoint's run trained with {saved}: resuming would "
        f"not continue its window order; set data.align: {saved} to resume it, or start a new "
        "run (--run.name)"
    )


def resume_data_problem(
    ckpt_path: str | Path, key: str, data_args: Mapping[str, Any], base: Path
) -> str | None:
    """Why ``nanolab fit`` would refuse to resume ``ckpt_path`` on the data that the settings
    ``data_args`` (``data.*``, relative paths under ``base``) name, by the DataModule's rules:
    data changed since the checkpoint (:func:`data_changes`, unless ``data.allow_changed``),
    or another ``data.align`` (:func:`align_change`). For ``queue add``, which refuses a job
    then rather than when it starts at night.

    None: fit would not refuse it, or cannot be told now. Not compared: a checkpoint without
    the DataModule's state (an older one, a sharded folder), and the data of a run that fit
    prepares from ``data.source`` at its start (what it holds is known only then); a folder
    that cannot be read is left to fit's own checks, which name it."""
    state = checkpoint_data_state(ckpt_path, key)
    if state is None:
        return None
    saved = state.get("data_fingerprint")
    compare = not (data_args.get("allow_changed") or data_args.get("source"))
    if isinstance(saved, dict) and compare and (now := _fingerprint_now(data_args, base)):
        changes = data_changes(saved, now)
        if changes:
            return changed_data_message(changes, ckpt_path)
    return align_change(state, str(data_args.get("align", "stream")))


def _fingerprint_now(data_args: Mapping[str, Any], base: Path) -> dict[str, Any] | None:
    """The data record (:func:`data_fingerprint_of`) of the prepared folders ``data_args``
    names, as the DataModule makes it from the same settings (None: a folder unreadable)."""
    from nanolab.data.mixture import parse_datasets

    folders = parse_datasets(data_args.get("datasets"))
    if folders is None:
        folder = Path(str(data_args.get("dataset_dir")))
        folders = [(folder.name, folder, 1.0)]
    try:
        return data_fingerprint_of(
            (name, path, weight, fingerprint(base / expand_user(path, keep_unknown=True)))
            for name, path, weight in folders
        )
    except OSError:
        return None


def checkpoint_tokenizer(ckpt_path: str | Path) -> dict[str, Any] | None:
    """The tokenizer spec a checkpoint file stores (its ``nanolab`` section), None if none.
    Read the way :func:`checkpoint_fingerprint` reads (no tensor data)."""
    section = _mapped_checkpoint(ckpt_path).get("nanolab")
    spec = section.get("tokenizer") if isinstance(section, dict) else None
    return spec if isinstance(spec, dict) else None


def _mapped_checkpoint(ckpt_path: str | Path) -> dict[str, Any]:
    """A checkpoint file memory-mapped (``weights_only``); empty for a sharded folder (the
    DataModule checks those when the trainer restores them) or a file that does not load
    (the resume checks report that, in their own words)."""
    path = Path(ckpt_path)
    if not path.is_file():
        return {}
    import torch

    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return {}
    return ckpt if isinstance(ckpt, dict) else {}


def data_changes_text(changes: list[str], ckpt: str | Path | None) -> str:
    """What changed in the data since checkpoint ``ckpt`` was saved (the first three)."""
    source = f"{ckpt} was saved" if ckpt else "the checkpoint was saved"
    more = f" (and {len(changes) - 3} more)" if len(changes) > 3 else ""
    return f"the data changed since {source}: {'; '.join(changes[:3])}{more}"


def changed_data_message(changes: list[str], ckpt: str | Path | None) -> str:
    """The refusal of a resume on changed data, with the three ways on."""
    return (
        f"{data_changes_text(changes, ckpt)}; resuming would not continue the run on the data "
        "it trained on. To resume, point data.dataset_dir / data.datasets at the old data; to "
        "train these weights on the new data (a fine-tune), pass --data.allow_changed true; to "
        "start from scratch on it, give another --run.name (and no --run.resume PATH)"
    )


def allowed_change_line(changes: list[str], ckpt: str | Path | None) -> str:
    """The warning of ``data.allow_changed`` resuming on changed data: what changed, and what
    it means, without advising the flag already given."""
    return (
        f"data.allow_changed: resuming on other data: {data_changes_text(changes, ckpt)}; "
        "the run goes on training these weights on the new data (its checkpoints record it, "
        "so the next resume needs no flag)"
    )
