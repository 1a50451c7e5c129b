"""What ``nanolab prepare`` reads: source specs resolved to files, and files read as a stream of
blocks of documents, never a whole file at once.

A *source spec* is ``bundled:<name>``, a file, a folder (walked recursively, symlinks followed,
loops reported), or a glob. Each file is one of three kinds, by its name:

- ``text``: ``.txt``/``.md``/``.text``/``.rst`` (plain, ``.gz``, ``.zst``). The file is one
  document; it is cut into *units* of about :data:`TEXT_UNIT_BYTES` at line starts (a line
  longer than any unit at a whitespace), which are the pieces the train/validation split draws
  from, so validation comes from every part of a book.
- ``jsonl``: ``.jsonl``/``.json``/``.ndjson`` lines (plain, ``.gz``, ``.zst``); each line is a
  document and a unit, its text at ``--text-field`` (a dotted path for nested fields).
- ``parquet``: each row is a document and a unit, its text in the ``--text-field`` column; read
  in record batches with pyarrow (FineWeb, SlimPajama and OpenWebText exports are parquet).

A :class:`Block` is the unit of parallel work: about :data:`BLOCK_BYTES` of one file's raw
documents, plus where they sit (file index, first unit, byte offset or line) so a worker can
name the exact line of a bad document. Blocks depend only on the file's bytes, never on how many
workers there are, which is what makes the output identical for any ``--workers``.
"""

from __future__ import annotations

import codecs
import contextlib
import glob
import gzip
import hashlib
import itertools
import os
import re
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import IO, Any

from nanolab.errors import NanolabError
from nanolab.home import expand_user, expanded_text

BUNDLED_PREFIX = "bundled:"
BUNDLED = {"shakespeare": "shakespeare.txt.gz"}

TEXT_SUFFIXES = (".txt", ".md", ".text", ".rst")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
COMPRESSIONS = {".gz": "gz", ".zst": "zst"}

#: Target size of a unit of a text file (the split's granularity inside one long document).
TEXT_UNIT_BYTES = 16 << 10
#: A text unit is cut at a line start when one comes within this many bytes; else here when a
#: newline is (every line indented), or at a space when none is (no newlines, minified code).
TEXT_UNIT_MAX_BYTES = 1 << 20
#: The longest unit of a line with no line start in reach: cut at its first whitespace after
#: :data:`TEXT_UNIT_BYTES`, or mid-word here when there is none. Units of 1 MB (the line start
#: limit) left a 3 MB line 3 units, one of them validation: 30% at --val-fraction 0.1.
TEXT_UNIT_LONG_LINE_BYTES = 64 << 10
#: Target raw size of one block of work.
BLOCK_BYTES = 1 << 20
#: The longest line of a JSON lines file: a line is one document, held whole while it is read and
#: parsed, so a longer one is refused (naming the line) rather than filling the memory.
JSON_LINE_MAX_BYTES = 64 << 20
#: The most rows of a parquet record batch: fewer where rows are long, so that a batch, and each
#: block cut from it, holds about :data:`BLOCK_BYTES` of text (:func:`parquet_batch_rows`).
PARQUET_ROWS = 256
_READ_BYTES = 4 << 20
#: A cut after a newline that starts a non-blank line keeps GPT-2-style pre-tokenization intact.
_LINE_START = re.compile(rb"\n(?=[^ \t\r\n\f\v])")
#: A newline with more of the text after it (not a file's trailing newline or blank lines): a
#: unit with one in reach but no line start (every line indented: poetry, code, logs) is cut as
#: it always was, so any text with lines prepares to the bytes it gave before long lines were cut.
_LINE_BREAK = re.compile(rb"\n(?=[^\r\n])")
#: Where a long line is cut: before a whitespace, so the word after it keeps its space.
_WHITESPACE = re.compile(rb"[ \t\r\n\f\v]")
#: A byte that is text other than whitespace whatever surrounds it: ASCII, and none of the
#: characters ``str.isspace`` calls whitespace. A text with none may still hold some (a
#: non-ASCII character); :class:`_BlankScan` decodes it to tell.
_ASCII_NON_SPACE = re.compile(rb"[^\t\n\x0b\x0c\r\x1c-\x1f \x80-\xff]")
#: How much of a text file's start is held to find out whether it is only whitespace. A file
#: still blank past it is read through once more, without holding it, to decide.
BLANK_LOOKAHEAD_BYTES = _READ_BYTES


class SourceError(NanolabError):
    """A source that cannot be read; the message names the file (and line or row) and the fix."""


class TextColumnError(SourceError):
    """A parquet file without the ``--text-field`` column. ``problem`` is the message less
    prepare's fix (``fit``, which reads the column ``text`` only, words its own)."""

    def __init__(self, problem: str) -> None:
        super().__init__(f"{problem}; name the text column with --text-field")
        self.problem = problem


@dataclass(frozen=True)
class InputFile:
    """One file to read. ``path`` is what messages show; ``fingerprint`` says if it changed."""

    path: str
    kind: str  # "text" | "jsonl" | "parquet"
    compression: str | None  # "gz" | "zst" | None
    size: int  # bytes on disk, for progress and the ETA
    fingerprint: tuple[Any, ...]
    bundled: str | None = None


def real_paths(files: Sequence[InputFile]) -> list[str]:
    """Where ``files`` really are (symlinks and ``..`` resolved; a bundled corpus by its
    name), sorted: what a dataset was prepared from, whichever folder or link named it."""
    return sorted({str(f.fingerprint[0]) for f in files})


#: How many input paths (and skipped-file notes) ``meta.json`` lists at most. A folder of
#: 220,000 small files made a 19.6 MB meta.json (285 MB to write); past this many, it keeps
#: their count and :func:`paths_sha256` instead, and stays a few hundred KB.
META_LIST_MAX = 1000


def paths_sha256(paths: Sequence[str]) -> str:
    """The sha256 of ``paths`` (each as a line): which files a dataset was prepared from, in
    64 characters however many there were."""
    h = hashlib.sha256()
    for path in paths:
        h.update(path.encode("utf-8", "surrogateescape") + b"\n")
    return h.hexdigest()


@dataclass
class Block:
    """About a megabyte of one file's documents, the unit of work a tokenizer worker takes."""

    kind: str  # "text" (units of one document) | "jsonl" (lines) | "rows" (parquet texts)
    file_index: int
    file_path: str
    first_unit: int  # unit index of the first document/unit in this block (line, row, piece)
    payload: Any  # bytes for text/jsonl; list of values for rows
    unit_sizes: list[int] = field(default_factory=list)  # text: byte length of each unit
    byte_offset: int = 0  # text: offset of the block in the decompressed file
    ends_document: bool = False  # text: the block's last unit ends the file's document
    #: text: the file holds only whitespace (not a document); its bytes are not carried.
    blank: bool = False


@dataclass
class Resolved:
    files: list[InputFile]
    skipped: list[str]  # human-readable notes: loops, broken links, other extensions


def _classify(name: str) -> tuple[str | None, str | None]:
    """(kind, compression) from a file name; kind is None for files nanolab does not read."""
    lower = name.lower()
    compression = None
    for suffix, comp in COMPRESSIONS.items():
        if lower.endswith(suffix):
            compression, lower = comp, lower[: -len(suffix)]
            break
    if lower.endswith(TEXT_SUFFIXES):
        return "text", compression
    if lower.endswith(JSONL_SUFFIXES):
        return "jsonl", compression
    if lower.endswith(PARQUET_SUFFIXES) and compression is None:
        return "parquet", None
    return None, compression


def _input_file(path: Path, explicit: bool) -> InputFile | None:
    kind, compression = _classify(path.name)
    if kind is None:
        if not explicit:
            return None
        kind = "text"  # a file named on the command line is read as text whatever its name
    st = path.stat()
    resolved = str(path.resolve())
    return InputFile(
        str(path), kind, compression, st.st_size, (resolved, st.st_size, st.st_mtime_ns)
    )


def not_a_file(path: Path) -> str:
    """What ``path`` is instead of a regular file, in the words every message uses: a FIFO is
    not "missing", and a broken symlink is named as one wherever it is found."""
    import errno
    import stat

    try:
        mode = os.stat(path).st_mode
    except OSError as err:
        if os.path.islink(path):
            return "a symlink loop" if err.errno == errno.ELOOP else "a broken symlink"
        return "missing" if err.errno == errno.ENOENT else f"not readable ({err.strerror})"
    for test, what in (
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a folder"),
    ):
        if test(mode):
            return what
    return "not a regular file"


#: The ``format`` of a prepared dataset's ``meta.json`` starts with this (nanolab.data.prepare).
DATASET_FORMAT_PREFIX = "nanolab-tokens-"
#: A prepared dataset's ``meta.json`` is small (a char vocabulary, a few counts): one up to this
#: size is parsed whole to tell; a larger one (an earlier version listed every input file in it)
#: by how it starts (:data:`_DATASET_META_START`), never parsed: it may be a corpus of that name.
DATASET_META_MAX_BYTES = 16 << 20
#: How every ``meta.json`` ``nanolab prepare`` writes starts: its ``format`` key comes first.
_DATASET_META_START = re.compile(rb'\A\s*\{\s*"format"\s*:\s*"' + DATASET_FORMAT_PREFIX.encode())


#: How a prepared dataset met among the sources is listed as skipped, after its folder.
DATASET_SKIPPED = ": a prepared nanolab dataset (its meta.json), skipped"
#: The files ``nanolab prepare`` writes into a dataset folder: its token ids and their key, not
#: text (``train.bin`` read as text is its ids' bytes tokenized again).
DATASET_FILE_NAMES = ("train.bin", "val.bin", "meta.json", "tokenizer.json")


def is_prepared_dataset(directory: Path) -> bool:
    """Whether ``directory`` holds a dataset ``nanolab prepare`` wrote (its ``meta.json`` names
    a nanolab format): its meta.json and tokenizer.json are another dataset's, not corpus, and
    a bad-line refusal would advise editing them. Told whatever the meta.json's size: a large
    one, which an earlier version wrote for a folder of many files, by its first bytes."""
    import json

    meta = directory / "meta.json"
    try:
        if not meta.is_file():
            return False
        if meta.stat().st_size > DATASET_META_MAX_BYTES:
            with open(meta, "rb") as f:
                return _DATASET_META_START.match(f.read(4096)) is not None
        data = json.loads(meta.read_bytes())
    except (OSError, ValueError):
        return False
    fmt = data.get("format") if isinstance(data, dict) else None
    return isinstance(fmt, str) and fmt.startswith(DATASET_FORMAT_PREFIX)


def _walk(root: Path, skipped: list[str], exclude: Sequence[Path] = ()) -> list[Path]:
    """Every file under ``root``, following symlinks, each directory once (loops reported),
    except the paths in ``exclude`` (prepare's own output folder and lock, when ``-o`` lies
    inside an input folder: a rerun must not read its own dataset as input)."""
    skip = {os.path.realpath(p) for p in exclude}
    found: list[Path] = []
    seen: set[tuple[int, int]] = set()
    other: dict[str, int] = {}

    def visit(directory: Path) -> None:
        if not _first_visit(directory, seen, skipped):
            return
        if is_prepared_dataset(directory):
            skipped.append(f"{directory}{DATASET_SKIPPED}")
            return
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except PermissionError:
            skipped.append(f"{directory}: not readable, skipped")
            return
        for entry in entries:
            path = Path(entry.path)
            if skip and os.path.realpath(path) in skip:
                continue
            try:
                is_dir = entry.is_dir()  # follows symlinks
                is_file = entry.is_file()
            except OSError:
                skipped.append(f"{path}: {not_a_file(path)}, skipped")
                continue
            if is_dir:
                visit(path)
            elif is_file:
                if _classify(entry.name)[0] is None:
                    ext = "".join(Path(entry.name).suffixes[-2:]) or "(no extension)"
                    other[ext] = other.get(ext, 0) + 1
                else:
                    found.append(path)
            else:
                skipped.append(f"{path}: {not_a_file(path)}, skipped")

    visit(root)
    if other:
        summary = ", ".join(f"{n} {ext}" for ext, n in sorted(other.items()))
        skipped.append(f"{root}: {sum(other.values())} files of other types skipped ({summary})")
    return found


def _first_visit(
    directory: str | os.PathLike[str], seen: set[tuple[int, int]], skipped: list[str]
) -> bool:
    """Whether ``directory`` is read for the first time in a walk (its device and inode not in
    ``seen``, then added): a symlink back up the tree, or a second link to a folder, is named in
    ``skipped`` instead of read again and again (a loop, until the path is too long)."""
    st = os.stat(directory)
    if (st.st_dev, st.st_ino) in seen:
        skipped.append(f"{directory}: a symlink loop (folder already read), skipped")
        return False
    seen.add((st.st_dev, st.st_ino))
    return True


def _glob(pattern: str, skipped: list[str]) -> set[str]:
    """What ``glob.glob(pattern, recursive=True)`` matches, but each folder a ``**`` walks read
    once (:func:`_first_visit`): Python's ``**`` follows a symlink back up the tree until the
    path is too long, which listed every file ~40 times (12,000 warning lines and a 3 MB
    ``meta.json`` for 300 files, and minutes for a few thousand). As there, ``**`` skips
    hidden names and matches the folder it starts in too."""
    parts = pattern.split(os.sep)
    if "**" not in parts:
        return set(glob.glob(pattern))
    at = parts.index("**")
    prefix, rest = os.sep.join(parts[:at]), os.sep.join(parts[at + 1 :])
    if at == 0:
        bases = [""]  # the current folder, matches relative to it
    elif not prefix:
        bases = [os.sep]  # "/**": the root folder
    else:
        bases = [b for b in glob.glob(prefix) if os.path.isdir(b)]
    found: set[str] = set()
    for base in bases:
        for folder in _folders_below(base, skipped):
            if rest:
                found |= _glob(os.path.join(glob.escape(folder), rest), skipped)
            else:  # a trailing "**": the folders and everything in them ("**/": the folders)
                if folder:  # as Python's, "**" alone does not match the current folder
                    found.add(folder)
                if parts[at + 1 :] != [""]:
                    found |= {os.path.join(folder, n) for n in _visible(folder or os.curdir)}
    return found


def _visible(directory: str) -> list[str]:
    """The names in ``directory`` that a glob's ``*`` and ``**`` match (not hidden ones)."""
    try:
        return [name for name in os.listdir(directory) if not name.startswith(".")]
    except OSError:  # unreadable, or gone since: a glob matches nothing there
        return []


def _folders_below(base: str, skipped: list[str]) -> list[str]:
    """``base`` and every folder under it that is not hidden, following symlinks, each once."""
    seen: set[tuple[int, int]] = set()
    folders: list[str] = []

    def visit(folder: str) -> None:
        try:
            if not _first_visit(folder or os.curdir, seen, skipped):
                return
        except OSError:
            return
        folders.append(folder)
        for name in sorted(_visible(folder or os.curdir)):
            path = os.path.join(folder, name)
            if os.path.isdir(path):  # follows symlinks, as Python's glob does
                visit(path)

    visit(base)
    return folders


def resolve_sources(
    specs: Sequence[str], exclude: Sequence[Path] = (), setting: str | None = None
) -> Resolved:
    """Every file the specs name, in a fixed order (specs in order, each folder sorted); a
    folder's walk leaves out the paths in ``exclude``. ``setting``: the config key the specs
    came from (``data.source``), put before a refusal's words; None for ``nanolab prepare``'s
    arguments."""

    def named(message: str) -> str:
        return f"{setting}: {message}" if setting else message

    if not specs:
        raise SourceError("no sources given; pass files, folders, globs, or bundled:shakespeare")
    files: list[InputFile] = []
    skipped: list[str] = []
    for spec in specs:
        if not spec:  # Path("") is the current folder: every file in it would be read
            raise SourceError(named("a source is empty (''); give a file, a folder or a glob"))
        if spec.startswith(BUNDLED_PREFIX):
            key = spec[len(BUNDLED_PREFIX) :]
            if key not in BUNDLED:
                raise SourceError(
                    named(f"unknown bundled corpus {spec!r}; available: ")
                    + ", ".join(BUNDLED_PREFIX + k for k in BUNDLED)
                )
            blob = resources.files("nanolab.data").joinpath("corpus", BUNDLED[key]).read_bytes()
            digest = hashlib.sha256(blob).hexdigest()
            files.append(InputFile(spec, "text", "gz", len(blob), (spec, digest), BUNDLED[key]))
            continue
        path = expand_user(spec)
        if path.is_dir():
            if is_prepared_dataset(path):
                raise SourceError(
                    named(
                        f"folder {path} is a prepared nanolab dataset, not a corpus; give the "
                        "files or folder of text it was prepared from"
                    )
                )
            noted = len(skipped)
            found = _walk(path, skipped, exclude)
            if not found:
                datasets = [n for n in skipped[noted:] if DATASET_SKIPPED in n]
                if datasets:
                    shown = datasets[0].removesuffix(DATASET_SKIPPED)
                    more = f" and {len(datasets) - 1} more" if len(datasets) > 1 else ""
                    raise SourceError(
                        named(f"folder {path} holds no files nanolab reads, only a prepared ")
                        + f"nanolab dataset ({shown}{more}, skipped); give the files or folder "
                        "of text it was prepared from"
                    )
                raise SourceError(
                    named(f"folder {path} holds no files nanolab reads (text ")
                    + f"{', '.join(TEXT_SUFFIXES)}; json lines {', '.join(JSONL_SUFFIXES)}; "
                    ".parquet; optionally .gz/.zst)"
                )
            files.extend(f for p in found if (f := _input_file(p, explicit=False)) is not None)
        elif path.is_file():
            if path.name in DATASET_FILE_NAMES and is_prepared_dataset(path.parent):
                raise SourceError(
                    named(
                        f"{path} is a file of the prepared nanolab dataset {path.parent}, not a "
                        "corpus; give the files or folder of text it was prepared from"
                    )
                )
            files.append(_input_file(path, explicit=True))  # type: ignore[arg-type]
        elif glob.has_magic(spec):
            try:
                files.extend(_glob_files(spec, skipped, exclude))
            except SourceError as err:
                raise SourceError(named(str(err))) from None
        elif path.is_symlink() or path.exists():  # a link to nothing, a FIFO, a device
            raise SourceError(
                named(f"source {spec!r} is {not_a_file(path)}, not a file nanolab can read; ")
                + "give a file, a folder or a glob"
            )
        else:
            fix = read_from_here(path, setting) or "give a file, a folder or a glob"
            raise SourceError(named(f"source {spec!r} does not exist; {fix}"))
    return Resolved(_read_once(files, skipped), skipped)


def read_from_here(path: Path, setting: str | None = None) -> str | None:
    """For a relative ``path`` that is not there, where it was looked for and the fix: a
    config's paths are read from the current folder, not the config file's (a command run
    from the folder above the project misses ``data/text``); None for an absolute path."""
    if path.is_absolute():
        return None
    beside = ", not the config file's" if setting else ""
    return (
        f"relative paths are read from the current folder ({os.getcwd()}){beside}: run from "
        "the folder the path is relative to (a project's own), or give an absolute path"
    )


def _glob_files(spec: str, skipped: list[str], exclude: Sequence[Path]) -> list[InputFile]:
    """The files a glob matches that nanolab reads; what else it matches (folders, files of
    other types, links to nothing) is named in ``skipped``, never dropped without a word, and
    the paths in ``exclude`` (prepare's own output) are left out as a folder's walk does."""
    skip = [os.path.realpath(p) for p in exclude]

    def excluded(match: str) -> bool:
        real = os.path.realpath(match)
        return any(real == s or real.startswith(s + os.sep) for s in skip)

    matches = [Path(m) for m in sorted(_glob(expanded_text(spec), skipped)) if not excluded(m)]
    matches, datasets = _outside_datasets(matches)
    skipped += [f"{d}{DATASET_SKIPPED}" for d in datasets]
    picked, other, folders, odd = [], [], [], []
    for path in matches:
        if path.is_file():
            (picked if _classify(path.name)[0] is not None else other).append(path)
        elif path.is_dir():
            folders.append(path)  # its files are matched by the glob themselves, or named below
        else:
            odd.append(f"{path}: {not_a_file(path)}")
    skipped += [f"{note}, skipped" for note in odd]
    others = f"{len(other)} file(s) of other types" if other else ""
    if other:
        others += f" ({other[0].name}{', ...' if len(other) > 1 else ''})"
        skipped.append(f"{spec}: {others.replace(' of other', ' matched of other')} skipped")
    folder_note = None
    if folders and "**" not in spec:  # a recursive glob matches the files under them too
        more = ", ..." if len(folders) > 1 else ""
        folder_note = (
            f"{len(folders)} folder(s) ({folders[0]}{more}): a glob reads the files it "
            "matches; name a folder to read everything under it"
        )
        skipped.append(f"{spec}: matched and skipped {folder_note}")
    if not picked:
        reasons = [*odd, *([folder_note] if folder_note else [])]
        if datasets:
            more = ", ..." if len(datasets) > 1 else ""
            reasons.append(f"the files of {len(datasets)} prepared nanolab dataset(s) "
                           f"({datasets[0]}{more}), which are not a corpus")  # fmt: skip
        if other:
            reasons.append(others)
        why = f" (it matched {'; '.join(reasons)})" if reasons else ""
        raise SourceError(f"the glob {spec!r} matches no files nanolab reads{why}")
    return [f for p in picked if (f := _input_file(p, explicit=False)) is not None]


def _outside_datasets(matches: list[Path]) -> tuple[list[Path], list[Path]]:
    """The glob matches that lie in no prepared dataset (in one: its meta.json would be read as
    JSON lines and refused with advice to edit another dataset), and the datasets they lay in.
    A recursive glob reaches files a folder's walk would skip with their dataset."""
    verdict: dict[Path, bool] = {}

    def dataset_of(path: Path) -> Path | None:
        for folder in (path, *path.parents) if path.is_dir() else path.parents:
            if folder not in verdict:
                verdict[folder] = is_prepared_dataset(folder)
            if verdict[folder]:
                return folder
        return None

    kept: list[Path] = []
    datasets: dict[Path, None] = {}
    for path in matches:
        if (dataset := dataset_of(path)) is None:
            kept.append(path)
        else:
            datasets[dataset] = None
    return kept, list(datasets)


def _read_once(files: list[InputFile], skipped: list[str]) -> list[InputFile]:
    """Each file once, however many sources reach it (a link beside its target, a file inside
    a folder also given, overlapping globs): a second copy would be split into train and
    validation on its own, putting the validation text of one copy into the training text of
    the other."""
    seen: dict[tuple[Any, ...], str] = {}
    out = []
    for f in files:
        if f.bundled is not None:
            key: tuple[Any, ...] = ("bundled", f.bundled)
        else:
            try:
                st = os.stat(f.path)
            except OSError:  # gone since: reported when read, as before
                out.append(f)
                continue
            key = (st.st_dev, st.st_ino)
        if key in seen:
            skipped.append(f"{f.path}: the same file as {seen[key]} (read once), skipped")
            continue
        seen[key] = f.path
        out.append(f)
    return out


class _Counting:
    """A raw file object that remembers how many bytes were read (progress, ETA)."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.count = 0

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.count += len(data)
        return data

    def readinto(self, buf: Any) -> int:
        n = self.raw.readinto(buf)
        self.count += n or 0
        return n or 0

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self.raw.close()

    @property
    def closed(self) -> bool:
        return bool(self.raw.closed)


class FileReader:
    """Reads one :class:`InputFile` as :class:`Block` objects, counting raw bytes consumed."""

    def __init__(self, f: InputFile, index: int, text_field: str) -> None:
        self.file = f
        self.index = index
        self.text_field = text_field
        self.consumed = 0  # raw bytes of this file read so far
        self._counter: _Counting | None = None

    def _progress(self) -> None:
        if self._counter is not None:
            self.consumed = self._counter.count

    def _open(self, counter: _Counting) -> IO[bytes]:
        """The decompressed stream over ``counter`` (the raw file, :meth:`_open_raw`)."""
        if self.file.compression == "gz":
            return gzip.GzipFile(fileobj=counter, mode="rb")  # type: ignore[arg-type]
        return counter  # type: ignore[return-value]  # zst: decoded in _zstd_chunks

    def _open_raw(self) -> _Counting:
        f = self.file
        if f.bundled is not None:
            raw: IO[bytes] = (
                resources.files("nanolab.data").joinpath("corpus", f.bundled).open("rb")
            )
        else:
            raw = open(f.path, "rb")  # noqa: SIM115 - closed by the caller's with-block
        return _Counting(raw)

    def _chunks(self, counted: bool = True) -> Iterator[bytes]:
        """The decompressed bytes, in pieces, with corrupt or truncated files named.

        ``counted``: the read is the one progress follows (:attr:`consumed`); a second read
        of the file (:meth:`_blank_through`) is not.
        """
        what = {"gz": "gzip", "zst": "zstd", None: "file"}[self.file.compression]
        stream = counter = None
        try:
            counter = self._open_raw()
            if counted:
                self._counter = counter
            stream = self._open(counter)
            if self.file.compression == "zst":
                yield from self._zstd_chunks(stream)
                return
            while True:
                chunk = stream.read(_READ_BYTES)
                self._progress()
                if not chunk:
                    return
                yield chunk
        except Exception as err:  # zstandard.ZstdError has no importable base here
            corrupt = (EOFError, gzip.BadGzipFile, zlib.error)
            if isinstance(err, corrupt) or type(err).__name__ == "ZstdError":
                raise SourceError(
                    f"{self.file.path}: the {what} stream is truncated or corrupt ({err}); "
                    "download or copy the file again"
                ) from None
            if isinstance(err, OSError):
                raise SourceError(
                    f"{self.file.path}: cannot read ({err.strerror or err})"
                ) from None
            raise
        finally:
            if stream is not None and stream is not counter:
                stream.close()
            if counter is not None:
                counter.close()

    def _zstd_chunks(self, raw: IO[bytes]) -> Iterator[bytes]:
        """The frames of a ``.zst`` file decoded one after another; a file that ends inside a
        frame is refused (zstandard's stream reader returns end-of-file there, silently
        dropping the rest of the text)."""
        import zstandard

        dctx = zstandard.ZstdDecompressor()
        frame = dctx.decompressobj()
        inside = False  # bytes of an unfinished frame have been fed
        while data := raw.read(_READ_BYTES):
            self._progress()
            while data:
                out = frame.decompress(data)
                inside = True
                if out:
                    yield out
                if not frame.eof:
                    break
                data, frame, inside = frame.unused_data, dctx.decompressobj(), False
        if inside:
            raise EOFError("the file ends inside a zstd frame")

    def blocks(self) -> Iterator[Block]:
        kinds = {"text": self._text_blocks, "jsonl": self._jsonl_blocks}
        return kinds.get(self.file.kind, self._parquet_blocks)()

    # -- text: one document, cut into units at line starts ---------------------------------
    def _text_blocks(self) -> Iterator[Block]:
        """The file's units in blocks; a file of only whitespace is no document: one block
        saying so (``blank``), whatever its size, as a small one is. Its start is held until
        a non-blank character shows (at once, in a file of text), at most
        :data:`BLANK_LOOKAHEAD_BYTES`; a file blank that far is read once more to decide."""
        with contextlib.closing(self._chunks()) as chunks:
            held: list[bytes] = []
            size, scan = 0, _BlankScan()
            while True:
                if size >= BLANK_LOOKAHEAD_BYTES:
                    blank = self._blank_through()
                    break
                chunk = next(chunks, None)
                if chunk is None:
                    blank = scan.blank(b"", final=True)
                    break
                held.append(chunk)
                size += len(chunk)
                if not scan.blank(chunk):
                    blank = False
                    break
            if blank and size > 0:
                yield Block("text", self.index, self.file.path, 0, b"", [0], 0, True, blank=True)
                return
            yield from self._text_units(itertools.chain(held, chunks))

    def _blank_through(self) -> bool:
        """Whether the whole file is whitespace, read through on its own (nothing held)."""
        scan = _BlankScan()
        with contextlib.closing(self._chunks(counted=False)) as chunks:
            return all(scan.blank(chunk) for chunk in chunks) and scan.blank(b"", final=True)

    def _text_units(self, chunks: Iterator[bytes]) -> Iterator[Block]:
        buf = b""
        unit = 0
        offset = 0  # decompressed offset of buf[0]
        sizes: list[int] = []
        block_start = 0  # offset in buf where the pending block starts
        pos = 0  # offset in buf where the next unit starts
        eof = False
        scan = _NewlineScan()
        while True:
            cut = _next_cut(buf, pos, eof, scan)
            if cut is None:
                if eof:
                    break
                chunk = next(chunks, None)
                if chunk is None:
                    eof = True
                else:
                    buf = buf[block_start:] + chunk
                    offset += block_start
                    scan.base = offset
                    pos -= block_start
                    block_start = 0
                continue
            sizes.append(cut - pos)
            pos = cut
            if pos - block_start >= BLOCK_BYTES or (eof and pos == len(buf)):
                yield Block(
                    "text",
                    self.index,
                    self.file.path,
                    unit,
                    buf[block_start:pos],
                    sizes,
                    offset + block_start,
                    ends_document=eof and pos == len(buf),
                )
                unit += len(sizes)
                sizes = []
                block_start = pos
        if unit == 0:
            # An empty file: still one (empty) document, which the worker reports or skips.
            yield Block("text", self.index, self.file.path, 0, b"", [0], 0, ends_document=True)

    # -- json lines: one document per line --------------------------------------------------
    def _jsonl_blocks(self) -> Iterator[Block]:
        # The chunks of the pending lines are kept in a list and joined once per block: adding
        # each chunk to one bytes object copied everything held at every chunk, which made a
        # long line's cost grow with its square.
        parts: list[bytes] = []
        held = 0  # bytes in parts
        tail = 0  # bytes in parts after their last newline: the line being read
        newlines = 0  # newlines in parts
        line = 0  # line index of the first line in parts
        first = True
        for chunk in self._chunks():
            if first:
                first = False
                stripped = chunk.lstrip()
                if stripped.startswith(b"["):
                    raise SourceError(
                        f"{self.file.path}: this is one JSON array, not JSON lines; convert it "
                        f"with `jq -c '.[]' {self.file.path} > out.jsonl`"
                    )
            parts.append(chunk)
            held += len(chunk)
            count = chunk.count(b"\n")
            # The line that ends in this chunk (the one held so far plus the chunk's start),
            # else the one still being read; lines wholly inside a chunk are shorter than it.
            ended = tail + chunk.find(b"\n") if count else 0
            over = newlines + 1 if ended > JSON_LINE_MAX_BYTES else None
            newlines += count
            tail = len(chunk) - chunk.rfind(b"\n") - 1 if count else tail + len(chunk)
            if over is None and tail > JSON_LINE_MAX_BYTES:
                over = newlines + 1
            if over is not None:
                raise SourceError(
                    f"{self.file.path} line {line + over} is over "
                    f"{_size(JSON_LINE_MAX_BYTES)}: JSON lines hold one document per line, each "
                    "read whole; split it into several lines (documents), or put its text in a "
                    ".txt file"
                )
            if held < BLOCK_BYTES or tail == held:
                continue
            payload, parts = _split_parts(parts, held - tail)
            block = Block("jsonl", self.index, self.file.path, line, payload)
            del payload  # the block is the only holder while it is encoded
            line += newlines
            held, newlines = tail, 0
            yield block
        if held:
            block = Block("jsonl", self.index, self.file.path, line, b"".join(parts))
            parts.clear()
            yield block

    # -- parquet: one document per row ------------------------------------------------------
    def _parquet_blocks(self) -> Iterator[Block]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        top = self.text_field.split(".")[0]
        row = 0
        try:
            pf = pq.ParquetFile(self.file.path)
            names = pf.schema_arrow.names
            if top not in names:
                raise TextColumnError(
                    f"{self.file.path}: no column {top!r} (columns: {', '.join(names[:12])})"
                )
            batches = pf.iter_batches(
                batch_size=parquet_batch_rows(pf.metadata, top), columns=[top]
            )
            for batch in batches:
                for piece in _row_slices(batch.column(0)):
                    self._refuse_long_row(piece, row)
                    values = piece.to_pylist()
                    del piece  # the block's values are the only copy while it is encoded
                    done = (row + len(values)) / max(1, pf.metadata.num_rows)
                    self.consumed = int(self.file.size * min(1.0, done))
                    yield Block("rows", self.index, self.file.path, row, values)
                    row += len(values)
                del batch
        except (pa.ArrowException, OSError) as err:
            raise SourceError(
                f"{self.file.path}: not a readable parquet file near row {row} "
                f"({str(err).splitlines()[0]}); download or copy the file again"
            ) from None

    def _refuse_long_row(self, piece: Any, row: int) -> None:
        """Refuse a row whose text is over :data:`JSON_LINE_MAX_BYTES`: one document, held
        whole, as a JSON line is (a row of gigabytes would fill the memory several times)."""
        sizes = _text_sizes(piece)
        if sizes is None:
            return
        longest = max(sizes, default=0)
        if longest > JSON_LINE_MAX_BYTES:
            at = row + sizes.index(longest)
            raise SourceError(
                f"{self.file.path} row {at} is over {_size(JSON_LINE_MAX_BYTES)}: a parquet row "
                "is one document, read whole; split its text into several rows (documents), "
                "or put it in a .txt file"
            )


def parquet_batch_rows(metadata: Any, column: str) -> int:
    """Rows per record batch for ``column``: about :data:`BLOCK_BYTES` of it at its longest
    rows per row group (from the file's own sizes), at most :data:`PARQUET_ROWS`. A batch of
    256 rows whatever their size held 384 MB of 1.5 MB rows at once, and its copies several
    times that (90 MB of such text peaked at 840 MB)."""
    widest = 0.0
    for group in range(metadata.num_row_groups):
        chunks = metadata.row_group(group)
        size = sum(
            chunks.column(i).total_uncompressed_size
            for i in range(chunks.num_columns)
            if chunks.column(i).path_in_schema.split(".")[0] == column
        )
        widest = max(widest, size / max(1, chunks.num_rows))
    return int(max(1, min(PARQUET_ROWS, BLOCK_BYTES // max(1.0, widest))))


def _text_sizes(column: Any) -> list[int] | None:
    """Each row's text size in bytes, for a column of strings (None for another type)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        return None
    return [n or 0 for n in pc.binary_length(column).to_pylist()]


def _row_slices(column: Any) -> Iterator[Any]:
    """``column`` (one record batch's) in slices of about :data:`BLOCK_BYTES` of text each, one
    row at least: rows longer than their row group's average make a batch larger than planned."""
    sizes = _text_sizes(column)
    if sizes is None:
        yield column
        return
    start, held = 0, 0
    for i, size in enumerate(sizes):
        if held and held + size > BLOCK_BYTES:
            yield column.slice(start, i - start)
            start, held = i, 0
        held += size
    if start < len(sizes):
        yield column.slice(start)


class _BlankScan:
    """Whether a text read in pieces is only whitespace so far, by the rule a small file is
    judged by (``str.isspace``: Unicode whitespace). A piece with an ASCII character other
    than whitespace is decided at the first one, without decoding; only a piece without
    one is decoded. A piece that is not UTF-8 counts as text: the read of the file names the
    bad byte."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")()

    def blank(self, piece: bytes, final: bool = False) -> bool:
        if _ASCII_NON_SPACE.search(piece) is not None:
            return False
        try:
            text = self._decoder.decode(piece, final)
        except UnicodeDecodeError:
            return False
        return not text or text.isspace()


def _split_parts(parts: list[bytes], cut: int) -> tuple[bytes, list[bytes]]:
    """The first ``cut`` bytes of ``parts`` joined, and the parts of the rest. Only the chunk
    the cut falls in is split: joining everything and slicing held three copies of a long JSON
    line (the chunks, the join, the slice) while the block was encoded."""
    head: list[bytes] = []
    for i, part in enumerate(parts):
        if cut <= len(part):
            head.append(part[:cut])
            rest = [part[cut:]] if cut < len(part) else []
            return b"".join(head), rest + parts[i + 1 :]
        head.append(part)
        cut -= len(part)
    return b"".join(head), []


def _size(n: int) -> str:
    """``64 MB`` (whole megabytes), else ``1,000 bytes``."""
    return f"{n >> 20} MB" if n % (1 << 20) == 0 else f"{n:,} bytes"


@dataclass
class _NewlineScan:
    """How far the newline searches of :func:`_next_cut` found nothing, so that the next unit's
    search resumes there instead of scanning the same bytes again.

    Each ~16 KB unit looks up to 1 MB ahead for a line start, then for any line break: where
    there is none (text with no newlines, or CR-only line ends), each unit rescanned the same
    megabyte twice, and prepare ran 5-7x slower than on text with lines. Units start ever
    further into the file, so what was found empty stays empty for every later unit; the cut
    points are those of a full search.
    """

    base: int = 0  # offset in the file of the reader's buffer's first byte
    #: Per pattern, the file offset below which (from the unit where that search began) no
    #: match starts.
    clean_to: dict[re.Pattern[bytes], int] = field(default_factory=dict)

    def search(
        self, pattern: re.Pattern[bytes], buf: bytes, start: int, end: int
    ) -> re.Match[bytes] | None:
        """``pattern.search(buf, start, end)``, skipping what an earlier search found empty.

        ``start`` never moves back between calls. A newline in the last byte searched is not
        counted as clean: whether it matches depends on the byte after it (both patterns look
        one byte ahead), which a later search may see.
        """
        clean = self.clean_to.get(pattern, 0) - self.base
        found = pattern.search(buf, max(start, clean), end)
        if found is None:
            self.clean_to[pattern] = self.base + max(clean, end - 1)
        return found


def _next_cut(buf: bytes, pos: int, eof: bool, scan: _NewlineScan | None = None) -> int | None:
    """End of the unit that starts at ``pos``, or None when more bytes are needed first.

    The answer never depends on how much of the file is buffered (only on its bytes), so units
    and blocks are the same however the file is read. ``scan``: one per file, passed for every
    unit in order, so that no byte is searched for a newline more than about once.
    """
    n = len(buf)
    if pos >= n:
        return None
    want = pos + TEXT_UNIT_BYTES
    if want >= n:
        return n if eof else None
    limit = pos + TEXT_UNIT_MAX_BYTES
    scan = scan if scan is not None else _NewlineScan()
    m = scan.search(_LINE_START, buf, want, min(n, limit))
    if m is not None:
        return m.end()
    reach_known = limit < n or eof  # all the bytes the rules below look at are buffered
    if reach_known and scan.search(_LINE_BREAK, buf, want, min(n, limit)) is not None:
        # Lines, none starting with a non-blank: the cut of before (at the limit, mid-line).
        if limit < n:
            return _char_boundary(buf, limit, want)
        return n
    # No newline within the limit, or before the end of the file further than a long line's
    # unit: one long line (lines of ordinary text end well before), cut at a whitespace.
    if limit < n or (eof and n - pos > TEXT_UNIT_LONG_LINE_BYTES):
        cap = pos + TEXT_UNIT_LONG_LINE_BYTES
        space = _WHITESPACE.search(buf, want, cap)
        if space is not None:
            return space.start()
        return _char_boundary(buf, cap, want)  # none: mid-word
    return n if eof else None


def _char_boundary(buf: bytes, cut: int, floor: int) -> int:
    """``cut`` moved back (not below ``floor``) to the start of a UTF-8 character, so no
    character is split between two units."""
    while cut > floor and (buf[cut] & 0xC0) == 0x80:
        cut -= 1
    return cut
