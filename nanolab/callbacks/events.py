"""What the nanolab callbacks share: errors, the stop reason, and how records reach the run log.

The callbacks are independent Lightning callbacks (each one can be left out), so they find each
other through the Trainer rather than through references: :func:`emit` hands a record to whichever
``MetricsLog`` is attached (none: the record is dropped), and callbacks that contribute fields to
the ``start``/``train``/``end`` records implement the small :class:`RecordSource` protocol.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar, runtime_checkable

import lightning as L

from nanolab.callbacks.step import order_of
from nanolab.training.callback_settings import CallbackConfigError  # noqa: F401  (public here too)

#: Why a run ended, as written in the ``end`` record.
END_REASONS = ("completed", "budget", "plateau", "preempted", "diverged", "rollback", "error")

#: The Trainer attribute holding ``(reason, detail, save_state)`` once a stop reason is set.
_STOP_ATTR = "nanolab_stop"

C = TypeVar("C")


class NothingToTrain(Exception):
    """The run, as restored, must not train a step (complete, or stopped by a budget that still
    holds): the message is the one line that says so and how to go on. ``fit`` prints it and
    exits 0 before its banner, writing nothing into the run directory."""


@runtime_checkable
class RecordSource(Protocol):
    """A callback that adds fields to the run log's records (all methods optional in practice)."""

    def record_fields(self, trainer: L.Trainer, event: str) -> dict[str, Any]: ...


def set_stop_reason(
    trainer: L.Trainer, reason: str, detail: str | None = None, save_state: bool = True
) -> None:
    """Record why the run is about to stop, for the ``end`` record; also asks the Trainer to stop.

    This is the hook for code outside these callbacks (the preemption handler calls
    ``set_stop_reason(trainer, "preempted", "SIGTERM")``). The first reason set wins, so a budget
    stop that is followed by a preemption signal during the final save still reads ``budget``.
    ``save_state=False``: the checkpoint callback saves nothing more (the weights are damaged).
    """
    if reason not in END_REASONS:
        raise ValueError(f"stop reason must be one of {', '.join(END_REASONS)}, got {reason!r}")
    if getattr(trainer, _STOP_ATTR, None) is None:
        setattr(trainer, _STOP_ATTR, (reason, detail, save_state))
    trainer.should_stop = True


def stop_saves_state(trainer: L.Trainer) -> bool:
    """False when the stop's reason says the current weights must not become a checkpoint
    (a loss spike: the run rolls back from an older one, or stops as diverged without saving
    the damaged state)."""
    return bool(getattr(trainer, _STOP_ATTR, (None, None, True))[2])


def stop_reason(trainer: L.Trainer) -> tuple[str | None, str | None]:
    """The reason (and detail) set with :func:`set_stop_reason`, or ``(None, None)``."""
    reason, detail, _ = getattr(trainer, _STOP_ATTR, None) or (None, None, True)
    return reason, detail


def open_bad_streak(trainer: L.Trainer) -> int | None:
    """The first step of the run of non-finite optimizer steps in progress (fewer than the
    divergence stop's ``patience`` so far: it may yet recover or diverge), or None when the
    last step was finite. The checkpoint callback holds its scheduled saves while one is open
    and keeps the checkpoint a branch would start from. Asked of whichever attached callback
    offers ``open_bad_streak`` (the divergence stop): the checkpoint callback sits below it."""
    return _offered_step_count(trainer, "open_bad_streak")


def bad_steps_left(trainer: L.Trainer) -> int | None:
    """How many more non-finite optimizer steps in a row stop the run as diverged (the
    divergence stop's ``patience`` less the open run of them), or None when none is open: what
    a checkpoint saved inside them may yet do on a resume."""
    return _offered_step_count(trainer, "bad_steps_left")


def _offered_step_count(trainer: L.Trainer, name: str) -> int | None:
    """The int attribute ``name`` of the first attached callback that offers one, or None."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        value = getattr(callback, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def find_callback(trainer: L.Trainer, kind: type[C]) -> C | None:
    """The first callback of type ``kind`` attached to ``trainer``."""
    callbacks = trainer.callbacks  # type: ignore[attr-defined]
    return next((c for c in callbacks if isinstance(c, kind)), None)


def emit(trainer: L.Trainer, record: dict[str, Any]) -> None:
    """Write ``record`` to the run log if its owner (``MetricsLog``, which sets
    ``owns_run_log``) is attached; it writes on rank 0 only."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if getattr(callback, "owns_run_log", False):
            callback.write(trainer, record)
            return


def collect_fields(trainer: L.Trainer, event: str) -> dict[str, Any]:
    """Fields every :class:`RecordSource` callback contributes to a record of kind ``event``.

    Asked in the step order (:func:`nanolab.callbacks.step.order_of`), so where two give the
    same field the later one in that order wins, not the later one registered.
    """
    fields: dict[str, Any] = {}
    for callback in sorted(trainer.callbacks, key=order_of):  # type: ignore[attr-defined]
        method = getattr(callback, "record_fields", None)  # per record: no Protocol isinstance
        if method is not None:
            fields.update(method(trainer, event))
    return fields
