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

A rank that raised closes its connections a moment before it exits (its own teardown, its
traceback, the interpreter's shutdown): seconds on a loaded machine. Rank 0 waits for the exit
itself (:func:`nanolab.processes.failed_children`, woken by it), :data:`WAIT_S` at most, while
nanolab's own watch of the ranks (:mod:`nanolab.callbacks.rank_watch`), in place of
Lightning's, leaves rank 0 the time to say it.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

from nanolab.callbacks.checkpoint import RotatingCheckpoint
from nanolab.callbacks.events import find_callback
from nanolab.processes import failed_children, how_it_ended

#: The exception attribute the finding is kept in: the run log asks first (for its ``end``
#: record) and ``nanolab fit`` reads it after the Trainer has let the exception go.
ATTRIBUTE = "nanolab_lost_rank"

#: Texts of the collectives' errors when the other end went away. With one of them, rank 0
#: waits up to :data:`WAIT_S` for the dead rank's exit status (a dying process's sockets close
#: before its status can be read: at once when killed, seconds later when it raised); with
#: another text a rank found ended already still counts, but there is no wait (an unrelated
#: error is not held up).
PEER_GONE_TEXTS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "remote process exited",
    "communicator was aborted",
)

#: Seconds rank 0 waits at most for a rank's exit after a peer-gone error. A rank that raised
#: took 2.4 s from closing its connections to its exit on 2 busy CPU cores, longer beside two
#: busy loops (2 s was too short there); the wait ends at the exit itself, so a long bound
#: costs nothing when the rank ends at once. Lightning's child-process observer, which ended
#: rank 0 within 5 s of a rank's death, is replaced by :mod:`nanolab.callbacks.rank_watch`.
WAIT_S = 30.0


@dataclass(frozen=True)
class LostRank:
    """A rank this process launched that ended while the run was going on."""

    rank: int
    pid: int
    returncode: int
    resume_step: int | None  # the newest complete checkpoint's step (None: none saved)
    training: bool = True  # False: a validate or test, which has no checkpoint of its own

    def __str__(self) -> str:
        if not self.training:
            ended = f"rank {self.rank} (pid {self.pid})"
            if self.returncode < 0:
                return f"{ended} was {how_it_ended(self.returncode)}; rerun the same command"
            said = "its traceback is above" if self.returncode == 1 else "its message is above"
            return f"{ended} ended with an error (exit code {self.returncode}): {said}"
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
    reporting.set()  # rank 0 is saying how the run ended: the rank watch leaves it the time
    found = _find(trainer, exception, wait_s)
    with contextlib.suppress(AttributeError, TypeError):  # a built-in exception's own slots
        setattr(exception, ATTRIBUTE, found)
    return found


def lost_rank_of(exception: BaseException) -> LostRank | None:
    """What :func:`lost_rank` found for ``exception`` (None: not asked, or not a lost rank)."""
    return getattr(exception, ATTRIBUTE, None)


#: Set once rank 0 has begun to say how its run ended (:func:`lost_rank`); cleared by each
#: launch's rank watch. The watch ends a rank 0 that never gets there (a collective that hangs).
reporting = threading.Event()

_said_lock = threading.Lock()
_said: set[int] = set()  # the pids of the ranks whose line was printed


def say_lost_rank(verb: str, found: LostRank) -> None:
    """Print ``nanolab VERB: error: <found>`` on stderr, once per lost rank: the main thread's
    report and the rank watch's (when rank 0 hangs) may both come to it."""
    with _said_lock:
        if found.pid in _said:
            return
        _said.add(found.pid)
    print(f"nanolab {verb}: error: {found}", file=sys.stderr, flush=True)


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
    failed_children([p for _, p in ranks], wait_s if any(t in text for t in PEER_GONE_TEXTS) else 0)
    ended = [(rank, p) for rank, p in ranks if p.returncode not in (None, 0)]
    if not ended:
        return None
    rank, proc = ended[0]
    return found_rank(trainer, rank, proc)


def found_rank(trainer: Any, rank: int, proc: subprocess.Popen) -> LostRank:
    """The finding for ``rank`` (``proc``, ended), with the step a rerun of a fit resumes from."""
    stage = getattr(getattr(trainer, "state", None), "fn", None)  # TrainerFn: a str enum
    training = stage is None or stage == "fit"
    step = _resume_step(trainer) if training else None
    return LostRank(rank, proc.pid, int(proc.returncode), step, training)


def _resume_step(trainer: Any) -> int | None:
    """The step of the newest complete checkpoint this run saved (or resumed from)."""
    checkpoints = find_callback(trainer, RotatingCheckpoint)
    if checkpoints is None or checkpoints.newest_saved() is None:
        return None
    return checkpoints.last_saved_step
