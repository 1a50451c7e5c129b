"""One error type for everything a user can get wrong, and one way to report it.

Every error that a user can fix (a config key, a file, an option, a run directory in use, a full
disk) is a :class:`NanolabError`: its message names what is wrong and how to fix it, in one line.
Each verb's ``main`` is wrapped in :func:`one_line_errors`, the only place that turns such an
error into ``nanolab <verb>: error: <message>`` on stderr and exit code 2, with no traceback.
Anything else is a bug of ours (or of a fork's) and keeps its traceback.

The error classes of the modules (``RunConfigError``, ``EstimateError``, ``PrepareError``, ...)
subclass it, so a caller can still catch the narrow kind, and ``ValueError`` keeps working for
code written against the older classes.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

#: Exit code of every verb for input that cannot work (the message says why).
EXIT_USAGE = 2

#: Exit code of a run stopped by a full disk (or quota) while writing a checkpoint or its log
#: (sysexits' EX_IOERR): free space and rerun the same command, it resumes from the newest
#: complete checkpoint. The queue marks such a job failed (a person must act).
EXIT_DISK_FULL = 74


def disk_full(err: BaseException) -> bool:
    """Whether ``err`` is a write that failed for lack of space (ENOSPC, EDQUOT)."""
    import errno

    return getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT)


def storage_refused(err: BaseException) -> bool:
    """Whether ``err`` is the file system refusing a write: read-only, no permission, full.
    The user fixes those (another folder, free space), so each verb says them in one line
    instead of a traceback, whichever write met them."""
    import errno

    return isinstance(err, OSError) and getattr(err, "errno", None) in (
        errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT,
    )  # fmt: skip


def size_text(nbytes: float) -> str:
    """Bytes as GB (MB or kB when small, so a tiny file does not read "0.00 GB")."""
    if nbytes >= 1e8:
        return f"{nbytes / 1e9:.2f} GB"
    if nbytes >= 1e5:
        return f"{nbytes / 1e6:.2f} MB"
    return f"{nbytes / 1e3:.0f} kB"


def free_space(folder: str | os.PathLike[str]) -> str:
    """What is left where a write failed (``"12 kB free there"``), for its error line: how much
    to free is the first thing the user asks."""
    import shutil

    try:
        return f"{size_text(shutil.disk_usage(folder).free)} free there"
    except OSError:
        return "its folder is gone"


def storage_message(err: OSError) -> str:
    """The one line for a refused write, naming the path and the fix."""
    import errno

    where = err.filename or "a file"
    what = err.strerror or str(err)
    if disk_full(err):
        if err.filename:
            what = f"{what}; {free_space(os.path.dirname(os.path.abspath(where)))}"
        return f"cannot write {where} ({what}); free space there, or write elsewhere"
    if err.errno == errno.EROFS:
        return f"cannot write {where} ({what}); choose a folder on a writable file system"
    return f"cannot use {where} ({what}); choose a path this user can read and write"


class NanolabError(ValueError):
    """A problem the user can fix; ``str(err)`` is the whole one-line message.

    ``field`` (the config key, option or file at fault) and ``fix`` (what to do) are optional
    structured parts; when given they are appended to the message as ``"<field>: <problem>;
    <fix>"`` so that every message carries them in the same order.
    """

    def __init__(self, message: str = "", *, field: str | None = None, fix: str | None = None):
        self.problem = message
        self.field = field
        self.fix = fix
        text = message
        if field and not message.startswith(field):
            text = f"{field}: {text}"
        if fix:
            text = f"{text}; {fix}"
        super().__init__(text)


class RunConfigError(NanolabError):
    """A run setting that cannot work (``fit``, ``estimate``, ``queue add`` alike); the message
    names the key and the fix."""


Main = TypeVar("Main", bound=Callable[..., Any])


def report(prog: str, err: BaseException) -> int:
    """Print ``err`` as ``<prog>: error: <message>`` on stderr; the exit code for it."""
    print(f"{prog}: error: {err}", file=sys.stderr)
    return EXIT_USAGE


def one_line_errors(prog: str | Callable[..., str]) -> Callable[[Main], Main]:
    """Decorate a verb's ``main(argv) -> int``: a :class:`NanolabError` is one line and exit 2.

    ``prog`` is the verb's name as the user typed it (``"nanolab report"``), or a function of
    the call's arguments that says it (``queue`` names its sub-command).
    """

    def wrap(main: Main) -> Main:
        @functools.wraps(main)
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return main(*args, **kwargs)
            except NanolabError as err:
                name = prog(*args, **kwargs) if callable(prog) else prog
                return report(name, err)
            except OSError as err:
                if not storage_refused(err):
                    raise  # anything else is a bug of ours: its traceback stays
                name = prog(*args, **kwargs) if callable(prog) else prog
                report(name, NanolabError(storage_message(err)))
                return EXIT_DISK_FULL if disk_full(err) else EXIT_USAGE

        return run  # type: ignore[return-value]

    return wrap
