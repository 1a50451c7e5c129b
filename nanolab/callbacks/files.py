"""Durable file operations the run's writers share: a ``.tmp`` name, publishing it, removing.

A checkpoint (or the run's ``config.yaml``) must be complete under its final name or absent, and
what was renamed must survive a power cut. The rotation callback, the atomic ``CheckpointIO``, the
preemption handler's fallback and the config writer all need the same moves, so they live here
once.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from nanolab.atomic import fsync_dir


def tmp_path(path: str | os.PathLike[str]) -> Path:
    """The name a file is written under before it is renamed into place (``<name>.tmp``)."""
    path = Path(path)
    return path.with_name(path.name + ".tmp")


def publish(tmp: Path, path: Path) -> None:
    """Rename a complete ``tmp`` (a file, or a folder of shards) to ``path``, durably.

    The data is fsynced before the rename and the folder after it, so after a crash ``path`` is
    either the old version or the whole new one.
    """
    files = [f for f in tmp.rglob("*") if f.is_file()] if tmp.is_dir() else [tmp]
    for file in files:
        with open(file, "rb+") as f:
            os.fsync(f.fileno())
    if tmp.is_dir() and path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)  # os.replace cannot replace a non-empty folder
    os.replace(tmp, path)
    fsync_dir(path.parent)


def remove(path: Path) -> None:
    """Delete a file, a link or a folder tree; a path that is already gone is not an error."""
    with contextlib.suppress(FileNotFoundError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def write_text(path: Path, text: str) -> None:
    """``text`` as the file ``path``, complete or not at all: written to its ``.tmp`` name,
    then renamed into place by :func:`publish`. A failed write (a full disk) removes the
    ``.tmp`` and raises the ``OSError`` naming ``path``, so the one error line says which file
    could not be written (a failed ``write`` carries no file name of its own)."""
    tmp = tmp_path(path)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        publish(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            remove(tmp)
        err.filename = str(path)
        raise
