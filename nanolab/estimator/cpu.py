"""The CPU as an estimator device: this machine's memory and its measured matmul rates.

``nanolab estimate --device cpu`` describes a CPU run on this machine: CPU kernels (dropout
masks in the input dtype, SDPA's math fallback with dropout, torch AdamW's per-tensor loop), the
training process's own memory and the C heap's slack on top of the allocator's peak
(:data:`nanolab.estimator.memory.CPU_FRAGMENTATION`), against the RAM available now, the figure
fit checks before it builds the model. The time estimate uses the fp32 (and bf16) matmul rates
measured here (the fastest of many short matmuls within 0.2 s), at the efficiency the queue
assumes for CPU jobs; imports torch.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from typing import Any

from nanolab.estimator.gpus import GPU

#: Share of the measured 512 x 512 fp32 matmul rate a small GPT's training step reaches on CPU
#: (``flops_per_token`` x tokens/s over that rate): the time estimate of ``nanolab estimate
#: --device cpu``, of queued CPU jobs and of the start banner. Measured 2026-12-01 on a 2-core
#: x86-64 VM: the quickstart model 0.67 with 1 thread and 0.57 with 2 (2m19s of steps where 0.35
#: had predicted 3m48s), 6 layers x 384 wide 0.83 with 1 thread. The lower end, so estimates err
#: long; a finished queue run of the same config replaces it with its measured time per step.
CPU_EFFICIENCY = 0.55

#: The host's fixed work per training step, whatever the model's FLOPs: the floor of a step's
#: time (:func:`host_floor_seconds`), which the FLOPs model alone misses for small models (a
#: 2-layer, 32-wide model's 3,000 CPU steps were estimated at 3 s and took 99 s of steps).
#: Per optimizer step: the training loop, the optimizer's per-tensor update, clipping and the
#: step callbacks; per micro-batch: forward, loss and backward dispatch, plus per layer their
#: ~100 small ops. On a CPU the tiny kernels run on the host too; on a GPU the host does the
#: same dispatch (and the kernel launches) while the device runs the queued step, so the floor
#: is the step's time only where it exceeds the FLOPs time (not measured on a GPU here: it is
#: the same Python and dispatcher path, ~1-4 ms a step for nanoGPT-class models). Measured
#: 2026-12-06 on a 2-core x86-64 VM, torch 2.13.0+cpu, 1 thread, 128-token micro-batches:
#: process CPU time of 450-step fits minus 50-step ones of the same config (the VM was loaded
#: ~4x, so CPU time, not wall time), per step: 1 layer 4.2 ms, 2 layers 7.1 ms, 6 layers 14.0
#: ms, 2 layers x 4 micro-batches 17.8 ms (3.6 ms per extra micro-batch); scaled by the quiet
#: machine's 2.5 ms for the 1-layer step (docs/overhead.md: plain loop 1.52 ms + nanolab and
#: Lightning 0.97 ms), that is ~1.2 ms per layer and micro-batch including its FLOPs. The
#: constants are the lower end, so the figure stays a floor.
HOST_STEP_S = 1.0e-3
HOST_MICRO_BATCH_S = 0.5e-3
HOST_LAYER_S = 0.5e-3


def host_floor_seconds(n_layer: int, accumulate: int) -> float:
    """Seconds of fixed host work in one optimizer step of ``accumulate`` micro-batches of an
    ``n_layer`` model (:data:`HOST_STEP_S`, :data:`HOST_MICRO_BATCH_S`, :data:`HOST_LAYER_S`)."""
    per_micro = HOST_MICRO_BATCH_S + HOST_LAYER_S * max(1, n_layer)
    return HOST_STEP_S + max(1, accumulate) * per_micro


def sixteen_bit_mfu(device: GPU, dtype: str) -> tuple[float, str]:
    """(MFU against the ``dtype`` peak, why) that times a 16-bit run on a CPU at
    :data:`CPU_EFFICIENCY` of the fp32 rate.

    A 512 x 512 bf16 matmul on a CPU with AMX reads 3x the fp32 rate, but a training step under
    bf16 autocast gets nowhere near it: the casts, the fp32 ops around the matmuls and the small
    matmuls of a small model dominate. Measured 2026-12-05 on a 2-core Xeon with AMX (1 thread,
    fastest steps, fp32 = 1): the quickstart model 0.81-0.87 under bf16-mixed and 0.71-0.93 as
    bf16-true; a 6-layer, 384-wide model 2.3 and 2.4. Timing at the fp32 rate is close for small
    models and errs long for larger ones; a finished queue run replaces it with its measured
    time."""
    peak, fp32 = device.peak(dtype), device.peak("fp32")
    if not peak or not fp32 or dtype == "fp32":
        return device.default_mfu, device.mfu_source
    return device.default_mfu * min(1.0, fp32 / peak), (
        f"{device.default_mfu:.0%} of the fp32 rate (CPU_EFFICIENCY): 16-bit training on a CPU "
        "is timed at the fp32 rate, its matmul peak is rarely reached there; a finished queue "
        "run of the config on this machine replaces it"
    )


def physical_memory() -> int:
    """Bytes of RAM (``os.sysconf``); 0 where the platform does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def usable_memory() -> tuple[int, str]:
    """(bytes a new run can have, where the figure comes from): the RAM available now (free
    RAM capped by the cgroup and address-space limits, what fit's check before the model reads),
    else the physical RAM."""
    from nanolab.processes import host_memory_available

    available = host_memory_available()
    if available:
        return available, "RAM available now (MemAvailable, cgroup and address-space limits)"
    return physical_memory(), "physical RAM (os.sysconf)"


#: Single matmuls timed per probe, at most (the fastest one counts), and the pause between two.
PROBE_REPEATS = 40
PROBE_PAUSE_S = 0.002


def matmul_tflops(
    dtype_name: str = "float32", seconds: float = 0.2, n: int = 512, threads: int | None = None
) -> float:
    """Dense matmul TFLOP/s of this machine in ``dtype_name``, with ``threads`` threads (default:
    the current count; the queue passes the count its jobs will use).

    The fastest of up to :data:`PROBE_REPEATS` single matmuls timed one by one within
    ``seconds``, with a short pause between them. Another process on the machine only ever makes
    a matmul slower (with several threads, one descheduled thread stalls the whole product), and
    one 512 x 512 product takes a few milliseconds, so among many short repeats spread over the
    window some run with the cores free: their rate is what training gets once it has the cores.
    Windows of several products (the earlier probe) caught load in every window and swung from
    17 to 40 GFLOP/s between calls on a shared 2-core machine.
    """
    import torch

    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        dtype = getattr(torch, dtype_name)
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b  # warm-up: the thread pool starts here
        best = math.inf
        deadline = time.perf_counter() + seconds
        for _ in range(PROBE_REPEATS):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
            if start > deadline:
                break
            time.sleep(PROBE_PAUSE_S)  # let a busy neighbour's time slice pass
        return 2 * n**3 / best / 1e12
    finally:
        torch.set_num_threads(previous)


def cpu_device(threads: int | None = None, bf16: bool = True) -> GPU:
    """This machine as an estimator device, with ``threads`` torch threads (default: the count
    a run started here uses). Measured once per process and thread count; at the default count
    the rate is the best any probe here saw within a day (:func:`_remember`), so ``estimate
    --device cpu``, the start banner and ``queue add`` divide by the same rate, and a probe
    taken while a neighbour held the cores does not make one call's estimate 10x another's. ``bf16=False``
    leaves out the bf16 probe (0.2 s more at every fit launch) for a run that has no use for it."""
    import torch

    default = torch.get_num_threads()
    threads = threads or default
    fp32 = _rate("float32", threads)
    bf16_rate = _rate("bfloat16", threads) if bf16 else None
    if threads == default:  # the best any probe here saw today: load only lowers a probe
        fp32, best_bf16 = _remember(threads, fp32, bf16_rate)
        bf16_rate = best_bf16 if bf16 else None
    return _device(threads, fp32, bf16_rate)


def _device(threads: int, fp32: float, bf16: float | None) -> GPU:
    memory, memory_source = usable_memory()
    return GPU(
        name="cpu",
        label=f"CPU (this machine, {threads} thread{'s' if threads > 1 else ''})",
        memory_bytes=memory,
        vendor="cpu",
        usd_per_hour=0.0,
        tflops={"fp32": fp32, "tf32": None, "bf16": bf16, "fp16": None, "fp8": None},
        family="cpu",
        memory_reported=True,
        memory_source=memory_source,
        tflops_source="measured here: the fastest of up to 40 single 512 x 512 matmuls in 0.2 s "
        "per dtype",
        price_source="no price for a CPU; pass --usd-per-gpu-hour",
        default_mfu=CPU_EFFICIENCY,
        mfu_source="nanolab's CPU assumption (CPU_EFFICIENCY): a rough share of the measured "
        "matmul rate; a finished queue run of the config on this machine replaces it",
    )


@functools.cache
def _rate(dtype_name: str, threads: int) -> float:
    """One probe per dtype and thread count per process (at the default thread count the
    estimates divide by the best rate remembered today, :func:`_remember`)."""
    return matmul_tflops(dtype_name, threads=threads)


#: How long a probe's rates stand in for a new probe (:func:`remembered_cpu_device`).
REMEMBERED_RATES_S = 24 * 3600.0


def remembered_cpu_device(bf16: bool = True) -> GPU:
    """:func:`cpu_device` with the default thread count, from the rates probes measured on
    this machine (same CPU, core count and affinity, thread settings and torch) within
    :data:`REMEMBERED_RATES_S`, without importing torch (~2 s); else probed, and remembered
    beside the estimator's cache (``NANOLAB_ESTIMATOR_CACHE=0``: always probed).

    ``queue add`` asks here: its duration estimates then cost no torch import. A busy
    neighbour only ever slows a probe (on a shared 2-core machine at load 3-4 the fastest of the
    short matmuls read 14 GFLOP/s where an idle one reads 170-200), so what is remembered is
    the best rate any probe saw: every probe of a process that has torch loaded anyway (a
    ``fit``'s start banner, ``estimate --device cpu``) raises it (:func:`_remember`)."""
    import json

    path = _rates_path()
    if path is None:
        return cpu_device(bf16=bf16)
    try:
        stored = json.loads(path.read_text())
        now = time.time()
        age = now - float(stored["time"])
        if stored["machine"] == _machine() and 0 <= age < REMEMBERED_RATES_S:
            fp32, bf16_rate = float(stored["fp32"]), stored["bf16"]
            bf16_age = now - float(stored.get("bf16_time", stored["time"]))
            if not 0 <= bf16_age < REMEMBERED_RATES_S:
                bf16_rate = None  # a day old: probed again if wanted
            if fp32 > 0 and (not bf16 or bf16_rate):
                return _device(int(stored["threads"]), fp32, float(bf16_rate) if bf16 else None)
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none, unreadable, another machine's or too old: probe
    return cpu_device(bf16=bf16)  # remembers what it measured


def this_cpu(bf16: bool = True) -> GPU:
    """This machine as ``nanolab estimate``'s device: probed (:func:`cpu_device`) where torch is
    loaded already (a fit's start banner: the probe then also raises the remembered rates),
    else from the rates remembered today (:func:`remembered_cpu_device`), so a CPU estimate
    imports torch (seconds) only when no probe of this machine is remembered."""
    import sys

    return cpu_device(bf16=bf16) if "torch" in sys.modules else remembered_cpu_device(bf16=bf16)


def _rates_path():  # -> Path | None
    import hashlib
    import json

    from nanolab.estimator.facts_cache import cache_dir

    folder = cache_dir()
    if folder is None:
        return None
    name = hashlib.sha256(json.dumps(_machine()).encode()).hexdigest()[:16]
    return folder / f"cpu-rates-{name}.json"


def _remember(threads: int, fp32: float, bf16: float | None) -> tuple[float, float | None]:
    """Keep the best rates any probe at the default thread count saw within a day of it (load
    only ever lowers a probe's rate), with the time of that probe: a best rate expires a day
    after it was measured, so a machine that became slower (a smaller CPU quota) is believed
    by the next day. A probe with no bf16 rate keeps the remembered one. Returns the best
    rates, this probe's where nothing is remembered."""
    import json

    from nanolab.estimator.facts_cache import write_json

    path = _rates_path()
    if path is None:
        return fp32, bf16
    machine = _machine()
    now = time.time()
    fp32_at = bf16_at = now

    def best(new: float | None, old: Any, old_at: float) -> tuple[float | None, float]:
        """The remembered rate with its probe's time while it is fresh and not beaten."""
        old = float(old or 0.0)
        if old and 0 <= now - old_at < REMEMBERED_RATES_S and old >= (new or 0.0):
            return old, old_at
        return new, now

    try:
        stored = json.loads(path.read_text())
        if stored["machine"] == machine and int(stored["threads"]) == threads:
            at = float(stored["time"])
            fp32, fp32_at = best(fp32, stored["fp32"], at)  # type: ignore[assignment]
            bf16, bf16_at = best(bf16, stored.get("bf16"), float(stored.get("bf16_time", at)))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    with contextlib.suppress(OSError):
        write_json(path, {"machine": machine, "time": fp32_at, "threads": threads,
                          "fp32": fp32, "bf16": bf16, "bf16_time": bf16_at})  # fmt: skip
    return fp32, bf16


def _machine() -> list:
    """What the rates and the default thread count depend on, read without importing torch."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")  # fmt: skip
    except OSError:
        pass
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "none"
    threads = [os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")]
    return [platform.node(), platform.machine(), model, os.cpu_count(), affinity, threads,
            torch_version]  # fmt: skip
