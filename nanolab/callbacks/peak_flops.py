"""Dense peak FLOP/s per device, looked up by the name the driver reports.

MFU is only as good as its denominator. Common tables get it wrong in three ways this one avoids:
they quote *sparse* tensor-core numbers (2:4 structured sparsity doubles the datasheet figure but
no dense transformer sees it), they quote the *FP16-accumulate* rate of GeForce cards (training
accumulates in FP32, which GeForce parts run at half that rate), and they guess a device from a
substring (``"h100"`` matches the PCIe card too; ``"l4"`` matches ``"l40s"``). The numbers and
the driver-name patterns live in one data file shared with the estimator,
``nanolab/estimator/gpus.json``, each with its source; every pattern is anchored to one product,
and anything else is *unknown*, reported as ``mfu: null`` with a warning that names the device
and the override (``throughput.peak_flops``), never as a wrong number.

The rate a run gets depends on its matmul dtype: bf16/fp16 for the ``*-mixed``/``*-true``
16-bit precisions, and for ``32-true`` TF32 when ``torch.get_float32_matmul_precision()`` allows
it (``run.float32_matmul_precision``, default ``high``) and, on an AMD GPU,
``HIPBLASLT_ALLOW_TF32=1`` is set (ROCm's torch uses TF32 only then); a dtype the hardware has no
units for runs at its FP32 rate. That rule is :func:`nanolab.estimator.gpus.matmul_rate`, shared
with the estimator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanolab.estimator.gpus import (
    gpu_for_device,
    hip_tf32_setting,
    matmul_rate,
    normalise_device_name,
)
from nanolab.estimator.gpus import matmul_dtype as gpu_matmul_dtype

__all__ = ["Peak", "lookup_peak", "matmul_dtype", "normalise_device_name", "peak_flops_per_device"]


@dataclass(frozen=True)
class Peak:
    """Dense TFLOP/s of one device for each matmul precision (``None``: not supported)."""

    product: str
    bf16: float | None
    fp16: float | None
    tf32: float | None
    fp32: float
    fp8: float | None = None


def lookup_peak(name: str) -> Peak | None:
    """The table entry for a device name, or ``None`` when the name is not exactly known."""
    g = gpu_for_device(name)
    if g is None:
        return None
    return Peak(
        product=g.label,
        bf16=g.peak("bf16"),
        fp16=g.peak("fp16"),
        tf32=g.peak("tf32"),
        fp32=g.peak("fp32") or 0.0,
        fp8=g.peak("fp8"),
    )


def rocm_build() -> bool:
    """Whether this torch is ROCm's (its GPUs are AMD's, its TF32 under HIPBLASLT_ALLOW_TF32)."""
    return bool(getattr(torch.version, "hip", None))


def matmul_dtype(precision: str) -> str | None:
    """The matmul dtype a Lightning ``precision`` runs at in this process (bf16, fp16, tf32 or
    fp32; ``32-true`` follows ``torch.get_float32_matmul_precision()``, and on a ROCm build of
    torch ``HIPBLASLT_ALLOW_TF32`` too)."""
    return gpu_matmul_dtype(precision, torch.get_float32_matmul_precision(), amd=rocm_build())


def tf32_switch(precision: str) -> dict[str, bool]:
    """What a launch at ``precision`` records of ``HIPBLASLT_ALLOW_TF32`` in this process
    (:func:`nanolab.estimator.gpus.hip_tf32_setting`): on a ROCm build where it decides
    between TF32 and FP32 (a resume that flips it runs at another speed), else nothing."""
    return hip_tf32_setting(precision, torch.get_float32_matmul_precision(), amd=rocm_build())


def peak_flops_per_device(name: str, precision: str) -> tuple[float | None, str]:
    """(peak FLOP/s, explanation) for one device at a Lightning precision; ``None`` if unknown.

    The rate is :func:`nanolab.estimator.gpus.matmul_rate`, the one the estimator's time uses.
    """
    g = gpu_for_device(name)
    if g is None:
        return None, f"device {name!r} is not in the peak-FLOPs table"
    value, _, why = matmul_rate(g, precision, torch.get_float32_matmul_precision())
    return (None if value is None else value * 1e12), why
