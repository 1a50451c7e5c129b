"""Recovering the jobs of a runner that is gone: a job is never started twice at once, and the
runner that recovers one goes on with its own work meanwhile."""

from __future__ import annotations

import io
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nanolab.queue.db import Job, NewJob, QueueDB
from nanolab.queue.runner import EXIT_PREEMPTED, Active, Runner


def _job(tmp_path: Path, name: str = "z") -> NewJob:
    return NewJob(name=name, config="c.yaml", args=[], seed=None, cwd=str(tmp_path),
                  run_dir=str(tmp_path / "runs" / name))  # fmt: skip


def test_a_recovery_from_a_stale_row_leaves_another_runners_live_attempt(tmp_path: Path) -> None:
    """Two runners recover one orphan; the slower one read the row before the quicker one
    recovered the job and started attempt 2. Its update checked only ``status = 'running'``, so
    it set attempt 2, live, claimable again: the job would run twice at once. The update now
    holds only for the row as it was seen (same runner, same attempt)."""
    path = tmp_path / "q.db"
    db = QueueDB(path)
    (job,) = db.add_jobs([_job(tmp_path)])
    gone = db.register_runner()
    assert db.claim(job.id, gone, None, time.time())
    db.stop_runner(gone)  # its runner is gone
    stale = db.get(job.id)  # what the slower runner read
    quicker = db.register_runner()
    assert db.set_status(job.id, "preempted", expect=("running",))  # the quicker one recovers
    assert db.claim(job.id, quicker, None, time.time())  # and starts attempt 2
    slower = Runner(QueueDB(path), out=io.StringIO())
    slower.runner_id = slower.db.register_runner()
    slower.db.jobs = lambda statuses=None: [stale]  # type: ignore[method-assign]
    slower.recover()
    row = db.get(job.id)
    assert (row.status, row.runner_id, row.attempts) == ("running", quicker, 2)


# A gone runner's job process that is slow to exit: it ignores SIGTERM (a checkpoint that takes
# a while), says so on stdout, and would sleep on for a minute.
SLOW_ORPHAN = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(60)"
)


@pytest.fixture
def slow_orphan(tmp_path: Path) -> Iterator[tuple[Path, int, subprocess.Popen]]:
    """A queue whose job ``z`` is ``running`` under a gone runner, its process still alive."""
    path = tmp_path / "q.db"
    db = QueueDB(path)
    (job,) = db.add_jobs([_job(tmp_path)])
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_ORPHAN, "--run.name=z"], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    gone = db.register_runner()
    assert db.claim(job.id, gone, None, time.time())
    assert db.set_job_pid(job.id, proc.pid, "log")
    db.stop_runner(gone)
    yield path, job.id, proc
    proc.kill()
    proc.wait()


class QuickJobs(Runner):
    """Starts each claimed job as a short ``sleep`` instead of ``nanolab fit`` and records when
    it heartbeats."""

    beats: list[float]

    def _spawn(self, job: Job, units: list[int], *args: Any, **kw: Any) -> None:
        proc = subprocess.Popen(["sleep", "0.2"])
        log = open(Path(job.cwd) / f"{job.name}.log", "a+b")  # noqa: SIM115 - reap closes it
        assert self.db.set_job_pid(job.id, proc.pid, log.name)
        self._active[job.id] = Active(job, proc, units, time.time(), log)
        self.say(f"job {job.id} {job.name}: starting")

    def run(self) -> int:
        self.beats = []
        beat = self.db.heartbeat

        def heartbeat(runner_id: int) -> None:
            self.beats.append(time.monotonic())
            beat(runner_id)

        self.db.heartbeat = heartbeat  # type: ignore[method-assign]
        return super().run()


def test_a_runner_stopping_an_orphan_heartbeats_and_runs_its_own_jobs(
    tmp_path: Path, slow_orphan
) -> None:
    """While it waited (up to ``grace_s``) for a gone runner's job process to exit, a runner sent
    no heartbeat and reaped nothing: its own healthy jobs showed "its runner is gone" and a
    second runner stopped them. The orphan is now watched each loop turn: the runner's own job
    starts and finishes meanwhile, heartbeats go on, and the orphan that ignores SIGTERM is
    SIGKILLed at its deadline, then recovered and resumed by this runner."""
    path, orphan_id, proc = slow_orphan
    (own,) = QueueDB(path).add_jobs([_job(tmp_path, "own")])
    said = io.StringIO()
    runner = QuickJobs(QueueDB(path), grace_s=2.0, heartbeat_s=0.1, poll_s=0.05, out=said)
    started = time.monotonic()
    assert runner.run() == 0
    text = said.getvalue()
    lines = text.splitlines()

    def at(needle: str) -> int:
        return next(i for i, line in enumerate(lines) if needle in line)

    assert at(f"job {own.id} own: done") < at("did not exit within 2s; killed it (SIGKILL)"), text
    assert at("killed it (SIGKILL)") < at(f"job {orphan_id} z: recovered") < at("z: done"), text
    assert proc.wait(timeout=5) == -signal.SIGKILL
    beats = [started, *runner.beats]
    assert max(b - a for a, b in itertools.pairwise(beats)) < 1.0, beats
    assert {j.name: j.status for j in QueueDB(path).jobs()} == {"z": "done", "own": "done"}


def test_a_signal_ends_a_runners_wait_for_an_orphan(tmp_path: Path, slow_orphan) -> None:
    """SIGTERM (or Ctrl-C) to a runner waiting for an orphan's process was noticed only when the
    wait ended (``grace_s``, 120 s by default). It now stops the runner at once; the orphan
    stays taken over by the stopped runner, so the next runner recovers it."""
    path, orphan_id, proc = slow_orphan
    said = io.StringIO()
    runner = QuickJobs(QueueDB(path), grace_s=60.0, out=said)
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    started = time.monotonic()
    assert runner.run() == EXIT_PREEMPTED
    assert time.monotonic() - started < 5.0, said.getvalue()
    assert proc.poll() is None  # still exiting: neither killed nor waited for
    assert (
        f"job {orphan_id} z: its process {proc.pid} is still exiting; the next" in said.getvalue()
    )
    row = QueueDB(path).get(orphan_id)
    assert (row.status, row.runner_id) == ("running", runner.runner_id)
    proc.kill()
    proc.wait()
    nxt = QuickJobs(QueueDB(path), out=io.StringIO())
    nxt.recover()
    assert QueueDB(path).get(orphan_id).status == "preempted"
