"""The record of an evaluation of a run's own checkpoint, appended to that run's log only.

``validate``, ``test`` and ``eval`` score a run directory's checkpoint and append their record to
its ``metrics.jsonl``, holding the run directory for the append only (held for the whole
scoring, it refused a ``fit`` of the run started meanwhile: a queued continuation, a resume
loop). So by the time the record is written the directory may hold another run: a ``fit
--run.fresh true`` moved the scored run to ``previous/`` and started a new one in its place.
Appended there, the old model's scores would read, in ``report``, as the new run's. One rule
for the three verbs: with the lock held, the log's newest ``start`` record must name the run
that was scored (the run id the checkpoint saved, else the log's owner read before the
checkpoint was picked); otherwise the record stays printed only, with one warning.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nanolab.callbacks.rundir import owner_of_log
from nanolab.messages import warn
from nanolab.runlog import RUN_LOG_NAME


def log_owner(run_dir: Path) -> str | None:
    """The run the directory's log names now (its newest ``start`` record's run id), or None.
    Read before the checkpoint is picked: what a run started later would change."""
    return owner_of_log(run_dir / RUN_LOG_NAME)


def scored_run(checkpoint_run_id: str | None, owner_at_pick: str | None) -> str | None:
    """The run an evaluation scores: the run id its checkpoint saved (the run log callback's
    state), else the run the log named when the checkpoint was picked."""
    return checkpoint_run_id or owner_at_pick


def append_evaluation(
    run_dir: Path, record: dict[str, Any], run_id: str | None, prog: str
) -> Path | None:
    """Append ``record`` (an evaluation of run ``run_id``'s checkpoint) to the run log of
    ``run_dir`` and return the log's path, holding the directory for the append only. None,
    with one warning line and nothing written, when a fit holds the directory or the log now
    names another run than the one scored, or the directory or its log is gone (moved or
    deleted while it was scored): nothing is created in its place."""
    from nanolab.callbacks import runlock
    from nanolab.training.evaluate import append_record

    try:
        # No fit may append or rotate while the record is written; a directory gone is not
        # made again (a lone record there would read, in ``status``, as a running run).
        lock = runlock.acquire(run_dir, create=False)
    except FileNotFoundError:
        warn(prog, f"not logged: {gone(run_dir)}")
        return None
    except (runlock.RunLockedError, OSError) as err:  # one line, not a Python warning
        warn(prog, f"not logging to {run_dir}: {err}")
        return None
    try:
        if not (run_dir / RUN_LOG_NAME).is_file():
            warn(prog, f"not logged: {gone(run_dir)}")
            return None
        other = replaced_by(run_dir, run_id)
        if other is not None:
            warn(prog, f"not logged: {run_dir} now holds another run ({other})")
            return None
        return append_record(run_dir, record)
    finally:
        lock.release()


def gone(run_dir: Path) -> str:
    """Why a record cannot go into ``run_dir``: the directory, or its log, is not there."""
    if not run_dir.is_dir():
        return (
            f"the run directory {run_dir} is gone (moved or deleted while it was scored); "
            "the scores are printed only"
        )
    return (
        f"{run_dir} has no {RUN_LOG_NAME} (moved or deleted?); a record alone there would "
        "read as a run of its own"
    )


def replaced_by(run_dir: Path, run_id: str | None) -> str | None:
    """Why the log of ``run_dir`` belongs to another run than ``run_id`` (the caller holds the
    directory), or None: it names that run, or no run at all."""
    owner = log_owner(run_dir)
    if owner is None or owner == run_id:
        return None
    if run_id is None:
        return f"its log names run {owner}, started after the evaluated checkpoint was picked"
    return f"its log names run {owner}; the checkpoint evaluated is run {run_id}'s"
