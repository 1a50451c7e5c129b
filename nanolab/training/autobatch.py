"""Before a GPU run starts: choose the micro-batch from the estimator, or warn that it will not fit.

No trial-and-error OOM runs: ``run.micro_batch_size: auto`` asks the memory estimator for the
largest micro-batch predicted to fit on this device that also divides the per-device share of
``run.global_batch_tokens`` (so accumulation stays exact). Any run on a GPU gets one warning line
at start when the estimate exceeds the device's memory, naming the switches that would fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


class AutoBatchError(ValueError):
    """No micro-batch fits; the message says which switches would help."""


@dataclass
class MemoryPlan:
    micro_batch_size: int
    predicted_bytes: int
    device_bytes: int
    warning: str | None


def device_memory_bytes() -> int | None:
    """Total memory of this process's GPU (CUDA or ROCm), or None on CPU."""
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


def plan_memory(
    config: dict[str, Any], device_memory: int, auto: bool, devices_per_node: int
) -> MemoryPlan:
    """Pick (``auto``) or check the micro-batch of ``config`` against ``device_memory`` bytes.

    ``config`` is the merged ``nanolab fit`` config as a plain dict (``vocab_size`` resolved).
    """
    from nanolab.estimator import estimate_from_config, largest_fitting_micro_batch

    micro = int(config["data"]["micro_batch_size"])
    if auto:
        micro = largest_fitting_micro_batch(
            config, device_memory=device_memory, devices=devices_per_node
        )
        if micro == 0:
            est = estimate_from_config(
                config, device_memory=device_memory, devices=devices_per_node, micro_batch_size=1
            )
            raise AutoBatchError(
                "run.micro_batch_size auto: not even one sequence fits in "
                f"{device_memory / 2**30:.1f} GiB (predicted {est.memory.total / 2**30:.1f} GiB); "
                f"try: {_switches(est) or 'a smaller model or block_size'}"
            )
    est = estimate_from_config(
        config, device_memory=device_memory, devices=devices_per_node, micro_batch_size=micro
    )
    warning = None
    if not est.fits:
        warning = (
            f"memory estimate {est.memory.total / 2**30:.1f} GiB exceeds this device's "
            f"{device_memory / 2**30:.1f} GiB at micro_batch_size {micro}; expect an OOM. "
            f"Largest that fits: {est.largest_micro_batch}; or try: {_switches(est) or '-'} "
            "(nanolab estimate shows the breakdown)"
        )
    return MemoryPlan(micro, int(est.memory.total), device_memory, warning)


def _switches(est: Any) -> str:
    return "; ".join(f"{sw.yaml} (micro-batch {sw.largest_micro_batch})" for sw in est.switches)
