"""Termination signals that arrive before training starts: held, then "preempted", exit 75.

The preemption callback can only install its handlers once the Trainer runs (Lightning installs
its own first). Start-up before that takes seconds to minutes (imports, data preparation, model
construction, loading a checkpoint); a scheduler's SIGTERM in that window used to kill the process
with the default action (exit 143, no ``end`` record), which breaks a requeue loop that waits for
exit code 75. So ``nanolab fit`` installs these handlers first thing: a first signal is only
recorded (start-up continues to a safe point: nothing half-written), then the run stops before its
first step, saying "preempted before the first step", and exits 75. A second signal exits at once.

Deliberately light (no torch/Lightning import) so it can run before the heavy imports.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from types import FrameType
from typing import Any

#: The preemption callback's default signals (``preemption.signals``).
DEFAULT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")

#: Exit status of a preempted run (sysexits.h EX_TEMPFAIL), as in the preemption callback.
EXIT_PREEMPTED = 75

_received: tuple[signal.Signals, float] | None = None
_previous: dict[signal.Signals, Any] = {}


class PreemptedBeforeStart(SystemExit):
    """Raised at a safe point of start-up when a termination signal arrived before training."""

    def __init__(self, signal_name: str, code: int = EXIT_PREEMPTED) -> None:
        super().__init__(code)
        self.signal_name = signal_name
        self.reason = "preempted"

    def __str__(self) -> str:
        return f"preempted by {self.signal_name} before the first step"


def _handle(signum: int, frame: FrameType | None) -> None:
    global _received
    sig = signal.Signals(signum)
    if _received is not None:
        _write(f"nanolab: second {sig.name} during start-up: exiting now\n")
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        return
    _received = (sig, time.time())
    _write(
        f"nanolab: received {sig.name} during start-up: stopping before the first step, "
        f"then exiting with code {EXIT_PREEMPTED} (send it again to exit at once)\n"
    )


def install(names: tuple[str, ...] = DEFAULT_SIGNALS) -> None:
    """Hold these signals until training starts (main thread only; idempotent)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    for name in names:
        sig = getattr(signal, name, None)
        if not isinstance(sig, signal.Signals) or sig in _previous:
            continue
        current = signal.getsignal(sig)
        if current is signal.SIG_IGN:
            continue  # ignored by whoever started us (nohup): keep it that way
        _previous[sig] = current
        signal.signal(sig, _handle)


def received() -> signal.Signals | None:
    """The signal held during start-up, if any."""
    return _received[0] if _received else None


def received_at() -> float | None:
    return _received[1] if _received else None


def uninstall(deliver: bool = True) -> None:
    """Give the signals back to their previous handlers (preemption disabled, or evaluation).

    ``deliver``: a signal held meanwhile is raised again under the restored handler, so turning
    preemption off means the default action, as before.
    """
    for sig, previous in list(_previous.items()):
        if signal.getsignal(sig) == _handle:
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
    _previous.clear()
    if deliver and _received is not None:
        os.kill(os.getpid(), _received[0])


def stop_if_received(where: str = "") -> None:
    """At a safe point of start-up: exit 75 (via :class:`PreemptedBeforeStart`) if signalled."""
    sig = received()
    if sig is None:
        return
    _write(
        f"nanolab: preempted by {sig.name} before the first step{where}; nothing was trained "
        f"or written; exiting with code {EXIT_PREEMPTED}, rerun the same command to start\n"
    )
    raise PreemptedBeforeStart(sig.name)


def _write(text: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        os.write(sys.stderr.fileno(), text.encode())
