"""Durable file operations the run's writers share: publishing a temporary file, removing.

A checkpoint must be complete under its final name or absent, and what was renamed must survive
a power cut. The rotation callback, the atomic ``CheckpointIO`` and the preemption handler's
fallback all need the same moves, so they live here once. Their temporary names come from
:mod:`nanolab.atomic` (fresh and unguessable, created by the writer itself where it can be),
never a fixed ``<name>.tmp`` where a link planted beforehand would be written through; the
run's ``config.yaml`` is written whole by :func:`nanolab.atomic.write_whole`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from nanolab.atomic import fsync_dir


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
