"""A rank of a multi-process run killed: rank 0 names it in one line (nanolab.callbacks.lost_rank).

Rank 0 learned of it as gloo's ``Connection closed by peer`` under a 63-line traceback, exit 1,
and the run log's ``end`` record held the same words: nothing said which rank died, or how.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import tiny_overrides, write_config

from nanolab.callbacks.checkpoint import RotatingCheckpoint, step_checkpoint_name
from nanolab.callbacks.lost_rank import lost_rank, lost_rank_of
from nanolab.runlog import read_records

GLOO_TEXT = (
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:6530. This is typically caused by a remote worker crashing."
)


def _trainer(procs: list[subprocess.Popen], callbacks: list | None = None) -> SimpleNamespace:
    """What lost_rank reads of a Trainer: rank 0 of its node, the launcher's children."""
    launcher = SimpleNamespace(procs=procs)
    return SimpleNamespace(
        global_rank=0, local_rank=0, strategy=SimpleNamespace(launcher=launcher),
        callbacks=callbacks or [],
    )  # fmt: skip


def _child() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_killed_rank_is_named_with_its_pid_and_signal(tmp_path: Path) -> None:
    """Rank 2 (the second child) killed by SIGKILL, rank 1 alive: the line names rank 2, its
    pid, the signal and the step a rerun resumes from (the newest complete checkpoint)."""
    alive, killed = _child(), _child()
    try:
        killed.kill()
        killed.wait()
        checkpoints = RotatingCheckpoint()
        checkpoints.dirpath, checkpoints.last_saved_step = tmp_path, 40
        (tmp_path / step_checkpoint_name(40)).write_bytes(b"x")
        error = RuntimeError(GLOO_TEXT)
        found = lost_rank(_trainer([alive, killed], [checkpoints]), error)
        assert str(found) == (
            f"rank 2 (pid {killed.pid}) was killed by SIGKILL (out of memory?); rerun the same "
            "command to resume from step 40"
        )
        assert lost_rank_of(error) is found  # what `fit` prints after the Trainer let it go
    finally:
        alive.kill()
        alive.wait()


def test_a_rank_that_exited_before_any_checkpoint() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    gone.wait()
    found = lost_rank(_trainer([gone]), RuntimeError(GLOO_TEXT))
    assert str(found) == (
        f"rank 1 (pid {gone.pid}) ended with an error (exit code 3): its message is above; no "
        "checkpoint was saved yet"
    )


def test_a_rank_that_raised_is_named_without_rerun_advice(tmp_path: Path) -> None:
    """A Python error on rank 1 (exit code 1) was told as "exited with code 1; rerun the same
    command to resume from step 4": a rerun meets the same error. The line names the error
    and points at the rank's own traceback; the checkpoint's step stays as information."""
    raised = subprocess.Popen(
        [sys.executable, "-c", "raise ValueError('a bug on this rank')"], stderr=subprocess.PIPE
    )
    _, err = raised.communicate()
    assert raised.returncode == 1 and b"ValueError: a bug on this rank" in err
    checkpoints = RotatingCheckpoint()
    checkpoints.dirpath, checkpoints.last_saved_step = tmp_path, 4
    (tmp_path / step_checkpoint_name(4)).write_bytes(b"x")
    found = lost_rank(_trainer([raised], [checkpoints]), RuntimeError(GLOO_TEXT))
    assert str(found) == (
        f"rank 1 (pid {raised.pid}) ended with an error (exit code 1): its traceback is above; "
        "the newest checkpoint is of step 4"
    )
    assert "rerun" not in str(found)


def test_other_errors_keep_their_traceback() -> None:
    """Only a collective's error while a launched rank has ended counts: a peer-gone text with
    every rank running (after a short wait for the dead one's status), another error type, a
    process that launched no ranks: None, and the error is raised as it was."""
    alive = _child()
    try:
        started = time.monotonic()
        assert lost_rank(_trainer([alive]), RuntimeError(GLOO_TEXT), wait_s=0.3) is None
        assert 0.3 <= time.monotonic() - started < 5
        started = time.monotonic()
        assert lost_rank(_trainer([alive]), RuntimeError("shape mismatch")) is None
        assert time.monotonic() - started < 0.3  # an unrelated error is not held up
        alive.kill()
        alive.wait()
        assert lost_rank(_trainer([alive]), ValueError(GLOO_TEXT)) is None
        assert lost_rank(_trainer([]), RuntimeError(GLOO_TEXT)) is None
    finally:
        if alive.poll() is None:
            alive.kill()
            alive.wait()


@pytest.mark.slow  # a real 2-process CPU DDP run (~40 s on 2 cores)
@pytest.mark.timeout(600)
def test_rank_0_names_the_rank_that_was_killed(tmp_path: Path, char_dataset: Path) -> None:
    """SIGKILL of rank 1 once training is under way: rank 0 prints one line naming it and the
    step to resume from, exits 1, and its ``end`` record's error is the same line."""
    cfg = tiny_overrides(
        char_dataset, tmp_path / "runs", trainer__max_steps=100000, run__name="r1k",
        run__eval_every_steps=1000, checkpoint__every_n_steps=2,
    )  # fmt: skip
    config = write_config(tmp_path / "r1k.yaml", cfg)
    ddp = Path(__file__).resolve().parents[1] / "configs" / "strategy" / "ddp.yaml"
    err = tmp_path / "stderr.txt"
    with err.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "nanolab", "fit", "--config", str(config), "--config",
             str(ddp), "--trainer.devices", "2"],
            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
    run_dir = tmp_path / "runs" / "r1k"
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "metrics.jsonl").exists() or not any(
            r["step"] >= 3 for r in read_records(run_dir / "metrics.jsonl", "train")
        ):
            assert proc.poll() is None, err.read_text()[-3000:]
            assert time.monotonic() < deadline, "no train record"
            time.sleep(0.05)
        children = subprocess.run(
            ["pgrep", "-P", str(proc.pid), "-f", "nanolab"], capture_output=True, text=True
        )
        rank1 = int(children.stdout.split()[0])
        os.kill(rank1, signal.SIGKILL)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = err.read_text()
    lines = [line for line in text.splitlines() if line.startswith("nanolab fit:")]
    assert code == 1 and "Traceback" not in text and "Connection closed" not in text, text[-3000:]
    end = read_records(run_dir / "metrics.jsonl", "end")[-1]
    step = max(r["step"] for r in read_records(run_dir / "metrics.jsonl", "checkpoint"))
    said = (
        f"rank 1 (pid {rank1}) was killed by SIGKILL (out of memory?); rerun the same command "
        f"to resume from step {step}"
    )
    assert lines == [f"nanolab fit: error: {said}"], text[-3000:]
    assert (end["reason"], end["error"]) == ("error", said)
