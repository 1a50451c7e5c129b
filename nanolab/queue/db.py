"""The queue database: jobs, runners and runner events in one SQLite file (stdlib ``sqlite3``).

Why SQLite and not a JSON file: several processes touch the queue at once (a runner claiming
and finishing jobs, shells adding and removing them), and a machine can die mid-write. WAL mode
lets readers and one writer proceed together; every change is one transaction (``BEGIN
IMMEDIATE`` takes the write lock up front, so a read-then-update such as claiming a job cannot
interleave with another writer); ``synchronous=FULL`` makes a committed change survive a power
cut. Connections wait up to 30 s for the lock instead of failing, in short waits retried in
Python (:class:`PatientConnection`), so a Ctrl-C or a runner's signal is heard within a fraction
of a second; a lock held longer is said as it is (:func:`busy_db`: the queue is healthy, retry),
and a runner keeps waiting (:attr:`QueueDB.patience`).

A job's life: ``pending`` -> ``running`` -> ``done`` | ``stopped`` (budget/plateau, with the
reason) | ``failed`` (with the error) | ``preempted`` (interrupted; resumes from its checkpoint
when claimed again). A runner records its pid, host, PID namespace, process start and a
heartbeat; a ``running`` job whose runner is gone (:func:`runner_alive`) is recovered by the next
runner (see :mod:`nanolab.queue.runner`).

Schema version 2 added the columns of packing and backfill (:data:`V2_COLUMNS`); a version-1
queue is upgraded in place when opened (``ALTER TABLE ... ADD COLUMN``, in one transaction), so
its jobs keep their history. The runner columns of :data:`RUNNER_COLUMNS` (and the jobs' of
:data:`LOG_COLUMNS`) are added the same way to a queue written before them, without a new
version: they may be NULL (a runner started before them is judged as it was then), and a
nanolab that does not know them ignores them.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import shutil
import socket
import sqlite3
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any
from urllib.parse import quote

from nanolab.errors import NanolabError, with_errno_of
from nanolab.processes import (
    pid_alive,
    pid_namespace,
    process_start,
    process_state,
    same_process,
)

DEFAULT_DB = "nanolab_queue.db"
SCHEMA_VERSION = 2

STATUSES = ("pending", "running", "done", "stopped", "failed", "preempted")
#: Statuses a runner may start: new jobs, and interrupted ones (which resume).
CLAIMABLE = ("pending", "preempted")
#: Statuses with time still to run: the jobs ``queue ls`` and ``status`` say a time left for.
UNFINISHED = (*CLAIMABLE, "running")
#: Statuses ``queue clear`` removes by default: nothing left to do.
FINISHED = ("done", "stopped", "failed")

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runners (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    pid INTEGER NOT NULL,
    host TEXT NOT NULL,
    started REAL NOT NULL,
    heartbeat REAL NOT NULL,
    stopped REAL,
    pid_namespace TEXT,
    pid_start TEXT
);
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL UNIQUE,
    config TEXT NOT NULL,
    args TEXT NOT NULL,
    seed INTEGER,
    cwd TEXT NOT NULL,
    run_dir TEXT NOT NULL,
    config_key TEXT,
    devices INTEGER NOT NULL DEFAULT 1,
    max_steps INTEGER,
    estimate_s REAL,
    estimate_source TEXT,
    status TEXT NOT NULL DEFAULT 'pending',
    detail TEXT,
    attempts INTEGER NOT NULL DEFAULT 0,
    exit_code INTEGER,
    created REAL NOT NULL,
    started REAL,
    last_started REAL,
    ended REAL,
    run_seconds REAL NOT NULL DEFAULT 0,
    runner_id INTEGER,
    job_pid INTEGER,
    gpus TEXT,
    log TEXT,
    backfill INTEGER NOT NULL DEFAULT 0,
    alone INTEGER NOT NULL DEFAULT 0,
    mem_peak INTEGER,
    mem_source TEXT,
    mem_cap INTEGER,
    packed_on TEXT
);
CREATE INDEX IF NOT EXISTS jobs_status ON jobs(status);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    time REAL NOT NULL,
    runner_id INTEGER,
    job_id INTEGER,
    kind TEXT NOT NULL,
    value REAL,
    detail TEXT
);
"""


#: Columns schema version 2 added to ``jobs``, with the definitions that upgrade a version-1
#: queue: ``backfill`` (1: low priority, runs only on idle devices and is preempted for other
#: jobs), ``alone`` (1: must not share a device; set after an out-of-memory error while packed),
#: ``mem_peak``/``mem_source`` (predicted peak allocated bytes on its device, and how it was
#: predicted or why not), ``mem_cap`` (the allocator cap in bytes of its current/last packed
#: attempt; NULL when it ran alone) and ``packed_on`` (the device it shared, e.g. ``GPU 0``).
V2_COLUMNS = {
    "config_sha": "TEXT",  # the config files' digest at ``queue add`` (NULL: added before it)
    "backfill": "INTEGER NOT NULL DEFAULT 0",
    "alone": "INTEGER NOT NULL DEFAULT 0",
    "mem_peak": "INTEGER",
    "mem_source": "TEXT",
    "mem_cap": "INTEGER",
    "packed_on": "TEXT",
}


#: Columns of ``runners`` added after schema version 2, added to a queue that lacks them when it
#: is opened: ``pid_namespace`` (:func:`nanolab.processes.pid_namespace`: a pid compares only
#: within one) and ``pid_start`` (:func:`nanolab.processes.process_start`: a reused pid is
#: another process). NULL in rows of runners started before them.
RUNNER_COLUMNS = {"pid_namespace": "TEXT", "pid_start": "TEXT"}

#: Columns of ``jobs`` added after schema version 2, the same way (NULL in rows written before
#: them; a nanolab that does not know them ignores them), so that ``queue ls`` reads what it
#: needs of a job's run log in a few lines, however long the log: ``log_start`` (the run log's
#: size when the job's newest attempt was started: that launch's records begin there),
#: ``log_end`` (its size when that attempt ended: nothing was appended since while it still
#: is) and ``steady_s`` (a done job's steady seconds a step, that of its newest launch read
#: from its log's end, :func:`nanolab.queue.predict.ended_step_seconds`, measured once as it
#: ended; 0: none could be).
LOG_COLUMNS = {"log_start": "INTEGER", "log_end": "INTEGER", "steady_s": "REAL"}


class QueueError(NanolabError):
    """A queue operation that cannot be done; the message says which job and what to do."""


class ReadOnlyDBError(QueueError):
    """The queue database cannot be written (a read-only file, folder or file system); it can
    still be read (``queue ls`` falls back to :meth:`QueueDB.read_only`)."""


class DamagedJobError(QueueError):
    """A job row that cannot be read back (edited by hand); ``queue rm ID`` still removes it."""

    def __init__(self, job_id: Any, message: str) -> None:
        super().__init__(message)
        self.job_id = job_id


@dataclass
class Job:
    """One row of ``jobs`` (see the schema for the meaning of each column)."""

    id: int
    name: str
    config: str
    args: list[str]
    seed: int | None
    cwd: str
    run_dir: str
    config_key: str | None
    devices: int
    max_steps: int | None
    estimate_s: float | None
    estimate_source: str | None
    status: str
    detail: str | None
    attempts: int
    exit_code: int | None
    created: float
    started: float | None
    last_started: float | None
    ended: float | None
    run_seconds: float
    runner_id: int | None
    job_pid: int | None
    gpus: str | None
    log: str | None
    backfill: int = 0
    alone: int = 0
    mem_peak: int | None = None
    mem_source: str | None = None
    mem_cap: int | None = None
    packed_on: str | None = None
    config_sha: str | None = None
    log_start: int | None = None
    log_end: int | None = None
    steady_s: float | None = None

    @property
    def run_path(self) -> Path:
        """The job's run directory as its process sees it: ``run_dir`` from the job's own
        ``cwd`` (``queue add`` stores it absolute; a queue written before holds it relative to
        where the job was added, not to where a runner or a listing is started)."""
        return Path(self.cwd) / self.run_dir

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> Job:
        data = dict(row)
        try:
            args = json.loads(data["args"])
        except (TypeError, ValueError):
            args = None
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise DamagedJobError(
                data.get("id"),
                f"job {data.get('id')} ({data.get('name')}) has arguments that are not a JSON "
                f"list of strings ({str(data['args'])[:60]!r}): the queue database was edited "
                f"by hand; `nanolab queue rm {data.get('id')}` and add the job again",
            )
        data["args"] = args
        # A column a queue written before it lacks (read read-only: not added) is its default.
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


@dataclass
class NewJob:
    """What ``queue add`` inserts (validated beforehand by :mod:`nanolab.queue.jobs`)."""

    name: str
    config: str
    args: list[str]
    seed: int | None
    cwd: str
    run_dir: str
    config_key: str | None = None
    devices: int = 1
    max_steps: int | None = None
    estimate_s: float | None = None
    estimate_source: str | None = None
    backfill: bool = False
    mem_peak: int | None = None
    mem_source: str | None = None
    config_sha: str | None = None


#: Seconds a write waits for another process's write lock before it fails as busy.
BUSY_TIMEOUT_S = 30.0
#: Seconds SQLite itself waits for a lock before Python tries again: a signal (Ctrl-C) is
#: handled only between SQLite calls, so this bounds how late it is heard.
BUSY_SLICE_S = 0.2


class PatientConnection(sqlite3.Connection):
    """A connection whose statements wait for another process's lock up to :attr:`lock_wait_s`
    in all, in waits of :data:`BUSY_SLICE_S` retried here (SQLite's own ``busy_timeout`` is one
    uninterruptible C call: a Ctrl-C during a 30 s wait was heard only when it ended)."""

    lock_wait_s: float = BUSY_TIMEOUT_S
    #: Called between the tries (a runner notes its jobs' exits meanwhile).
    between_tries: Callable[[], None] | None = None

    def execute(self, sql: str, parameters: Any = (), /) -> sqlite3.Cursor:
        began = time.monotonic()
        while True:
            try:
                return super().execute(sql, parameters)
            except sqlite3.OperationalError as err:
                if not is_busy(err) or time.monotonic() - began >= self.lock_wait_s:
                    raise
            if self.between_tries is not None:
                self.between_tries()


def connect(
    target: str | os.PathLike[str], lock_wait_s: float, uri: bool = False
) -> PatientConnection:
    """A :class:`PatientConnection` to ``target`` (autocommit: every write opens its own
    transaction) that waits up to ``lock_wait_s`` for a lock."""
    conn = sqlite3.connect(
        target,
        uri=uri,
        timeout=min(BUSY_SLICE_S, lock_wait_s),
        isolation_level=None,
        factory=PatientConnection,
    )
    assert isinstance(conn, PatientConnection)
    conn.lock_wait_s = lock_wait_s
    return conn


def default_db_path() -> Path:
    return Path(os.environ.get("NANOLAB_QUEUE_DB", DEFAULT_DB))


def _read_only_connection(path: Path, immutable: bool) -> PatientConnection:
    """A connection that reads ``path`` (SQLite ``mode=ro``); ``immutable``: as a file no
    process changes (no lock taken, no -wal/-shm read or made)."""
    uri = "file:" + quote(str(path.resolve())) + "?mode=ro" + ("&immutable=1" if immutable else "")
    conn = connect(uri, 5.0, uri=True)
    conn.row_factory = sqlite3.Row
    try:
        # What a writing verb refuses, in its words; SQLite's quick_check is the writers' (a
        # reader that meets damage fails on the page it reads, and says so in one line).
        check_queue_db(conn, path, verify=False)
        if not _tables(conn):  # 0 bytes: SQLite's new file (a touch, a first create cut short)
            conn.close()
            return _empty_queue()
        conn.execute("SELECT 1 FROM jobs LIMIT 1").fetchall()
    except BaseException:
        conn.close()
        raise
    return conn


def _tables(conn: sqlite3.Connection) -> set[str]:
    """The tables of the database ``conn`` reads (SQLite's own bookkeeping left out)."""
    rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
    return {r[0] for r in rows} - {"sqlite_sequence"}


def _empty_queue() -> PatientConnection:
    """An empty queue in memory: what a reader sees in a database file without tables (a
    zero-byte file, as SQLite makes a new database), which the first writing verb fills with
    the schema. The file itself is not written: a reader never writes."""
    conn = connect(":memory:", 5.0)
    conn.row_factory = sqlite3.Row
    for statement in SCHEMA.split(";"):
        if statement.strip():
            conn.execute(statement)
    conn.execute(
        "INSERT INTO meta(key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
    )
    upgrade_schema(conn)
    return conn


def _empty(path: Path) -> bool:
    """Whether ``path`` is there and holds nothing (an empty -wal: no change in it)."""
    try:
        return path.stat().st_size == 0
    except OSError:
        return False


#: SQLite's lock bytes in a database file (its unix VFS, ``sqlite3PendingByte``): the pending
#: byte, then the reserved byte, then the range every connection holds a shared lock in
#: while it has the database open in WAL mode.
_PENDING_BYTE = 0x40000000
_SHARED_FIRST, _SHARED_SIZE = _PENDING_BYTE + 2, 510

#: The queue databases this process has open (a lock it holds does not keep itself out).
_OPEN_HERE: weakref.WeakSet[QueueDB] = weakref.WeakSet()


def drop_unused_journal(path: Path) -> bool:
    """Remove an empty ``-wal`` and its ``-shm`` beside ``path`` that no connection uses, as
    SQLite's last connection does when it closes: a write that failed as it opened (a
    file-size limit met by the ``-shm``) left them, and a reader under such a limit could not
    rebuild the index of that journal. Nothing is removed while any process has the database
    open (it holds a shared lock on its lock bytes: taking them all fails) or the -wal holds
    a change. True when they were removed."""
    import fcntl

    wal, shm = (path.with_name(path.name + suffix) for suffix in ("-wal", "-shm"))
    if not (wal.exists() or shm.exists()) or (wal.exists() and not _empty(wal)):
        return False
    resolved = path.resolve()
    if any(db.path.resolve() == resolved for db in list(_OPEN_HERE)):
        return False
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        for start, length in ((_PENDING_BYTE, 1), (_SHARED_FIRST, _SHARED_SIZE)):
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, length, start)
        if wal.exists() and not _empty(wal):  # written before the locks were taken
            return False
        for leftover in (wal, shm):
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()
        return True
    except OSError:  # held by a connection: in use
        return False
    finally:
        os.close(fd)  # releases the locks


class QueueDB:
    """A connection to the queue database; creates the schema on first use."""

    @classmethod
    def read_only(cls, path: str | os.PathLike[str]) -> QueueDB:
        """A connection that only reads (SQLite ``mode=ro``): it changes no journal mode and
        never holds a write lock, so the runner is never blocked.

        A plain read-only reader of a WAL database creates ``-shm``/``-wal`` beside it and cannot
        remove them; with no ``-wal`` there, no process has the database open, so it is read as
        ``immutable`` and nothing is left behind."""
        db = cls.__new__(cls)
        db.path = Path(path)
        wal = db.path.with_name(db.path.name + "-wal")
        in_use = wal.exists()
        try:
            try:
                db.conn = _read_only_connection(db.path, immutable=not in_use)
            except sqlite3.Error as err:
                # An empty -wal holds no change: the database file is the whole queue. Its
                # index (-shm) is rebuilt by the first reader, a write a file-size limit
                # refuses (a writing verb that failed under `ulimit -f` left them): the file
                # is read alone then, as when there is no -wal.
                if not (_empty(wal) and no_room(db.path, err)):
                    raise
                db.conn = _read_only_connection(db.path, immutable=True)
        except sqlite3.Error as err:
            if not _empty(db.path) and not _starts_like_sqlite(db.path):  # empty: no queue yet
                raise QueueError(not_sqlite(db.path)) from None
            said = busy_db(db.path, err, 5.0) or read_only_db(db.path, err, reading=True)
            if said is None and (room := no_room(db.path, err)) is not None:
                raise with_errno_of(QueueError(room), errno.ENOSPC) from None
            raise QueueError(said or unusable_db(db.path, f"cannot be read ({err})")) from None
        _OPEN_HERE.add(db)
        return db

    @staticmethod
    def check_path(path: Path) -> None:
        """Refuse a path no database can be opened at (its folder missing, a folder in its
        place) before anything is created: ``queue add`` checks it before building its jobs,
        and creates the database only once they are all accepted."""
        if path.parent and not path.parent.exists():
            raise QueueError(
                f"the queue database folder {path.parent} does not exist; "
                "create it or pass --db PATH"
            )
        if path.exists() and not path.is_file():
            what = "a folder" if path.is_dir() else "not a regular file"
            hint = path / DEFAULT_DB if path.is_dir() else DEFAULT_DB
            raise QueueError(
                f"the queue database {path} is {what}; pass --db with a file path, e.g. --db {hint}"
            )

    def __init__(self, path: str | os.PathLike[str] | None = None, reading: bool = False) -> None:
        """``reading``: for a verb that only reads (``queue ls``). It writes nothing into a
        queue already set up (WAL mode, this nanolab's schema) and so skips SQLite's
        ``quick_check`` of the whole file (milliseconds per MiB, at every call); where the
        setup would write, it verifies first, as the verbs that write always do."""
        self.path = Path(path) if path is not None else default_db_path()
        self.check_path(self.path)
        # isolation_level=None: no implicit transactions; every write below opens its own.
        #: Called, where set, when a write met the lock held by another process for longer than
        #: the busy timeout: with the number of tries that failed so far (1, 2, ...) before each
        #: retry, and with 0 once a write got through after such tries. Unset: the write fails.
        self.patience: Callable[[int], None] | None = None
        try:
            self.conn = connect(self.path, BUSY_TIMEOUT_S)
        except sqlite3.Error as err:
            if (line := read_only_db(self.path, err)) is not None:
                raise ReadOnlyDBError(line) from None
            raise QueueError(unusable_db(self.path, f"cannot be opened ({err})")) from None
        self.conn.row_factory = sqlite3.Row
        try:
            # Read-only checks first: nothing below may write into a file that is not ours
            # (even switching it to WAL mode rewrites its header).
            # A reader verifies only where this open is going to write (a queue in another
            # journal mode, or of an older schema): damage is found before any page changes.
            setup = _setup_needed(self.conn)
            check_queue_db(self.conn, self.path, verify=not reading or setup)
            if reading and not setup:
                _OPEN_HERE.add(self)
                return
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=FULL")
            with self.transaction():
                for statement in SCHEMA.split(";"):
                    if statement.strip():
                        self.conn.execute(statement)
                self.conn.execute(
                    "INSERT OR IGNORE INTO meta(key, value) VALUES ('schema_version', ?)",
                    (str(SCHEMA_VERSION),),
                )
                upgrade_schema(self.conn)
        except sqlite3.DatabaseError as err:
            self.conn.close()
            if not _starts_like_sqlite(self.path):  # a config or a log given as --db: not ours
                raise QueueError(not_sqlite(self.path)) from None
            if (line := busy_db(self.path, err)) is not None:
                raise QueueError(line) from None
            if (line := read_only_db(self.path, err)) is not None:
                raise ReadOnlyDBError(line) from None
            room = no_room(self.path, err)
            if room is not None:  # exit 74, as every full disk
                drop_unused_journal(self.path)  # the queue as it was: no -wal/-shm of ours left
                raise with_errno_of(QueueError(room), errno.ENOSPC) from None
            raise QueueError(unusable_db(self.path, f"is damaged or not SQLite ({err})")) from None
        except BaseException:
            self.conn.close()
            raise
        _OPEN_HERE.add(self)

    def close(self) -> None:
        _OPEN_HERE.discard(self)
        self.conn.close()

    def wait_for_lock(self, seconds: float) -> None:
        """How long one write waits for another process's write lock before it is busy."""
        self.conn.lock_wait_s = seconds

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """``BEGIN IMMEDIATE`` ... ``COMMIT`` (``ROLLBACK`` on any error). The write lock is
        taken up front, so a busy queue fails (or, with :attr:`patience`, waits) here only."""
        tries = 0
        while True:
            try:
                self.conn.execute("BEGIN IMMEDIATE")
                break
            except sqlite3.OperationalError as err:
                if self.patience is None or not is_busy(err):
                    raise
                tries += 1
                self.patience(tries)
        if tries and self.patience is not None:
            self.patience(0)
        try:
            yield self.conn
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    # -- jobs ------------------------------------------------------------------------------
    def add_jobs(self, jobs: list[NewJob]) -> list[Job]:
        """Insert all of ``jobs`` or none (a duplicate name aborts the whole add)."""
        now = time.time()
        ids = []
        with self.transaction() as c:
            for j in jobs:
                existing = c.execute(
                    "SELECT id, status FROM jobs WHERE name = ?", (j.name,)
                ).fetchone()
                if existing is not None:
                    raise QueueError(
                        f"a job named {j.name!r} is already queued (id {existing['id']}, "
                        f"{existing['status']}); its run directory is {j.run_dir}; pass another "
                        "--name, or `nanolab queue rm` it first"
                    )
                row = {**vars(j), "args": json.dumps(j.args), "backfill": int(j.backfill)}
                cur = c.execute(
                    f"INSERT INTO jobs({', '.join(row)}, created) VALUES ({'?, ' * len(row)}?)",
                    (*row.values(), now),
                )
                ids.append(cur.lastrowid)
        return [self.get(i) for i in ids]

    def get(self, job_id: int) -> Job:
        row = self.conn.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise QueueError(f"no job with id {job_id}")
        return Job.from_row(row)

    def jobs(self, statuses: tuple[str, ...] | list[str] | None = None) -> list[Job]:
        where = f"WHERE status IN ({','.join('?' * len(statuses))}) " if statuses else ""
        rows = self.conn.execute(f"SELECT * FROM jobs {where}ORDER BY id", tuple(statuses or ()))
        return [Job.from_row(r) for r in rows]

    def resolve(self, refs: list[str]) -> list[Job]:
        """Jobs named by id, name or ``#id``; every unknown reference is named in one error."""
        all_jobs = self.jobs()
        by_id = {str(j.id): j for j in all_jobs}
        by_name = {j.name: j for j in all_jobs}
        found, unknown = [], []
        for ref in refs:
            if ref.startswith("#") and ref[1:].isdigit():  # an id, whatever the names
                job = by_id.get(ref[1:])
                (found if job else unknown).append(job or ref)
                continue
            numbered, named = by_id.get(ref), by_name.get(ref)
            if numbered and named and numbered.id != named.id:  # a job named "1"
                raise QueueError(
                    f"{ref!r} is both the id of job {numbered.id} ({numbered.name}) and the name "
                    f"of job {named.id}; give #{numbered.id} or #{named.id} (an id, whatever the "
                    "names)"
                )
            job = numbered or named
            (found if job else unknown).append(job or ref)
        if unknown:
            have = ", ".join(f"{j.id}:{j.name}" for j in all_jobs[:10]) or "none"
            raise QueueError(
                f"no job {', '.join(map(repr, unknown))} in {self.path} (jobs: {have}"
                f"{' ...' if len(all_jobs) > 10 else ''})"
            )
        return found

    def remove(self, job_ids: list[int]) -> int:
        with self.transaction() as c:
            return sum(c.execute("DELETE FROM jobs WHERE id = ?", (i,)).rowcount for i in job_ids)

    def set_status(
        self,
        job_id: int,
        status: str,
        *,
        expect: tuple[str, ...] | None = None,
        **columns: Any,
    ) -> bool:
        """Set a job's status (and other columns); with ``expect``, only from those statuses."""
        assert status in STATUSES
        sets = ", ".join(["status = ?", *(f"{k} = ?" for k in columns)])
        params: list[Any] = [status, *columns.values(), job_id]
        where = "id = ?"
        if expect:
            where += f" AND status IN ({','.join('?' * len(expect))})"
            params += list(expect)
        with self.transaction() as c:
            return c.execute(f"UPDATE jobs SET {sets} WHERE {where}", params).rowcount == 1

    def claim(
        self,
        job_id: int,
        runner_id: int,
        gpus: str | None,
        now: float,
        packed_on: str | None = None,
        mem_cap: int | None = None,
    ) -> bool:
        """Atomically move a claimable job to ``running`` for this runner (False: taken already).

        ``packed_on``/``mem_cap``: the device this attempt shares with other jobs and its
        allocator cap in bytes (both None when it runs alone)."""
        with self.transaction() as c:
            cur = c.execute(
                "UPDATE jobs SET status = 'running', runner_id = ?, gpus = ?, "
                "attempts = attempts + 1, last_started = ?, started = COALESCE(started, ?), "
                "ended = NULL, exit_code = NULL, detail = NULL, job_pid = NULL, packed_on = ?, "
                f"mem_cap = ? WHERE id = ? AND status IN ({','.join('?' * len(CLAIMABLE))})",
                (runner_id, gpus, now, now, packed_on, mem_cap, job_id, *CLAIMABLE),
            )
            return cur.rowcount == 1

    def unclaim(self, job: Job, runner_id: int, detail: str) -> bool:
        """Undo :meth:`claim` of ``job`` (the row as read before the claim): its process could not
        be started for a cause that is not the job's own (the machine's process table full, no
        memory to fork), so it waits again as it was, its attempt not counted; ``detail`` says
        why. Only while the row is still this runner's claim with no process recorded."""
        with self.transaction() as c:
            cur = c.execute(
                "UPDATE jobs SET status = ?, runner_id = ?, gpus = ?, attempts = ?, "
                "last_started = ?, started = ?, ended = ?, exit_code = ?, detail = ?, "
                "packed_on = ?, mem_cap = ? WHERE id = ? AND status = 'running' "
                "AND runner_id = ? AND attempts = ? AND job_pid IS NULL",
                (job.status, job.runner_id, job.gpus, job.attempts, job.last_started,
                 job.started, job.ended, job.exit_code, detail, job.packed_on, job.mem_cap,
                 job.id, runner_id, job.attempts + 1),
            )  # fmt: skip
            return cur.rowcount == 1

    def adopt_orphan(self, job: Job, runner_id: int, detail: str) -> bool:
        """Make ``runner_id`` the runner of a ``running`` job whose runner is gone while it stops
        the job's leftover process, only if the row is still the attempt ``job`` shows: one
        runner takes the orphan over (another sees a live runner and leaves it alone, so the
        process is asked to stop once: a second SIGTERM ends a run without its checkpoint), and
        a runner that dies meanwhile leaves it to the next."""
        with self.transaction() as c:
            cur = c.execute(
                "UPDATE jobs SET runner_id = ?, detail = ? "
                "WHERE id = ? AND status = 'running' AND runner_id IS ? AND attempts = ?",
                (runner_id, detail, job.id, job.runner_id, job.attempts),
            )
            return cur.rowcount == 1

    def recover_as_seen(self, job: Job, detail: str) -> bool:
        """Mark a ``running`` job whose runner is gone ``preempted`` (claimable again), only if
        its row is still the attempt ``job`` shows (same runner, same attempt count): a row read
        before another runner recovered the job and started it again is that runner's live
        attempt, and setting it claimable would start the job twice at once."""
        with self.transaction() as c:
            cur = c.execute(
                "UPDATE jobs SET status = 'preempted', detail = ?, job_pid = NULL, ended = ? "
                "WHERE id = ? AND status = 'running' AND runner_id IS ? AND attempts = ?",
                (detail, time.time(), job.id, job.runner_id, job.attempts),
            )
            return cur.rowcount == 1

    def set_args(self, job_id: int, runner_id: int, args: list[str]) -> bool:
        """Write the fit arguments of a job this runner has claimed in the form they run in
        (options written whole, as ``queue add`` now checks them); False when it is not its."""
        with self.transaction() as c:
            sql = "UPDATE jobs SET args = ? WHERE id = ? AND runner_id = ? AND status = 'running'"
            return c.execute(sql, (json.dumps(args), job_id, runner_id)).rowcount == 1

    def set_job_pid(self, job_id: int, pid: int, log: str, log_start: int | None = None) -> bool:
        """Record a started job's process (``log_start``: its run log's size before it started);
        False when its row is gone (``queue rm`` deleted it before the pid was there to signal:
        the runner then stops the process itself)."""
        with self.transaction() as c:
            sql = "UPDATE jobs SET job_pid = ?, log = ?, log_start = ?, log_end = NULL WHERE id = ?"
            return c.execute(sql, (pid, log, log_start, job_id)).rowcount == 1

    def remove_as_seen(self, job_id: int, job_pid: int | None) -> bool:
        """Delete a job's row only if its pid is still ``job_pid`` (what the caller saw, and
        signalled or not); False when a runner recorded a pid meanwhile (read it again)."""
        with self.transaction() as c:
            sql = "DELETE FROM jobs WHERE id = ? AND job_pid IS ?"
            return c.execute(sql, (job_id, job_pid)).rowcount == 1

    def finish(
        self,
        job_id: int,
        runner_id: int,
        status: str,
        detail: str | None,
        exit_code: int | None,
        ran_s: float,
        **columns: Any,
    ) -> bool:
        """Record a job's outcome, if this runner still owns it (it may have been removed);
        ``ran_s`` (the attempt's process wall time, start-up included, start to exit) is added
        to ``run_seconds``; ``columns`` are set in the same transaction (e.g. ``alone=1``)."""
        assert status in STATUSES
        extra = "".join(f", {k} = ?" for k in columns)
        with self.transaction() as c:
            cur = c.execute(
                "UPDATE jobs SET status = ?, detail = ?, exit_code = ?, ended = ?, job_pid = NULL, "
                f"run_seconds = run_seconds + ?{extra} WHERE id = ? AND runner_id = ? "
                "AND status = 'running'",
                (status, detail, exit_code, time.time(), ran_s, *columns.values(), job_id,
                 runner_id),
            )  # fmt: skip
            return cur.rowcount == 1

    # -- runners ---------------------------------------------------------------------------
    def register_runner(self) -> int:
        """A row for this process as a runner: what :func:`runner_alive` judges it by."""
        now = time.time()
        pid = os.getpid()
        with self.transaction() as c:
            cur = c.execute(
                "INSERT INTO runners(pid, host, started, heartbeat, pid_namespace, pid_start) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (pid, socket.gethostname(), now, now, pid_namespace(), process_start(pid)),
            )
            return int(cur.lastrowid)

    def heartbeat(self, runner_id: int) -> None:
        with self.transaction() as c:
            c.execute("UPDATE runners SET heartbeat = ? WHERE id = ?", (time.time(), runner_id))

    def stop_runner(self, runner_id: int) -> None:
        with self.transaction() as c:
            c.execute("UPDATE runners SET stopped = ? WHERE id = ?", (time.time(), runner_id))

    def runner(self, runner_id: int | None) -> dict[str, Any] | None:
        if runner_id is None:
            return None
        row = self.conn.execute("SELECT * FROM runners WHERE id = ?", (runner_id,)).fetchone()
        return None if row is None else dict(row)

    def live_runners(self, stale_s: float) -> list[dict[str, Any]]:
        """Runners that have not stopped and whose process looks alive."""
        rows = self.conn.execute("SELECT * FROM runners WHERE stopped IS NULL").fetchall()
        return [dict(r) for r in rows if runner_alive(dict(r), stale_s)]

    # -- events ----------------------------------------------------------------------------
    def event(
        self,
        kind: str,
        runner_id: int | None = None,
        job_id: int | None = None,
        value: float | None = None,
        detail: str | None = None,
    ) -> None:
        with self.transaction() as c:
            c.execute(
                "INSERT INTO events(time, runner_id, job_id, kind, value, detail) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (time.time(), runner_id, job_id, kind, value, detail),
            )

    def event_values(self, kind: str) -> list[float]:
        rows = self.conn.execute(
            "SELECT value FROM events WHERE kind = ? AND value IS NOT NULL ORDER BY id", (kind,)
        ).fetchall()
        return [float(r["value"]) for r in rows]


def not_sqlite(path: Path) -> str:
    """The line for a ``--db`` whose file is not SQLite at all (a config or a log given by
    mistake), the same for the verbs that write and those that only read."""
    return (
        f"--db {path} is not a queue database (not SQLite: a config file or other text?); it "
        "was left untouched; pass --db with the queue's file (nanolab_queue.db by default), "
        "or a new path for a new queue"
    )


def _starts_like_sqlite(path: Path) -> bool:
    """Whether the file begins with SQLite's header (a damaged queue does; a YAML file does not)."""
    try:
        with open(path, "rb") as f:
            return f.read(16) == b"SQLite format 3\x00"
    except OSError:
        return True  # unreadable: say what SQLite said


#: Free bytes below which a failed SQLite write is taken for a full disk, not a damaged file.
LOW_SPACE_BYTES = 1 << 20

#: SQLite's shared-memory index (``-shm``) is made 32 KiB at a time: a file-size limit below
#: that stops even a reader that opens a WAL queue.
SHM_CHUNK_BYTES = 32 * 1024


def size_limit_in_the_way(path: Path) -> int | None:
    """This process's file-size limit (``ulimit -f``) when a write to the queue database at
    ``path`` can meet it: it is below the largest of the database, its ``-wal`` and its ``-shm``
    (at least one 32 KiB piece) plus :data:`LOW_SPACE_BYTES` for what one write adds. SQLite
    reports such a refused write (EFBIG) as a plain "disk I/O error"; ``None`` when no limit
    is that close (then the error is not the limit's)."""
    from nanolab.errors import file_size_limit

    limit = file_size_limit()
    if limit is None:
        return None
    sizes = [SHM_CHUNK_BYTES]
    for suffix in ("", "-wal", "-shm"):
        with contextlib.suppress(OSError):
            sizes.append(path.with_name(path.name + suffix).stat().st_size)
    return limit if limit < max(sizes) + LOW_SPACE_BYTES else None


def no_room(path: Path, err: BaseException) -> str | None:
    """The one line for a SQLite error that is the room's, not the file's: its file system is
    full (or out of file entries), or this process's file-size limit is lower than the file
    must grow, and SQLite could not write the journal or the page. ``None`` when there is room
    (then the file itself is at fault). Said as it is, because the damaged-file advice (move it
    aside, queue the jobs again) would throw away a healthy queue's history."""
    name = str(getattr(err, "sqlite_errorname", ""))
    full = "full" in str(err).lower() or name.startswith(
        ("SQLITE_FULL", "SQLITE_IOERR", "SQLITE_CANTOPEN")  # no entry left for its -wal/-shm
    )
    if not full:
        return None
    from nanolab.errors import inodes_left, size_limit_met, size_text

    if not name.startswith("SQLITE_CANTOPEN") and size_limit_in_the_way(path) is not None:
        limit, fix = size_limit_met("--db")
        return (
            f"the queue database {path} cannot be written past {limit} ({err}); the database "
            f"was left untouched: {fix}, then rerun the same command"
        )
    folder = path.parent if str(path.parent) else Path(".")
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return None
    if inodes_left(folder) is not None:
        what, fix = "has no file entries (inodes) left", "delete files you no longer need there"
    elif free < LOW_SPACE_BYTES:
        what, fix = f"is full ({size_text(free)} free)", "free space there"
    else:
        return None
    return (
        f"the file system holding the queue database {path} {what} ({err}); the database was "
        f"left untouched: {fix} and rerun the same command"
    )


def read_only_db(path: Path, err: BaseException, reading: bool = False) -> str | None:
    """The one line for a SQLite error that comes from the database not being writable: its file
    system is mounted read-only, or the file (read-only, immutable) or its folder (where SQLite
    keeps the ``-wal``/``-shm`` files) cannot be written. ``None`` when nothing of the kind is
    read-only (then the file itself is at fault). Said as it is, like :func:`no_room`: the
    damaged-file advice (move it aside, queue the jobs again) would throw away a healthy queue.
    ``reading``: said to a reader, which has no read-only way left to offer."""
    name = str(getattr(err, "sqlite_errorname", ""))
    kinds = ("SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_IOERR", "SQLITE_PERM")
    if not name.startswith(kinds) and "readonly" not in str(err).lower():
        return None
    folder = path.parent if str(path.parent) else Path(".")
    try:
        read_only_fs = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return None
    if not path.exists() and (read_only_fs or not os.access(folder, os.W_OK)):
        where = (
            "on a read-only file system" if read_only_fs else "in a folder that cannot be written"
        )
        return (
            f"there is no queue database at {path}, and none can be created there ({folder} is "
            f"{where}); pass --db with a file in a writable folder"
        )
    if read_only_fs:
        mount = _mount_point(folder)
        what = f"is on a read-only file system ({mount} is mounted read-only)"
        fix = f"remount it read-write (mount -o remount,rw {mount})"
    elif path.exists() and not os.access(path, os.W_OK):
        what = "is a read-only file"
        fix = f"make it writable (chmod u+w {path}; if lsattr shows it immutable, chattr -i)"
    elif not os.access(folder, os.W_OK):
        what = f"is in a folder that cannot be written ({folder}: SQLite keeps its -wal file there)"
        fix = f"make {folder} writable"
    else:
        return None
    still = "" if reading else "; `nanolab queue ls` still reads it"
    return (
        f"the queue database {path} {what} ({err}); it was left untouched{still}; to change "
        f"the queue, {fix}, or copy it to a writable folder and pass --db with the copy"
    )


def _mount_point(folder: Path) -> Path:
    """The mount holding ``folder`` (the one to remount): the longest mount point above it in
    ``/proc/self/mountinfo`` (a bind mount shares its device with the file system it shows, so
    walking up while the device stays the same would name that file system's root); else the
    top folder of its device."""
    here = folder.resolve()
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            points = [Path(line.split()[4].replace("\\040", " ")) for line in f if line.strip()]
    except (OSError, IndexError):
        points = []
    above = [p for p in points if p == here or p in here.parents]
    if above:
        return max(above, key=lambda p: len(p.parts))
    device = here.stat().st_dev
    while here.parent != here and here.parent.stat().st_dev == device:
        here = here.parent
    return here


def is_busy(err: BaseException) -> bool:
    """Whether a SQLite error is another connection holding the lock (SQLITE_BUSY/LOCKED)."""
    name = str(getattr(err, "sqlite_errorname", ""))
    return name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "database is locked" in str(err)


def busy_db(path: Path, err: BaseException, waited_s: float | None = None) -> str | None:
    """The one line for a queue another process keeps locked (``None`` for any other error);
    ``waited_s``: how long the lock was waited for (None: :data:`BUSY_TIMEOUT_S`). Said as it
    is: the damaged-file advice (move it aside) would throw away a healthy queue."""
    if not is_busy(err):
        return None
    if waited_s is None:
        waited_s = BUSY_TIMEOUT_S
    return (
        f"the queue database {path} is busy: another process has held its write lock for over "
        f"{waited_s:.0f} s ({err}); the queue is healthy and was left untouched; rerun the "
        f"command once that process is done (`fuser {path}` names the processes that have it open)"
    )


def unusable_db(path: Path, why: str) -> str:
    """One line for a queue database that cannot be used: what is wrong, that the file was not
    touched, and the ways forward."""
    return (
        f"the queue database {path} {why}; it was left untouched; pass --db with another file, "
        f"or move it aside (mv {path} {path}.bad) and queue the jobs again (a job re-added with "
        "the same --name resumes from its run directory's checkpoint)"
    )


def upgrade_schema(conn: sqlite3.Connection) -> None:
    """Add the columns a version-1 queue lacks and record version 2, and the runner columns a
    queue written before them lacks (inside the caller's transaction, so a concurrent opener
    sees either the old or the new schema)."""
    for table, columns in (("jobs", {**V2_COLUMNS, **LOG_COLUMNS}), ("runners", RUNNER_COLUMNS)):
        have = {r[1] for r in conn.execute(f"PRAGMA table_info({table})").fetchall()}
        for name, definition in columns.items():
            if name not in have:
                conn.execute(f"ALTER TABLE {table} ADD COLUMN {name} {definition}")
    conn.execute(
        "UPDATE meta SET value = ? WHERE key = 'schema_version' AND CAST(value AS INTEGER) < ?",
        (str(SCHEMA_VERSION), SCHEMA_VERSION),
    )


def _shape(conn: sqlite3.Connection) -> dict[str, set[str]]:
    """The columns of each table of ``conn``'s database, and its indexes (under ``""``)."""
    names = conn.execute("SELECT type, name FROM sqlite_master").fetchall()
    shape = {"": {name for kind, name in names if kind == "index"}}
    for kind, name in names:
        if kind == "table":
            shape[name] = {r[1] for r in conn.execute(f"PRAGMA table_info({name})").fetchall()}
    return shape


@functools.cache
def _current_shape() -> dict[str, set[str]]:
    """The tables, columns and indexes a queue of this nanolab has (its schema, upgraded)."""
    conn = _empty_queue()
    try:
        return _shape(conn)
    finally:
        conn.close()


def _setup_needed(conn: sqlite3.Connection) -> bool:
    """Whether :class:`QueueDB`'s setup would write into ``conn``'s database: a journal mode
    other than WAL, or a schema that lacks a table, column or index of this nanolab's or
    records an older version. A queue in use already has all of these, so a reader writes
    nothing."""
    mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
    if str(mode).lower() != "wal":
        return True
    have = _shape(conn)
    if any(not needed <= have.get(name, set()) for name, needed in _current_shape().items()):
        return True
    row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    return row is None or str(row[0]) != str(SCHEMA_VERSION)


def check_queue_db(conn: sqlite3.Connection, path: Path, verify: bool = True) -> None:
    """Refuse a file that is not a nanolab queue before anything is written into it.

    A new or empty database (no tables, e.g. a zero-byte file) is fine: the schema is created.
    A SQLite file holding other tables, one from a newer nanolab, or (``verify``) one that
    fails SQLite's ``quick_check`` (a truncated copy, a torn disk) raises :class:`QueueError`.
    Garbage bytes raise ``sqlite3.DatabaseError`` on the first read, which the caller turns
    into one line. ``quick_check`` reads the whole file (~10 ms at 2,000 jobs on a busy
    machine, growing with the file): the writers run it; a reader does not, at each call.
    """
    tables = _tables(conn)
    if not tables:
        return
    version = None
    if "meta" in tables:
        with contextlib.suppress(sqlite3.OperationalError):  # a "meta" table of another shape
            row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            version = None if row is None else row[0]
    if version is None:
        raise QueueError(
            f"{path} is a SQLite database but not a nanolab queue (its tables: "
            f"{', '.join(sorted(tables))}); it was left untouched; pass --db with the queue's "
            f"file or a new file name"
        )
    if not str(version).isdigit() or int(version) > SCHEMA_VERSION:
        raise QueueError(
            f"the queue database {path} has schema version {version!r}, newer than this nanolab "
            f"understands ({SCHEMA_VERSION}); it was left untouched; upgrade nanolab or pass "
            "--db with another file"
        )
    missing_tables = {"jobs", "runners", "events"} - tables
    job_columns = {r[1] for r in conn.execute("PRAGMA table_info(jobs)").fetchall()}
    # Version 1 lacks the V2 columns; they are added after these read-only checks.
    needed = {f.name for f in fields(Job)} - set(V2_COLUMNS) - set(LOG_COLUMNS)
    missing = needed - job_columns if "jobs" in tables else set()
    if missing or missing_tables:
        gone = sorted(missing_tables) + [f"jobs.{c}" for c in sorted(missing)]
        raise QueueError(unusable_db(path, f"lacks {', '.join(gone[:5])}"))
    if not verify:
        return
    problems = [r[0] for r in conn.execute("PRAGMA quick_check").fetchall()]
    if problems != ["ok"]:
        raise QueueError(unusable_db(path, f"is damaged (sqlite quick_check: {problems[0]})"))


#: Seconds between a runner's heartbeats.
HEARTBEAT_S = 5.0

#: Seconds without a heartbeat (5 s apart) after which a runner of another machine counts as gone.
RUNNER_STALE_S = 30.0

#: Heartbeat intervals a live runner may miss before ``queue ls`` and ``status`` say so.
SILENT_BEATS = 3


def silent_runners(db: QueueDB, now: float | None = None) -> list[dict[str, Any]]:
    """Runners counted alive (they keep their jobs) that have not beaten for
    :data:`SILENT_BEATS` heartbeat intervals, each with ``silent_s`` and ``line``: what
    ``queue ls`` and ``status`` print of it.

    A runner stopped by SIGSTOP (Ctrl-Z in its terminal) keeps its process, so it is not gone
    and its jobs stay its own: no other runner takes them over, and nothing else showed why
    they sat still. Who owns a job is not changed here, only said."""
    from nanolab.runs import duration

    now = time.time() if now is None else now
    rows = db.conn.execute("SELECT * FROM runners WHERE stopped IS NULL ORDER BY id").fetchall()
    found = []
    for row in map(dict, rows):
        silent = now - float(row["heartbeat"])
        if silent <= SILENT_BEATS * HEARTBEAT_S or not runner_alive(row, RUNNER_STALE_S):
            continue
        pid = int(row["pid"])
        here = runner_process(row) is not None  # its process can be seen from here
        state = process_state(pid) if here else None
        where = "" if row["host"] == socket.gethostname() else f" on {row['host']}"
        why = (
            f"stopped by a signal: `kill -CONT {pid}` resumes it"
            if state in ("T", "t")
            else "stopped?"
        )
        line = f"runner pid {pid}{where}: no heartbeat for {duration(silent)} ({why})"
        found.append({"pid": pid, "host": row["host"], "silent_s": silent, "line": line})
    return found


def orphaned(db: QueueDB, job: Job) -> bool:
    """A ``running`` job whose runner is gone (killed, out of memory, its machine lost): the
    next ``queue run`` recovers it and resumes it from its checkpoint."""
    return job.status == "running" and not runner_alive(db.runner(job.runner_id), RUNNER_STALE_S)


def runner_process(runner: dict[str, Any]) -> bool | None:
    """Whether a runner's process still runs, where this process can tell: a runner of this host
    and PID namespace that recorded both (its pid compared with its recorded start, so a reused
    pid is not taken for it). None where it cannot: another machine (or container), or a row
    written before the namespace was recorded.

    Host name and namespace do not tell machines apart: hosts cloned from one image share a
    name, and every Linux host's first PID namespace is ``pid:[4026531836]``; a runner on
    another machine sharing the queue (NFS) was judged by a local pid, and its live jobs taken
    over. The boot id in its recorded start tells: another one is another machine (or an
    earlier boot of this one), judged by its heartbeat."""
    here = runner["host"] == socket.gethostname()
    namespace = runner.get("pid_namespace")
    if not here or namespace is None or namespace != pid_namespace():
        return None
    start = runner.get("pid_start")
    if start is not None and not _this_boot(start):
        return None
    return same_process(int(runner["pid"]), start)


def _this_boot(start: str) -> bool:
    """Whether a start :func:`process_start` recorded was read on this machine since its boot
    (its boot id is this one's; True where the kernel does not say)."""
    mine = process_start(os.getpid())
    return mine is None or start.partition(":")[0] == mine.partition(":")[0]


def runner_alive(runner: dict[str, Any] | None, stale_s: float) -> bool:
    """A runner is alive if it has not stopped and, on this machine, its process runs; only a
    runner whose process cannot be seen from here (another machine) is judged by its heartbeat.

    A heartbeat is only a sign: a healthy runner misses it while another process holds the
    queue's write lock (a ``sqlite3`` shell, a stuck command), and a runner taken for gone on
    that sign alone had its jobs stopped and started again by the next runner."""
    if runner is None or runner.get("stopped") is not None:
        return False
    process = runner_process(runner)
    if process is not None:
        return process
    if time.time() - float(runner["heartbeat"]) > stale_s:
        return False
    if runner["host"] == socket.gethostname() and runner.get("pid_namespace") is None:
        return pid_alive(int(runner["pid"]))  # a row from before the namespace was recorded
    return True
