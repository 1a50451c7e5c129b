"""Accelerators nanolab knows: memory, dense peak per dtype, default MFU, all from ``gpus.json``.

One data file (``nanolab/estimator/gpus.json``) holds every number with its source; the
estimator (``nanolab estimate --gpu``), the MFU callback (by the driver's device name) and the
queue read it through this module. It is deliberately free of torch and Lightning so that "how
much memory does an RTX 4070 have" costs milliseconds.

Memory is what one *device* as PyTorch sees it offers (``torch.cuda.get_device_properties(i)
.total_memory``) where such a report was found, else the datasheet capacity (``memory_reported``
says which): an A100 40 GB reports 39.4 GiB, an MI250X is two devices of 64 GiB. Peaks are dense
(no 2:4 sparsity) matmul rates with FP32 accumulation, per dtype; ``None`` where the device has no
such units (no bf16 on V100/T4, no TF32 on CDNA2/CDNA4). Prices are indicative.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Literal, get_args

from nanolab.errors import NanolabError
from nanolab.training.resolve import precision_name

KiB = 1024
MiB = 1024**2
GiB = 1024**3

TABLE = Path(__file__).with_name("gpus.json")
DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")


@dataclass(frozen=True)
class GPU:
    """One accelerator model, as one PyTorch device."""

    name: str
    label: str
    memory_bytes: int
    vendor: str  # "nvidia" or "amd": selects the framework-overhead constant
    usd_per_hour: float
    tflops: dict[str, float | None] = field(default_factory=dict, hash=False, compare=False)
    family: str = ""
    patterns: tuple[str, ...] = ()
    memory_reported: bool = True
    memory_source: str = ""
    tflops_source: str = ""
    price_source: str = ""
    default_mfu: float = 0.40
    mfu_source: str = ""

    @property
    def bf16(self) -> bool:
        """Has bf16 matmul units (else 16-bit means fp16)."""
        return self.tflops.get("bf16") is not None

    def peak(self, dtype: str) -> float | None:
        """Dense TFLOP/s for matmuls in ``dtype`` (fp32, tf32, bf16, fp16, fp8), or None."""
        value = self.tflops.get(dtype)
        return None if value is None else float(value)


#: The ``trainer.precision`` values the estimator has rules for, each spelling (the short ones
#: too) with Lightning's name for it; the names come from the resolver's one alias table.
PRECISIONS = {
    spelling: precision_name(spelling)
    for spelling in (
        "32",
        "32-true",
        "bf16",
        "bf16-mixed",
        "16",
        "16-mixed",
        "bf16-true",
        "16-true",
    )
}

#: ``torch.set_float32_matmul_precision`` values (``run.float32_matmul_precision``): ``highest``
#: keeps FP32 GEMMs, ``high``/``medium`` allow TF32 where the device has it.
MatmulPrecision = Literal["highest", "high", "medium"]
FLOAT32_MATMUL_PRECISIONS: tuple[str, ...] = get_args(MatmulPrecision)


#: torch on ROCm runs ``32-true`` matmuls on TF32 units (hipBLASLt, MI300 class) only when this
#: variable is exactly ``1`` in the training process, whatever ``set_float32_matmul_precision``
#: allows (torch's own TF32 tests set it on AMD GPUs); unset, it computes them in IEEE FP32.
HIP_TF32_VARIABLE = "HIPBLASLT_ALLOW_TF32"


def hip_allows_tf32(environ: Mapping[str, str] | None = None) -> bool:
    """Whether torch on ROCm may run fp32 matmuls as TF32 here: :data:`HIP_TF32_VARIABLE` is
    ``1`` in ``environ`` (this process's environment unless given), as torch reads it."""
    return (os.environ if environ is None else environ).get(HIP_TF32_VARIABLE) == "1"


#: The key a launch records :func:`hip_allows_tf32` under (its setup, its start record), only
#: where the variable decides its matmul dtype (:func:`hip_tf32_setting`).
HIP_TF32_KEY = "hip_allow_tf32"


def hip_tf32_setting(
    precision: str,
    float32_matmul_precision: str,
    amd: bool,
    environ: Mapping[str, str] | None = None,
) -> dict[str, bool]:
    """``{HIP_TF32_KEY: hip_allows_tf32(environ)}`` where :data:`HIP_TF32_VARIABLE` decides
    whether a run's matmuls are TF32 or FP32: on an AMD GPU (``amd``: torch's ROCm build) at a
    precision whose matmuls are TF32 when allowed (``32-true`` under ``high``). Else empty: a
    CUDA or CPU launch records what it did before, so its setups and logs still compare equal
    to those of older launches."""
    if not amd or matmul_dtype(precision, float32_matmul_precision) != "tf32":
        return {}
    return {HIP_TF32_KEY: hip_allows_tf32(environ)}


def matmul_dtype(
    precision: str,
    float32_matmul_precision: str = "high",
    amd: bool = False,
    environ: Mapping[str, str] | None = None,
) -> str | None:
    """The dtype a run's matmuls use at a Lightning ``precision``: bf16, fp16, tf32 or fp32
    (``None`` for a precision the table has no rates for, such as ``64-true``). ``amd``: the
    run is on an AMD GPU (torch's ROCm build), where ``32-true`` is TF32 only when
    :func:`hip_allows_tf32` says so in ``environ``."""
    canonical = PRECISIONS.get(str(precision))
    if canonical is None:
        return None
    if canonical.startswith("bf16"):
        return "bf16"
    if canonical.startswith("16"):
        return "fp16"
    if float32_matmul_precision == "highest" or (amd and not hip_allows_tf32(environ)):
        return "fp32"
    return "tf32"


def rocm_tf32_note(
    gpu: GPU,
    precision: str,
    float32_matmul_precision: str = "high",
    environ: Mapping[str, str] | None = None,
) -> str | None:
    """What a ``32-true`` run on an AMD GPU with TF32 units was assumed to compute in, and why
    (the environment variable decides there, not only ``run.float32_matmul_precision``); None
    where that variable changes nothing (another precision or GPU, ``highest``, no TF32)."""
    if (
        gpu.vendor != "amd"
        or gpu.peak("tf32") is None
        or matmul_dtype(precision, float32_matmul_precision) != "tf32"
    ):
        return None
    if hip_allows_tf32(environ):
        return f"TF32: {HIP_TF32_VARIABLE}=1 is set here (ROCm's torch uses TF32 only then)"
    return (
        f"FP32: ROCm's torch uses TF32 only with {HIP_TF32_VARIABLE}=1 set, and it is not set here"
    )


def matmul_rate(
    gpu: GPU,
    precision: str,
    float32_matmul_precision: str = "high",
    environ: Mapping[str, str] | None = None,
) -> tuple[float | None, str, str]:
    """(dense TFLOP/s, the dtype it is the rate of, how it was chosen) of a run's matmuls.

    The one answer for the estimator's time and the MFU callback's denominator. A dtype the
    device has no units for runs at its FP32 rate: TF32 on CDNA2/CDNA4, bf16 on V100/T4
    (emulated), fp16 on a CPU; ``16-mixed`` on a CPU is Lightning's bf16-mixed. On an AMD GPU
    ``32-true`` is TF32 only with ``HIPBLASLT_ALLOW_TF32=1`` in ``environ`` (this process's
    unless given): :func:`rocm_tf32_note`. ``None`` only for a precision without rates.
    """
    dtype = matmul_dtype(precision, float32_matmul_precision, gpu.vendor == "amd", environ)
    if dtype is None:
        return None, "", f"precision {precision!r} has no entry in the peak-FLOPs table"
    if gpu.family == "cpu" and PRECISIONS.get(str(precision)) == "16-mixed" and gpu.bf16:
        # Lightning has no fp16 autocast on a CPU: it trains 16-mixed as bf16-mixed there.
        return gpu.peak("bf16"), "bf16", f"{gpu.label} bf16 dense (16-mixed runs as bf16-mixed)"
    note = rocm_tf32_note(gpu, precision, float32_matmul_precision, environ)
    why = "" if note is None else f" ({note})"
    value = gpu.peak(dtype)
    if value is not None:
        return value, dtype, f"{gpu.label} {dtype} dense{why}"
    fp32 = gpu.peak("fp32")
    unit = "" if dtype == "tf32" else f" (no {dtype} units)"  # TF32 off-hardware is just FP32
    return fp32, "fp32", f"{gpu.label} fp32 dense{unit}"


def format_rate(tflops: float) -> str:
    """A matmul rate in the unit that keeps its digits: ``312.0 TFLOP/s``, ``98 GFLOP/s``."""
    if tflops >= 1:
        return f"{tflops:,.1f} TFLOP/s"
    return f"{tflops * 1e3:,.0f} GFLOP/s" if tflops >= 1e-3 else f"{tflops * 1e6:,.0f} MFLOP/s"


class UnknownGPUError(NanolabError):
    """A GPU name not in the table; the message lists the closest known ones."""


class AmbiguousGPUError(UnknownGPUError):
    """A name that fits several entries (``a100``: 40 or 80 GB); the message asks which."""


class MemoryStringError(NanolabError):
    """A memory size that does not parse, e.g. ``12 gigs``."""


_TEXT_FIELDS = (
    "name",
    "label",
    "vendor",
    "family",
    "memory_source",
    "tflops_source",
    "price_source",
)


@cache
def _load() -> tuple[dict[str, GPU], dict[str, str | list[str]]]:
    data = json.loads(TABLE.read_text())
    families = data["families"]
    gpus: dict[str, GPU] = {}
    for e in data["gpus"]:
        fam = families[e["family"]]
        gpus[e["name"]] = GPU(
            **{k: e[k] for k in _TEXT_FIELDS},
            memory_bytes=int(e["memory_bytes"]),
            usd_per_hour=float(e["usd_per_hour"]),
            tflops={k: e["tflops"].get(k) for k in DTYPES},
            patterns=tuple(e["patterns"]),
            memory_reported=bool(e["memory_reported"]),
            default_mfu=float(fam["mfu"]),
            mfu_source=fam["source"],
        )
    return gpus, data["aliases"]


GPUS, ALIASES = _load()


def _squash(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def get_gpu(name: str) -> GPU:
    """Look a GPU up by table name, alias or the name its driver reports (``nvidia-smi``,
    ``torch.cuda.get_device_name()``): case, spaces, dashes and underscores do not matter.

    Raises:
        AmbiguousGPUError: ``a100``, ``v100``, ...: the candidates and their memory, to pick one.
        UnknownGPUError: the closest known names.
    """
    key = _squash(name)
    lookup: dict[str, str | list[str]] = {_squash(n): n for n in GPUS}
    lookup |= {_squash(a): t for a, t in ALIASES.items()}
    found = lookup.get(key)
    if isinstance(found, list):
        options = ", ".join(f"{n} ({GPUS[n].memory_bytes / GiB:.1f} GiB)" for n in found)
        raise AmbiguousGPUError(
            f"--gpu {name!r} is ambiguous: {options}; name one, e.g. --gpu {found[-1]}"
        )
    if found is None and (by_driver := gpu_for_device(name)) is not None:
        return by_driver  # the name the driver reports ("NVIDIA GeForce RTX 4070"), as nvidia-smi shows it
    if found is None:
        close = difflib.get_close_matches(key, list(lookup), n=4, cutoff=0.5)
        targets = [lookup[c] if isinstance(lookup[c], list) else [lookup[c]] for c in close]
        names = list(dict.fromkeys(n for target in targets for n in target))
        hint = f"closest: {', '.join(names)}" if names else "none is close"
        raise UnknownGPUError(
            f"unknown GPU {name!r}; {hint} (nanolab estimate --list-gpus shows all "
            f"{len(GPUS)}; or give --gpu-mem)"
        )
    return GPUS[found]


_NOISE = re.compile(r"\b(nvidia|geforce|amd|instinct|radeon)\b")


def normalise_device_name(name: str) -> str:
    """Lower-case, vendor words removed, spaces collapsed: ``"NVIDIA H100 PCIe"`` -> ``"h100 pcie"``."""
    return " ".join(_NOISE.sub(" ", name.lower()).split())


@cache
def _compiled() -> tuple[tuple[re.Pattern[str], GPU], ...]:
    return tuple((re.compile(rf"^(?:{p})$"), g) for g in GPUS.values() for p in g.patterns)


def gpu_for_device(device_name: str) -> GPU | None:
    """The entry whose driver-name pattern matches ``torch.cuda.get_device_name()`` exactly,
    or None: a guess from a substring would put an L40S's numbers on an L4."""
    key = normalise_device_name(device_name)
    for pattern, g in _compiled():
        if pattern.match(key):
            return g
    return None


#: Unit suffix -> bytes: "", "b"; "k"/"kb" ... "t"/"tb" (powers of 1000); "kib" ... "tib" (1024).
_UNITS = {"": 1, "b": 1}
for _power, _prefix in enumerate("kmgt", start=1):
    _UNITS |= {_prefix: 1000**_power, f"{_prefix}b": 1000**_power, f"{_prefix}ib": 1024**_power}


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
    if not m.group(2) and value < MiB:  # "12": a device of 12 bytes is a unit left out
        raise MemoryStringError(
            f"memory size {text!r} has no unit and reads as {int(value)} bytes; did you mean "
            f"{m.group(1)}GiB?"
        )
    return int(value)


def decimal_size_note(text: str) -> str | None:
    """A note for a ``--gpu-mem`` written in decimal gigabytes (``12GB``) where listed cards
    sold as that many GB hold more than it reads as: a card's "12 GB" is binary (the RTX 4070
    reports 11.99 GiB), while ``12GB`` is 12e9 bytes, 11.18 GiB, so the estimate would hold the
    run to 7% less memory than the card has. None when no listed card is sold as that size."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*(gb?)\s*", str(text), flags=re.IGNORECASE)
    if not m:
        return None
    size, given = float(m.group(1)), parse_memory(text)
    sold = [g for g in GPUS.values() if _sold_gb(g.label) == size and g.memory_bytes > given]
    if not sold:
        return None
    sold.sort(key=lambda g: -g.memory_bytes)
    cards = ", ".join(f"{g.name} {g.memory_bytes / GiB:.2f} GiB" for g in sold[:3])
    more = f", {len(sold) - 3} more" if len(sold) > 3 else ""
    whole = f"{size:g}"
    fix = "give --gpu NAME (its own figure)"
    if all(g.memory_bytes >= 0.995 * size * GiB for g in sold):  # each holds N GiB
        fix += f" or --gpu-mem {whole}GiB"
    return (
        f"--gpu-mem {text.strip()} is {given / GiB:.2f} GiB (GB: powers of 1000); a card sold "
        f"as {whole} GB has more ({cards}{more}): {fix}"
    )


def _sold_gb(label: str) -> float | None:
    """The memory a card is sold with, from its label (``NVIDIA GeForce RTX 4070 12 GB``)."""
    m = re.search(r"\b([0-9]+) GB\b", label)
    return float(m.group(1)) if m else None


def format_bytes(n: float) -> str:
    """``1.23 GiB`` style, for tables."""
    for unit, size in (("TiB", 1024**4), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{int(n)} B"
