"""One clock for every callback: wall time, time inside training steps, pauses, tokens.

Goodput, GPU-hours, tokens/s and the budget all divide or compare the same few quantities; if each
callback timed itself they would disagree (and each would pay for its own bookkeeping). So one
:class:`RunClock` per Trainer measures them and the other callbacks read it. It is itself a
callback (its totals travel in checkpoints, so GPU-hours and tokens add up across resumes), attached
on demand by :meth:`RunClock.attach` from the other callbacks' ``setup``.

What is measured, without any device synchronisation per step:

* wall time from when nanolab's code started in this process (start-up, imports and data
  preparation are paid for too; time the process spent as a shell before it exec'd into nanolab
  is not);
* *step time*: ``on_train_batch_start`` -> ``on_train_batch_end`` of every micro-batch, plus the
  time a host sync later spends waiting for the device to finish queued step work (the run log's
  once-per-record ``.item()``, the device sync before a checkpoint);
* *pauses*: evaluation, downstream tasks, checkpointing and logging, attributed to the innermost one when nested;
* *data wait*: from the end of one step (or pause) to the start of the next step, outside
  pauses: fetching the next batch plus the loop's own bookkeeping, so an upper bound on the time
  spent waiting for data (it is what a slow DataLoader would inflate);
* tokens and samples over all ranks, counted per micro-batch (so accumulation is included).

It also tells the step callbacks (:mod:`nanolab.callbacks.step`) whether the micro-batch that just
ended finished an optimizer step, and which of them reaches an event first.

Goodput = step time / wall time, summed over every process of the run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from nanolab.callbacks.devices import launch_setup
from nanolab.callbacks.readout import StepReadout, defer_from_env, lag_from_env

PAUSE_KINDS = ("eval", "tasks", "checkpoint", "log")


_launch_counted = False


def launch_start_monotonic() -> float:
    """When this run's time starts: nanolab's first import for the first run of a process.

    Not the process start time: under ``sh -c 'pip install ... && exec nanolab fit'`` that is
    when the shell started, and the setup before the exec was never the run's time. Only the
    first run of a process gets the start-up: a second run in the same process (a notebook, a
    test session) starts when its clock does, not when nanolab was imported an hour earlier.
    """
    global _launch_counted
    now = time.monotonic()
    if _launch_counted:
        return now
    _launch_counted = True
    import nanolab

    return min(now, float(getattr(nanolab, "STARTED_MONOTONIC", now)))


@dataclass(frozen=True)
class ClockSnapshot:
    """Counters at one instant, for rates over an interval (see :meth:`RunClock.snapshot`)."""

    monotonic: float
    active_s: float  # this process: wall time minus pauses
    step_s: float  # this process
    tokens: int  # whole run
    samples: int  # whole run
    global_step: int


def _batch_shape(batch: Any) -> tuple[int, int]:
    """(samples, tokens) of one micro-batch on this rank: the first tensor's batch size and numel."""
    tensor = batch
    while not isinstance(tensor, torch.Tensor):
        if isinstance(tensor, (list, tuple)) and tensor:
            tensor = tensor[0]
        elif isinstance(tensor, dict) and tensor:
            tensor = next(iter(tensor.values()))
        else:
            return 0, 0
    if tensor.dim() == 0:
        return 1, 1
    return int(tensor.shape[0]), int(tensor.numel())


class RunClock(Callback):
    """The run's single timing and token-counting source (see the module docstring)."""

    def __init__(self) -> None:
        self.start_monotonic = launch_start_monotonic()
        self.world_size = 1
        # Totals of earlier processes of this run (restored from the checkpoint / run log).
        self.before_elapsed_s = 0.0
        self.before_gpu_hours = 0.0
        self.before_step_s = 0.0
        #: Earlier processes' active training seconds and wall-time split (None: restored from
        #: a checkpoint of a nanolab that did not keep them, so the run's are unknown).
        self.before_train_active_s: float | None = 0.0
        self.before_parts: dict[str, float] | None = {}
        #: The setup (:func:`launch_setup`) the earlier processes' active time was measured on
        #: (None: no earlier process, or a run that began a new one from another's checkpoint).
        self.before_setup: dict[str, Any] | None = None
        # This process.
        self.this_launch_setup: dict[str, Any] | None = None  # from its start of training
        self._train_active_from: float | None = None  # its active seconds when training began
        self.step_s = 0.0
        self.pauses = dict.fromkeys(PAUSE_KINDS, 0.0)
        self.tokens = 0
        self.samples = 0
        # The model's tokens when this run started from another run's checkpoint (0 for a run
        # of its own from scratch): what it trained on before this run, on other data perhaps.
        self.inherited_tokens = 0
        #: Set before a launch that starts a new run from another run's checkpoint.
        self.forked = False
        self._trainer: L.Trainer | None = None
        self._batch_start: float | None = None
        self._batch_shape = (0, 0)
        self._marked_batches = -1  # value of batch_progress.total.processed last counted
        self._frozen_at: float | None = None
        self._stack: list[str] = []
        self._segment_start = 0.0
        self.data_wait_s = 0.0
        self._gap_from: float | None = None  # end of the last step or pause, outside pauses
        self._step_at_batch_start = -1
        self._validations = 0  # evaluations started (sanity check included)
        self._claimed: dict[str, int] = {}  # event -> occurrence already handed out
        self._per_step: dict[str, tuple[int, Any]] = {}  # once_per_step: key -> (step, value)
        # The step callbacks' one read per step.
        self.readout = StepReadout(defer_from_env(), lag_from_env())

    # -- attaching ---------------------------------------------------------------------------
    @classmethod
    def attach(cls, trainer: L.Trainer) -> RunClock:
        """The Trainer's clock, appended to its callbacks on first use."""
        callbacks = trainer.callbacks  # type: ignore[attr-defined]
        clock = next((c for c in callbacks if isinstance(c, cls)), None)
        if clock is None:
            clock = cls()
            callbacks.append(clock)
        clock._bind(trainer)
        return clock

    def _bind(self, trainer: L.Trainer) -> None:
        self._trainer = trainer
        self.world_size = max(1, int(trainer.world_size))
        self._claimed = {}  # a new stage: every event is new

    # -- events of the step callbacks ------------------------------------------------------
    def step_finished(self, trainer: L.Trainer) -> bool:
        """Whether the micro-batch that just ended completed an optimizer step."""
        return int(trainer.global_step) != self._step_at_batch_start

    def first_call(self, event: str, trainer: L.Trainer) -> bool:
        """True for the first caller per occurrence of ``event`` (``start``, ``batch`` or
        ``validation``), so exactly one step callback hands it to the others."""
        if event == "batch":
            occurrence = int(trainer.fit_loop.epoch_loop.batch_progress.total.processed)
        elif event == "validation":
            occurrence = self._validations
        else:
            occurrence = 0  # once per stage (claims are reset when the clock is bound)
        if self._claimed.get(event) == occurrence:
            return False
        self._claimed[event] = occurrence
        return True

    def once_per_step(self, key: str, step: int, compute: Callable[[], Any]) -> Any:
        """``compute()`` for the first caller of ``key`` in optimizer step ``step``, the same
        value for the others (the run log and the divergence stop read one gradient norm)."""
        held = self._per_step.get(key)
        if held is not None and held[0] == step:
            return held[1]
        value = compute()
        self._per_step[key] = (step, value)
        return value

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._bind(trainer)

    # -- reading -----------------------------------------------------------------------------
    def now(self) -> float:
        """The clock's reading of ``time.monotonic()`` (pinned inside :meth:`frozen`)."""
        return self._frozen_at if self._frozen_at is not None else time.monotonic()

    @contextmanager
    def frozen(self) -> Iterator[None]:
        """Every reading inside is taken at the same instant, so one record is consistent."""
        outer = self._frozen_at
        self._frozen_at = outer if outer is not None else time.monotonic()
        try:
            yield
        finally:
            self._frozen_at = outer

    def process_elapsed_s(self) -> float:
        return self.now() - self.start_monotonic

    def elapsed_s(self) -> float:
        """Wall seconds of the whole run (every process, start-up included)."""
        return self.before_elapsed_s + self.process_elapsed_s()

    def gpu_hours(self) -> float:
        """Devices x wall hours of the whole run."""
        return self.before_gpu_hours + self.world_size * self.process_elapsed_s() / 3600.0

    def total_step_s(self) -> float:
        return self.before_step_s + self.step_s

    def goodput(self) -> float:
        """Fraction of the run's wall time spent inside training steps, in [0, 1]."""
        elapsed = self.elapsed_s()
        return 0.0 if elapsed <= 0 else min(1.0, max(0.0, self.total_step_s() / elapsed))

    def paused_s(self) -> float:
        total = sum(self.pauses.values())
        if self._stack:
            total += max(0.0, self.now() - self._segment_start)
        return total

    def snapshot(self) -> ClockSnapshot:
        trainer = self._trainer
        return ClockSnapshot(
            monotonic=self.now(),
            active_s=self.process_elapsed_s() - self.paused_s(),
            step_s=self.step_s,
            tokens=self.tokens,
            samples=self.samples,
            global_step=int(trainer.global_step) if trainer is not None else 0,
        )

    def _parts(self) -> dict[str, float]:
        """This process's step, data-wait and pause seconds."""
        return {
            "step_s": self.step_s,
            "data_wait_s": self.data_wait_s,
            **{f"{k}_s": v for k, v in self.pauses.items()},
        }

    def breakdown(self) -> dict[str, float]:
        """This process's wall time split into step, pauses and the rest (data waits, start-up)."""
        parts = self._parts()
        parts["other_s"] = max(0.0, self.process_elapsed_s() - sum(parts.values()))
        return {k: round(v, 3) for k, v in parts.items()}

    def run_breakdown(self) -> dict[str, float] | None:
        """The whole run's wall time (:meth:`elapsed_s`, every process) split as
        :meth:`breakdown` splits this process's: the earlier processes' parts (kept in the
        checkpoint, so up to its save) plus this one's; ``other_s`` is the rest: start-ups, and
        what an earlier process spent after its last save (its final validation, or steps a
        crash lost). None: restored from a checkpoint that did not keep the parts."""
        if self.before_parts is None:
            return None
        parts = self._parts()
        for key, value in self.before_parts.items():
            if key != "other_s" and key in parts:
                parts[key] += value
        parts["other_s"] = max(0.0, self.elapsed_s() - sum(parts.values()))
        return {k: round(v, 3) for k, v in parts.items()}

    def end_totals(self) -> dict[str, Any]:
        """The ``end`` record's ``time_breakdown`` and what it (and ``tokens_per_s``, ``mfu``)
        covers: ``totals_of`` ``run`` (every launch of the run, from the checkpoint), or
        ``this launch`` when it resumed from an older nanolab's checkpoint, which did not keep
        the earlier launches' times or their setup, or when the launches trained on different
        setups (:meth:`on_train_start`): one rate over them would describe none."""
        whole = self.run_breakdown()
        if whole is None or self.train_active_s() is None:
            return {"time_breakdown": self.breakdown(), "totals_of": "this launch"}
        return {"time_breakdown": whole, "totals_of": "run"}

    def train_active_s(self) -> float | None:
        """Active seconds (wall minus pauses) the whole run has trained, from each process's
        start of training (its start-up left out): the denominator of the run's tokens/s.
        None: restored from a checkpoint that did not keep the earlier processes'."""
        if self.before_train_active_s is None:
            return None
        return self.before_train_active_s + self.launch_train_active_s()

    def launch_train_active_s(self) -> float:
        """Active seconds this process has trained, from its start of training: the
        denominator of this launch's own tokens/s (0 before training starts)."""
        if self._train_active_from is None:
            return 0.0
        here = self.process_elapsed_s() - self.paused_s() - self._train_active_from
        return max(0.0, here)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._train_active_from is None:
            self._train_active_from = self.process_elapsed_s() - self.paused_s()
        self.this_launch_setup = launch_setup(trainer)
        if self.before_setup is not None and self.before_setup != self.this_launch_setup:
            # Another precision, device layout or GPU than the earlier launches': their time
            # and this launch's measure different rates, so the run's totals are unknown from
            # here on (the checkpoints this launch saves say so to the next launch too).
            self.before_train_active_s, self.before_parts = None, None

    # -- marking -----------------------------------------------------------------------------
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_start = time.monotonic()
        self._batch_shape = _batch_shape(batch)
        self._step_at_batch_start = int(trainer.global_step)
        if self._gap_from is not None and not self._stack:
            self.data_wait_s += self._batch_start - self._gap_from
        self._gap_from = None

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.batch_end(trainer, batch)

    def batch_end(self, trainer: L.Trainer, batch: Any = None) -> None:
        """Count the micro-batch that just finished (idempotent: every callback may call it first).

        The step callbacks call this before their step work (saving, logging), so that work is
        not counted as step time whatever the order of the callbacks.
        """
        processed = int(trainer.fit_loop.epoch_loop.batch_progress.total.processed)
        if processed == self._marked_batches:
            return
        self._marked_batches = processed
        if self._batch_start is not None:
            now = time.monotonic()
            self.step_s += now - self._batch_start
            self._batch_start = None
            self._gap_from = now
        samples, tokens = self._batch_shape if batch is None else _batch_shape(batch)
        self.samples += samples * self.world_size
        self.tokens += tokens * self.world_size

    @contextmanager
    def device_wait(self) -> Iterator[None]:
        """Time inside is the host waiting for queued step work (a ``.item()``, a sync): it is
        counted as step time, not as the pause or the logging that follows."""
        start = time.monotonic()
        try:
            yield
        finally:
            self.step_s += max(0.0, time.monotonic() - start)

    def sync_device(self, trainer: L.Trainer) -> None:
        """Wait for queued device work (counted as step time) so a pause that follows is honest."""
        device = trainer.strategy.root_device
        if device.type == "cuda":
            with self.device_wait():
                torch.cuda.synchronize(device)

    @contextmanager
    def pause(self, kind: str) -> Iterator[None]:
        """Time spent inside is a ``kind`` pause (nested pauses count for the innermost only)."""
        if kind not in self.pauses:
            raise ValueError(f"unknown pause kind {kind!r}; one of {PAUSE_KINDS}")
        self.begin_pause(kind)
        try:
            yield
        finally:
            self.end_pause(kind)

    def begin_pause(self, kind: str) -> None:
        now = time.monotonic()
        if self._stack:
            self.pauses[self._stack[-1]] += now - self._segment_start
        elif self._gap_from is not None:
            self.data_wait_s += now - self._gap_from  # the gap up to the pause
            self._gap_from = now
        self._stack.append(kind)
        self._segment_start = now

    def end_pause(self, kind: str) -> None:
        if kind not in self._stack:
            return
        now = time.monotonic()
        self.pauses[self._stack[-1]] += now - self._segment_start
        # Pop up to and including ``kind`` (an exception may have skipped an inner end).
        while self._stack and self._stack.pop() != kind:
            pass
        self._segment_start = now
        if not self._stack and self._gap_from is not None:
            self._gap_from = now  # the pause's time is the pause's, not the data's

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._validations += 1
        self.sync_device(trainer)
        self.begin_pause("eval")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.end_pause("eval")

    # -- resume ------------------------------------------------------------------------------
    @property
    def run_tokens(self) -> int:
        """Tokens this run trained on (all ranks), leaving out what the model had before a run
        started from another run's checkpoint."""
        return max(0, self.tokens - self.inherited_tokens)

    def start_new_run(self) -> None:
        """A new run that starts from another run's checkpoint: its wall time, step time and
        GPU-hours (and so its budget and cost) count from zero; the tokens and samples the
        model has trained on are kept (they are the model's, and a scaling fit's D)."""
        self.before_elapsed_s = self.before_gpu_hours = self.before_step_s = 0.0
        self.before_train_active_s, self.before_parts = 0.0, {}
        self.before_setup = None
        self.inherited_tokens = self.tokens

    def account_earlier(self, elapsed_s: float, gpu_hours: float, step_s: float) -> None:
        """Raise the earlier processes' totals to at least these (from the run log).

        A checkpoint only knows the time up to its save; the run log also knows the minutes a
        crashed or preempted process trained after its last checkpoint. They were paid for, so
        they count against the budget and in GPU-hours.
        """
        self.before_elapsed_s = max(self.before_elapsed_s, float(elapsed_s))
        self.before_gpu_hours = max(self.before_gpu_hours, float(gpu_hours))
        self.before_step_s = max(self.before_step_s, float(step_s))

    def state_dict(self) -> dict[str, Any]:
        if self._trainer is not None and self._trainer.training:
            # A save from inside on_train_batch_end must include the batch that just finished.
            processed = int(self._trainer.fit_loop.epoch_loop.batch_progress.total.processed)
            started = int(self._trainer.fit_loop.epoch_loop.batch_progress.total.started)
            if processed == started and processed != self._marked_batches:
                self.batch_end(self._trainer)
        return {
            "elapsed_s": self.elapsed_s(),
            "gpu_hours": self.gpu_hours(),
            "step_s": self.total_step_s(),
            "tokens": self.tokens,
            "samples": self.samples,
            "inherited_tokens": self.inherited_tokens,
            "train_active_s": self.train_active_s(),
            "time_breakdown": self.run_breakdown(),
            # What train_active_s was measured on (this launch's; an earlier one's before
            # training starts): a resume on another setup does not add its time to it.
            "setup": self.this_launch_setup or self.before_setup,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.before_elapsed_s = float(state_dict.get("elapsed_s", 0.0))
        self.before_gpu_hours = float(state_dict.get("gpu_hours", 0.0))
        self.before_step_s = float(state_dict.get("step_s", 0.0))
        self.tokens = int(state_dict.get("tokens", 0))
        self.samples = int(state_dict.get("samples", 0))
        self.inherited_tokens = (
            self.tokens if self.forked else int(state_dict.get("inherited_tokens", 0))
        )
        active, parts = state_dict.get("train_active_s"), state_dict.get("time_breakdown")
        setup = state_dict.get("setup")
        if isinstance(active, (int, float)) and isinstance(parts, dict) and isinstance(setup, dict):
            self.before_train_active_s = float(active)
            self.before_parts = {
                k: float(v) for k, v in parts.items() if isinstance(v, (int, float))
            }
            self.before_setup = setup
        else:  # an older nanolab's checkpoint: the earlier launches' split or setup is unknown
            self.before_train_active_s, self.before_parts, self.before_setup = None, None, None
