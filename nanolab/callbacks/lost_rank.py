"""A rank of a multi-process run that died: one line naming it, not rank 0's traceback.

With ``trainer.devices 2`` (or more) on one machine, Lightning's launcher starts the other ranks
from rank 0's process. When one of them dies (the kernel's out-of-memory killer, a segfault, a
``kill -9``), rank 0 learns it from its next collective as an error that names neither the rank
nor the cause (gloo: ``Connection closed by peer``; NCCL: ``remote process exited``), under a
traceback of some sixty lines. The launcher holds the ranks' process handles, so rank 0 asks them
how they ended, and the run ends with one line::

    rank 1 (pid 4242) was killed by SIGKILL (out of memory?); rerun the same command to resume from step 40

A rank that ended itself on an error (an exception in its own code: exit code 1) is named without
that advice, since an unchanged rerun meets the same error: its own traceback is above the line::

    rank 1 (pid 4242) ended with an error (exit code 1): its traceback is above; the newest checkpoint is of step 40

The run log's ``end`` record carries the same line as its error, and ``nanolab fit`` exits
:data:`nanolab.errors.EXIT_CRASHED`. Only a collective's error (a ``RuntimeError``) while a rank
this process launched has ended counts as such; any other error keeps its traceback. Ranks that
another launcher started (``torchrun``, ``srun``, the other nodes) are not this process's
children: reporting their deaths is that launcher's part.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from dataclasses import dataclass
from typing import Any

from nanolab.callbacks.checkpoint import RotatingCheckpoint
from nanolab.callbacks.events import find_callback
from nanolab.processes import how_it_ended

#: The exception attribute the finding is kept in: the run log asks first (for its ``end``
#: record) and ``nanolab fit`` reads it after the Trainer has let the exception go.
ATTRIBUTE = "nanolab_lost_rank"

#: Texts of the collectives' errors when the other end went away. With one of them, rank 0
#: waits up to :data:`WAIT_S` for the dead rank's exit status (the kernel closes a dying
#: process's sockets a moment before its status can be read); with another text a rank found
#: ended already still counts, but there is no wait (an unrelated error is not held up).
PEER_GONE_TEXTS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "remote process exited",
    "communicator was aborted",
)

#: Seconds rank 0 waits for a rank's exit status after a peer-gone error. Lightning's own
#: child-process observer ends rank 0 within 5 s of a rank's death: the line comes first.
WAIT_S = 2.0


@dataclass(frozen=True)
class LostRank:
    """A rank this process launched that ended while the run was going on."""

    rank: int
    pid: int
    returncode: int
    resume_step: int | None  # the newest complete checkpoint's step (None: none saved)

    def __str__(self) -> str:
        if self.returncode < 0:  # killed from outside (the OOM killer, kill -9): a rerun resumes
            if self.resume_step is None:
                again = "rerun the same command to start again (no checkpoint was saved yet)"
            else:
                again = f"rerun the same command to resume from step {self.resume_step}"
            return f"rank {self.rank} (pid {self.pid}) was {how_it_ended(self.returncode)}; {again}"
        # It ended itself on an error: an unchanged rerun meets it again, so no rerun advice.
        # Exit code 1 is Python's for an uncaught exception; nanolab's own errors print a line.
        said = "its traceback is above" if self.returncode == 1 else "its message is above"
        saved = (
            "no checkpoint was saved yet"
            if self.resume_step is None
            else f"the newest checkpoint is of step {self.resume_step}"
        )
        return (
            f"rank {self.rank} (pid {self.pid}) ended with an error (exit code "
            f"{self.returncode}): {said}; {saved}"
        )


def lost_rank(trainer: Any, exception: BaseException, wait_s: float = WAIT_S) -> LostRank | None:
    """The rank whose death ``exception`` (raised on this process) reports, or None when it is
    not a collective's error or every rank this process launched still runs. Kept on the
    exception: the first caller waits, the others read it."""
    if hasattr(exception, ATTRIBUTE):
        return getattr(exception, ATTRIBUTE)
    found = _find(trainer, exception, wait_s)
    with contextlib.suppress(AttributeError, TypeError):  # a built-in exception's own slots
        setattr(exception, ATTRIBUTE, found)
    return found


def lost_rank_of(exception: BaseException) -> LostRank | None:
    """What :func:`lost_rank` found for ``exception`` (None: not asked, or not a lost rank)."""
    return getattr(exception, ATTRIBUTE, None)


def launched_ranks(trainer: Any) -> list[tuple[int, subprocess.Popen]]:
    """``(global rank, process)`` of the ranks Lightning's launcher started from this process
    (local ranks 1, 2, ... in the order it started them); empty where it started none."""
    launcher = getattr(getattr(trainer, "strategy", None), "launcher", None)
    procs = getattr(launcher, "procs", None)
    if not isinstance(procs, list) or not procs:
        return []
    first = int(trainer.global_rank) - int(trainer.local_rank)  # this node's rank 0
    return [(first + i + 1, p) for i, p in enumerate(procs) if isinstance(p, subprocess.Popen)]


def _find(trainer: Any, exception: BaseException, wait_s: float) -> LostRank | None:
    if not isinstance(exception, RuntimeError):
        return None
    ranks = launched_ranks(trainer)
    if not ranks:
        return None
    text = str(exception).lower()
    deadline = time.monotonic() + (wait_s if any(t in text for t in PEER_GONE_TEXTS) else 0.0)
    while True:
        ended = [(rank, p) for rank, p in ranks if p.poll() not in (None, 0)]
        if ended or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if not ended:
        return None
    rank, proc = ended[0]
    return LostRank(rank, proc.pid, int(proc.returncode), _resume_step(trainer))


def _resume_step(trainer: Any) -> int | None:
    """The step of the newest complete checkpoint this run saved (or resumed from)."""
    checkpoints = find_callback(trainer, RotatingCheckpoint)
    if checkpoints is None or checkpoints.newest_saved() is None:
        return None
    return checkpoints.last_saved_step
