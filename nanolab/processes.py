"""Processes on this machine, as the run lock and the queue see them."""

from __future__ import annotations

import os


def pid_alive(pid: int | None) -> bool:
    """Whether a process with ``pid`` exists on this machine (zombies count as gone)."""
    if not pid or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:  # a zombie has exited; only its parent has not reaped it yet
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True
