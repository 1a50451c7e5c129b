"""Whether every launch of a config scores the same validation windows.

``data.val_windows`` fixes the validation set: the same windows at every evaluation, whatever
the micro-batch or the number of devices. An integer ``trainer.limit_val_batches`` counts
micro-batches per device instead, so it cuts that set at ``limit x micro-batch x devices``
windows: a run at micro-batch 8 (``run.micro_batch_size: auto`` on a smaller GPU) scores half
the windows a run at 16 does, and their val losses, seed groups and tests compare two
different sets without a word. The launch says so once; the fix is a smaller
``data.val_windows`` without the limit.
"""

from __future__ import annotations

from typing import Any


def partial_validation_warning(
    limit_val_batches: Any,
    val_windows: Any,
    micro_batch_size: int,
    world_size: int,
    datasets: int = 1,
) -> str | None:
    """The warning for a batch-count limit that scores fewer windows than ``val_windows``
    (``val_windows`` of each of a mixture's ``datasets``; ``None`` when every window is scored,
    or when either setting is not a count)."""
    if isinstance(limit_val_batches, bool) or not isinstance(limit_val_batches, int):
        return None  # unset, or a fraction: the same share of the windows at any micro-batch
    if isinstance(val_windows, bool) or not isinstance(val_windows, int) or limit_val_batches < 1:
        return None  # a data module without fixed windows, or validation off
    scored, total = limit_val_batches * micro_batch_size * world_size, val_windows * datasets
    if scored >= total:
        return None
    each = f" x {datasets} datasets" if datasets > 1 else ""
    return (
        f"trainer.limit_val_batches {limit_val_batches} scores {scored} of data.val_windows "
        f"{val_windows}{each} validation windows at micro-batch {micro_batch_size} x "
        f"{world_size} device(s): another micro-batch or device count scores other windows, "
        "so their val losses are not comparable with this run's; for one fixed set, set "
        f"data.val_windows {max(1, scored // datasets)} and trainer.limit_val_batches null"
    )
