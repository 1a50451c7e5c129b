"""``queue add --backfill``: a low-priority job fills an idle CPU slot, gives it back within one
optimizer step of a normal job's arrival (SIGTERM -> checkpoint -> exit 75), resumes after the
normal job, and ends with weights bit-identical to an uninterrupted run. Real ``nanolab fit``
processes and a real runner.

Each test names, in its docstring, the mutation of nanolab it was seen to catch.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import run_nanolab, tiny_overrides, write_config

from nanolab.queue.cli import main
from nanolab.queue.db import QueueDB
from nanolab.runlog import read_records

TESTS = Path(__file__).resolve().parent
STEPS = 14


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    return ckpt["state_dict"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_backfill_gives_way_within_a_step_and_resumes_bit_exactly(
    tmp_path: Path, char_dataset: Path, monkeypatch
) -> None:
    """One CPU slot. A backfill job (0.4 s steps) starts on the empty queue; a normal job is
    added while it trains. Within a quarter second the runner asks it to stop; it finishes the
    step in progress (at most one more optimizer step after the signal), checkpoints and exits
    75; the normal job starts once it has gone, and the backfill job resumes after that from its
    checkpoint. Its final weights equal, bit for bit, those of the same config trained without
    interruption by ``nanolab fit``.

    Mutations caught: backfill ignored (the normal job waits until the backfill job ends:
    no ``preempted`` record); SIGTERM not sent (same); the backfill job restarted from scratch
    (steps 1.. twice in its log); the normal job started while the backfill job still ran (its
    start precedes the backfill job's exit).
    """
    monkeypatch.chdir(tmp_path)
    slow = [{"class_path": "cli_probes.SlowSteps", "init_args": {"seconds": 0.4}}]
    cfg = tiny_overrides(
        char_dataset, tmp_path / "runs", trainer__max_steps=STEPS, trainer__accelerator="cpu"
    )
    cfg["run"]["name"] = "ref"
    cfg["checkpoint"] = {"every_n_steps": 100_000}  # only the preemption saves mid-run
    cfg["trainer"]["callbacks"] = slow
    long_cfg = write_config(tmp_path / "long.yaml", cfg)
    short = tiny_overrides(
        char_dataset, tmp_path / "runs", trainer__max_steps=4, trainer__accelerator="cpu"
    )
    del short["run"]["name"]
    short_cfg = write_config(tmp_path / "short.yaml", short)

    db = tmp_path / "q.db"
    assert main(["add", str(long_cfg), "--db", str(db), "--name", "bf", "--backfill"]) == 0
    out = tmp_path / "runner.out"
    runner = subprocess.Popen(
        [sys.executable, "-m", "nanolab", "queue", "run", "--db", str(db)],
        cwd=tmp_path, env=_env(), stdout=out.open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    bf_log = tmp_path / "runs" / "bf" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while len(read_records(bf_log, "train")) < 3:
        assert runner.poll() is None and time.monotonic() < deadline, out.read_text()[-2000:]
        time.sleep(0.05)
    assert main(["add", str(short_cfg), "--db", str(db), "--name", "normal"]) == 0
    added = time.time()
    # meanwhile, the uninterrupted reference run of the same config
    ref = run_nanolab("fit", "--config", str(long_cfg), cwd=tmp_path, env=_env(), timeout=300)
    assert ref.returncode == 0, ref.stderr[-2000:]
    assert runner.wait(timeout=400) == 0, out.read_text()[-3000:]
    text = out.read_text()

    jobs = {j.name: j for j in QueueDB(db).jobs()}
    assert {n: (j.status, j.attempts) for n, j in jobs.items()} == {
        "bf": ("done", 2), "normal": ("done", 1)
    }, text  # fmt: skip
    (signalled,) = (
        QueueDB(db)
        .conn.execute(
            "SELECT time FROM events WHERE kind = 'preempt' AND job_id = ?", (jobs["bf"].id,)
        )
        .fetchone()
    )
    ends = read_records(bf_log, "end")
    assert [e["reason"] for e in ends] == ["preempted", "completed"], ends
    # within one optimizer step of the signal: the step in progress finishes, no further one
    train = read_records(bf_log, "train")
    before = [r["step"] for r in train if r["time"] <= signalled]
    assert ends[0]["step"] <= max(before) + 1, (before, ends[0])
    first = [r for r in train if r["time"] <= ends[0]["time"]]
    step_s = max(b["time"] - a["time"] for a, b in itertools.pairwise(first))
    latency = ends[0]["time"] - signalled
    assert latency <= step_s + 1.0, (latency, step_s)  # + one checkpoint of a tiny model
    assert signalled - added < 2.0  # the runner noticed the arrival (polls every 0.25 s)
    saved = re.search(r"\(([0-9.]+)s after the signal\)", Path(jobs["bf"].log).read_text())
    assert saved, "the backfill job did not report its preemption checkpoint"
    print(f"backfill preemption: arrival -> signal {signalled - added:.2f}s, signal -> exit "
          f"{latency:.2f}s (step {step_s:.2f}s; checkpoint saved {saved.group(1)}s after it)")  # fmt: skip
    # the normal job ran in the gap; the backfill job resumed after it, from its checkpoint
    normal = tmp_path / "runs" / "normal" / "metrics.jsonl"
    assert read_records(normal, "start")[0]["time"] >= ends[0]["time"] - 0.5
    resumed = read_records(bf_log, "start")[-1]
    assert resumed["time"] >= read_records(normal, "end")[-1]["time"] - 0.5
    steps = [r["step"] for r in train]
    assert steps == list(range(1, STEPS + 1)), steps  # no step lost or trained twice
    assert "made room for job" in (jobs["bf"].detail or "") or "made room for job" in text
    # bit-identical to the uninterrupted run
    a, b = _weights(tmp_path / "runs" / "bf"), _weights(tmp_path / "runs" / "ref")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"weight {k} differs from the uninterrupted run"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_backfill_stops_at_the_deadline(tmp_path: Path, char_dataset: Path, monkeypatch) -> None:
    """``queue run --until +Ns`` with only a long backfill job: it starts although it cannot
    finish by then (it can always be stopped), and when the deadline comes it checkpoints and
    exits 75; the runner returns 0 with the job ``preempted``, ready for the next night.

    Mutations caught: backfill deferred like a normal job (it never starts); the deadline not
    enforced on backfill jobs (the runner waits for all 100000 steps).
    """
    monkeypatch.chdir(tmp_path)
    slow = [{"class_path": "cli_probes.SlowSteps", "init_args": {"seconds": 0.3}}]
    cfg = tiny_overrides(
        char_dataset, tmp_path / "runs", trainer__max_steps=100_000, trainer__accelerator="cpu"
    )
    del cfg["run"]["name"]
    cfg["trainer"]["callbacks"] = slow
    path = write_config(tmp_path / "long.yaml", cfg)
    db = tmp_path / "q.db"
    assert main(["add", str(path), "--db", str(db), "--name", "night", "--backfill"]) == 0
    res = subprocess.run(
        [sys.executable, "-m", "nanolab", "queue", "run", "--db", str(db), "--until", "+25s"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:]
    assert "the deadline has come; asked to checkpoint and stop" in res.stdout
    (job,) = QueueDB(db).jobs()
    assert job.status == "preempted" and job.detail.startswith("backfill: stopped at the deadline")
    end = read_records(tmp_path / "runs" / "night" / "metrics.jsonl", "end")[-1]
    assert end["reason"] == "preempted" and end["step"] >= 1
    assert (tmp_path / "runs" / "night" / "checkpoints" / f"step-{end['step']:08d}.ckpt").is_file()
