"""Every check nanolab has never run on a GPU, in one command; one JSON summary and a short table.

    bash benches/gpu_check.sh                            # all checks, results in $OUT
    bash benches/gpu_check.sh --only flash,bench_124m    # a subset (names: --list)
    python benches/gpu_check.py --list                   # what runs, with each check's time cap

``benches/gpu_check.sh`` is the entry point (it adds a hard time limit); this file is the driver.
Each check runs in its own process group with a time cap, so a hang or an out-of-memory crash in
one is recorded and the next one still runs (past its cap it is killed with every process it
started, in its group or not: ``pack``'s queue jobs lead sessions of their own). After every check the summary is rewritten, so a run
cut short still leaves what it measured:

* ``$OUT/gpu_check.json``: machine, versions, and per check ``status`` (``ok``, ``fail``,
  ``timeout``, ``stopped``, ``skipped``, ``not_run``), ``seconds``, ``metrics`` and ``note``;
* ``$OUT/gpu_check.md``: the same as a table;
* ``$OUT/logs/<check>.log``: each check's full output.

Checks, most important first (``--list`` prints them with their caps):

* ``flash``: the flash SDPA kernel runs fwd+bwd in bf16 at GPT-2 124M's attention shape and
  agrees with the math kernel (output, and gradient relative to the largest);
* ``bench_124m``: ``nanolab bench`` on GPT-2 124M (bf16, ``torch.compile``, flash): tokens/s of
  ``nanolab fit`` and of the plain loop, MFU, measured vs predicted peak memory (compiled);
* ``flex_mask``: a document mask with a 512-token window at 124M's attention shape, bf16: the
  compiled FlexAttention path against SDPA with the boolean mask (outputs, gradients, times,
  and causal flash's time beside them);
* ``memory_eager``: ``benches/bench_memory.py`` on 124M and 350M: predicted vs measured peak and
  saved activations, eager;
* ``memory_compiled_350m``: ``nanolab fit`` of 350M with ``torch.compile``: measured peak vs
  the estimator's prediction;
* ``async_checkpoint``: 124M with a checkpoint every 10 steps, written in the step vs in a
  background thread: the stall each checkpoint costs the training loop;
* ``micro_batch_auto``: ``run.micro_batch_size: auto`` on 124M: the size it picked, and that a
  real run at that size fits (measured peak vs the device's memory);
* ``flex_fit``: ``nanolab fit`` of 124M with ``attention: flex``, ``document_mask`` and a
  window, ``torch.compile``, bf16 and gradient checkpointing (FlexAttention's backward inside
  the compiled model), a validation, and a branch resumed from its middle checkpoint: finite
  losses, the branch's losses against the uninterrupted run's, step time and peak memory;
* ``pack``: ``benches/gpu_pack.py``: 3 GPT-2 124M jobs packed on one GPU vs one after another
  (skipped when that bench is not in this tree).

Without a visible CUDA/ROCm GPU it stops at once: one error line, exit code 2, and a summary with
``status: no_gpu``. Runs, checkpoints and data go to ``--work`` (deleted at the end unless
``--keep``), never to ``$OUT``. Exit code 0 when every check that ran passed, 1 otherwise.
A Ctrl-C or SIGTERM (``gpu_check.sh``'s time limit) kills the check in flight with everything
it started, writes the summary (that check ``stopped``, the rest ``not_run``), removes the
scratch folder and exits 128 + the signal's number.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30
STATUSES = ("ok", "fail", "timeout", "stopped", "skipped", "not_run")


@dataclass(frozen=True)
class Check:
    name: str
    cap_s: int  # the most this check may take; the driver gives it less when time runs out
    what: str


# In the order they run: fast and most important first, the slowest last (a run cut short by
# its deadline still has the headline figures). Caps are from the H200 runs of 2026-12-04
# (docs/gpu-check.md), cold, with one Inductor cache shared by every process.
CHECKS: tuple[Check, ...] = (
    Check("flash", 20, "flash SDPA fwd+bwd in bf16 at 124M's attention shape, vs the math kernel"),
    Check("flex_mask", 45, "document mask + window: FlexAttention vs SDPA boolean mask, bf16"),
    Check("bench_124m", 200, "nanolab bench 124M bf16+compile+flash+clip: tokens/s, MFU, memory"),
    Check("vs_nanogpt", 120, "nanoGPT's train.py, same GPU, data and 124M config (--nanogpt)"),
    Check("memory_eager", 70, "bench_memory.py 124M + 350M eager: predicted vs measured memory"),
    Check("micro_batch_auto", 45, "run.micro_batch_size auto on 124M: the picked size fits"),
    Check("flex_fit", 150, "fit 124M attention flex + document mask, compiled: trains, resumes"),
    Check("async_checkpoint", 70, "124M, checkpoint every 5 steps: stall, sync vs async"),
    Check("memory_compiled_350m", 150, "fit 350M compiled: measured vs predicted peak memory"),
    Check("pack", 180, "benches/gpu_pack.py: 2 x 124M packed vs sequential"),
)
BY_NAME = {c.name: c for c in CHECKS}


@dataclass(frozen=True)
class Scale:
    """Sizes and device of a run: the GPU's, or the CPU dry run's (every check's code path on
    tiny sizes, so the code a lent GPU session runs has run before; tests/test_gpu_check.py)."""

    device: str
    attention_shape: tuple[int, int, int, int]  # B, H, T, D
    model_args: tuple[str, ...]  # fit overrides that shrink the recipe (none on a GPU)
    bench_steps: int
    bench_warmup: int
    bench_micro_batch: int
    fit_steps: int
    checkpoint_every: int
    pack_jobs: int
    pack_steps: int
    block_size: int  # the recipe's context at this scale
    compile: bool  # whether the checks that compile do (a cold CPU compile costs ~40 s)
    nanogpt_model: tuple[int, int, int]  # n_layer, n_head, n_embd of the side-by-side
    bench_args: tuple[str, ...] = ()  # more `nanolab bench` options (none on a GPU)
    #: each check's H200 cap times this, and the default --deadline too: the dry run's tiny
    #: sizes took up to 74 s a check on a 2-core CPU at load 5 (memory_eager's 50 s, past its
    #: H200 cap of 70 s at load 3.9), so the H200's caps read a slow CPU as a failed check
    cap_scale: int = 1

    def cap_s(self, check: Check) -> int:
        """The most ``check`` may take at this scale."""
        return check.cap_s * self.cap_scale


GPU = Scale("cuda", (8, 12, 1024, 64), (), 60, 20, 16, 6, 5, 2, 10, 1024, True, (12, 12, 768))
DRY = Scale(
    "cpu", (2, 2, 128, 16),
    (
        "--trainer.accelerator", "cpu", "--model.gpt.n_layer", "1", "--model.gpt.n_head", "2",
        "--model.gpt.n_embd", "32", "--model.gpt.block_size", "64", "--data.num_workers", "0",
        "--model.gpt.vocab_size", "null", "--data.val_windows", "8",
        "--model.compile", "false", "--model.optimizer.fused", "true",  # CUDA's optimizer
    ),
    6, 2, 4, 3, 2, 2, 3, 64, False, (1, 2, 32),
    # One fresh interpreter for the bench's import time, not three (~5 s each on 2 cores); the
    # packed jobs are the GPU's 124M recipe, shrunk as the fits are (see check_pack).
    bench_args=("--import-repeats", "1"),
    cap_scale=3,
)  # fmt: skip
SCALE = GPU  # the child process sets DRY for --dry-run


@dataclass
class Result:
    name: str
    status: str
    seconds: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    log: str | None = None


class CheckFailed(Exception):
    """A check ran but its result is wrong; the message is the summary's note."""


class CheckSkipped(Exception):
    """A check that cannot run in this tree or on this device; the message says why."""


class Stopped(Exception):
    """SIGINT or SIGTERM reached the driver (a Ctrl-C, ``gpu_check.sh``'s time limit, a kill):
    it stops the check in flight, writes what finished and removes its scratch folder.
    ``result`` is the check it stopped, when one was running."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        self.result: Result | None = None
        super().__init__(self.name)


def stop_on_signals() -> None:
    """Turn the first SIGINT or SIGTERM into :class:`Stopped` in the driver, and ignore the
    ones after it: a Ctrl-C reaches the driver both from the terminal and forwarded by
    ``timeout``, and a second one must not cut short the clean-up the first started."""
    from nanolab.processes import STOP_SIGNALS

    def stop(signum: int, _frame: Any) -> None:
        for each in STOP_SIGNALS:
            signal.signal(each, signal.SIG_IGN)
        raise Stopped(signum)

    for each in STOP_SIGNALS:
        signal.signal(each, stop)


# -- helpers the checks share ------------------------------------------------------------------


def nanolab_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "nanolab", *args]


def run(cmd: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run a command with its output streamed into this check's log as it comes (a check
    killed at its cap still leaves what the child printed); the output is also returned
    (stdout and stderr merged, its last 2 MB) for the check to read."""
    print("$ " + " ".join(cmd), flush=True)
    tail: deque[str] = deque()
    size = 0
    with subprocess.Popen(
        cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    ) as proc:  # fmt: skip
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            tail.append(line)
            size += len(line)
            while size > 2_000_000 and len(tail) > 1:
                size -= len(tail.popleft())
    text = "".join(tail)
    return subprocess.CompletedProcess(cmd, proc.returncode, text, text)


_EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b.*:|: error: ")


def last_line(text: str) -> str:
    """What a failed child said: its last exception line (``torch.OutOfMemoryError: CUDA out of
    memory. Tried to allocate ...``) or one-line error, else its last line; 300 characters."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if _EXCEPTION_LINE.search(line)]
    chosen = errors[-1] if errors else (lines[-1] if lines else "(no output)")
    return chosen[:300]


def ensure_data(work: Path, given: str | None) -> Path:
    """A GPT-2-vocabulary dataset: ``--data``, or BPE 50257 trained on the bundled text (speed
    and memory depend on the vocabulary size, not on the text); characters in the dry run."""
    if given:
        return Path(given).resolve()
    dry = SCALE is DRY
    data = work / "data" / ("chars" if dry else "bpe50k")
    if not (data / "meta.json").is_file():
        tokenizer = ["chars"] if dry else ["bpe", "--bpe-vocab-size", "50257"]
        proc = run(
            nanolab_cmd(
                "prepare", "bundled:shakespeare", "--tokenizer", *tokenizer, "-o", str(data)
            )
        )
        if proc.returncode != 0:
            raise CheckFailed(f"nanolab prepare failed: {last_line(proc.stderr)}")
    return data


def fit_args(config: str, data: Path, work: Path, name: str, steps: int) -> list[str]:
    """``nanolab fit`` of a shipped recipe for a few steps on ``data``, one micro-batch a step.
    ``a.yaml+b.yaml`` composes overlay b on a, as repeated ``--config`` files do."""
    files = [a for c in config.split("+") for a in ("--config", str(ROOT / "configs" / c))]
    return [
        "fit", *files,
        "--run.root", str(work / "runs"), "--run.name", name, "--run.resume", "never",
        "--run.global_batch_tokens", "null", "--run.eval_every_steps", "100000",
        "--trainer.limit_val_batches", "0",  # no validation, not even the last step's
        "--checkpoint.every_n_steps", "100000", "--trainer.max_steps", str(steps),
        "--trainer.enable_progress_bar", "false", "--downstream.suite", "null",
        "--data.dataset_dir", str(data), "--data.source", "null", *SCALE.model_args,
    ]  # fmt: skip


def records(work: Path, name: str) -> list[dict[str, Any]]:
    from nanolab.runlog import read_records

    return read_records(work / "runs" / name / "metrics.jsonl")


def peak_allocated(recs: list[dict[str, Any]]) -> int | None:
    """The run's largest ``mem_allocated_bytes`` (the device allocator's peak); ``None`` where
    the run log has none (a CPU run)."""
    values = [r.get("mem_allocated_bytes") for r in recs if r["event"] == "train"]
    return max((v for v in values if v), default=None)


def predicted_peak(work: Path, name: str) -> int | None:
    from nanolab.bench.harness import predicted_peak_bytes

    return predicted_peak_bytes(work / "runs" / name / "config.yaml")


def gib(value: float | None) -> float | None:
    return None if value is None else value / GiB


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    return predicted / measured - 1 if predicted and measured else None


#: How far the estimator's peak allocated may be from the measured one (the rules were within
#: 0.5% of every H200 figure of 2026-12-04, eager and compiled: docs/gpu-check.md).
PEAK_TOLERANCE = 0.05

#: What a figure the CPU has no source for reads in the dry run (a device allocator's peak: the
#: run log's ``mem_allocated_bytes`` is CUDA's). Said in the figure's own field, never ``None``,
#: which a GPU run refuses.
NA_ON_CPU = "n/a on CPU"


def peak_metrics(measured: int | None, predicted: int | None) -> dict[str, Any]:
    """A run's measured and predicted peak allocated (GiB) and the prediction's error; the
    measured peak and the error read :data:`NA_ON_CPU` in the dry run, which has no allocator
    peak to measure (the prediction it has: the CPU's rules)."""
    dry = SCALE is DRY and measured is None
    return {
        "peak_measured_gib": NA_ON_CPU if dry else gib(measured),
        "peak_predicted_gib": gib(predicted),
        "peak_error": NA_ON_CPU if dry else relative_error(predicted, measured),
    }


def judge_peak(metrics: dict[str, Any]) -> None:
    """Fail a check whose memory figures are missing or off: no prediction, no measured peak
    (on a GPU; a broken memory reader must not pass as "peak - GiB"), or a prediction more than
    :data:`PEAK_TOLERANCE` from the measured peak. ``metrics`` go with the failure."""
    if metrics.get("peak_predicted_gib") is None:
        raise CheckFailed(
            "no predicted peak: the estimator gave none for the run's config", metrics
        )
    if metrics.get("peak_measured_gib") is None:
        raise CheckFailed("no measured peak: the run log has no mem_allocated_bytes", metrics)
    error = metrics.get("peak_error")
    if isinstance(error, float) and abs(error) > PEAK_TOLERANCE:
        raise CheckFailed(
            f"peak allocated predicted {error:+.1%} off the measured one (limit "
            f"{PEAK_TOLERANCE:.0%})",
            metrics,
        )


def step_seconds(recs: list[dict[str, Any]]) -> list[float]:
    times = [r["time"] for r in recs if r["event"] == "train"]
    return [b - a for a, b in itertools.pairwise(times)]


def synchronize() -> None:
    import torch

    if SCALE.device == "cuda":
        torch.cuda.synchronize()


def timed_ms(fn: Callable[[], Any], repeats: int = 10) -> float:
    """Mean wall milliseconds of ``fn`` over ``repeats`` calls, after one warm-up call."""
    fn()
    synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    synchronize()
    return (time.perf_counter() - start) / repeats * 1000


# -- the checks (each runs in a child process: `gpu_check.py --run-check NAME`) -----------------


def check_flash(work: Path, data_arg: str | None) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, H, T, D = SCALE.attention_shape  # GPT-2 124M at micro-batch 8
    device = SCALE.device
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(B, H, T, D, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
        for _ in range(3)
    )

    def attend(backend: SDPBackend) -> tuple[torch.Tensor, torch.Tensor]:
        with sdpa_kernel(backend):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            (grad,) = torch.autograd.grad(y.float().square().mean(), q)
        return y.detach(), grad

    try:
        y_flash, g_flash = attend(SDPBackend.FLASH_ATTENTION)
    except RuntimeError as err:
        raise CheckFailed(f"flash kernel unavailable: {last_line(str(err))}") from None
    y_math, g_math = attend(SDPBackend.MATH)
    ms = timed_ms(lambda: attend(SDPBackend.FLASH_ATTENTION))
    results = {
        "fwd_bwd_ms": round(ms, 3),
        "max_out_diff": (y_flash.float() - y_math.float()).abs().max().item(),
        "max_grad_rel_diff": relative_max_diff(g_flash, g_math),
    }
    judge_flash(results)
    return results


#: How far flash's output may be from the math kernel's (absolute, on outputs of order 1): a
#: bf16 rounding of an output near 2-4 is 2^-6 ~ 0.016 (the H200 gave 1.6e-2), so 2e-2.
FLASH_OUT_LIMIT = 2e-2

#: How far flash's gradient may be from the math kernel's, relative to the largest (an absolute
#: bound means nothing: at 124M's shape the mean loss's gradients are ~1e-8). Both kernels take
#: the same bf16 inputs and add in fp32 in their own order, so their bf16 gradients differ by a
#: few roundings of the largest (2^-9 ~ 0.002 each; 0.003 on a CPU's flash kernel at the dry
#: run's shape). 2e-2 is ten roundings, as :data:`FLEX_GRAD_LIMIT`; a backward 5% wrong gives
#: 0.05 and a causal output with a non-causal backward ~1 (tests/test_gpu_check.py).
FLASH_GRAD_LIMIT = 2e-2


def judge_flash(results: dict[str, Any]) -> None:
    """Fail ``flash`` when its output or gradient is past its bound from the math kernel's
    (:data:`FLASH_OUT_LIMIT`, :data:`FLASH_GRAD_LIMIT`); ``results`` go with the failure."""
    _hold_to_bounds(
        results,
        "flash and math attention",
        "flash's",
        (FLASH_OUT_LIMIT, FLASH_GRAD_LIMIT),
        backward=True,
    )


def _hold_to_bounds(
    results: dict[str, Any],
    pair: str,
    kernel: str,
    limits: tuple[float, float],
    backward: bool,
) -> None:
    """Fail when ``results``' output difference is past ``limits[0]``, or (``backward``) its
    gradient difference, relative to the largest, is missing or past ``limits[1]``; ``pair``
    names the two kernels compared, ``kernel`` the one whose backward was timed."""
    out_diff = results["max_out_diff"]
    if not out_diff <= limits[0]:
        raise CheckFailed(
            f"{pair} differ by {out_diff:.3g} in output (limit {limits[0]:g})", results
        )
    if not backward:
        return
    grad_diff = results.get("max_grad_rel_diff")
    if grad_diff is None:
        raise CheckFailed(f"no gradient difference recorded for {kernel} backward", results)
    if not grad_diff <= limits[1]:
        raise CheckFailed(
            f"{pair} differ by {grad_diff:.3g} in gradient, relative to the largest "
            f"(limit {limits[1]:g})",
            results,
        )


def check_flex_mask(work: Path, data_arg: str | None) -> dict[str, Any]:
    """``model.gpt.document_mask`` + ``attention_window`` at 124M's attention shape, as training
    runs it: the mask built once per batch (``block_mask_ms``: FlexAttention's block mask,
    ``dense_mask_ms``: the boolean one), then each layer's attention with it
    (``attention: flex`` against ``attention: sdpa``), forward and backward, beside causal
    flash. On a CPU (the dry run) FlexAttention has no backward: forward only there."""
    import torch
    import torch.nn.functional as F

    from nanolab.model.config import GPTConfig
    from nanolab.model.gpt import AttentionMask, flex_attend

    B, H, T, D = SCALE.attention_shape
    device = SCALE.device
    backward = device == "cuda"
    g = torch.Generator(device=device).manual_seed(0)
    idx = torch.randint(0, 50000, (B, T), device=device, generator=g)
    idx[torch.rand(B, T, device=device, generator=g) < 1 / 300] = 50256  # ~300-token documents
    config = GPTConfig(vocab_size=50257, block_size=T, n_layer=1, n_head=H, n_embd=H * D,
                       document_mask=True, eot_id=50256, attention_window=T // 2)  # fmt: skip
    q, k, v = (
        torch.randn(B, H, T, D, device=device, dtype=torch.bfloat16, generator=g).requires_grad_(
            backward
        )
        for _ in range(3)
    )
    visible = AttentionMask(idx, config)
    block, dense = visible.block_mask(), visible.dense()  # first builds: compile, not timed

    def with_grad(fn: Callable[[], torch.Tensor]) -> Callable[[], Any]:
        def step() -> Any:
            y = fn()
            return torch.autograd.grad(y.float().square().mean(), q) if backward else y

        return step

    kernels = {
        "flex": lambda: flex_attend(q, k, v, block),
        "dense": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense),
        "causal_flash": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    results: dict[str, Any] = {"backward": backward}
    with torch.no_grad():
        results["block_mask_ms"] = round(
            timed_ms(lambda: AttentionMask(idx, config).block_mask()), 3
        )
        results["dense_mask_ms"] = round(timed_ms(lambda: AttentionMask(idx, config).dense()), 3)
    outputs = {}
    for name in ("flex", "dense"):
        outputs[name] = kernels[name]().detach().float()
    for name, fn in kernels.items():
        results[f"{name}_ms"] = round(timed_ms(with_grad(fn)), 3)
    results["max_out_diff"] = (outputs["flex"] - outputs["dense"]).abs().max().item()
    if backward:  # FlexAttention's backward, which training runs: torch has none on a CPU
        results["max_grad_rel_diff"] = max_grad_rel_diff(kernels["flex"], kernels["dense"], q)
    judge_flex_mask(results)
    return results


#: How far FlexAttention's output may be from the boolean-mask SDPA's (absolute, on outputs of
#: order 1): the bound flash is held to against the math kernel (the H200's 1.6e-2 there).
FLEX_OUT_LIMIT = 2e-2

#: How far FlexAttention's gradient may be from the boolean-mask SDPA's, relative to the largest
#: gradient (:func:`max_grad_rel_diff`). Both kernels take the same bf16 inputs and add in fp32
#: in their own order; their bf16 gradients then differ by a few roundings (2^-9 ~ 0.002 each)
#: of the largest one, and on a CPU the same kernel twice differs by 0. 2e-2 is ten roundings,
#: while a mask that lets one wrong key through (a missed window or document edge) moves the
#: gradient by its own size: without the window, 0.17 (fp32) and 0.38 (bf16) relative at the dry
#: run's shape (tests/test_gpu_check.py).
FLEX_GRAD_LIMIT = 2e-2


def judge_flex_mask(results: dict[str, Any]) -> None:
    """Fail ``flex_mask`` when FlexAttention's output or gradient is past its bound from the
    boolean-mask SDPA's (:data:`FLEX_OUT_LIMIT`, :data:`FLEX_GRAD_LIMIT`), or when a run with a
    backward recorded no gradient difference. ``results`` go with the failure."""
    _hold_to_bounds(
        results,
        "flex and the boolean-mask SDPA",
        "FlexAttention's",
        (FLEX_OUT_LIMIT, FLEX_GRAD_LIMIT),
        backward=bool(results.get("backward")),
    )


def max_grad_rel_diff(a: Callable[[], Any], b: Callable[[], Any], wrt: Any) -> float:
    """The largest difference between the gradients two attention kernels give ``wrt`` for one
    loss (the mean square of their output), over the largest of ``b``'s gradient: how
    differently training through each would step, in a unit that does not shrink with the
    shape (the loss is a mean: at 124M's shape each gradient is ~1e-7)."""
    import torch

    grads = [torch.autograd.grad(fn().float().square().mean(), wrt)[0] for fn in (a, b)]
    return relative_max_diff(*grads)


def relative_max_diff(got: Any, reference: Any) -> float:
    """The largest difference between two tensors over the largest of ``reference`` (in fp32):
    the gradient checks' unit, which does not shrink with the shape; inf when the reference
    is all zeros."""
    got, reference = got.float(), reference.float()
    scale = reference.abs().max().item()
    return (got - reference).abs().max().item() / scale if scale else math.inf


def check_bench_124m(work: Path, data_arg: str | None) -> dict[str, Any]:
    data = ensure_data(work, data_arg)
    mb = SCALE.bench_micro_batch
    sets = [
        f"--set={a}={b}" for a, b in zip(SCALE.model_args[::2], SCALE.model_args[1::2], strict=True)
    ]
    proc = run(
        nanolab_cmd(
            "bench", "--config", str(ROOT / "configs" / "gpt2-124m.yaml"),
            "--steps", str(SCALE.bench_steps), "--warmup", str(SCALE.bench_warmup),
            "--rounds", "1", "--json",
            "--no-count-syncs",  # a third compiled fit; syncs per step are counted on CPU in CI
            "--no-import-time",  # start-up is the fits' own figure here
            f"--set=--data.dataset_dir={data}", "--set=--data.source=null",
            f"--set=--data.micro_batch_size={mb}",
            f"--set=--run.global_batch_tokens={2 * mb * SCALE.block_size}",  # 2 micro-batches
            "--set=--run.eval_every_steps=100000", "--set=--downstream.suite=null", *sets,
            # no validation on either side (the last step's would compile an eval graph)
            "--set=--trainer.limit_val_batches=0",
            # no 1.4 GB save at the end on either side (async_checkpoint measures saves)
            "--set=--checkpoint.save_on_train_end=false",
            *SCALE.bench_args,
        )
    )  # fmt: skip
    if proc.returncode != 0:
        raise CheckFailed(f"nanolab bench failed: {last_line(proc.stderr)}")
    opening = re.search(r"^\{$", proc.stdout, re.M)  # stderr lines are merged in around it
    if opening is None:
        raise CheckFailed("nanolab bench printed no JSON")
    res, _ = json.JSONDecoder().raw_decode(proc.stdout[opening.start() :])
    gap = res.get("loss_gap") or {}
    mfu = res.get("mfu")
    metrics = {
        "micro_batch": mb,
        "nanolab_tokens_per_s": res["nanolab_tokens_per_s"]["median"],
        "plain_tokens_per_s": res["plain_tokens_per_s"]["median"],
        "ratio_nanolab_over_plain": res["ratio"]["median"],
        "mfu": NA_ON_CPU if mfu is None and SCALE is DRY else mfu,
        **peak_metrics(res.get("peak_mem_bytes"), res.get("predicted_peak_bytes")),
        "startup_s": res["nanolab_startup_s"]["median"],
        "loss_gap_max": gap.get("max"),
        "loss_gap_steps": gap.get("steps_compared", 0),
        "loss_gap_limit": loss_gap_limit(),
    }
    judge_bench(metrics)
    return metrics


#: How far nanolab's loss may be from the plain loop's at the same step in ``bench_124m``, by
#: device. Both sides build the same model from the same seed and read the same windows in the
#: same order, so they differ only by rounding. In fp32 (the CPU dry run) the two run the same
#: operations in the same order: their losses were equal to the bit (0.0), and 1e-4 leaves room
#: for a reduction summed in another order (fp32's 6e-8 relative, at a loss near 10, over a few
#: steps) while a wrong learning rate (x100 on one side: 0.059 after 3 steps) fails. On a GPU
#: in bf16 autocast (8 significant bits: 2^-9 ~ 0.002 relative), one rounding of a loss near
#: ln(50257) ~ 10.8 is ~0.02, and Inductor fuses each side's kernels its own way: the H200
#: measured 0.011 over 60 steps (docs/gpu-check.md); 0.05, the bound flex_fit's resume holds a
#: bf16 GPU run to as well, is about two such roundings and four times the measured gap.
LOSS_GAP_LIMIT = {"cpu": 1e-4, "cuda": 0.05}


def loss_gap_limit() -> float:
    """:data:`LOSS_GAP_LIMIT` for this run's device."""
    return LOSS_GAP_LIMIT[SCALE.device]


def judge_bench(metrics: dict[str, Any]) -> None:
    """Fail ``bench_124m`` when its two sides did not train the same thing (no step compared,
    or a loss gap past :func:`loss_gap_limit`), when a GPU gave no MFU (the device's peak rate
    unknown: its headline figure missing), or when its memory figures fail :func:`judge_peak`.
    ``metrics`` go with the failure."""
    gap, limit = metrics.get("loss_gap_max"), metrics["loss_gap_limit"]
    if not metrics.get("loss_gap_steps") or gap is None:
        raise CheckFailed(
            "no step's loss was compared: nanolab's and the plain loop's run logs share no step",
            metrics,
        )
    if not gap <= limit:
        raise CheckFailed(
            f"nanolab's loss differs from the plain loop's by {gap:.3g} at the same step "
            f"(limit {limit:g} on {SCALE.device}): the two sides did not train the same model",
            metrics,
        )
    if metrics.get("mfu") is None:
        raise CheckFailed(
            "no MFU: nanolab's run log carries mfu null (no peak FLOP/s known for this GPU and "
            "precision; its log's warning names them)",
            metrics,
        )
    judge_peak(metrics)


_MEMORY_ROW = re.compile(
    r"^(?P<config>\S+)\s+(?P<B>\d+)\s+(?P<what>\S.*?)\s+(?P<predicted>[\d,]+\.\d+)\s+"
    r"(?P<measured>[\d,]+\.\d+)\s+(?P<error>[+-]\d+\.\d+)%$"
)


def parse_memory_table(text: str) -> list[dict[str, Any]]:
    """The rows of ``benches/bench_memory.py``'s table (MiB and relative error)."""
    rows = []
    for line in text.splitlines():
        if m := _MEMORY_ROW.match(line.strip()):
            rows.append(
                {
                    "config": m["config"],
                    "micro_batch": int(m["B"]),
                    "quantity": m["what"],
                    "predicted_mib": float(m["predicted"].replace(",", "")),
                    "measured_mib": float(m["measured"].replace(",", "")),
                    "error": float(m["error"]) / 100,
                }
            )
    return rows


def parse_phase_peaks(text: str) -> dict[str, dict[str, float]]:
    """``bench_memory.py``'s "where the peak is" lines: config and micro-batch -> the peak of
    each phase of the step in MiB."""
    found: dict[str, dict[str, float]] = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("where the peak is"):
            continue
        for row in lines[i + 1 :]:
            m = re.match(r"^\s+(\S+)\s+B=(\d+)\s+(.*)$", row)
            if m is None:
                break
            pairs = re.findall(r"(\w+) ([\d,]+)", m.group(3))
            found[f"{m.group(1)} B{m.group(2)}"] = {k: float(v.replace(",", "")) for k, v in pairs}
    return found


def check_memory_eager(work: Path, data_arg: str | None) -> dict[str, Any]:
    """``bench_memory.py``'s device path on the 124M recipe and on 350M composed onto it (the
    size overlays hold only what changes): predicted vs measured rows, calibration and the
    peak of each phase of the step, each recipe's. The dry run takes the same path on the CPU
    with the recipes shrunk and fused AdamW (``--device-path-on-cpu``)."""
    base = str(ROOT / "configs" / "gpt2-124m.yaml")
    configs = [base, f"{base}+{ROOT / 'configs' / 'gpt2-350m.yaml'}"]
    device = ["--device-path-on-cpu"] if SCALE is DRY else []
    script = str(ROOT / "benches" / "bench_memory.py")
    proc = run([sys.executable, script, "--configs", *configs, *device])
    rows = parse_memory_table(proc.stdout)
    if not rows:
        raise CheckFailed(f"bench_memory.py printed no rows (exit {proc.returncode})")
    worst = max(abs(r["error"]) for r in rows)
    metrics = {"rows": rows, "worst_error": worst, "phases_mib": parse_phase_peaks(proc.stdout)}
    if proc.returncode != 0:
        raise CheckFailed(f"an error beyond bench_memory's target: worst {worst:+.1%}", metrics)
    if len(metrics["phases_mib"]) != len(configs):
        raise CheckFailed("bench_memory.py printed no phase peaks for a recipe", metrics)
    return metrics


def _fit_peak(work: Path, data: Path, config: str, name: str, *extra: str) -> dict[str, Any]:
    """Fit ``config`` for a few steps; its measured and predicted peak memory."""
    args = fit_args(config, data, work, name, SCALE.fit_steps)
    proc = run(nanolab_cmd(*args, *extra))
    if proc.returncode != 0:
        raise CheckFailed(f"nanolab fit failed: {last_line(proc.stderr)}")
    recs = records(work, name)
    start = next(r for r in recs if r["event"] == "start")
    return {
        "micro_batch": start["config"]["data"]["micro_batch_size"],
        **peak_metrics(peak_allocated(recs), predicted_peak(work, name)),
        "output": proc.stdout,
    }


def check_memory_compiled_350m(work: Path, data_arg: str | None) -> dict[str, Any]:
    data = ensure_data(work, data_arg)
    compile_flag = str(SCALE.compile).lower()
    got = _fit_peak(
        work, data, "gpt2-124m.yaml+gpt2-350m.yaml", "compiled350m", "--model.compile", compile_flag
    )
    got.pop("output")
    judge_peak(got)
    return got


def check_async_checkpoint(work: Path, data_arg: str | None) -> dict[str, Any]:
    data = ensure_data(work, data_arg)
    out: dict[str, Any] = {}
    steps = 3 * SCALE.checkpoint_every
    for mode in ("sync", "async"):
        name = f"ckpt_{mode}"
        args = fit_args("gpt2-124m.yaml", data, work, name, steps)
        proc = run(
            nanolab_cmd(
                *args, "--model.compile", "false",
                "--checkpoint.every_n_steps", str(SCALE.checkpoint_every),
                "--checkpoint.async_save", str(mode == "async").lower(),
            )
        )  # fmt: skip
        if proc.returncode != 0:
            raise CheckFailed(f"nanolab fit ({mode}) failed: {last_line(proc.stderr)}")
        recs = records(work, name)
        saves = [r for r in recs if r["event"] == "checkpoint"]
        if not saves:
            raise CheckFailed(f"{mode}: no checkpoint record in the run log")
        steps_s = step_seconds(recs)
        out[mode] = {
            "checkpoints": len(saves),
            "stall_s_median": statistics.median(r["seconds"] for r in saves),
            "write_s_median": statistics.median(r["write_seconds"] for r in saves),
            "checkpoint_gib": max(r.get("bytes") or 0 for r in saves) / GiB,
            "step_s_median": statistics.median(steps_s) if steps_s else None,
        }
    out["stall_saved_s"] = out["sync"]["stall_s_median"] - out["async"]["stall_s_median"]
    if SCALE is GPU and out["async"]["stall_s_median"] >= out["sync"]["stall_s_median"]:
        raise CheckFailed("async checkpoints stall the loop as long as sync ones", out)
    return out


#: fit's line for ``auto``: on a GPU the size and its planned peak of the device's memory; on a
#: CPU the data's size (``nanolab/run/compose.py``), which the dry run reads the same way.
_AUTO_LINE = re.compile(
    r"run\.micro_batch_size auto: (\d+)(?: \(predicted peak ([\d.]+) of ([\d.]+) GiB"
    r"|, data\.micro_batch_size \(no GPU memory to plan against\))"
)


def check_micro_batch_auto(work: Path, data_arg: str | None) -> dict[str, Any]:
    """``run.micro_batch_size: auto`` on 124M, eager: the picked size trains without running out
    of memory, and the estimator's peak allocated at that size is within
    :data:`PEAK_TOLERANCE` of the measured one. (The auto line's prediction adds the framework
    overhead and the fragmentation margin to that peak, which is how it fits the device; on a
    CPU auto keeps the data's value and says so: the dry run reads that line, and the figures
    a CPU has no source for read :data:`NA_ON_CPU`.)"""
    data = ensure_data(work, data_arg)
    got = _fit_peak(
        work, data, "gpt2-124m.yaml", "auto_mb",
        "--run.micro_batch_size", "auto", "--model.compile", "false",
    )  # fmt: skip
    m = _AUTO_LINE.search(got.pop("output"))
    metrics = {**got, "auto_line": m[0] if m else None}
    if m is None:
        raise CheckFailed("fit printed no 'run.micro_batch_size auto' line", metrics)
    if m[2] is not None:  # planned against the GPU's memory
        predicted_total, device = float(m[2]), float(m[3])
        measured = metrics["peak_measured_gib"]
        headroom = 1 - measured / device if isinstance(measured, float) else None
        metrics.update(predicted_total_gib=predicted_total, device_gib=device, headroom=headroom)
    elif SCALE is DRY:
        metrics.update(predicted_total_gib=NA_ON_CPU, device_gib=NA_ON_CPU, headroom=NA_ON_CPU)
    else:
        raise CheckFailed(f"fit planned no GPU memory: {m[0]}", metrics)
    judge_peak(metrics)
    return metrics


#: How far the branch's losses may be from the uninterrupted run's in ``flex_fit``: a CPU
#: resumes to the bit (0.0 in the dry run); a GPU's embedding and attention backward add in no
#: fixed order, so a loose bound that a resume losing its optimizer state or data order passes.
FLEX_RESUME_TOLERANCE = 0.05


def _fit_losses(work: Path, name: str) -> tuple[dict[int, float], dict[int, float]]:
    """A run's train and validation losses by step, from its run log."""
    recs = records(work, name)
    train = {r["step"]: r["loss"] for r in recs if r["event"] == "train"}
    val = {r["step"]: r["val_loss"] for r in recs if r["event"] == "val"}
    return train, val


def _all_finite(values: list[Any]) -> bool:
    """Every value a finite number (the run log writes a non-finite loss as null)."""
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def check_flex_fit(work: Path, data_arg: str | None) -> dict[str, Any]:
    """``attention: flex`` as a run trains it, which ``flex_mask`` (the kernel alone) does not:
    ``nanolab fit`` of the 124M recipe with ``document_mask`` and a window of half the
    context, the model compiled around the compiled FlexAttention and block mask, bf16 and
    gradient checkpointing, a validation at the last step; then a branch from the middle
    checkpoint to the same step. Figures: the losses, the branch's largest difference from
    them (:data:`FLEX_RESUME_TOLERANCE`), the steady step time and the peak allocated. A
    failure carries what was measured before it. The dry run takes it eager (no compile), where
    FlexAttention, having no backward on a CPU, runs in the validation only."""
    data = ensure_data(work, data_arg)
    steps = SCALE.fit_steps
    middle = steps // 2
    flex = (
        "--model.gpt.attention", "flex", "--model.gpt.document_mask", "true",
        "--model.gpt.attention_window", str(SCALE.block_size // 2),
        "--model.gpt.gradient_checkpointing", "true", "--model.compile", str(SCALE.compile).lower(),
        "--run.eval_every_steps", str(steps), "--trainer.limit_val_batches", "2",
        "--checkpoint.every_n_steps", str(middle), "--checkpoint.keep_last", "3",
    )  # fmt: skip
    metrics: dict[str, Any] = {"steps": steps, "resumed_at": middle}
    proc = run(nanolab_cmd(*fit_args("gpt2-124m.yaml", data, work, "flex", steps), *flex))
    if proc.returncode != 0:
        raise CheckFailed(f"nanolab fit failed: {last_line(proc.stderr)}", metrics)
    train, val = _fit_losses(work, "flex")
    recs = records(work, "flex")
    later_steps = step_seconds(recs)[1:]  # the first step compiles
    peak = peak_allocated(recs)
    metrics.update(
        first_loss=train.get(1), last_loss=train.get(steps), val_loss=val.get(steps),
        step_ms_median=statistics.median(later_steps) * 1000 if later_steps else None,
        peak_allocated_gib=NA_ON_CPU if SCALE is DRY and peak is None else gib(peak),
    )  # fmt: skip
    if sorted(train) != list(range(1, steps + 1)) or steps not in val:
        raise CheckFailed(
            f"the run log has train steps {sorted(train)}, val {sorted(val)}", metrics
        )
    if not _all_finite([*train.values(), *val.values()]):
        raise CheckFailed("a loss is not finite (null in the run log)", metrics)
    checkpoint = work / "runs" / "flex" / "checkpoints" / f"step-{middle:08d}.ckpt"
    branch = fit_args("gpt2-124m.yaml", data, work, "flex_branch", steps)
    proc = run(nanolab_cmd(*branch, *flex, "--run.resume", str(checkpoint)))
    if proc.returncode != 0:
        raise CheckFailed(f"the resumed nanolab fit failed: {last_line(proc.stderr)}", metrics)
    b_train, b_val = _fit_losses(work, "flex_branch")
    if sorted(b_train) != list(range(middle + 1, steps + 1)) or steps not in b_val:
        raise CheckFailed(
            f"the branch from step {middle} logged train steps {sorted(b_train)}, "
            f"val {sorted(b_val)}",
            metrics,
        )
    if not _all_finite([*b_train.values(), *b_val.values()]):
        raise CheckFailed("a loss of the branch is not finite (null in the run log)", metrics)
    pairs = [(b_train[s], train[s]) for s in b_train] + [(b_val[steps], val[steps])]
    diff = max(abs(a - b) for a, b in pairs)
    metrics["resume_loss_max_diff"] = diff
    if not diff <= FLEX_RESUME_TOLERANCE:
        raise CheckFailed(
            f"the branch from step {middle} differs from the uninterrupted run by {diff:.3g} "
            f"in loss (limit {FLEX_RESUME_TOLERANCE})",
            metrics,
        )
    return metrics


def as_queue_sets(fit_args: tuple[str, ...]) -> list[str]:
    """``fit`` overrides (``--model.gpt.n_layer 1``) as ``queue add`` takes them
    (``--set model.gpt.n_layer=1``)."""
    pairs = zip(fit_args[::2], fit_args[1::2], strict=True)
    return [x for key, value in pairs for x in ("--set", f"{key.removeprefix('--')}={value}")]


def check_pack(work: Path, data_arg: str | None) -> dict[str, Any]:
    """``gpu_pack.py``: the GPT-2 124M recipe's jobs back to back, then packed, on GPU 0; the
    dry run packs the same recipe on the CPU, shrunk as its fits are (``SCALE.model_args``)."""
    script = ROOT / "benches" / "gpu_pack.py"
    if not script.is_file():
        raise CheckSkipped("benches/gpu_pack.py is not in this tree")
    data = ensure_data(work, data_arg)
    pack_work = work / "pack"
    device = ["--device", "cpu"] if SCALE is DRY else []
    proc = run(
        [
            sys.executable, str(script), "--jobs", str(SCALE.pack_jobs),
            "--steps", str(SCALE.pack_steps), "--data", str(data), "--work", str(pack_work),
            "--config", str(ROOT / "configs" / "gpt2-124m.yaml"),
            "--block-size", str(SCALE.block_size), *device, *as_queue_sets(SCALE.model_args),
        ]
    )  # fmt: skip
    result = pack_work / "gpu_pack.json"
    if proc.returncode != 0 or not result.is_file():
        raise CheckFailed(f"gpu_pack.py failed (exit {proc.returncode}): {last_line(proc.stderr)}")
    return json.loads(result.read_text())


def check_vs_nanogpt(work: Path, data_arg: str | None) -> dict[str, Any]:
    """nanoGPT's own ``train.py`` (a checkout given by ``--nanogpt``, never shipped here) on the
    same device, token files and model as ``bench_124m``: GPT-2 124M with bias, vocabulary
    padded to 50304, bf16, compile, fused AdamW, clip 1.0, 2 x 16 x 1024 tokens per step. Its
    steady tokens/s, and nanolab's from ``bench_124m`` over it."""
    nanogpt = os.environ.get("GPU_CHECK_NANOGPT")
    if not nanogpt:
        raise CheckSkipped("no nanoGPT checkout given (--nanogpt PATH)")
    vs = _load_bench("vs_nanogpt")
    checkout = Path(nanogpt).resolve()
    try:
        vs.check_checkout(checkout)
    except vs.BenchError as err:
        raise CheckFailed(str(err)) from None
    data = ensure_data(work, data_arg)
    from nanolab.data.prepare import read_meta

    meta = read_meta(data) or {}
    if meta.get("dtype") != "uint16":
        raise CheckSkipped(f"nanoGPT reads uint16 token files; {data} holds {meta.get('dtype')}")
    scratch = work / "nanogpt"
    (scratch / "data" / "nanolab").mkdir(parents=True, exist_ok=True)
    for name in ("train.bin", "val.bin"):
        link = scratch / "data" / "nanolab" / name
        if not link.exists():
            link.symlink_to(data / name)
    if SCALE is DRY:  # the tiny model's vocabulary is the data's (on a GPU: GPT-2's 50304)
        import pickle

        vocab = {"vocab_size": int(meta["vocab_size"])}
        (scratch / "data" / "nanolab" / "meta.pkl").write_bytes(pickle.dumps(vocab))
    if not (scratch / "configurator.py").exists():
        (scratch / "configurator.py").symlink_to(checkout / "configurator.py")
    layers, heads, width = SCALE.nanogpt_model
    gpu = SCALE is GPU
    mb, steps = SCALE.bench_micro_batch, SCALE.bench_steps
    settings = {
        "device": SCALE.device, "compile": gpu, "dtype": "bfloat16" if gpu else "float32",
        "dataset": "nanolab", "out_dir": str(scratch / "out"), "wandb_log": False,
        "init_from": "scratch", "eval_interval": 100000, "eval_iters": 1, "log_interval": 1,
        "always_save_checkpoint": False, "max_iters": steps - 1,
        "gradient_accumulation_steps": 2, "batch_size": mb, "block_size": SCALE.block_size,
        "n_layer": layers, "n_head": heads, "n_embd": width, "dropout": 0.0, "bias": True,
        "learning_rate": 6e-4, "weight_decay": 0.1, "beta2": 0.95, "grad_clip": 1.0,
        "warmup_iters": 10, "lr_decay_iters": steps,
    }  # fmt: skip
    args = [f"--{k}={v!r}" if isinstance(v, str) else f"--{k}={v}" for k, v in settings.items()]
    proc = run([sys.executable, str(checkout / "train.py"), *args], cwd=scratch)
    if proc.returncode != 0:
        raise CheckFailed(f"nanoGPT's train.py failed: {last_line(proc.stdout)}")
    step_s, dirty, _ = vs.parse_nanogpt_log(proc.stdout, 100000)
    steady = vs.steady_step_s(step_s, dirty, SCALE.bench_warmup)
    tokens_per_step = 2 * mb * SCALE.block_size
    metrics: dict[str, Any] = {
        "nanogpt_step_ms": round(steady * 1000, 2),
        "nanogpt_tokens_per_s": round(tokens_per_step / steady, 1),
        "tokens_per_step": tokens_per_step,
    }
    ours = work / "bench_124m.result.json"
    if ours.is_file():
        bench = json.loads(ours.read_text()).get("metrics") or {}
        rate = bench.get("nanolab_tokens_per_s")
        if rate:
            metrics["nanolab_tokens_per_s"] = rate
            metrics["ratio_nanolab_over_nanogpt"] = round(rate / metrics["nanogpt_tokens_per_s"], 3)
    return metrics


def _load_bench(name: str) -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "benches" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


CHECK_FUNCTIONS: dict[str, Callable[[Path, str | None], dict[str, Any]]] = {
    "flash": check_flash,
    "flex_mask": check_flex_mask,
    "bench_124m": check_bench_124m,
    "memory_eager": check_memory_eager,
    "memory_compiled_350m": check_memory_compiled_350m,
    "async_checkpoint": check_async_checkpoint,
    "micro_batch_auto": check_micro_batch_auto,
    "flex_fit": check_flex_fit,
    "pack": check_pack,
    "vs_nanogpt": check_vs_nanogpt,
}


def run_check_in_child(
    name: str, work: Path, data: str | None, result_file: Path, dry_run: bool = False
) -> int:
    """The child side: run one check, write ``{status, metrics, note}`` to ``result_file``."""
    global SCALE
    SCALE = DRY if dry_run else GPU
    try:
        metrics = CHECK_FUNCTIONS[name](work, data)
        status, note = "ok", ""
    except CheckSkipped as err:
        status, note, metrics = "skipped", str(err), {}
    except CheckFailed as err:
        status, note = "fail", str(err.args[0])
        metrics = err.args[1] if len(err.args) > 1 else {}
    result_file.write_text(json.dumps({"status": status, "metrics": metrics, "note": note}))
    return 0


# -- the driver ----------------------------------------------------------------------------------


def select(only: str | None, skip: str | None) -> list[Check]:
    """The checks to run, in the fixed order; unknown names are a ValueError naming the valid."""
    names = [c.name for c in CHECKS]
    chosen = set(names)
    for label, value in (("--only", only), ("--skip", skip)):
        if not value:
            continue
        given = [n.strip() for n in value.split(",") if n.strip()]
        unknown = [n for n in given if n not in BY_NAME]
        if unknown:
            raise ValueError(
                f"{label}: unknown check {', '.join(unknown)}; one of {', '.join(names)}"
            )
        chosen = chosen & set(given) if label == "--only" else chosen - set(given)
    return [c for c in CHECKS if c.name in chosen]


def time_for(check: Check, remaining_s: float, scale: Scale = GPU) -> float:
    """Seconds this check may take: its cap at ``scale``, or what is left before the deadline."""
    return max(0.0, min(float(scale.cap_s(check)), remaining_s))


def run_check(
    check: Check, work: Path, data: str | None, logs: Path, limit_s: float, dry_run: bool = False
) -> Result:
    """Run one check in a child process group; kill the whole group when it passes its time.

    Every process of the run shares one Inductor cache in ``work`` (``bench_124m``'s two sides
    compile the same model: the second reads the first's kernels)."""
    log = logs / f"{check.name}.log"
    if limit_s < 5:
        return Result(check.name, "not_run", note="no time left before the deadline")
    result_file = work / f"{check.name}.result.json"
    result_file.unlink(missing_ok=True)
    cmd = [
        sys.executable, str(Path(__file__).resolve()), "--run-check", check.name,
        "--work", str(work), "--result-file", str(result_file),
    ] + (["--data", data] if data else []) + (["--dry-run"] if dry_run else [])  # fmt: skip
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor-cache"),
        **({"OMP_NUM_THREADS": "1"} if dry_run else {}),
    }
    from nanolab.processes import stop_signals_held

    start = time.perf_counter()
    proc: subprocess.Popen | None = None
    with open(log, "w") as out:
        try:
            # A stop that came while Popen forked and exec'd would leave it without the check's
            # pid, and the check (its own session) running on: held, it arrives as Stopped on
            # leaving, with the pid known. The check opens the mask it inherits (main).
            with stop_signals_held():
                proc = subprocess.Popen(
                    cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                    env=env,
                )  # fmt: skip
            proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            return Result(
                check.name, "timeout", time.perf_counter() - start,
                note=f"stopped after {limit_s:.0f} s", log=str(log),
            )  # fmt: skip
        except Stopped as stop:  # the check and whatever it started (a fit, a prepare) end too
            if proc is not None:  # None: the stop came before Popen, which started nothing
                kill_group(proc)
            stop.result = Result(
                check.name, "stopped", time.perf_counter() - start,
                note=f"stopped by {stop.name} after {time.perf_counter() - start:.0f} s",
                log=str(log),
            )  # fmt: skip
            raise
    seconds = time.perf_counter() - start
    if not result_file.is_file():
        return Result(
            check.name, "fail", seconds,
            note=f"crashed (exit {proc.returncode}): {last_line(log.read_text(errors='replace'))}",
            log=str(log),
        )  # fmt: skip
    got = json.loads(result_file.read_text())
    return Result(check.name, got["status"], seconds, got["metrics"], got["note"], str(log))


def kill_group(proc: subprocess.Popen) -> None:
    """Kill a check's process group (it leads its own session: the check, the fits and
    prepares it started) and every group its processes started elsewhere, then reap the check.

    ``pack``'s queue runner starts each job in a session of its own: killing the check's group
    alone killed the runner and left its jobs on the GPU (a parent-death SIGTERM asks each to
    checkpoint first; a job stuck in start-up or in a kernel held the GPU on, into the next
    check). So the groups are stopped first, the check's and then each one a stopped process's
    descendant leads, until no new one turns up (a stopped process starts nothing, and its
    children stay its until it dies), and only then killed."""
    from nanolab.processes import pid_alive

    groups: set[int] = set()
    new, members = {proc.pid}, set()
    while new:
        for group in new:
            with contextlib.suppress(ProcessLookupError):  # it had exited already
                os.killpg(group, signal.SIGSTOP)
        groups |= new
        members.update(descendants(proc.pid))
        new = {_group_of(pid) for pid in members} - groups - {None, os.getpgrp()}
    for group in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
    proc.wait()
    # The others are not this process's to reap: gone is when they have exited (a GPU's
    # memory is given back on the way), which a killed process takes a moment to do.
    give_up = time.monotonic() + KILL_WAIT_S
    while any(map(pid_alive, members)) and time.monotonic() < give_up:
        time.sleep(0.02)


#: The most :func:`kill_group` waits for the processes it killed to have exited.
KILL_WAIT_S = 10.0


def descendants(pid: int) -> list[int]:
    """The processes descended from ``pid`` (its children, theirs, ...), from Linux's ``/proc``;
    none where there is no ``/proc`` to read (the check's own group is still killed)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # after the command name, which may hold spaces and ")": state, then the parent
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # it exited meanwhile
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        found.append(child := todo.pop())
        todo += children.get(child, [])
    return found


def _group_of(pid: int) -> int | None:
    """The process group ``pid`` is in; None once it has exited."""
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def machine() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "host": platform.node(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name, gpu_count=torch.cuda.device_count(), gpu_gib=props.total_memory / GiB
        )
    proc = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    info["nanolab_commit"] = proc.stdout.strip() or None
    return info


def summary(meta: dict[str, Any], results: list[Result], started: float) -> dict[str, Any]:
    counts = {s: sum(r.status == s for r in results) for s in STATUSES}
    return {
        **meta,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "total_s": round(time.time() - started, 1),
        "status": "ok" if counts["fail"] + counts["timeout"] + counts["stopped"] == 0 else "fail",
        "counts": counts,
        "checks": [asdict(r) for r in results],
    }


def _headline(name: str, m: dict[str, Any]) -> str:
    """The few numbers of a check that fit in a table cell ("-" for one it did not measure;
    nothing for a check that measured nothing, such as one stopped at its cap)."""
    if not m:
        return ""

    def f(key: str, fmt: str, d: dict[str, Any] = m) -> str:
        value = d.get(key)
        if isinstance(value, str):  # NA_ON_CPU
            return value
        return "-" if value is None else format(value, fmt)

    if name == "flash":
        parts = [
            f"{f('fwd_bwd_ms', '.2f')} ms fwd+bwd",
            f"max diff {f('max_out_diff', '.1e')}, gradient {f('max_grad_rel_diff', '.1e')}"
            " relative",
        ]
    elif name == "flex_mask":
        parts = [
            f"per layer: flex {f('flex_ms', '.2f')} ms, boolean mask {f('dense_ms', '.2f')} ms,"
            f" causal flash {f('causal_flash_ms', '.2f')} ms",
            f"per batch: block mask {f('block_mask_ms', '.2f')} ms, boolean"
            f" {f('dense_mask_ms', '.2f')} ms",
            f"max diff {f('max_out_diff', '.1e')}, gradient {f('max_grad_rel_diff', '.1e')}"
            " relative",
        ]
    elif name == "bench_124m":
        parts = [
            f"{f('nanolab_tokens_per_s', ',.0f')} tok/s (plain {f('plain_tokens_per_s', ',.0f')})",
            f"ratio {f('ratio_nanolab_over_plain', '.3f')}",
            f"MFU {f('mfu', '.3f')}",
            f"loss gap {f('loss_gap_max', '.1e')} (limit {f('loss_gap_limit', 'g')})",
            f"peak {f('peak_measured_gib', '.2f')} vs {f('peak_predicted_gib', '.2f')} GiB",
        ]
    elif name == "memory_eager":
        parts = [f"{len(m.get('rows', []))} rows, worst error {f('worst_error', '.1%')}"]
    elif name == "vs_nanogpt":
        parts = [
            f"nanoGPT {f('nanogpt_tokens_per_s', ',.0f')} tok/s ({f('nanogpt_step_ms', '.1f')} ms/step)",
            f"nanolab / nanoGPT {f('ratio_nanolab_over_nanogpt', '.3f')}",
        ]
    elif name == "pack" and "results" in m:
        rates = {r["mode"]: r.get("tokens_per_s_wall") for r in m["results"]}
        parts = [f"{mode} {rate or 0:,.0f} tok/s" for mode, rate in rates.items()]
    elif name in ("memory_compiled_350m", "micro_batch_auto"):
        parts = [
            f"micro-batch {m.get('micro_batch')}",
            f"peak {f('peak_measured_gib', '.2f')} GiB (predicted {f('peak_predicted_gib', '.2f')})",
        ]
    elif name == "flex_fit":
        parts = [
            f"loss {f('first_loss', '.3f')} -> {f('last_loss', '.3f')}, val {f('val_loss', '.3f')}",
            f"resumed at {m.get('resumed_at')}: loss diff {f('resume_loss_max_diff', '.1e')}",
            f"{f('step_ms_median', '.1f')} ms/step, peak {f('peak_allocated_gib', '.2f')} GiB",
        ]
    elif name == "async_checkpoint" and "sync" in m and "async" in m:
        parts = [
            f"stall sync {f('stall_s_median', '.2f', m['sync'])} s",
            f"async {f('stall_s_median', '.2f', m['async'])} s",
        ]
    else:
        parts = [f"{len(m)} values"] if m else []
    return ", ".join(p for p in parts if p)


def format_table(res: dict[str, Any]) -> str:
    gpu = "CPU dry run" if res.get("dry_run") else (res.get("gpu") or "no GPU")
    lines = [
        f"nanolab GPU check: {gpu}, torch {res.get('torch')}, nanolab {res.get('nanolab_commit')}, "
        f"{res.get('date')}, {res.get('total_s')} s, status {res['status']}",
        "",
        "| check | status | seconds | result |",
        "|---|---|---|---|",
    ]
    if res.get("note"):
        lines.insert(1, f"note: {res['note']}")
    for c in res.get("checks", []):
        cell = _headline(c["name"], c.get("metrics") or {})
        if c.get("note"):
            cell = f"{cell}; {c['note']}" if cell else c["note"]
        lines.append(f"| {c['name']} | {c['status']} | {c['seconds']:.0f} | {cell} |")
    return "\n".join(lines)


def write_summary(out: Path, res: dict[str, Any]) -> None:
    """Atomic writes: a reader (or a kill mid-write) never sees half a summary."""
    for name, text in (
        ("gpu_check.json", json.dumps(res, indent=2) + "\n"),
        ("gpu_check.md", format_table(res) + "\n"),
    ):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)


def gpu_visible() -> tuple[bool, str]:
    import torch

    if torch.cuda.is_available():
        return True, ""
    build = (
        f"CUDA {torch.version.cuda}"
        if torch.version.cuda
        else (f"ROCm {torch.version.hip}" if torch.version.hip else "CPU only")
    )
    return False, f"torch {torch.__version__} ({build}) sees no GPU"


def _one_line_error(message: str) -> None:
    print(f"gpu_check: error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="benches/gpu_check.sh", description="nanolab's GPU checks, one summary."
    )
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "runs" / "gpu_check"),
                   help="summary and logs (default: $OUT, else runs/gpu_check)")  # fmt: skip
    p.add_argument(
        "--work", help="scratch folder for data, runs, checkpoints (default: a temp dir)"
    )
    p.add_argument("--keep", action="store_true", help="keep --work afterwards")
    p.add_argument(
        "--data", help="a prepared GPT-2-vocabulary dataset (default: made from bundled text)"
    )
    p.add_argument(
        "--nanogpt",
        help="a nanoGPT checkout (never shipped here): adds its train.py side by side on the "
        "same device, data and 124M config (the vs_nanogpt check)",
    )
    p.add_argument("--only", help="comma-separated checks to run (see --list)")
    p.add_argument("--skip", help="comma-separated checks to leave out")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds for all checks; later ones get what is left (default 690, "
                   "3 times that with --dry-run)")  # fmt: skip
    p.add_argument(
        "--list", action="store_true", help="print the checks and their caps, run nothing"
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="every check's code path on this CPU at tiny sizes (no GPU needed; figures "
        "mean nothing); what CI runs so a GPU session does not run code for the first time",
    )
    p.add_argument("--run-check", choices=sorted(CHECK_FUNCTIONS), help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    p.error = _one_line_error  # type: ignore[method-assign]
    args = p.parse_args(argv)
    # The checks run their commands from the project's root: a folder given relative to where
    # this was started is made absolute here, or a check read (and wrote) another folder.
    for name in ("out", "work", "data", "result_file"):
        if getattr(args, name):
            setattr(args, name, os.path.abspath(getattr(args, name)))
    if args.nanogpt:  # the children read it (the vs_nanogpt check)
        os.environ["GPU_CHECK_NANOGPT"] = str(Path(args.nanogpt).resolve())

    if args.run_check:  # child process of run_check()
        # Started with SIGINT and SIGTERM held (run_check's Popen): open them again, or the
        # fits and prepares it starts would run deaf to a stop sent to them alone.
        if hasattr(signal, "pthread_sigmask"):
            from nanolab.processes import STOP_SIGNALS

            signal.pthread_sigmask(signal.SIG_UNBLOCK, set(STOP_SIGNALS))
        return run_check_in_child(
            args.run_check, Path(args.work), args.data, Path(args.result_file), args.dry_run
        )
    try:
        checks = select(args.only, args.skip)
    except ValueError as err:
        p.error(str(err))
    scale = DRY if args.dry_run else GPU
    if args.deadline is None:
        args.deadline = 690.0 * scale.cap_scale
    if args.deadline <= 0:
        p.error("--deadline must be > 0 seconds")
    if args.list:
        for c in checks:
            print(f"{c.name:<22} {scale.cap_s(c):>4} s  {c.what}")
        total = sum(scale.cap_s(c) for c in checks)
        print(f"{'total cap':<22} {total:>4} s  (--deadline {args.deadline:.0f} s)")
        return 0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    ok, why = (True, "") if args.dry_run else gpu_visible()
    if not ok:
        write_summary(out, {**summary(machine(), [], started), "status": "no_gpu", "note": why})
        print(
            f"gpu_check: error: no CUDA/ROCm GPU visible ({why}); run it on a GPU machine",
            file=sys.stderr,
        )
        return 2
    meta = {**machine(), "dry_run": args.dry_run}
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    results: list[Result] = []
    stopped: Stopped | None = None
    stop_on_signals()
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="nanolab-gpu-check-"))
    try:
        work.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + args.deadline
        for check in checks:
            limit = time_for(check, deadline - time.monotonic(), scale)
            print(
                f"[{time.strftime('%H:%M:%S')}] {check.name} (up to {limit:.0f} s) ...", flush=True
            )
            results.append(run_check(check, work, args.data, logs, limit, args.dry_run))
            write_summary(out, summary(meta, results, started))
    except Stopped as stop:
        stopped = stop
        results += [stop.result] if stop.result else []
        done = {r.name for r in results}
        why = f"the run was stopped by {stop.name}"
        results += [Result(c.name, "not_run", note=why) for c in checks if c.name not in done]
    finally:
        if not args.keep and not args.work:
            shutil.rmtree(work, ignore_errors=True)
    res = summary(meta, results, started)
    if stopped is not None:
        res["note"] = f"stopped by {stopped.name}; what finished before it is below"
    write_summary(out, res)
    print(format_table(res))
    print(f"\nsummary: {out / 'gpu_check.json'}, {out / 'gpu_check.md'}; logs: {logs}")
    if stopped is not None:
        print(f"gpu_check: error: stopped by {stopped.name}", file=sys.stderr)
        return 128 + stopped.signum
    return 0 if res["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
