"""Recovering the jobs of a runner that is gone: a job is never started twice at once, and the
runner that recovers one goes on with its own work meanwhile."""

from __future__ import annotations

import io
import time
from pathlib import Path

from nanolab.queue.db import NewJob, QueueDB
from nanolab.queue.runner import Runner


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
