"""One launch per run directory: an advisory lock file naming its holder.

Two ``nanolab fit`` processes in one run directory would interleave their logs and rotate each
other's checkpoints away; a ``run.fresh`` start would archive the files of a run that is still
writing them. So before anything is read or written, the launching process takes
``<run_dir>/.nanolab.lock``:

* The lock is ``flock`` on that file, held for the life of the process: the kernel releases it
  when the process exits however it exits (SIGKILL, OOM, a lost node), so a dead holder never
  blocks a restart: the next launch simply takes it. The file also records the holder (host, pid,
  start time, command) so a refused launch can say who holds the directory.
* Ranks of one launch share it. Lightning's DDP launcher re-executes the command for ranks
  1..N-1; they inherit :data:`TOKEN_ENV` from the holder and recognise its token in the file.
  Under torchrun or ``srun`` every rank is a peer: only global rank 0 takes the lock (a second
  launch's rank 0 is refused, and its launcher then stops the other ranks).
* A SLURM requeue of the same job takes the directory over even when the lock still looks held
  (the previous allocation's node may be unreachable, its lock not yet expired on a network
  filesystem): the job id in the file says it is the same job, and SLURM only requeues a job
  whose processes are gone.
* A held lock that an older nanolab wrote (its file names no PID namespace) is refused, whatever
  its pid reads here: that pid may number a live process of another PID namespace (a container
  with this host's name); the refusal says to delete the file if that process is really gone.
* On filesystems without ``flock`` the file alone decides: a holder on this host whose pid no
  longer runs is taken over (:func:`nanolab.processes.lock_holder_gone`: in its PID namespace,
  or, for an older nanolab's file that names none, also a pid reused since the file was
  written); a holder on another host is respected, and the refusal says to delete the file if
  that process is really gone.

The lock is released (and the file removed) when the process exits.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanolab.callbacks.events import CallbackConfigError
from nanolab.processes import (
    RUN_LOCK_NAME,
    global_rank_from_env,
    lock_holder_gone,
    pid_alive,
    pid_namespace,
    read_lock_holder,
)

LOCK_NAME = RUN_LOCK_NAME
#: Environment variable through which a holder hands its token to the ranks it launches.
TOKEN_ENV = "NANOLAB_RUN_LOCK"


class RunLockedError(CallbackConfigError):
    """The run directory is held by another live launch; the message names the holder."""


@dataclass
class RunLock:
    """A held lock (``fd`` is None when this process shares its launcher's lock)."""

    path: Path
    token: str
    fd: int | None
    created_dir: bool = False  # this launch created the run directory

    def release(self) -> None:
        """Remove the file and drop the lock (idempotent; a rank that shares it does nothing).

        A run directory this launch created and left empty (it was refused before writing
        anything) is removed too, so a failed start leaves no trace.
        """
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        with contextlib.suppress(OSError):
            # Unlink while still holding it: a launch waiting on this inode re-checks the path.
            if _same_file(fd, self.path):
                self.path.unlink()
                if self.created_dir:
                    self.path.parent.rmdir()  # only if empty (OSError otherwise)
        with contextlib.suppress(OSError):
            os.close(fd)


_held: dict[Path, RunLock] = {}


def acquire(run_dir: str | os.PathLike[str], *, create: bool = True) -> RunLock:
    """Hold ``run_dir`` for this launch, or raise :class:`RunLockedError` naming the holder.

    Idempotent within a process. Creates ``run_dir`` if needed (an unwritable one raises
    ``OSError``, which the caller reports). ``create=False`` (an evaluation appending to a run
    it scored) never creates it: a directory moved or deleted meanwhile raises
    :class:`FileNotFoundError` naming it, and nothing is made in its place (a new folder with
    a lone record would read, in ``status``, as a run of its own).
    """
    run_dir = Path(run_dir)
    if not create and not run_dir.is_dir():
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(run_dir))
    path = run_dir / LOCK_NAME
    key = path.absolute()
    if key in _held and _held[key].fd is not None:
        return _held[key]
    shared = _shared_with_launcher(path)
    if shared is None and global_rank_from_env() != 0:
        # A peer rank under torchrun/srun: rank 0 of this launch holds the directory.
        shared = RunLock(path, os.environ.get(TOKEN_ENV, ""), None)
    if shared is not None:
        _held[key] = shared
        return shared
    created = create and not run_dir.exists()
    if create:
        run_dir.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    for _ in range(10):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # a folder gone since: ENOENT
        try:
            locked = _try_flock_past_readers(fd, path)
        except BaseException:
            os.close(fd)
            raise
        if locked is False and _held_by_gone_holder(path):
            locked = _wait_for_orphans(fd, path)
        if locked is False:
            holder = read_lock_holder(path)
            os.close(fd)
            if _requeued_same_job(holder) or _held_by_gone_holder(path):
                # The requeued job, or the launch after a holder of this host that is gone,
                # takes over: a new, unlocked file at ``path`` (the old holder, or the children
                # it left, keep their lock on the unlinked inode).
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                continue
            raise RunLockedError(_refusal(run_dir, holder))
        if not _same_file(fd, path):
            os.close(fd)  # the holder removed the file while we opened it: try the new one
            continue
        if locked is None and _live_holder_elsewhere(path):
            holder = read_lock_holder(path)
            os.close(fd)
            raise RunLockedError(_refusal(run_dir, holder))
        _write_holder(fd, token)
        lock = RunLock(path, token, fd, created_dir=created)
        _held[key] = lock
        os.environ[TOKEN_ENV] = f"{key}:{token}"  # the ranks this process launches share it
        atexit.register(lock.release)
        return lock
    raise RunLockedError(f"run directory {run_dir}: could not take {path} (it keeps changing)")


def release_all() -> None:
    for lock in list(_held.values()):
        lock.release()
    _held.clear()


def _refusal(run_dir: Path, holder: dict[str, Any] | None) -> str:
    who = "another process (holder unknown)"
    if holder:
        get = holder.get
        who = f"pid {get('pid', '?')} on {get('host', '?')} (since {get('started', '?')})"
    line = (
        f"run directory {run_dir} is in use by {who}; wait for it to finish, "
        "stop it, or choose another run.name"
    )
    if holder and (holder.get("host") != socket.gethostname() or "pid_namespace" not in holder):
        # Not judged from here (another host's process, or an older nanolab's lock, whose pid
        # may number a process of another PID namespace): the user can tell, and clear it.
        line += f"; if that process is gone, delete {run_dir / LOCK_NAME}"
    return line


def _shared_with_launcher(path: Path) -> RunLock | None:
    """A rank launched by the holder: its token (inherited) is the one in the file."""
    inherited = os.environ.get(TOKEN_ENV, "")
    where, _, token = inherited.rpartition(":")
    if not token or Path(where) != path.absolute():
        return None
    holder = read_lock_holder(path)
    return RunLock(path, token, None) if holder and holder.get("token") == token else None


#: How long a launch waits for the children a killed holder left (data loader workers, which
#: look for their parent every 5 s) to let go of the run directory's lock before taking it over.
ORPHAN_GRACE_S = 10.0


def _held_by_gone_holder(path: Path) -> bool:
    """The lock at ``path`` is held (flock said so): does its file name a holder of this host
    that is gone, whose children (or nothing) hold it? An older nanolab's holder (no PID
    namespace) is never: the held lock says it runs, wherever its pid is numbered."""
    holder = read_lock_holder(path)
    return holder is not None and lock_holder_gone(holder, path, flock_held=True)


#: A reader (``status``, ``report``) asks whether an older nanolab's lock is held by taking a
#: shared lock for an instant (:func:`nanolab.processes.lock_file_held`): a launch finding the
#: lock held asks again this many times, :data:`_READER_PAUSE_S` apart, before it believes so.
_READER_RETRIES = 5
_READER_PAUSE_S = 0.02


def _try_flock_past_readers(fd: int, path: Path) -> bool | None:
    """:func:`_try_flock`, asked again for a moment while the lock reads as held, so that a
    reader's brief shared lock never refuses a launch."""
    for _ in range(_READER_RETRIES):
        locked = _try_flock(fd, path)
        if locked is not False:
            return locked
        time.sleep(_READER_PAUSE_S)
    return _try_flock(fd, path)


def _wait_for_orphans(fd: int, path: Path) -> bool | None:
    """The lock of a holder that no longer runs (SIGKILL, the OOM killer) but is still held:
    its children share the lock (a fork keeps the open file), and a resume started at once was
    refused as "in use by pid N" for a pid that was gone (a queue job then failed). Wait for
    them to exit, a few seconds; the caller takes the directory over if they do not."""
    deadline = time.monotonic() + ORPHAN_GRACE_S
    while True:
        locked = _try_flock(fd, path)
        if locked is not False or time.monotonic() >= deadline:
            return locked
        time.sleep(0.2)


def _try_flock(fd: int, path: Path) -> bool | None:
    """True: locked; False: held by someone else; None: this filesystem has no flock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as err:
        if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return None
        raise


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _write_holder(fd: int, token: str) -> None:
    """Name this process as the holder (for a refused launch's message) with its token."""
    info = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pid_namespace": pid_namespace(),  # what a pid of this host means (containers)
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "slurm_restart_count": os.environ.get("SLURM_RESTART_COUNT"),
        "argv": " ".join(sys.argv[:8]),
        "token": token,
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    with contextlib.suppress(OSError):
        os.fsync(fd)


def _requeued_same_job(holder: dict[str, Any] | None) -> bool:
    job = os.environ.get("SLURM_JOB_ID")
    if not job or not holder or str(holder.get("slurm_job_id")) != job:
        return False
    if holder.get("host") == socket.gethostname() and _pid_alive(holder.get("pid")):
        return False  # the same job's process is still running here: not a requeue
    return holder.get("slurm_restart_count") != os.environ.get("SLURM_RESTART_COUNT")


def _live_holder_elsewhere(path: Path) -> bool:
    """Without flock: does the file name a holder that may still run?"""
    holder = read_lock_holder(path)
    if not holder or holder.get("pid") == os.getpid() or _requeued_same_job(holder):
        return False
    if holder.get("host") != socket.gethostname():
        return True  # cannot check another host's processes: respect the file
    return not lock_holder_gone(holder, path, flock_held=None)  # pid, namespace, file age


def _pid_alive(pid: Any) -> bool:
    """A holder's ``pid`` as read from its JSON: only a positive int can name a live process."""
    return isinstance(pid, int) and not isinstance(pid, bool) and pid_alive(pid)
