"""Bad options to nanolab's own argparse verbs: one ``error:`` line naming the option, exit 2.

argparse alone prints its usage block first; every verb's parser is ``helpfmt.OneLineParser``
(a sub-command such as ``queue ls`` inherits it), so a log or a script sees one line.
"""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["report", "runs", "--gpu-hours", "abc"], "--gpu-hours"),
        (["queue", "ls", "--db"], "--db"),
        (["queue", "bogus"], "invalid choice: 'bogus'"),
        (["prepare", "--workers", "abc", "x", "-o", "out"], "--workers"),
        (["init"], "directory"),
        (["estimate", "--gpu-mem"], "--gpu-mem"),
        (["generate", "--temperature", "x"], "--temperature"),
        (["export", "--ckpt"], "--ckpt"),
        (["bench"], "--config"),
        (["bench", "--steps"], "--steps"),
        # An unset shell variable: Path("") would be the current folder, read as a run root.
        (["report", ""], "'' is an empty path"),
        (["status", ""], "'' is an empty path"),
    ],
)
def test_a_bad_option_is_one_line_and_exit_2(argv: list[str], names: str, tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "nanolab", *argv], capture_output=True, text=True, cwd=tmp_path
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    verb = " ".join(argv[:2]) if argv[0] == "queue" and argv[1] == "ls" else argv[0]
    assert lines[0].startswith(f"nanolab {verb}: error: "), lines[0]
    assert names in lines[0] and lines[0].endswith("--help`")
    assert "usage:" not in proc.stderr and "Traceback" not in proc.stderr
    assert not any(tmp_path.iterdir())  # nothing written
