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
