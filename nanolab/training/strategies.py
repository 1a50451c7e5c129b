"""Distributed strategies that also run on CPU, so the same configs are tested here and on GPUs.

* DDP: Lightning's own (gloo on CPU, NCCL/RCCL on GPUs).
* FSDP2: Lightning's ``ModelParallelStrategy`` calls ``configure_model``, where
  :func:`apply_fsdp2` shards each transformer block and then the root with ``fully_shard``
  (per-parameter DTensor sharding). Unlike Lightning's FSDP1 strategy it runs on CPU.
* DeepSpeed ZeRO 1/2/3: Lightning's ``DeepSpeedStrategy`` refuses any accelerator but CUDA.
  :class:`DeepSpeedStrategy` below lifts only that check; DeepSpeed itself supports CPU (its CPU
  accelerator, gloo/ccl communication, a JIT-built shared-memory op). On GPUs it behaves exactly
  like Lightning's.
"""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DeepSpeedStrategy as _LightningDeepSpeed
from lightning.pytorch.strategies.ddp import DDPStrategy
from torch import nn


def apply_fsdp2(model: nn.Module, device_mesh: Any) -> None:
    """Shard ``model`` with FSDP2: every block is its own unit (gathered just in time), the
    embedding/head/final norm belong to the root unit (the tied weight stays one parameter)."""
    from torch.distributed.fsdp import fully_shard

    mesh = (
        device_mesh["data_parallel"]
        if "data_parallel" in (device_mesh.mesh_dim_names or ())
        else device_mesh
    )
    for block in model.blocks:  # type: ignore[attr-defined]
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


class DeepSpeedStrategy(_LightningDeepSpeed):
    """Lightning's DeepSpeed strategy, allowed on CPU too (for tests and CPU-only machines)."""

    strategy_name = "nanolab_deepspeed"

    def setup_environment(self) -> None:
        if isinstance(self.accelerator, CPUAccelerator):
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
            # Skip Lightning's CUDA-only check; keep the rest of the environment setup.
            DDPStrategy.setup_environment(self)
        else:
            super().setup_environment()
