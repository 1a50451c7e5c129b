"""``nanolab prepare``: text, JSON-lines and parquet corpora -> ``train.bin``, ``val.bin`` and
``meta.json``, streamed in bounded memory by parallel workers.

The bins are flat arrays of token ids (uint16 when the vocabulary fits, else uint32) that the
DataModule memory-maps, nanoGPT's format; every document ends with the tokenizer's end-of-text id.
``meta.json`` records the tokenizer, vocabulary, dtype, token, byte and document counts per split
(the bytes give ``val_bpb``), and an identity hash of the inputs and settings, so a second
``prepare`` of the same sources is a no-op.

How it stays bounded and exact:

- Sources are read block by block (:mod:`nanolab.data.sources`); at most ``2 x workers`` blocks
  are in flight, and results are written in input order, so memory does not grow with the corpus
  and the bytes are the same for any ``--workers``.
- Validation is drawn by unit (a document, or a ~16 KB piece of a long text file) with a seeded
  hash of its position, so every source contributes to it.
- Everything is written into a temporary folder beside the target and renamed into place after
  ``meta.json``: a crash, a SIGKILL or a bad input never leaves something ``fit`` would take for a
  dataset, and the next run clears the leftovers and starts again.
- One process prepares a folder at a time (a file lock); the others wait, then find it ready.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import glob
import hashlib
import json
import multiprocessing
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import IO, Any, TypeVar
from unittest import mock

import numpy as np

from nanolab.data import encode, sources
from nanolab.data.bpe_process import train_bpe
from nanolab.data.encode import BlockResult, EncodeSettings, SplitPart
from nanolab.data.sources import (
    DATASET_FORMAT_PREFIX,
    META_LIST_MAX,
    Block,
    FileReader,
    InputFile,
    SourceError,
    TextColumnError,
    is_prepared_dataset,
    paths_sha256,
    real_paths,
    resolve_sources,
)
from nanolab.data.tokenizers import (
    HFTokenizer,
    Tokenizer,
    TokenizerError,
    build_tokenizer,
    check_bpe_vocab_size,
    check_tokenizer_name,
)
from nanolab.errors import (
    NanolabError,
    disk_full,
    one_line_errors,
    room_left,
    size_limit_met,
    with_errno_of,
)
from nanolab.home import expand_user
from nanolab.messages import note, say, warn
from nanolab.processes import exclusive, sigterm_as_interrupt, stop_signals_held
from nanolab.runlog import refuse_inside_run

FORMAT = f"{DATASET_FORMAT_PREFIX}v1"
#: Below this much input, worker processes cost more to start than they save.
PARALLEL_MIN_BYTES = 8 << 20
DEFAULT_BPE_SAMPLE_BYTES = 256 << 20
#: Bad documents whose messages ``meta.json`` keeps as examples.
KEEP_EXAMPLES = 10

T = TypeVar("T")


class PrepareError(NanolabError):
    """Input that cannot become a dataset; the message names it and the fix."""


class BadTextError(PrepareError):
    """The sources' text is not what or where prepare reads: a bad document (stopping the run
    without ``--skip-bad``) or a parquet file without the ``--text-field`` column.

    The message is prepare's; ``fit``, which has neither option, words its own fix from the
    parts (:mod:`nanolab.data.bad_text`).

    Attributes:
        problem: Where (file, line or row) and what is wrong.
        fix: Prepare's fix for that document ("remove it", "fix the line", ...), or "".
        skippable: ``--skip-bad`` passes it (a bad document, not a missing column).
        names_field: The text may be at another field or column (``--text-field``).
    """

    def __init__(
        self, message: str, problem: str, fix: str, skippable: bool, names_field: bool
    ) -> None:
        super().__init__(message)
        self.problem, self.fix = problem, fix
        self.skippable, self.names_field = skippable, names_field

    @classmethod
    def of_document(cls, message: str) -> BadTextError:
        """The error of a bad document's message (:func:`nanolab.data.encode.bad_document`)."""
        problem, fix = encode.split_bad_document(message)
        return cls(message, problem, fix, True, fix == encode.NAME_TEXT_FIELD)


class OutputInUseError(PrepareError):
    """The output folder holds something else: another dataset (``holds_dataset``) or files
    that are not a dataset's. ``fit`` words its own fix from it (it has no ``--force``)."""

    def __init__(self, message: str, holds_dataset: bool) -> None:
        super().__init__(message)
        self.holds_dataset = holds_dataset


#: How ``nanolab prepare`` names the settings :func:`prepare_dataset` checks; ``fit``, preparing
#: a ``data.source``, passes :data:`FIT_KEYS`: a refusal names what its user typed.
PREPARE_FLAGS = {
    "dataset_dir": "-o",
    "bpe_vocab_size": "--bpe-vocab-size",
    "val_fraction": "--val-fraction",
}
FIT_KEYS = {
    "source": "data.source",
    "dataset_dir": "data.dataset_dir",
    "bpe_vocab_size": "data.bpe_vocab_size",
    "val_fraction": "data.val_fraction",
}

#: The files a prepared dataset folder holds (and all that ``--force`` may replace): its
#: ``packing/`` folder keeps the document packings fit made of it (``data.align: document``).
DATASET_FILES = frozenset({"meta.json", "train.bin", "val.bin", "tokenizer.json", "packing"})


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab <= 65536), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def read_meta(dataset_dir: str | Path) -> dict[str, Any] | None:
    path = Path(dataset_dir) / "meta.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS
        return max(1, os.cpu_count() or 1)


def parse_bytes(text: str | int) -> int:
    """``256M``, ``2G``, ``1048576`` -> bytes."""
    if isinstance(text, int):
        return text
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    s = str(text).strip().lower().removesuffix("b").removesuffix("i")
    mult = units.get(s[-1:], 1)
    number = s[:-1] if s[-1:] in units else s
    try:
        value = int(float(number) * mult)
    except (ValueError, OverflowError):  # "nan" is a ValueError, "inf" and "1e400" overflow
        raise PrepareError(
            f"--bpe-sample-bytes {text!r} is not a size; use e.g. 256M or 2G"
        ) from None
    if value <= 0:
        raise PrepareError(f"--bpe-sample-bytes must be positive, got {text!r}")
    return value


def identity_hash(files: Sequence[InputFile], settings: dict[str, Any]) -> str:
    """Identity of a dataset: every input file (path, size, mtime) and every setting that
    changes the token stream. Computed without reading the files, so a no-op is instant."""
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for f in files:
        h.update(json.dumps(list(f.fingerprint)).encode())
    return h.hexdigest()


def prepare_settings(
    tokenizer: str = "chars",
    bpe_vocab_size: int = 4096,
    bpe_sample_bytes: int = DEFAULT_BPE_SAMPLE_BYTES,
    eot_token: str | None = None,
    val_fraction: float = 0.1,
    seed: int = 0,
    text_field: str = "text",
    skip_bad: bool = False,
) -> dict[str, Any]:
    """The settings a dataset's identity (``source_hash``, with its files) is made of: a
    folder prepared under the same files and settings is reused as it is."""
    tok_identity: Any = tokenizer
    if tokenizer.endswith(".json") and expand_user(tokenizer).is_file():
        tok_identity = hashlib.sha256(expand_user(tokenizer).read_bytes()).hexdigest()
    return {
        "format": FORMAT,
        "tokenizer": tok_identity,
        "bpe_vocab_size": bpe_vocab_size if tokenizer == "bpe" else None,
        "bpe_sample_bytes": bpe_sample_bytes if tokenizer == "bpe" else None,
        "eot_token": eot_token,
        "val_fraction": val_fraction,
        "seed": seed,
        "text_field": text_field,
        "skip_bad": skip_bad,
    }


def holds_prepared(
    sources: Sequence[str],
    dataset_dir: str | Path,
    tokenizer: str = "chars",
    bpe_vocab_size: int = 4096,
    val_fraction: float = 0.1,
) -> bool | None:
    """Whether ``dataset_dir`` already holds what ``nanolab fit`` would prepare there from
    ``data.source`` ``sources`` with these settings (the same files and settings: fit reuses
    it untouched), told without preparing anything: the files are listed and stat'ed, not
    read. None: it cannot be told (a source that cannot be listed; fit says why at start)."""
    out_dir = expand_user(dataset_dir)
    if out_dir.is_symlink():
        out_dir = Path(os.path.realpath(out_dir))
    lock = out_dir.with_name(f".{out_dir.name}.lock")
    mine = (out_dir, lock, *out_dir.parent.glob(f".{glob.escape(out_dir.name)}.*-*"))
    try:
        resolved = resolve_sources(sources, mine, "data.source")
    except SourceError:
        return None
    try:
        existing = read_meta(out_dir)
    except (OSError, ValueError):  # unreadable: fit prepares it again (or says why)
        existing = None
    if not isinstance(existing, dict):
        return False
    settings = prepare_settings(tokenizer, bpe_vocab_size, val_fraction=val_fraction)
    return existing.get("source_hash") == identity_hash(resolved.files, settings)


def prepare_dataset(
    sources: Sequence[str],
    dataset_dir: str | Path,
    tokenizer: str = "chars",
    bpe_vocab_size: int = 4096,
    val_fraction: float = 0.1,
    force: bool = False,
    quiet: bool = False,
    *,
    workers: int | None = None,
    text_field: str = "text",
    seed: int = 0,
    skip_bad: bool = False,
    bpe_sample_bytes: int = DEFAULT_BPE_SAMPLE_BYTES,
    eot_token: str | None = None,
    say_reused: bool = False,
    setting_names: Mapping[str, str] = PREPARE_FLAGS,
) -> dict[str, Any]:
    """Tokenize ``sources`` into ``dataset_dir``; return its meta. A no-op when already prepared
    (``say_reused``: say so, as ``nanolab prepare`` does; ``fit`` reuses it at every launch).
    ``setting_names``: what a refusal of ``source``, ``dataset_dir``, ``bpe_vocab_size`` or
    ``val_fraction`` calls them."""
    if not str(dataset_dir):  # Path("") is the current folder: it would become the dataset
        raise PrepareError(
            f"{setting_names['dataset_dir']} is empty; give the dataset folder to create "
            "(e.g. data/mine)"
        )
    try:
        check_tokenizer_name(tokenizer)
        if tokenizer == "bpe":  # before the corpus is read, not after its sample
            check_bpe_vocab_size(bpe_vocab_size, setting_names["bpe_vocab_size"])
    except TokenizerError as err:
        raise PrepareError(str(err)) from None
    if not 0.0 < val_fraction < 0.5:
        raise PrepareError(
            f"{setting_names['val_fraction']} must be in (0, 0.5), got {val_fraction}"
        )
    if workers is not None and workers < 1:
        raise PrepareError(f"--workers must be >= 1, got {workers}")
    if workers is not None and workers > (usable := default_workers()):
        # More processes than cores only adds memory and switching, never speed.
        print(
            f"nanolab prepare: --workers {workers} is more than the {usable} usable core"
            f"{'s' if usable > 1 else ''}; using {usable}",
            file=sys.stderr,
        )
        workers = usable
    if not text_field or any(not part for part in text_field.split(".")):
        raise PrepareError(
            f"--text-field {text_field!r} is not a field name (e.g. text, meta.body)"
        )
    out_dir = expand_user(dataset_dir)
    if out_dir.name in ("", ".."):  # -o . or -o ..: the folder those name
        out_dir = Path(os.path.abspath(out_dir))
        if not out_dir.name:
            raise PrepareError(
                f"dataset folder {dataset_dir} is the file system's root; give a folder to "
                "create, e.g. -o data/mine"
            )
    if out_dir.is_symlink():  # a link to a folder on another disk: the dataset goes there and
        out_dir = Path(os.path.realpath(out_dir))  # the link stays (replacing it lost both)
        if not os.access(out_dir.parent, os.W_OK):
            raise PrepareError(
                f"dataset folder {dataset_dir} links to {out_dir}, whose parent folder cannot be "
                "written (prepare writes beside the folder and renames it into place); link to "
                "a folder inside one you own, e.g. /scratch/$USER/data/NAME"
            )
    if problem := output_problem(out_dir):
        raise PrepareError(f"{setting_names['dataset_dir']} {shorten(str(dataset_dir))}: {problem}")
    if out_dir.exists() and not out_dir.is_dir():
        raise PrepareError(
            f"dataset folder {out_dir} is a file; give the path of a folder to create"
        )
    try:
        lock = out_dir.with_name(f".{out_dir.name}.lock")
        # -o inside an input folder: its dataset, lock and a killed run's leftovers are not input
        mine = (out_dir, lock, *out_dir.parent.glob(f".{glob.escape(out_dir.name)}.*-*"))
        resolved = resolve_sources(sources, mine, setting_names.get("source") or None)
    except SourceError as err:
        raise PrepareError(str(err)) from None
    settings = prepare_settings(
        tokenizer, bpe_vocab_size, bpe_sample_bytes, eot_token, val_fraction, seed, text_field,
        skip_bad,
    )  # fmt: skip
    digest = identity_hash(resolved.files, settings)
    # Never into a run's folder (``fit``'s data.dataset_dir too, not only ``prepare -o``): the
    # lock file and the dataset would be written among another run's files.
    refuse_inside_run(out_dir, "the dataset folder", PrepareError)
    # Every rank of a torchrun/srun launch may get here at once: one prepares, the others wait
    # on the lock and then find the dataset ready (same hash: a no-op).
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(lock):
        _finish_interrupted_swap(out_dir)
        try:
            existing = read_meta(out_dir)
        except (OSError, ValueError):  # unreadable: not a dataset this run can reuse
            existing = None
        damage = dataset_damage(out_dir, existing) if existing is not None else None
        rebuild = existing is not None and existing.get("source_hash") == digest
        if rebuild and damage is None:
            if say_reused and not quiet:
                say("nanolab prepare", f"{out_dir} already holds this dataset (the same files and "
                    "settings): nothing to do")  # fmt: skip
            return existing
        if problem := name_problem(out_dir):  # checked for the lock alone so far
            raise PrepareError(
                f"{setting_names['dataset_dir']} {shorten(str(dataset_dir))}: {problem}"
            )
        if (force or rebuild) and out_dir.is_dir():
            _refuse_users_files(out_dir, damage if rebuild else None)
        if rebuild and not quiet:  # the same settings: what fit asks for, --force or not
            say("nanolab prepare", f"{out_dir} holds this dataset damaged ({damage}); "
                "preparing it again")  # fmt: skip
        if out_dir.exists() and any(out_dir.iterdir()) and not force and not rebuild:
            what = "other files"
            if existing:
                differs = dataset_differences(existing, settings, resolved.files)
                what = "a dataset of other sources or settings (" + (
                    f"it differs in {'; '.join(differs)})" if differs
                    else "or its files changed since: sizes or times)"
                )  # fmt: skip
            raise OutputInUseError(
                f"{out_dir} already holds {what}; choose another output folder or pass --force "
                "to replace it",
                holds_dataset=existing is not None,
            )
        for note in resolved.skipped:
            if not quiet:
                say("nanolab prepare", note)
        job = _Job(
            files=resolved.files,
            out_dir=out_dir,
            tokenizer=tokenizer,
            bpe_vocab_size=bpe_vocab_size,
            bpe_sample_bytes=bpe_sample_bytes,
            eot_token=eot_token,
            settings=settings,
            digest=digest,
            workers=workers,
            skip_bad=skip_bad,
            quiet=quiet,
            sources=list(sources),
            skipped_notes=resolved.skipped,
        )
        try:
            meta = job.run()
        except TextColumnError as err:
            raise BadTextError(str(err), err.problem, "", False, True) from None
        except (SourceError, TokenizerError) as err:
            raise PrepareError(str(err)) from None
    if far := split_share_warning(meta, val_fraction, setting_names["val_fraction"], out_dir):
        warn("nanolab prepare", far)
    return meta


#: How far from ``--val-fraction`` the validation split's share of the tokens may fall before
#: prepare warns: more than this many times it, or less than it over this.
VAL_SHARE_FAR = 2.0


def _percent(share: float) -> str:
    return f"{share * 100:.3g}%"


def split_share_warning(
    meta: Mapping[str, Any], val_fraction: float, setting: str, out_dir: Path
) -> str | None:
    """The warning for a validation split whose share of the tokens is far from what
    ``setting`` (``--val-fraction`` or ``data.val_fraction``) asked (None: near it). The split
    takes whole units (documents, ~16 KB pieces of a long text file) by a hash, so a corpus of
    a few long JSON lines can put most of its tokens in validation: 5 documents of ~250 KB
    gave 60% at 0.1, training on the other 40% without a word."""
    train, val = int(meta["train_tokens"]), int(meta["val_tokens"])
    share = val / max(1, train + val)
    if val_fraction / VAL_SHARE_FAR <= share <= val_fraction * VAL_SHARE_FAR:
        return None
    units = meta.get("units")
    count = sum(units.values()) if isinstance(units, dict) else None
    these = f"these {count:,}" if count else "these"
    return (
        f"{out_dir}: validation holds {_percent(share)} of the tokens ({val:,} of "
        f"{train + val:,}), not the {_percent(val_fraction)} {setting} {val_fraction} asks: "
        "each document (or ~16 KB piece of a long text file) goes to one split whole, and "
        f"{these} are too few or too unequal in length to even out; split long documents into "
        "more (lines, rows, or .txt files, which are cut into pieces), or add more"
    )


def _refuse_users_files(out_dir: Path, damage: str | None) -> None:
    """Refuse to replace ``out_dir`` when it holds files that are not a dataset's: replacing
    swaps the whole folder, so the user's notes beside a dataset would go with it. Both ways in
    are checked, ``--force`` and the rebuild of a damaged dataset (``damage``, which needs no
    --force), and neither ever takes the user's files."""
    foreign = sorted(
        p.name + ("/" if p.is_dir() else "")
        for p in out_dir.iterdir()
        if p.name not in DATASET_FILES
    )
    if not foreign:
        return
    shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
    if damage is None:
        raise PrepareError(
            f"{out_dir} holds files that are not a dataset's ({shown}); --force replaces only a "
            "dataset folder: choose another output folder, or move those files"
        )
    raise PrepareError(
        f"{out_dir} holds this dataset damaged ({damage}) and files that are not a dataset's "
        f"({shown}); preparing it again replaces the whole folder: move those files, or choose "
        "another output folder"
    )


#: What prepare adds to the dataset folder's name for the files it writes beside it: the lock
#: (``.NAME.lock``), the folder being written (``.NAME.tmp-XXXXXXXX``) and a replaced one
#: (``.NAME.old-PID``, ``.NAME.dead-PID``, a PID of up to 7 digits: Linux's pid_max is at most
#: 4,194,304), as long as the folder being written (``len("..tmp-") + 8``).
SIBLING_NAME_EXTRA = len("..dead-") + 7
#: What the lock (``.NAME.lock``) adds, all a no-op on a prepared dataset writes beside it.
LOCK_NAME_EXTRA = len("..lock")


def shorten(text: str, keep: int = 60) -> str:
    """``text``, or its start and end around an ellipsis when longer than ``keep``."""
    return text if len(text) <= keep else f"{text[: keep // 2]}...{text[-keep // 2 :]}"


def output_problem(out_dir: Path) -> str | None:
    """Why ``out_dir`` can never become a dataset folder, in words, or None. Checked before
    the corpus is read: a file where a parent folder should be, a symlink loop (``realpath``
    of one gives it back unchanged, and the write at the very end failed), a name with no room
    for the files prepare writes beside it. Whatever else (no permission, a full disk) is for
    the write itself to say."""
    import errno

    try:
        os.stat(out_dir)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):
            for path in (*reversed(out_dir.parents), out_dir):  # the first one at fault
                try:
                    os.stat(path)
                except OSError as inner:
                    if inner.errno == errno.ELOOP:
                        return f"{path} is a symlink loop (a link that leads back to itself); "\
                            "remove it or choose another output folder"  # fmt: skip
                    continue
                if path != out_dir and not os.path.isdir(path):
                    return f"{path} is a file, not a folder; choose a folder for the dataset"
        elif err.errno == errno.ENAMETOOLONG:
            return (
                f"the path is too long ({len(os.fsencode(out_dir)):,} bytes, more than this "
                "file system takes); choose a shorter one"
            )
    # A dataset already there (an older prepare's): only the lock must fit beside it for a
    # no-op; writing it again is checked once that is known (name_problem in prepare_dataset).
    return name_problem(out_dir, lock_only=is_prepared_dataset(out_dir))


def name_problem(out_dir: Path, lock_only: bool = False) -> str | None:
    """Why ``out_dir``'s name leaves no room for what prepare writes beside it, or None:
    ``.NAME.tmp-*`` and the other siblings of a write, or with ``lock_only`` the lock alone
    (all a no-op writes)."""
    existing = next((p for p in (out_dir, *out_dir.parents) if p.is_dir()), Path("."))
    try:
        name_max = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    room = name_max - (LOCK_NAME_EXTRA if lock_only else SIBLING_NAME_EXTRA)
    size = len(os.fsencode(out_dir.name))
    if size <= room:
        return None
    beside = ".NAME.lock" if lock_only else ".NAME.tmp-*"
    return (
        f"the name is too long: {size:,} bytes, at most {room} (prepare writes {beside} beside "
        f"it, within the {name_max} a name may have here); choose a shorter name"
    )


def dataset_damage(out_dir: Path, meta: Mapping[str, Any]) -> str | None:
    """What is missing or cut short in a prepared dataset, in words (``train.bin holds 1,000
    bytes, not 2,007,524``), or None when each bin holds its tokens in full and the tokenizer
    file its meta needs is there. Sizes only: a no-op stays instant on a corpus of any size."""
    try:
        itemsize = np.dtype(meta["dtype"]).itemsize
        wanted = {f"{split}.bin": int(meta[f"{split}_tokens"]) * itemsize
                  for split in ("train", "val")}  # fmt: skip
        needs_file = meta["tokenizer"].get("name") in ("bpe", "hf")
    except (KeyError, TypeError, ValueError, AttributeError):
        return "its meta.json lacks the token counts"
    for name, size in wanted.items():
        try:
            held = (out_dir / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if held != size:
            return f"{name} holds {held:,} bytes, not {size:,}"
    if needs_file and not (out_dir / HFTokenizer.FILE).is_file():
        return f"{HFTokenizer.FILE} is missing"
    return None


def dataset_differences(
    existing: dict[str, Any], settings: dict[str, Any], files: list[Any]
) -> list[str]:
    """Which of the asked settings a prepared dataset was made with otherwise, in words
    (``--val-fraction 0.1, asked 0.2``), for the refusal to name them. ``meta.json`` keeps the
    settings asked (``settings``); a dataset prepared before it did is compared on what its
    meta shows (split, text field), never on the vocabulary BPE learned, which may be smaller
    than the one asked."""
    had = existing.get("settings")
    if not isinstance(had, dict):
        had = {"val_fraction": existing.get("val_fraction"), "seed": existing.get("split_seed"),
               "text_field": existing.get("text_field")}  # fmt: skip
    out = []
    for key, value in settings.items():
        if key == "format" or key not in had or had[key] == value:
            continue
        if key.startswith("bpe_") and None in (had[key], value):
            continue  # a setting of bpe only, and one of the two is not bpe: --tokenizer says it
        if key == "tokenizer" and not (isinstance(value, str) and isinstance(had[key], str)):
            continue  # None on one side: a dataset of an older format
        if key == "tokenizer" and max(len(value), len(had[key])) == 64:  # a file's sha256
            out.append("--tokenizer (another tokenizer file)")
            continue
        out.append(f"--{key.replace('_', '-')} {had[key]}, asked {value}")
    if isinstance(existing.get("files"), int) and existing["files"] != len(files):
        out.append(f"{existing['files']} input files, now {len(files)}")
    elif existing.get("source_paths_sha256") not in (None, paths_sha256(real_paths(files))):
        out.append(f"the paths of its {len(files):,} input file{'s' if len(files) != 1 else ''}")
    return out


#: What HF ``tokenizers``' BPE trainer holds per byte of distinct words in its sample (each
#: byte a symbol with its links, each pair with the words it occurs in): 8 MB of random Han
#: text (every word new) peaked at 1.05 GB RSS, 2026-12-05; English repeats its words and
#: stays near 10 bytes per byte.
TRAINER_BYTES_PER_DISTINCT_BYTE = 110
#: Bytes of the sample read to measure how many of its words are new.
PROBE_BYTES = 4 << 20
_WORD = re.compile(r"\w+|[^\w\s]+")


class _DistinctWords:
    """How much of a BPE sample's text is distinct words, measured on its first
    :data:`PROBE_BYTES`: text without spaces (Chinese, Japanese) or of random tokens holds
    few repeats, and the trainer's memory grows with the distinct words' bytes, so a 256 MB
    sample of it needs ~28 GB. :meth:`bounded_cap` says how much sample fits in half of the
    memory this process can allocate, and says so when that is less than asked."""

    def __init__(self) -> None:
        self.words: set[str] = set()
        self.seen = 0  # characters (what the sample's cap counts)
        self.seen_bytes = 0  # their UTF-8 bytes (what the byte-level trainer holds)
        self.cap: int | None = None

    def add(self, text: str) -> None:
        if self.seen < PROBE_BYTES:
            self.seen += len(text)
            self.seen_bytes += len(text.encode("utf-8"))
            self.words.update(_WORD.findall(text))

    def full(self) -> bool:
        return self.seen >= PROBE_BYTES

    def bounded_cap(self, cap: int, expected_bytes: float) -> int:
        """The sample's cap in characters: ``cap``, or less where the trainer would hold over
        half of the free memory for the sample expected (``expected_bytes`` of text)."""
        from nanolab.processes import host_memory_available

        share = sum(len(w.encode("utf-8")) for w in self.words) / max(1, self.seen_bytes)
        self.words.clear()
        per_char = self.seen_bytes / max(1, self.seen)  # UTF-8 bytes per character
        wanted = min(cap, int(expected_bytes / per_char))  # characters
        held = TRAINER_BYTES_PER_DISTINCT_BYTE * share * per_char  # memory per character
        available = host_memory_available()
        self.cap = cap
        if available is None:
            return cap
        bound = max(PROBE_BYTES, int(available / 2 / held)) if held else cap
        self.cap = min(cap, bound)  # also where the corpus holds more text than its size said
        if wanted > bound:
            note(
                "nanolab prepare",
                f"the BPE sample stops at {self.cap * per_char / 2**20:.0f} MB of text, not "
                f"{wanted * per_char / 2**20:.0f}: {share:.0%} of it is distinct words, which "
                f"the trainer holds at ~{TRAINER_BYTES_PER_DISTINCT_BYTE} bytes of memory per "
                f"byte (about {held * wanted / 2**30:.1f} GB, over half of the "
                f"{available / 2**30:.1f} GB free); --bpe-sample-bytes sets it",
            )
        return self.cap


class _SampleRate:
    """The share of each block's units that the BPE sample draws, so that it holds about
    ``target`` characters drawn evenly over the whole corpus.

    How much text a compressed or parquet file holds shows only as it is read. A fixed guess
    of 3x its size drew a corpus of ~9x zstd shards from its first two files, where the cap
    then stopped the pass without a word. The rate is set before each block (in block order,
    from the input alone: the same for any number of workers) from the text still expected,
    at the text per input byte read so far in files of its kind (3x until one is read; a plain
    file's text is its size), against the part of the target not yet drawn: a start drawn too
    densely is made up for by the rest."""

    def __init__(self, files: Sequence[InputFile], target: int) -> None:
        self.files = files
        self.target = target
        self.drawn = 0.0  # characters drawn so far, as expected at the rates set
        #: input bytes and their text, of the files read through, per kind (expands or not)
        self.done_read = {False: 0, True: 0}
        self.done_text = {False: 0, True: 0}
        self.index = -1  # the file being read
        self.read = 0  # its input bytes read so far
        self.text = 0  # its text so far
        #: the last point of it where its text and input bytes are known to match: all its
        #: text before a block that needed a new read came from the bytes read before it
        self.matched_read = 0
        self.matched_text = 0

    @staticmethod
    def _expands(f: InputFile) -> bool:
        return f.compression is not None or f.kind == "parquet"

    def _per_byte(self, expands: bool) -> float:
        """Text per input byte of files of this kind (compressed or parquet, or plain)."""
        if not expands:
            return 1.0
        read, text = self.done_read[True], self.done_text[True]
        read_now, text_now = read, text  # all the text so far came from the bytes read so far
        if self.index >= 0 and self._expands(self.files[self.index]):
            read, text = read + self.matched_read, text + self.matched_text
            read_now, text_now = read_now + self.read, text_now + self.text
        guess = text / read if read and text else 3.0
        return max(guess, text_now / read_now if read_now else 0.0)

    def _ahead(self) -> float:
        """The text expected in the input not read yet."""
        later = sum(f.size * self._per_byte(self._expands(f)) for f in self.files[self.index + 1 :])
        if self.index < 0:
            return later
        f = self.files[self.index]
        return later + max(0.0, f.size * self._per_byte(self._expands(f)) - self.text)

    def keep(self, block: Block, f: InputFile, read_in_file: int) -> float:
        """The share of ``block`` to draw; ``read_in_file``: ``f``'s input bytes read so far."""
        if block.file_index != self.index:
            if self.index >= 0 and self.text:
                expands = self._expands(self.files[self.index])
                self.done_read[expands] += self.files[self.index].size
                self.done_text[expands] += self.text
            self.index, self.read, self.text = block.file_index, 0, 0
            self.matched_read = self.matched_text = 0
        if read_in_file > self.read:
            self.matched_read, self.matched_text = self.read, self.text
            self.read = read_in_file
        text = block_bytes(block)
        self.text += text
        ahead = self._ahead() + text  # this block's text included
        keep = min(1.0, max(0.0, self.target - self.drawn) / max(1.0, ahead))
        self.drawn += keep * text
        return keep

    def expected_sample(self) -> float:
        """The sample's expected size in characters, as the input read so far says."""
        return min(float(self.target), self.drawn + self._ahead())

    def note_stopped_early(self, taken: int, cap: int) -> None:
        """Say that the cap ended the sample before the corpus did, and where."""
        if self.index < 0:
            return
        f = self.files[self.index]
        if self.index == len(self.files) - 1 and self.read >= f.size:
            return  # the corpus ended with it (or all but what the last read holds)
        note(
            "nanolab prepare",
            f"the BPE sample reached its cap ({cap / 1e6:,.1f}M characters, {taken / 1e6:,.1f}M "
            f"taken) in file {self.index + 1} of {len(self.files)} ({f.path}): the rest of the "
            "corpus is not in it; --bpe-sample-bytes sets its size",
        )


#: The part after ``.NAME.KIND-`` of what a write leaves beside the dataset folder: the folder
#: being written (``tempfile.mkdtemp``'s 8 letters, digits or ``_``) and a replaced copy (the
#: PID of the process that replaced it).
_LEFTOVER_SUFFIX = {"tmp": re.compile(r"[a-z0-9_]{8}"), "old": re.compile(r"\d+"),
                    "dead": re.compile(r"\d+")}  # fmt: skip


def _leftovers(out_dir: Path, kind: str) -> list[Path]:
    """``.<name>.<kind>-*`` beside ``out_dir``, newest first (the name taken literally, and the
    suffix as prepare writes it: a dataset called ``a*`` never matches another's, nor ``a``
    the folder being written for a dataset called ``a.tmp-x``, ``.a.tmp-x.tmp-XXXXXXXX``)."""
    prefix = f".{out_dir.name}.{kind}-"
    found = [
        p
        for p in out_dir.parent.glob(f"{glob.escape(prefix)}*")
        if _LEFTOVER_SUFFIX[kind].fullmatch(p.name[len(prefix) :])
    ]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def _finish_interrupted_swap(out_dir: Path) -> None:
    """A replacement moves the old dataset to ``.<name>.old-PID`` and the new one in. Killed
    between the two, the old one is the only copy: put it back (the run that was replacing it
    starts again from the rules, ``--force`` included). Once ``out_dir`` is there, a leftover
    old copy is what was replaced, and goes; a replaced copy is renamed ``.dead-`` before it is
    deleted, so one whose deletion was killed is never put back.

    A killed prepare's half-written ``.<name>.tmp-*`` (as large as the dataset) goes too, here
    and not only before a write: a later no-op prepare, and every ``fit`` that reuses the
    dataset, stop at "nothing to do". Called with the lock held, which a prepare holds from
    before it creates its folder until that folder is renamed into place: so no live prepare
    is writing one, and every one found is a dead process's."""
    olds = _leftovers(out_dir, "old")
    if olds and not out_dir.exists():
        os.replace(olds.pop(0), out_dir)
    for stale in olds + _leftovers(out_dir, "dead") + _leftovers(out_dir, "tmp"):
        shutil.rmtree(stale, ignore_errors=True)


def _stop(pool: ProcessPoolExecutor) -> None:
    """End a pool now, its blocks unfinished: queued ones are cancelled by the pool itself and
    the workers are terminated (a block of BPE takes seconds). The order matters: the pool is
    told to shut down before its workers die, so it cancels what was queued before it sees
    them gone; a future cancelled from outside made the pool's own clean-up fail on it
    (InvalidStateError), leaving its feeder thread blocked on a pipe no process read, and the
    interpreter waiting on that thread at exit for ever.

    A worker ended while it was writing its result (a sample block is megabytes) leaves the
    pool's manager thread reading a message that never completes: this process's own copy of
    the result pipe's write end kept it from ever seeing end-of-file, so the join below waited
    its 30 s and the interpreter then waited for ever at exit. This process never writes
    there, so that copy is closed once the workers are told to end: the torn message then
    reads as end-of-file, which the pool treats as a worker lost and cleans up after.

    The workers are killed, not sent SIGTERM: they ignore it (a job-wide SIGTERM is for the
    parent to act on, :func:`nanolab.data.encode.become_worker`), so each went on through the
    blocks already handed to it, seconds each for BPE, and the join below waited its 30 s."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    manager = getattr(pool, "_executor_manager_thread", None)
    results_writer = getattr(getattr(pool, "_result_queue", None), "_writer", None)
    pool.shutdown(wait=False, cancel_futures=True)  # it forgets the three above
    for process in processes:
        with contextlib.suppress(Exception):
            process.kill()  # SIGKILL: they ignore SIGINT and SIGTERM
    if results_writer is not None:
        with contextlib.suppress(OSError):
            results_writer.close()
    if manager is not None:
        manager.join(timeout=30)  # it reaps the workers and the queue's feeder thread


class _Progress:
    """One status line on stderr: MB/s of input, tokens/s and an ETA from the input's size."""

    def __init__(self, phase: str, total_bytes: int, quiet: bool) -> None:
        self.phase = phase
        self.total = max(1, total_bytes)
        self.quiet = quiet
        self.tty = sys.stderr.isatty()
        self.started = time.perf_counter()
        self.last_shown = self.started  # the first line after one interval: quick runs stay quiet
        self.shown_any = False

    def update(self, done_bytes: int, tokens: int, force: bool = False) -> None:
        if self.quiet:
            return
        now = time.perf_counter()
        every = 0.5 if self.tty else 30.0
        if now - self.last_shown < every and not (force and self.shown_any):
            return
        self.last_shown = now
        secs = max(now - self.started, 1e-9)
        rate = done_bytes / secs
        left = (self.total - done_bytes) / rate if rate > 0 else float("inf")
        eta = time.strftime("%H:%M:%S", time.gmtime(left)) if left < 360_000 else "--:--:--"
        line = (
            f"prepare {self.phase}: {done_bytes / 1e6:,.1f}/{self.total / 1e6:,.1f} MB "
            f"({100 * done_bytes / self.total:.0f}%)  {rate / 1e6:.1f} MB/s"
        )
        if tokens:
            line += f"  {tokens / secs / 1e6:.2f}M tok/s"
        line += f"  ETA {eta}"
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr)
        self.shown_any = True

    def close(self) -> None:
        if self.shown_any and self.tty and not self.quiet:
            print(file=sys.stderr)


def in_flight_budget(workers: int) -> int:
    """The raw bytes of documents that may be in the workers at once: what the usual ``2 x
    workers`` blocks hold (a block is at most a read past its ~1 MB, but for a line longer
    than that), or one longest JSON line. A block that would pass it waits for the blocks
    before it (one is always let through). Without it each worker took two blocks whatever
    their size: 16 workers held 32 lines of up to 64 MB, each encoded in a multiple of its
    size (a tokenizer.json that cannot be encoded in slices takes ~200 bytes per token)."""
    usual = sources.BLOCK_BYTES + sources._READ_BYTES
    return max(2 * workers * usual, sources.JSON_LINE_MAX_BYTES)


def block_bytes(block: Block) -> int:
    """The raw size of a block's documents: its bytes, or a parquet block's texts' lengths."""
    if isinstance(block.payload, bytes):
        return len(block.payload)
    return sum(len(value) for value in block.payload if isinstance(value, str))


class _Job:
    """One ``prepare`` run under the folder's lock."""

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)
        self.total_bytes = sum(f.size for f in self.files)
        small = self.total_bytes < PARALLEL_MIN_BYTES
        self.n_workers = self.workers or (1 if small else default_workers())
        self.bad_count = 0
        self.bad_examples: list[str] = []
        self.read_in_file = 0  # the input bytes of the block's file read so far (_blocks)
        #: Text files found bad (a byte that is not UTF-8): each is one document, skipped whole
        #: under --skip-bad, so the rest of it is not read.
        self.dropped: set[int] = set()

    # -- blocks in, results out -----------------------------------------------------------
    def _blocks(self, progress: _Progress, tokens: Callable[[], int]) -> Iterator[Block]:
        done = 0
        for index, f in enumerate(self.files):
            reader = FileReader(f, index, self.settings["text_field"])
            with contextlib.closing(reader.blocks()) as each:
                for block in each:
                    if index in self.dropped:
                        break
                    progress.update(done + reader.consumed, tokens())
                    self.read_in_file = reader.consumed  # for the BPE sample's rate
                    yield block
            done += f.size
        progress.update(done, tokens(), force=True)

    def _map(
        self,
        func: Callable[..., T],
        blocks: Iterable[Block],
        spec: dict[str, Any] | None,
        *extra: Any,
        args_of: Callable[[Block], tuple[Any, ...]] | None = None,
    ) -> Iterator[tuple[tuple[int, str], T]]:
        """``func(block, *extra)`` over the blocks, in order, with at most 2 x workers in flight,
        each with its block's file index and kind; ``args_of(block)``, where given, gives each
        block's own arguments instead of ``extra`` (called in this process, in block order)."""

        def args(block: Block) -> tuple[Any, ...]:
            return args_of(block) if args_of is not None else extra

        settings = EncodeSettings(
            text_field=self.settings["text_field"],
            val_fraction=self.settings["val_fraction"],
            seed=self.settings["seed"],
            dtype=getattr(self, "dtype", "uint32"),
        )
        if self.n_workers == 1:
            encode.init_worker(spec, settings)
            for block in blocks:
                yield (block.file_index, block.kind), func(block, *args(block))
            return
        # spawn, not fork: prepare also runs inside `fit`, where torch's threads make fork unsafe.
        ctx = multiprocessing.get_context("spawn")
        # N processes, not N x cores threads
        with mock.patch.dict(os.environ, {"TOKENIZERS_PARALLELISM": "false"}):
            pool = ProcessPoolExecutor(
                self.n_workers,
                mp_context=ctx,
                initializer=encode.init_worker,
                initargs=(spec, settings, os.getpid()),
            )
            pending: deque[tuple[tuple[int, str], Future[T], int]] = deque()
            budget = in_flight_budget(self.n_workers)
            in_flight = 0  # raw bytes of the pending blocks
            try:
                for block in blocks:
                    size = block_bytes(block)
                    while pending and in_flight + size > budget:  # a long document waits
                        where, future, done = pending.popleft()
                        in_flight -= done
                        yield where, future.result()
                    with stop_signals_held():  # a worker starts inside submit: see _stop
                        future = pool.submit(func, block, *args(block))
                    pending.append(((block.file_index, block.kind), future, size))
                    in_flight += size
                    if len(pending) >= 2 * self.n_workers:
                        where, future, done = pending.popleft()
                        in_flight -= done
                        yield where, future.result()
                while pending:
                    where, future, _ = pending.popleft()
                    yield where, future.result()
            except BaseException:  # Ctrl-C, a bad document, or the caller stopping early
                pending.clear()
                with stop_signals_held():  # a second Ctrl-C must not leave the pool half stopped
                    _stop(pool)
                raise
            pool.shutdown(wait=True)

    def _bad_text(self, where: tuple[int, str], errors: list[str]) -> bool:
        """Whether a block is of a text file found bad, now or before: the file is one
        document, dropped whole (a block's worth of it, and the rest of it, would leave a
        document without its end, run into the next file's)."""
        index, kind = where
        if index in self.dropped:
            return True
        if kind != "text" or not errors:
            return False
        self._note_errors(errors[:1])
        self.dropped.add(index)
        return True

    def _refuse_no_documents(self) -> None:
        """Called when no document was kept: an empty dataset is not one to train on, and one
        written would stand in the way of the real one (``fit`` can neither use nor replace
        it). Either --skip-bad skipped them all, or the sources hold none."""
        if self.bad_count:
            first = self.bad_examples[0].removesuffix(encode.SKIP_BAD)
            raise PrepareError(
                f"every document was skipped as bad ({self.bad_count:,}); nothing to prepare "
                f"(the first: {first})"
            )
        n = len(self.files)
        raise PrepareError(
            f"the sources hold no documents: {n:,} file{'s' if n != 1 else ''}, "
            f"{'all' if n != 1 else 'it is'} empty or blank; give files with text"
        )

    def _note_errors(self, errors: list[str]) -> None:
        if not errors:
            return
        if not self.skip_bad:
            raise BadTextError.of_document(errors[0])
        self.bad_count += len(errors)
        room = KEEP_EXAMPLES - len(self.bad_examples)
        self.bad_examples.extend(errors[:room])

    # -- the tokenizer ----------------------------------------------------------------------
    def _build_tokenizer(self) -> Tokenizer:
        name = self.tokenizer
        if name == "chars":
            return build_tokenizer(name, self._alphabet_texts)
        if name == "bpe":
            return train_bpe(self._bpe_sample(), self.bpe_vocab_size)
        return build_tokenizer(name, lambda: [], eot_token=self.eot_token)

    def _first_pass(
        self,
        phase: str,
        func: Callable[..., Any],
        *extra: Any,
        args_of: Callable[[Block], tuple[Any, ...]] | None = None,
    ) -> Iterator[Any]:
        """What ``func`` makes of each block, in a streaming pass before the encoding one."""
        progress = _Progress(phase, self.total_bytes, self.quiet)
        try:
            blocks = self._blocks(progress, lambda: 0)
            results = self._map(func, blocks, None, *extra, args_of=args_of)
            kept = 0
            with contextlib.closing(results):
                for where, (result, errors, documents) in results:
                    if self._bad_text(where, errors):
                        continue
                    self._note_errors(errors)
                    kept += documents
                    yield result
            if not kept:
                self._refuse_no_documents()
        finally:  # also when the caller stops early (the bpe sample is full)
            progress.close()
            self.bad_count, self.bad_examples = 0, []  # counted again by the encoding pass
            self.dropped = set()

    def _alphabet_texts(self) -> Iterator[str]:
        """The corpus's characters, block by block."""
        return self._first_pass("alphabet", encode.block_alphabet)

    def _bpe_sample(self) -> Iterator[str]:
        """A bounded sample drawn across the whole corpus, by a fixed hash per unit, at a rate
        :class:`_SampleRate` sets before each block from the text read so far."""
        rate = _SampleRate(self.files, self.bpe_sample_bytes)
        cap = int(self.bpe_sample_bytes * 1.25)  # the rate aims at the size; this bounds it
        taken = 0
        probe = _DistinctWords()

        def keep_of(block: Block) -> tuple[float]:
            return (rate.keep(block, self.files[block.file_index], self.read_in_file),)

        each = self._first_pass("bpe sample", encode.block_sample, args_of=keep_of)
        with contextlib.closing(each):
            for texts in each:
                for text in texts:
                    taken += len(text)
                    probe.add(text)
                    yield text
                if probe.full() and probe.cap is None:
                    cap = probe.bounded_cap(cap, rate.expected_sample())
                if taken >= cap:
                    rate.note_stopped_early(taken, cap)
                    break

    # -- the run ----------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        out_dir: Path = self.out_dir  # a killed run's leftovers: _finish_interrupted_swap
        tok = self._build_tokenizer()
        if tok.eot_id is None:
            raise PrepareError(f"tokenizer {self.tokenizer!r} has no end-of-text token")
        self.dtype = token_dtype(tok.vocab_size).name
        spec = tok.to_meta()
        if isinstance(tok, HFTokenizer):
            spec = {**spec, "json": tok.to_json()}

        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; a dataset is meant to be shared
        try:
            totals = self._write(tmp, tok, spec)
            tok.save_files(tmp)
            meta = self._meta(tok, totals)
            _write_json(tmp / "meta.json", meta)
            if out_dir.exists():
                old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
                os.replace(out_dir, old)
                os.replace(tmp, out_dir)
                dead = old.with_name(f".{out_dir.name}.dead-{os.getpid()}")
                os.replace(old, dead)  # a delete killed half-way is never put back
                shutil.rmtree(dead, ignore_errors=True)
            else:
                os.replace(tmp, out_dir)
        except OSError as err:
            shutil.rmtree(tmp, ignore_errors=True)
            raise with_errno_of(PrepareError(write_refused(out_dir, err)), err) from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if not self.quiet:
            secs = time.perf_counter() - started
            tokens = meta["train_tokens"] + meta["val_tokens"]
            skipped = f", {self.bad_count:,} bad documents skipped" if self.bad_count else ""
            print(
                f"prepared {out_dir}: {tok.name} tokenizer, vocab {tok.vocab_size}, "
                f"{meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens, "
                f"{sum(meta['documents'].values()):,} documents{skipped} "
                f"({secs:.1f}s, {tokens / max(secs, 1e-9) / 1e6:.2f}M tokens/s, "
                f"{self.n_workers} worker{'s' if self.n_workers > 1 else ''})",
                file=sys.stderr,
            )
        return meta

    def _write(self, tmp: Path, tok: Tokenizer, spec: dict[str, Any]) -> dict[str, Any]:
        totals: dict[str, Any] = {
            split: {"tokens": 0, "bytes": 0, "docs": 0, "units": 0} for split in ("train", "val")
        }
        last: dict[str, tuple[list[np.ndarray], int, int, str | None] | None] = {
            "train": None,
            "val": None,
        }
        characters = 0
        progress = _Progress("tokenize", self.total_bytes, self.quiet)
        written = lambda: totals["train"]["tokens"] + totals["val"]["tokens"]  # noqa: E731
        with open(tmp / "train.bin", "wb") as ftrain, open(tmp / "val.bin", "wb") as fval:
            handles = {"train": ftrain, "val": fval}
            blocks = self._blocks(progress, written)
            result: BlockResult
            # A text file is one document over many blocks: where it started, to take back
            # what was written of it when a later block finds it bad (--skip-bad).
            document, start = -1, None
            with contextlib.closing(self._map(encode.encode_block, blocks, spec)) as results:
                for where, result in results:
                    if where[1] == "text" and where[0] != document:
                        at = {split: handle.tell() for split, handle in handles.items()}
                        document, start = (
                            where[0],
                            (at, copy.deepcopy(totals), dict(last), characters),
                        )
                    if self._bad_text(where, result.errors):
                        if where[0] == document and start is not None:
                            at, was, kept, characters = start
                            for split, handle in handles.items():
                                handle.truncate(at[split])
                                handle.seek(at[split])
                            totals.update(copy.deepcopy(was))
                            last.update(kept)
                        continue
                    self._note_errors(result.errors)
                    characters += result.characters
                    for split, part in (("train", result.train), ("val", result.val)):
                        _append(handles[split], part, totals[split])
                        if part.last is not None:
                            unit_start, unit_bytes, unit_docs, unit_text = part.last
                            last[split] = (
                                part.ids_from(unit_start),
                                unit_bytes,
                                unit_docs,
                                unit_text,
                            )
            progress.close()
            if not totals["train"]["units"] + totals["val"]["units"]:
                self._refuse_no_documents()
            _rebalance(handles, totals, last, tok, self.settings["val_fraction"])
            for handle in handles.values():
                handle.flush()
                os.fsync(handle.fileno())
        totals["characters"] = characters
        return totals

    def _meta(self, tok: Tokenizer, totals: dict[str, Any]) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "tokenizer": tok.to_meta(),
            "vocab_size": tok.vocab_size,
            "dtype": self.dtype,
            "eot_id": tok.eot_id,
            "train_tokens": totals["train"]["tokens"],
            "val_tokens": totals["val"]["tokens"],
            "train_bytes": totals["train"]["bytes"],
            "val_bytes": totals["val"]["bytes"],
            "documents": {"train": totals["train"]["docs"], "val": totals["val"]["docs"]},
            "units": {"train": totals["train"]["units"], "val": totals["val"]["units"]},
            "characters": totals["characters"],
            "sources": self.sources,  # as typed, for messages
            **input_paths(real_paths(self.files)),  # what they were: stale.other_sources
            "files": len(self.files),
            "input_bytes": self.total_bytes,
            "source_hash": self.digest,
            "val_fraction": self.settings["val_fraction"],
            "split_seed": self.settings["seed"],
            "text_field": self.settings["text_field"],
            "settings": self.settings,  # as asked: what a refusal compares with
            "skipped": {"count": self.bad_count, "examples": self.bad_examples},
            "skipped_files": self.skipped_notes[:META_LIST_MAX],
            **(
                {"skipped_files_count": len(self.skipped_notes)}
                if len(self.skipped_notes) > META_LIST_MAX
                else {}
            ),
        }


def input_paths(paths: list[str]) -> dict[str, Any]:
    """What ``meta.json`` records of the files a dataset was prepared from: their digest
    (:func:`~nanolab.data.sources.paths_sha256`), and the paths themselves when there are at
    most :data:`~nanolab.data.sources.META_LIST_MAX` of them. Its size must not grow with the
    corpus's file count: every ``fit`` start and resume reads it."""
    kept = {"source_paths": paths} if len(paths) <= META_LIST_MAX else {}
    return {**kept, "source_paths_sha256": paths_sha256(paths)}


def write_refused(out_dir: Path, err: OSError) -> str:
    """The one line for a dataset that could not be written, worded by its cause: only a full
    disk or quota talks of space (a symlink loop or a permission was called a full disk), and
    a file-size limit names the limit."""
    what = err.strerror or str(err)
    if disk_full(err):
        left, fix = room_left(out_dir.parent, err)
        return f"cannot write {out_dir} ({what}; {left}); {fix}"
    if err.errno == errno.EFBIG:  # a size limit: another folder on the same disk would not help
        limit, fix = size_limit_met("--out")
        return f"cannot write {out_dir} ({what}: {limit}); {fix}"
    where = f": {err.filename}" if err.filename else ""
    return f"cannot write {out_dir} ({what}{where}); choose another output folder"


def _append(handle: IO[bytes], part: SplitPart, total: dict[str, int]) -> None:
    for piece in part.pieces:
        if piece.size:  # the array's own memory: tobytes() was a copy of a block's ids
            handle.write(memoryview(np.ascontiguousarray(piece)).cast("B"))
    total["tokens"] += part.size
    total["bytes"] += part.nbytes
    total["docs"] += part.docs
    total["units"] += part.units


def _rebalance(
    handles: dict[str, IO[bytes]],
    totals: dict[str, Any],
    last: dict[str, tuple[list[np.ndarray], int, int, str | None] | None],
    tok: Tokenizer,
    val_fraction: float,
) -> None:
    """A corpus too small for the hash to give both splits a unit: move the last unit over, or
    with a single unit of text (one short file), cut it: its tail is the validation split."""
    for empty, full in (("val", "train"), ("train", "val")):
        if totals[empty]["units"] or not totals[full]["units"]:
            continue
        moved = last[full]
        assert moved is not None
        unit, nbytes, docs, text = moved
        ids = np.concatenate(unit)  # at most one unit, once
        src = handles[full]
        src.flush()
        src.truncate(src.tell() - ids.nbytes)
        src.seek(0, os.SEEK_END)
        for key, value in (("tokens", ids.size), ("bytes", nbytes), ("docs", docs), ("units", 1)):
            totals[full][key] -= int(value)
        if totals[full]["units"]:
            pieces = {empty: (ids, nbytes, docs)}
        else:
            assert text is not None  # the corpus's only unit is its block's only one
            if ids.size < 4:
                raise PrepareError(
                    f"the corpus is too small to split: {ids.size} token(s); add text"
                )
            pieces = _cut(text, ids, nbytes, docs, tok, val_fraction)
        for split, (part, part_bytes, part_docs) in pieces.items():
            _append(
                handles[split], SplitPart([part], int(part_bytes), int(part_docs), 1), totals[split]
            )


_SPACE = re.compile(r"\s")


def _cut(
    text: str, ids: np.ndarray, nbytes: int, docs: int, tok: Tokenizer, val_fraction: float
) -> dict[str, tuple[np.ndarray, int, int]]:
    """The one unit of a corpus in two: ``val_fraction`` of its tokens, end-of-text included,
    are the validation split. The text is cut at the first character whose prefix encodes to
    the training share of the tokens (:func:`_token_position`; the share of characters is not
    the share of tokens when words differ in length), and each side
    is encoded and its bytes counted on its own: the bytes of decoded ids are not the text's for
    a tokenizer whose decode gives other text back (a WordLevel one drops the spaces), which
    counted 1 validation byte, or -128."""
    keep = ids.size - max(1, int(ids.size * val_fraction))  # tokens left for training
    at = _token_position(text, keep, ids.size - docs, tok)
    space = _SPACE.search(text, at, min(len(text) - 1, at + 64))
    at = space.start() if space else at  # not inside a word, where a WordLevel would see [UNK]
    head, tail = text[:at], text[at:]  # whole characters: never inside one's UTF-8 bytes
    head_ids, tail_ids = (a.astype(ids.dtype) for a in tok.encode_batch([head, tail]))
    if docs:
        tail_ids = np.concatenate([tail_ids, ids[-1:]])
    head_bytes = len(head.encode("utf-8"))
    return {
        "train": (head_ids, head_bytes, 0),
        "val": (tail_ids, nbytes - head_bytes, docs),
    }


def _token_position(text: str, keep: int, tokens: int, tok: Tokenizer) -> int:
    """The first character of ``text`` (``tokens`` tokens in all) whose prefix encodes to
    ``keep`` tokens. Tokens before a whitespace do not depend on the text after it, so the
    prefix up to a whitespace some way before the proportional guess is encoded once and the
    search runs over the few thousand characters after it: a unit can be a whole 64 MB JSON
    line, where a bisection encoding the prefix each time took 10x the unit's own encoding."""
    last = len(text) - 1
    if last < 1:
        return max(1, last)
    margin = max(256, len(text) // 512)
    guess = min(last, max(1, round(len(text) * keep / max(1, tokens))))

    def count(a: int, b: int) -> int:
        return int(tok.encode_batch([text[a:b]])[0].size) if b > a else 0

    base_at = guess
    while True:  # a whitespace before the cut: the tokens up to it are the prefix's
        base_at = max(0, base_at - margin)
        space = text.rfind(" ", 0, base_at) if base_at else -1
        base_at = space if space > 0 else 0
        base = count(0, base_at)
        if base < keep or base_at == 0:
            break
        margin *= 4
    need = keep - base
    hi = min(last, guess + margin)
    while hi < last and count(base_at, hi) < need:  # widen forward until it holds the cut
        hi = min(last, base_at + 2 * (hi - base_at))
    lo = base_at + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if count(base_at, mid) >= need:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(data, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())


@one_line_errors("nanolab prepare")
def main(argv: Sequence[str] | None = None) -> int:
    from nanolab.helpfmt import DefaultsHelpFormatter, OneLineParser

    parser = OneLineParser(
        prog="nanolab prepare",
        description=(
            "Tokenize text (.txt/.md), JSON lines (.jsonl/.json) and parquet files, plain or "
            ".gz/.zst, given as files, folders or globs, into train.bin / val.bin / meta.json."
        ),
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("sources", nargs="+", help="files, folders, globs, or bundled:shakespeare")
    parser.add_argument("-o", "--out", required=True, help="dataset folder to create")
    parser.add_argument(
        "--tokenizer",
        default="chars",
        help="bytes, chars, bpe, gpt2, or the path of a Hugging Face tokenizer.json",
    )
    parser.add_argument(
        "--bpe-vocab-size",
        type=int,
        default=4096,
        help="bpe: vocabulary size, all ids (merges, bytes and the end-of-text token)",
    )
    parser.add_argument(
        "--bpe-sample-bytes",
        default="256M",
        help="bpe: text the tokenizer learns from, drawn across the corpus",
    )
    parser.add_argument(
        "--eot-token",
        default=None,
        help="tokenizer.json: the end-of-text token added after every document (default: the "
        "first of <|endoftext|>, <|end_of_text|>, </s>, <eos>, ... it has)",
    )
    parser.add_argument(
        "--text-field", default="text", help="jsonl/parquet: the field holding the text (a.b nests)"
    )
    parser.add_argument(
        "--val-fraction", type=float, default=0.1, help="share of documents held out for validation"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the validation draw")
    parser.add_argument(
        "--workers", type=int, default=None, help="tokenizer processes (default: all cores)"
    )
    parser.add_argument(
        "--skip-bad", action="store_true", help="count bad documents instead of stopping"
    )
    parser.add_argument("--force", action="store_true", help="replace an existing dataset")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    parser.add_argument("--json", action="store_true",
                        help="print the dataset's meta.json summary as JSON on stdout")  # fmt: skip
    args = parser.parse_args(argv)
    refuse_inside_run(args.out, "-o", PrepareError)
    terminated = threading.Event()
    try:
        sample_bytes = parse_bytes(args.bpe_sample_bytes)
        with sigterm_as_interrupt(terminated):
            meta = prepare_dataset(
                args.sources,
                args.out,
                args.tokenizer,
                args.bpe_vocab_size,
                args.val_fraction,
                args.force,
                args.quiet,
                workers=args.workers,
                text_field=args.text_field,
                seed=args.seed,
                skip_bad=args.skip_bad,
                bpe_sample_bytes=sample_bytes,
                eot_token=args.eot_token,
                say_reused=True,
            )
    except BaseException as err:
        if not (isinstance(err, KeyboardInterrupt) or terminated.is_set()):
            raise
        # The command ends here: a signal sent again while it exits is not a traceback.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if terminated.is_set():
            print("nanolab prepare: terminated; nothing was written", file=sys.stderr)
            return 128 + signal.SIGTERM
        print("nanolab prepare: interrupted; nothing was written", file=sys.stderr)
        return 130
    if args.json:  # the one-line summary is on stderr either way
        summary = {k: v for k, v in meta.items() if k not in ("tokenizer", "skipped_files")}
        print(json.dumps(summary, indent=2))
    return 0
