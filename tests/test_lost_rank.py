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


def test_a_rank_that_exits_seconds_after_its_connections_closed_is_still_named() -> None:
    """A rank that raised closes its connections, then takes seconds to exit (its teardown,
    its traceback, the interpreter's shutdown; more on a loaded machine): 2 s was too short a
    wait, and rank 0 printed gloo's traceback. The wait ends at the exit itself."""
    slow = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(4); raise SystemExit(1)"]
    )
    started = time.monotonic()
    found = lost_rank(_trainer([slow]), RuntimeError(GLOO_TEXT))
    waited = time.monotonic() - started
    assert found is not None and (found.pid, found.returncode) == (slow.pid, 1)
    assert waited < 4 + 3, waited  # woken by the exit, not by the bound


def test_failed_children_wakes_at_the_exit_and_passes_over_a_clean_one() -> None:
    from nanolab.processes import failed_children

    clean = subprocess.Popen([sys.executable, "-c", "pass"])
    failing = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1); exit(3)"])
    started = time.monotonic()
    assert failed_children([clean, failing], 60) == [failing]
    assert clean.returncode == 0 and failing.returncode == 3
    assert time.monotonic() - started < 10
    assert failed_children([clean], 60) == []  # nothing left running: no wait
    assert failed_children([failing], 60, ok=(3,)) == []


#: Rank 0 hung in a collective that never completes after its rank 1 failed: the launcher's
#: observer is what ends it (Lightning's SIGKILLed it silently, exit -9).
HUNG_RANK_ZERO = """
import subprocess, sys, time
from types import SimpleNamespace
from nanolab.callbacks import rank_watch
import importlib
rank_watch.GRACE_S = 1.0
rank1 = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5); exit(1)"])
trainer = SimpleNamespace(global_rank=0, local_rank=0, callbacks=[], state=SimpleNamespace(fn="validate"),
    strategy=SimpleNamespace(launcher=SimpleNamespace(procs=[rank1])))
launcher_module = importlib.import_module(rank_watch.LAUNCHER_MODULE)
with rank_watch.watching(trainer, "validate"):
    getattr(launcher_module, rank_watch.OBSERVER)([rank1])  # as Lightning's launcher calls it
    print(rank1.pid, flush=True)
    time.sleep(60)  # a collective that never completes
"""


def test_a_hung_rank_zero_says_which_rank_died_before_it_is_ended() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", HUNG_RANK_ZERO], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )  # fmt: skip
    pid = proc.stdout.split()[0]
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert proc.stderr.strip().splitlines()[-1] == (
        f"nanolab validate: error: rank 1 (pid {pid}) ended with an error (exit code 1): its "
        "traceback is above"
    )


def test_the_watch_takes_the_place_of_lightnings_observer_for_the_call_only() -> None:
    """Lightning has no public switch for its observer: the private name nanolab swaps must
    still be there (else Lightning's observer ends rank 0 before it says which rank died)."""
    import importlib

    from nanolab.callbacks import rank_watch

    module = importlib.import_module(rank_watch.LAUNCHER_MODULE)
    lightnings = getattr(module, rank_watch.OBSERVER)
    trainer = _trainer([])
    with rank_watch.watching(trainer, "fit"):
        assert getattr(module, rank_watch.OBSERVER) is not lightnings
    assert getattr(module, rank_watch.OBSERVER) is lightnings


#: Rank 1 raises once it gets SIGUSR2 (a bug on that rank only).
RAISE_ON_USR2 = """
import os, signal
if os.environ.get("LOCAL_RANK", "0") != "0":
    def _raise(signum, frame):
        raise ValueError("a bug on this rank")
    signal.signal(signal.SIGUSR2, _raise)
"""


@pytest.mark.slow  # a real 2-process CPU DDP run beside two busy loops (~80 s on 2 cores)
@pytest.mark.timeout(600)
def test_rank_0_names_a_rank_that_raised_on_a_loaded_machine(
    tmp_path: Path, char_dataset: Path
) -> None:
    """Rank 1 raises mid-run beside two busy loops: it exits seconds after its connections
    close. Rank 0 printed gloo's traceback (it waited 2 s), or was SIGKILLed by Lightning's
    observer; now one line names rank 1, and the ``end`` record's error is that line."""
    cfg = tiny_overrides(
        char_dataset, tmp_path / "runs", trainer__max_steps=100000, run__name="raised",
        run__eval_every_steps=1000, checkpoint__every_n_steps=2,
    )  # fmt: skip
    cfg["trainer"].update(accelerator="cpu", devices=2, strategy="ddp")
    config = write_config(tmp_path / "raised.yaml", cfg)
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(RAISE_ON_USR2)
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{hooks}{os.pathsep}{repo}"}
    busy = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(2)]
    err = tmp_path / "stderr.txt"
    run_dir = tmp_path / "runs" / "raised"
    try:
        with err.open("w") as stderr:
            proc = subprocess.Popen(
                [sys.executable, "-m", "nanolab", "fit", "--config", str(config)], cwd=tmp_path,
                stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True, env=env,
            )  # fmt: skip
        try:
            deadline = time.monotonic() + 400
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
            os.kill(rank1, signal.SIGUSR2)
            code = proc.wait(timeout=200)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    finally:
        for loop in busy:
            loop.kill()
            loop.wait()
    text = err.read_text()
    lines = [line for line in text.splitlines() if line.startswith("nanolab fit:")]
    assert code == 1 and "Connection closed" not in text, text[-3000:]
    assert len(lines) == 1, text[-3000:]
    said = lines[0].removeprefix("nanolab fit: error: ")
    assert said.startswith(f"rank 1 (pid {rank1}) ended with an error (exit code 1): its "
                           "traceback is above; the newest checkpoint is of step "), text[-3000:]  # fmt: skip
    assert "ValueError: a bug on this rank" in text
    end = read_records(run_dir / "metrics.jsonl", "end")[-1]
    assert (end["reason"], end["error"]) == ("error", said)
