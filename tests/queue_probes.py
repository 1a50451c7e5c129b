"""Callbacks that queue tests plug into real ``nanolab fit`` jobs (``tests/`` on ``PYTHONPATH``).

Like ``cli_probes``, they stand in for the outside world only, never for nanolab's code.
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch


class OutOfMemoryWhenPacked(L.Callback):
    """Raises PyTorch's out-of-memory error when optimizer step ``step + 1`` begins, but only
    in an attempt the queue started on a shared device (``NANOLAB_QUEUE_PACKED`` set).

    A CPU has no allocator cap to hit, so this is what a packed CUDA job sees when it grows past
    its ``set_per_process_memory_fraction`` cap: the same exception type and message. The same
    job started alone (the variable unset) trains through.
    """

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and os.environ.get("NANOLAB_QUEUE_PACKED"):
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                "139.80 GiB (raised by tests/queue_probes.py: the job's cap, simulated)"
            )
