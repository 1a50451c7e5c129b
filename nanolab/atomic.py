"""A file replaced whole, through a temporary name of this call's own.

Every writer of a file the user names or shares (``eval --json``, a run's skip ledger, the
estimator's cache, the shipped cloze file) replaces it the same way: the new content goes to a
fresh file made by :func:`create_temp` beside it, is synced, and is renamed over the old
name with :func:`os.replace`. A fixed temporary name (``.<name>.tmp``) is not enough: a link
planted there (a hard link into another run's log, a symlink to another run's config) would be
written through, a folder there fails the write, and two shells writing the same file would
write into, publish or delete each other's half-written copy. :func:`create_temp` creates the
file itself (``O_EXCL``), so nothing that stood at its name is ever written through.

A writer that streams (a checkpoint's ``torch.save``) or writes through a claimed folder's
descriptor takes the same kind of file from :func:`create_temp`; one that hands a name to
someone else's writer (Lightning's ``save_checkpoint``) takes a fresh, unguessable
:func:`temp_name`, where no link can have been planted beforehand.
"""

from __future__ import annotations

import contextlib
import os
import secrets
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
        fd, name = create_temp(path)
    except OSError as err:
        err.filename = str(path)
        raise
    try:
        with os.fdopen(fd, "wb") as f:
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


def temp_name(path: str | os.PathLike[str]) -> Path:
    """A temporary name beside ``path`` that nothing stands at now: ``.<name>.<random>.tmp``.

    Sixteen random hex digits, so no link can have been planted there in advance (a fixed
    ``<name>.tmp`` can be: by another tool, or left by an older crash). The leading dot and the
    ``.tmp`` ending keep it out of every listing of checkpoints, and a run clears such leftovers
    from its checkpoint folder when it claims it."""
    path = Path(path)
    while True:
        name = path.with_name(f".{path.name}.{secrets.token_hex(TEMP_HEX_BYTES)}.tmp")
        if not os.path.lexists(name):
            return name


#: Random bytes in a :func:`temp_name` (written as twice as many hex digits).
TEMP_HEX_BYTES = 8


def is_temp_name(name: str) -> bool:
    """Whether ``name`` has the shape of a :func:`temp_name` (``.<name>.<16 hex>.tmp``): what
    a save cut short leaves behind, and the only folders a claim may clear as leftovers."""
    if not (name.startswith(".") and name.endswith(".tmp")):
        return False
    stem, dot, digits = name[1 : -len(".tmp")].rpartition(".")
    return (
        bool(stem and dot)
        and len(digits) == 2 * TEMP_HEX_BYTES
        and all(c in "0123456789abcdef" for c in digits)
    )


#: A new file that must be this call's own: never an existing file, never through a link.
_NEW_FILE = (
    os.O_WRONLY
    | os.O_CREAT
    | os.O_EXCL
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_BINARY", 0)
)


def create_temp(path: str | os.PathLike[str], dir_fd: int | None = None) -> tuple[int, Path]:
    """(descriptor open for writing, its name): a new empty file at a :func:`temp_name` beside
    ``path``, created by this call (``O_EXCL``), so whatever stood at a name is never written
    through; with the mode a plain ``open`` gives (0666 less the umask). ``dir_fd``: the folder
    held by descriptor that holds ``path`` (:class:`nanolab.claimed.ClaimedDir`), created there
    by name, never through a link swapped in for the folder."""
    for _ in range(100):
        name = temp_name(path)
        try:
            where = name if dir_fd is None else name.name
            return os.open(where, _NEW_FILE, 0o666, dir_fd=dir_fd), name
        except FileExistsError:  # taken between the look and the create: draw again
            continue
    raise FileExistsError(f"no free temporary name beside {path}")


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
