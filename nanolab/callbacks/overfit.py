"""Train on the same few micro-batches over and over: the "can it overfit?" debugging check.

Lightning's ``trainer.overfit_batches`` replaces the loader's sampler, which nanolab's
step-addressed window sampler does not survive (its batches are a function of the step, not of
an epoch index). This callback keeps the loader as it is and overwrites each micro-batch, in
place, with one of the first ``batches`` it saw, so every optimizer step trains on the same
tokens and the training loss of a working model falls towards zero. Validation is untouched:
its loss rising while the training loss falls is the memorisation the check is for.
``configs/debug/overfit.yaml`` turns it on.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from nanolab.callbacks.events import CallbackConfigError


class OverfitBatches(L.Callback):
    """Replay the first ``batches`` micro-batches for the whole run.

    Args:
        batches: How many distinct micro-batches to cycle through (>= 1).
    """

    def __init__(self, batches: int = 1) -> None:
        if batches < 1:
            raise CallbackConfigError(f"OverfitBatches.batches must be >= 1, got {batches}")
        self.batches = batches
        self._kept: list[tuple[torch.Tensor, ...]] = []
        self._seen = 0

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        tensors = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
        if len(self._kept) < self.batches:
            self._kept.append(tuple(t.detach().clone() for t in tensors))
        else:
            kept = self._kept[self._seen % self.batches]
            with torch.no_grad():
                for target, source in zip(tensors, kept, strict=True):
                    target.copy_(source)
        self._seen += 1
