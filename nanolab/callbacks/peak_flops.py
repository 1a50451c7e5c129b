"""Dense peak FLOP/s per device, looked up by the name the driver reports.

MFU is only as good as its denominator. Common tables get it wrong in three ways this one avoids:
they quote *sparse* tensor-core numbers (2:4 structured sparsity doubles the datasheet figure but
no dense transformer sees it), they quote the *FP16-accumulate* rate of GeForce cards (training
accumulates in FP32, which GeForce parts run at half that rate), and they guess a device from a
substring (``"h100"`` matches the PCIe card too; ``"l4"`` matches ``"l40s"``). Every pattern
below is anchored to one product; anything else is *unknown*, reported as ``mfu: null`` with a
warning that names the device and the override (``throughput.peak_flops``), never as a wrong number.

Values are TFLOP/s per device *as torch sees it*, from the vendors' datasheets/whitepapers, dense:

* ``bf16``/``fp16``: tensor/matrix cores with FP32 accumulation;
* ``tf32``: FP32 matmuls when TF32 is allowed (``torch.set_float32_matmul_precision("high")``);
  ``None`` where the hardware has no TF32 (then FP32 matmuls run at the ``fp32`` rate);
* ``fp32``: plain FP32 (CDNA: the FP32 *matrix* rate, what an FP32 GEMM reaches).

AMD MI250X: torch sees each of its two dies (GCDs) as one device, so the figures are half the
module's (383 -> 191.5 TFLOP/s bf16). ROCm may report it as "AMD Instinct MI250X/MI250"; that name
is taken as MI250X.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Peak:
    """Dense TFLOP/s of one device for each matmul precision (``None``: not supported)."""

    product: str
    bf16: float | None
    fp16: float | None
    tf32: float | None
    fp32: float


# (pattern on the lower-cased name, with "nvidia "/"geforce "/"amd "/"instinct " removed; Peak)
_TABLE: tuple[tuple[str, Peak], ...] = (
    # NVIDIA datacenter
    (r"tesla v100-sxm[23]-\d+gb", Peak("V100 SXM", None, 125.0, None, 15.7)),
    (r"tesla v100-pcie-\d+gb", Peak("V100 PCIe", None, 112.0, None, 14.0)),
    (r"tesla v100s-pcie-\d+gb", Peak("V100S PCIe", None, 130.0, None, 16.4)),
    (
        r"a100(-sxm4-\d+gb| \d+gb pcie|-pcie-\d+gb|-sxm-\d+gb)?",
        Peak("A100", 312.0, 312.0, 156.0, 19.5),
    ),
    (
        r"h100 80gb hbm3|h100[ -]sxm5?([ -]\d+gb)?( hbm3)?",
        Peak("H100 SXM", 989.4, 989.4, 494.7, 66.9),
    ),
    (r"h100 pcie|h100-pcie(-\d+gb)?", Peak("H100 PCIe", 756.5, 756.5, 378.0, 51.2)),
    (r"h200( \d+gb hbm3e)?", Peak("H200 SXM", 989.4, 989.4, 494.7, 66.9)),
    (r"gh200( \d+gb)?", Peak("GH200", 989.4, 989.4, 494.7, 66.9)),
    (r"h200 nvl", Peak("H200 NVL", 835.5, 835.5, 417.5, 60.0)),
    (r"b200", Peak("B200", 2250.0, 2250.0, 1100.0, 75.0)),
    (r"l4", Peak("L4", 121.0, 121.0, 60.0, 30.3)),
    (r"l40s", Peak("L40S", 362.05, 362.05, 183.0, 91.6)),
    # NVIDIA GeForce (FP32-accumulate tensor rates)
    (r"rtx 3090", Peak("RTX 3090", 71.0, 71.0, 35.6, 35.6)),
    (r"rtx 4070", Peak("RTX 4070", 58.3, 58.3, 29.1, 29.1)),
    (r"rtx 4090", Peak("RTX 4090", 165.2, 165.2, 82.6, 82.6)),
    (r"rtx 5090", Peak("RTX 5090", 209.5, 209.5, 104.8, 104.8)),
    # AMD Instinct (per device as torch sees it)
    (r"mi250x(/mi250)?", Peak("MI250X (one GCD)", 191.5, 191.5, None, 47.9)),
    (r"mi300x( vf)?", Peak("MI300X", 1307.4, 1307.4, 653.7, 163.4)),
    (r"mi325x( vf)?", Peak("MI325X", 1307.4, 1307.4, 653.7, 163.4)),
    (r"mi355x( vf)?", Peak("MI355X", 2516.6, 2516.6, None, 157.3)),
)
_COMPILED = tuple((re.compile(rf"^(?:{pattern})$"), peak) for pattern, peak in _TABLE)
_NOISE = re.compile(r"\b(nvidia|geforce|amd|instinct|radeon)\b")


def normalise_device_name(name: str) -> str:
    """Lower-case, vendor words removed, spaces collapsed: ``"NVIDIA H100 PCIe"`` -> ``"h100 pcie"``."""
    return " ".join(_NOISE.sub(" ", name.lower()).split())


def lookup_peak(name: str) -> Peak | None:
    """The table entry for a device name, or ``None`` when the name is not exactly known."""
    key = normalise_device_name(name)
    for pattern, peak in _COMPILED:
        if pattern.match(key):
            return peak
    return None


def matmul_dtype(precision: str) -> str | None:
    """The matmul precision a Lightning ``precision`` setting runs at: bf16, fp16, tf32 or fp32."""
    p = str(precision)
    if p.startswith("bf16"):
        return "bf16"
    if p.startswith("16"):
        return "fp16"
    if p in ("32", "32-true"):
        return "tf32" if torch.get_float32_matmul_precision() != "highest" else "fp32"
    return None  # 64-true, transformer-engine (fp8), ...: not in the table


def peak_flops_per_device(name: str, precision: str) -> tuple[float | None, str]:
    """(peak FLOP/s, explanation) for one device at a Lightning precision; ``None`` if unknown."""
    peak = lookup_peak(name)
    dtype = matmul_dtype(precision)
    if peak is None:
        return None, f"device {name!r} is not in the peak-FLOPs table"
    if dtype is None:
        return None, f"precision {precision!r} has no entry in the peak-FLOPs table"
    value = getattr(peak, dtype)
    if dtype == "tf32" and value is None:
        value, dtype = peak.fp32, "fp32"  # no TF32 units: FP32 matmuls run at the FP32 rate
    if value is None:
        return None, f"{peak.product} has no {dtype} tensor units"
    return value * 1e12, f"{peak.product} {dtype} dense"
