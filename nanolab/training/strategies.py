"""Distributed strategies that also run on CPU, so the same configs are tested here and on GPUs.

* DDP: Lightning's own (gloo on CPU, NCCL/RCCL on GPUs).
* FSDP2: Lightning's ``ModelParallelStrategy`` calls ``configure_model``, where
  :func:`apply_fsdp2` shards each transformer block and then the root with ``fully_shard``
  (per-parameter DTensor sharding). Unlike Lightning's FSDP1 strategy it runs on CPU.
* DeepSpeed ZeRO 1/2/3: Lightning's ``DeepSpeedStrategy`` refuses any accelerator but CUDA.
  :class:`DeepSpeedStrategy` below lifts only that check; DeepSpeed itself supports CPU (its CPU
  accelerator, gloo/ccl communication, a JIT-built shared-memory op). On GPUs it behaves like
  Lightning's but for one fix: an accumulating run's loss is divided by the accumulation once,
  not twice (:meth:`DeepSpeedStrategy.backward`).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DeepSpeedStrategy as _LightningDeepSpeed
from lightning.pytorch.strategies import ModelParallelStrategy
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


def offloads_optimizer(strategy: Any) -> bool:
    """Whether ``strategy`` runs the optimizer step on offloaded (CPU/NVMe) copies of the weights
    (DeepSpeed ZeRO-Offload); the module must then build DeepSpeed's CPU Adam, because DeepSpeed
    refuses a torch optimizer there."""
    config = getattr(strategy, "config", None)
    if not isinstance(strategy, _LightningDeepSpeed) or not isinstance(config, dict):
        return False
    offload = (config.get("zero_optimization") or {}).get("offload_optimizer") or {}
    return offload.get("device") in ("cpu", "nvme")


class FSDP2Strategy(ModelParallelStrategy):
    """Lightning's ModelParallelStrategy set up for pure FSDP2: shard over every device.

    Lightning's "auto" sizes mean data-parallel across nodes and tensor-parallel within a node;
    nanolab has no tensor parallelism, so here "auto" means one data-parallel (sharding) group of
    the whole world and a tensor-parallel size of 1.
    """

    def __init__(self, save_distributed_checkpoint: bool = False, **kwargs: Any) -> None:
        kwargs.setdefault("data_parallel_size", "auto")
        kwargs.setdefault("tensor_parallel_size", 1)
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint, **kwargs)

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":
            tp = 1 if self._tensor_parallel_size == "auto" else int(self._tensor_parallel_size)
            self._data_parallel_size = self.num_nodes * self.num_processes // tp
            self._tensor_parallel_size = tp
        super().setup_environment()


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

    def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """Lightning has already divided the loss by the accumulation (its automatic
        optimization normalises every micro-batch's loss); DeepSpeed's ``engine.backward``
        divides it again by its ``gradient_accumulation_steps`` unless told not to. With both,
        every gradient of an accumulating run was 1/accumulation of the true one (the clip,
        the logged norm and the update all off by that factor): measured against DDP, the same
        to fp tolerance only once one of the two divisions is left out."""
        kwargs.setdefault("scale_wrt_gas", False)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _auto_select_batch_size(self) -> int:
        # DeepSpeed wants the micro-batch for its own bookkeeping; nanolab's loaders yield whole
        # micro-batches from a sampler (no batch_sampler to read it from), the DataModule knows it.
        dm = getattr(self.lightning_module.trainer, "datamodule", None)
        return int(getattr(dm, "micro_batch_size", 1))

    def _setup_model_and_optimizer(
        self, model: nn.Module, optimizer: Any, lr_scheduler: Any = None
    ) -> tuple[Any, Any]:
        if not isinstance(self.accelerator, CPUAccelerator):
            return super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)
        import deepspeed

        # Lightning passes the CUDA index as DeepSpeed's device rank; a CPU device has none,
        # and DeepSpeed's CPU accelerator wants the local rank there.
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer

    def _initialize_deepspeed_inference(self, model: nn.Module) -> None:
        """``validate``/``test``: Lightning's set-up, with DeepSpeed's device rank given as on
        the training path (it passes the CUDA index, None on a CPU, which DeepSpeed compares
        with an int: a TypeError at every CPU validate or test under DeepSpeed)."""
        if not isinstance(self.accelerator, CPUAccelerator):
            return super()._initialize_deepspeed_inference(model)
        import deepspeed

        initialize = deepspeed.initialize

        def on_this_rank(*args: Any, **kwargs: Any) -> Any:
            kwargs["args"] = argparse.Namespace(device_rank=self.local_rank)
            return initialize(*args, **kwargs)

        deepspeed.initialize = on_this_rank
        try:
            return super()._initialize_deepspeed_inference(model)
        finally:
            deepspeed.initialize = initialize

    def setup_distributed(self) -> None:
        if isinstance(self.accelerator, CPUAccelerator):
            # CPU "devices" have no indices to validate against local ranks.
            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()
        else:
            super().setup_distributed()
