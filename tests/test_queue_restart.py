"""The queue runner end to end, with real ``nanolab fit`` jobs: the runner is SIGKILLed mid-job
while a second shell adds a job, a new runner takes over, a job that breaks at run time is
marked failed and the queue goes on, and every job finishes exactly once (checked in the
database and in each run's ``metrics.jsonl``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import tiny_overrides, write_config

from nanolab.queue.cli import main
from nanolab.queue.db import QueueDB
from nanolab.runlog import read_records

STEPS = 40


def start_runner(tmp_path: Path, db: Path, out: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "nanolab", "queue", "run", "--db", str(db)],
        cwd=tmp_path,
        env=env,
        stdout=out.open("a"),
        stderr=subprocess.STDOUT,
    )


def wait_until(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None:
            assert proc.poll() is None, f"exited ({proc.returncode}) while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_runner_killed_mid_job_then_restarted(
    tmp_path: Path, char_dataset: Path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=STEPS)
    del cfg["run"]["name"]
    cfg["run"]["eval_every_steps"] = 10
    cfg["checkpoint"] = {"every_n_steps": 2, "keep_last": 2}
    tiny = write_config(tmp_path / "tiny.yaml", cfg)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be or not to be, that is the question\n" * 200)
    broken = write_config(
        tmp_path / "broken.yaml",
        {
            **cfg,
            "data": {**cfg["data"], "source": [str(corpus)], "dataset_dir": str(tmp_path / "d2")},
        },
    )
    db = tmp_path / "q.db"
    assert main(["add", str(tiny), "--db", str(db), "--seeds", "1,2"]) == 0
    assert main(["add", str(broken), "--db", str(db), "--name", "broken"]) == 0
    corpus.unlink()  # the config was fine at add time; the job breaks at run time

    out = tmp_path / "runner.out"
    runner = start_runner(tmp_path, db, out)
    first = tmp_path / "runs" / "tiny-s1"
    wait_until(
        lambda: any((first / "checkpoints").glob("step-*.ckpt")), 300, "a checkpoint", runner
    )
    # A second shell adds a job while the runner runs...
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    adder = subprocess.Popen(
        [sys.executable, "-m", "nanolab", "queue", "add", str(tiny), "--db", str(db), "--name", "late"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    # ...and the runner dies without a chance to clean up.
    runner.send_signal(signal.SIGKILL)
    assert runner.wait(timeout=60) == -signal.SIGKILL
    killed_at = time.time()
    job = QueueDB(db).resolve(["tiny-s1"])[0]
    assert job.status == "running"  # the database still says so: only a new runner can tell
    assert adder.wait(timeout=300) == 0, adder.stdout.read()

    runner = start_runner(tmp_path, db, out)
    assert runner.wait(timeout=600) == 1, out.read_text()[-3000:]  # 1: the broken job failed
    text = out.read_text()
    assert "job 1 tiny-s1: recovered (will resume from its checkpoint)" in text

    qdb = QueueDB(db)
    jobs = {j.name: j for j in qdb.jobs()}
    assert {n: j.status for n, j in jobs.items()} == {
        "tiny-s1": "done", "tiny-s2": "done", "broken": "failed", "late": "done",
    }  # fmt: skip
    assert "corpus.txt" in jobs["broken"].detail and "does not exist" in jobs["broken"].detail
    assert jobs["tiny-s1"].attempts == 2
    assert [jobs[n].attempts for n in ("tiny-s2", "broken", "late")] == [1, 1, 1]

    for name in ("tiny-s1", "tiny-s2", "late"):
        records = read_records(tmp_path / "runs" / name / "metrics.jsonl")
        ends = [r for r in records if r["event"] == "end"]
        assert [e["reason"] for e in ends if e["reason"] == "completed"] == ["completed"], name
        assert ends[-1]["step"] == STEPS and records[-1]["event"] == "end"
    # The killed job: its process checkpointed and stopped when its runner died (parent-death
    # signal), and the new runner resumed it from that checkpoint, never running it twice at once.
    records = read_records(first / "metrics.jsonl")
    starts = [r for r in records if r["event"] == "start"]
    ends = [r for r in records if r["event"] == "end"]
    assert len(starts) == 2 and starts[0]["resumed_from_step"] is None
    assert ends[0]["reason"] == "preempted" and ends[0]["time"] <= killed_at + 60
    assert starts[1]["resumed_from_step"] == ends[0]["step"] > 0
    assert starts[1]["time"] > ends[0]["time"]
    steps = [r["step"] for r in records if r["event"] == "train"]
    assert steps == list(range(1, STEPS + 1))  # the preemption checkpoint was at the last step
    gaps = qdb.event_values("gap")
    assert len(gaps) >= 2 and max(gaps) < 5.0
    print(f"job-to-job gaps (s): {[round(g, 3) for g in gaps]}")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_runner_sigterm_preempts_its_jobs(tmp_path: Path, char_dataset: Path, monkeypatch) -> None:
    """Stopping the runner (Ctrl-C, a scheduler's SIGTERM) stops its jobs at a step boundary with
    a checkpoint; they are marked preempted and the next ``queue run`` resumes them."""
    monkeypatch.chdir(tmp_path)
    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=2000)
    del cfg["run"]["name"]
    cfg["checkpoint"] = {"every_n_steps": 5}
    tiny = write_config(tmp_path / "tiny.yaml", cfg)
    db = tmp_path / "q.db"
    assert main(["add", str(tiny), "--db", str(db), "--name", "long"]) == 0
    out = tmp_path / "runner.out"
    runner = start_runner(tmp_path, db, out)
    run_dir = tmp_path / "runs" / "long"
    wait_until(
        lambda: any((run_dir / "checkpoints").glob("step-*.ckpt")), 300, "a checkpoint", runner
    )
    runner.send_signal(signal.SIGTERM)
    assert runner.wait(timeout=120) == 75, out.read_text()[-2000:]
    (job,) = QueueDB(db).jobs()
    end = read_records(run_dir / "metrics.jsonl", "end")[-1]
    assert end["reason"] == "preempted" and 0 < end["step"] < 2000
    assert (job.status, job.detail, job.exit_code) == (
        "preempted",
        f"interrupted at step {end['step']}",
        75,
    )
    assert (run_dir / "checkpoints" / f"step-{end['step']:08d}.ckpt").is_file()
    assert "asking 1 job(s) to checkpoint and stop" in out.read_text()
