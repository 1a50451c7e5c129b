"""How long a run will take: its FLOPs over this device's rate, start-up included.

One answer for the ``fit`` start banner and ``nanolab queue`` (``--until``, ``--order``): on a
GPU of the estimator's table, :func:`nanolab.estimator.estimate_from_config` at the family's MFU;
on CPU, where there is no datasheet peak, this machine's FP32 matmul rate is measured once per
process (:mod:`nanolab.estimator.cpu`, 0.2 s) and :data:`CPU_EFFICIENCY` of it is assumed. Both
count the host's fixed work per step (:func:`nanolab.estimator.cpu.host_floor_seconds`) and
add :data:`STARTUP_S` for importing torch/Lightning and building the model.
"""

from __future__ import annotations

import sys
from typing import Any

from nanolab.estimator.cpu import (  # noqa: F401  (CPU_EFFICIENCY: public here)
    CPU_EFFICIENCY,
    cpu_device,
    remembered_cpu_device,
)
from nanolab.estimator.gpus import format_rate

#: Vocabulary assumed for a duration estimate when the data is not prepared yet.
VOCAB_GUESS = 256
#: Seconds a job spends before its first step (imports, data, model) and after its last.
STARTUP_S = 12.0


#: Why a GPU job could not be timed where no GPU is visible, and the fix ``queue add`` and
#: ``estimate`` take (another command's message words its own fix instead).
NO_GPU_HERE = "no estimate: no GPU here to look up"
GPU_HINT = " (pass --gpu NAME)"


def cpu_flops() -> float:
    """This machine's FP32 matmul FLOP/s, measured once per process and thread count (the one
    probe: :func:`nanolab.estimator.cpu.cpu_device`)."""
    return float(cpu_device().peak("fp32") or 0.0) * 1e12


def _gpu_name() -> str | None:
    """The estimator's name for the first visible GPU (``NVIDIA H200`` -> ``h200``), if any.
    A torch built without CUDA or ROCm sees none, known without importing torch (~2 s)."""
    from nanolab.allocator import torch_build

    if "torch" not in sys.modules and torch_build("cuda") is None and torch_build("hip") is None:
        return None
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        device = torch.cuda.get_device_name(0)
    except Exception:
        return None
    return estimator_gpu(device) or device


def estimator_gpu(device_name: str) -> str | None:
    """The estimator's table name for a driver-reported device name (its anchored driver-name
    patterns, as the MFU callback uses them), or None when the device is not exactly known."""
    from nanolab.estimator.gpus import gpu_for_device

    g = gpu_for_device(device_name)
    return g.name if g is not None else None


def run_seconds(
    config: dict[str, Any],
    *,
    devices: int,
    tokens_per_step: int,
    max_steps: int,
    gpu: str | None = None,
    remembered_cpu: bool = False,
) -> tuple[float | None, str]:
    """(seconds, how it was estimated) for ``max_steps`` steps of a merged ``fit`` config,
    start-up included; (None, why not) when it cannot be estimated.

    The estimator's own time (:func:`nanolab.estimator.estimate_from_config`), so ``estimate``,
    the banner and the queue give one number for one config: ``devices`` and
    ``tokens_per_step`` are the resolved ones; ``gpu`` names the device in the estimator's
    table (default: the first visible GPU, or this CPU). ``remembered_cpu``: this CPU's rates
    as a recent probe measured them (:func:`nanolab.estimator.cpu.remembered_cpu_device`, no
    torch import: ``queue add``), not probed in this process.
    """
    from nanolab.errors import RunConfigError
    from nanolab.estimator.estimate import estimate_from_config
    from nanolab.estimator.own_class import OtherNetworkError

    cfg = as_estimator_config(config, devices)
    accelerator = str(cfg["trainer"].get("accelerator", "auto"))
    gpu = gpu or (None if accelerator == "cpu" else _gpu_name())
    if gpu is None and accelerator not in ("cpu", "auto"):
        return None, NO_GPU_HERE + GPU_HINT
    if gpu is not None:
        where: dict[str, Any] = {"gpu": gpu}
    else:  # this CPU, probed once per process (bf16 rates only for a bf16 run)
        bf16 = str(cfg["trainer"].get("precision") or "").startswith("bf16")
        device = remembered_cpu_device(bf16=bf16) if remembered_cpu else cpu_device(bf16=bf16)
        where = {"gpu": device, "device": "cpu"}
    tokens = max(1, tokens_per_step * max_steps)
    guessed = ""
    try:
        try:
            est = estimate_from_config(cfg, tokens=tokens, history=False, **where)
        except OtherNetworkError:
            raise  # not the vocabulary's doing: no guess changes the verdict
        except RunConfigError:
            # Unprepared data with a vocabulary read from it (chars): the embedding is a small
            # share of a model's FLOPs, so a byte-sized guess is close enough for a duration.
            est = estimate_from_config(
                cfg, tokens=tokens, history=False, vocab_size=VOCAB_GUESS, **where
            )
            guessed = f", vocab guessed {VOCAB_GUESS}"
    except Exception as err:  # unknown GPU name, a config the estimator cannot describe
        return None, f"no estimate: {str(err).splitlines()[0]}"
    c = est.compute
    if "device" not in where:
        how = f"estimator ({gpu}, MFU {c.mfu:.0%})"
    else:
        how = f"FLOPs at {c.mfu:.0%} of this CPU's {format_rate(c.peak_tflops_per_device)}{guessed}"
    if c.floor_dominates:  # the estimate's own rule (its note), in the same words everywhere
        how += (
            f"; a lower bound: {c.floor_seconds * 1e3:.3g} ms of a step's "
            f"{c.step_seconds * 1e3:.3g} ms is fixed host work, counted at its lower end"
        )
    return c.hours * 3600 + STARTUP_S, how


def as_estimator_config(
    config: dict[str, Any], devices: int, for_memory: bool = False
) -> dict[str, Any]:
    """The config with ``trainer.devices`` as the run will have it (``precision: null``, Lightning's
    32-true, is the estimator's own reading: :func:`nanolab.estimator.setup.setup_from_config`).
    For a duration (``for_memory`` false) a project's own optimizer is timed as ``adamw``
    (:func:`nanolab.estimator.setup.timed_config`: the same FLOPs); ``for_memory`` keeps it,
    and the memory estimate says it is not modelled."""
    from nanolab.estimator.setup import timed_config

    cfg = dict(config) if for_memory else timed_config(config)
    cfg["trainer"] = dict(config.get("trainer") or {})
    cfg["trainer"]["devices"] = devices
    return cfg
