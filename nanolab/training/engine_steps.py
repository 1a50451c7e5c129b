"""What DeepSpeed's engine did with an optimizer step: taken, or skipped for non-finite gradients.

DeepSpeed keeps its (partitioned) gradients outside ``.grad`` and checks them itself: a step
whose gradient norm is not finite is *skipped* (``[deepspeed] OVERFLOW! Skipping step``), the
weights stay as they were, the loss stays finite and the run trains nothing from then on. That
happens in every precision, not only fp16 (its ZeRO optimizers check fp32 and bf16 gradients
too). A reader cannot see it in ``.grad`` (empty) nor always in the engine's reported norm
(``None`` where the engine takes none), so it counts the engine's own ``skipped_steps`` across
the step: a host integer DeepSpeed keeps anyway (no device read is added).

Under fp16 with a dynamic loss scale the skip is the scaler's normal search for its scale, as
with torch's GradScaler; :func:`loss_scale` and :func:`lowest_loss_scale` say where it stands.
DeepSpeed's scaler never goes below its ``min_loss_scale`` (1 by default), so its scale cannot
fall below a floor of 1: the lowest scale is the collapse. At an overflow there its ZeRO
optimizers' scaler raises a bare ``Exception`` ("Current loss scale already at minimum") from
inside the engine's step unless told not to (:func:`raise_at_lowest_scale`): the run then ended
in a traceback, two overflows after a start at the lowest scale, before the divergence stop had
counted its ``patience`` skipped steps.
"""

from __future__ import annotations

from typing import Any

import lightning as L


def deepspeed_engine(trainer: L.Trainer | None) -> Any:
    """The run's DeepSpeed engine (``None`` under another strategy, or before it is built)."""
    strategy = getattr(trainer, "strategy", None) if trainer is not None else None
    return getattr(strategy, "deepspeed_engine", None)


def skipped_steps(engine: Any) -> int | None:
    """The optimizer steps the engine has skipped so far (non-finite gradients); ``None`` where
    it keeps no count. Read before and after a step, an increase means it skipped that step."""
    count = getattr(engine, "skipped_steps", None)
    return count if isinstance(count, int) and not isinstance(count, bool) else None


def scales_loss(engine: Any) -> bool:
    """Whether the engine trains in fp16 with a dynamic loss scale (skips are then its search
    for the scale, not by themselves a sign of divergence)."""
    try:
        return bool(engine.fp16_enabled()) and bool(engine.dynamic_loss_scale())
    except (AttributeError, TypeError):
        return False


def loss_scale(engine: Any) -> float | None:
    """fp16's current dynamic loss scale (a host float in DeepSpeed), or ``None``."""
    if not scales_loss(engine):
        return None
    scale = getattr(getattr(engine, "optimizer", None), "cur_scale", None)
    return float(scale) if isinstance(scale, int | float) and not isinstance(scale, bool) else None


def lowest_loss_scale(engine: Any) -> float | None:
    """The scale DeepSpeed's dynamic scaler stops at (``fp16.min_loss_scale``): an overflow
    there raises inside the engine, so a run of skipped steps that left the scale there has no
    lower scale to try. ``None`` when unknown."""
    if not scales_loss(engine):
        return None
    scaler = getattr(getattr(engine, "optimizer", None), "loss_scaler", None)
    lowest = getattr(scaler, "min_scale", None)
    return (
        float(lowest) if isinstance(lowest, int | float) and not isinstance(lowest, bool) else None
    )


def raise_at_lowest_scale(engine: Any, raises: bool) -> bool:
    """Whether DeepSpeed's fp16 scaler raises at an overflow at its lowest scale (``raises``,
    its own default) or skips that step too and stays there (the divergence stop then counts
    the skips and stops the run in its own words: exit 3, the branch to take). DeepSpeed reads
    it from its ``DynamicLossScaler`` only (no config key sets it); its non-ZeRO fp16 optimizer
    has none and never raises. False when the engine has no such scaler (nothing set)."""
    if not scales_loss(engine):
        return False
    scaler = getattr(getattr(engine, "optimizer", None), "loss_scaler", None)
    if not isinstance(getattr(scaler, "raise_error_at_min_scale", None), bool):
        return False
    scaler.raise_error_at_min_scale = raises
    return True
