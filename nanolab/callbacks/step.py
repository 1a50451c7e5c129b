"""The base of every step-driven nanolab callback: the run started, a step finished, an evaluation ended.

Lightning calls ``on_train_batch_end`` after every *micro*-batch. A callback that acts per
optimizer step (log a record, save, check a budget, refresh a bar, stop on a signal) has to tell a
finished step from an accumulating micro-batch, count the micro-batch on the shared clock before
doing slow work, and — when it writes records, saves or stops the run — act before or after the
others in an order that does not depend on where it sits in ``trainer.callbacks``.
:class:`StepCallback` does all three once, so a subclass says only what it does:

* :meth:`~StepCallback.on_run_start` — training starts in this process (a restored checkpoint
  is already loaded);
* :meth:`~StepCallback.on_micro_batch` — after every micro-batch, before ``on_step``;
* :meth:`~StepCallback.step_values` — a step finished: put the device scalars to read (one
  transfer for all the callbacks, :mod:`nanolab.callbacks.readout`), before any ``on_step``; the
  place to log a metric for the step (``pl_module.log``): the callbacks that read the logged
  metrics (:attr:`~StepCallback.reads_logged_metrics`, the run log) take them after every other
  callback's ``step_values``, and before any ``on_step``;
* :meth:`~StepCallback.on_step` — an optimizer step just finished (``step`` = steps done);
* :meth:`~StepCallback.on_validated` — an evaluation during fit ended (not the sanity check);
* :meth:`~StepCallback.on_saved` — the checkpoint callback just saved a periodic checkpoint of
  the step (every rank, at the same point): a stop decided after the step's ``on_step`` (a
  signal that landed during the save) can end the run on that checkpoint;
* :meth:`~StepCallback.on_values_arrived` — before a save: the values of finished steps that
  were still on their way from the device (:func:`settle_step_values`), for a callback whose
  state goes into the checkpoint; it takes them with :meth:`~StepCallback.unseen`, as it takes
  ``readout.completed`` in ``on_step``, so no step counts twice.

Each event reaches the active step callbacks of the Trainer in one order, whichever of them
Lightning happens to call first: :data:`STEP_ORDER`, the one list of nanolab's own step callbacks
(observers first: run log, throughput, progress; then the callbacks that may stop the run:
budget, divergence, spike, preemption; then checkpointing), so a record of a step is written before
anything acts on the step and a save sees every decision. A callback of a fork's own slots in by
its :attr:`~StepCallback.step_order` (the list's places are 10, 20, ... 80; default 100, after
them all); ties keep registration order.

The shared :class:`~nanolab.callbacks.clock.RunClock` is attached in ``setup`` (``self.clock``)
and has counted the micro-batch before any of these hooks runs.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import lightning as L
from lightning.pytorch.callbacks import Callback

from nanolab.callbacks.clock import RunClock
from nanolab.callbacks.readout import StepReadout, Values

#: nanolab's step callbacks in the order every event reaches them (a subclass takes its base's
#: place). Place ``i`` (from 0) is ``step_order`` ``10 * (i + 1)``.
STEP_ORDER: tuple[str, ...] = (
    "nanolab.callbacks.jsonl.MetricsLog",
    "nanolab.callbacks.throughput.ThroughputMeter",
    "nanolab.callbacks.progress.StepProgressBar",
    "nanolab.callbacks.budget.CostBudget",
    "nanolab.callbacks.divergence.DivergenceStop",
    "nanolab.callbacks.spike.SpikeGuard",
    "nanolab.callbacks.preemption.PreemptionHandler",
    "nanolab.callbacks.checkpoint.RotatingCheckpoint",
)


def order_of(callback: object) -> int:
    """Where ``callback`` acts among the step callbacks: its class's (or nearest listed base's)
    place in :data:`STEP_ORDER`, else its own ``step_order`` (100 if it sets none)."""
    return _class_order(type(callback))


@functools.cache
def _class_order(kind: type) -> int:
    # Once per class: the step callbacks are sorted by it at every micro-batch.
    for cls in kind.__mro__:
        name = f"{cls.__module__}.{cls.__qualname__}"
        if name in STEP_ORDER and "step_order" not in cls.__dict__:
            return 10 * (STEP_ORDER.index(name) + 1)
        if "step_order" in cls.__dict__:
            return int(cls.__dict__["step_order"])
    return 100


class StepCallback(Callback):
    """Base class for callbacks that act on optimizer steps (see the module docstring).

    Subclasses override the ``on_run_start`` / ``on_micro_batch`` / ``on_step`` /
    ``on_validated`` hooks, not Lightning's ``on_train_start``, ``on_train_batch_end`` or
    ``on_validation_end`` (or call ``super()`` first when they must).
    """

    #: Position of a fork's callback among the step callbacks (lower first; nanolab's own are
    #: placed by :data:`STEP_ORDER` at 10 ... 80).
    step_order: ClassVar[int] = 100

    #: Whether :meth:`step_values` reads what was logged for the step (``self.log``): such a
    #: callback's runs after every other's, so that a metric a callback logs there is the step's.
    reads_logged_metrics: ClassVar[bool] = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # cooperative: e.g. TQDMProgressBar's arguments
        self.clock: RunClock | None = None
        self.active = False
        self._seen_through: int | None = None  # the newest step taken by unseen()

    def is_active(self, stage: str) -> bool:
        """Whether the hooks run in this Trainer stage: ``fit`` only unless overridden, and not at
        all when the callback has an ``enabled`` setting that is false."""
        return stage == "fit" and bool(getattr(self, "enabled", True))

    # -- Lightning's hooks, turned into the events above -------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self.active = self.is_active(stage)
        self._seen_through = None  # a new fit (a rollback's goes on from an older step)
        if self.active:
            self.clock = RunClock.attach(trainer)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        for callback in self._peers("start", trainer):
            callback.on_run_start(trainer, pl_module)

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        # Replaces the parent's hook (TQDMProgressBar's counts micro-batches).
        if self.active and self.clock is not None:
            self.clock.batch_end(trainer, batch)
        peers = self._peers("batch", trainer)
        for callback in peers:
            callback.on_micro_batch(trainer, pl_module, outputs)
        if peers and self.clock is not None and self.clock.step_finished(trainer):
            step = int(trainer.global_step)
            validate_at_the_last_step(trainer)  # before on_step: saves wait for it
            readout = self.clock.readout
            readout.begin(step)
            for callback in sorted(peers, key=lambda c: c.reads_logged_metrics):  # stable
                callback.step_values(trainer, pl_module, step, readout)
            with self.clock.device_wait():  # the host waits for the step's queued device work
                readout.transfer()
            for callback in peers:
                callback.on_step(trainer, pl_module, step)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if trainer.sanity_checking:
            return
        step = int(trainer.global_step)
        for callback in self._peers("validation", trainer):
            callback.on_validated(trainer, pl_module, step)

    def _peers(self, event: str, trainer: L.Trainer) -> list[StepCallback]:
        """The active step callbacks, in order, if this call is the event's first; else none."""
        if not self.active or self.clock is None or not self.clock.first_call(event, trainer):
            return []
        return active_step_callbacks(trainer)

    def unseen(self, arrived: list[tuple[int, Values]]) -> list[tuple[int, Values]]:
        """The steps of ``arrived`` (oldest first) this callback has not taken yet, marked taken.

        A step's values can reach a callback twice: at a save (:meth:`on_values_arrived`) and
        again in the next step's ``readout.completed``. A callback that counts steps (a streak,
        a window of losses) takes both through this, and so each step once."""
        fresh = [(s, v) for s, v in arrived if self._seen_through is None or s > self._seen_through]
        if fresh:
            self._seen_through = fresh[-1][0]
        return fresh

    # -- what subclasses override ------------------------------------------------------------
    def on_run_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Training starts in this process (after a checkpoint, if any, was restored)."""

    def on_micro_batch(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any
    ) -> None:
        """A micro-batch finished (every one, also mid-accumulation); runs before ``on_step``."""

    def step_values(
        self, trainer: L.Trainer, pl_module: L.LightningModule, step: int, readout: StepReadout
    ) -> None:
        """Before ``on_step``: put the device scalars of this step that this callback reads
        (``readout.put``); they are read together, in one transfer, for every callback
        (:mod:`nanolab.callbacks.readout`). Reading a device tensor any other way per step
        (``.item()``, ``float()``) adds a host-device synchronisation."""

    def on_step(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        """An optimizer step just finished; ``step`` = optimizer steps done. ``self.clock.readout``
        holds what the callbacks' :meth:`step_values` put (``values``/``completed``)."""

    def on_validated(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        """An evaluation during fit ended (never the sanity check); ``step`` as in ``on_step``."""

    def on_saved(
        self, trainer: L.Trainer, pl_module: L.LightningModule, step: int, path: str
    ) -> None:
        """The checkpoint callback just saved ``path``, the state after optimizer step
        ``step``, on its own schedule (not a save another callback asked for); called on every
        rank at the same point, after the save (its rotation too, unless asynchronous)."""

    def on_values_arrived(
        self, trainer: L.Trainer, pl_module: L.LightningModule, arrived: list[tuple[int, Values]]
    ) -> None:
        """Before a save, on every rank at the same point: the values of finished steps that
        had not reached ``on_step`` yet (on a GPU the newest step's are still on their way).
        A callback whose saved state depends on them takes them here (with :meth:`unseen`), so
        the checkpoint holds what a run reading them at once would hold, and a run resumed
        from it decides what an uninterrupted one decides. They come again in the next step's
        ``readout.completed``."""


def active_step_callbacks(trainer: L.Trainer) -> list[StepCallback]:
    """The Trainer's active step callbacks, in the order events reach them."""
    callbacks = trainer.callbacks  # type: ignore[attr-defined]
    return sorted((c for c in callbacks if isinstance(c, StepCallback) and c.active), key=order_of)


def announce_save(trainer: L.Trainer, step: int, path: str) -> None:
    """Tell the active step callbacks that a checkpoint of ``step`` was saved at ``path``
    (:meth:`~StepCallback.on_saved`); called by the checkpoint callback on every rank."""
    pl_module = trainer.lightning_module
    for callback in active_step_callbacks(trainer):
        callback.on_saved(trainer, pl_module, step, path)


def settle_step_values(trainer: L.Trainer) -> None:
    """Before a save (called on every rank, as saving is collective): wait for the step values
    still in flight and hand them to the step callbacks' :meth:`~StepCallback.on_values_arrived`.

    On a GPU a step's values arrive at the next step (:mod:`nanolab.callbacks.readout`), so a
    checkpoint saved at step k would hold the spike guard's window and the divergence stop's
    streaks without step k, and a run resumed from it would detect a spike at another step
    than the run never stopped. The wait costs nothing extra: the save waits for the device
    anyway. A callback may act on what arrives (stop the run, roll it back); the save then
    looks at the stop reason as it would after that callback's ``on_step``."""
    callbacks = active_step_callbacks(trainer)
    clock = next((c.clock for c in callbacks if c.clock is not None), None)
    if clock is None:
        return
    with clock.device_wait():
        arrived = clock.readout.drain()
    if not arrived:
        return
    pl_module = trainer.lightning_module
    for callback in callbacks:
        callback.on_values_arrived(trainer, pl_module, arrived)


def validate_at_the_last_step(trainer: L.Trainer) -> None:
    """Make the run's last step a validation step.

    Lightning validates every ``val_check_interval`` micro-batches, so a ``trainer.max_steps``
    that is not a multiple of ``run.eval_every_steps`` (80 steps, a validation every 100) ended
    with no validation of the final model: no final val loss in the log, the report or the
    queue. Asking the loop to stop at that step is Lightning's own early-stop path, which
    validates first; the checkpoint of the last step then holds that validation too.
    """
    max_steps = trainer.max_steps
    if max_steps is None or max_steps <= 0 or trainer.global_step < max_steps:
        return
    if trainer.should_stop or not trainer.enable_validation or validation_follows(trainer):
        return  # stopping anyway, validation off, or the step validates already
    trainer.should_stop = True


def validation_follows(trainer: L.Trainer) -> bool:
    """Whether Lightning validates right after this batch (False if that cannot be told).

    Lightning has no public API for this decision: it is ``_should_check_val_fx`` of the fit
    loop, which weighs ``val_check_interval``, the last batch, time-based intervals and an early
    stop; recomputing it from public settings would drift from it. A Lightning upgrade that moves
    it makes this False: saves and preemption stops then happen before the evaluation instead of
    after it (still correct, the evaluation is just not in that checkpoint).
    """
    try:
        loop = trainer.fit_loop.epoch_loop
        return bool(loop._should_check_val_fx(trainer.fit_loop._data_fetcher)) and not bool(
            loop._skip_next_val
        )
    except Exception:
        return False


def scheduled_validation(trainer: L.Trainer) -> bool:
    """Whether the evaluation that just ran is one of the run's every-``run.eval_every_steps``
    ones (True when that cannot be told), not the extra one a stop (budget, plateau, the last
    step) asks for first. A run stopped there and continued, or never stopped there, has the same
    scheduled evaluations; the extra one is logged, but the plateau rule's patience and the
    in-loop tasks' ``every_n_evals`` count the scheduled ones, so both runs stop and score at the
    same steps.

    Lightning validates when the micro-batches done are a multiple of ``val_check_batch`` (the
    micro-batches of ``eval_every_steps`` optimizer steps, counted in this launch's
    accumulation, as a resume realigns them)."""
    every = getattr(trainer, "val_check_batch", None)
    if isinstance(every, bool) or not isinstance(every, int) or every <= 0:
        return True
    accumulate = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
    return int(trainer.global_step) * accumulate % every == 0


def validate_now(trainer: L.Trainer) -> bool:
    """Run the fit's evaluation now, before the next training step; False if it cannot be run.

    For an evaluation a checkpoint was saved without (a preemption that saved first): the
    restored weights are those that evaluation would have seen, so its numbers are the
    uninterrupted run's. Lightning has no public API for an evaluation during fit; this is what
    its training loop does after a step (a fresh evaluation, not the continuation of one the
    checkpoint interrupted). A Lightning upgrade that moves the loop makes this False: the step
    then goes unevaluated, as it did before this existed.
    """
    if not trainer.enable_validation:
        return False
    try:
        val_loop = trainer.fit_loop.epoch_loop.val_loop
        val_loop.restarting = False
    except AttributeError:
        return False
    trainer.validating = True
    try:
        val_loop.run()
    finally:
        trainer.training = True
    return True
