"""Masked targets (``y = -1``): declared by the data module, paid for only where declared.

A forked data module may mask targets (a chat prompt, padding: ``y = -1`` carries no loss). Its
micro-batches then hold different numbers of targets, and the mean of micro-batch means that a
plain step takes weighs a target by how few shared its micro-batch: micro-batch 8 would not be
micro-batch 4 x accumulation 2. :class:`~nanolab.training.module.GPTLightningModule` averages a
step over its targets instead, which costs every micro-batch a count and every optimizer step an
all-reduce of counts and a multiply over the gradients. nanolab's own data never masks, so the
module takes that path only for a data module that says its batches may mask: a class (or
instance) attribute ``masked_targets = True``, read once per fit (:func:`declares_masked_targets`).

A module that masks without saying so still trains, each micro-batch's mean counting the same;
:func:`holds_masked_targets` spots its masks on the host, before a batch moves to the device,
and the fit warns once (:func:`undeclared_masks_line`).
"""

from __future__ import annotations

from typing import Any

import torch

from nanolab.host_buffer import mark_host_buffer
from nanolab.model.gpt import IGNORE_INDEX

#: The data module attribute that declares masked targets (``False`` on nanolab's own).
DECLARATION = "masked_targets"


def declares_masked_targets(datamodule: Any) -> bool:
    """Whether ``datamodule`` (None: dataloaders given without one) says its batches may hold
    targets of ``-1``."""
    return bool(getattr(datamodule, DECLARATION, False))


def masked_targets_problem(datamodule: Any, strategy_kind: str) -> str | None:
    """Why a fit of ``datamodule`` cannot train under ``strategy_kind``, or None.

    DeepSpeed's engine clips and steps its own gradients, outside ``.grad``: the step's
    gradient scale (its target slots over its targets) has nowhere to go, and its gradients
    would be a mean of micro-batch means while ``train/loss`` says a mean over targets (23% off
    in one 2-step check with 7 of 8 targets masked)."""
    if strategy_kind.startswith("deepspeed") and declares_masked_targets(datamodule):
        return (
            f"{type(datamodule).__name__} declares {DECLARATION} and trainer.strategy is "
            "DeepSpeed, whose engine steps gradients nanolab cannot average over the step's "
            "targets; train it with ddp or fsdp (strategy/ddp.yaml, strategy/fsdp.yaml)"
        )
    return None


def worth_a_look(datamodule: Any) -> bool:
    """Whether the training batches of ``datamodule``, which does not declare masked targets,
    are looked at for them (:func:`holds_masked_targets`, once per micro-batch until found).
    nanolab's own token data module reads ids from a token file, never ``-1``: its batches are
    not looked at (a subclass of it, a fork's, is)."""
    from nanolab.data.datamodule import TokenDataModule

    return type(datamodule) is not TokenDataModule


def target_count(targets: torch.Tensor) -> torch.Tensor:
    """How many of ``targets`` carry a loss (are not :data:`IGNORE_INDEX`): an int64 scalar on
    their device, so weighting a loss by it adds no host sync."""
    return (targets != IGNORE_INDEX).sum()


def loss_or_zero(loss: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``loss``, or 0 for a batch whose :func:`target_count` ``count`` is 0.

    Cross-entropy over no target is 0/0, a NaN that would poison a whole validation and read as
    a diverged model; 0, weighted by its count of 0, adds nothing, and its gradient is 0 (the
    loss's backward writes only to targets that carry a loss). A NaN of the model itself still
    comes through, and where a target carries a loss the value and its gradient are the loss's
    to the bit (``torch.where`` selects, it does not round). Two elementwise ops on a scalar."""
    return torch.where(count > 0, loss, torch.zeros_like(loss))


def no_loss_as_nan(value: torch.Tensor, count: torch.Tensor | None) -> torch.Tensor:
    """``value`` (a step's loss), or NaN where its optimizer step held no target at all
    (``count``, the step's :func:`target_count` over all ranks, is 0; ``None``: not counted,
    data without declared masks).

    Such a step has no loss: its gradients are 0, and the 0 its micro-batches add up to is not
    a loss of the model (a spike guard's median of them would be 0). As NaN it is written as
    null by the run log, not shown by the progress bar, and left out by the spike guard, which
    takes only finite losses. The divergence stop watches the micro-batches' own losses (0
    here) and asks :func:`held_no_target` to leave the step out. One elementwise op on the
    device: no host sync."""
    if count is None:
        return value
    nan = torch.full_like(value, float("nan"))
    return torch.where(count.to(value.device) > 0, value, nan)


def held_no_target(module: Any) -> torch.Tensor | None:
    """1.0 (a float32 device scalar) when the optimizer step that ended last held no target
    (the module's ``step_target_count`` is 0), else 0.0; ``None`` when the module does not
    count them (no declared masks, or not nanolab's module)."""
    count = getattr(module, "step_target_count", None)
    return (count == 0).to(torch.float32) if isinstance(count, torch.Tensor) else None


def holds_masked_targets(batch: Any) -> bool:
    """Whether a training batch ``(x, y, ...)`` holds a target of ``-1``, judged on the host.

    Only a ``y`` in host memory is read (the batch before it moves to the device): one min over
    it, ~15 us at 16 x 1024 int64 ids, no device sync. A ``y`` already on a device, or a batch of
    another shape, is not read: False. (A target below ``-1`` is an error of its own, which the
    loss reports.)"""
    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
        return False
    targets = batch[1]
    if not isinstance(targets, torch.Tensor) or targets.device.type != "cpu":
        return False
    if targets.numel() == 0 or targets.is_floating_point():
        return False
    # Host memory that no copy writes: reading it never waits for a device (nanolab's sync
    # counter would count it on a CPU run, where every tensor looks like a device's).
    return bool(mark_host_buffer(targets.min() == IGNORE_INDEX))


def undeclared_masks_line(datamodule: Any) -> str:
    """The warning for masks found in the batches of a data module that did not declare them."""
    if datamodule is None:
        found = "the training batches hold masked targets (y = -1) but come from no data module"
        fix = f"serve them from a LightningDataModule with {DECLARATION} = True"
    else:
        name = f"{type(datamodule).__module__}.{type(datamodule).__qualname__}"
        found = f"{name}'s training batches hold masked targets (y = -1) it does not declare"
        fix = f"set {DECLARATION} = True on {name}"
    return (
        f"{found}; {fix}, so each optimizer step averages its loss and gradient over its "
        "targets (micro-batch 8 = 4 x accumulation 2) and a micro-batch whose targets are all "
        "-1 adds 0 instead of NaN"
    )
