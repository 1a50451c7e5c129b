"""The run log (``metrics.jsonl``): one JSON object per line, appended, never rewritten.

This module is the contract between the process that trains (the ``MetricsLog`` callback writes
through :class:`RunLogWriter`) and everything that reads a run afterwards or from another shell
(``nanolab report``, the queue, ``tail``/``jq``). Readers must survive a crash: a process killed
mid-write leaves a half-written last line, so :func:`iter_records` skips any line that does not
parse as a JSON object, and the writer starts every record on a fresh line when the file does not
end with a newline (a process killed mid-write, a write cut short by a full disk or a file-size
limit), so no record, a resumed run's or the same process's next, is glued onto the broken one.

Every record has ``event`` (``start``, ``train``, ``val``, ``budget``, ``checkpoint``, ``end``),
``time`` (unix seconds) and ``step`` (optimizer steps done); docs/callbacks.md documents each event.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import shlex
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from nanolab.claimed import ClaimedDir, LeftClaimedDir
from nanolab.errors import NanolabError, size_limit_met
from nanolab.messages import warn
from nanolab.processes import live_lock_holder

RUN_LOG_NAME = "metrics.jsonl"
QUEUE_LOG_NAME = "queue.log"  # a queued job's console output, beside its run log
CHECKPOINT_DIR = "checkpoints"  # a run's checkpoints, beside its run log

#: First line of the ``config.yaml`` a run writes: it tells the run's own copy (rewritten at
#: each launch) from a config a user keeps in the folder, which a launch must not overwrite.
CONFIG_HEADER = "# nanolab fit: this run's merged config, rewritten at each launch\n"
#: What every run's ``config.yaml`` starts with (the header's wording may change).
CONFIG_MARK = b"# nanolab fit:"

#: The records that say which run a log is: its ``start`` records and, after the log was
#: deleted under a live run, the ``log_recreated`` record its writer starts the new file with.
OWNER_EVENTS = ("start", "log_recreated")

#: The checkpoint names nanolab writes in a run's ``checkpoints/``.
_NANOLAB_CHECKPOINT = re.compile(r"(last|step-\d+)\.ckpt")


def iter_records(
    path: str | os.PathLike[str], event: str | None = None
) -> Iterator[dict[str, Any]]:
    """Yield the records of a run log in order, skipping lines that are not JSON objects.

    ``event`` keeps only records of that kind; only the lines that can hold one are parsed
    (:func:`event_marks`), so looking for a rare kind in a long log costs a read, not a parse.
    A missing file yields nothing.
    """
    for _, record in iter_numbered(path, containing=event_marks(event)):
        if is_event(record, event):
            yield record


def iter_numbered(
    path: str | os.PathLike[str],
    containing: str | tuple[str, ...] | Callable[[str], bool] | None = None,
) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) of each parsable line, one line in memory at a time, so a reader's
    memory does not grow with the log. ``containing`` parses only the lines holding that text
    (or one of those texts): a cheap first look, e.g. for the few ``start`` records of a
    300k-line log. It may also be a test of a line's text, asked as each line is read: a
    reader that wants other lines after some record (the first train record after each start)
    changes its answer between records, and the lines in between are not parsed."""
    if callable(containing):
        wanted = containing
    else:
        needles = (containing,) if isinstance(containing, str) else containing
        wanted = None if needles is None else (lambda line: any(n in line for n in needles))
    handle = _open_log(path, "r")
    if handle is None:
        return
    with handle:
        number = -1
        while line := handle.readline(MAX_RECORD_BYTES + 1):
            number += 1
            if len(line) > MAX_RECORD_BYTES and not line.endswith("\n"):
                # longer than any record (a power loss's zeros): damage, passed over in pieces
                while (rest := handle.readline(1 << 20)) and not rest.endswith("\n"):
                    pass
                continue
            if wanted is not None and not wanted(line):
                continue
            record = _parse(line)
            if record is not None:
                yield number, record


def event_marks(event: str | tuple[str, ...] | None) -> tuple[str, ...] | None:
    """Texts one of which every line holding a record of ``event`` (one of them) contains: the
    event as a JSON string, or a backslash (the only other way to spell it, escaped). A line
    with none of them cannot be such a record, so readers skip it unparsed. None: any event."""
    if event is None:
        return None
    events = (event,) if isinstance(event, str) else event
    return (*(json.dumps(e, ensure_ascii=False) for e in events), "\\")


def is_event(record: dict[str, Any], event: str | tuple[str, ...] | None) -> bool:
    """Whether ``record`` is of kind ``event`` (one of them; None: any)."""
    if event is None:
        return True
    kind = record.get("event")
    return kind == event if isinstance(event, str) else any(kind == e for e in event)


def written_in_training(record: dict[str, Any]) -> bool:
    """Whether a ``val`` or ``tasks`` record is a point of the run's own training curve.

    ``nanolab validate``, ``test`` and ``eval`` append records of their own to a run's log,
    marked ``evaluated_by``: a checkpoint scored afterwards, perhaps on other data, windows or
    suite, and without the ``tokens`` a curve point has. One rule for every reader that draws,
    fits or sums up the curve (report, its forecast and plot, fit's closing lines, ``--ckpt_path
    best``), so none takes such a record for training's latest point at its step."""
    return not record.get("evaluated_by")


def started_from_another_run(start: dict[str, Any]) -> bool:
    """Whether a ``start`` record's launch began a new run from another run's checkpoint (a
    branch, ``run.resume PATH``): its ``branched``; in a log from before the record said so,
    a checkpoint (``resumed_from``) outside its own run directory. Such a run plans its own LR
    schedule and counts its GPU-hours from zero, while its ``tokens`` go on from its parent's."""
    if isinstance(start.get("branched"), bool):
        return start["branched"]
    source, run_dir = start.get("resumed_from"), start.get("run_dir")
    if start.get("resumed_from_step") is None or not isinstance(source, str):
        return False
    if not isinstance(run_dir, str):
        return False
    own = os.path.normpath(os.path.abspath(run_dir))
    return os.path.commonpath([own, os.path.normpath(os.path.abspath(source))]) != own


def read_records(path: str | os.PathLike[str], event: str | None = None) -> list[dict[str, Any]]:
    """All (parsable) records of a run log as a list; see :func:`iter_records`."""
    return list(iter_records(path, event))


#: No record is longer (a ``start`` record with its config is a few kB): a longer line is
#: damage, skipped by :func:`last_record` without holding it in memory.
MAX_RECORD_BYTES = 16 << 20


def last_record(
    path: str | os.PathLike[str],
    event: str | tuple[str, ...] | None = None,
    where: Callable[[dict[str, Any]], bool] | None = None,
    chunk: int = 1 << 16,
) -> dict[str, Any] | None:
    """The last parsable record (of kind ``event``, for which ``where`` is true), read backwards.

    Long runs log hundreds of thousands of lines; resuming and ``nanolab report`` only need the
    tail, so this reads ``chunk`` bytes at a time from the end instead of parsing everything.
    """
    with contextlib.closing(iter_backwards(path, event, where, chunk)) as newest_first:
        return next(newest_first, None)


def iter_backwards(
    path: str | os.PathLike[str],
    event: str | tuple[str, ...] | None = None,
    where: Callable[[dict[str, Any]], bool] | None = None,
    chunk: int = 1 << 16,
    split_cr: bool = False,
) -> Iterator[dict[str, Any]]:
    """The parsable records (of kind ``event``, for which ``where`` is true), newest first.

    Lines end at newlines; ``split_cr`` also ends them at a carriage return, as the text reader
    of :func:`iter_records` does, so that the newest ``n`` records read here are the last ``n``
    it yields. With ``event`` given, only the lines that can hold one are parsed
    (:func:`event_marks`), and a chunk holding none of them is passed over whole: the one
    ``start`` record at the top of a 2M-line log is found at the speed of reading the file.
    """
    handle = _open_log(path, "rb")
    if handle is None:
        return
    marks = event_marks(event)
    needles = (
        tuple(m.encode() for m in marks) if marks and all(m.isascii() for m in marks) else None
    )

    def may_hold(raw: bytes) -> bool:
        return needles is None or any(n in raw for n in needles)

    def wanted(raw: bytes) -> Iterator[dict[str, Any]]:
        if not may_hold(raw):
            return
        for part in reversed(raw.split(b"\r")) if split_cr else (raw,):
            record = _parse(part.decode("utf-8", errors="replace"))
            if record is not None and is_event(record, event) and (where is None or where(record)):
                yield record

    with handle:
        pos = handle.seek(0, os.SEEK_END)
        # The line that crosses ``pos``, in pieces (each chunk read once, joined once: a tail
        # without newlines, such as the zeros a power loss leaves, stays linear), or None
        # once it is longer than any record, when it is skipped rather than held.
        partial: deque[bytes] | None = deque()
        held = 0
        while pos > 0:
            step = min(chunk, pos)
            pos -= step
            handle.seek(pos)
            data = handle.read(step)
            first = data.find(b"\n")
            if first < 0 and pos > 0:  # no line starts in this chunk
                if partial is not None:
                    partial.appendleft(data)
                    held += len(data)
                    if held > MAX_RECORD_BYTES:
                        partial = None
                continue
            last = data.rfind(b"\n") if first >= 0 else -1
            lines = [b"".join([data[last + 1 :], *partial])] if partial is not None else []
            if first >= 0:
                middle = data[first + 1 : last]  # whole lines: none can match without a mark
                if first < last:
                    lines = [*_lines_holding(middle, needles), *lines]
                if pos == 0:  # the file's first line is whole too
                    lines.insert(0, data[:first])
            for raw in reversed(lines):
                yield from wanted(raw)
            partial, held = deque([data[:first]]), first


def _lines_holding(block: bytes, needles: tuple[bytes, ...] | None) -> list[bytes]:
    """The lines of ``block`` (whole lines) that may hold a wanted record, in order: found by
    searching for the marks, not by splitting every line (the lines of a 64 kB chunk of train
    records that hold one ``val``: the rest are never looked at one by one)."""
    if needles is None:
        return block.split(b"\n")
    spans = set()
    for needle in needles:
        at = block.find(needle)
        while at >= 0:
            begin, end = block.rfind(b"\n", 0, at) + 1, block.find(b"\n", at)
            end = len(block) if end < 0 else end
            spans.add((begin, end))
            at = block.find(needle, end)
    return [block[begin:end] for begin, end in sorted(spans)]


class FollowedLog:
    """The records of kind ``event`` (for which ``where`` is true) of one run log, oldest
    first, read forward and kept between reads: each :meth:`records` reads only the bytes
    appended since the one before, so a screen redrawn every few seconds (``nanolab status
    --watch``) costs what the runs wrote meanwhile, not their whole logs, and a finished run's
    log is read once.

    The records are those :func:`iter_backwards` finds (the same lines, marks and ``split_cr``):
    whole lines are kept (cut by ``keep`` to what the reader needs), and the unfinished last
    line is parsed at each read, as :func:`iter_backwards` parses it, until its newline comes.
    A log replaced by another file, or shorter than what was read, is read again from its start.
    """

    #: Bytes read per step.
    CHUNK = 1 << 20

    def __init__(
        self,
        path: str | os.PathLike[str],
        event: str | tuple[str, ...] | None = None,
        where: Callable[[dict[str, Any]], bool] | None = None,
        split_cr: bool = False,
        keep: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> None:
        self.path, self.event, self.where, self.split_cr, self.keep = (
            path, event, where, split_cr, keep,
        )  # fmt: skip
        marks = event_marks(event)
        self.needles = (
            tuple(m.encode() for m in marks) if marks and all(m.isascii() for m in marks) else None
        )
        self._restart(None)

    def _restart(self, identity: tuple[int, int] | None) -> None:
        self.identity = identity  # (device, inode) of the file read
        self.offset = 0  # bytes read and kept: whole lines only
        self.kept: list[dict[str, Any]] = []
        self.skipping = False  # inside a line longer than any record: damage, passed over

    def records(self) -> list[dict[str, Any]]:
        """The log's wanted records now, oldest first (read since the last call: the rest)."""
        handle = _open_log(self.path, "rb")
        if handle is None:
            self._restart(None)
            return []
        pending = b""  # the bytes after the last newline read
        with handle:
            stat = os.fstat(handle.fileno())
            if (stat.st_dev, stat.st_ino) != self.identity or stat.st_size < self.offset:
                self._restart((stat.st_dev, stat.st_ino))
            handle.seek(self.offset)
            while chunk := handle.read(self.CHUNK):
                if self.skipping:
                    cut = chunk.find(b"\n")
                    self.offset += len(chunk) if cut < 0 else cut + 1
                    if cut < 0:
                        continue
                    chunk, self.skipping = chunk[cut + 1 :], False
                block = pending + chunk
                cut = block.rfind(b"\n")
                if cut < 0:
                    pending = block
                    if len(pending) > MAX_RECORD_BYTES:
                        self.offset, pending, self.skipping = self.offset + len(pending), b"", True
                    continue
                for raw in _lines_holding(block[:cut], self.needles):
                    self.kept += [r if self.keep is None else self.keep(r) for r in self._in(raw)]
                self.offset += cut + 1
                pending = block[cut + 1 :]
        unfinished = [] if self.skipping else list(self._in(pending))
        return [*self.kept, *unfinished]

    def _in(self, raw: bytes) -> Iterator[dict[str, Any]]:
        """The wanted records of one line, in order (one per carriage-return part)."""
        if self.needles is not None and not any(n in raw for n in self.needles):
            return
        for part in raw.split(b"\r") if self.split_cr else (raw,):
            record = _parse(part.decode("utf-8", errors="replace"))
            if (
                record is not None
                and is_event(record, self.event)
                and (self.where is None or self.where(record))
            ):
                yield record


class RunLogReadError(NanolabError):
    """A run log that is there but cannot be read (a folder in its place, no permission)."""


def _open_log(path: str | os.PathLike[str], mode: str) -> IO[Any] | None:
    """The log opened for reading; None when there is none (a run that has not started)."""
    try:
        if mode == "rb":
            return open(path, "rb")
        return open(path, encoding="utf-8", errors="replace")
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as err:  # a folder in its place, no permission
        raise RunLogReadError(
            f"run log {path} cannot be read ({err.strerror}); move it out of the way or make "
            "it a readable file"
        ) from None


def names_run(record: dict[str, Any]) -> bool:
    """Whether ``record`` says which run its log belongs to (:data:`OWNER_EVENTS`, naming a
    ``run_id``): the one rule for a log's owner."""
    return record.get("event") in OWNER_EVENTS and bool(record.get("run_id"))


def owner_of_log(log_path: str | os.PathLike[str]) -> str | None:
    """The run id the run log names last: its ``start`` record, or the ``log_recreated`` record
    a run writes when its log was deleted under it (None: no record names one, no log)."""
    with contextlib.closing(iter_backwards(log_path, OWNER_EVENTS, where=names_run)) as newest:
        record = next(newest, None)
    return None if record is None else str(record["run_id"])


def is_nanolab_run(folder: str | os.PathLike[str]) -> bool:
    """Whether ``folder`` is a run nanolab wrote: its log opens with a record naming its run (a
    ``start``, or the ``log_recreated`` a live run starts its log again with when it was
    deleted), a live launch holds it (:func:`_held`), or its ``checkpoints/`` holds a
    checkpoint named as nanolab names them (a run whose log was lost still owns its
    checkpoints). A ``metrics.jsonl`` another tool left in a project folder is not a run, so it
    does not put everything below it "inside a run"; nor is a ``config.yaml`` alone, header and
    all: users copy a run's config out to launch from (``nanolab fit --config``)."""
    folder = Path(folder)
    for _, record in iter_numbered(folder / RUN_LOG_NAME):
        if names_run(record):
            return True
        break  # the record naming the run is a run log's first
    if _held(folder):
        return True
    checkpoints = folder / CHECKPOINT_DIR
    try:
        names = [entry.name for entry in os.scandir(checkpoints)] if checkpoints.is_dir() else []
    except OSError:  # unreadable: no checkpoint of nanolab's seen there
        names = []
    return any(_NANOLAB_CHECKPOINT.fullmatch(name) for name in names)


def _held(folder: Path) -> bool:
    """Whether a launch that may still run holds ``folder`` (its run lock names a holder not
    known to have exited): a live run whose log was deleted, and not yet started again, is
    still a run. A lock a killed run left behind does not make a folder a run."""
    return live_lock_holder(folder) is not None


def run_dir_holding(path: str | os.PathLike[str]) -> Path | None:
    """The nanolab run directory ``path`` is or lies in (a folder up its tree that a live launch
    holds, or holding a run log that :func:`is_nanolab_run` owns), or None. The one rule for
    "inside a run": fit's own run directory (``run.root``/``run.name``) and every other
    command's output go by it.

    Both the path as given and where its links lead are checked: a link to a run's folder is
    that run's folder.
    """
    given = Path(os.path.abspath(path))
    for start in (given, Path(os.path.realpath(given))):
        for folder in (start, *start.parents):
            if _held(folder) or ((folder / RUN_LOG_NAME).is_file() and is_nanolab_run(folder)):
                return folder
    return None


def refuse_inside_run(
    path: str | os.PathLike[str], option: str, error: type[NanolabError] = NanolabError
) -> None:
    """The one rule for every command that writes where the user says (``eval --json``,
    ``report --plot``, ``export -o``, ``prepare -o``, ``init``): never into a run directory.

    A run's files are its own (its lock, its rotation and its resume rely on knowing every file
    there), and one slip of the shell would put, or replace, a file among another run's
    checkpoints. Raises ``error`` naming ``option`` and the run directory.
    """
    run_dir = run_dir_holding(path)
    if run_dir is not None:
        raise error(
            f"{option} {path} is inside the run directory {run_dir}; write it elsewhere (a run's "
            "files are its own)"
        )


def _parse(line: str) -> dict[str, Any] | None:
    line = line.strip()
    if not line:
        return None
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):  # damage: a line of 1,000 "[" is not a record
        return None
    return record if isinstance(record, dict) else None


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null so every reader (jq included) can parse the line."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


#: One encoder for every record: ``json.dumps`` with these options builds a new one per call.
_ENCODER = json.JSONEncoder(default=str, allow_nan=False, separators=(",", ":"))


def dumps(record: dict[str, Any]) -> str:
    """One record as one line of strict JSON (non-finite floats -> null, unknown types -> str)."""
    return _ENCODER.encode(_clean(record))


class RunLogWriteError(NanolabError):
    """The run log cannot be appended to (a full disk, a folder gone); the message names the
    file and the free space, and says what was kept. ``errno`` is the OSError's."""

    errno: int | None = None


class LinkedFileError(NanolabError):
    """A file opened to be appended to that is a link: symbolic, or a hard link (one file under
    two names, e.g. another run's log). ``str(err)`` says which, after the path
    (``"is a link"``)."""


def open_own_file(path: str | os.PathLike[str], flags: int, dir_fd: int | None = None) -> int:
    """``path`` opened with ``flags`` (and ``O_NOFOLLOW``, ``O_CLOEXEC``, mode 0644 when
    created): a file descriptor of a file of its own, never one reached through a symbolic link
    nor one that is also another name, so an append cannot land in another run's files (a
    ``queue.log`` or ``metrics.jsonl`` linked to another run's log). Raises
    :class:`LinkedFileError` for either, with nothing written."""
    flags |= os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o644, dir_fd=dir_fd)
    except OSError as err:
        if err.errno != errno.ELOOP:
            raise
        raise LinkedFileError("is a link") from None
    links = os.fstat(fd).st_nlink
    if links > 1:
        os.close(fd)
        raise LinkedFileError(f"is a hard link ({links} names for one file)")
    return fd


#: What rerunning does once a failed append is fixed, said in the writer's error lines: a fit
#: resumes; an evaluation (``validate``, ``test``, ``eval``) resumes nothing.
RERUN_RESUMES = "rerun the same command to resume"
RERUN_EVALUATES = "rerun the same command to evaluate again and append its record"


class RunLogWriter:
    """Appends records to a run log, one flushed line each.

    The file is opened in append mode and never truncated. Each record is one ``write`` of its
    whole line, unbuffered, so ``tail -1 | jq`` is current; there is no fsync per record (that
    would cost milliseconds per step on network disks). An append always starts on a fresh
    line: when the file may not end with a newline (the previous process died mid-line, or a
    write of this one was cut short by a full disk or a file-size limit), the record is written
    after a newline, so the broken line stays isolated, readers skip it, and the record after
    it is whole. A buffered writer dropped what it had not written of a long record and glued
    the next record (the ``end`` record, a resume's ``start``) onto the torn bytes.

    A log deleted or replaced while it is written (``rm metrics.jsonl`` during a run) would
    otherwise take every later record into an unlinked file that vanishes at the end: each
    write checks that the path is still the open file (one ``stat``) and, if not, starts the
    file again at the path with a ``log_recreated`` record (naming ``run_id``, so the folder
    still says whose it is) and says so on stderr.

    The folder is claimed when the writer opens (:class:`~nanolab.claimed.ClaimedDir`) and the
    file is opened through it, never through a link: a link to another run's log put in place
    of this one, or this run's folder moved or replaced by a link, stops the run with one line
    (:class:`~nanolab.claimed.LeftClaimedDir`) instead of appending this run's records there.

    ``rerun``: what the error lines say a rerun does once the problem is fixed
    (:data:`RERUN_RESUMES` for a fit, :data:`RERUN_EVALUATES` for an evaluation's record).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        run_id: str | None = None,
        rerun: str = RERUN_RESUMES,
    ) -> None:
        self.path = Path(path)
        self.run_id = run_id
        self.rerun = rerun
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._folder = ClaimedDir(self.path.parent)
        self._refused: LeftClaimedDir | None = None
        #: Whether the file may not end with a newline: a file this writer has not written to
        #: yet, or a write of its own that failed part-way (see :meth:`_append`).
        self._torn = True
        self._handle: IO[bytes] | None = self._open()

    def _open(self) -> IO[str]:
        """The log opened for appending through the claimed folder; never a link, never a file
        that is also another name (a hard link to another run's log)."""
        assert self._folder.fd is not None
        flags = os.O_RDWR | os.O_APPEND | os.O_CREAT
        try:
            fd = open_own_file(self.path.name, flags, dir_fd=self._folder.fd)
        except LinkedFileError as err:
            raise self._refuse(f"{self.path} {err}") from None
        st = os.fstat(fd)
        self._inode = (st.st_ino, st.st_dev)
        return open(fd, "ab", buffering=0)

    def _refuse(self, why: str) -> LeftClaimedDir:
        """The error that stops the run: ``why`` names what is at the log's path now. The fix
        it gives keeps the run's history: removing the link would leave the run directory
        without its log (a resume then starts a new one), a copy of its own keeps every line."""
        log, copy = shlex.quote(str(self.path)), shlex.quote(f"{self.path}.tmp")
        self._refused = LeftClaimedDir(
            f"{why}; this run appends only to its own log, never through a link, so it stopped "
            "without writing there (the other file is untouched). Give the run a copy of its "
            f"own (cp {log} {copy} && mv {copy} {log}) and {self.rerun}"
        )
        return self._refused

    def _still_there(self) -> bool:
        try:
            return os.stat(self.path)[1:3] == self._inode
        except OSError:
            return False

    def write(self, record: dict[str, Any]) -> None:
        if self._refused is not None:
            raise self._refused
        if self._handle is None:
            raise ValueError(f"run log {self.path} is closed")
        try:
            if not self._still_there():
                self._recreate(record)
            self._append(dumps(record))
        except LeftClaimedDir as err:  # every later record (the end record too) is refused
            self._refused = err
            raise
        except OSError as err:
            raise self._write_error(err) from None

    def _recreate(self, record: dict[str, Any]) -> None:
        import time

        assert self._handle is not None
        with contextlib.suppress(OSError):
            self._handle.close()
        self._handle = None
        self._folder.check(f"the run log {self.path.name}")
        self._handle = self._open()
        note = (
            f"{self.path} was deleted or replaced while this run wrote it; started it again "
            "here (the records before this point are in the removed file)"
        )
        warn("nanolab", note)
        self._torn = True
        self._append(dumps({"event": "log_recreated", "time": time.time(),
                            "step": record.get("step"), "run_id": self.run_id,
                            "detail": note}))  # fmt: skip

    def _append(self, line: str) -> None:
        """Write ``line`` and its newline at the end of the file, on a line of its own.

        One unbuffered ``write`` of the whole line (looped if the system writes it in parts),
        so nothing of it waits in a buffer to land later, after another record. Until it has
        all landed the file may end mid-line (:attr:`_torn`): the next append then starts
        with a newline, when the file does not end with one.
        """
        assert self._handle is not None
        data = line.encode("utf-8") + b"\n"
        if self._torn and not self._ends_line():
            data = b"\n" + data
        self._torn = True
        view = memoryview(data)
        while view:
            view = view[self._handle.write(view) or 0 :]
        self._torn = False

    def _ends_line(self) -> bool:
        """Whether the file is empty or ends with a newline (a new record starts a line)."""
        assert self._handle is not None
        fd = self._handle.fileno()
        size = os.fstat(fd).st_size
        return size == 0 or os.pread(fd, 1, size - 1) == b"\n"

    def _write_error(self, err: OSError) -> RunLogWriteError:
        import shutil

        if err.errno == errno.EFBIG:  # a size limit: free space would not help
            limit, fix = size_limit_met()
            error = RunLogWriteError(
                f"cannot append to the run log {self.path} ({err.strerror or err}: {limit}); "
                f"the lines written so far and the checkpoints are intact: {fix}, then "
                f"{self.rerun}"
            )
            error.errno = err.errno
            return error
        try:
            free = f"{shutil.disk_usage(self.path.parent).free / 1e6:.0f} MB free there"
        except OSError:
            free = "its folder is gone"
        error = RunLogWriteError(
            f"cannot append to the run log {self.path} ({err.strerror or err}; {free}); the "
            "lines written so far and the checkpoints are intact: free space (or restore the "
            f"folder) and {self.rerun}"
        )
        error.errno = err.errno  # a full disk has an exit code of its own
        return error

    def close(self) -> None:
        if self._handle is not None:
            with contextlib.suppress(OSError):
                os.fsync(self._handle.fileno())
            with contextlib.suppress(OSError):
                self._handle.close()
            self._handle = None
        self._folder.close()

    @property
    def closed(self) -> bool:
        return self._handle is None
