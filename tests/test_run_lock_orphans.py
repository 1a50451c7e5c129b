"""A run killed with SIGKILL (the OOM killer) while its data loader workers ran: the workers
share the run directory's lock (a fork keeps the open file) until they notice their parent is
gone, and a resume started at once was refused as "in use by pid N" for a pid that no longer
ran: a queue job's resume then failed. The next launch now waits a moment and takes over."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
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


def _older_lock(path: Path, pid: int, written: float | None = None) -> None:
    """A lock file as an older nanolab wrote it: no ``pid_namespace``."""
    import json
    import socket

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "started": "then"}))
    if written is not None:
        os.utime(path, (written, written))


def test_an_older_nanolabs_lock_is_judged_by_its_pid_and_age(tmp_path: Path) -> None:
    """It names no PID namespace, and was never judged gone: a stale one blocked for good.
    Gone: its pid runs no more, the pid's process started after the file was written (reused),
    or the file predates this boot; a pid that runs since before the file may be the holder."""
    from nanolab.processes import RUN_LOCK_NAME, boot_time, gone_lock_holder, live_lock_holder

    path = tmp_path / RUN_LOCK_NAME
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # exited and reaped
    _older_lock(path, dead.pid)
    assert gone_lock_holder(tmp_path) is not None and live_lock_holder(tmp_path) is None
    _older_lock(path, os.getpid())  # this process, running since before the file
    assert gone_lock_holder(tmp_path) is None and live_lock_holder(tmp_path) is not None
    reused = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _older_lock(path, reused.pid, written=time.time() - 3600)  # the pid's process is newer
        assert gone_lock_holder(tmp_path) is not None
    finally:
        reused.kill()
        reused.wait(timeout=30)
    booted = boot_time()
    if booted is not None:
        _older_lock(path, os.getpid(), written=booted - 60)  # from an earlier boot
        assert gone_lock_holder(tmp_path) is not None


def test_an_older_nanolabs_stale_lock_no_longer_blocks_a_launch(
    tmp_path: Path, monkeypatch
) -> None:
    """Its holder killed, a child still holding the lock: taken over after the grace, as a
    lock of this version is (it was refused as long as the child lived)."""
    from nanolab.callbacks import runlock

    monkeypatch.setattr(runlock, "ORPHAN_GRACE_S", 1.0)
    run_dir = tmp_path / "run"
    _killed_holder_with_a_child(run_dir, 20.0)
    holder = runlock.read_lock_holder(run_dir / runlock.LOCK_NAME)
    _older_lock(run_dir / runlock.LOCK_NAME, holder["pid"])
    lock = runlock.acquire(run_dir)
    try:
        assert runlock.read_lock_holder(run_dir / runlock.LOCK_NAME)["pid"] == os.getpid()
    finally:
        lock.release()


def test_a_refusal_by_an_older_lock_says_how_to_clear_it(tmp_path: Path) -> None:
    from nanolab.callbacks import runlock

    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir), "3"],
                            stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        _older_lock(run_dir / runlock.LOCK_NAME, proc.pid)  # a live holder, as an older one
        with pytest.raises(runlock.RunLockedError) as refused:
            runlock.acquire(run_dir)
        line = str(refused.value)
        assert f"in use by pid {proc.pid} on " in line
        assert line.endswith(f"; if that process is gone, delete {run_dir / runlock.LOCK_NAME}")
    finally:
        proc.kill()
        proc.wait(timeout=30)
