"""One error type for everything a user can get wrong, and one way to report it.

Every error that a user can fix (a config key, a file, an option, a run directory in use, a full
disk) is a :class:`NanolabError`: its message names what is wrong and how to fix it, in one line.
Each verb's ``main`` is wrapped in :func:`one_line_errors`, the only place that turns such an
error into ``nanolab <verb>: error: <message>`` on stderr and exit code 2 (74 for a write
refused for room: :func:`exit_code`), with no traceback.
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

#: Exit code of a run stopped by a full disk, a quota or a file-size limit while writing a
#: checkpoint or its log (sysexits' EX_IOERR; :func:`out_of_room`): make room and rerun the same
#: command, it resumes from the newest complete checkpoint. The queue marks such a job failed (a
#: person must act).
EXIT_DISK_FULL = 74


#: Exit code of a run that crashed: a bug's traceback, or one line where nanolab knows the cause
#: (a rank of a multi-process run killed: ``nanolab.callbacks.lost_rank``). Not 75 ("try again
#: later"): a rank the out-of-memory killer ended is likely ended again by an unchanged rerun,
#: so a retry loop or the queue must not rerun it by itself. The checkpoints are intact: a rerun of
#: the same command resumes from the newest complete one.
EXIT_CRASHED = 1


def disk_full(err: BaseException) -> bool:
    """Whether ``err`` is a write that failed for lack of space (ENOSPC, EDQUOT)."""
    import errno

    return getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT)


def out_of_room(err: BaseException) -> bool:
    """Whether ``err`` is a write refused for room: no space (ENOSPC), a quota (EDQUOT), or a
    file-size limit (EFBIG: ``ulimit -f``, FAT32's 4 GiB). Such a run stops with its earlier
    files intact and the same command resumes it once there is room, so it exits
    :data:`EXIT_DISK_FULL`, never 2 (bad input: nothing was written)."""
    import errno

    return disk_full(err) or getattr(err, "errno", None) == errno.EFBIG


def file_size_limit() -> int | None:
    """This process's largest file in bytes (``ulimit -f``; None: unlimited, or a system
    without the limit)."""
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    except (ImportError, OSError, ValueError):
        return None
    return None if limit == resource.RLIM_INFINITY else int(limit)


def size_limit_met(target: str = "run.root") -> tuple[str, str]:
    """For a write refused with EFBIG: the limit it met, this process's (``ulimit -f``, as a
    batch system may set it) or else the file system's own (FAT32: 4 GiB), and the fix, which
    moves ``target`` (the setting or option that names where the file goes) elsewhere in the
    second case. Free space is beside the point: freeing it would not help."""
    limit = file_size_limit()
    if limit is not None:
        return (
            f"this process's file-size limit (ulimit -f: {size_text(limit)})",
            "raise the limit (ulimit -f unlimited, or ask for it in the job's settings)",
        )
    return (
        "the file system's maximum file size",
        f"put {target} on a file system that holds files that large (not FAT32)",
    )


def storage_refused(err: BaseException) -> bool:
    """Whether ``err`` is the file system refusing a write: read-only, no permission, full,
    past a file-size limit. The user fixes those (another folder, free space, a higher limit),
    so each verb says them in one line instead of a traceback, whichever write met them."""
    import errno

    return isinstance(err, OSError) and getattr(err, "errno", None) in (
        errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT, errno.EFBIG,
    )  # fmt: skip


def size_text(nbytes: float) -> str:
    """Bytes as GB (MB or kB when small, so a tiny file does not read "0.00 GB")."""
    if nbytes >= 1e8:
        return f"{nbytes / 1e9:.2f} GB"
    if nbytes >= 1e5:
        return f"{nbytes / 1e6:.2f} MB"
    return f"{nbytes / 1e3:.0f} kB"


#: Fewer free file entries (inodes) than this, where a write failed for lack of space, means the
#: entries ran out rather than the bytes: a checkpoint save takes two (its ``.tmp`` and the link
#: that becomes ``last.ckpt``), and the failed write's ``.tmp`` is removed before they are counted.
FEW_INODES = 16


def inodes_left(folder: str | os.PathLike[str]) -> tuple[int, int] | None:
    """``(free, total)`` file entries (inodes) of the file system holding ``folder`` when they
    have run out (fewer than :data:`FEW_INODES` free), else None. "No space left on device" is
    the kernel's word for both; the bytes may be plentiful. None too where the file system does
    not count entries (``f_files`` 0: btrfs, many network file systems) or has no ``statvfs``."""
    try:
        st = os.statvfs(folder)
    except (OSError, AttributeError):
        return None
    if st.f_files == 0 or st.f_ffree >= FEW_INODES:
        return None
    return st.f_ffree, st.f_files


def room_left(folder: str | os.PathLike[str], err: OSError) -> tuple[str, str]:
    """For ``err``, a write in ``folder`` refused for lack of space: what is left there
    (``"12 kB free there"``: how much to free is the first thing the user asks) and the fix.
    When the file entries ran out (ENOSPC with bytes to spare), both say so: freeing bytes
    would not help."""
    import errno
    import shutil

    folder = os.path.abspath(folder)
    while not os.path.exists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)  # a folder that could not be made: its parent's disk
    try:
        free = size_text(shutil.disk_usage(folder).free)
    except OSError:
        return "free space unknown", "free space there, or write elsewhere"
    entries = inodes_left(folder) if err.errno == errno.ENOSPC else None
    if entries is None:
        return f"{free} free there", "free space there, or write elsewhere"
    left = f"no file entries (inodes) left there: {entries[0]} of {entries[1]}, {free} free"
    return left, (
        "delete files you no longer need on that file system (each file takes one entry, "
        "whatever its size), or write elsewhere"
    )


def storage_message(err: OSError) -> str:
    """The one line for a refused write, naming the path and the fix."""
    import errno

    where = err.filename or "a file"
    what = err.strerror or str(err)
    if disk_full(err):
        fix = "free space there, or write elsewhere"
        if err.filename:
            left, fix = room_left(os.path.dirname(os.path.abspath(where)), err)
            what = f"{what}; {left}"
        return f"cannot write {where} ({what}); {fix}"
    if err.errno == errno.EFBIG:  # a size limit: free space would not help
        limit, fix = size_limit_met("it")
        return f"cannot write {where} ({what}: {limit}); {fix}"
    if err.errno == errno.EROFS:
        return f"cannot write {where} ({what}); choose a folder on a writable file system"
    return f"cannot use {where} ({what}); choose a path this user can read and write"


class NanolabError(ValueError):
    """A problem the user can fix; ``str(err)`` is the whole one-line message.

    ``field`` (the config key, option or file at fault) and ``fix`` (what to do) are optional
    structured parts; when given they are appended to the message as ``"<field>: <problem>;
    <fix>"`` so that every message carries them in the same order.
    """

    #: The refused write's ``OSError.errno`` when the problem is one (set by
    #: :func:`with_errno_of`): a full disk, a quota or a file-size limit exits
    #: :data:`EXIT_DISK_FULL` in every verb, not 2 (:func:`exit_code`).
    errno: int | None = None

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


def written_whole(where: str, value: Any, shown: str | None = None) -> str | None:
    """For a whole-number setting given a float that is whole (``1e9``, ``1000.0``: YAML and the
    command line read an exponent as a float), the one line saying to write it whole; else
    None. Every reader of whole-number settings (the fit parser's reports, the resolver's and
    the model's checks) refuses such a value with this line, so ``fit``, ``estimate`` and
    ``queue add`` agree; ``shown``: the value as the user wrote it, when known."""
    if isinstance(value, bool) or not isinstance(value, float) or not value.is_integer():
        return None
    return (
        f"{where}: {shown or repr(value)} is read as a float and this setting takes a whole "
        f"number; write it whole: {int(value)}"
    )


Error = TypeVar("Error", bound=NanolabError)


def with_errno_of(error: Error, err: OSError | int) -> Error:
    """``error`` (the one line for the refused write ``err``, an ``OSError`` or its errno)
    carrying that errno, so the verb exits as the write failed: :data:`EXIT_DISK_FULL` for a
    full disk, a quota or a file-size limit (make room, rerun), 2 for anything else."""
    error.errno = err if isinstance(err, int) else err.errno
    return error


def exit_code(err: BaseException) -> int:
    """The exit code of a verb ended by ``err``: :data:`EXIT_DISK_FULL` for a write refused for
    room (:func:`out_of_room`: the error is the OSError, or carries its errno), else
    :data:`EXIT_USAGE`."""
    return EXIT_DISK_FULL if out_of_room(err) else EXIT_USAGE


def report(prog: str, err: BaseException) -> int:
    """Print ``err`` as ``<prog>: error: <message>`` on stderr; the exit code for it."""
    print(f"{prog}: error: {err}", file=sys.stderr)
    return exit_code(err)


def one_line_errors(prog: str | Callable[..., str]) -> Callable[[Main], Main]:
    """Decorate a verb's ``main(argv) -> int``: a :class:`NanolabError` is one line and exit 2
    (:data:`EXIT_DISK_FULL` for a write refused for room, as an unwrapped ``OSError`` of the kind).

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
                return report(name, with_errno_of(NanolabError(storage_message(err)), err))

        return run  # type: ignore[return-value]

    return wrap
