"""Recovering the jobs of a runner that is gone: a job is never started twice at once, and the
runner that recovers one goes on with its own work meanwhile."""

from __future__ import annotations

import io
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nanolab.processes import process_start
from nanolab.queue.db import Job, NewJob, QueueDB, orphaned
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


def _age_heartbeat(db: QueueDB, runner_id: int, seconds: float = 60.0, **columns: Any) -> None:
    """The runner wrote no heartbeat for ``seconds`` (and its row says ``columns``)."""
    sets = "".join(f", {k} = ?" for k in columns)
    with db.transaction() as c:
        c.execute(
            f"UPDATE runners SET heartbeat = ?{sets} WHERE id = ?",
            (time.time() - seconds, *columns.values(), runner_id),
        )


def test_a_runner_of_this_machine_is_alive_while_its_process_runs(tmp_path: Path, slow_orphan):
    """A runner blocked for over 30 s by another process's lock on the queue wrote no
    heartbeat, and a runner started meanwhile took it for gone by that alone: it SIGTERMed the
    healthy job, which checkpointed and resumed, with "its runner is gone" lines. A runner of
    this machine is now judged by its process (this test's), its start time guarding against a
    reused pid; the heartbeat judges only runners of other machines."""
    path, job_id, proc = slow_orphan
    db = QueueDB(path)
    blocked = db.register_runner()  # this process: alive, but silent for a minute
    with db.transaction() as c:
        c.execute("UPDATE jobs SET runner_id = ? WHERE id = ?", (blocked, job_id))
    _age_heartbeat(db, blocked)
    said = io.StringIO()
    second = Runner(QueueDB(path), stale_s=1.0, out=said)
    second.runner_id = second.db.register_runner()
    second.recover()
    row = db.get(job_id)
    assert (row.status, row.runner_id, row.detail) == ("running", blocked, None), said.getvalue()
    assert said.getvalue() == "" and proc.poll() is None
    assert not orphaned(db, row)
    assert blocked in [r["id"] for r in db.live_runners(stale_s=1.0)]

    # The same pid started anew (reused): another process; the runner is gone.
    boot = process_start(os.getpid()).partition(":")[0]
    _age_heartbeat(db, blocked, pid_start=f"{boot}:1")
    assert orphaned(db, db.get(job_id))
    second.recover()
    assert f"job {job_id} z: its runner is gone" in said.getvalue()


def test_a_runner_of_another_machine_with_this_hosts_name_is_judged_by_heartbeat(tmp_path) -> None:
    """Machines cloned from one image share a host name, and every Linux host's first PID
    namespace is ``pid:[4026531836]``: a live runner of another machine sharing the queue (NFS)
    was judged by a pid of this one (gone here), and its running jobs taken over. Its recorded
    start's boot id is another machine's: its heartbeat judges it."""
    db = QueueDB(tmp_path / "q.db")
    (job,) = db.add_jobs([_job(tmp_path)])
    there = db.register_runner()
    assert db.claim(job.id, there, None, time.time())
    _age_heartbeat(db, there, seconds=1.0, pid=1 << 22, pid_start="boot-of-another-machine:77")
    assert not orphaned(db, db.get(job.id))  # same name and namespace, its pid not ours
    _age_heartbeat(db, there, seconds=60.0)
    assert orphaned(db, db.get(job.id))


def test_a_runner_of_another_machine_is_judged_by_its_heartbeat(tmp_path: Path) -> None:
    db = QueueDB(tmp_path / "q.db")
    (job,) = db.add_jobs([_job(tmp_path)])
    there = db.register_runner()
    assert db.claim(job.id, there, None, time.time())
    _age_heartbeat(db, there, seconds=1.0, host="elsewhere", pid=1 << 22)
    assert not orphaned(db, db.get(job.id))  # its pid means nothing here
    _age_heartbeat(db, there, seconds=60.0)
    assert orphaned(db, db.get(job.id))


def test_a_queue_from_before_the_runner_columns_keeps_working(tmp_path: Path) -> None:
    """A queue whose runners table lacks ``pid_namespace``/``pid_start`` (written by an earlier
    nanolab) opens, gains them, and judges its old runner rows as before: this machine's by
    heartbeat and pid."""
    import sqlite3

    path = tmp_path / "q.db"
    db = QueueDB(path)
    (job,) = db.add_jobs([_job(tmp_path)])
    db.close()
    conn = sqlite3.connect(path, isolation_level=None)
    for column in ("pid_namespace", "pid_start"):
        conn.execute(f"ALTER TABLE runners DROP COLUMN {column}")
    now = time.time()
    conn.execute(
        "INSERT INTO runners(pid, host, started, heartbeat) VALUES (?, ?, ?, ?)",
        (os.getpid(), socket.gethostname(), now, now),
    )
    conn.execute("UPDATE jobs SET status = 'running', runner_id = 1 WHERE id = ?", (job.id,))
    conn.close()
    db = QueueDB(path)
    columns = {r[1] for r in db.conn.execute("PRAGMA table_info(runners)")}
    assert {"pid_namespace", "pid_start"} <= columns
    assert db.runner(1)["pid_namespace"] is None
    assert not orphaned(db, db.get(job.id))
    _age_heartbeat(db, 1)
    assert orphaned(db, db.get(job.id))
    assert db.register_runner() == 2 and db.runner(2)["pid_start"] is not None
