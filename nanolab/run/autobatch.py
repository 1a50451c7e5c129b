"""Before a GPU run starts: choose the micro-batch from the estimator, or warn that it will not fit.

No trial-and-error OOM runs: ``run.micro_batch_size: auto`` asks the memory estimator for the
largest micro-batch predicted to fit on the smallest GPU the run uses (``trainer.devices``) that
also divides the per-device share of ``run.global_batch_tokens`` (so accumulation stays exact).
Any run on a GPU gets one warning line at start when the estimate exceeds that GPU's memory,
naming the switches that would fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nanolab.errors import NanolabError
from nanolab.processes import host_memory_available, resident_bytes
from nanolab.run.trainer_errors import gpus_used


class AutoBatchError(NanolabError):
    """No micro-batch fits; the message says which switches would help."""


@dataclass
class MemoryPlan:
    micro_batch_size: int
    predicted_bytes: int
    device_bytes: int
    warning: str | None


def gpu_memories(devices: Any = "auto", cuda: Any = None) -> list[int]:
    """Total memory of each GPU (CUDA or ROCm) the run puts itself on; empty on a CPU.

    ``devices`` is ``trainer.devices``: every GPU it names (:func:`gpus_used`) gets the same
    micro-batch, so the plan must fit the smallest of them, not
    whichever GPU is current (GPU 0 before the Trainer starts: an 80 GiB GPU 0 would plan
    ``devices: [1]`` onto a 12 GiB GPU 1 at a micro-batch six times too large). A value the
    Trainer refuses itself (a GPU this host lacks) is planned on every GPU here: its own error,
    once it is built, names the value. ``cuda``: the ``torch.cuda`` to ask (a test's stand-in)."""
    cuda = torch.cuda if cuda is None else cuda
    if not cuda.is_available():
        return []
    used = gpus_used(devices, cuda) or range(cuda.device_count())
    return [int(cuda.get_device_properties(i).total_memory) for i in used]


def device_memory_words(device_memory: int, gpus_differ: bool = False) -> str:
    """The memory a plan was made against, in words: "this device's 12.0 GiB", or, where the
    run's GPUs differ (``gpus_differ``), the smallest of them, which the plan must fit."""
    gib = f"{device_memory / 2**30:.1f} GiB"
    return f"the smallest of the run's GPUs ({gib})" if gpus_differ else f"this device's {gib}"


def device_backend() -> str:
    """The memory rules' backend for this process's GPU: ``rocm`` under a ROCm build of torch
    (its context and communication buffers are larger), else ``cuda``."""
    return "rocm" if getattr(torch.version, "hip", None) else "cuda"


def plan_memory(
    config: dict[str, Any],
    device_memory: int,
    auto: bool,
    devices_per_node: int,
    backend: str | None = None,
    gpus_differ: bool = False,
) -> MemoryPlan:
    """Pick (``auto``) or check the micro-batch of ``config`` against ``device_memory`` bytes.

    ``config`` is the merged ``nanolab fit`` config as a plain dict (``vocab_size`` resolved);
    ``backend`` is this machine's (:func:`device_backend` unless given), so ``fit`` holds the
    run to the rules ``nanolab estimate --gpu`` shows for the same GPU. ``gpus_differ``: the
    run's GPUs differ in memory and ``device_memory`` is the smallest's (the warning says so).
    """
    from nanolab.estimator import estimate_from_config, largest_fitting_micro_batch
    from nanolab.training.resolve import sections

    rules: dict[str, Any] = {"devices": devices_per_node, "backend": backend or device_backend()}
    micro = int(sections(config)[3]["micro_batch_size"])
    if auto:
        micro = largest_fitting_micro_batch(config, device_memory=device_memory, **rules)
        if micro == 0:
            est = estimate_from_config(
                config, device_memory=device_memory, micro_batch_size=1, **rules
            )
            raise AutoBatchError(
                "run.micro_batch_size auto: not even one sequence fits in "
                f"{device_memory / 2**30:.1f} GiB (predicted {est.memory.total / 2**30:.1f} GiB); "
                f"try: {_switches(est) or 'a smaller model or block_size'}"
            )
    est = estimate_from_config(config, device_memory=device_memory, micro_batch_size=micro, **rules)
    warning = None
    if not est.fits:
        warning = (
            f"memory estimate {est.memory.total / 2**30:.1f} GiB exceeds "
            f"{device_memory_words(device_memory, gpus_differ)} at micro_batch_size {micro}; "
            "expect an OOM. "
            f"Largest that fits: {est.largest_micro_batch}; or try: {_switches(est) or '-'} "
            "(nanolab estimate shows the breakdown)"
        )
    return MemoryPlan(micro, int(est.memory.total), device_memory, warning)


class HostMemoryError(NanolabError):
    """A CPU run whose model cannot fit in this machine's memory (refused before allocating)."""


def check_fits_on_host(config: dict[str, Any], processes: int = 1) -> None:
    """Refuse, before anything is allocated, a CPU run the estimator says cannot fit in RAM.

    ``config`` is the merged ``nanolab fit`` config as plain data (``vocab_size`` resolved);
    ``processes`` training processes share this machine's memory. The need is the total of
    ``nanolab estimate --device cpu`` (the process itself and the C heap's slack included), held
    against the RAM available plus what this process already holds, so both commands give one
    answer. A config the estimator cannot describe is let through (the run then finds out for
    itself).
    """
    available = host_memory_available()
    if available is None:
        return
    floor = _min_bytes(config) * max(1, processes)
    if floor > available:  # refused by arithmetic: the estimator would build the model first
        raise _too_big(floor, available, processes, "at least ")
    try:
        from nanolab.estimator.estimate import setup_for
        from nanolab.estimator.memory import CPU_FRAGMENTATION, estimate_memory

        trainer = dict(config.get("trainer") or {})
        trainer["precision"] = trainer.get("precision") or "32-true"  # Lightning's default
        # The memory model only: the fit search and the switch list are for GPUs. Each process
        # as the run has it (a DDP process holds its gradient buckets too), as estimate does.
        setup = setup_for({**config, "trainer": trainer}, devices=max(1, processes))
        from nanolab.training.resolve import sections

        micro = int(sections(config)[3].get("micro_batch_size") or 1)
        per_process = estimate_memory(
            setup, micro, backend="cpu", fragmentation=CPU_FRAGMENTATION
        ).total
    except Exception:
        return
    need = int(per_process) * max(1, processes)
    room = available + resident_bytes()  # this process's own memory is part of the need
    if need <= room:
        return
    raise _too_big(need, room, processes, "about ")


def _min_bytes(config: dict[str, Any]) -> int:
    """Bytes a run of ``config`` needs at the very least: 2-byte weights and gradients of
    :meth:`GPTConfig.min_params` (0 when the model section is not nanolab's GPT)."""
    from nanolab.model.config import GPTConfig
    from nanolab.training.resolve import sections

    try:
        gpt = sections(config)[1].get("gpt") or {}
        return 4 * GPTConfig(**gpt).min_params()
    except Exception:  # another model class, or a config the run itself will refuse
        return 0


def _too_big(need: int, available: int, processes: int, how: str) -> HostMemoryError:
    return HostMemoryError(
        f"this model needs {how}{need / 2**30:.1f} GiB of memory to train on the CPU "
        f"(estimate: weights, gradients, optimizer states and activations"
        + (f", x{processes} processes" if processes > 1 else "")
        + f"), but only {available / 2**30:.1f} GiB are available; make model.gpt smaller "
        "(n_layer, n_embd), lower data.micro_batch_size or model.gpt.block_size, or train on a "
        "GPU (`nanolab estimate` shows the breakdown)"
    )


def _switches(est: Any) -> str:
    return "; ".join(f"{sw.yaml} (micro-batch {sw.largest_micro_batch})" for sw in est.switches)
