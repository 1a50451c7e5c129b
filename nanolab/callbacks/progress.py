"""Progress over optimizer steps: ETA to the launch's end, loss, tokens/s; plain lines in logs.

Lightning's bar counts micro-batches of an endless loader ("123/?": no ETA), opens a second bar
for every validation, and converts every progress-bar metric to a Python number at each
refresh. This one counts optimizer steps against the step the launch ends at, the banner's
(``trainer.max_steps``, or sooner where a budget stops it: ``~`` for a time or cost limit's
estimate), from the restored step when resuming, with the rate and ETA of the last minutes'
pace (:mod:`.eta`), reads the loss only around the refresh interval, in the step's one host
read shared with the run log
(:mod:`.readout`) and never waiting for it (on a GPU a refresh shows the newest loss already
copied, usually the step before's), takes tokens/s from the shared clock and shows the
validation result in the same bar. Where the output is not a terminal (a queue job's log, a
SLURM file) a bar is a stream of escape codes, and on a terminal of 0 columns (an unsized
pseudo-terminal) tqdm draws nothing, so it prints plain lines instead, at most one per
``plain_every_s`` seconds plus one after every validation and one at the end.
The run starts with a one-screen banner (:mod:`nanolab.callbacks.banner`).
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Literal

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

from nanolab.callbacks.clock import ClockSnapshot
from nanolab.callbacks.eta import RecentStepTime
from nanolab.callbacks.events import CallbackConfigError
from nanolab.callbacks.readout import StepReadout
from nanolab.callbacks.step import StepCallback, validation_follows

if TYPE_CHECKING:
    from nanolab.callbacks.banner import ExpectedEnd

#: The bar's loss in the step readout (:mod:`nanolab.callbacks.readout`).
PROGRESS_KEY = "progress:loss"


def last_step(trainer: L.Trainer) -> int | None:
    """``trainer.max_steps``; None when it has none (-1). The bar's end before the launch's
    expected end is known (:meth:`StepProgressBar.last_step`)."""
    return trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None


def shows_a_bar(stream: Any) -> bool:
    """Whether ``stream`` is a terminal with a width to draw a bar in.

    A pseudo-terminal whose size was never set reports 0 columns (``ssh -tt`` from a script,
    ``docker run -t``, ``srun --pty``, ``script``): tqdm, sizing its bar to the terminal, then
    prints nothing at all, so such a stream gets plain lines, as a file does."""
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(callable(isatty) and isatty() and os.get_terminal_size(stream.fileno())[0])
    except (AttributeError, OSError, ValueError):  # no descriptor, or none that has a size
        return False


class StepProgressBar(StepCallback, TQDMProgressBar):
    """tqdm bar (or plain lines) over optimizer steps with ETA, loss and tokens/s.

    Args:
        refresh_rate: Optimizer steps between refreshes; 0 hides the bar and the lines
            (``trainer.enable_progress_bar: false`` does the same under ``nanolab fit``).
        leave: Keep the finished bar on screen.
        loss_key: The logged training loss shown as ``loss``.
        mode: ``auto`` = a bar on a terminal, plain lines otherwise; ``bar``; ``plain``.
        plain_every_s: Least seconds between two plain lines (validations and the last step
            always get one); 0 = a line at every refresh.
        banner: Print the start banner (model, batch, devices, resume point, estimate).
    """

    def __init__(
        self,
        refresh_rate: int = 10,
        leave: bool = True,
        loss_key: str = "train/loss",
        mode: Literal["auto", "bar", "plain"] = "auto",
        plain_every_s: float = 30.0,
        banner: bool = True,
    ) -> None:
        if refresh_rate < 0:
            raise CallbackConfigError(f"progress.refresh_rate must be >= 0, got {refresh_rate}")
        if mode not in ("auto", "bar", "plain"):
            raise CallbackConfigError(f"progress.mode must be auto, bar or plain, got {mode!r}")
        if plain_every_s < 0:
            raise CallbackConfigError(f"progress.plain_every_s must be >= 0, got {plain_every_s}")
        super().__init__(refresh_rate=refresh_rate, leave=leave)
        self._refresh_steps = refresh_rate
        self.loss_key = loss_key
        self.mode = mode
        self.plain_every_s = plain_every_s
        self.banner = banner
        self._last: ClockSnapshot | None = None
        self._postfix: dict[str, Any] = {}
        self._started: tuple[float, int] | None = None  # (monotonic time, step) at train start
        self._last_line = float("-inf")
        self._loss: tuple[int, float] | None = None  # (step, loss): the newest on the host
        self._loss_keys: tuple[str, ...] = ()
        self._recent = RecentStepTime()  # the ETA's pace: the last minutes', not the launch's
        self._end: ExpectedEnd | None = None  # where this launch ends (set at train start)
        self._end_known = False
        self._end_timed = False  # a time or cost limit's estimate: made again at refreshes

    @property
    def refresh_rate(self) -> int:
        return self._refresh_steps

    @property
    def plain(self) -> bool:
        """Plain lines instead of a bar: asked for, or stdout is not a terminal that can show
        one (:func:`shows_a_bar`)."""
        if self.mode == "auto":
            return not shows_a_bar(sys.stdout)
        return self.mode == "plain"

    @property
    def is_enabled(self) -> bool:  # the tqdm bars; plain lines are printed by this class
        return super().is_enabled and not self.plain

    def _bar(self, desc: str, bar: type[Tqdm] = Tqdm, **kwargs: Any) -> Tqdm:
        return bar(desc=desc, disable=self.is_disabled, dynamic_ncols=True, file=sys.stdout,
                   bar_format=self.BAR_FORMAT, **kwargs)  # fmt: skip

    def last_step(self, trainer: L.Trainer) -> int | None:
        """The step this launch ends at (:func:`~nanolab.callbacks.banner.expected_end`: the
        first of ``trainer.max_steps`` and the budget's stops), None when nothing bounds it.
        A time or cost limit's step is an estimate, made again at each refresh from the step
        time the budget has measured since."""
        if not self._end_known:
            return last_step(trainer)
        return None if self._end is None else self._end.step

    def _total(self, trainer: L.Trainer) -> str:
        """``/400``, ``/~400`` (an estimate), or nothing."""
        if self._end_known and self._end is not None:
            return f"/{self._end.shown}"
        total = last_step(trainer)
        return f"/{total}" if total else ""

    def _find_end(self, trainer: L.Trainer) -> None:
        """Where this launch ends, as the banner says it (a time or cost limit's at the step
        time the budget measured, else the plan's estimate). Asked again at refreshes when
        such a limit ends it: a newer measured step time moves the estimate."""
        from nanolab.callbacks.banner import expected_end

        try:
            end = expected_end(trainer, trainer.lightning_module)
        except Exception:  # a count to show, never in the way of a run: max_steps then
            return
        self._end, self._end_known = end, True
        self._end_timed = self._end_timed or (end is not None and end.estimated)

    def init_train_tqdm(self) -> Tqdm:
        """One bar, counting optimizer steps from the restored step to the launch's end."""
        trainer = self.trainer
        total = self.last_step(trainer)
        step = trainer.global_step
        bar = self._bar("train", RecentPaceTqdm, total=total, initial=step, leave=self._leave,
                        smoothing=0)  # fmt: skip
        bar.recent = self._recent
        return bar

    def init_validation_tqdm(self) -> Tqdm:
        """No second bar during fit: the result goes into the training bar."""
        if self.trainer.state.fn == "fit":
            return Tqdm(disable=True)
        return self._bar("validate", leave=True)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.banner:
            from nanolab.callbacks.banner import print_banner

            print_banner(trainer, pl_module)
        if self.refresh_rate:
            self._find_end(trainer)
        super().on_train_start(trainer, pl_module)
        if self.clock is not None:
            self._last = self.clock.snapshot()
        self._started = (time.monotonic(), trainer.global_step)

    def on_train_epoch_start(self, trainer: L.Trainer, *_: Any) -> None:
        pass  # one endless epoch: the bar made at train start is the bar

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        return dict(self._postfix)

    def _refreshes(self, trainer: L.Trainer, step: int) -> bool:
        if self.refresh_rate == 0 or (not self.plain and self._train_progress_bar is None):
            return False
        last = self.last_step(trainer)
        return not (step % self.refresh_rate and step != last)

    def step_values(
        self, trainer: L.Trainer, pl_module: L.LightningModule, step: int, readout: StepReadout
    ) -> None:
        """The loss goes with the step's one read, never wanted now (but at the last step): a
        GPU's copy arrives a step or more later, so it is put on the step before a refresh too,
        and a refresh shows the newest that has arrived (:meth:`_take_arrived_loss`) without
        making the host wait for the device. A step that validates puts its loss too: its
        plain line, printed after the validation, shows this step's (:meth:`on_validation_end`)."""
        shown_after_validation = self.plain and bool(self.refresh_rate)
        if not (
            self._refreshes(trainer, step)
            or self._refreshes(trainer, step + 1)
            or (shown_after_validation and validation_follows(trainer))
        ):
            return
        from nanolab.callbacks.jsonl import fresh_metrics

        loss = fresh_metrics(trainer, training=True).get(self.loss_key)
        if loss is not None:  # read with the run log's values: no sync of its own
            last = self.last_step(trainer)
            readout.put(PROGRESS_KEY, loss, now=step == last)

    def on_step(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        assert self.clock is not None
        if self.refresh_rate == 0:  # hidden (nanolab bench, enable_progress_bar: false)
            return
        self._take_arrived_loss(self.clock.readout.completed)
        if not self._refreshes(trainer, step):
            return
        self._recent.add(time.monotonic(), step)
        if self._end_timed:  # a time or cost limit's end: at the newest measured pace
            self._find_end(trainer)
        last = self.last_step(trainer)
        self._show_values()
        if self.plain:  # a step that validates gets its line after the validation (with val)
            due = time.monotonic() - self._last_line >= self.plain_every_s
            if step != last and due and not validation_follows(trainer):
                self._print_line(trainer, step)
            return
        bar = self.train_progress_bar
        bar.n = step
        bar.total = last
        bar.set_postfix(self._postfix, refresh=False)
        bar.refresh()

    def _take_arrived_loss(self, arrived: list[tuple[int, dict[str, float]]]) -> None:
        """Keep the newest loss on the host: the bar's own, or the run log's (every step it
        records). On a GPU a copy arrives a step or more after its step, whenever the device
        has finished it, so every step's arrivals are looked at, not only a refresh's."""
        if not self._loss_keys:
            from nanolab.callbacks.jsonl import LOG_KEY

            self._loss_keys = (PROGRESS_KEY, LOG_KEY + self.loss_key)
        for step, values in arrived:  # oldest first
            for key in self._loss_keys:
                if key in values and (self._loss is None or step >= self._loss[0]):
                    self._loss = (step, values[key])

    def _show_values(self) -> None:
        """The newest loss on the host and the tokens/s since the values were last shown."""
        self._show_loss()
        if self._last is not None and self.clock is not None:
            now = self.clock.snapshot()
            active = now.active_s - self._last.active_s
            if active > 0 and now.tokens > self._last.tokens:
                self._postfix["tok/s"] = f"{(now.tokens - self._last.tokens) / active:,.0f}"
            self._last = now

    def _show_loss(self) -> None:
        loss = None if self._loss is None else self._loss[1]
        if loss is not None and math.isfinite(loss):
            self._postfix["loss"] = f"{loss:.4f}"

    def _print_line(self, trainer: L.Trainer, step: int) -> None:
        """``step 100/600 (17%)  loss 2.5432  val 2.5401  13,512 tok/s  0m35s, ETA 2m55s``."""
        if not trainer.is_global_zero:
            return
        from nanolab.callbacks.banner import duration

        self._last_line = time.monotonic()
        total = self.last_step(trainer)
        text = f"step {step}{self._total(trainer)}"
        text += f" ({step / total:.0%})" if total else ""
        for key in ("loss", "val", "bpb"):
            if key in self._postfix:
                text += f"  {key} {self._postfix[key]}"
        if "tok/s" in self._postfix:
            text += f"  {self._postfix['tok/s']} tok/s"
        if self._started is not None:
            elapsed = time.monotonic() - self._started[0]
            done = step - self._started[1]
            text += f"  {duration(elapsed)}"
            eta = self._recent.eta_s(step, total) if total else None
            if eta is None and total and done > 0:  # before two refreshes: the launch's pace
                eta = elapsed / done * (total - step)
            if eta is not None and step < total:
                text += f", ETA {duration(eta)}"
        print(text, flush=True)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        value = trainer.callback_metrics.get("val/loss")
        if value is not None and not trainer.sanity_checking:
            self._postfix["val"] = f"{float(value):.4f}"
            bpb = trainer.callback_metrics.get("val/bpb")  # absent for data without byte counts
            if bpb is not None:
                self._postfix["bpb"] = f"{float(bpb):.4f}"
            last = self.last_step(trainer)
            fitting, step = trainer.state.fn == "fit", trainer.global_step
            # A stopping run's last validation: its line is the end's (on_train_end), once.
            stopping = step == last or trainer.should_stop
            if self.plain and fitting and self.refresh_rate and not stopping:
                if self.clock is not None:  # this step's loss and rate, not the last refresh's
                    self._take_arrived_loss(self.clock.readout.drain())  # validation synced
                    self._show_values()
                self._print_line(trainer, step)
        super().on_validation_end(trainer, pl_module)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._train_progress_bar is not None and not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self._postfix)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.plain and self.refresh_rate:
            if self.clock is not None:  # a run stopped early: its last steps' losses in flight
                self._take_arrived_loss(self.clock.readout.drain())
                self._show_loss()
            self._print_line(trainer, trainer.global_step)
        if self._train_progress_bar is not None:
            self.train_progress_bar.close()


class RecentPaceTqdm(Tqdm):
    """The training bar: its rate and ETA are the recent pace (:mod:`nanolab.callbacks.eta`),
    not tqdm's average since the bar opened (the compile included, every slowdown lagging)."""

    recent: RecentStepTime | None = None

    @property
    def format_dict(self) -> dict[str, Any]:
        values = super().format_dict
        rate = self.recent.steps_per_second() if self.recent is not None else None
        if rate:
            values["rate"] = rate
        return values


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
