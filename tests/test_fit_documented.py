"""What the README promises about ``nanolab fit``, each through the real CLI on CPU: SIGINT and
SIGUSR1 preemption, ``preemption.finish_validation: false``, ``checkpoint.save_on_best``, async
saving of tied weights, and stopping on ``budget.max_cost`` and ``budget.max_wall_hours``.

Each test names, in its docstring, the mutation of nanolab it was seen to catch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import tiny_overrides, write_config

from nanolab.runlog import read_records

TESTS = Path(__file__).resolve().parent


def env_with_probes() -> dict[str, str]:
    """The subprocess environment, with ``tests/`` importable for ``cli_probes`` callbacks."""
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}


def fit(config: Path, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "nanolab", "fit", "--config", str(config)],
        cwd=cwd, env=env_with_probes(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


@pytest.mark.slow  # 30-100 s on 2 cores; `pytest -m slow`
def test_sigint_preempts_with_an_async_checkpoint_that_keeps_tied_weights_shared(
    tmp_path, char_dataset
):
    """Ctrl-C (SIGINT) during training: the step finishes, a checkpoint is written by the async
    writer, the run exits 75 with reason ``preempted``; in that file the tied embedding and
    output head are one tensor, as a synchronous ``torch.save`` would store them.

    Mutations caught: SIGINT dropped from ``preemption.signals``' default (Lightning's own
    Ctrl-C handling: no checkpoint, no exit 75); ``cpu_snapshot`` copying every tensor on its own
    (the file holds two embedding matrices).
    """
    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=3000)
    cfg["checkpoint"] = {"every_n_steps": 1000, "async_save": True}
    proc = fit(write_config(tmp_path / "t.yaml", cfg), tmp_path)
    run = tmp_path / "runs" / "tiny"
    deadline = time.monotonic() + 300
    while len(read_records(run / "metrics.jsonl", "train")) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    code, err = finish(proc)
    assert code == 75, err[-2000:]
    assert "received SIGINT" in err and "Traceback" not in err
    end = read_records(run / "metrics.jsonl", "end")[-1]
    assert end["reason"] == "preempted" and "SIGINT" in end["detail"]
    (saved,) = read_records(run / "metrics.jsonl", "checkpoint")
    assert saved["step"] == end["step"] and saved["async"] is True
    path = run / "checkpoints" / f"step-{end['step']:08d}.ckpt"
    assert os.path.samefile(path, run / "checkpoints" / "last.ckpt")
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == end["step"]
    wte, head = ckpt["state_dict"]["model.wte.weight"], ckpt["state_dict"]["model.lm_head.weight"]
    assert wte.untyped_storage().data_ptr() == head.untyped_storage().data_ptr()


@pytest.mark.slow
def test_sigusr1_with_finish_validation_false_saves_before_the_evaluation(tmp_path, char_dataset):
    """SIGUSR1 arrives in step 5 of a run that evaluates every step; with
    ``preemption.finish_validation: false`` it checkpoints right after the step and skips that
    step's evaluation (the signal is sent by ``cli_probes.SignalAt`` from inside the process, so
    it lands in the step every time). With ``checkpoint.save_on_best`` (and no step-based saves)
    every evaluation that set a new best val loss was saved, and nothing else but the
    preemption checkpoint.

    Mutations caught: ``finish_validation`` ignored (step 5 is evaluated before the save);
    SIGUSR1 dropped from the default signals (the process dies of it); ``save_on_best`` ignored
    (only the preemption checkpoint).
    """
    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=50)
    cfg["run"]["eval_every_steps"] = 1
    cfg["checkpoint"] = {"every_n_steps": None, "keep_best": 1, "save_on_best": True}
    cfg["preemption"] = {"finish_validation": False}
    cfg["trainer"]["callbacks"] = [
        {"class_path": "cli_probes.SignalAt", "init_args": {"step": 4, "signal": "SIGUSR1"}}
    ]
    code, err = finish(fit(write_config(tmp_path / "t.yaml", cfg), tmp_path))
    assert code == 75, err[-2000:]
    assert "received SIGUSR1 at step 4" in err
    run = tmp_path / "runs" / "tiny"
    log = run / "metrics.jsonl"
    end = read_records(log, "end")[-1]
    assert end["reason"] == "preempted" and end["step"] == 5
    vals = read_records(log, "val")
    assert [r["step"] for r in vals] == [1, 2, 3, 4]
    ckpt = torch.load(run / "checkpoints" / "step-00000005.ckpt", weights_only=True, mmap=True)
    assert ckpt["global_step"] == 5

    best, improving = float("inf"), set()
    for record in vals:
        if record["val_loss"] < best:
            best, improving = record["val_loss"], improving | {record["step"]}
    assert len(improving) >= 2, vals
    saved = [r["step"] for r in read_records(log, "checkpoint")]
    assert sorted(saved) == sorted(improving | {5})


def stopped_by(log: Path, budget: str, spent: Callable[[dict], float], limit: float) -> dict:
    """The run ended on ``budget``, at the first step whose projected spend reached ``limit``
    (the spend at every earlier step was below it). Start-up counts (elapsed time is the
    process's), so on a slow machine that can be step 1, or the start (no step trained)."""
    end = read_records(log, "end")[-1]
    assert end["reason"] == "budget" and budget in end["detail"], end
    (stop,) = [r for r in read_records(log, "budget") if r["decision"] == "stop"]
    assert stop["budget"] == budget and stop["projected_at_next_check"] >= limit
    for record in read_records(log, "train"):
        if record["step"] < stop["step"]:
            assert spent(record) < limit, record
    return end


def test_max_cost_stops_the_run(tmp_path, char_dataset):
    """``budget.max_cost`` (GPU-hours x price) ends a run that would otherwise go on for 2000
    steps, once the next step would pass the limit.

    Mutation caught: ``max_cost`` left out of ``CostBudget.limits`` (the run completes).
    """
    price, limit = 2.0, 0.004  # 7.2 s of one CPU "GPU" at 2 USD/hour (start-up counts too)
    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=2000)
    cfg["checkpoint"] = {"every_n_steps": None}
    cfg["budget"] = {"price_per_gpu_hour": price, "max_cost": limit}
    code, err = finish(fit(write_config(tmp_path / "t.yaml", cfg), tmp_path))
    assert code == 0, err[-2000:]
    log = tmp_path / "runs" / "tiny" / "metrics.jsonl"
    end = stopped_by(log, "max_cost", lambda record: record["cost"], limit)
    assert 0 <= end["step"] < 2000  # 0: start-up alone spent it on a loaded machine
    assert end["cost"] == end["gpu_hours"] * price and end["currency"] == "USD"


@pytest.mark.slow  # 30-100 s on 2 cores; `pytest -m slow`
def test_max_wall_hours_stops_the_run(tmp_path, char_dataset):
    """``budget.max_wall_hours`` ends a 2000-step run once the next step would pass it.

    Mutation caught: ``max_wall_hours`` left out of ``CostBudget.limits`` (the run completes).
    """
    limit = 0.002  # 7.2 s: start-up counts, and a loaded machine's start-up can take seconds
    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=2000)
    cfg["checkpoint"] = {"every_n_steps": None}
    cfg["budget"] = {"max_wall_hours": limit}
    code, err = finish(fit(write_config(tmp_path / "t.yaml", cfg), tmp_path))
    assert code == 0, err[-2000:]
    run = tmp_path / "runs" / "tiny"
    log = run / "metrics.jsonl"
    end = stopped_by(log, "max_wall_hours", lambda record: record["elapsed_s"] / 3600, limit)
    assert 0 < end["step"] < 2000
    assert (
        torch.load(run / "checkpoints" / "last.ckpt", weights_only=True, mmap=True)["global_step"]
        == end["step"]
    )
