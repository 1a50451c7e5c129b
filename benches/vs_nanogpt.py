"""nanolab against nanoGPT itself: upstream ``train.py`` and ``nanolab fit``, same data and settings.

    python benches/vs_nanogpt.py --nanogpt ~/src/nanoGPT                      # both shapes
    python benches/vs_nanogpt.py --nanogpt ~/src/nanoGPT --shape quickstart --rounds 3 --threads 1

``--nanogpt`` is a checkout of https://github.com/karpathy/nanoGPT that you cloned yourself; its
code is run from there, never copied. In a scratch folder the bench

1. runs nanoGPT's own ``data/shakespeare_char/prepare.py`` on nanolab's bundled Shakespeare text
   (as ``input.txt``, so nothing is downloaded), giving ``train.bin``, ``val.bin``, ``meta.pkl``,
   and writes a nanolab ``meta.json`` beside them: both programs train on the very same token
   files, with the same vocabulary (no end-of-text id: nanoGPT has none);
2. alternates, round by round, upstream ``train.py`` (cwd = the scratch folder, which holds a link
   to the checkout's ``configurator.py`` and the data under ``data/shakespeare_char``) and
   ``nanolab fit --config configs/quickstart.yaml`` with the shape's settings as overrides;
3. reports per round and as median / min / max over rounds:

   * **steady** step time: the median interval between optimizer steps after ``--warmup``,
     leaving out steps that contain an evaluation or a checkpoint (nanoGPT's ``time`` column at
     ``log_interval=1``; nanolab's ``train`` records);
   * **steady CPU** step time: the same median in CPU seconds. The bench samples each
     process's CPU time (``/proc/<pid>/stat``, every 20 ms) and reads it off at every step's end
     (nanoGPT: when its ``iter N`` line arrives; nanolab: the record's time). On a shared
     machine a step's wall time is mostly waiting for a core; its CPU time is the work done;
   * **end to end**: wall time from launch to exit, evaluations, checkpoints and start-up
     included, and the CPU time the process used (``os.wait4``), which a busy machine disturbs
     less than wall time;
   * each side's last validation loss, to show both trained the same kind of model.

Ratios are ``nanoGPT time / nanolab time`` (above 1: nanolab is faster). Both sides evaluate on
the same number of windows at the same steps: nanoGPT's ``estimate_loss`` reads ``eval_iters``
batches of each split at steps 0, E, 2E, ... (``max_iters = steps - 1``, so it trains ``steps``
steps), nanolab reads ``2 * eval_iters * batch`` validation windows at E, 2E, ..., steps. nanoGPT
saves a checkpoint when the validation loss improves, nanolab at every evaluation.

Shapes: ``quickstart`` is configs/quickstart.yaml (4 layers, 4 heads, 128 wide, block 128,
batch 32, dropout 0, AdamW 3e-3, beta2 0.99, warmup 50, cosine to the last step); and
``shakespeare_char`` is nanoGPT's ``config/train_shakespeare_char.py`` itself (6 layers, 6 heads,
384 wide, block 256, batch 64, dropout 0.2, AdamW 1e-3, warmup 100, decay over 5000 steps), run
for a few steps only. nanolab's model options (GELU variant, vocabulary padding) are the
quickstart recipe's, printed with the results; ``--nanolab-set`` changes them. Both sides run in
float32 on CPU without ``torch.compile``, with the same ``--threads``.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import itertools
import json
import math
import os
import pickle
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
CORPUS = ROOT / "nanolab" / "data" / "corpus" / "shakespeare.txt.gz"
DATASET = "shakespeare_char"
#: What a nanoGPT checkout must hold for this bench (relative to its root).
UPSTREAM_FILES = ("train.py", "model.py", "configurator.py", "data/shakespeare_char/prepare.py")


class BenchError(Exception):
    """A setup problem the user can fix; printed as one line, exit code 2."""


@dataclass(frozen=True)
class Shape:
    """One benchmark setting, in nanoGPT's terms (nanolab's overrides are derived from it)."""

    name: str
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    batch_size: int
    dropout: float
    learning_rate: float
    min_lr: float
    warmup_iters: int
    lr_decay_iters: int | None  # None: the last step (nanolab's decay_steps null)
    steps: int
    eval_interval: int
    eval_iters: int
    warmup: int  # steps left out of the steady-state median
    upstream_config: str | None = None  # a file under the checkout's config/ to start from
    beta2: float = 0.99
    weight_decay: float = 0.1
    grad_clip: float = 1.0


SHAPES: dict[str, Shape] = {
    "quickstart": Shape(
        "quickstart", n_layer=4, n_head=4, n_embd=128, block_size=128, batch_size=32,
        dropout=0.0, learning_rate=3e-3, min_lr=3e-4, warmup_iters=50, lr_decay_iters=None,
        steps=400, eval_interval=100, eval_iters=4, warmup=10,
    ),
    "shakespeare_char": Shape(
        "shakespeare_char", n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=64,
        dropout=0.2, learning_rate=1e-3, min_lr=1e-4, warmup_iters=100, lr_decay_iters=5000,
        steps=24, eval_interval=12, eval_iters=1, warmup=3,
        upstream_config="config/train_shakespeare_char.py",
    ),
}  # fmt: skip


@dataclass
class SideRun:
    """One training run of one side."""

    step_s: list[float]  # seconds per optimizer step, index = step (0-based)
    dirty: list[int]  # steps whose interval holds an evaluation or a checkpoint
    wall_s: float  # launch to exit
    cpu_s: float  # user + system CPU seconds of the process and its threads
    first_step_s: float | None  # launch to the end of the first optimizer step (nanolab only)
    val_loss: float | None  # the last evaluation's validation loss
    step_cpu: list[float] = field(default_factory=list)  # CPU seconds per step (NaN: unknown)
    steady_s: float = float("nan")  # filled in by summarize()
    steady_cpu_s: float = float("nan")  # the same median, in CPU seconds


def steady_step_s(step_s: Sequence[float], dirty: Sequence[int], warmup: int) -> float:
    """Median seconds per step over steps ``>= warmup`` that hold no evaluation or checkpoint."""
    skip = set(dirty)
    clean = [s for i, s in enumerate(step_s) if i >= warmup and i not in skip]
    if not clean:
        raise BenchError(
            f"no clean step after warmup {warmup} in {len(step_s)} steps; raise --steps"
        )
    return statistics.median(clean)


def steady_cpu_s(step_cpu: Sequence[float], dirty: Sequence[int], warmup: int) -> float:
    """The steady median in CPU seconds (NaN where the CPU time was not sampled)."""
    known = [c if math.isfinite(c) else None for c in step_cpu]
    skip = set(dirty) | {i for i, c in enumerate(known) if c is None}
    clean = [c for i, c in enumerate(known) if i >= warmup and i not in skip and c is not None]
    return statistics.median(clean) if clean else float("nan")


# -- data ------------------------------------------------------------------------------------


def check_checkout(path: Path) -> None:
    missing = [f for f in UPSTREAM_FILES if not (path / f).is_file()]
    if missing:
        raise BenchError(
            f"--nanogpt {path} is not a nanoGPT checkout (missing {', '.join(missing)}); "
            "clone https://github.com/karpathy/nanoGPT and pass its folder"
        )


def prepare_data(nanogpt: Path, work: Path) -> Path:
    """Run nanoGPT's shakespeare_char ``prepare.py`` on the bundled text; add nanolab's meta.

    The script writes next to itself, so a copy of it runs in ``work/data/shakespeare_char``
    (the checkout is left untouched) with ``input.txt`` already there (no download).
    """
    folder = work / "data" / DATASET
    folder.mkdir(parents=True, exist_ok=True)
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        (folder / "input.txt").write_text(f.read(), encoding="utf-8")
    shutil.copyfile(nanogpt / "data" / DATASET / "prepare.py", folder / "prepare.py")
    proc = subprocess.run(
        [sys.executable, "prepare.py"], cwd=folder, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise BenchError(f"nanoGPT's prepare.py failed: {_last_line(proc.stderr)}")
    write_nanolab_meta(folder)
    return folder


def write_nanolab_meta(folder: Path) -> dict[str, Any]:
    """A nanolab ``meta.json`` for nanoGPT's ``train.bin``/``val.bin``/``meta.pkl`` (uint16 ids,
    one per character, no end-of-text), so ``nanolab fit`` reads the same files."""
    from nanolab.data.checks import FORMAT, check_files, load_meta

    with open(folder / "meta.pkl", "rb") as f:
        upstream = pickle.load(f)  # written by prepare.py a moment ago, in our own folder
    vocab = int(upstream["vocab_size"])
    itos = upstream["itos"]
    meta = {
        "format": FORMAT,
        "tokenizer": {"name": "chars", "chars": [itos[i] for i in range(vocab)], "eot": False},
        "vocab_size": vocab,
        "dtype": "uint16",
        "eot_id": None,
        "train_tokens": (folder / "train.bin").stat().st_size // 2,
        "val_tokens": (folder / "val.bin").stat().st_size // 2,
        "sources": ["nanoGPT data/shakespeare_char/prepare.py on bundled:shakespeare"],
    }
    (folder / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    check_files(folder, load_meta(folder))  # exactly what `nanolab fit` checks first
    return meta


# -- the two sides ---------------------------------------------------------------------------


def nanogpt_command(nanogpt: Path, shape: Shape, out_dir: str) -> list[str]:
    """Upstream train.py with the shape's settings (its configurator's ``--key=value`` syntax)."""
    decay = shape.lr_decay_iters or shape.steps
    settings: dict[str, Any] = {
        "device": "cpu", "compile": False, "dtype": "float32", "dataset": DATASET,
        "out_dir": out_dir, "wandb_log": False, "init_from": "scratch",
        "eval_interval": shape.eval_interval, "eval_iters": shape.eval_iters, "log_interval": 1,
        "always_save_checkpoint": False, "max_iters": shape.steps - 1,
        "gradient_accumulation_steps": 1, "batch_size": shape.batch_size,
        "block_size": shape.block_size, "n_layer": shape.n_layer, "n_head": shape.n_head,
        "n_embd": shape.n_embd, "dropout": float(shape.dropout), "bias": False,
        "learning_rate": float(shape.learning_rate), "min_lr": float(shape.min_lr),
        "warmup_iters": shape.warmup_iters, "lr_decay_iters": decay, "decay_lr": True,
        "beta1": 0.9, "beta2": float(shape.beta2), "weight_decay": float(shape.weight_decay),
        "grad_clip": float(shape.grad_clip),
    }  # fmt: skip
    cmd = [sys.executable, str(nanogpt / "train.py")]
    if shape.upstream_config:
        cmd.append(str(nanogpt / shape.upstream_config))
    return cmd + [
        f"--{k}={v!r}" if isinstance(v, str) else f"--{k}={v}" for k, v in settings.items()
    ]


def nanolab_command(shape: Shape, data: Path, runs: Path, tag: str, extra: list[str]) -> list[str]:
    """``nanolab fit`` on the quickstart recipe with the shape's settings as overrides."""
    # No decay override means the recipe's own null (cosine to the last step); passing
    # "null" explicitly is refused by the current parser for this Union field.
    decay = (
        []
        if shape.lr_decay_iters is None
        else ["--model.schedule.decay_steps", str(shape.lr_decay_iters)]
    )
    return [
        sys.executable, "-m", "nanolab", "fit", "--config", str(QUICKSTART),
        "--run.root", str(runs), "--run.name", tag, "--run.resume", "never",
        "--run.global_batch_tokens", "null", "--run.eval_every_steps", str(shape.eval_interval),
        "--checkpoint.every_n_steps", str(shape.eval_interval),
        "--trainer.max_steps", str(shape.steps), "--trainer.enable_progress_bar", "false",
        "--trainer.precision", "32-true", "--trainer.gradient_clip_val", str(shape.grad_clip),
        "--data.dataset_dir", str(data), "--data.source", "null",
        "--data.micro_batch_size", str(shape.batch_size),
        "--data.val_windows", str(2 * shape.eval_iters * shape.batch_size),
        "--model.gpt.block_size", str(shape.block_size),
        "--model.gpt.n_layer", str(shape.n_layer), "--model.gpt.n_head", str(shape.n_head),
        "--model.gpt.n_embd", str(shape.n_embd), "--model.gpt.dropout", str(shape.dropout),
        "--model.gpt.bias", "false", "--model.compile", "false",
        "--model.optimizer.lr", str(shape.learning_rate),
        "--model.optimizer.weight_decay", str(shape.weight_decay),
        "--model.optimizer.betas", f"[0.9, {shape.beta2}]",
        "--model.schedule.warmup_steps", str(shape.warmup_iters),
        *decay,
        "--model.schedule.min_lr_ratio", str(shape.min_lr / shape.learning_rate),
        *extra,
    ]  # fmt: skip


_ITER = re.compile(r"^iter (\d+): loss [-+0-9.naninf]+, time ([0-9.]+)ms")
_EVAL = re.compile(r"^step (\d+): train loss [0-9.naninf]+, val loss ([0-9.naninf]+)")


def parse_nanogpt_log(text: str, eval_interval: int) -> tuple[list[float], list[int], float | None]:
    """(seconds per step, steps holding an evaluation, last val loss) from train.py's output.

    With ``log_interval=1`` every step prints ``iter N: loss L, time Tms``; T is the wall time
    since the previous step ended, so step N's T holds the evaluation (and any checkpoint) that
    train.py runs at the top of iteration N when ``N % eval_interval == 0``.
    """
    steps: dict[int, float] = {}
    val: float | None = None
    for line in text.splitlines():
        if m := _ITER.match(line.strip()):
            steps[int(m.group(1))] = float(m.group(2)) / 1000
        elif m := _EVAL.match(line.strip()):
            val = float(m.group(2))
    ordered = [steps[i] for i in sorted(steps)]
    if sorted(steps) != list(range(len(ordered))):
        raise BenchError("nanoGPT's output misses some `iter N:` lines; is log_interval 1?")
    dirty = [i for i in range(len(ordered)) if i % eval_interval == 0]
    return ordered, dirty, val


def nanolab_steps(records: list[dict[str, Any]]) -> tuple[list[float], list[int], float | None]:
    """(seconds per step, steps whose interval holds a val/checkpoint record, last val loss).

    Step 0's interval runs from the ``start`` record (the trainer set up) to the first step.
    """
    start = next(r["time"] for r in records if r["event"] == "start")
    step_s: list[float] = []
    dirty: list[int] = []
    previous, pending, val = start, False, None
    for r in records:
        if r["event"] == "train":
            step_s.append(r["time"] - previous)
            previous = r["time"]
            if pending:
                dirty.append(len(step_s) - 1)
            pending = False
        elif r["event"] in ("val", "checkpoint"):
            pending = True  # lands in the next step's interval
            if r["event"] == "val" and r.get("val/loss") is not None:
                val = float(r["val/loss"])
    return step_s, dirty, val


@dataclass
class Timed:
    """One process run: wall and CPU totals, CPU samples over time, stamped output lines."""

    wall_s: float
    cpu_s: float
    returncode: int
    samples: list[tuple[float, float]]  # (time.time(), process CPU seconds so far)
    lines: list[tuple[float, str]]  # (time.time() when read, line)


def _proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` and its threads so far (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed(cmd: list[str], cwd: Path, env: dict[str, str], log: Path) -> Timed:
    """Run ``cmd`` with its output to ``log``; sample its CPU time every 20 ms meanwhile.

    The samples let step intervals be measured in CPU seconds as well as in wall seconds: on a
    shared machine a step's wall time is mostly waiting for a core, its CPU time is the work.
    """
    samples: list[tuple[float, float]] = []
    lines: list[tuple[float, str]] = []
    with open(log, "w", encoding="utf-8", errors="replace") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, errors="replace",
        )  # fmt: skip

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append((time.time(), line))
                out.write(line)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)  # rusage comes with the reap
            if pid:
                break
            cpu = _proc_cpu_s(proc.pid)
            if cpu is not None:
                samples.append((time.time(), cpu))
            time.sleep(0.02)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        reader.join()
    total = usage.ru_utime + usage.ru_stime
    return Timed(wall, total, int(proc.returncode), samples, lines)


def cpu_at(samples: Sequence[tuple[float, float]], t: float) -> float:
    """Process CPU seconds at wall time ``t``, linearly interpolated between samples."""
    if not samples:
        return float("nan")
    i = bisect.bisect_left(samples, (t, float("-inf")))
    if i == 0:
        return samples[0][1]
    if i == len(samples):
        return samples[-1][1]
    (ta, ca), (tb, cb) = samples[i - 1], samples[i]
    return ca + (cb - ca) * (t - ta) / (tb - ta) if tb > ta else cb


def step_cpu_s(samples: Sequence[tuple[float, float]], ends: Sequence[float]) -> list[float]:
    """CPU seconds of each step from its end times; step 0 (no known start) is NaN."""
    cpu = [cpu_at(samples, t) for t in ends]
    return [float("nan")] + [b - a for a, b in itertools.pairwise(cpu)]


def run_nanogpt(nanogpt: Path, shape: Shape, work: Path, tag: str, env: dict[str, str]) -> SideRun:
    log = work / f"{tag}.log"
    run = timed(nanogpt_command(nanogpt, shape, f"out-{tag}"), work, env, log)
    text = log.read_text(errors="replace")
    if run.returncode != 0:
        raise BenchError(
            f"nanoGPT train.py failed (exit {run.returncode}), see {log}: {_last_line(text)}"
        )
    step_s, dirty, val = parse_nanogpt_log(text, shape.eval_interval)
    ends = [t for t, line in run.lines if _ITER.match(line.strip())]
    return SideRun(step_s, dirty, run.wall_s, run.cpu_s, None, val, step_cpu_s(run.samples, ends))


def run_nanolab(
    shape: Shape, data: Path, work: Path, tag: str, env: dict[str, str], extra: list[str]
) -> SideRun:
    from nanolab.runlog import read_records

    log = work / f"{tag}.log"
    launched = time.time()
    run = timed(nanolab_command(shape, data, work / "runs", tag, extra), ROOT, env, log)
    if run.returncode != 0:
        text = log.read_text(errors="replace")
        raise BenchError(
            f"nanolab fit failed (exit {run.returncode}), see {log}: {_last_line(text)}"
        )
    records = read_records(work / "runs" / tag / "metrics.jsonl")
    step_s, dirty, val = nanolab_steps(records)
    first = next(r["time"] for r in records if r["event"] == "train") - launched
    ends = [r["time"] for r in records if r["event"] == "train"]
    return SideRun(step_s, dirty, run.wall_s, run.cpu_s, first, val, step_cpu_s(run.samples, ends))


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][-400:] if lines else "(no output)"


# -- rounds and summary ----------------------------------------------------------------------


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def summarize(shape: Shape, rounds: list[dict[str, SideRun]]) -> dict[str, Any]:
    """Per-round ratios (nanoGPT / nanolab: above 1 means nanolab is faster) and their spread."""
    per_round = []
    for r in rounds:
        up, us = r["nanogpt"], r["nanolab"]
        for side in (up, us):
            side.steady_s = steady_step_s(side.step_s, side.dirty, shape.warmup)
            side.steady_cpu_s = steady_cpu_s(side.step_cpu, side.dirty, shape.warmup)
        per_round.append(
            {
                "nanogpt": asdict(up),
                "nanolab": asdict(us),
                "steady_ratio": _ratio(up.steady_s, us.steady_s),
                "steady_cpu_ratio": _ratio(up.steady_cpu_s, us.steady_cpu_s),
                "wall_ratio": _ratio(up.wall_s, us.wall_s),
                "cpu_ratio": _ratio(up.cpu_s, us.cpu_s),
            }
        )
    tokens = shape.batch_size * shape.block_size
    return {
        "shape": asdict(shape),
        "rounds": per_round,
        "steady_ratio": spread([p["steady_ratio"] for p in per_round]),
        "steady_cpu_ratio": spread([p["steady_cpu_ratio"] for p in per_round]),
        "nanogpt_steady_cpu_ms": spread([r["nanogpt"].steady_cpu_s * 1000 for r in rounds]),
        "nanolab_steady_cpu_ms": spread([r["nanolab"].steady_cpu_s * 1000 for r in rounds]),
        "wall_ratio": spread([p["wall_ratio"] for p in per_round]),
        "cpu_ratio": spread([p["cpu_ratio"] for p in per_round]),
        "nanogpt_steady_ms": spread([r["nanogpt"].steady_s * 1000 for r in rounds]),
        "nanolab_steady_ms": spread([r["nanolab"].steady_s * 1000 for r in rounds]),
        "nanogpt_tokens_per_s": statistics.median(tokens / r["nanogpt"].steady_s for r in rounds),
        "nanolab_tokens_per_s": statistics.median(tokens / r["nanolab"].steady_s for r in rounds),
        "nanogpt_wall_s": spread([r["nanogpt"].wall_s for r in rounds]),
        "nanolab_wall_s": spread([r["nanolab"].wall_s for r in rounds]),
        "nanolab_first_step_s": spread([r["nanolab"].first_step_s or 0.0 for r in rounds]),
        "val_loss": {side: [r[side].val_loss for r in rounds] for side in ("nanogpt", "nanolab")},
    }


def nanolab_model_options(extra: list[str]) -> dict[str, Any]:
    """The quickstart recipe's model options that matter for speed, after ``--nanolab-set``."""
    import yaml

    gpt = dict((yaml.safe_load(QUICKSTART.read_text()).get("model") or {}).get("gpt") or {})
    for key, value in zip(extra[::2], extra[1::2], strict=False):
        if key.startswith("--model.gpt."):
            gpt[key.removeprefix("--model.gpt.")] = yaml.safe_load(value)
    return {k: gpt.get(k) for k in ("activation", "vocab_multiple")}


def format_table(res: dict[str, Any]) -> str:
    lines = [
        f"nanolab vs nanoGPT - {res['machine']}, {res['date']}, threads {res['threads']}, "
        f"{'concurrent' if res.get('concurrent') else 'alternating'}, "
        f"load {res['load_before']} -> {res['load_after']}, nanoGPT {res['nanogpt_commit']}",
        f"nanolab model options: {res['nanolab_model']}",
    ]
    for s in res["shapes"]:
        sh = s["shape"]
        lines += [
            "",
            f"{sh['name']}: {sh['n_layer']}L {sh['n_head']}H {sh['n_embd']}C block {sh['block_size']} "
            f"batch {sh['batch_size']} dropout {sh['dropout']}, {sh['steps']} steps, eval every "
            f"{sh['eval_interval']}, {len(s['rounds'])} rounds (ratio = nanoGPT / nanolab time)",
            f"{'':<30}{'median':>10}{'min':>10}{'max':>10}   per round",
        ]
        rows = (
            ("steady step, nanoGPT ms", "nanogpt_steady_ms", None, ".1f"),
            ("steady step, nanolab ms", "nanolab_steady_ms", None, ".1f"),
            ("steady ratio", "steady_ratio", "steady_ratio", ".3f"),
            ("steady step CPU, nanoGPT ms", "nanogpt_steady_cpu_ms", None, ".1f"),
            ("steady step CPU, nanolab ms", "nanolab_steady_cpu_ms", None, ".1f"),
            ("steady CPU-time ratio", "steady_cpu_ratio", "steady_cpu_ratio", ".3f"),
            ("end-to-end wall ratio", "wall_ratio", "wall_ratio", ".3f"),
            ("end-to-end CPU-time ratio", "cpu_ratio", "cpu_ratio", ".3f"),
            ("wall, nanoGPT s", "nanogpt_wall_s", None, ".1f"),
            ("wall, nanolab s", "nanolab_wall_s", None, ".1f"),
            ("launch to first step, nanolab s", "nanolab_first_step_s", None, ".2f"),
        )
        for label, key, per, fmt in rows:
            v = s[key]
            each = " ".join(f"{p[per]:{fmt}}" for p in s["rounds"]) if per else ""
            lines.append(
                f"{label:<30}{v['median']:>10{fmt}}{v['min']:>10{fmt}}{v['max']:>10{fmt}}   {each}"
            )
        vl = s["val_loss"]
        lines.append(f"{'last val loss nanoGPT / nanolab':<30}{vl['nanogpt']} / {vl['nanolab']}")
    return "\n".join(lines)


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}"


def _load() -> str:
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "?"


def _commit(nanogpt: Path) -> str:
    proc = subprocess.run(
        ["git", "-C", str(nanogpt), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return proc.stdout.strip() if proc.returncode == 0 else "unknown commit"


def benchmark(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    nanogpt = Path(args.nanogpt).resolve()
    check_checkout(nanogpt)
    extra = [part for item in args.nanolab_set for part in item.split("=", 1)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.threads:
        env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    data = prepare_data(nanogpt, work)
    # train.py reads ./configurator.py and ./data/<dataset>: the scratch folder is its cwd.
    (work / "configurator.py").symlink_to(nanogpt / "configurator.py")
    result: dict[str, Any] = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "threads": args.threads or "default",
        "concurrent": bool(args.concurrent),
        "nanogpt_commit": _commit(nanogpt),
        "nanolab_model": nanolab_model_options(extra),
        "nanolab_set": extra,
        "load_before": _load(),
        "shapes": [],
    }
    for name in args.shape:
        shape = SHAPES[name]
        shape = with_overrides(shape, args.steps, args.eval_every, args.warmup)
        rounds: list[dict[str, SideRun]] = []
        for r in range(args.rounds):
            order = ("nanogpt", "nanolab") if r % 2 == 0 else ("nanolab", "nanogpt")

            def one(side: str, r: int = r, name: str = name, shape: Shape = shape) -> SideRun:
                tag = f"{name}-{side}-{r}"
                print(f"[{time.strftime('%H:%M:%S')}] {tag} ...", file=sys.stderr, flush=True)
                if side == "nanogpt":
                    return run_nanogpt(nanogpt, shape, work, tag, env)
                return run_nanolab(shape, data, work, tag, env, extra)

            if args.concurrent:  # both at once: the same background load for both
                with ThreadPoolExecutor(2) as pool:
                    futures = {side: pool.submit(one, side) for side in order}
                    rounds.append({side: f.result() for side, f in futures.items()})
            else:
                rounds.append({side: one(side) for side in order})
        result["shapes"].append(summarize(shape, rounds))
    result["load_after"] = _load()
    return result


def with_overrides(
    shape: Shape, steps: int | None, eval_every: int | None, warmup: int | None
) -> Shape:
    """The shape with the command line's ``--steps``/``--eval-every``/``--warmup`` (None: keep)."""
    values = {"steps": steps, "eval_interval": eval_every, "warmup": warmup}
    return Shape(**(asdict(shape) | {k: v for k, v in values.items() if v is not None}))


def _one_line_error(message: str) -> None:
    print(f"vs_nanogpt: error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python benches/vs_nanogpt.py",
        description="nanolab fit vs nanoGPT's own train.py on the same data and settings.",
    )
    parser.add_argument("--nanogpt", required=True, help="a nanoGPT checkout (git clone)")
    parser.add_argument(
        "--shape", action="append", choices=sorted(SHAPES), help="repeatable; default: both"
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (default 2)")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (default: per shape)")
    parser.add_argument("--eval-every", type=int, help="steps between evaluations")
    parser.add_argument(
        "--warmup", type=int, help="steps left out of the steady median (default: per shape)"
    )
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS for both sides")
    parser.add_argument(
        "--concurrent",
        action="store_true",
        help="run the two sides of a round at the same time (a shared machine's load then "
        "falls on both alike; compare CPU times, give each side its cores with --threads)",
    )
    parser.add_argument(
        "--nanolab-set",
        action="append",
        default=[],
        metavar="--key=value",
        help="extra nanolab fit override, e.g. --nanolab-set=--model.gpt.activation=gelu_tanh",
    )
    parser.add_argument("--work", help="scratch folder to keep (default: a temporary one)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--out", help="also write the JSON result to this file")
    parser.error = _one_line_error  # type: ignore[method-assign]
    args = parser.parse_args(argv)
    args.shape = args.shape or list(SHAPES)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if args.warmup is not None and args.warmup < 0:
        parser.error("--warmup must be >= 0")
    for name in args.shape:
        shape = with_overrides(SHAPES[name], args.steps, args.eval_every, args.warmup)
        if shape.steps < 2 or shape.eval_interval < 1 or shape.steps <= shape.warmup + 1:
            parser.error(
                f"--steps {shape.steps} / --eval-every {shape.eval_interval} / --warmup "
                f"{shape.warmup} leave no steady steps"
            )
    try:
        if args.work:
            work = Path(args.work)
            if work.exists() and any(work.iterdir()):
                raise BenchError(f"--work {work} is not empty; give a new or empty folder")
            work.mkdir(parents=True, exist_ok=True)
            res = benchmark(args, work.resolve())
        else:
            with tempfile.TemporaryDirectory(prefix="vs-nanogpt-") as tmp:
                res = benchmark(args, Path(tmp))
    except BenchError as err:
        print(f"vs_nanogpt: error: {err}", file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2) if args.json else format_table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
