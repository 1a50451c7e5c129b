"""Masked targets (``y = -1``): declared by the data module, paid for only where declared.

A forked data module may mask targets (a chat prompt, padding: ``y = -1`` carries no loss). Its
micro-batches then hold different numbers of targets, and the mean of micro-batch means that a
plain step takes weighs a target by how few shared its micro-batch: micro-batch 8 would not be
micro-batch 4 x accumulation 2. :class:`~nanolab.training.module.GPTLightningModule` averages a
step over its targets instead, which costs every micro-batch a count and every optimizer step an
all-reduce of counts and a multiply over the gradients. nanolab's own data never masks, so the
module takes that path only for a data module that says its batches may mask: a class (or
instance) attribute ``masked_targets = True``, read once per fit (:func:`declares_masked_targets`).
A module that masks without saying so still trains, each micro-batch's mean counting the same.
"""

from __future__ import annotations

from typing import Any

import torch

from nanolab.model.gpt import IGNORE_INDEX

#: The data module attribute that declares masked targets (``False`` on nanolab's own).
DECLARATION = "masked_targets"


def declares_masked_targets(datamodule: Any) -> bool:
    """Whether ``datamodule`` (None: dataloaders given without one) says its batches may hold
    targets of ``-1``."""
    return bool(getattr(datamodule, DECLARATION, False))


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
