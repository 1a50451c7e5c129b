"""Which output gets a bar: a terminal with a width. An unsized pseudo-terminal (``ssh -tt`` from
a script, ``docker run -t``, ``srun --pty``, ``script``) reports 0 columns, where tqdm draws
nothing at all: it gets the plain lines a log file gets (a real pty, no training)."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import struct
import sys
import termios
from collections.abc import Iterator

import pytest

from nanolab.callbacks.progress import StepProgressBar, shows_a_bar


@pytest.fixture
def terminal() -> Iterator[tuple[io.TextIOWrapper, int]]:
    """A pseudo-terminal's writing end as a text stream, and its descriptor to size."""
    leader, follower = pty.openpty()
    stream = os.fdopen(follower, "w")
    try:
        yield stream, follower
    finally:
        stream.close()
        os.close(leader)


def _size(fd: int, rows: int, columns: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))


def test_a_terminal_of_zero_columns_gets_plain_lines(
    terminal: tuple[io.TextIOWrapper, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    stream, fd = terminal
    _size(fd, 0, 0)
    assert stream.isatty() and os.get_terminal_size(fd).columns == 0
    assert not shows_a_bar(stream)
    monkeypatch.setattr(sys, "stdout", stream)
    assert StepProgressBar(mode="auto", banner=False).plain


def test_a_sized_terminal_gets_the_bar(
    terminal: tuple[io.TextIOWrapper, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    stream, fd = terminal
    _size(fd, 24, 80)
    assert shows_a_bar(stream)
    monkeypatch.setattr(sys, "stdout", stream)
    assert not StepProgressBar(mode="auto", banner=False).plain
    assert StepProgressBar(mode="plain", banner=False).plain  # asked for: plain regardless


def test_a_file_or_a_stream_without_a_descriptor_gets_plain_lines(tmp_path) -> None:
    assert not shows_a_bar(io.StringIO())
    with open(tmp_path / "log", "w") as log:
        assert not shows_a_bar(log)
