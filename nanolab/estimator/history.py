"""This machine's own throughput for a config, from the finished runs the queue remembers.

An MFU assumption is a guess; a finished run of the same config on the same kind of device is a
measurement. ``nanolab queue`` keeps every job's run directory, and each run directory keeps its
``config.yaml`` and its run log, whose last ``start`` record names the devices and whose ``end``
record has that launch's own tokens/s (:func:`launch_rate`). A past run counts when its config describes the same step
(architecture, precision, matmul precision, micro-batch, accumulation, devices, strategy,
optimizer, compile) on a device that matches the GPU being estimated (on an AMD GPU, a ``32-true``
step under the same ``HIPBLASLT_ALLOW_TF32`` as here, which its start record keeps); the median
of their tokens/s is used.
"""

from __future__ import annotations

import os
import sqlite3
import statistics
from dataclasses import dataclass
from pathlib import Path

from nanolab.estimator.gpus import GPU, gpu_for_device, hip_tf32_setting
from nanolab.estimator.setup import Setup, load_config, setup_from_config

QUEUE_DB_ENV = "NANOLAB_QUEUE_DB"
DEFAULT_QUEUE_DB = "nanolab_queue.db"


@dataclass
class Measured:
    tokens_per_second: float  # all devices together
    runs: int
    source: str


#: What makes two runs' steps the same (and the strategy's kind).
_STEP = ("gpt", "precision", "float32_matmul_precision", "micro_batch_size")
_STEP += ("global_batch_tokens", "accumulate_grad_batches", "world_size", "optimizer", "compile")


def _same_step(a: Setup, b: Setup) -> bool:
    same = all(getattr(a, k) == getattr(b, k) for k in _STEP)
    return same and a.strategy.kind == b.strategy.kind


def ran_on(devices: list, gpu: GPU | None) -> bool:
    """Whether a launch whose start record lists ``devices`` ran on ``gpu`` (every device is
    one; None: every device is a CPU). An empty list says nothing: no."""
    if gpu is not None:
        return bool(devices) and all(gpu_for_device(str(d)) == gpu for d in devices)
    return bool(devices) and all(str(d) == "cpu" for d in devices)


def _run_tokens_per_second(run_dir: Path, setup: Setup, gpu: GPU | None) -> float | None:
    from nanolab.runlog import RUN_LOG_NAME, last_record

    config = run_dir / "config.yaml"
    if not config.is_file():
        return None
    try:
        cfg = load_config([config])
        run = cfg.get("run") or {}
        if run.get("micro_batch_size") == "auto":  # what it resolved to is in data
            from nanolab.training.resolve import sections

            run["micro_batch_size"] = sections(cfg)[3].get("micro_batch_size")
        past = setup_from_config(cfg)
    except Exception:  # a config this version cannot read says nothing about speed
        return None
    if not _same_step(past, setup):
        return None
    log = run_dir / RUN_LOG_NAME
    start = last_record(log, "start") or {}
    if not ran_on(start.get("devices") or [], gpu):
        return None
    if not same_tf32_switch(start, setup, gpu):
        return None
    end = last_record(log, "end") or {}
    if end.get("reason") not in ("completed", "budget", "plateau"):
        return None  # crashed, diverged or preempted: its rate may cover a few steps only
    return launch_rate(end, resumed=start.get("resumed_from") is not None)


def same_tf32_switch(start: dict, setup: Setup, gpu: GPU | None) -> bool:
    """Whether the launch a ``start`` record opens ran its matmuls as ``setup`` would here: on
    an AMD GPU, where ``HIPBLASLT_ALLOW_TF32`` decides TF32 or FP32 for a ``32-true`` step
    (about 4x apart), the launch recorded the variable as this process has it. A start record
    without it (an older nanolab's) says nothing: not the same. Elsewhere always the same."""
    amd = gpu is not None and gpu.vendor == "amd"
    here = hip_tf32_setting(setup.precision, setup.float32_matmul_precision, amd)
    return all(start.get(key) == value for key, value in here.items())


def launch_rate(end: dict, resumed: bool) -> float | None:
    """The tokens/s of the launch an ``end`` record closes: the config and devices compared
    are that launch's (the last ``config.yaml`` and ``start``), so the rate must be too, not a
    resumed run's whole-run figure, which may blend launches of other precisions or GPUs.

    ``launch_tokens_per_s`` where the record has it; an older record's ``tokens_per_s`` where
    it was this launch's (no ``totals_of``, or ``this launch``), or where the run's figure is
    one launch's because the launch was not a resume (``resumed``: its start resumed one)."""
    rate = end.get("launch_tokens_per_s")
    if rate is None and (end.get("totals_of") in (None, "this launch") or not resumed):
        rate = end.get("tokens_per_s")
    return float(rate) if isinstance(rate, (int, float)) and rate > 0 else None


def measured_throughput(setup: Setup, gpu: GPU | None, db: str | None = None) -> Measured | None:
    """Median tokens/s of finished queue jobs with the same step on ``gpu`` (None: CPU)."""
    path = Path(db or os.environ.get(QUEUE_DB_ENV) or DEFAULT_QUEUE_DB)
    if not path.is_file():
        return None
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            rows = conn.execute("SELECT run_dir, cwd FROM jobs WHERE status = 'done'").fetchall()
        finally:
            conn.close()
    except sqlite3.Error:
        return None
    dirs = [Path(d) if Path(d).is_absolute() else Path(cwd) / d for d, cwd in rows]
    rates = [r for d in dirs if (r := _run_tokens_per_second(d, setup, gpu)) is not None]
    if not rates:
        return None
    where = gpu.name if gpu is not None else "this CPU"
    return Measured(
        statistics.median(rates),
        len(rates),
        f"measured: median of {len(rates)} finished queue run(s) of this config on {where}",
    )
