"""Stop a run whose loss or gradient norm stays non-finite: a diverged run trains nothing.

Once the loss is NaN or infinite (a learning rate far too high, an fp16 overflow, a bad batch
that poisoned the weights) every later step is wasted GPU time, and without a check the run
ends "completed" hours later with NaN checkpoints. :class:`DivergenceStop` counts consecutive
optimizer steps whose loss (any micro-batch of the step) or global gradient norm is not finite;
at ``patience`` of them it stops the run: the ``end`` record says ``diverged`` (with the first
bad step in ``diverged_step``), ``nanolab fit`` exits with :data:`EXIT_DIVERGED`, and the
checkpoint callback never saves non-finite weights, so the newest checkpoint on disk is the last
finite one.

Cost: the flags stay on the device; under DDP/FSDP they are all-reduced on the device (so every
rank stops at the same step) and copied to pinned host memory without blocking. Each step reads
the previous step's flag, which the device has finished by then, so the check adds no host-device
synchronisation (on CPU it is read at once). The gradient norm is one fused pass over the
gradients per optimizer step.

Under fp16 with a GradScaler, non-finite gradients are how the scaler finds its scale: it skips
those steps by design, so there only the loss counts.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from nanolab.callbacks.events import CallbackConfigError, set_stop_reason
from nanolab.callbacks.jsonl import gradient_norm
from nanolab.callbacks.step import StepCallback

#: Exit status of ``nanolab fit`` when this callback stopped the run. Not 2 (bad input) and not
#: 75 (preempted, rerun me): rerunning a diverged run as it is diverges again.
EXIT_DIVERGED = 3

#: The reason string of the ``end`` record.
REASON = "diverged"


class DivergenceStop(StepCallback):
    """Stops the run after ``patience`` consecutive optimizer steps with a non-finite loss or
    gradient norm (see the module docstring).

    Its step hooks run after the budget's (a budget stop at the same step wins) and before the
    preemption handler's and the checkpoint's.

    Args:
        enabled: Check every optimizer step. Off = a diverged run trains on to ``max_steps``.
        patience: Consecutive non-finite optimizer steps that stop the run (1 = the first).
        check_grad_norm: Also count a non-finite global gradient norm (not under fp16's
            GradScaler, which skips such steps itself).
    """

    step_order = 50

    def __init__(self, enabled: bool = True, patience: int = 3, check_grad_norm: bool = True):
        super().__init__()
        if not isinstance(patience, int) or patience < 1:
            raise CallbackConfigError(f"divergence.patience must be >= 1, got {patience!r}")
        self.enabled = enabled
        self.patience = patience
        self.check_grad_norm = check_grad_norm
        self.streak = 0
        self.first_bad_step: int | None = None
        self.diverged_step: int | None = None  # first step of the streak that stopped the run
        self._step_bad: torch.Tensor | None = None  # this optimizer step, on the device
        self._params: list[torch.nn.Parameter] | None = None
        self._in_flight: list[tuple[int, torch.Tensor, Any]] = []
        self._host: list[torch.Tensor] = []

    # -- hooks -------------------------------------------------------------------------------
    def is_active(self, stage: str) -> bool:
        return self.enabled and stage == "fit"

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._params = None

    def on_run_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.streak, self.first_bad_step, self._step_bad = 0, None, None

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if not self.active or not self.check_grad_norm or _grad_scaler(trainer) is not None:
            return
        if self._params is None:
            self._params = list(pl_module.parameters())
        norm = gradient_norm(pl_module, self._params)
        if norm is not None:
            self._mark(~torch.isfinite(norm.detach().float()))

    def on_micro_batch(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self._mark(~torch.isfinite(loss.detach().float()).all())

    def on_step(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        bad, self._step_bad = self._step_bad, None
        if bad is None:
            bad = torch.zeros((), dtype=torch.bool, device=pl_module.device)
        self._submit(trainer, step, bad)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.active:
            self._drain(trainer, keep=0)

    # -- bookkeeping -------------------------------------------------------------------------
    def _mark(self, bad: torch.Tensor) -> None:
        self._step_bad = bad if self._step_bad is None else self._step_bad | bad

    def _submit(self, trainer: L.Trainer, step: int, bad: torch.Tensor) -> None:
        """Agree across ranks on the device, then read it now (CPU) or at the next step."""
        flag = bad.to(torch.float32).reshape(())
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if trainer.world_size > 1 and distributed:
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if flag.device.type != "cuda":
            self._observe(trainer, step, bool(flag.item()))
            return
        self._drain(trainer, keep=1)  # the previous step's flag: finished on the device by now
        if len(self._host) < 2:
            self._host = [torch.zeros((), pin_memory=True) for _ in range(2)]
        host = self._host[step % 2]
        host.copy_(flag, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._in_flight.append((step, host, event))

    def _drain(self, trainer: L.Trainer, keep: int) -> None:
        while len(self._in_flight) > keep:
            step, host, event = self._in_flight.pop(0)
            event.synchronize()
            self._observe(trainer, step, bool(host.item()))

    def _observe(self, trainer: L.Trainer, step: int, bad: bool) -> None:
        if not bad:
            self.streak, self.first_bad_step = 0, None
            return
        self.streak += 1
        if self.first_bad_step is None:
            self.first_bad_step = step
        if self.streak >= self.patience and self.diverged_step is None:
            self.diverged_step = self.first_bad_step
            set_stop_reason(trainer, REASON, self.describe())

    def describe(self) -> str:
        """One sentence for the end record and the exit message."""
        steps = (
            f"step {self.diverged_step}"
            if self.patience == 1
            else f"{self.patience} consecutive optimizer steps from step {self.diverged_step}"
        )
        return f"loss or gradient norm not finite (NaN/inf) for {steps}"

    def record_fields(self, trainer: L.Trainer, event: str) -> dict[str, Any]:
        if event == "end" and self.diverged_step is not None:
            return {"diverged_step": self.diverged_step}
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}  # a resumed run starts from a finite checkpoint: nothing to carry


def _grad_scaler(trainer: L.Trainer) -> Any:
    """fp16's GradScaler when one is active (None for fp32/bf16)."""
    plugin = getattr(trainer, "precision_plugin", None)
    return getattr(plugin, "scaler", None)


def diverged(trainer: L.Trainer | None) -> DivergenceStop | None:
    """The run's divergence callback if it stopped the run, else None."""
    if trainer is None:
        return None
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, DivergenceStop) and callback.diverged_step is not None:
            return callback
    return None
