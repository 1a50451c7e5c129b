"""Data skipped after a rollback: part of the training order, kept in the run directory.

When the spike guard (:mod:`nanolab.callbacks.spike`) rolls a run back from step D to an older
checkpoint at step R, the run does not train again on the micro-batches it was training on when
the spike came: micro-batch ``k`` after the rollback is the one ``k + offset`` of the order
(:class:`~nanolab.data.windows.ResumableBatchSampler`), where ``offset`` carries it past what
step D had reached. Each rollback is one *jump* ``(at, offset)``: from consumed micro-batch
``at`` on, the order is shifted by ``offset``. A later jump replaces the ones at or after its
``at`` (the timeline they belonged to was abandoned). The order therefore stays a pure function
of (seed, step, rank, jumps), and a resume from any checkpoint of the run reads the same jumps,
so it is as exact as before.

The jumps live in ``<run_dir>/rollbacks.json`` (written atomically), next to what each rollback
did, so a person reads what happened and every resume of the run sees the same order. Deleting
that file changes the data order of a run that rolled back.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanolab.atomic import write_whole
from nanolab.errors import NanolabError

LEDGER = "rollbacks.json"


@dataclass(frozen=True)
class Jump:
    """From consumed micro-batch ``at`` on, the order is shifted by ``offset`` micro-batches."""

    at: int
    offset: int


class LedgerError(NanolabError):
    """A rollback ledger that cannot be read; the run's data order depends on it."""


def _damaged(path: Path, why: str) -> LedgerError:
    return LedgerError(
        f"{path} {why}: it holds the data this run skipped after a loss spike, so its data "
        "order depends on it; restore it (from a backup of the run), or start a new run "
        "(another --run.name)"
    )


def read_ledger(run_dir: str | os.PathLike[str] | None) -> list[dict[str, Any]]:
    """The rollbacks recorded in ``run_dir`` (oldest first); none when there is no ledger.
    A damaged one is a :class:`LedgerError` (one line), never a guess."""
    if run_dir is None:
        return []
    path = Path(run_dir) / LEDGER
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _damaged(path, f"cannot be read ({type(err).__name__}: {err})") from None
    rollbacks = data.get("rollbacks") if isinstance(data, dict) else None
    if not isinstance(rollbacks, list):
        raise _damaged(path, "is not a rollback ledger (no 'rollbacks' list)")
    for i, r in enumerate(rollbacks):
        ok = isinstance(r, dict) and all(
            isinstance(r.get(k), int) and not isinstance(r.get(k), bool)
            for k in ("skip_at", "skip_offset")
        )
        if not ok:
            raise _damaged(path, f"entry {i} lacks skip_at/skip_offset as integers")
    return rollbacks


def write_ledger(run_dir: str | os.PathLike[str], rollbacks: list[dict[str, Any]]) -> None:
    """Replace the ledger atomically (a reader sees the old or the new one, never half),
    through a temporary name of this call's own (:func:`nanolab.atomic.write_whole`)."""
    write_whole(Path(run_dir) / LEDGER, json.dumps({"rollbacks": rollbacks}, indent=1))


def jumps(rollbacks: list[dict[str, Any]]) -> list[Jump]:
    """The jumps in force after these rollbacks: each drops the ones at or after its own."""
    out: list[Jump] = []
    for r in rollbacks:
        at = int(r["skip_at"])
        out = [j for j in out if j.at < at] + [Jump(at, int(r["skip_offset"]))]
    return out


def data_position(consumed: int, in_force: list[Jump]) -> int:
    """The position in the training order of the ``consumed``-th micro-batch."""
    offset = 0
    for j in in_force:
        if j.at <= consumed:
            offset = j.offset
    return consumed + offset
