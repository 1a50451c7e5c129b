"""``nanolab queue ls > /dev/full`` (a full disk under a redirected listing): one line and exit
74, as ``status`` and ``report`` say it, not a traceback with exit 1. The queue's verbs go
through the same translation of a write refused for room (``errors.one_line_errors``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nanolab.errors import EXIT_DISK_FULL

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
@pytest.mark.parametrize("options", [(), ("--json",)], ids=["table", "json"])
def test_a_listing_into_a_full_device_is_one_line_and_exit_74(
    tmp_path: Path, options: tuple[str, ...]
) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "nanolab", "queue", "ls", *options, "--db", str(tmp_path / "q.db")],
            stdout=full, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path, timeout=120,
        )  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == EXIT_DISK_FULL, proc.stderr
    assert len(lines) == 1 and "No space left on device" in lines[0], proc.stderr
    assert lines[0].startswith("nanolab queue ls: error: cannot write"), lines


def test_the_queue_names_its_verb_in_its_errors() -> None:
    from nanolab.queue.cli import queue_prog

    assert queue_prog(["ls", "--db", "q.db"]) == "nanolab queue ls"
    assert queue_prog(["--help"]) == queue_prog([]) == "nanolab queue"
