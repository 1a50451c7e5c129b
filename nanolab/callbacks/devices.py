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
    precision (TF32 or not). Two launches with equal setups measure one rate; a resume that
    changes any of them (fit accepts a precision change with a warning) measures another."""
    return {
        "devices": device_names(trainer),
        "world_size": int(trainer.world_size),
        "num_nodes": int(trainer.num_nodes),
        "precision": str(trainer.precision),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
