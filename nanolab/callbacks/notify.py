"""When a run ends, say so: a line in ``<run.root>/results.log`` and the targets you name.

``notify.targets`` is a list of commands or apprise URLs (:mod:`nanolab.notify`), fired once when
a run ends for any reason: ``completed``, ``budget``/``plateau``, ``diverged``, ``preempted``,
``error`` (a rollback from a loss spike is not an end: the run goes on). The fields a command
can use are :data:`FIELDS`; for example::

    notify:
      targets:
        - notify-send "nanolab: {run} {reason}" "val {val_loss} after {wall}"
        - ntfy://my-topic

``notify.results_log`` (on by default) appends one JSON line per ended run to
``<run.root>/results.log``: ``grep diverged runs/results.log``, ``jq -s`` for a table. The line
is one ``write`` to a file opened for appending, so runs ending at once do not interleave. A
failing target is a warning line; nothing here ever stops or fails the run.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

from nanolab.notify import send
from nanolab.runlog import RUN_LOG_NAME, last_record
from nanolab.runs import RESULTS_LOG, append_result, duration, last_trained_val
from nanolab.training.callback_settings import NOTIFY_FIELDS, check_notify

#: What a command target can fill in.
FIELDS = NOTIFY_FIELDS


class Notifier(Callback):
    """A ``results.log`` line and the ``targets`` when a run ends (module docstring).

    Args:
        targets: Commands (``{field}`` templates, run without a shell) or apprise URLs.
        results_log: Append one JSON line per ended run to ``<run.root>/results.log``.
    """

    def __init__(self, targets: list[str] | None = None, results_log: bool = True) -> None:
        super().__init__()
        self.targets = list(targets or [])
        check_notify({"targets": self.targets})
        self.results_log = results_log
        self.sent: dict[str, Any] | None = None  # the fields of the last notification

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._ended(trainer)

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._ended(trainer)

    def _ended(self, trainer: L.Trainer) -> None:
        if not trainer.is_global_zero or trainer.state.fn != "fit" or self.sent is not None:
            return
        run_dir = Path(trainer.default_root_dir)
        end = last_record(run_dir / RUN_LOG_NAME, "end")
        if end is None or end.get("reason") == "rollback":
            return  # no run log, or a rollback: the run continues
        # Training's last validation on the run's timeline: a `nanolab validate` appended
        # since (before a resume that ended without validating) scored a checkpoint
        # afterwards, perhaps otherwise; a resume from an older step abandoned the later ones.
        val = last_trained_val(run_dir)
        wall = end.get("elapsed_s")
        fields = {
            "run": run_dir.name,
            "reason": end.get("reason"),
            "detail": end.get("detail") or end.get("error") or "",
            "step": end.get("step"),
            "val_loss": _rounded((val or {}).get("val_loss")),
            "best_val_loss": _rounded(end.get("best_val_loss")),
            "wall": duration(wall) if isinstance(wall, int | float) else "",
            "wall_s": wall,
            "tokens": end.get("tokens"),
            "run_dir": str(run_dir),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        self.sent = fields
        if self.results_log:
            append_result(run_dir.parent / RESULTS_LOG, fields)
        if self.targets:
            title = f"nanolab: {fields['run']} {fields['reason']}"
            body = (f"{fields['run']}: {fields['reason']} at step {fields['step']}, val loss "
                    f"{fields['val_loss'] or '-'}, {fields['wall']} ({fields['run_dir']})")  # fmt: skip
            send(self.targets, fields, title, body)


def _rounded(value: Any) -> float | None:
    return round(float(value), 4) if isinstance(value, int | float) else None
