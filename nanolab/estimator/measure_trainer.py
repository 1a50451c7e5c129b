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
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from nanolab.estimator.measure import allocation_peak, memory_events, storage_bytes
from nanolab.model.config import GPTConfig

#: A Lightning Trainer that only trains: no logger, checkpoints, progress bar, model summary or
#: validation. What a measurement of training alone runs (here, and ``nanolab bench --floor``).
BARE_TRAINER: dict[str, Any] = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
    "limit_val_batches": 0,
}

if TYPE_CHECKING:
    import lightning as L


@dataclass
class TrainerPeak:
    """Peak allocated bytes of a CPU ``fit`` and what was resident when training started."""

    peak: int
    resident_at_start: int
    phases: dict[str, int] = field(default_factory=dict)  # PhasePeaks: where the peak is


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
    fused: bool | None = None,
) -> TrainerPeak:
    """Fit ``GPTLightningModule(gpt)`` for ``steps`` optimizer steps on CPU; return its peak
    and the peak of each phase of the step (:class:`PhasePeaks`, fed by replaying the
    profiler's events at the moments the step's hooks ran).

    ``module_cls`` replaces the LightningModule class (a subclass, e.g. to compare another
    ``zero_grad`` placement); ``fused`` is ``model.optimizer.fused`` (``None``: torch's choice
    for the CPU, not fused). Three steps: the first creates the optimizer states, the second
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

    hooks = _HookLog()
    _fit(
        "cpu",
        [_Profile(), phase_peaks_callback(hooks)],  # type: ignore[arg-type]
        gpt,
        micro_batch,
        precision,
        optimizer,
        accumulate,
        steps,
        seed,
        module_cls,
        fused,
    )
    replay = _ReplayedAllocator(memory_events(prof), resident[0])
    phases = PhasePeaks(replay)
    for at_ns, hook, args in hooks.calls:
        replay.advance(at_ns)
        getattr(phases, hook)(*args)
    return TrainerPeak(
        peak=resident[0] + allocation_peak(prof),
        resident_at_start=resident[0],
        phases=phases.summary(),
    )


class _HookLog:
    """Stands in for :class:`PhasePeaks` during a profiled CPU fit: notes each call and its
    time (the profiler's events are only readable once it stops), for a real
    :class:`PhasePeaks` to replay over :class:`_ReplayedAllocator` afterwards."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str, tuple[Any, ...]]] = []

    def __getattr__(self, hook: str) -> Any:
        return lambda *args: self.calls.append((time.time_ns(), hook, args))


class _ReplayedAllocator:
    """The four allocator statistics :class:`PhasePeaks` reads from ``torch.cuda``, for a CPU:
    the running sum of the profiler's ``[memory]`` events (plus what was resident at the
    start) up to the moment :meth:`advance` reached. A CPU has no caching allocator, so what
    is reserved is what is allocated."""

    def __init__(self, events: list[tuple[int, int]], resident: int) -> None:
        self._events = events
        self._next = 0
        self._allocated = self._peak = resident

    def advance(self, at_ns: int) -> None:
        while self._next < len(self._events) and self._events[self._next][0] <= at_ns:
            self._allocated += self._events[self._next][1]
            self._peak = max(self._peak, self._allocated)
            self._next += 1

    def memory_allocated(self) -> int:
        return self._allocated

    def max_memory_allocated(self) -> int:
        return self._peak

    def max_memory_reserved(self) -> int:
        return self._peak

    def reset_peak_memory_stats(self) -> None:
        self._peak = self._allocated


@dataclass
class TrainerPeakCuda:
    """What one CUDA/ROCm device held during a ``fit``, for calibrating the overhead lines."""

    peak_allocated: int  # torch.cuda.max_memory_allocated
    peak_reserved: int  # torch.cuda.max_memory_reserved: allocated + the caching allocator's slack
    outside_allocator: int  # device memory in use that PyTorch's allocator does not hold
    phases: dict[str, int] = field(default_factory=dict)  # PhasePeaks: where the peak is


class PhasePeaks:
    """Where in a training step the device's peak is reached: the peak of each phase of the
    step (forward, backward, between backward and the optimizer, optimizer step), the largest
    over the steps after the first (which creates the optimizer states), and what is allocated
    at the forward's end. The estimator names the phase it predicts the peak in; a measured
    peak elsewhere says which of its lines is wrong.

    Resetting the allocator's peak at each phase loses the fit's overall peaks, so they are kept
    here (``overall_allocated``, ``overall_reserved``, every step included). ``memory`` is the
    device's allocator statistics: ``torch.cuda`` (``memory_allocated``, ``max_memory_allocated``,
    ``max_memory_reserved``, ``reset_peak_memory_stats``), or anything with those four. Fed by
    the step's hooks through :func:`phase_peaks_callback`."""

    ORDER = ("forward", "backward", "before_step", "optimizer_step")

    def __init__(self, memory: Any) -> None:
        self.memory = memory
        self.peaks: dict[str, int] = {}
        self.at_forward_end = 0
        self.overall_allocated = 0
        self.overall_reserved = 0
        self._counting = False

    def _close(self, phase: str | None) -> None:
        peak = self.memory.max_memory_allocated()
        self.overall_allocated = max(self.overall_allocated, peak)
        self.overall_reserved = max(self.overall_reserved, self.memory.max_memory_reserved())
        if phase is not None and self._counting:
            self.peaks[phase] = max(self.peaks.get(phase, 0), peak)
        self.memory.reset_peak_memory_stats()

    def batch_start(self, global_step: int) -> None:
        self._close(None)  # what came before the batch (the data transfer) counts overall only
        self._counting = global_step >= 1

    def before_backward(self) -> None:
        if self._counting:
            self.at_forward_end = max(self.at_forward_end, self.memory.memory_allocated())
        self._close("forward")

    def after_backward(self) -> None:
        self._close("backward")

    def before_optimizer_step(self) -> None:
        self._close("before_step")

    def batch_end(self, stepped: bool) -> None:
        if stepped:
            self._close("optimizer_step")

    def summary(self) -> dict[str, int]:
        """Each phase's peak in step order, and ``at_forward_end``."""
        out = {p: self.peaks[p] for p in self.ORDER if p in self.peaks}
        if out:
            out["at_forward_end"] = self.at_forward_end
        return out


def phase_peaks_callback(phases: PhasePeaks) -> L.Callback:
    """A Lightning Callback that feeds :class:`PhasePeaks` from the step's own hooks."""
    from lightning.pytorch.callbacks import Callback

    class _Phases(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._step_before = trainer.global_step
            phases.batch_start(trainer.global_step)

        def on_before_backward(self, trainer, pl_module, loss) -> None:
            phases.before_backward()

        def on_after_backward(self, trainer, pl_module) -> None:
            phases.after_backward()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            phases.before_optimizer_step()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            phases.batch_end(trainer.global_step > self._step_before)

        def on_train_end(self, trainer, pl_module) -> None:
            phases._close(None)

    return _Phases()


def measure_trainer_peak_cuda(
    gpt: GPTConfig,
    micro_batch: int,
    *,
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    accumulate: int = 1,
    steps: int = 3,
    seed: int = 0,
    fused: bool | None = None,
    memory: Any = None,
    accelerator: str = "gpu",
) -> TrainerPeakCuda:
    """Fit ``GPTLightningModule(gpt)`` on one GPU; the peak Lightning's step really reaches.

    The statistics are reset at ``on_train_start`` (the model is on the device by then) and
    the peaks kept per phase of the step (:class:`PhasePeaks`) to the end. ``outside_allocator``
    is what ``cudaMemGetInfo`` says is used minus what the allocator reserved: the CUDA/ROCm
    context, kernels and library workspaces that the estimator's framework-overhead constant
    stands for. ``fused`` is ``model.optimizer.fused`` (``None``: torch's choice, fused on a
    GPU): the optimizer measured must be the one predicted.

    ``memory`` (default ``torch.cuda``) is what the statistics, syncs and ``mem_get_info`` are
    read from, and ``accelerator`` the Trainer's: a stand-in (:class:`NoDeviceMemory`) and
    ``"cpu"`` run this same code on a machine without CUDA, as the tests and the GPU check's
    dry run do.
    """
    from lightning.pytorch.callbacks import Callback

    memory = torch.cuda if memory is None else memory
    seen: dict[str, int] = {}

    class _Stats(Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            gc.collect()
            memory.synchronize()
            memory.reset_peak_memory_stats()

        def on_train_end(self, trainer, pl_module) -> None:
            memory.synchronize()
            free, total = memory.mem_get_info()
            seen["outside"] = total - free - memory.memory_reserved()

    phases = PhasePeaks(memory)
    callbacks = [_Stats(), phase_peaks_callback(phases)]
    _fit(
        accelerator, callbacks, gpt, micro_batch, precision, optimizer, accumulate, steps, seed,
        fused=fused,
    )  # fmt: skip
    return TrainerPeakCuda(
        phases.overall_allocated, phases.overall_reserved, seen["outside"], phases.summary()
    )


class NoDeviceMemory:
    """``torch.cuda``'s allocator statistics, syncs and ``mem_get_info`` for a machine without
    CUDA: nothing is ever allocated, and the syncs do nothing. With it,
    :func:`measure_trainer_peak_cuda` runs its whole fit on a CPU (its numbers are all zero: the
    CPU's real peak is :func:`measure_trainer_peak_cpu`'s)."""

    total = 1 << 30  # what mem_get_info says the device has (all of it free)

    def synchronize(self) -> None:
        pass

    def reset_peak_memory_stats(self) -> None:
        pass

    def memory_allocated(self) -> int:
        return 0

    def max_memory_allocated(self) -> int:
        return 0

    def max_memory_reserved(self) -> int:
        return 0

    def memory_reserved(self) -> int:
        return 0

    def mem_get_info(self) -> tuple[int, int]:
        return self.total, self.total


def _fit(
    accelerator: str,
    callback: L.Callback | list[L.Callback],
    gpt: GPTConfig,
    micro_batch: int,
    precision: str,
    optimizer: str,
    accumulate: int,
    steps: int,
    seed: int,
    module_cls: type | None = None,
    fused: bool | None = None,
) -> None:
    """Fit the module on ``steps`` optimizer steps of random tokens with a bare one-device
    Trainer: no logger, checkpoints, validation, bar or summary, so what ``callback`` measures
    is the training step alone (with the recipes' gradient clipping)."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from nanolab.training.module import GPTLightningModule
    from nanolab.training.optim import OptimizerConfig

    torch.manual_seed(seed)
    opt = OptimizerConfig(name=optimizer, fused=fused)
    module = (module_cls or GPTLightningModule)(gpt=gpt, optimizer=opt)
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
        **BARE_TRAINER,
        # Clipped as the recipes are: with a fused optimizer clipping takes its own path
        # (nanolab/training/fused_amp.py), which a measurement must run too.
        gradient_clip_val=1.0,
        callbacks=callback if isinstance(callback, list) else [callback],
    )
    trainer.fit(module, train_dataloaders=DataLoader(TensorDataset(x, y), batch_size=micro_batch))
