"""A parameter's true size and shape, also while ZeRO-3 holds it partitioned.

DeepSpeed's ZeRO-3 replaces every parameter's data with an empty placeholder once the strategy
wraps the model (``numel() == 0``, one dimension): the full size is in ``ds_numel``, the shape
in ``ds_shape``, and this rank's shard in ``ds_tensor``. Counting ``numel()`` there gave a
model of 0 parameters (the banner, the start record's ``num_params``, the FLOPs per token and
so MFU, the scaling fit), and a check over ``p`` looked at nothing. Everything that sizes a
model or reads its values goes through these.
"""

from __future__ import annotations

import torch


def parameter_numel(p: torch.Tensor) -> int:
    """Elements of the whole parameter (ZeRO-3: ``ds_numel``, not its empty placeholder)."""
    full = getattr(p, "ds_numel", None)
    return int(full) if isinstance(full, int) else p.numel()


def parameter_ndim(p: torch.Tensor) -> int:
    """Dimensions of the whole parameter (ZeRO-3: of ``ds_shape``; its placeholder is 1-D)."""
    shape = getattr(p, "ds_shape", None)
    return len(shape) if shape is not None else p.dim()


def local_values(p: torch.Tensor) -> torch.Tensor:
    """The values of ``p`` this rank holds: its shard under ZeRO-3 (``ds_tensor``) or FSDP2
    (a DTensor's local part), else the parameter itself."""
    shard = getattr(p, "ds_tensor", None)
    if isinstance(shard, torch.Tensor):
        return shard
    return p.to_local() if hasattr(p, "to_local") else p
