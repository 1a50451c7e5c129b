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
    the GPU recipes say ``accelerator: gpu``, and their data may not exist on this machine.
    Also a multi-node run started without a multi-node launch (:func:`lone_multinode`), and
    a bf16 precision on a CUDA GPU that has no bf16 (:func:`bf16_unsupported`)."""
    for refusal in (missing_gpu(trainer_args), lone_multinode(trainer_args)):
        if refusal is not None:
            raise refusal
    if (refusal := bf16_unsupported(trainer_args)) is not None:
        raise refusal


def bf16_unsupported(trainer_args: Mapping[str, Any], cuda: Any = None) -> RunConfigError | None:
    """The refusal of ``trainer.precision`` ``bf16-mixed``/``bf16-true`` where the run lands on
    a CUDA GPU without bf16 in hardware (before Ampere: V100, T4), or None.

    torch emulates bf16 there (``is_bf16_supported()`` says yes by default): the run would start
    and train many times slower than fp16, or fail in a kernel that has no bf16 on that card.
    Every GPU the run will use is checked (:func:`gpus_used`), not GPU 0: on a host with a V100
    at 0 and an A100 at 1, ``devices: [1]`` runs and ``devices: [0]`` is refused naming the V100.
    ``cuda``: the ``torch.cuda`` to ask (a test's stand-in)."""
    from nanolab.training.resolve import precision_name

    precision = trainer_args.get("precision")
    if precision is None or not precision_name(precision).startswith("bf16"):
        return None
    if str(trainer_args.get("accelerator") or "auto") not in ("auto", "gpu", "cuda"):
        return None  # a CPU run has bf16 autocast; Apple's MPS is not CUDA
    if cuda is None:
        import torch

        cuda = torch.cuda
    if not cuda.is_available():
        return None
    lacking = [i for i in gpus_used(trainer_args.get("devices"), cuda) if not _has_bf16(cuda, i)]
    if not lacking:
        return None
    index = lacking[0]
    major, minor = cuda.get_device_capability(index)
    name = precision_name(precision)
    fix = "use --trainer.precision 16-mixed (fp16 with loss scaling) or 32-true on this GPU"
    if capable := [i for i in range(cuda.device_count()) if _has_bf16(cuda, i)]:
        fix += f", or --trainer.devices '{capable}' (the GPUs here with bf16)"
    return RunConfigError(
        f"{name} needs a GPU with bf16 (Ampere or newer, compute capability 8.0), and "
        f"{cuda.get_device_name(index)} (GPU {index}, compute capability {major}.{minor}) "
        "has none",
        field="trainer.precision",
        fix=fix,
    )


def gpus_used(devices: Any, cuda: Any) -> list[int]:
    """The indices of the GPUs ``trainer.devices`` puts the run on, read as the Trainer's
    documented forms read (``auto``/``-1``: every visible GPU; ``N``: the first N; ``[1]`` or
    ``"1,"``: those), against ``cuda.device_count()``. A value the Trainer will refuse itself
    (a GPU ``cuda`` does not have, a malformed or repeated list, 0) gives none here: its own
    refusal speaks for it once the Trainer is built. Parsed here, not by Lightning's private
    device-parsing helpers, so a Lightning upgrade that moves them cannot break the check."""
    count = cuda.device_count()
    if devices is None or str(devices).strip() in ("auto", "-1"):
        return list(range(count))
    ids = _listed_devices(devices)
    if not ids or len(set(ids)) != len(ids) or not all(0 <= i < count for i in ids):
        return []  # none, a repeat, or a GPU this host does not have: the Trainer names it
    return ids


def _listed_devices(devices: Any) -> list[int]:
    """``trainer.devices`` as GPU indices, before they are held against the GPUs there: a list
    or tuple of ints as it is, an int N as the first N, a string as the int or comma-separated
    ints it spells (``"1,"``: GPU 1; ``"2"``: the first two); [] for anything else."""
    if isinstance(devices, str):
        text = devices.strip()
        try:
            if "," in text:
                return [int(part.strip()) for part in devices.split(",") if len(part) > 0]
            devices = int(text)
        except ValueError:
            return []
    if isinstance(devices, (list, tuple)):
        return list(devices) if all(type(i) is int for i in devices) else []
    if type(devices) is int and devices > 0:
        return list(range(devices))
    return []


def _has_bf16(cuda: Any, index: int) -> bool:
    """Whether GPU ``index`` computes in bf16 itself, not by torch's emulation: compute
    capability 8.0 or newer, the test torch's ``is_bf16_supported(including_emulation=False)``
    makes of the current GPU only (the GPUs ROCm supports report 9.0 and newer)."""
    return tuple(cuda.get_device_capability(index)) >= (8, 0)


#: The variables of a hand-made multi-node launch (Lightning's general-purpose cluster: each
#: machine runs the command with these set), beside the launchers Lightning detects itself.
MANUAL_MULTINODE_VARS = ("MASTER_ADDR", "NODE_RANK", "GROUP_RANK")


def multinode_launcher(env: Mapping[str, str] | None = None) -> str | None:
    """The multi-node launch this process is part of (``torchrun``, ``SLURM``, ...), or None.

    Lightning's own detectors decide, as they do when the Trainer picks its cluster
    environment; a launch by hand counts when it sets :data:`MANUAL_MULTINODE_VARS`."""
    import contextlib
    import os
    from unittest import mock

    from lightning.fabric.plugins import environments as envs

    if any((os.environ if env is None else env).get(n) for n in MANUAL_MULTINODE_VARS):
        return "MASTER_ADDR/NODE_RANK"
    detectors = (
        ("torchrun", envs.TorchElasticEnvironment),
        ("SLURM", envs.SLURMEnvironment),
        ("MPI", envs.MPIEnvironment),
        ("LSF", envs.LSFEnvironment),
        ("Kubeflow", envs.KubeflowEnvironment),
    )
    given = (
        contextlib.nullcontext() if env is None else mock.patch.dict(os.environ, env, clear=True)
    )
    with given:  # the detectors read os.environ; a test gives its own
        for name, kind in detectors:
            try:
                if kind.detect():
                    return name
            except Exception:  # MPI's detector needs mpi4py: absent means no MPI launch
                continue
    return None


def lone_multinode(
    trainer_args: Mapping[str, Any], env: Mapping[str, str] | None = None
) -> RunConfigError | None:
    """The refusal of ``trainer.num_nodes`` > 1 in a process no multi-node launcher started:
    its first rank would wait for the other machines' ranks for ever (blocked in the
    rendezvous, where a Ctrl-C or SIGTERM is not even handled)."""
    nodes = trainer_args.get("num_nodes") or 1
    if not isinstance(nodes, int) or nodes <= 1 or multinode_launcher(env) is not None:
        return None
    return RunConfigError(
        f"{nodes} machines, but no multi-node launch started this process (no torchrun, "
        "SLURM, MPI or LSF, nor MASTER_ADDR/NODE_RANK set), so it would wait for the other "
        "machines for ever",
        field="trainer.num_nodes",
        fix="on one machine set --trainer.num_nodes 1; across machines start the same command "
        "on each with torchrun or srun (docs/scaling.md)",
    )


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
