"""Accelerators the estimator knows: memory per device and dense bf16 peak throughput.

This module is deliberately self-contained (no torch, no Lightning) so that tools which only need
"how much memory does an RTX 4070 have" import it in milliseconds.

Memory is what one *device* as PyTorch sees it offers (``torch.cuda.get_device_properties(i)
.total_memory``), not the marketing figure where the two differ: an MI250X is two devices of
64 GiB each; an H100 SXM reports 79.6 GiB of its "80 GB". Peak TFLOPs are dense (no 2:4 sparsity)
bf16 tensor-core figures with fp32 accumulation from the vendors' data sheets; they are the
denominator of MFU; ``fp32_tflops`` is what ``32-true`` runs reach (TF32 tensor cores where the
hardware has them, else the fp32 rate; the same datasheet figures as
``nanolab/callbacks/peak_flops.py``). The V100 has no bf16 units: its entry carries the fp16
figure and ``bf16=False`` so the estimator can warn. Prices are indicative on-demand cloud rates in USD per
GPU-hour (consumer cards: a rough rental rate); pass your own with ``--usd-per-gpu-hour``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KiB = 1024
MiB = 1024**2
GiB = 1024**3


@dataclass(frozen=True)
class GPU:
    """One accelerator model, as one PyTorch device."""

    name: str
    label: str
    memory_bytes: int
    bf16_tflops: float
    vendor: str  # "nvidia" or "amd": selects the framework-overhead constant
    usd_per_hour: float
    fp32_tflops: float  # what an fp32 matmul reaches: TF32 tensor cores where there are any
    bf16: bool = True


GPUS: dict[str, GPU] = {
    g.name: g
    for g in (
        # name, label, memory per device, bf16 dense TFLOPs, vendor, $/GPU-h, fp32/TF32 TFLOPs
        GPU("rtx4070", "NVIDIA GeForce RTX 4070 12 GB", 12282 * MiB, 58.3, "nvidia", 0.15, 29.1),
        GPU("rtx3090", "NVIDIA GeForce RTX 3090 24 GB", 24576 * MiB, 71.0, "nvidia", 0.25, 35.6),
        GPU("rtx4090", "NVIDIA GeForce RTX 4090 24 GB", 24564 * MiB, 165.2, "nvidia", 0.40, 82.6),
        GPU("rtx5090", "NVIDIA GeForce RTX 5090 32 GB", 32607 * MiB, 209.5, "nvidia", 0.70, 104.8),
        GPU("a100-40gb", "NVIDIA A100 40 GB", 40960 * MiB, 312.0, "nvidia", 1.30, 156.0),
        GPU("a100-80gb", "NVIDIA A100 80 GB", 81920 * MiB, 312.0, "nvidia", 1.80, 156.0),
        GPU("h100", "NVIDIA H100 SXM 80 GB", 81559 * MiB, 989.4, "nvidia", 2.50, 494.7),
        GPU("h200", "NVIDIA H200 SXM 141 GB", 143771 * MiB, 989.4, "nvidia", 3.50, 494.7),
        GPU("b200", "NVIDIA B200 180 GB", 183359 * MiB, 2250.0, "nvidia", 5.50, 1100.0),
        GPU("l4", "NVIDIA L4 24 GB", 23034 * MiB, 121.0, "nvidia", 0.80, 60.0),
        GPU("l40s", "NVIDIA L40S 48 GB", 46068 * MiB, 362.0, "nvidia", 1.00, 183.0),
        GPU(
            "v100",
            "NVIDIA V100 SXM2 32 GB (no bf16: fp16 peak)",
            32768 * MiB,
            125.0,
            "nvidia",
            0.90,
            15.7,
            bf16=False,
        ),
        GPU(
            "mi250x",
            "AMD Instinct MI250X (one of its two 64 GB GCDs)",
            64 * GiB,
            191.5,
            "amd",
            1.00,
            47.9,
        ),
        GPU("mi300x", "AMD Instinct MI300X 192 GB", 192 * GiB, 1307.4, "amd", 2.50, 653.7),
        GPU("mi325x", "AMD Instinct MI325X 256 GB", 256 * GiB, 1307.4, "amd", 3.00, 653.7),
        GPU("mi355x", "AMD Instinct MI355X 288 GB", 288 * GiB, 2516.6, "amd", 4.00, 157.3),
    )
}

#: Other spellings (compared with every non-alphanumeric character removed).
ALIASES = {
    "4070": "rtx4070",
    "3090": "rtx3090",
    "4090": "rtx4090",
    "5090": "rtx5090",
    "a100": "a100-80gb",
    "h100sxm": "h100",
    "h200sxm": "h200",
}


def _squash(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


_LOOKUP = {_squash(n): n for n in GPUS} | {_squash(a): n for a, n in ALIASES.items()}


class UnknownGPUError(ValueError):
    """A GPU name not in :data:`GPUS`; the message lists the known ones."""


class MemoryStringError(ValueError):
    """A memory size that does not parse, e.g. ``12 gigs``."""


def known_gpus() -> list[str]:
    return list(GPUS)


def get_gpu(name: str) -> GPU:
    """Look a GPU up by name: case, spaces, dashes and underscores do not matter."""
    key = _LOOKUP.get(_squash(name))
    if key is None:
        raise UnknownGPUError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")
    return GPUS[key]


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": 1024**4,
}


def parse_memory(text: str | int | float) -> int:
    """Bytes from ``"12GiB"``, ``"12 GB"``, ``"11.5gib"``, ``"24576MiB"`` or a plain byte count.

    Decimal units (GB) are powers of 1000 and binary units (GiB) powers of 1024, as written:
    "12GB" is 12e9 bytes, 0.8 GiB less than "12GiB".
    """
    if isinstance(text, bool):
        raise MemoryStringError(f"cannot read a memory size from {text!r}")
    if isinstance(text, (int, float)):
        if text <= 0:
            raise MemoryStringError(f"memory size must be positive, got {text!r}")
        return int(text)
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise MemoryStringError(
            f"cannot read a memory size from {text!r}; write e.g. 12GiB, 24GB, 16384MiB"
        )
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value < 1:
        raise MemoryStringError(f"memory size must be positive, got {text!r}")
    return int(value)


def format_bytes(n: float) -> str:
    """``1.23 GiB`` style, for tables."""
    for unit, size in (("TiB", 1024**4), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{int(n)} B"
