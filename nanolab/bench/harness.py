"""``nanolab bench``: nanolab's training speed against a plain PyTorch loop, side by side.

Each round runs (a) ``nanolab fit`` on the config — with its default callbacks, periodic
evaluation and checkpoints, exactly as a user runs it — and (b) the plain loop of
:mod:`nanolab.bench.plain_loop` on the same resolved config, with the same validations, task
scoring and checkpoints at the same steps (:mod:`nanolab.bench.plain_evals`), one after the
other; rounds alternate which side goes first so drift on a shared machine hits both. Both
sides report the wall time at the end of every optimizer step; steady-state tokens/s is
``tokens per step / median step interval`` after ``--warmup`` steps, where the intervals that
contain an evaluation or checkpoint are left out (those are goodput's business, reported
separately from the run's own ``end`` record). Two more ratios take that work in: over the
whole step window after warm-up, and end to end (each process's start to its exit, start-up
and the final scoring and save included).

A ratio means something only when each side is steady from round to round: the run-to-run
spread of each side's tokens/s and of the per-round ratio (max - min over the median) is
reported, and when the ratio's exceeds :data:`NOISY_SPREAD` (or with one round, or with more
runnable processes than cores) the result says the machine is too noisy to read the ratio,
instead of letting 0.35 on a loaded machine read as "nanolab is 3x slower".
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from nanolab.bench.comparable import check_comparable
from nanolab.errors import NanolabError, one_line_errors
from nanolab.helpfmt import OneLineParser
from nanolab.processes import sigterm_as_interrupt
from nanolab.runlog import read_records
from nanolab.tables import table

#: Run-to-run spread of the per-round ratio, (max - min) / median, above which the rounds
#: disagree too much for the ratio to mean anything. (Each side's own spread is reported too;
#: alternating the sides cancels slow drift, so the paired ratio can be steady when they are not.)
NOISY_SPREAD = 0.10

#: The work both sides do outside the steps, by its ``time_breakdown`` key.
PAUSES = {"eval_s": "validation", "tasks_s": "task scoring", "checkpoint_s": "saving"}


@dataclass
class SideResult:
    tokens_per_s: float
    median_step_s: float  # the median interval between steady step ends
    window_tokens_per_s: float
    startup_s: float  # process start -> end of the first optimizer step
    steps: int
    losses: dict[int, float]  # optimizer step -> loss of its last micro-batch (plain: sampled)
    wall_s: float  # process start -> exit: start-up, steps, evaluations, saves, teardown
    val_losses: dict[int, float]  # optimizer step -> validation loss (none: steps only)
    #: seconds validating, scoring tasks and saving (``eval_s``, ``tasks_s``, ``checkpoint_s``)
    breakdown: dict[str, float]


@dataclass
class NanolabResult(SideResult):
    goodput: float | None
    data_wait_s: float | None
    mfu: float | None  # median over steady-state records; None where the device's peak is unknown
    peak_mem_bytes: int | None  # torch.cuda.max_memory_allocated over the run; None on CPU


def _steady_rate(
    ends: list[float], tokens_per_step: int, warmup: int, skip: set[int]
) -> tuple[float, float, float]:
    """(tokens / median step interval, tokens / wall time of the whole measured window, the
    median step interval in seconds)."""
    intervals = [ends[i] - ends[i - 1] for i in range(max(1, warmup), len(ends)) if i not in skip]
    if not intervals:
        raise RuntimeError(f"only {len(ends)} steps measured; raise --steps above --warmup")
    median = statistics.median(intervals)
    window = ends[-1] - ends[max(0, warmup - 1)]
    n = len(ends) - max(0, warmup - 1) - 1
    return tokens_per_step / median, tokens_per_step * n / window, median


def outside_steps(side: SideResult) -> float:
    """Seconds of a side's run spent outside steady-state steps: its end-to-end time less its
    steps at its median step interval (start-up, evaluations, saves and teardown, which the
    end-to-end ratio mixes with the steady rate)."""
    return side.wall_s - side.steps * side.median_step_s


def extra_seconds(nano: list[NanolabResult], plain: list[SideResult]) -> dict[str, Any]:
    """Per kind of work both sides do outside the steps (validation, task scoring, saving):
    nanolab's seconds for it minus the plain loop's, over the rounds where both timed it."""
    out = {}
    for kind in PAUSES:
        diffs = [
            n.breakdown[kind] - p.breakdown[kind]
            for n, p in zip(nano, plain, strict=True)
            if kind in n.breakdown and kind in p.breakdown
        ]
        if diffs:
            out[kind] = _stats(diffs)
    return out


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def predicted_peak_bytes(config_yaml: Path) -> int | None:
    """The memory estimator's peak for the run's resolved config on the device it ran on: this
    GPU's rules where CUDA/ROCm is visible, the CPU's rules otherwise (the rules run anywhere,
    so a CPU run, such as the GPU check's dry run, has its prediction too); None for a config
    the estimator cannot describe. The peak is the one at the micro-batch the run trained with
    (``data.micro_batch_size``; a ``run.micro_batch_size: auto`` is not picked again)."""
    import torch
    import yaml

    from nanolab.estimator import estimate_from_config

    config = yaml.safe_load(config_yaml.read_text())
    data = config.get("data") or {}
    micro = data.get("init_args", data).get("micro_batch_size")
    try:
        if torch.cuda.is_available():
            from nanolab.run.autobatch import device_backend

            memory = torch.cuda.get_device_properties(0).total_memory
            est = estimate_from_config(
                config, device_memory=memory, devices=1, backend=device_backend(),
                micro_batch_size=micro if isinstance(micro, int) else None,
            )  # fmt: skip
        else:
            est = estimate_from_config(config, device="cpu", devices=1)
    except ValueError:  # a model the rules do not describe (a fork's): no prediction, no crash
        return None
    return int(est.memory.peak_allocated)


def _env() -> dict[str, str]:
    return {"PYTHONUNBUFFERED": "1", **os.environ}


#: Seconds a side stopped with the bench (SIGTERM, Ctrl-C) has to exit by itself (a ``fit``
#: finishes its optimizer step and saves) before it is killed.
STOP_GRACE_S = 30.0


def _run(cmd: list[str], what: str, env: dict[str, str] | None = None) -> None:
    """Run one side's process, its output passed on to this process's stderr as it comes (a
    bench stopped from outside still shows how far each side got; stdout stays the result's);
    its failure is a RuntimeError with its last line (the rest was passed on already). The
    bench stopped meanwhile (:class:`nanolab.processes.Terminated`, Ctrl-C) stops the side
    and waits for it (:func:`_stop`) before the stop goes on: an orphan would go on training
    and writing into the bench's temporary folder, which would never be removed."""
    last = "no output"
    with subprocess.Popen(
        cmd,
        env={**_env(), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    ) as proc:
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                sys.stderr.write(line)
                last = line.strip() or last
        except BaseException:
            _stop(proc)
            raise
    sys.stderr.flush()
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}; its output is above): {last}")


def _stop(proc: subprocess.Popen[str], grace_s: float = STOP_GRACE_S) -> None:
    """End a side and wait for it: SIGTERM (a ``fit`` stops at its step and ends its data
    workers), SIGKILL after ``grace_s``. A side that got the signal too (the whole process
    group was stopped) has exited or is exiting; the second SIGTERM only hastens it."""
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_nanolab(
    configs: list[str],
    overrides: list[str],
    steps: int,
    warmup: int,
    work: Path,
    tag: str,
    env: dict[str, str] | None = None,
) -> tuple[NanolabResult, Path]:
    runs = work / "runs"
    cmd = [sys.executable, "-m", "nanolab", "fit"]
    for c in configs:
        cmd += ["--config", c]
    cmd += [
        "--trainer.max_steps", str(steps),
        "--run.root", str(runs),
        "--run.name", tag,
        "--run.resume", "never",
        "--trainer.enable_progress_bar", "false",
        *overrides,
    ]  # fmt: skip
    t0 = time.time()
    _run(cmd, "nanolab fit", env)
    wall = time.time() - t0
    run_dir = runs / tag
    records = read_records(run_dir / "metrics.jsonl")
    start = next(r for r in records if r["event"] == "start")
    train = [r for r in records if r["event"] == "train"]
    end = next((r for r in records if r["event"] == "end"), {})
    breakdown = end.get("time_breakdown") or {}
    # An interval is "dirty" when an evaluation or checkpoint happened inside it.
    skip: set[int] = set()
    index = -1
    for r in records:
        if r["event"] == "train":
            index += 1
        elif r["event"] in ("val", "tasks", "checkpoint") and index >= 0:
            skip.add(index + 1)
    ends = [r["time"] for r in train]
    tokens_per_step = int(start.get("global_batch_tokens") or 0)
    rate, window, median = _steady_rate(ends, tokens_per_step, warmup, skip)
    return (
        NanolabResult(
            tokens_per_s=rate,
            median_step_s=median,
            window_tokens_per_s=window,
            startup_s=ends[0] - t0,
            steps=len(ends),
            losses={int(r["step"]): r["loss"] for r in train if r.get("loss") is not None},
            wall_s=wall,
            val_losses={
                int(r["step"]): r["val/loss"]
                for r in records
                if r["event"] == "val" and r.get("val/loss") is not None
            },
            breakdown=breakdown,
            goodput=end.get("goodput"),
            data_wait_s=breakdown.get("data_wait_s"),
            mfu=_median([r.get("mfu") for r in train[warmup:]]),
            peak_mem_bytes=max((r.get("mem_allocated_bytes") or 0 for r in train), default=0)
            or None,
        ),
        run_dir,
    )


def run_plain(
    config_yaml: Path, steps: int, warmup: int, work: Path, driver: str = "plain", tag: str = "0"
) -> SideResult:
    """The plain loop (``driver="plain"``), which validates, scores tasks and saves at the
    config's cadence as ``nanolab fit`` does, or the same training steps under a bare Lightning
    Trainer (``"lightning"``, steps only), in its own process."""
    out = work / f"{driver}.json"
    t0 = time.time()
    cmd = [sys.executable, "-m", "nanolab.bench.plain_loop", "--config", str(config_yaml)]
    cmd += ["--steps", str(steps), "--out", str(out), "--driver", driver]
    if driver == "plain":
        # a folder of its own per run, as each nanolab run has its run directory
        cmd += ["--checkpoint-dir", str(work / f"plain-checkpoints-{tag}")]
    _run(cmd, "plain loop" if driver == "plain" else "bare Lightning loop")
    wall = time.time() - t0
    result = json.loads(out.read_text())
    ends = result["step_ends"]
    busy = set(result.get("busy_steps", []))  # the interval after such a step holds the work
    rate, window, median = _steady_rate(ends, int(result["tokens_per_step"]), warmup, busy)
    return SideResult(
        tokens_per_s=rate,
        median_step_s=median,
        window_tokens_per_s=window,
        startup_s=ends[0] - t0,
        steps=len(ends),
        losses={int(step): float(loss) for step, loss in result["losses"]},
        wall_s=wall,
        val_losses={int(step): float(loss) for step, loss in result.get("val_losses", [])},
        breakdown=result.get("time_breakdown", {}),
    )


def import_time(module: str, repeats: int = 3) -> float:
    """Seconds to import ``module`` in a fresh interpreter, interpreter start-up subtracted."""

    def wall(code: str) -> float:
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, env=_env())
        return time.perf_counter() - t

    base = min(wall("pass") for _ in range(repeats))
    return min(wall(f"import {module}") for _ in range(repeats)) - base


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def spread(stats: dict[str, float]) -> float | None:
    """(max - min) / median of one side's rounds; None without a median."""
    median = stats.get("median")
    if not median or median != median:  # 0 or NaN
        return None
    return (stats["max"] - stats["min"]) / median


def load_average() -> float | None:
    """Runnable processes over the last minute (None where the platform does not say)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def noise_warnings(res: dict[str, Any]) -> list[str]:
    """Why the ratio cannot be read on this machine now (empty when it can)."""
    out = []
    if res["rounds"] < 2:
        out.append("one round: no run-to-run spread measured, so no way to tell the ratio from "
                   "noise; use --rounds 3 or more")  # fmt: skip
    spreads = res.get("spread") or {}
    ratio_spread = spreads.get("ratio")
    if ratio_spread is not None and ratio_spread > NOISY_SPREAD:
        sides = ", ".join(
            f"{k} {v:.0%}" for k, v in spreads.items() if k != "ratio" and v is not None
        )
        ratio = res["ratio"]
        out.append(
            f"the machine is too noisy for the ratio to mean anything: it ran from "
            f"{ratio['min']:.2f} to {ratio['max']:.2f} over the rounds ({ratio_spread:.0%} of "
            f"its median; limit {NOISY_SPREAD:.0%}), tokens/s varied by {sides}. Rerun on an "
            "idle machine or with more --rounds"
        )
    cores, loads = os.cpu_count() or 1, [v for v in res.get("load_avg", []) if v is not None]
    if loads and max(loads) > cores:
        out.append(
            f"load average {max(loads):.1f} on {cores} cores during the bench: other processes "
            "competed for the CPU and the timings are theirs as much as nanolab's"
        )
    return out


#: Optimizer steps of the (untimed) run that counts nanolab's host-device synchronisations.
COUNT_STEPS = 30


def count_syncs(
    configs: list[str], overrides: list[str], steps: int, work: Path
) -> dict[str, Any] | None:
    """nanolab's host-device synchronisations per steady step and per micro-batch, counted in
    one extra, untimed ``nanolab fit`` of the config (:mod:`nanolab.callbacks.syncs`); None when
    the run was too short to have a steady step."""
    from nanolab.callbacks.syncs import ENV, FIRST_STEP, read_counts

    path = work / "syncs.json"
    steps = max(FIRST_STEP + 2, min(steps, COUNT_STEPS))
    run_nanolab(configs, overrides, steps, 1, work, "bench-syncs", env={ENV: str(path)})
    counts = read_counts(path)
    steady = counts["steady_per_step"]
    if not steady:
        return None
    return {
        "per_step": _stats([float(n) for n in steady]),
        "per_micro_batch_max": max(counts["micro_batches"], default=0),
        "steps_counted": len(steady),
        "sources": counts["steady_sources"],
    }


def benchmark(
    configs: list[str],
    overrides: list[str],
    steps: int,
    warmup: int,
    rounds: int,
    syncs: bool = True,
    floor: bool = False,
) -> dict[str, Any]:
    """``rounds`` rounds of each side, alternating which goes first; ``floor`` adds a third
    side, the same training under a bare Lightning Trainer, which splits nanolab's overhead
    into Lightning's own loop and nanolab's callbacks and logging."""
    nano: list[NanolabResult] = []
    plain: list[SideResult] = []
    bare: list[SideResult] = []
    loads = [load_average()]
    with tempfile.TemporaryDirectory(prefix="nanolab-bench-") as tmp:
        work = Path(tmp)
        config_yaml: Path | None = None

        def nanolab_side(r: int) -> None:
            nonlocal config_yaml
            result, run_dir = run_nanolab(configs, overrides, steps, warmup, work, f"bench-{r}")
            nano.append(result)
            config_yaml = run_dir / "config.yaml"  # resolved: vocab, accumulation, ...

        def plain_side(r: int) -> None:
            assert config_yaml is not None
            plain.append(run_plain(config_yaml, steps, warmup, work, tag=str(r)))

        def bare_side(r: int) -> None:
            assert config_yaml is not None
            bare.append(run_plain(config_yaml, steps, warmup, work, driver="lightning"))

        sides = [nanolab_side, plain_side, *([bare_side] if floor else [])]
        for r in range(rounds):
            # The first round starts with nanolab (its run resolves the config for the other
            # sides); later rounds rotate which side goes first.
            for k in range(len(sides)):
                sides[(r + k) % len(sides) if config_yaml else k](r)
        predicted = predicted_peak_bytes(config_yaml) if config_yaml else None
        counted = count_syncs(configs, overrides, steps, work) if syncs else None
    loads.append(load_average())
    ratios = [n.tokens_per_s / p.tokens_per_s for n, p in zip(nano, plain, strict=True)]

    # Both sides must train the same thing: the same loss at the same step (each reads its loss
    # once per step).
    def loss_gap(sides: list[SideResult]) -> dict[str, Any]:
        gaps = [
            abs(other.losses[step] - loss)
            for other, p in zip(sides, plain, strict=True)
            for step, loss in p.losses.items()
            if step in other.losses
        ]
        return {"max": max(gaps) if gaps else None, "steps_compared": len(gaps)}

    # ... and validated the same model the same way at the same steps.
    val_gaps = [
        abs(n.val_losses[step] - loss)
        for n, p in zip(nano, plain, strict=True)
        for step, loss in p.val_losses.items()
        if step in n.val_losses
    ]

    res = {
        "configs": configs,
        "overrides": overrides,
        "steps": steps,
        "warmup": warmup,
        "rounds": rounds,
        "machine": _machine(),
        "date": time.strftime("%Y-%m-%d"),
        "nanolab_tokens_per_s": _stats([n.tokens_per_s for n in nano]),
        "plain_tokens_per_s": _stats([p.tokens_per_s for p in plain]),
        "ratio": _stats(ratios),
        # nanolab's fixed cost per step: its median step interval minus the plain loop's
        "overhead_ms_per_step": _stats(
            [(n.median_step_s - p.median_step_s) * 1e3 for n, p in zip(nano, plain, strict=True)]
        ),
        "syncs": counted,
        "loss_gap": loss_gap(list(nano)),  # nanolab vs the plain loop
        "nanolab_window_tokens_per_s": _stats([n.window_tokens_per_s for n in nano]),
        "plain_window_tokens_per_s": _stats([p.window_tokens_per_s for p in plain]),
        "window_ratio": _stats(
            [
                n.window_tokens_per_s / p.window_tokens_per_s
                for n, p in zip(nano, plain, strict=True)
            ]
        ),
        # the whole process, start to exit, both sides doing the same evaluations and saves
        "nanolab_wall_s": _stats([n.wall_s for n in nano]),
        "plain_wall_s": _stats([p.wall_s for p in plain]),
        "end_to_end_ratio": _stats([p.wall_s / n.wall_s for n, p in zip(nano, plain, strict=True)]),
        # what end to end adds to the steady steps: start-up, evaluations, saves, teardown
        "nanolab_outside_steps_s": _stats([outside_steps(n) for n in nano]),
        "plain_outside_steps_s": _stats([outside_steps(p) for p in plain]),
        "extra_s": extra_seconds(nano, plain),
        "startup_extra_s": _stats(
            [n.startup_s - p.startup_s for n, p in zip(nano, plain, strict=True)]
        ),
        "val_loss_gap": {
            "max": max(val_gaps) if val_gaps else None,
            "steps_compared": len(val_gaps),
        },
        "nanolab_startup_s": _stats([n.startup_s for n in nano]),
        "plain_startup_s": _stats([p.startup_s for p in plain]),
        "goodput": _stats([n.goodput for n in nano if n.goodput is not None] or [float("nan")]),
        "data_wait_s": [n.data_wait_s for n in nano],
        "mfu": _median([n.mfu for n in nano]),
        "peak_mem_bytes": max((n.peak_mem_bytes or 0 for n in nano), default=0) or None,
        "predicted_peak_bytes": predicted,
        "rounds_detail": [
            {
                "nanolab": asdict(n),
                "plain": asdict(p),
                **({"lightning": asdict(bare[r])} if bare else {}),
            }
            for r, (n, p) in enumerate(zip(nano, plain, strict=True))
        ],
        "load_avg": loads,  # at the start and the end
    }
    if bare:
        res["lightning_tokens_per_s"] = _stats([b.tokens_per_s for b in bare])
        res["lightning_loss_gap"] = loss_gap(bare)  # the bare Trainer vs the plain loop
        # the overhead split: Lightning's own loop, then what nanolab adds on top of it
        res["lightning_ms_per_step"] = _stats(
            [(b.median_step_s - p.median_step_s) * 1e3 for b, p in zip(bare, plain, strict=True)]
        )
        res["nanolab_beyond_lightning_ms_per_step"] = _stats(
            [(n.median_step_s - b.median_step_s) * 1e3 for n, b in zip(nano, bare, strict=True)]
        )
    sides = {
        "nanolab": "nanolab_tokens_per_s",
        "plain loop": "plain_tokens_per_s",
        "ratio": "ratio",
        **({"bare Lightning": "lightning_tokens_per_s"} if bare else {}),
    }
    res["spread"] = {k: spread(res[v]) if rounds > 1 else None for k, v in sides.items()}
    res["warnings"] = noise_warnings(res)
    res["noisy"] = bool(res["warnings"])
    return res


def _machine() -> str:
    import platform

    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"


def format_table(res: dict[str, Any]) -> str:
    """The bench's figures as a table (median, min, max over rounds; one figure: median only),
    the spread and the verdict on the ratio below it."""
    rows: list[list[str]] = []

    def row(name: str, s: dict[str, float], fmt: str, note: str = "") -> None:
        rows.append([name, *(format(s[k], fmt) for k in ("median", "min", "max")), note])

    def one(name: str, value: str, note: str = "") -> None:
        rows.append([name, value, "", "", note])

    row("nanolab tokens/s (steady)", res["nanolab_tokens_per_s"], ",.0f")
    row("plain loop tokens/s (steady)", res["plain_tokens_per_s"], ",.0f")
    row("ratio nanolab / plain", res["ratio"], ".3f")
    if res.get("overhead_ms_per_step"):
        row("overhead per step ms", res["overhead_ms_per_step"], ".2f")
    if res.get("lightning_ms_per_step"):
        row("bare Lightning tokens/s (steady)", res["lightning_tokens_per_s"], ",.0f")
        row("overhead: Lightning's loop ms", res["lightning_ms_per_step"], ".2f", "bare - plain")
        note = "nanolab - bare"
        row("overhead: nanolab's own ms", res["nanolab_beyond_lightning_ms_per_step"], ".2f", note)
    syncs = res.get("syncs")
    if syncs:
        note = (
            f"{syncs['steps_counted']} steps counted; per micro-batch at most "
            f"{syncs['per_micro_batch_max']}"
        )
        row("syncs per step, nanolab", syncs["per_step"], ".0f", note)
    row("nanolab tokens/s (whole window)", res["nanolab_window_tokens_per_s"], ",.0f")
    row("plain tokens/s (whole window)", res["plain_window_tokens_per_s"], ",.0f")
    if res.get("window_ratio"):
        row("ratio, whole window", res["window_ratio"], ".3f", "evaluations and saves included")
    if res.get("end_to_end_ratio"):
        row("end to end, nanolab s", res["nanolab_wall_s"], ".1f", "process start to exit")
        row("end to end, plain s", res["plain_wall_s"], ".1f")
        row("ratio, end to end", res["end_to_end_ratio"], ".3f", "plain s / nanolab s")
        note = "end to end - steps x median step"
        row("outside steady steps, nanolab s", res["nanolab_outside_steps_s"], ".1f", note)
        row("outside steady steps, plain s", res["plain_outside_steps_s"], ".1f")
    for what, stats in [("start-up", res.get("startup_extra_s")),
                        *((PAUSES[k], v) for k, v in (res.get("extra_s") or {}).items())]:  # fmt: skip
        if stats:
            row(f"{what}, nanolab - plain s", stats, "+.2f", "the same work on both sides")
    row("start-up to first step, nanolab s", res["nanolab_startup_s"], ".2f")
    row("start-up to first step, plain s", res["plain_startup_s"], ".2f")
    row("goodput, nanolab", res["goodput"], ".3f")
    gap = res.get("loss_gap") or {}
    if gap.get("max") is not None:  # both sides trained the same thing
        note = f"nanolab vs plain, {gap['steps_compared']} steps compared"
        one("|loss gap| at the same steps, max", f"{gap['max']:.2g}", note)
    gap = res.get("val_loss_gap") or {}
    if gap.get("max") is not None:  # both sides validated the same model
        note = f"nanolab vs plain, {gap['steps_compared']} validations compared"
        one("|val loss gap|, max", f"{gap['max']:.2g}", note)
    gap = res.get("lightning_loss_gap") or {}
    if gap.get("max") is not None:
        note = f"bare Lightning vs plain, {gap['steps_compared']} steps compared"
        one("|loss gap| at the same steps, max", f"{gap['max']:.2g}", note)
    waits = [w for w in res.get("data_wait_s", []) if w is not None]
    if waits:
        row("waiting for batches, nanolab s", _stats(waits), ".2f")
    if res.get("mfu") is not None:
        one("MFU, nanolab (median)", f"{res['mfu']:.3f}")
    if res.get("peak_mem_bytes"):
        one("peak memory measured, GiB", f"{res['peak_mem_bytes'] / 2**30:.2f}")
    if res.get("predicted_peak_bytes"):
        one("peak memory predicted, GiB", f"{res['predicted_peak_bytes'] / 2**30:.2f}")
    if "import_s" in res:
        one("import nanolab.run.cli, s", f"{res['import_s']:.2f}")
    title = (
        f"nanolab bench — {res['machine']}, {res['date']}, {res['rounds']} rounds x "
        f"{res['steps']} steps (warmup {res['warmup']})"
    )
    lines = [title, *table(rows, ["", "median", "min", "max", ""], right={1, 2, 3})]
    spreads = res.get("spread") or {}
    if any(v is not None for v in spreads.values()):
        shown = ", ".join(f"{k} {v:.1%}" for k, v in spreads.items() if v is not None)
        lines.append(f"run-to-run spread (max-min)/median: {shown}")
    for warning in res.get("warnings", []):
        lines.append(f"warning: {warning}")
    if not res.get("warnings"):
        lines.append(f"the ratio within {NOISY_SPREAD:.0%} from round to round: it can be read")
    return "\n".join(lines)


class BenchError(NanolabError):
    """A ``nanolab bench`` option that cannot work."""


#: Settings the bench gives each side itself, with what to use instead.
BENCH_OWNS = {
    "trainer.max_steps": "use --steps",
    "run.name": "each round has its own run",
    "run.root": "the runs go to a temporary folder",
    "run.resume": "every round starts fresh",
}


def resolve_benchmarked(configs: list[str], overrides: list[str], steps: int) -> Any:
    """The config both sides will train, through the resolver ``nanolab fit`` uses: a setting
    that cannot work, or that the plain loop would not train the same way, is one line now,
    not a failed run or a ratio of different work after the first round.

    ``overrides`` are the ``--key value`` pairs given to fit, read by fit's own parser (an
    unknown key or a value of the wrong type is its one line here) and checked as fit checks
    the model at start-up.
    """
    from nanolab.run.read import FitParseError, fit_config
    from nanolab.training.resolve import check_model_settings, resolve, sections, visible_gpus

    try:
        config = fit_config(
            [
                *(a for c in configs for a in ("--config", c)),
                *("--trainer.max_steps", str(steps), "--run.name", "bench-0"),
                *overrides,
            ]
        )
    except FitParseError as err:
        raise BenchError(str(err)) from None
    check_model_settings(sections(config)[1])
    trainer = config.get("trainer") or {}
    resolved = resolve(config, visible_gpus=visible_gpus(trainer.get("accelerator")))
    check_comparable(config, resolved)
    return resolved


def set_pair(item: str) -> tuple[str, str]:
    """(``--key``, value) of one ``--set``: ``--key=value`` or ``--key value``."""
    text = item.strip()
    space, equals = text.find(" "), text.find("=")
    if space >= 0 and (equals < 0 or space < equals):  # --key value (the value may hold '=')
        key, _, value = text.partition(" ")
    else:
        key, _, value = text.partition("=")
    key, value = key.strip(), value.strip()
    if not key.startswith("--") or len(key) < 3 or not value:
        raise BenchError(
            f"--set {item!r}: give one fit setting and its value, e.g. "
            "--set=--run.eval_every_steps=50"
        )
    return key, value


def _stopped(terminated: threading.Event) -> int:
    """The line and exit code of a bench stopped by SIGTERM (143) or Ctrl-C (130): by now the
    side it ran has exited (:func:`_run`) and its temporary folder is removed."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a signal again while it exits: no traceback
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    how = "terminated" if terminated.is_set() else "interrupted"
    print(
        f"nanolab bench: {how}; the process it ran was stopped and its temporary runs "
        "removed; no result",
        file=sys.stderr,
    )
    return 128 + signal.SIGTERM if terminated.is_set() else 130


@one_line_errors("nanolab bench")
def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(
        prog="nanolab bench",
        description="nanolab fit vs a plain PyTorch loop on the same config (the same "
        "validations, task scoring and saves at the same steps), alternating A/B.",
    )
    parser.add_argument(
        "--config", action="append", required=True, help="nanolab config (repeatable)"
    )
    parser.add_argument(
        "--steps", type=int, default=150, help="optimizer steps per run (default %(default)s)"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=20,
        help="steps left out of the steady state (default %(default)s)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="A/B rounds, each side trained once per round, which goes first alternating; the "
        "figures are medians over rounds, with their spread (default %(default)s)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="--key=value",
        help="extra override for nanolab fit, e.g. --set=--run.eval_every_steps=50 (or "
        "--set '--run.eval_every_steps 50')",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--no-import-time",
        dest="import_time",
        action="store_false",
        help="skip timing `import nanolab.run.cli` in fresh interpreters (6 extra launches)",
    )
    parser.add_argument(
        "--no-count-syncs",
        dest="count_syncs",
        action="store_false",
        help="skip the extra, untimed nanolab run that counts host-device syncs per step",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also train under a bare Lightning Trainer (no callbacks, no logging): splits "
        "the overhead per step into Lightning's own loop and nanolab's (the rounds rotate "
        "which side goes first: a multiple of 3 puts each side first equally often)",
    )
    parser.add_argument(
        "--import-repeats",
        type=int,
        default=3,
        help="fresh interpreters timed for import_s, the best kept (default 3; each is a few "
        "seconds of imports)",
    )
    args = parser.parse_args(argv)
    if args.warmup < 0:
        raise BenchError(f"--warmup must be >= 0, got {args.warmup}")
    if args.steps <= args.warmup + 1:
        raise BenchError("--steps must exceed --warmup + 1")
    if args.rounds < 1:
        raise BenchError("--rounds must be >= 1")
    if args.import_repeats < 1:
        raise BenchError("--import-repeats must be >= 1")
    overrides = [part for item in args.set for part in set_pair(item)]
    for key in overrides[::2]:
        owner = BENCH_OWNS.get(key.lstrip("-"))
        if owner is not None:
            raise BenchError(f"--set {key}: the bench sets it for every side and round; {owner}")
    resolve_benchmarked(args.config, overrides, args.steps)
    terminated = threading.Event()
    try:
        with sigterm_as_interrupt(terminated):
            res = benchmark(
                args.config,
                overrides,
                args.steps,
                args.warmup,
                args.rounds,
                args.count_syncs,
                floor=args.floor,
            )
            if args.import_time:
                res["import_s"] = import_time("nanolab.run.cli", args.import_repeats)
    except RuntimeError as err:
        if not terminated.is_set():
            print(f"nanolab bench: error: {err}", file=sys.stderr)
            return 1
        return _stopped(terminated)
    except KeyboardInterrupt:
        return _stopped(terminated)
    print(json.dumps(res, indent=2) if args.json else format_table(res))
    return 0
