"""nanolab's watch over the ranks a launch started, in place of Lightning's child-process observer.

With ``trainer.devices 2`` (or more) on one machine, Lightning's DDP launcher starts the other
ranks from rank 0 and a thread that polls them every 5 s: once one has ended with a non-zero
status, it SIGKILLs the others and rank 0, whose collective might otherwise wait forever (NCCL
without its error handling). It also SIGKILLed a rank 0 that was about to say which rank had died
(:mod:`nanolab.callbacks.lost_rank`: on a loaded machine, gloo's traceback or nothing at all
came out instead), and one that was ending as planned behind a rank that exited 75 first.

This watch keeps the duty and leaves rank 0 the time to say it. Woken by a rank's exit itself,
it gives rank 0 :data:`GRACE_S` seconds from a rank's failure (and as long again from the start
of rank 0's own report, which may finish a checkpoint save first) to end by itself; a rank 0
still running then prints the same one line, ends the other ranks and exits 1. A rank that ended
with a status every rank reaches together (:data:`RANKS_END_TOGETHER`: 0, 75, 3) is no failure.
It watches while ``fit``, ``validate`` or ``test`` runs (:func:`watching`); from there on the end
of the launch waits for the ranks (:func:`nanolab.training.early_signals.wait_for_launched_ranks`).

Lightning has no public switch for its observer: :func:`watching` puts this watch in the place
of the launcher module's private ``_launch_process_observer`` for the call, and puts it back
after. Where a Lightning version has moved that name, Lightning's observer runs as before
(``tests/test_lost_rank.py`` says so). Ranks another launcher started (``torchrun``, ``srun``)
are not rank 0's children: that launcher watches them.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

from nanolab.callbacks.lost_rank import (
    found_rank,
    launched_ranks,
    lost_rank,
    reporting,
    say_lost_rank,
)
from nanolab.errors import EXIT_CRASHED
from nanolab.processes import failed_children
from nanolab.training.early_signals import RANKS_END_TOGETHER, end_with_launched_ranks

#: Seconds a rank 0 has to end by itself after a rank it launched failed (and again from the
#: start of its own report): its next collective's error, its ``end`` record, its line, on a
#: loaded machine. Lightning's observer gave it 0 to 5 s.
GRACE_S = 30.0

#: Where Lightning's DDP launcher looks up the function that starts its observer (private).
LAUNCHER_MODULE = "lightning.pytorch.strategies.launchers.subprocess_script"
OBSERVER = "_launch_process_observer"


class RankWatch:
    """One launch's ranks (``procs``, Lightning's ``Popen`` objects), watched from a thread."""

    def __init__(
        self, trainer: Any, verb: str, procs: list[subprocess.Popen], grace_s: float = GRACE_S
    ) -> None:
        self.trainer, self.verb, self.procs, self.grace_s = trainer, verb, procs, grace_s
        self._over = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="nanolab-rank-watch", daemon=True)

    def start(self) -> RankWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        """The run is over: a rank that ends from here is the launch end's to wait for."""
        self._over.set()

    def _watch(self) -> None:
        failed: list[subprocess.Popen] = []
        while not failed:  # 1 s slices: stop() is seen within a second
            if self._over.is_set():
                return
            failed = failed_children(self.procs, 1.0, ok=RANKS_END_TOGETHER)
            if not failed and all(proc.returncode is not None for proc in self.procs):
                return  # every rank ended as planned
        deadline = time.monotonic() + self.grace_s
        reported = False
        while time.monotonic() < deadline:
            if self._over.wait(timeout=min(0.5, max(0.0, deadline - time.monotonic()))):
                return
            if reporting.is_set() and not reported:  # rank 0 is at it: as long again from now
                reported, deadline = True, time.monotonic() + self.grace_s
        self._give_up(failed[0])

    def _give_up(self, proc: subprocess.Popen) -> None:
        """Rank 0 did not end within the grace: say which rank died, end the others, exit 1."""
        rank = next((r for r, p in launched_ranks(self.trainer) if p is proc), None)
        if rank is not None:
            with contextlib.suppress(Exception):  # the line must not stop the ending
                say_lost_rank(self.verb, found_rank(self.trainer, rank, proc))
        for other in self.procs:
            if other.poll() is None:
                with contextlib.suppress(OSError):
                    other.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    other.wait(timeout=5)
        os._exit(EXIT_CRASHED)


@contextlib.contextmanager
def watching(trainer: Any, verb: str) -> Iterator[None]:
    """Run ``trainer``'s fit, validate or test (the ``with`` body) with the ranks its launcher
    starts watched by a :class:`RankWatch` instead of Lightning's observer; the launch ends
    after them (:func:`~nanolab.training.early_signals.end_with_launched_ranks`), and a
    collective's error that a rank's death explains is named (:func:`lost_rank`, which ``fit``'s
    run log asked first; the command prints it)."""
    end_with_launched_ranks(getattr(trainer.strategy, "launcher", None))
    try:
        module = importlib.import_module(LAUNCHER_MODULE)
    except ImportError:
        module = None
    lightnings = getattr(module, OBSERVER, None)
    watches: list[RankWatch] = []

    def observe(procs: list[subprocess.Popen]) -> None:
        watches.append(RankWatch(trainer, verb, procs, GRACE_S).start())

    reporting.clear()
    if callable(lightnings):  # else moved in this Lightning version: its own observer watches
        setattr(module, OBSERVER, observe)
    try:
        yield
    except RuntimeError as err:
        lost_rank(trainer, err)
        raise
    finally:
        if callable(lightnings):
            setattr(module, OBSERVER, lightnings)
        for watch in watches:
            watch.stop()
