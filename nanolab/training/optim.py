"""Optimizer and learning-rate schedule: AdamW (or 8-bit AdamW), linear warmup, cosine decay."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from nanolab.model.config import ConfigError

OptimizerName = Literal["adamw", "adamw8bit"]


@dataclass
class OptimizerConfig:
    """AdamW settings.

    Args:
        name: ``adamw`` (torch, fused on CUDA) or ``adamw8bit`` (bitsandbytes: optimizer states
            in 8 bits, ~75% less optimizer memory; needs ``pip install 'nanolab[bnb]'``).
        lr: Peak learning rate, reached at the end of warmup.
        weight_decay: Decoupled weight decay, applied only to matrices (>= 2-D: linear and
            embedding weights), never to biases or LayerNorm gains.
        betas: Adam's moment decay rates; (0.9, 0.95) is the GPT-3 / nanoGPT choice.
        eps: Adam's epsilon.
        fused: Use the fused CUDA kernel; ``null`` = whenever the model is on CUDA.
    """

    name: OptimizerName = "adamw"
    lr: float = 6e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    fused: bool | None = None

    def __post_init__(self) -> None:
        if self.name not in ("adamw", "adamw8bit"):
            raise ConfigError(
                f"model.optimizer.name must be 'adamw' or 'adamw8bit', got {self.name!r}"
            )
        if not isinstance(self.lr, (int, float)) or not math.isfinite(self.lr) or self.lr <= 0:
            # NaN passes `lr <= 0`; inf (also YAML's 1e400) trains nothing but NaNs.
            raise ConfigError(
                f"model.optimizer.lr must be a finite number > 0 (e.g. 6e-4), got {self.lr}"
            )
        if self.weight_decay < 0:
            raise ConfigError(f"model.optimizer.weight_decay must be >= 0, got {self.weight_decay}")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"model.optimizer.betas must lie in [0, 1), got {self.betas}")


@dataclass
class ScheduleConfig:
    """Per-step learning rate: linear warmup from 0, then cosine decay to ``min_lr_ratio * lr``.

    Args:
        warmup_steps: Optimizer steps of linear warmup.
        decay_steps: Step at which the cosine reaches its minimum (held after); ``null`` =
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


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: matrices decay, vectors (biases, norm gains) do not. Tied weights appear once."""
    decay, no_decay = [], []
    for p in model.parameters():  # parameters() yields each shared tensor once
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(
    model: nn.Module, cfg: OptimizerConfig, device: torch.device, cpu_offload: bool = False
) -> torch.optim.Optimizer:
    """The optimizer ``fit`` trains with. ``cpu_offload``: DeepSpeed ZeRO-Offload steps it on CPU
    copies of the weights, where it must be DeepSpeed's vectorised CPU AdamW (same update)."""
    groups = parameter_groups(model, cfg.weight_decay)
    if cpu_offload:
        if cfg.name != "adamw":
            raise ConfigError(
                f"model.optimizer.name {cfg.name!r} cannot run with DeepSpeed's optimizer "
                "offload; use 'adamw' (offloaded states already live in CPU memory)"
            )
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, adamw_mode=True)
    if cfg.name == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise ConfigError(
                "model.optimizer.name 'adamw8bit' needs bitsandbytes: pip install 'nanolab[bnb]'"
            ) from None
        return bnb.optim.AdamW8bit(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    fused = device.type == "cuda" if cfg.fused is None else cfg.fused
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=fused or None)
