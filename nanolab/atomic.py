"""A file replaced whole, through a temporary name of this call's own.

Every writer of a file the user names or shares (``eval --json``, a run's skip ledger, the
estimator's cache, the shipped cloze file) replaces it the same way: the new content goes to a
fresh file made by :func:`tempfile.mkstemp` beside it, is synced, and is renamed over the old
name with :func:`os.replace`. A fixed temporary name (``.<name>.tmp``) is not enough: a link
planted there (a hard link into another run's log, a symlink to another run's config) would be
written through, a folder there fails the write, and two shells writing the same file would
write into, publish or delete each other's half-written copy. ``mkstemp`` creates the file
itself (``O_EXCL``), so nothing that stood at its name is ever written through.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_whole(
    path: str | os.PathLike[str], content: str | bytes, *, durable: bool = True
) -> None:
    """``content`` as the file ``path``, complete or not at all (a reader sees the old file or
    the new one). ``durable``: synced before the rename and the folder after it, so a power cut
    leaves one of the two as well. A failed write removes its temporary file and raises the
    ``OSError`` naming ``path`` (a failed ``write`` names no file of its own), so the one error
    line says which file could not be written."""
    path = Path(path)
    data = content.encode("utf-8") if isinstance(content, str) else content
    try:
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:
        err.filename = str(path)
        raise
    try:
        with os.fdopen(fd, "wb") as f:
            if hasattr(os, "fchmod"):  # mkstemp's 0600: the mode a plain open would give
                os.fchmod(f.fileno(), 0o666 & ~_umask())
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(name, path)
    except BaseException as err:  # a Ctrl-C too: its half copy goes
        with contextlib.suppress(OSError):
            os.unlink(name)
        if isinstance(err, OSError):
            err.filename, err.filename2 = str(path), None
        raise
    if durable:
        fsync_dir(path.parent)


def _umask() -> int:
    """This process's umask, read without changing it where the system says it (Linux); else
    set and put back at once."""
    with (
        contextlib.suppress(OSError, ValueError),
        open("/proc/self/status", encoding="ascii", errors="replace") as f,
    ):
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Persist a directory entry (a rename or a new file) on file systems that need it (a folder
    that cannot be opened, as on Windows, keeps its renames anyway). The one copy: the run's
    writers, the packing cache and :func:`write_whole` use it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)
