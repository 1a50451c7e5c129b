"""What nanolab says besides a command's output: notes and warnings, through ``logging``.

A command's output (a table, generated text, JSON, ``fit``'s banner and progress) is printed to
stdout, where a pipe or a file takes it. Everything else it says on the way (``using
runs/x/checkpoints/last.ckpt``, ``note: ...``, ``warning: ...``) goes through the ``nanolab``
logger, so one flag sets how much of it a user sees, for every verb::

    nanolab -q <verb> ...      # warnings and errors only
    nanolab -v <verb> ...      # also debug detail
    NANOLAB_VERBOSITY=quiet    # the same for a whole shell, and for the processes a command
                               # starts (the queue's jobs)

Errors are not log messages: a refused command prints its one ``error:`` line and exits 2
whatever the verbosity (:mod:`nanolab.errors`).

Used as a library (a notebook, a fork's script, a verb's ``main`` called in-process) nothing is
configured on import; the first message configures the ``nanolab`` logger as the command line
does, unless the application has given that logger a handler of its own first (then its
handlers and level decide).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

LOGGER = logging.getLogger("nanolab")

#: Inherited by child processes: ``quiet``, ``normal`` or ``verbose``.
ENV = "NANOLAB_VERBOSITY"
LEVELS = {"quiet": logging.WARNING, "normal": logging.INFO, "verbose": logging.DEBUG}
FLAGS = {"-q": "quiet", "--quiet": "quiet", "-v": "verbose", "--verbose": "verbose"}


class _StderrHandler(logging.Handler):
    """The message as it is, to the current ``sys.stderr`` (tests and tools swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(record.getMessage() + "\n")
            sys.stderr.flush()
        except Exception:  # a closed stderr must not end the run
            self.handleError(record)


def split_verbosity(args: list[str]) -> tuple[str | None, list[str]]:
    """The verbosity flags given before the verb (``nanolab -q fit ...``) and the rest."""
    chosen = None
    while args and args[0] in FLAGS:
        chosen = FLAGS[args[0]]
        args = args[1:]
    return chosen, args


def verbosity() -> str:
    """The verbosity asked for: :data:`ENV`, else ``verbose`` under the older
    ``NANOLAB_VERBOSE=1``, else ``normal``."""
    chosen = os.environ.get(ENV, "").strip().lower()
    if chosen in LEVELS:
        return chosen
    return "verbose" if os.environ.get("NANOLAB_VERBOSE", "").strip() not in ("", "0") else "normal"


def configure(chosen: str | None = None) -> str:
    """Show the ``nanolab`` logger's messages on stderr at ``chosen`` (else
    :func:`verbosity`). Quiet also quiets
    Lightning's start-up lines (``GPU available: ...``); verbose keeps all of them (see
    :mod:`nanolab.run.quiet`). Returns the level used."""
    if chosen not in LEVELS:
        chosen = verbosity()
    LOGGER.setLevel(LEVELS[chosen])
    if not any(isinstance(h, _StderrHandler) for h in LOGGER.handlers):
        LOGGER.addHandler(_StderrHandler())
    LOGGER.propagate = False
    for name in _LIGHTNING_LOGGERS:
        lightning = logging.getLogger(name)
        if chosen == "quiet":
            _QUIETED.setdefault(name, lightning.level)
            lightning.setLevel(logging.WARNING)
        elif name in _QUIETED:  # a quiet call earlier in this process: its levels come back
            lightning.setLevel(_QUIETED.pop(name))
    return chosen


#: The loggers whose start-up lines quiet also quiets, and the levels quiet replaced: a command
#: run in the same process after a quiet one (a script calling ``nanolab.cli.main`` twice)
#: shows Lightning's resume notes again.
_LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch")
_QUIETED: dict[str, int] = {}


def _ready() -> None:
    """Configure on first use unless the application gave the logger a handler first."""
    if not LOGGER.handlers:
        configure()


def say(prog: str, text: str) -> None:
    """An informational line: ``nanolab generate: using runs/x/checkpoints/last.ckpt``."""
    _ready()
    LOGGER.info("%s: %s", prog, text)


def note(prog: str, text: str) -> None:
    """Something worth knowing that changes nothing: ``nanolab export: note: ...``."""
    _ready()
    LOGGER.info("%s: note: %s", prog, text)


def warn(prog: str, text: str) -> None:
    """Something that may need the user's action: ``nanolab: warning: ...`` (shown when quiet)."""
    _ready()
    LOGGER.warning("%s: warning: %s", prog, text)


def debug(prog: str, text: str) -> None:
    """Detail for ``-v``."""
    _ready()
    LOGGER.debug("%s: %s", prog, text)


def warn_line(text: str) -> None:
    """A warning already worded in full (``nanolab: warning: ...`` or a resume's own line)."""
    _ready()
    LOGGER.warning("%s", text)


@contextlib.contextmanager
def flag_verbosity(chosen: str | None) -> Iterator[None]:
    """Inside, a verbosity given on the command line holds for this process (the logger's
    level) and for the processes it starts (:data:`ENV`); put back afterwards."""
    before = os.environ.get(ENV)
    if chosen is not None:
        os.environ[ENV] = chosen
    configure(chosen)
    try:
        yield
    finally:
        if chosen is not None:
            if before is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = before
