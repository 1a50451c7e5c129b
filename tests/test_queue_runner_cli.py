"""What the README promises about ``nanolab queue run``, through the real runner on CPU:
``--gpus 0,1`` (each job's ``CUDA_VISIBLE_DEVICES``/``HIP_VISIBLE_DEVICES``, a ``devices: 2`` job
getting both ids; dummy ids on CPU), ``--until``, ``--slots``, ``--wait``, ``queue rm`` of a
running job, and a second Ctrl-C to the runner. Jobs are real ``nanolab fit`` processes; what a
job saw is recorded by ``cli_probes`` callbacks in its config.

Each test names, in its docstring, the mutation of nanolab it was seen to catch.
"""

from __future__ import annotations

import contextlib
import json
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

TESTS = Path(__file__).resolve().parent
ENV_NAMES = ["CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"]


def probe_env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    for name in ENV_NAMES:
        env.pop(name, None)  # what a job sees must come from the runner
    return env


@pytest.fixture(autouse=True)
def _no_leftover_processes(tmp_path: Path):
    """A failed wait leaves a `queue run --wait` runner and its jobs behind: kill every process
    whose command line names this test's folder, so nothing outlives the test."""
    yield
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if str(tmp_path).encode() in cmdline:
            with contextlib.suppress(OSError):
                os.kill(int(entry), signal.SIGKILL)


def start_runner(tmp_path: Path, db: Path, out: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "nanolab", "queue", "run", "--db", str(db), *args],
        cwd=tmp_path, env=probe_env(), stdout=out.open("a"), stderr=subprocess.STDOUT,
    )  # fmt: skip


def wait_until(predicate, what: str, proc: subprocess.Popen, out: Path, timeout: float = 240):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, (
            f"runner exited ({proc.returncode}) before {what}:\n" + (out.read_text()[-2000:])
        )
        assert time.monotonic() < deadline, (
            f"timed out waiting for {what}:\n" + (out.read_text()[-2000:])
        )
        time.sleep(0.02)


def job_config(tmp_path: Path, dataset: Path, name: str, steps: int, callbacks: list, **extra):
    cfg = tiny_overrides(
        dataset, tmp_path / "runs", trainer__max_steps=steps, trainer__accelerator="cpu", **extra
    )  # device ids are dummies here: the jobs run on CPU whatever the machine has
    del cfg["run"]["name"]  # the queue names runs
    cfg["checkpoint"] = {"every_n_steps": 100_000}
    cfg["trainer"]["callbacks"] = callbacks
    return write_config(tmp_path / f"{name}.yaml", cfg)


def seen_env(run_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(run_dir.glob("env-*.json"))]


@pytest.mark.slow  # 30-100 s on 2 cores; `pytest -m slow`
@pytest.mark.timeout(600)
def test_gpus_give_each_job_its_ids_and_until_defers_what_would_end_late(
    tmp_path, char_dataset, monkeypatch
):
    """The runner of ``queue run --gpus 0,1 --until +30m``: two 1-device jobs run at once, one on
    id 0 and one on id 1 (``CUDA_VISIBLE_DEVICES`` and ``HIP_VISIBLE_DEVICES``); a
    ``trainer.devices: 2`` job waits for both and gets ``0,1`` in each of its ranks; a job that
    would end after the deadline is not started, and the runner returns when nothing else can
    run. ``queue run --gpus`` refuses ids on a machine without GPUs (tested with the CLI's other
    errors), so the runner is driven in-process here with dummy ids; its jobs are real
    ``nanolab fit`` processes on CPU.

    Mutations caught: the runner exporting only the first of a job's ids (the 2-device job sees
    ``0``); ``--until`` ignored (the long job starts and the runner never returns).
    """
    from nanolab.queue.runner import Runner

    monkeypatch.chdir(tmp_path)
    for name, value in probe_env().items():
        monkeypatch.setenv(name, value)
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    probe = [{"class_path": "cli_probes.EnvProbe", "init_args": {"names": ENV_NAMES}}]
    one = job_config(tmp_path, char_dataset, "one", 6, probe)
    two = job_config(
        tmp_path, char_dataset, "two", 4, probe,
        trainer__devices=2, trainer__strategy="ddp",
    )  # fmt: skip
    db = tmp_path / "q.db"
    assert main(["add", str(one), "--db", str(db), "--seeds", "1,2"]) == 0
    assert main(["add", str(two), "--db", str(db), "--name", "wide"]) == 0
    long_ = ["--set", "trainer.max_steps=100000000", "--name", "long"]
    assert main(["add", str(one), "--db", str(db), *long_]) == 0
    out = tmp_path / "runner.out"
    with out.open("w") as log:
        runner = Runner(QueueDB(db), gpus=["0", "1"], until=time.time() + 1800, out=log)
        assert runner.run() == 0
    text = out.read_text()
    assert "job 4 long: deferred" in text

    jobs = {j.name: j for j in QueueDB(db).jobs()}
    assert {n: (j.status, j.gpus) for n, j in jobs.items()} == {
        "one-s1": ("done", "0"), "one-s2": ("done", "1"), "wide": ("done", "0,1"),
        "long": ("pending", None),
    }, text  # fmt: skip
    runs = tmp_path / "runs"
    for name, ids in (("one-s1", "0"), ("one-s2", "1")):
        (seen,) = seen_env(runs / name)
        assert seen["CUDA_VISIBLE_DEVICES"] == seen["HIP_VISIBLE_DEVICES"] == ids, (name, seen)
    wide = seen_env(runs / "wide")
    assert sorted(s["global_rank"] for s in wide) == [0, 1]
    assert all(s["CUDA_VISIBLE_DEVICES"] == s["HIP_VISIBLE_DEVICES"] == "0,1" for s in wide)
    assert not (runs / "long").exists()
    # Process lifetimes as the runner recorded them (spawn to exit):
    a, b, w = jobs["one-s1"], jobs["one-s2"], jobs["wide"]
    assert a.last_started < b.ended and b.last_started < a.ended  # the 1-device jobs overlapped
    assert w.last_started >= max(a.ended, b.ended)  # the 2-device job waited for both ids


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_wait_slots_rm_and_a_second_ctrl_c(tmp_path, char_dataset, monkeypatch):
    """``queue run --slots 2 --wait`` with an empty queue stays up and starts two jobs added
    later, both at once; ``queue rm`` of one of them makes it checkpoint at its step boundary
    and stop (exit 75), and the runner lets it go; Ctrl-C to the runner asks the other to
    checkpoint, and a second Ctrl-C stops it at once, without a checkpoint (each step takes
    10 s here once the job has its first signal, ``cli_probes.LingerAfterSignal``, so the
    second Ctrl-C lands inside it every time).

    Mutations caught: ``--wait`` ignored (the runner exits on the empty queue); ``--slots``
    ignored (the second job never starts while the first runs); ``queue rm`` not signalling a
    running job (it trains on); the runner not forwarding the second signal (the job
    checkpoints and exits 75: "interrupted at step N").
    """
    monkeypatch.chdir(tmp_path)
    slow = [{"class_path": "cli_probes.SlowSteps", "init_args": {"seconds": 0.2}}]
    linger = [{"class_path": "cli_probes.LingerAfterSignal", "init_args": {"seconds": 10.0}}]
    removed = job_config(tmp_path, char_dataset, "removed", 100_000, slow)
    stopped = job_config(tmp_path, char_dataset, "stopped", 100_000, slow + linger)
    db = tmp_path / "q.db"
    out = tmp_path / "runner.out"
    runner = start_runner(tmp_path, db, out, "--slots", "2", "--wait")
    wait_until(lambda: "2 CPU slot(s)" in out.read_text(), "the runner to start", runner, out)
    time.sleep(1.0)  # an empty queue: a runner without --wait would be gone by now
    assert runner.poll() is None, out.read_text()
    assert main(["add", str(removed), "--db", str(db), "--name", "slow-s1"]) == 0
    assert main(["add", str(stopped), "--db", str(db), "--name", "slow-s2"]) == 0
    runs = tmp_path / "runs"

    def training(name: str) -> bool:
        return bool(read_records(runs / name / "metrics.jsonl", "train"))

    wait_until(lambda: training("slow-s1") and training("slow-s2"), "two jobs", runner, out)

    rm = subprocess.run(
        [sys.executable, "-m", "nanolab", "queue", "rm", "slow-s1", "--db", str(db)],
        cwd=tmp_path, env=probe_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert rm.returncode == 0, rm.stderr
    assert "asked it to checkpoint and stop" in rm.stdout
    wait_until(lambda: "removed from the queue meanwhile" in out.read_text(), "the rm", runner, out)
    assert "slow-s1: exited (75)" in out.read_text()
    end = read_records(runs / "slow-s1" / "metrics.jsonl", "end")[-1]
    assert end["reason"] == "preempted"
    assert (runs / "slow-s1" / "checkpoints" / f"step-{end['step']:08d}.ckpt").is_file()
    assert [j.name for j in QueueDB(db).jobs()] == ["slow-s2"]

    runner.send_signal(signal.SIGINT)
    wait_until(lambda: "SIGINT: asking 1 job(s)" in out.read_text(), "Ctrl-C", runner, out)
    job_log = Path(QueueDB(db).jobs()[0].log)
    # A person's second Ctrl-C comes after the job got the first (two signals sent within a
    # moment can reach the job as one).
    wait_until(lambda: "received SIGTERM" in job_log.read_text(), "the job's signal", runner, out)
    runner.send_signal(signal.SIGINT)
    assert runner.wait(timeout=120) == 75, out.read_text()[-3000:]
    assert "SIGINT again: stopping jobs now" in out.read_text()
    (job,) = QueueDB(db).jobs()
    assert (job.status, job.detail) == ("preempted", "stopped with the runner (SIGTERM)")
    assert "second SIGTERM: exiting now without a checkpoint" in job_log.read_text()
    assert not list((runs / "slow-s2" / "checkpoints").glob("step-*.ckpt"))


def test_a_signal_the_runner_starts_ignoring_stays_ignored():
    """``nohup nanolab queue run &`` starts with SIGHUP ignored: the runner keeps it so (a
    logout once stopped the whole night's queue), and handles the signals it may handle."""
    from types import SimpleNamespace

    from nanolab.queue.runner import Runner

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    runner = SimpleNamespace(_on_signal=lambda *a: None, _wake_r=None)
    try:
        previous = Runner._install_signals(runner)  # type: ignore[arg-type]
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is runner._on_signal
        assert signal.SIGHUP not in previous and signal.SIGTERM in previous
        Runner._restore_signals(runner, previous)  # type: ignore[arg-type]
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
