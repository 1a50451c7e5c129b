"""A run killed with SIGKILL (the OOM killer) while its data loader workers ran: the workers
share the run directory's lock (a fork keeps the open file) until they notice their parent is
gone, and a resume started at once was refused as "in use by pid N" for a pid that no longer
ran: a queue job's resume then failed. The next launch now waits a moment and takes over."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# Holds the lock, forks a child that keeps it (as a loader worker does), and is killed.
HOLDER = """
import os, sys, time
from nanolab.callbacks.runlock import acquire
acquire(sys.argv[1])
if os.fork() == 0:
    time.sleep(float(sys.argv[2]))
    os._exit(0)
print("held", flush=True)
time.sleep(600)
"""


def _killed_holder_with_a_child(run_dir: Path, child_s: float) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir), str(child_s)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.mark.parametrize("child_s", [1.0, 15.0])
def test_a_launch_after_a_killed_holder_takes_its_lock_from_the_children(
    tmp_path: Path, monkeypatch, child_s: float
) -> None:
    """Children that exit within the grace: the lock is taken once they let go. Children that
    outlive it: the directory is taken over (a new lock file), not refused."""
    from nanolab.callbacks import runlock

    monkeypatch.setattr(runlock, "ORPHAN_GRACE_S", 3.0)
    run_dir = tmp_path / "run"
    _killed_holder_with_a_child(run_dir, child_s)
    began = time.monotonic()
    lock = runlock.acquire(run_dir)
    try:
        assert lock.fd is not None
        assert runlock.read_lock_holder(run_dir / runlock.LOCK_NAME)["pid"] == os.getpid()
        assert time.monotonic() - began < 10
    finally:
        lock.release()


def test_a_live_holder_is_still_refused(tmp_path: Path) -> None:
    """The takeover is for a holder that is gone only: a live one keeps its directory."""
    from nanolab.callbacks import runlock

    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir), "3"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        with pytest.raises(runlock.RunLockedError, match="in use by"):
            runlock.acquire(run_dir)
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _older_lock(
    path: Path, pid: int, written: float | None = None, started: float | None = None
) -> None:
    """A lock file as an older nanolab wrote it: no ``pid_namespace``; ``started`` in local
    time (now unless given), the file's time ``written`` (now unless given)."""
    import json
    import socket

    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "started": stamp}))
    if written is not None:
        os.utime(path, (written, written))


def _dead_pid() -> int:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # exited and reaped
    return dead.pid


@contextlib.contextmanager
def _flock_held(path: Path) -> Iterator[None]:
    """Hold ``flock`` on ``path`` from this process through another open file, as an older
    nanolab's live holder does (in a container with this host's name its pid, numbered in
    the container, may name no process here, or another one)."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield
    finally:
        os.close(fd)


def test_a_held_older_lock_naming_a_dead_pid_is_refused_and_reads_as_live(
    tmp_path: Path,
) -> None:
    """An older nanolab (its lock names no PID namespace) in a container with this host's name
    (``docker run --network host``) numbers its pid apart: the pid read as gone here, and a
    launch took the live run's directory over after the 10 s grace. Held, it is refused at
    once and says how to clear it; readers (status, report) see it as running."""
    from nanolab.callbacks import runlock
    from nanolab.processes import gone_lock_holder, live_lock_holder

    run_dir = tmp_path / "run"
    path = run_dir / runlock.LOCK_NAME
    pid = _dead_pid()
    _older_lock(path, pid)
    with _flock_held(path):
        began = time.monotonic()
        with pytest.raises(runlock.RunLockedError) as refused:
            runlock.acquire(run_dir)
        assert time.monotonic() - began < runlock.ORPHAN_GRACE_S / 2  # not waited out
        line = str(refused.value)
        assert f"in use by pid {pid} on " in line
        assert line.endswith(f"; if that process is gone, delete {path}")
        assert gone_lock_holder(run_dir) is None and live_lock_holder(run_dir) is not None
        assert runlock.read_lock_holder(path)["pid"] == pid  # the holder's file untouched


def test_an_unheld_older_lock_is_gone_and_taken(tmp_path: Path) -> None:
    """Nothing holds its flock: its holder is gone (an older nanolab held it for life), even
    when its pid runs again here (this process: reused); a launch takes the directory."""
    from nanolab.callbacks import runlock
    from nanolab.processes import gone_lock_holder, live_lock_holder

    run_dir = tmp_path / "run"
    path = run_dir / runlock.LOCK_NAME
    for pid in (_dead_pid(), os.getpid()):
        _older_lock(path, pid)
        assert gone_lock_holder(run_dir) is not None and live_lock_holder(run_dir) is None
    lock = runlock.acquire(run_dir)
    try:
        assert runlock.read_lock_holder(path)["pid"] == os.getpid()
        assert "pid_namespace" in runlock.read_lock_holder(path)
    finally:
        lock.release()


def test_without_flock_an_older_lock_is_judged_by_its_pid_and_age(tmp_path: Path) -> None:
    """Where flock cannot be asked, the file alone decides. Gone: its pid runs no more, the
    pid's process started after the file was written (reused), or the file predates this boot;
    a pid that runs since before the file may be the holder."""
    from nanolab.processes import RUN_LOCK_NAME, boot_time, lock_holder_gone, read_lock_holder

    path = tmp_path / RUN_LOCK_NAME

    def gone() -> bool:
        holder = read_lock_holder(path)
        assert holder is not None
        return lock_holder_gone(holder, path, flock_held=None)

    _older_lock(path, _dead_pid())
    assert gone()
    _older_lock(path, os.getpid())  # this process, running since before the file
    assert not gone()
    reused = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        hour_ago = time.time() - 3600
        _older_lock(path, reused.pid, written=hour_ago, started=hour_ago)  # the pid is newer
        assert gone()
    finally:
        reused.kill()
        reused.wait(timeout=30)
    booted = boot_time()
    if booted is not None:
        _older_lock(path, os.getpid(), written=booted - 60, started=booted - 60)  # a past boot
        assert gone()


def test_without_flock_a_network_filesystems_clock_does_not_make_a_holder_gone(
    tmp_path: Path,
) -> None:
    """A network filesystem stamps the file with its server's clock: one an hour behind made a
    live holder's start read as later than its file (a reused pid), and a file written since
    boot as older than the boot; the holder's own start (this host's clock) now counts."""
    from nanolab.processes import RUN_LOCK_NAME, boot_time, lock_holder_gone, read_lock_holder

    path = tmp_path / RUN_LOCK_NAME
    holder_proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _older_lock(path, holder_proc.pid, written=time.time() - 3600)  # started: now
        holder = read_lock_holder(path)
        assert holder is not None and not lock_holder_gone(holder, path, flock_held=None)
        booted = boot_time()
        if booted is not None:
            _older_lock(path, os.getpid(), written=booted - 60)
            holder = read_lock_holder(path)
            assert holder is not None and not lock_holder_gone(holder, path, flock_held=None)
    finally:
        holder_proc.kill()
        holder_proc.wait(timeout=30)


def test_a_readers_look_at_the_lock_never_refuses_a_launch(tmp_path: Path) -> None:
    """A reader asks whether an older nanolab's lock is held by taking a shared lock for an
    instant; a launch asking in that instant asks again instead of refusing."""
    import threading

    from nanolab.callbacks import runlock

    run_dir = tmp_path / "run"
    path = run_dir / runlock.LOCK_NAME
    _older_lock(path, _dead_pid())
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # the reader's instant, stretched
    threading.Timer(0.03, os.close, (fd,)).start()
    lock = runlock.acquire(run_dir)
    try:
        assert runlock.read_lock_holder(path)["pid"] == os.getpid()
    finally:
        lock.release()
