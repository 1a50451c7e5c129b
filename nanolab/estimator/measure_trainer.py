"""Ground truth from a real ``L.Trainer``: the peak bytes ``nanolab fit`` allocates on a CPU.

The estimator's claims are about the step order Lightning really runs (``training_step``,
``zero_grad``, backward, optimizer step, with the module's own hooks), so the reference is a real
Trainer fitting :class:`~nanolab.training.module.GPTLightningModule`, not a hand-written loop. The
profiler's ``[memory]`` events count from ``on_train_start`` on, after Lightning has set the model
up (a ``*-true`` precision casts it there; the profiler cannot see frees of blocks allocated
before it started); their running maximum plus the parameters and buffers resident then is what
``torch.cuda.max_memory_allocated`` would report on a GPU. Used by the tests and
``benches/bench_memory.py``; imports torch and Lightning.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nanolab.estimator.measure import allocation_peak, storage_bytes
from nanolab.model.config import GPTConfig

if TYPE_CHECKING:
    import lightning as L


@dataclass
class TrainerPeak:
    """Peak allocated bytes of a CPU ``fit`` and what was resident when training started."""

    peak: int
    resident_at_start: int


def measure_trainer_peak_cpu(
    gpt: GPTConfig,
    micro_batch: int,
    *,
    precision: str = "32-true",
    optimizer: str = "adamw",
    accumulate: int = 1,
    steps: int = 3,
    module_cls: type | None = None,
    seed: int = 0,
) -> TrainerPeak:
    """Fit ``GPTLightningModule(gpt)`` for ``steps`` optimizer steps on CPU; return its peak.

    ``module_cls`` replaces the LightningModule class (a subclass, e.g. to compare another
    ``zero_grad`` placement). Three steps: the first creates the optimizer states, the second
    and third run with everything a long run holds.
    """
    from lightning.pytorch.callbacks import Callback
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    resident = [0]

    class _Profile(Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            # Objects of an earlier fit freed during this one would count as negative events.
            gc.collect()
            resident[0] = storage_bytes(list(pl_module.parameters()) + list(pl_module.buffers()))
            prof.start()

        def on_train_end(self, trainer, pl_module) -> None:
            prof.stop()

    _fit(
        "cpu",
        _Profile(),
        gpt,
        micro_batch,
        precision,
        optimizer,
        accumulate,
        steps,
        seed,
        module_cls,
    )
    return TrainerPeak(peak=resident[0] + allocation_peak(prof), resident_at_start=resident[0])


@dataclass
class TrainerPeakCuda:
    """What one CUDA/ROCm device held during a ``fit``, for calibrating the overhead lines."""

    peak_allocated: int  # torch.cuda.max_memory_allocated
    peak_reserved: int  # torch.cuda.max_memory_reserved: allocated + the caching allocator's slack
    outside_allocator: int  # device memory in use that PyTorch's allocator does not hold


def measure_trainer_peak_cuda(
    gpt: GPTConfig,
    micro_batch: int,
    *,
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    accumulate: int = 1,
    steps: int = 3,
    seed: int = 0,
) -> TrainerPeakCuda:
    """Fit ``GPTLightningModule(gpt)`` on one GPU; the peak Lightning's step really reaches.

    The statistics are reset at ``on_train_start`` (the model is on the device by then) and read
    at ``on_train_end``. ``outside_allocator`` is what ``cudaMemGetInfo`` says is used minus
    what the allocator reserved: the CUDA/ROCm context, kernels and library workspaces that the
    estimator's framework-overhead constant stands for.
    """
    from lightning.pytorch.callbacks import Callback

    seen: dict[str, int] = {}

    class _Stats(Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

        def on_train_end(self, trainer, pl_module) -> None:
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            seen["allocated"] = torch.cuda.max_memory_allocated()
            seen["reserved"] = torch.cuda.max_memory_reserved()
            seen["outside"] = total - free - torch.cuda.memory_reserved()

    _fit("gpu", _Stats(), gpt, micro_batch, precision, optimizer, accumulate, steps, seed)
    return TrainerPeakCuda(seen["allocated"], seen["reserved"], seen["outside"])


def _fit(
    accelerator: str,
    callback: L.Callback,
    gpt: GPTConfig,
    micro_batch: int,
    precision: str,
    optimizer: str,
    accumulate: int,
    steps: int,
    seed: int,
    module_cls: type | None = None,
) -> None:
    """Fit the module on ``steps`` optimizer steps of random tokens with a bare one-device
    Trainer: no logger, checkpoints, validation, bar or summary, so what ``callback`` measures
    is the training step alone (with the recipes' gradient clipping)."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from nanolab.training.module import GPTLightningModule
    from nanolab.training.optim import OptimizerConfig

    torch.manual_seed(seed)
    module = (module_cls or GPTLightningModule)(gpt=gpt, optimizer=OptimizerConfig(name=optimizer))
    g = torch.Generator().manual_seed(seed)
    shape = (micro_batch * accumulate * steps, gpt.block_size)
    x = torch.randint(0, gpt.vocab_size or 2, shape, generator=g)
    y = torch.randint(0, gpt.vocab_size or 2, shape, generator=g)
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=1,
        precision=precision,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        # Clipped as the recipes are: with a fused optimizer clipping takes its own path
        # (nanolab/training/fused_amp.py), which a measurement must run too.
        gradient_clip_val=1.0,
        callbacks=[callback],
    )
    trainer.fit(module, train_dataloaders=DataLoader(TensorDataset(x, y), batch_size=micro_batch))
