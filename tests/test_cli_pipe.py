"""A reader that leaves early (``nanolab ... | head``) ends the command quietly."""

from __future__ import annotations

import os
import subprocess
import sys


def test_a_closed_stdout_pipe_is_not_a_traceback() -> None:
    read, write = os.pipe()
    os.close(read)  # the reader is gone before nanolab writes a byte
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "nanolab", "estimate", "--list-gpus", "--json"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)
    assert proc.returncode == 141, proc.stderr
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
