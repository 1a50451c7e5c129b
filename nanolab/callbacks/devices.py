"""What a launch trains on, as the run log and the clock record it.

The start record lists the devices (:func:`device_names`), and the clock keeps a launch's
:func:`launch_setup` in the checkpoint: the run-wide tokens/s of a resumed run is only one
figure when every launch measured it on the same setup.
"""

from __future__ import annotations

import platform
from typing import Any

import lightning as L
import torch

from nanolab.callbacks.peak_flops import tf32_switch


def device_names(trainer: L.Trainer) -> list[str]:
    """Names of this node's devices in the run (``torch.cuda.get_device_name`` for GPUs)."""
    devices = getattr(trainer.strategy, "parallel_devices", None) or [trainer.strategy.root_device]
    cpu = f"cpu ({platform.machine() or 'unknown'})"
    return [
        torch.cuda.get_device_name(d) if d.type == "cuda" else cpu if d.type == "cpu" else str(d)
        for d in devices
    ]


def launch_setup(trainer: L.Trainer) -> dict[str, Any]:
    """What sets a launch's speed apart from another's on the same model: its devices (the GPU
    model), how many processes on how many nodes, its precision and the float32 matmul
    precision (TF32 or not; on ROCm also ``HIPBLASLT_ALLOW_TF32``, where it decides that:
    :func:`~nanolab.callbacks.peak_flops.tf32_switch`), the strategy (DDP, FSDP, DeepSpeed ...), whether and how the
    model is compiled, the micro-batch size, and the peak FLOP/s ``throughput.peak_flops``
    gives MFU (null: the GPU table's). Two launches with equal setups measure one rate; a resume
    that changes any of them (fit accepts each) measures another. A setup an older nanolab
    recorded lacks the later keys, so it never equals this one: its run reports per launch."""
    module = getattr(trainer, "lightning_module", None)
    data = getattr(trainer, "datamodule", None)
    micro_batch = getattr(data, "micro_batch_size", None)
    mode = getattr(module, "compile_mode", None)
    return {
        "devices": device_names(trainer),
        "world_size": int(trainer.world_size),
        "num_nodes": int(trainer.num_nodes),
        "precision": str(trainer.precision),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        **tf32_switch(str(trainer.precision)),
        "strategy": type(trainer.strategy).__name__,
        # True only as a setting: nn.Module.compile is a method, not a switch.
        "compile": getattr(module, "compile", False) is True,
        "compile_mode": None if mode is None else str(mode),  # plain data: weights_only loads
        "micro_batch_size": int(micro_batch) if isinstance(micro_batch, int) else None,
        "peak_flops": peak_flops_override(trainer),
    }


def peak_flops_override(trainer: L.Trainer) -> float | None:
    """The ``throughput.peak_flops`` this launch's throughput meter was given (None: none, or
    no meter): it sets the run's MFU, so a launch with another override is another setup."""
    for callback in getattr(trainer, "callbacks", []):
        override = getattr(callback, "peak_flops_override", None)
        if isinstance(override, (int, float)):
            return float(override)
    return None
