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


def test_stdout_reader_gone_is_told_with_nothing_left_to_flush() -> None:
    """A reader that left while nothing was buffered: only the pipe itself can say so."""
    probe = "import sys; from nanolab.cli import stdout_reader_gone; " \
        "sys.stderr.write(str(stdout_reader_gone()))"  # fmt: skip
    for reader_open in (False, True):
        read, write = os.pipe()
        if not reader_open:
            os.close(read)
        try:
            proc = subprocess.run(
                [sys.executable, "-c", probe], stdout=write, stderr=subprocess.PIPE, text=True,
                timeout=60,
            )  # fmt: skip
        finally:
            os.close(write)
            if reader_open:
                os.close(read)
        assert proc.stderr == str(not reader_open), proc.stderr


BROKEN_CHILD_PIPE = """
import subprocess, sys
from nanolab import cli

def main(argv):
    child = subprocess.Popen([sys.executable, "-c", "pass"], stdin=subprocess.PIPE)
    child.wait()  # gone: nothing reads its stdin
    child.stdin.write(b"x" * 100_000)
    child.stdin.flush()

sys.modules["broken_verb"] = type(sys)("broken_verb")
sys.modules["broken_verb"].main = main
cli.VERBS["broken"] = ("broken_verb:main", "writes to a child that has gone")
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_broken_pipe_to_a_child_is_an_error_line_not_a_silent_141() -> None:
    """Only a reader of stdout that left is SIGPIPE's quiet exit 141: a pipe to a child process
    that broke is an error, said in one line (the traceback under -v)."""
    for verbose in ([], ["-v"]):
        proc = subprocess.run(
            [sys.executable, "-c", BROKEN_CHILD_PIPE, *verbose, "broken"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 1, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert lines[-1].startswith(
            "nanolab broken: error: a pipe to another process closed early ([Errno 32] Broken "
            "pipe) at "
        ), proc.stderr
        assert lines[-1].endswith("please report it with the command (-v shows the traceback)")
        assert ("Traceback" in proc.stderr) == bool(verbose), proc.stderr
