"""A queue database whose write lock another process holds for long (a shell's ``sqlite3``, a
backup): the commands say the queue is busy (never that it is damaged), and the runner waits."""

from __future__ import annotations

import io
import os
import sqlite3
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from test_queue_recover import QuickJobs

import nanolab.queue.db as queue_db
from nanolab.queue.cli import main
from nanolab.queue.db import Job, NewJob, QueueDB
from nanolab.queue.runner import EXIT_PREEMPTED, Active


def _add(path: Path, *names: str) -> None:
    QueueDB(path).add_jobs([
        NewJob(name=n, config="c.yaml", args=[], seed=None, cwd=str(path.parent),
               run_dir=str(path.parent / "runs" / n))
        for n in names
    ])  # fmt: skip


@contextmanager
def locked(path: Path, after_s: float = 0.0, for_s: float = 60.0) -> Iterator[threading.Event]:
    """Another connection takes the queue's write lock ``after_s`` from now and holds it for
    ``for_s`` seconds, or until the block ends; the event is set once it holds the lock."""
    holding, done = threading.Event(), threading.Event()

    def hold() -> None:
        conn = sqlite3.connect(path, isolation_level=None)
        time.sleep(after_s)
        conn.execute("BEGIN IMMEDIATE")
        holding.set()
        done.wait(for_s)
        conn.execute("COMMIT")
        conn.close()

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        yield holding
    finally:
        done.set()
        thread.join()


def test_a_queue_held_locked_is_said_busy_not_damaged(tmp_path: Path, capsys, monkeypatch):
    """``queue rm`` against a queue another process kept locked past the 30 s wait said the
    database was "damaged or not SQLite (database is locked)" and advised moving it aside,
    which throws a healthy queue away. It is now one line saying the queue is busy, exit 2:
    when the lock is met opening the queue, and when met by a later write."""
    monkeypatch.setattr(queue_db, "BUSY_TIMEOUT_S", 0.2)
    path = tmp_path / "q.db"
    _add(path, "p")
    with locked(path) as holding:
        assert holding.wait(5)
        assert main(["rm", "--db", str(path), "p"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "q.db is busy: another process has held its write lock for over 0 s" in err, err
    assert "the queue is healthy" in err and "damaged" not in err and ".bad" not in err, err

    def locked_meanwhile(*args, **kw):
        raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(QueueDB, "remove_as_seen", locked_meanwhile)
    assert main(["rm", "--db", str(path), "p"]) == 2
    err = capsys.readouterr().err
    assert "is busy: another process has held its write lock" in err and ".bad" not in err, err
    assert [j.name for j in QueueDB(path).jobs()] == ["p"]


def test_a_runner_waits_for_a_queue_held_locked_and_its_jobs_finish(tmp_path: Path) -> None:
    """The runner died of a lock held past 30 s (its heartbeat or a job's outcome could not be
    written), leaving its job "running: its runner is gone". It now retries its writes with
    backoff, says so once, and records every outcome once the lock is let go."""
    path = tmp_path / "q.db"
    _add(path, "a", "b")
    said = io.StringIO()
    runner = QuickJobs(QueueDB(path), heartbeat_s=0.1, poll_s=0.05, busy_try_s=0.1, out=said)
    with locked(path, after_s=0.3, for_s=1.5):
        assert runner.run() == 0
    text = said.getvalue()
    assert text.count("is busy: another process has held its write lock for over 0 s") == 1, text
    assert "the queue database can be written again (waited" in text, text
    assert {j.name: j.status for j in QueueDB(path).jobs()} == {"a": "done", "b": "done"}, text


@pytest.mark.parametrize("message", ["disk I/O error", "database disk image is malformed"])
def test_other_sqlite_errors_are_not_taken_for_a_busy_queue(message: str) -> None:
    assert queue_db.busy_db(Path("q.db"), sqlite3.OperationalError(message)) is None


def test_a_ctrl_c_while_the_queue_waits_for_its_lock_is_one_line(tmp_path: Path):
    """A Ctrl-C while `queue rm` (or `add`, `run`) waited for a lock another process held was
    a traceback out of SQLite's wait once the lock came free; it is one line and exit 130. It
    was heard only when SQLite's wait ended (up to 30 s); it is now heard at once."""
    import os
    import signal
    import subprocess
    import sys

    path = tmp_path / "q.db"
    _add(path, "a")
    with locked(path, for_s=60.0) as holding:
        assert holding.wait(10)
        proc = subprocess.Popen(
            [sys.executable, "-m", "nanolab", "queue", "rm", "a", "--db", str(path)],
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        time.sleep(3.0)  # it has opened the queue and waits for the lock
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        heard_s = time.monotonic() - sent
    assert heard_s < 2.0, (heard_s, err[-2000:])
    assert proc.returncode == 130, err[-2000:]
    assert err.strip().splitlines() == ["nanolab queue rm: interrupted"], err[-2000:]
    assert [j.name for j in QueueDB(path).jobs()] == ["a"]


class HeardSignals(QuickJobs):
    """Starts each job as a ``sleep 30`` that the runner's stop ends, and records when its
    signal handler ran."""

    heard: list[float]

    def _spawn(self, job: Job, units: list[int], *args: Any, **kw: Any) -> None:
        proc = subprocess.Popen(["sleep", "30"])
        log = open(Path(job.cwd) / f"{job.name}.log", "a+b")  # noqa: SIM115 - reap closes it
        assert self.db.set_job_pid(job.id, proc.pid, log.name)
        self._active[job.id] = Active(job, proc, units, time.time(), log)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.heard.append(time.monotonic())
        super()._on_signal(signum, frame)


def test_a_runner_waiting_for_the_lock_hears_a_signal_at_once(tmp_path: Path) -> None:
    """A SIGTERM to a runner whose write waited for another process's lock was handled only
    when SQLite's wait of ``busy_try_s`` (5 s) ended: its jobs were asked to checkpoint that
    late. The handler now runs within a fraction of a second; the runner still records every
    outcome once the lock is let go."""
    import os
    import signal

    path = tmp_path / "q.db"
    _add(path, "a")
    runner = HeardSignals(QueueDB(path), heartbeat_s=0.1, poll_s=0.05, out=io.StringIO())
    runner.heard = []
    with locked(path, after_s=0.5, for_s=5.0) as holding:
        sent: list[float] = []

        def stop() -> None:
            assert holding.wait(10)
            time.sleep(1.0)  # the runner's writes wait for the lock by now
            sent.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGTERM)

        timer = threading.Thread(target=stop)
        timer.start()
        assert runner.run() == EXIT_PREEMPTED
        timer.join()
    assert runner.heard and runner.heard[0] - sent[0] < 1.0, (runner.heard, sent)
    assert QueueDB(path).jobs()[0].status == "preempted"


class HalfSecondJobs(QuickJobs):
    """Starts each job as a ``sleep 0.5``, watched through a pidfd as the runner's own."""

    def _spawn(self, job: Job, units: list[int], *args: Any, **kw: Any) -> None:
        proc = subprocess.Popen(["sleep", "0.5"])
        log = open(Path(job.cwd) / f"{job.name}.log", "a+b")  # noqa: SIM115 - reap closes it
        assert self.db.set_job_pid(job.id, proc.pid, log.name)
        pidfd = os.pidfd_open(proc.pid) if hasattr(os, "pidfd_open") else None
        self._active[job.id] = Active(job, proc, units, time.time(), log, pidfd)


def test_a_jobs_run_time_leaves_out_the_runners_wait_for_the_lock(tmp_path: Path) -> None:
    """A job that exited while its runner waited for another process's lock on the queue was
    recorded as running until the runner could write again: a 0.5 s job held up 4 s had
    ``run_seconds`` 4.3, which ``queue ls``, ``status`` and the estimates of the same config
    then used. It counts its process's wall time, start to exit, as seen meanwhile."""
    path = tmp_path / "q.db"
    _add(path, "a")
    said = io.StringIO()
    runner = HalfSecondJobs(QueueDB(path), heartbeat_s=0.1, poll_s=0.05, busy_try_s=0.3, out=said)
    with locked(path, after_s=0.2, for_s=4.0):
        assert runner.run() == 0
    (job,) = QueueDB(path).jobs()
    assert job.status == "done" and "waited" in said.getvalue(), said.getvalue()
    assert 0.5 <= job.run_seconds < 1.0, (job.run_seconds, said.getvalue())
