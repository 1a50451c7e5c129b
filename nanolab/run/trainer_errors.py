"""Lightning's refusals of a ``trainer.*`` setting, as one line that names the key and the fix.

``Trainer(...)`` checks the accelerator, strategy, precision and clipping settings itself and
raises (``MisconfigurationException``, ``ValueError``, ``TypeError``) with a message of its own,
sometimes over several lines; through ``nanolab fit`` that was a traceback and exit code 1 for a
typo. Nothing is in the run directory by then (it is claimed after the Trainer exists; a
``data.source`` may have been prepared, which later runs reuse), so the refusal is safe to turn
into :class:`~nanolab.errors.RunConfigError`: one line, exit code 2.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from lightning.fabric.utilities.exceptions import MisconfigurationException

from nanolab.errors import RunConfigError

#: Words of Lightning's messages that name a key other than by its name (checked first).
_ALIASES = (
    ("gpu backend", "accelerator"),
    ("torch_xla", "accelerator"),  # accelerator: tpu, without its package
    ("transformer_engine", "precision"),  # precision: transformer-engine, without its package
    ("plugin", "plugins"),
    ("Timer(duration", "max_time"),
)

#: The exceptions ``Trainer(...)`` raises for a setting it refuses (``TypeError``: a device
#: count that is not one, ``trainer.devices: x``; ``ImportError``: a value whose package is not
#: installed, ``accelerator: tpu``, ``precision: transformer-engine``).
REFUSALS = (MisconfigurationException, ValueError, TypeError, ImportError)


def refused_key(reason: str) -> str:
    """The ``trainer.*`` key Lightning's message is about: an alias it uses, else the Trainer
    argument it names first (``Trainer(devices=0)`` ... cpu accelerator: ``devices``)."""
    import inspect

    from lightning.pytorch import Trainer

    for word, key in _ALIASES:
        if word in reason:
            return f"trainer.{key}"
    names = [n for n in inspect.signature(Trainer.__init__).parameters if n != "self"]
    found = [(m.start(), n) for n in names if (m := re.search(rf"\b{n}\b", reason, re.I))]
    return f"trainer.{min(found)[1]}" if found else "trainer"


def missing_gpu(trainer_args: Mapping[str, Any]) -> RunConfigError | None:
    """The refusal of ``trainer.accelerator: gpu`` (or ``cuda``) where torch sees no GPU."""
    accelerator = str(trainer_args.get("accelerator") or "auto")
    if accelerator not in ("gpu", "cuda") or gpu_visible(mps=accelerator == "gpu"):
        return None
    kinds = "a CUDA or ROCm GPU" + (" (or Apple's MPS)" if accelerator == "gpu" else "")
    return RunConfigError(
        f"{accelerator!r} needs {kinds} and {torch_build()} sees none",
        field="trainer.accelerator",
        fix="run where one is visible (Docker: --gpus all, or ROCm's /dev/kfd and /dev/dri), "
        "or run on this CPU with --trainer.accelerator cpu",
    )


def refuse_missing_gpu(trainer_args: Mapping[str, Any]) -> None:
    """Refuse a GPU accelerator without a GPU at once, before the data is read or prepared:
    the GPU recipes say ``accelerator: gpu``, and their data may not exist on this machine."""
    if (refusal := missing_gpu(trainer_args)) is not None:
        raise refusal


def trainer_refusal(err: BaseException, trainer_args: Mapping[str, Any]) -> RunConfigError:
    """``err`` from ``Trainer(**trainer_args)`` as one line: the key, Lightning's reason, a fix."""
    if (refusal := missing_gpu(trainer_args)) is not None:
        return refusal
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    reason = (lines[0] if lines else type(err).__name__)[:300]
    key = refused_key(reason)
    fix = "check it against `nanolab fit --help`"
    if key == "trainer.strategy" and "fsdp" in reason.lower():
        fix = "for FSDP2, which runs on a CPU too, add --config configs/strategy/fsdp.yaml"
    return RunConfigError(reason.rstrip("."), field=key, fix=fix)


def gpu_visible(mps: bool = True) -> bool:
    """Whether torch sees a CUDA or ROCm GPU (or, with ``mps``, Apple's: Lightning's ``gpu``
    accelerator takes either, its ``cuda`` only the first)."""
    import torch

    return torch.cuda.is_available() or (mps and torch.backends.mps.is_available())


def torch_build() -> str:
    """``torch 2.13.0 (a CPU-only build)``, ``torch 2.11.0+cu130``: what the error can blame."""
    import torch

    gpu_build = torch.version.cuda is not None or torch.version.hip is not None
    said = gpu_build or torch.__version__.endswith("+cpu")  # the version says which build
    return f"torch {torch.__version__}" + ("" if said else " (a CPU-only build)")
