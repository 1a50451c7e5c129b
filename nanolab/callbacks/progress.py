"""A progress bar over optimizer steps: ETA to ``max_steps``, loss, tokens/s.

Lightning's bar counts micro-batches of an endless loader ("123/?": no ETA) and converts every
progress-bar metric to a Python number at each refresh. This one counts optimizer steps against
``trainer.max_steps``, so tqdm's ETA is the run's, reads the loss only at the refresh interval
(one host sync per refresh, none in between) and takes tokens/s from the shared clock.
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar

from nanolab.callbacks.clock import ClockSnapshot, RunClock
from nanolab.callbacks.events import CallbackConfigError


class StepProgressBar(TQDMProgressBar):
    """tqdm bar over optimizer steps with ETA, loss and tokens/s.

    Args:
        refresh_rate: Optimizer steps between refreshes; 0 hides the bar
            (``trainer.enable_progress_bar: false`` does the same under ``nanolab fit``).
        leave: Keep the finished bar on screen.
        loss_key: The logged training loss shown as ``loss``.
    """

    def __init__(
        self, refresh_rate: int = 10, leave: bool = True, loss_key: str = "train/loss"
    ) -> None:
        if refresh_rate < 0:
            raise CallbackConfigError(f"progress.refresh_rate must be >= 0, got {refresh_rate}")
        super().__init__(refresh_rate=refresh_rate, leave=leave)
        self._refresh_steps = refresh_rate
        self.loss_key = loss_key
        self._clock: RunClock | None = None
        self._last: ClockSnapshot | None = None
        self._shown_step = -1
        self._postfix: dict[str, Any] = {}

    @property
    def refresh_rate(self) -> int:
        return self._refresh_steps

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit":
            self._clock = RunClock.attach(trainer)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if self._clock is not None:
            self._last = self._clock.snapshot()
        self._shown_step = trainer.global_step

    def on_train_epoch_start(self, trainer: L.Trainer, *_: Any) -> None:
        bar = self.train_progress_bar
        bar.reset(total=trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None)
        bar.initial = trainer.global_step
        bar.n = trainer.global_step
        bar.set_description("train")
        bar.refresh()

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        return dict(self._postfix)

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if not self.is_enabled or self.train_progress_bar is None:
            return
        step = trainer.global_step
        last = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        if step == self._shown_step or (step % self.refresh_rate and step != last):
            return
        self._shown_step = step
        from nanolab.callbacks.jsonl import fresh_metrics, to_floats

        if self._clock is not None:
            self._clock.batch_end(trainer, batch)
        waited = time.monotonic()
        metrics = fresh_metrics(trainer, training=True)
        loss = to_floats(
            {self.loss_key: metrics[self.loss_key]} if self.loss_key in metrics else {}
        )
        if self._clock is not None:
            self._clock.add_step_time(time.monotonic() - waited)  # the sync waits for the step
        if loss.get(self.loss_key) is not None:
            self._postfix["loss"] = f"{loss[self.loss_key]:.4f}"
        if self._clock is not None and self._last is not None:
            now = self._clock.snapshot()
            active = now.active_s - self._last.active_s
            if active > 0 and now.tokens > self._last.tokens:
                self._postfix["tok/s"] = f"{(now.tokens - self._last.tokens) / active:,.0f}"
            self._last = now
        bar = self.train_progress_bar
        bar.n = step
        bar.set_postfix(self._postfix, refresh=False)
        bar.refresh()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        value = trainer.callback_metrics.get("val/loss")
        if value is not None and not trainer.sanity_checking:
            self._postfix["val"] = f"{float(value):.4f}"
            bpb = trainer.callback_metrics.get("val/bpb")  # absent for data without byte counts
            if bpb is not None:
                self._postfix["bpb"] = f"{float(bpb):.4f}"
        super().on_validation_end(trainer, pl_module)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.train_progress_bar is not None and not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self._postfix)


def reconcile_progress_bar(cfg: Any) -> None:
    """``trainer.enable_progress_bar: false`` with our bar configured means "hide the bar".

    Lightning refuses a progress-bar callback together with ``enable_progress_bar=False``; under
    ``nanolab fit`` the bar is always configured, so the flag becomes ``progress.refresh_rate: 0``.
    """
    trainer_cfg = cfg.get("trainer") if hasattr(cfg, "get") else None
    progress = cfg.get("progress") if hasattr(cfg, "get") else None
    if trainer_cfg is None or progress is None:
        return
    if trainer_cfg.get("enable_progress_bar") is False:
        progress.refresh_rate = 0
        trainer_cfg.enable_progress_bar = True
