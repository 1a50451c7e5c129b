"""Processes and memory on this machine, as the run lock, the queue, a CPU run and ``prepare``
see them."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

#: The file in a run directory that holds it for one launch (``nanolab.callbacks.runlock``).
RUN_LOCK_NAME = ".nanolab.lock"


def pid_alive(pid: int | None) -> bool:
    """Whether a process with ``pid`` exists on this machine (zombies count as gone)."""
    if not pid or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:  # a zombie has exited; only its parent has not reaped it yet
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def die_with_parent(parent: int, gone: str | None = None) -> None:
    """End this process when ``parent`` dies, even by SIGKILL: a pool worker waits on a queue
    whose other end it holds itself, so it would wait forever, and with it the
    multiprocessing resource tracker that waits for every holder of its pipe; a rank that
    rank 0 launched waits for it in the process group's rendezvous or a collective, holding
    its memory (on a GPU, the device's) while the queue starts its next job.

    Linux: the kernel sends SIGKILL at the parent's death (``prctl(PR_SET_PDEATHSIG)``; it
    fires when the parent's thread that started this process ends, so the parent must start it
    from a thread that lives as long as it does: its main thread). Elsewhere a daemon thread
    polls the parent's pid every second. Either way a parent that died before this ran (the
    process was adopted) ends it at once, after writing ``gone`` (a line) to stderr if given.
    """
    import ctypes
    import sys

    armed = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != parent:  # checked after arming: a death in between is not missed
        _parent_gone(gone)
    if armed:
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        _parent_gone(gone)

    threading.Thread(target=watch, name="nanolab-parent-watch", daemon=True).start()


#: ``prctl`` option: the signal this process gets when its parent dies (Linux).
_PR_SET_PDEATHSIG = 1


def _parent_gone(line: str | None) -> None:
    """Exit now (status 1), with ``line`` on stderr: the parent this process served is gone."""
    if line:
        with contextlib.suppress(OSError):
            os.write(2, f"{line}\n".encode(errors="replace"))
    os._exit(1)


def process_state(pid: int) -> str | None:
    """The state letter the kernel gives process ``pid`` (``R`` running, ``S`` sleeping, ``T``
    stopped by a signal, ``t`` stopped under a debugger, ``Z`` exited), or None where it does
    not say (no ``/proc``, no such process)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return (
                f.read().rsplit(")", 1)[-1].split()[0]
            )  # after the command name, which may hold ")"
    except (OSError, IndexError):
        return None


def read_lock_holder(path: Path) -> dict[str, Any] | None:
    """The holder a run lock file names (host, pid, start, command), or None when the file is
    absent, being written or not one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8") or "null")
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def pid_namespace() -> str | None:
    """This process's PID namespace (``pid:[4026531836]``), where the kernel says it: two
    processes' pids compare only within one."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def process_start(pid: int) -> str | None:
    """When process ``pid`` started, as ``<boot id>:<start time in clock ticks>`` (Linux's
    ``/proc``), or None where the kernel does not say. Pids are reused: a pid that runs with
    another start than the one recorded is another process (the boot id tells a pid and start
    tick of an earlier boot apart)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            # Fields after the command name (which may hold spaces and parentheses): state is
            # field 3, starttime field 22.
            return f"{boot}:{f.read().rsplit(')', 1)[-1].split()[19]}"
    except (OSError, IndexError):
        return None


def same_process(pid: int, start: str | None) -> bool:
    """Whether ``pid`` still runs and is the process that :func:`process_start` read as
    ``start`` then (None: not recorded, the pid alone decides)."""
    if not pid_alive(pid):
        return False
    now = process_start(pid) if start is not None else None
    return now is None or now == start


def gone_lock_holder(run_dir: Path) -> dict[str, Any] | None:
    """The holder ``run_dir``'s lock file names when it is a process of this host that no
    longer runs (killed with SIGKILL, out of memory: nothing removed the file), else None.

    For readers (``status``, ``report``, "is this folder a run"), which hold nothing: the file
    and the pid, and for an older nanolab's lock (no PID namespace) whether its ``flock`` is
    held (:func:`lock_file_held`). A holder on another host cannot be checked from here, and a
    pid of this version's lock that runs again (reused) reads as alive; for those the run's
    silence decides."""
    path = run_dir / RUN_LOCK_NAME
    holder = read_lock_holder(path)
    return holder if holder is not None and _gone_as_read(holder, path) else None


def lock_file_missing(run_dir: Path) -> bool:
    """Whether ``run_dir`` has no run lock file: no launch holds it. A launch takes the file
    before it writes the run's log and removes it when it exits (a killed one leaves it, for
    :func:`gone_lock_holder`), so a log with no end record and no lock file is a run that ended
    without one (a crash that cut the log's last line), not one still training, however
    recently it wrote."""
    return not os.path.lexists(run_dir / RUN_LOCK_NAME)


def live_lock_holder(run_dir: Path) -> dict[str, Any] | None:
    """The holder ``run_dir``'s lock file names when it may still run (any holder but one
    :func:`gone_lock_holder` knows has exited), else None: a launch is using the folder even
    when its log was deleted. For readers, like :func:`gone_lock_holder`."""
    path = run_dir / RUN_LOCK_NAME
    holder = read_lock_holder(path)
    return holder if holder is not None and not _gone_as_read(holder, path) else None


def _gone_as_read(holder: dict[str, Any], path: Path) -> bool:
    """:func:`lock_holder_gone` for a reader: it asks the kernel about ``flock`` only for an
    older nanolab's lock, the one holder its pid cannot judge. A lock of this version names its
    namespace and is judged by its pid, unprobed: the holder's own process reads its run too,
    and its probe would contend with its own lock (on NFS, where flock is a POSIX lock of the
    process, closing the probe would drop it)."""
    asked = lock_file_held(path) if _older_holder_here(holder) else None
    return lock_holder_gone(holder, path, flock_held=asked)


def _older_holder_here(holder: dict[str, Any]) -> bool:
    """A holder of this host's name written by an older nanolab (it names no PID namespace)."""
    return holder.get("host") == socket.gethostname() and "pid_namespace" not in holder


def lock_file_held(path: Path) -> bool | None:
    """Whether some process holds ``flock`` on the lock file ``path`` (True), none does (False),
    or this cannot be asked here (None: no file, no ``flock`` on this filesystem).

    Asked with a shared lock taken without waiting and dropped at once; a launch that asks for
    the lock in that instant asks again (:mod:`nanolab.callbacks.runlock`)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return None  # no flock here (ENOLCK, EOPNOTSUPP, ...): the file alone decides
    finally:
        os.close(fd)


def lock_holder_gone(holder: dict[str, Any], path: Path, *, flock_held: bool | None) -> bool:
    """Whether the lock ``holder`` (read from the lock file ``path``) is a process of this host
    that no longer runs. A holder on another host is never judged gone from here.

    ``flock_held`` is what ``flock`` says of the file (None: it cannot be asked). An older
    nanolab (its lock names no PID namespace) held ``flock`` for its life, and its pid may
    number a process of another namespace (a container with this host's name): while the
    kernel answers, its answer alone judges such a holder; a held lock is a live holder, never
    taken over for what its pid reads here."""
    if holder.get("host") != socket.gethostname():
        return False
    pid = holder.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    if "pid_namespace" not in holder:
        if flock_held is not None:
            return not flock_held
        return _unrecorded_namespace_holder_gone(holder, pid, path)
    # A container with this host's name (`docker run --network host`) numbers its processes
    # apart: its pid means nothing here, and its live run read as crashed.
    if holder.get("pid_namespace") is None or holder.get("pid_namespace") != pid_namespace():
        return False
    return not pid_alive(pid)


def _unrecorded_namespace_holder_gone(holder: dict[str, Any], pid: int, path: Path) -> bool:
    """An older nanolab's lock on a filesystem without ``flock``: gone when ``pid`` no longer
    runs here, when the file was written before this machine booted, or when the process that
    now has ``pid`` started after the file was written (the pid was reused); a process that
    runs with it since before then may be the holder. Judged from this PID namespace: a live
    holder of an older nanolab in a same-named container cannot be told apart here.

    "Written" is the later of the file's time and the holder's own ``started`` (this host's
    clock, as the holder is of this host): a network filesystem stamps the file with its
    server's clock, and a server behind this one made a live holder's start read as later
    than its file (a reused pid) and a file written since boot as older than the boot. Without
    a ``started`` of its own, only a pid that runs no more judges it."""
    try:
        written = path.stat().st_mtime
    except OSError:
        return False  # no file: nothing to judge (a reader raced its removal)
    if not pid_alive(pid):
        return True
    stamped = _local_stamp(holder.get("started"))
    if stamped is None:
        return False
    written = max(written, stamped)
    booted = boot_time()
    if booted is not None and written < booted:
        return True
    started = process_started_at(pid)
    return started is not None and started > written + _CLOCK_SLACK_S


def _local_stamp(started: Any) -> float | None:
    """A lock holder's ``started`` (``%Y-%m-%d %H:%M:%S`` in its local time) as Unix time, or
    None when it is not one."""
    if not isinstance(started, str):
        return None
    try:
        return time.mktime(time.strptime(started, "%Y-%m-%d %H:%M:%S"))
    except (ValueError, OverflowError):
        return None


#: Seconds a process start may read after its lock file's time and still be the holder (the
#: kernel's start time is in clock ticks from a boot time rounded to the second).
_CLOCK_SLACK_S = 2.0


def boot_time() -> float | None:
    """When this machine booted (Unix time, ``btime`` of ``/proc/stat``); None where the kernel
    does not say."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            return float(next(line.split()[1] for line in f if line.startswith("btime ")))
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def process_started_at(pid: int) -> float | None:
    """When process ``pid`` started (Unix time: the boot time plus its start ticks), or None
    where the kernel does not say."""
    booted = boot_time()
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            ticks = int(f.read().rsplit(")", 1)[-1].split()[19])  # starttime: field 22
        return None if booted is None else booted + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _reclaimable_cache() -> int:
    """Bytes of the cgroup's page cache the kernel drops before it runs out (``inactive_file``
    of ``memory.stat``): ``memory.current`` counts them, and a corpus just read fills them."""
    try:
        for line in Path("/sys/fs/cgroup/memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "inactive_file":
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def host_memory_available() -> int | None:
    """Bytes this process can still allocate: free RAM, capped by its cgroup and address-space
    limits (None when none of them can be read)."""
    limits: list[int] = []
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    limits.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        text = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if text != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
            limits.append(int(text) - used + _reclaimable_cache())
    except (OSError, ValueError):
        pass
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            with open("/proc/self/statm", encoding="ascii") as f:
                mapped = int(f.read().split()[0]) * resource.getpagesize()
            limits.append(soft - mapped)
    except (OSError, ValueError, ImportError):
        pass
    return max(0, min(limits)) if limits else None


def resident_bytes() -> int:
    """This process's resident memory now (``/proc/self/statm``; 0 where it cannot be read)."""
    try:
        import resource

        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except (OSError, ValueError, IndexError, ImportError):
        return 0


def how_it_ended(returncode: int) -> str:
    """How a child process ended, from its ``Popen.returncode``: ``killed by SIGKILL (out of
    memory?)`` (the kernel's out-of-memory killer sends SIGKILL, and a process has no say in
    it), ``killed by SIGSEGV``, or ``exited with code 1``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")
    return f"exited with code {returncode}"


def failed_children(
    procs: Sequence[Any], timeout: float | None, ok: Collection[int] = (0,)
) -> list[Any]:
    """Those of ``procs`` (``subprocess.Popen`` children of this process) that ended with a
    status not in ``ok``, as soon as one has, waiting ``timeout`` seconds at most (None: until
    one does); empty when none has by then. Their ``returncode`` is then set.

    Woken by the exit itself, not by a poll's next turn: a child's pidfd becomes readable when
    it ends (Linux 5.3 and later), so a wait long enough for a loaded machine costs nothing
    when the child ends at once. Elsewhere (or where a pidfd cannot be opened) the children are
    polled every 50 ms. A child that ended with a status in ``ok`` is not a failure: the wait
    goes on for the others.
    """
    import select

    deadline = None if timeout is None else time.monotonic() + timeout
    fds: dict[Any, int] = {}  # a running child's pidfd
    try:
        polled = False  # no pidfd for some child (not Linux, an older kernel): poll them all
        for proc in procs:
            if proc.poll() is not None:
                continue
            try:  # opened while the child is not yet reaped: the pid is still this child's
                fds[proc] = os.pidfd_open(proc.pid)
            except (AttributeError, OSError):
                polled = True
        while True:
            failed = [
                proc for proc in procs if proc.poll() is not None and proc.returncode not in ok
            ]
            for proc in [proc for proc in fds if proc.returncode is not None]:
                os.close(fds.pop(proc))  # ended, not failed: its pidfd would wake every select
            running = [proc for proc in procs if proc.returncode is None]
            left = None if deadline is None else deadline - time.monotonic()
            if failed or not running or (left is not None and left <= 0):
                return failed
            if polled:
                time.sleep(0.05 if left is None else min(0.05, left))
            else:  # a pidfd is readable once its child has ended (poll above reads its status)
                select.select(list(fds.values()), [], [], left)
    finally:
        for fd in fds.values():
            os.close(fd)


def global_rank_from_env() -> int:
    """This process's global rank as a launcher set it (0 when launched alone)."""
    for key in ("RANK", "SLURM_PROCID", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        value = os.environ.get(key)
        if value is not None and value.strip().isdigit():
            if key == "SLURM_PROCID" and int(os.environ.get("SLURM_NTASKS", "1") or 1) <= 1:
                continue  # a single-task job (also each sbatch step): every launch is rank 0
            return int(value)
    # Lightning's launcher on the other nodes of a multi-node run (started by hand or by a
    # scheduler with NODE_RANK set), or a rank a launcher started with only its local rank.
    for key in ("NODE_RANK", "GROUP_RANK", "LOCAL_RANK"):
        value = os.environ.get(key, "")
        if value.strip().isdigit() and int(value) > 0:
            return int(value)
    return 0


@contextlib.contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    """Hold ``lock_path`` exclusively (``prepare`` of one dataset folder, ``export`` to one
    ``-o``); the file is removed when done (no stray lock file is left beside the output; one a
    killed process leaves is harmless, since its lock died with it, and the next holder
    removes it). A waiter that locked a file since removed tries again, so two processes never
    both hold the lock."""
    while True:
        handle = open(lock_path, "a")  # noqa: SIM115 - closed below
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            current = os.stat(lock_path).st_ino == os.fstat(handle.fileno()).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        handle.close()
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock_path)  # while still holding it: see above
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


#: The signals that stop a command (Ctrl-C, a scheduler's or a queue's stop), held while a
#: worker process starts.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def stop_signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM held back in this thread, and delivered on leaving. A worker process
    started meanwhile starts with them held too (the signal mask survives its exec), so a
    Ctrl-C to the process group while it imports is never a traceback: it ignores SIGINT once
    it runs (``nanolab.data.encode.become_worker``), and the parent decides.

    The mask alone holds nothing in the main thread while another thread does not block the
    signal (torch's in a ``fit`` that prepares its ``data.source``, the tokenizers library's):
    the kernel delivers it there, and Python runs the handler in the main thread all the same,
    wherever it is. A KeyboardInterrupt inside a process pool's submit left a worker started
    but not recorded, never ended, waiting for the rest of its start data with the pool's task
    pipe open: the pool's feeder and manager threads waited on it, and the stop its 30 s. So
    the main thread's handlers only note a signal meanwhile, and the ones they replaced get it
    on leaving. (Handlers run in the main thread only: in another thread the mask is all there
    is to hold.)"""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    # The first process started here would also start multiprocessing's resource tracker, which
    # unblocks SIGINT in this thread on its way: the process after it (prepare's BPE trainer)
    # started with SIGINT open, and a Ctrl-C while it imported was a traceback. Started first.
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    noted: list[int] = []
    replaced: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            replaced[signum] = signal.signal(signum, lambda got, _frame: noted.append(got))
    old = signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS))
    try:
        yield
    finally:
        # One held at the kernel (no other thread took it) arrives on unblocking: noted too.
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        for signum, handler in replaced.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        _deliver(list(dict.fromkeys(noted)))


def _deliver(signums: list[int]) -> None:
    """Each noted signal raised to the handler it was meant for, in the order it came. A
    handler that raises (Ctrl-C's KeyboardInterrupt) does not swallow the ones after it: a
    SIGTERM a scheduler sent right after a Ctrl-C still ends the process its own way, with the
    KeyboardInterrupt as its context."""
    if not signums:
        return
    try:
        signal.raise_signal(signums[0])
    finally:
        _deliver(signums[1:])


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's stop, ``kill``), raised where the main thread is, so that it
    takes Ctrl-C's way out: ``prepare`` stops its workers and BPE trainer and removes its
    half-written folder (a dataset being replaced is left as it was); ``bench`` stops the side
    it runs and removes its temporary runs. Without it the default action ended the process at
    once: exit 143 with no line, its children left running, its leftovers never removed."""


@contextlib.contextmanager
def sigterm_as_interrupt(came: threading.Event) -> Iterator[None]:
    """SIGTERM raised as :class:`Terminated` while inside, and ``came`` set: should the stop
    surface as another error on its way out (a pipe to a process being ended), the cause is
    still the signal. The children (prepare's workers and BPE trainer, bench's sides) are
    this process's to end."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can be set only from the main thread
        return

    def terminate(signum: int, frame: Any) -> None:
        if not came.is_set():  # a second SIGTERM must not break the clean-up of the first
            came.set()
            raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
