"""Optimizers by registry name (``adamw``, ``adamw8bit``, ``muon``) and the LR schedule.

An optimizer is one builder function (or ``torch.optim.Optimizer`` subclass) plus one decorator::

    @register_optimizer("lion")
    def build_lion(model, cfg, device):
        return Lion(parameter_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas)

``model.optimizer.name`` accepts exactly the registered names (an unknown one is a one-line
error listing them), so there is no second list to keep in sync. A project installed with a
``nanolab.plugins`` entry point registers its optimizers when a name is first not found
(:mod:`nanolab.installed_plugins`). This module imports no torch:
the estimator and the queue validate configs with it in a fraction of a second.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nanolab.installed_plugins import known_after_plugins
from nanolab.model.config import ConfigError

if TYPE_CHECKING:
    import numpy as np
    import torch
    from torch import nn

    Builder = Callable[[nn.Module, "OptimizerConfig", torch.device], torch.optim.Optimizer]


@dataclass(frozen=True)
class OptimizerSpec:
    """A registered optimizer.

    Attributes:
        name: The ``model.optimizer.name`` that selects it.
        build: ``(model, OptimizerConfig, device) -> torch.optim.Optimizer``.
        shardable: Its update is elementwise, so it runs on FSDP/DeepSpeed shards of a parameter.
            Muon's Newton-Schulz iteration needs each whole matrix, so Muon is not.
        dtensor: It steps FSDP2's shards, which are ``DTensor``s. bitsandbytes' 8-bit kernels
            take plain tensors only ("got mixed torch.Tensor and DTensor" at the first step).
    """

    name: str
    build: Builder
    shardable: bool = True
    dtensor: bool = True


#: Strategy kinds (:func:`nanolab.training.parallelism.parse_strategy`) that shard parameters.
SHARDING_KINDS = ("fsdp1", "fsdp2", "deepspeed")


def strategy_refusal(name: str, kind: str, strategy_label: str | None = None) -> str | None:
    """Why optimizer ``name`` cannot run under a strategy of ``kind``, as the one-line error the
    resolver, the estimator and the optimizer builder all give; ``None`` when it can (or when
    the name is unknown: that has its own error)."""
    spec = registered_optimizer(name)
    label = strategy_label or kind
    if spec is None or kind not in SHARDING_KINDS:
        return None
    if not spec.shardable:
        return (
            f"model.optimizer.name {name!r} needs whole weight matrices on every device, but "
            f"trainer.strategy ({label}) shards them; use trainer.strategy ddp (or auto), or "
            "name adamw"
        )
    if kind == "fsdp2" and not spec.dtensor:
        return (
            f"model.optimizer.name {name!r} cannot step FSDP2's DTensor shards; use "
            "trainer.strategy ddp or deepspeed, or name adamw"
        )
    return None


#: Every optimizer ``model.optimizer.name`` can select, by name.
OPTIMIZERS: dict[str, OptimizerSpec] = {}


def register_optimizer(
    name: str, *, shardable: bool = True, dtensor: bool = True
) -> Callable[[Any], Any]:
    """Class or function decorator: make ``name`` a valid ``model.optimizer.name``.

    A builder function gets ``(model, cfg, device)`` and returns the optimizer. A
    ``torch.optim.Optimizer`` subclass gets :func:`parameter_groups` (decay on matrices only)
    and those of ``lr``, ``betas``, ``eps`` its ``__init__`` accepts.
    """

    def decorate(obj: Any) -> Any:
        build = _class_builder(obj) if inspect.isclass(obj) else obj
        known = OPTIMIZERS.get(name)
        if known is not None and _origin(known.build) != _origin(obj):
            raise ValueError(f"optimizer {name!r} is already registered by {_origin(known.build)}")
        OPTIMIZERS[name] = OptimizerSpec(name, build, shardable, dtensor)
        return obj

    return decorate


def _origin(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}"


def _class_builder(cls: type) -> Builder:
    accepted = inspect.signature(cls).parameters

    def build(model: nn.Module, cfg: OptimizerConfig, device: torch.device):
        kwargs = {"lr": cfg.lr, "betas": cfg.betas, "eps": cfg.eps}
        return cls(
            parameter_groups(model, cfg.weight_decay),
            **{k: v for k, v in kwargs.items() if k in accepted},
        )

    build.__module__, build.__qualname__ = cls.__module__, cls.__qualname__
    return build


def registered_optimizer(name: object) -> OptimizerSpec | None:
    """The optimizer registered as ``name``, or None; a name not registered yet first loads the
    installed projects' ``nanolab.plugins`` entry points (one of which may register it), as
    the model-part registries do. Every lookup by name goes through here."""
    if not known_after_plugins(name, OPTIMIZERS):
        return None
    return OPTIMIZERS[name]  # type: ignore[index]


def optimizer_spec(name: str) -> OptimizerSpec:
    """The registered optimizer ``name``, or a one-line :class:`ConfigError` listing them all."""
    spec = registered_optimizer(name)
    if spec is None:
        raise ConfigError(
            f"model.optimizer.name {name!r} is not a registered optimizer; use one of "
            f"{', '.join(sorted(OPTIMIZERS))} (or register one: docs/optimizers.md)"
        )
    return spec


@dataclass
class OptimizerConfig:
    """Optimizer settings (``model.optimizer``); docs/optimizers.md compares the choices.

    Args:
        name: A registered optimizer: ``adamw`` (torch, fused on CUDA), ``adamw8bit``
            (bitsandbytes: optimizer states in 8 bits, ~75% less optimizer memory; needs
            ``pip install 'nanolab[bnb]'``) or ``muon`` (torch.optim.Muon for the 2-D weights of
            the hidden layers, AdamW with ``lr``/``betas`` for embeddings, head, norms, biases).
        lr: Peak learning rate (of AdamW; with ``muon``, of the AdamW-trained parameters).
        weight_decay: Decoupled weight decay of AdamW, applied only to matrices (>= 2-D: linear
            and embedding weights), never to biases or LayerNorm gains.
        betas: Adam's moment decay rates; (0.9, 0.95) is the GPT-3 / nanoGPT choice.
        eps: Adam's epsilon.
        fused: Use torch's fused AdamW kernel (``adamw``, and ``muon``'s AdamW part; 8-bit AdamW
            has bitsandbytes' own kernels and ignores it); ``null`` = whenever the model is on
            CUDA.
        muon_lr: ``muon`` only: peak learning rate of the hidden matrices (Keller Jordan's
            scaling: each update is orthogonalised, then scaled by ``sqrt(max(1, out/in))``).
        muon_momentum: ``muon`` only: Nesterov momentum of the hidden matrices.
        muon_weight_decay: ``muon`` only: decoupled decay of the hidden matrices per step,
            ``muon_lr * muon_weight_decay`` (0, as in nanochat and the modded-nanogpt records).
    """

    name: str = "adamw"
    lr: float = 6e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    fused: bool | None = None
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.0

    def __post_init__(self) -> None:
        optimizer_spec(self.name)
        for key in ("lr", "muon_lr"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                # NaN passes `lr <= 0`; inf (also YAML's 1e400) trains nothing but NaNs.
                raise ConfigError(
                    f"model.optimizer.{key} must be a finite number > 0 (e.g. "
                    f"{'6e-4' if key == 'lr' else '0.02'}), got {value}"
                )
        for key in ("weight_decay", "muon_weight_decay"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                # NaN passes `< 0` and would make every decayed weight NaN at the first step.
                raise ConfigError(
                    f"model.optimizer.{key} must be a finite number >= 0 (e.g. 0.1), got {value}"
                )
        if not isinstance(self.eps, (int, float)) or not math.isfinite(self.eps) or self.eps <= 0:
            raise ConfigError(
                f"model.optimizer.eps must be a finite number > 0 (e.g. 1e-8), got {self.eps}"
            )
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"model.optimizer.betas must lie in [0, 1), got {self.betas}")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ConfigError(
                f"model.optimizer.muon_momentum must lie in [0, 1), got {self.muon_momentum}"
            )


@dataclass
class ScheduleConfig:
    """Per-step learning rate: linear warmup, then cosine decay to ``min_lr_ratio * lr``.

    Step k (from 1) trains at the multiplier of index k - 1 (:class:`WarmupCosine`), as nanoGPT:
    the first step at ``lr / (warmup_steps + 1)``, not 0, and the last step of a run whose cosine
    ends at ``max_steps`` slightly above the minimum (docs/configs.md).

    Args:
        warmup_steps: Optimizer steps of linear warmup.
        decay_steps: Step index at which the cosine reaches its minimum (held after); ``null`` =
            ``trainer.max_steps``.
        min_lr_ratio: Final learning rate as a fraction of the peak (nanoGPT and Chinchilla: 0.1).
    """

    warmup_steps: int = 100
    decay_steps: int | None = None
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ConfigError(f"model.schedule.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.decay_steps is not None and self.decay_steps < 1:
            raise ConfigError(f"model.schedule.decay_steps must be >= 1, got {self.decay_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(
                f"model.schedule.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}"
            )


@dataclass
class WarmupCosine:
    """LR multiplier at a step; a picklable callable so the scheduler state stays plain data."""

    warmup_steps: int
    decay_steps: int
    min_ratio: float = field(default=0.1)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if step >= self.decay_steps:
            return self.min_ratio
        span = max(1, self.decay_steps - self.warmup_steps)
        progress = (step - self.warmup_steps) / span
        return self.min_ratio + 0.5 * (1.0 - self.min_ratio) * (1.0 + math.cos(math.pi * progress))

    def multipliers(self, steps: int) -> np.ndarray:
        """The multipliers of steps ``0 .. steps - 1`` at once (what ``__call__`` gives each):
        the loss forecast reads a whole planned schedule, up to millions of steps, and a Python
        call per step cost it seconds."""
        import numpy as np  # here: the optimizers' module starts without it

        step = np.arange(steps, dtype=float)
        span = max(1, self.decay_steps - self.warmup_steps)
        progress = (step - self.warmup_steps) / span
        cosine = self.min_ratio + 0.5 * (1.0 - self.min_ratio) * (1.0 + np.cos(np.pi * progress))
        out = np.where(step >= self.decay_steps, self.min_ratio, cosine)
        return np.where(step < self.warmup_steps, (step + 1) / (self.warmup_steps + 1), out)


#: Where the cosine of ``decay_steps: null`` ends when nothing bounds the run in steps
#: (``trainer.max_steps`` -1 and no ``budget.max_tokens``): an arbitrary horizon, which the
#: launch says in a warning (:func:`unplanned_schedule_note`).
UNPLANNED_DECAY_STEPS = 10_000


def lr_schedule(schedule: ScheduleConfig, max_steps: int | None) -> WarmupCosine:
    """The LR multiplier a run planned for ``max_steps`` steps trains with (``decay_steps``
    null: the cosine ends at ``max_steps``, or at :data:`UNPLANNED_DECAY_STEPS` when the run is
    unbounded). One place, so the loss forecast reads the schedule the run really follows."""
    decay_steps = schedule.decay_steps
    if decay_steps is None:
        decay_steps = max_steps if max_steps and max_steps > 0 else UNPLANNED_DECAY_STEPS
    return WarmupCosine(schedule.warmup_steps, decay_steps, schedule.min_lr_ratio)


def planned_steps(trainer: Any, pl_module: Any) -> int:
    """The steps a new run's cosine is planned for: ``trainer.max_steps``, else (-1: a budget
    or a signal stops the run) the steps ``budget.max_tokens`` lets it train, else -1.

    ``trainer.max_steps: -1`` with a token budget used to plan the cosine for 10,000 steps: a
    run the budget stopped sooner never left the LR's peak. (A resume keeps the plan its
    checkpoint holds: the scheduler's state restores it.)"""
    max_steps = int(trainer.max_steps or -1)
    if max_steps > 0:
        return max_steps
    # Asked of the callbacks by name (the training layer imports none of them): the budget
    # answers ``token_steps`` (nanolab.callbacks.budget.CostBudget), a fork's own stop may too.
    for callback in getattr(trainer, "callbacks", None) or ():
        steps_of = getattr(callback, "token_steps", None)
        steps = steps_of(trainer, pl_module) if callable(steps_of) else None
        if steps is not None:
            return int(steps)
    return -1


def unplanned_schedule_note(schedule: ScheduleConfig, planned: int) -> str | None:
    """The warning of a new run whose cosine has no end to plan for (``planned`` -1), or None:
    its ``decay_steps`` is set, a constant rate needs no end (``min_lr_ratio`` 1), or the run
    is bounded."""
    if planned > 0 or schedule.decay_steps is not None or schedule.min_lr_ratio >= 1.0:
        return None
    return (
        f"trainer.max_steps is -1 and no budget.max_tokens bounds the run in steps, so the LR "
        f"cosine has no end to plan for: it decays over {UNPLANNED_DECAY_STEPS:,} steps, "
        "whenever the run stops; set model.schedule.decay_steps (the step where the LR reaches "
        "its minimum), budget.max_tokens or trainer.max_steps, or model.schedule.min_lr_ratio "
        "1.0 for a constant LR after the warm-up"
    )


def parameter_groups(model: nn.Module, weight_decay: float, exclude: Any = ()) -> list[dict]:
    """Two groups: matrices decay, vectors (biases, norm gains) do not. Tied weights appear once.

    ``exclude``: parameters another optimizer owns (Muon's matrices), left out of both groups.
    """
    skip = {id(p) for p in exclude}
    decay, no_decay = [], []
    for p in model.parameters():  # parameters() yields each shared tensor once
        if not p.requires_grad or id(p) in skip:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def hidden_matrices(model: nn.Module) -> list[Any]:
    """The 2-D weights Muon trains: those of ``nn.Linear`` layers, except the output head
    (a module named ``lm_head``) and any weight shared with an embedding (a tied head).

    Embeddings, the head, norms and biases stay with AdamW, as in modded-nanogpt and nanochat:
    orthogonalising an embedding's update (a lookup table, not a linear map) or the head's
    (whose rows are per-token logits) is not what Muon was designed or shown to help.
    """
    from torch import nn

    embedded = {
        id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
    }
    out, seen = [], set()
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or name.split(".")[-1] == "lm_head":
            continue
        p = module.weight
        if p.requires_grad and p.dim() == 2 and id(p) not in embedded and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def build_optimizer(
    model: nn.Module,
    cfg: OptimizerConfig,
    device: torch.device,
    cpu_offload: bool = False,
    sharded: bool = False,
) -> torch.optim.Optimizer:
    """The optimizer ``fit`` trains with, from the registry.

    ``cpu_offload``: DeepSpeed ZeRO-Offload steps it on CPU copies of the weights, where it must
    be DeepSpeed's vectorised CPU AdamW (same update). ``sharded``: FSDP or DeepSpeed hold only
    a shard of each parameter on this device (refused for an optimizer that needs whole ones).
    """
    spec = optimizer_spec(cfg.name)
    if sharded:
        kind = "fsdp2" if _has_dtensors(model) else "deepspeed"
        why = strategy_refusal(cfg.name, kind, "FSDP/DeepSpeed")
        if why:
            raise ConfigError(why)
    if cpu_offload:
        if cfg.name != "adamw":
            raise ConfigError(
                f"model.optimizer.name {cfg.name!r} cannot run with DeepSpeed's optimizer "
                "offload; use 'adamw' (offloaded states already live in CPU memory)"
            )
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        groups = parameter_groups(model, cfg.weight_decay)
        return DeepSpeedCPUAdam(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, adamw_mode=True)
    return spec.build(model, cfg, device)


@register_optimizer("adamw")
def build_adamw(model: nn.Module, cfg: OptimizerConfig, device: torch.device):
    """torch AdamW; the fused CUDA kernel whenever the model is on CUDA (``fused: null``)."""
    import torch

    fused = device.type == "cuda" if cfg.fused is None else cfg.fused
    groups = parameter_groups(model, cfg.weight_decay)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=fused or None)


def _has_dtensors(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


@register_optimizer("adamw8bit", dtensor=False)
def build_adamw8bit(model: nn.Module, cfg: OptimizerConfig, device: torch.device):
    """bitsandbytes AdamW8bit: block-wise 8-bit moments for tensors of >= 4096 elements."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ConfigError(
            "model.optimizer.name 'adamw8bit' needs bitsandbytes: pip install 'nanolab[bnb]'"
        ) from None
    groups = parameter_groups(model, cfg.weight_decay)
    return bnb.optim.AdamW8bit(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)


@register_optimizer("muon", shardable=False)
def build_muon(model: nn.Module, cfg: OptimizerConfig, device: torch.device):
    """torch.optim.Muon for :func:`hidden_matrices`, AdamW for every other parameter."""
    from nanolab.training.muon import MuonWithAdamW

    hidden = hidden_matrices(model)
    fused = device.type == "cuda" if cfg.fused is None else cfg.fused
    return MuonWithAdamW(
        muon_groups=[
            {
                "params": hidden,
                "lr": cfg.muon_lr,
                "momentum": cfg.muon_momentum,
                "weight_decay": cfg.muon_weight_decay,
            }
        ],
        adamw_groups=parameter_groups(model, cfg.weight_decay, exclude=hidden),
        adamw_options={"lr": cfg.lr, "betas": cfg.betas, "eps": cfg.eps, "fused": fused or None},
    )
