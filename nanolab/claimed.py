"""A folder a run claimed at start-up, held open, so its writes cannot be redirected later.

A run resolves its folders once, when it claims them. After that, anyone can swap a path under
it: ``mv runs/a/checkpoints x; ln -s ../b/checkpoints runs/a/checkpoints`` turns every later
``runs/a/checkpoints/...`` path into one of run ``b``'s files, and a path-based write would
overwrite ``b``'s checkpoints and a path-based rotation would delete them. :class:`ClaimedDir`
keeps a descriptor of the folder as it was claimed; writes go through it (``dir_fd=``), and
:meth:`ClaimedDir.check` refuses to go on once the path no longer leads to that folder (a link,
a move, a replacement), with one line that says where the run's files are now.

This module is imported by the run log writer, which readers of a run import too: it needs only
the standard library.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from nanolab.errors import NanolabError


class LeftClaimedDir(NanolabError):
    """A path the run writes no longer leads to the folder it claimed; the run stops, keeping
    everything (nothing is written or deleted through the new path)."""


class ClaimedDir:
    """A folder held by descriptor from the moment the run claims it.

    ``path`` is the folder as configured (``runs/a/checkpoints``), ``real`` where it led at claim
    time (links followed once, then fixed). A link put there later, a move of the folder or of
    one above it, or a new folder in its place: :meth:`check` raises :class:`LeftClaimedDir`.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(os.path.abspath(path))
        self.real = Path(os.path.realpath(self.path))
        flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
        self.fd: int | None = os.open(self.real, flags)
        st = os.fstat(self.fd)
        self.ident = (st.st_dev, st.st_ino)

    def moved(self) -> str | None:
        """Why ``path`` no longer leads to the claimed folder (None: it still does)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return f"{self.path} is gone"
        real = Path(os.path.realpath(self.path))
        if real != self.real:
            return f"{self.path} now leads to {real}"
        if (st.st_dev, st.st_ino) != self.ident:
            return f"{self.path} is another folder than the one claimed at start-up"
        return None

    def check(self, what: str) -> None:
        """Raise :class:`LeftClaimedDir` (nothing written) if ``path`` moved; ``what`` is the
        file about to be written or deleted, for the message."""
        why = self.moved()
        if why is not None and self.deleted():
            raise LeftClaimedDir(
                f"{self.path} was deleted while the run wrote it, with the files it held; "
                f"stopped without writing {what}. If other checkpoints of this run are on disk, "
                "point --run.resume at one; otherwise start the run over with --run.fresh true "
                "(its log moves to previous/)"
            )
        if why is not None:
            raise LeftClaimedDir(
                f"{why} (a link or a move since this run claimed it); stopped without writing "
                f"{what} there, so no other run's files are touched. This run's files are intact "
                f"in {self.where_now()}: put that folder back at {self.path} and rerun the same "
                "command to resume"
            )

    def deleted(self) -> bool:
        """Whether the claimed folder itself was removed (``rm -rf``), not moved: it has no name
        left, so there is no "where it is now" to point at."""
        if self.fd is None:
            return False
        try:
            return os.fstat(self.fd).st_nlink == 0
        except OSError:
            return False

    def where_now(self) -> Path:
        """Where the claimed folder is now (it may have been moved); its old path if unknown."""
        if self.fd is not None:
            with contextlib.suppress(OSError):
                return Path(os.readlink(f"/proc/self/fd/{self.fd}"))
        return self.real

    def holds(self, path: str | os.PathLike[str]) -> bool:
        """Whether ``path`` names an entry directly in this folder (as configured or claimed)."""
        parent = Path(os.path.abspath(path)).parent
        return parent in (self.path, self.real)

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:
        self.close()
