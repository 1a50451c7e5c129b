"""Termination signals that arrive before training starts: held, then "preempted", exit 75.

The preemption callback can only install its handlers once the Trainer runs (Lightning installs
its own first). Start-up before that takes seconds to minutes (imports, data preparation, model
construction, loading a checkpoint); a scheduler's SIGTERM in that window used to kill the process
with the default action (exit 143, no ``end`` record), which breaks a requeue loop that waits for
exit code 75. So ``nanolab fit`` installs these handlers first thing: a first signal is only
recorded (start-up continues to a safe point: nothing half-written), then the run stops before its
first step, saying "preempted before the first step", and exits 75. A second signal exits at once.

Until start-up begins to write (imports, parsing, checks: :func:`defer` not yet called) there is
nothing to half-write, so a signal stops the run at once, from the handler. After that a safe point
may never come (a start-up stuck in a model build, a data module or a callback of a fork): a
watchdog ends the process :data:`START_GRACE_S` seconds after the signal, exit 75 when the run
directory holds a checkpoint to resume from, else by the signal's own default action.

A rank that Lightning's DDP launcher started from rank 0 (it re-executes the command) dies with
rank 0 (:func:`die_with_launcher`), and does not stop by itself before the first step: rank 0
waits for it in the process group's rendezvous, and a rank that exits alone there is taken for
a crash (the launcher SIGKILLs rank 0: exit 137). It holds the signal through start-up
instead; every rank then stops together at the first step's start (the preemption callback's
agreement), exit 75. A second signal still exits at once. Rank 0 ends after the ranks it
launched (:func:`wait_for_launched_ranks`). ``validate`` and ``test`` tie their ranks to
rank 0 the same way (:func:`ranks_end_with_launch`), without the signal holding.

Only a run that owns the process installs these handlers, and only for its duration:
:func:`held_during_startup` wraps ``fit``'s entry and puts back every handler it found, so an
in-process run (a test) leaves Ctrl-C to whoever had it before. Importing this module, or any of
nanolab, installs nothing.

Deliberately light (no torch/Lightning import) so it can run before the heavy imports.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

#: The preemption callback's default signals (``preemption.signals``).
DEFAULT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")

#: Exit status of a preempted run (sysexits.h EX_TEMPFAIL), as in the preemption callback.
EXIT_PREEMPTED = 75

#: Seconds a held signal waits for start-up's next safe point before the process ends anyway.
START_GRACE_S = 5.0

#: The pid of the process that runs a ``nanolab fit``; the ranks Lightning's launcher starts
#: from it inherit it (:func:`launched_by_rank_zero`).
LAUNCHER_ENV = "NANOLAB_LAUNCHER_PID"

_received: tuple[signal.Signals, float] | None = None
_previous: dict[signal.Signals, Any] = {}
_deferring = False  # start-up writes from here on: hold a signal to the next safe point
_run_dir: Path | None = None  # where a checkpoint to resume from would be
_watchdog: threading.Timer | None = None

#: Seconds the end of a launch waits for the ranks it launched to end by themselves, before it
#: ends them (they die with it in any case: :func:`die_with_launcher`).
RANKS_END_WAIT_S = 30.0

#: Seconds the end of a launch that failed on its own (an exit status other than
#: :data:`RANKS_END_TOGETHER`) waits for the ranks it launched before it ends them: they are
#: likely waiting for it in a collective that never completes, and would only add their wait.
RANKS_ERROR_WAIT_S = 3.0

#: Exit statuses that every rank reaches together (a finished run, a preemption the ranks
#: agreed on, a divergence they all saw): the launched ranks are ending as well, so wait for them.
RANKS_END_TOGETHER = (0, EXIT_PREEMPTED, 3)

#: The launchers (Lightning's DDP launcher) whose rank processes this launch started:
#: :func:`wait_for_launched_ranks` at the launch's end reads their ``procs`` then, as the
#: launcher rebinds that list when it starts the ranks (a list kept from before stays empty).
_launched: list[Any] = []


@dataclass
class Launch:
    """What :func:`held_during_startup` yields: the caller sets ``exit_code`` to the status the
    run returns, so the launch's end knows whether the ranks it started are ending as well."""

    exit_code: int | None = None


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
    if launched_by_rank_zero():
        return  # held to the first step's start, where every rank stops together
    if not _deferring:  # nothing written yet: this moment is as safe as any later one
        if _inside_an_import(frame):
            # An exception unwinding through a half-run module import leaves that module
            # broken for whatever catches it (numpy under scipy: an AttributeError traceback
            # and exit 1). Nothing was written, so there is nothing to clean up: end here.
            _say_preempted(sig)
            os._exit(EXIT_PREEMPTED)
        stop_if_received()
    _write(
        f"nanolab: received {sig.name} during start-up: stopping at the next safe point before "
        f"the first step (within {START_GRACE_S:.0f}s), then exiting with code {EXIT_PREEMPTED} "
        "(send it again to exit at once)\n"
    )
    arm_watchdog(sig, lambda: _run_dir)


def launched_by_rank_zero() -> bool:
    """Whether this process is a rank that its parent, this launch's rank 0, started."""
    return os.environ.get(LAUNCHER_ENV) == str(os.getppid())


def die_with_launcher(verb: str = "fit") -> None:
    """A rank that rank 0 launched (Lightning's DDP launcher re-runs the command with
    ``LOCAL_RANK`` 1, 2, ...) ends when rank 0 does, even by SIGKILL. ``verb``: the command
    (``fit``, ``validate``, ``test``), for the line.

    Left alone it waited for the dead rank 0 in the process group's rendezvous (or a
    collective) for as long as 30 minutes, holding its memory, on a GPU the device's, while the
    queue, whose SIGKILL of a leftover job reaches rank 0's pid only, started its next job
    there. Armed first thing in start-up (:func:`nanolab.processes.die_with_parent`), then the
    parent is checked: a rank 0 that died before that ends this rank at once, with one line.
    A process started otherwise (``torchrun``, a scheduler, a user) is left alone: its
    environment has no launcher, or one that is not its parent and still runs.
    """
    from nanolab.processes import die_with_parent, pid_alive

    launcher, local_rank = os.environ.get(LAUNCHER_ENV), os.environ.get("LOCAL_RANK", "0")
    if not launcher or not launcher.isdigit() or local_rank in ("", "0"):
        return
    parent = int(launcher)
    if os.getppid() != parent and pid_alive(parent):
        return  # not this launcher's child
    die_with_parent(
        parent,
        gone=f"nanolab {verb}: local rank {local_rank}: the process that launched it (local rank 0, "
        f"pid {parent}) is gone; exiting",
    )


def end_with_launched_ranks(launcher: Any) -> None:
    """Have this launch wait, at its end, for the rank processes of ``launcher`` (Lightning's
    DDP launcher: ``Popen`` objects in its ``procs``, filled when it launches them) to end first.

    A launched rank dies with rank 0 (:func:`die_with_launcher`): a rank 0 that returned
    while a rank was still on its way out (its last lines, its exit) would cut it short; and
    a queue that starts its next job once rank 0 ends would find a rank still holding memory.
    The launcher itself is kept, not its list: it starts the ranks into a new list.
    """
    if launcher is not None:
        _launched.append(launcher)


def wait_for_launched_ranks(wait_s: float = RANKS_END_WAIT_S) -> None:
    """Wait up to ``wait_s`` seconds in all for the ranks this launch started to end; SIGKILL
    (and reap) any still running then, saying so: it waits for a rank 0 that is leaving.

    A Ctrl-C during the wait ends the ranks still running at once (one line, no traceback):
    the launch was ending anyway, and its own exit status stands.
    """
    import subprocess

    procs = [proc for launcher in _launched for proc in getattr(launcher, "procs", None) or ()]
    _launched.clear()
    deadline = time.monotonic() + wait_s
    try:
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _write(
                    f"nanolab: a rank this launch started (pid {proc.pid}) was still running "
                    f"{wait_s:.0f}s after the run ended; ending it\n"
                )
                _end(proc)
    except KeyboardInterrupt:
        running = [proc for proc in procs if proc.poll() is None]
        if running:
            pids = ", ".join(str(proc.pid) for proc in running)
            _write(f"nanolab: interrupted while waiting for the ranks this launch started; "
                   f"ending them (pid {pids})\n")  # fmt: skip
        for proc in running:
            _end(proc)


def _end(proc: Any) -> None:
    """SIGKILL a launched rank and reap it (a zombie would still hold its pid)."""
    with contextlib.suppress(OSError):
        proc.kill()
    proc.wait()


def ranks_wait_s(exit_code: object) -> float:
    """How long the end of a launch that exits with ``exit_code`` waits for its ranks."""
    return RANKS_END_WAIT_S if exit_code in RANKS_END_TOGETHER else RANKS_ERROR_WAIT_S


def arm_watchdog(
    sig: signal.Signals,
    run_dir: Callable[[], Path | None],
    before_exit: Callable[[], None] | None = None,
) -> None:
    """End the process :data:`START_GRACE_S` seconds from now unless :func:`disarm_watchdog`
    is called first: a held signal must not wait for a step or safe point that never comes.

    ``run_dir`` says, when the time is up, where a checkpoint to resume from would be;
    ``before_exit`` runs just before the process ends (rank 0 ends the ranks it launched).
    """
    global _watchdog
    disarm_watchdog()
    _watchdog = threading.Timer(START_GRACE_S, _give_up, args=(sig, run_dir, before_exit))
    _watchdog.daemon = True
    _watchdog.start()


def disarm_watchdog() -> None:
    """A safe point was reached (or the run is over): the watchdog has nothing to do."""
    global _watchdog
    if _watchdog is not None:
        _watchdog.cancel()
        _watchdog = None


def _give_up(
    sig: signal.Signals,
    run_dir: Callable[[], Path | None],
    before_exit: Callable[[], None] | None = None,
) -> None:
    """From the watchdog's thread: exit 75 if there is a checkpoint to resume, else die by
    ``sig`` (its default action, as if no handler had been installed)."""
    folder = run_dir()
    if before_exit is not None:
        with contextlib.suppress(Exception):
            before_exit()
    if has_checkpoint(folder):
        _write(
            f"nanolab: no safe point within {START_GRACE_S:.0f}s of {sig.name} before the first "
            f"step; exiting with code {EXIT_PREEMPTED}, rerun the same command to resume from "
            f"{folder}\n"
        )
        os._exit(EXIT_PREEMPTED)
    _write(
        f"nanolab: no safe point within {START_GRACE_S:.0f}s of {sig.name} before the first "
        f"step and nothing to resume; exiting by {sig.name}\n"
    )
    die_by(sig)


def has_checkpoint(run_dir: Path | None) -> bool:
    """Whether ``run_dir`` holds a complete checkpoint (``run.resume auto`` would take it)."""
    if run_dir is None:
        return False
    with contextlib.suppress(OSError):
        return any(p.suffix == ".ckpt" for p in (run_dir / "checkpoints").iterdir())
    return False


def die_by(sig: signal.Signals) -> None:
    """End the process by ``sig``'s default action, from any thread (Python's own
    ``signal.signal`` works in the main thread only, which may be stuck)."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal(int(sig), ctypes.c_void_p(0))  # SIG_DFL
        os.kill(os.getpid(), sig)
        time.sleep(1.0)  # delivery is asynchronous to this thread
    os._exit(128 + int(sig))  # what a shell reports for a death by the signal


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
    disarm_watchdog()
    for sig, previous in list(_previous.items()):
        if signal.getsignal(sig) == _handle:
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
    _previous.clear()
    if deliver and _received is not None:
        os.kill(os.getpid(), _received[0])


def defer(run_dir: str | Path | None = None) -> None:
    """From here start-up writes (data, the run directory): a signal is held to the next safe
    point, :data:`START_GRACE_S` seconds at most. ``run_dir``: where the run's checkpoints
    are, once known."""
    global _deferring, _run_dir
    stop_if_received()
    _deferring = True
    if run_dir is not None:
        _run_dir = Path(run_dir)


@contextlib.contextmanager
def ranks_end_with_launch(verb: str = "fit") -> Iterator[Launch]:
    """One launch of ``verb`` (``fit``, ``validate``, ``test``) that owns the process: the
    ranks it launches die with it, and it ends after them.

    A rank launched from here (it re-runs the command) arms :func:`die_with_launcher` first
    thing; rank 0 names itself their launcher (:data:`LAUNCHER_ENV`) and at the end waits for
    them: the whole :data:`RANKS_END_WAIT_S` when the run ends as its ranks do
    (``Launch.exit_code`` or a ``SystemExit`` in :data:`RANKS_END_TOGETHER`), only
    :data:`RANKS_ERROR_WAIT_S` when it failed on its own. Every verb that can launch ranks runs
    inside it: a ``validate`` rank left behind by a SIGKILLed rank 0 waited in the rendezvous.
    """
    die_with_launcher(verb)
    launcher = os.environ.get(LAUNCHER_ENV)
    if not launched_by_rank_zero():
        os.environ[LAUNCHER_ENV] = str(os.getpid())  # for the ranks launched from here
    launch = Launch()
    try:
        yield launch
    except SystemExit as stop:
        launch.exit_code = stop.code if isinstance(stop.code, int) else 1
        raise
    except BaseException:
        launch.exit_code = 1
        raise
    finally:
        if launcher is None:
            os.environ.pop(LAUNCHER_ENV, None)
        else:
            os.environ[LAUNCHER_ENV] = launcher
        wait_for_launched_ranks(ranks_wait_s(launch.exit_code or 0))


@contextlib.contextmanager
def held_during_startup(names: tuple[str, ...] = DEFAULT_SIGNALS) -> Iterator[Launch]:
    """Install the handlers for one ``fit`` that owns the process; afterwards put back the
    handlers found before it, whatever the run (or Lightning's teardown) left installed.

    Its ranks die with it and it ends after them (:func:`ranks_end_with_launch`), once the
    handlers are back: a signal during that wait is theirs.
    """
    global _received, _deferring, _run_dir
    main = threading.current_thread() is threading.main_thread()
    before = {}
    if main:
        for name in names:
            sig = getattr(signal, name, None)
            if isinstance(sig, signal.Signals):
                before[sig] = signal.getsignal(sig)
    _received, _deferring, _run_dir = None, False, None  # whatever an earlier run left
    with ranks_end_with_launch("fit") as launch:
        install(names)
        try:
            yield launch
        finally:
            disarm_watchdog()
            for sig, handler in before.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
            _previous.clear()
            _received, _deferring, _run_dir = None, False, None  # the next run: unsignalled


def stop_if_received(where: str = "") -> None:
    """At a safe point of start-up: exit 75 (via :class:`PreemptedBeforeStart`) if signalled."""
    sig = received()
    if sig is None or launched_by_rank_zero():
        return  # a launched rank stops with the others, at the first step's start
    disarm_watchdog()
    _say_preempted(sig, where)
    raise PreemptedBeforeStart(sig.name)


def _say_preempted(sig: signal.Signals, where: str = "") -> None:
    _write(
        f"nanolab: preempted by {sig.name} before the first step{where}; nothing was trained "
        f"or written; exiting with code {EXIT_PREEMPTED}, rerun the same command to start\n"
    )


def _inside_an_import(frame: FrameType | None) -> bool:
    """Whether the interrupted code is running a module's import (importlib's frames)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _write(text: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        os.write(sys.stderr.fileno(), text.encode())
