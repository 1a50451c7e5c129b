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


@pytest.mark.parametrize(
    ("argv", "meant"),
    [
        (["generate", "--ckpt", "x", "--max_new_tokens", "5"], "--max-new-tokens"),
        (["prepare", "x", "-o", "out", "--bpe_vocab_size=300"], "--bpe-vocab-size"),
        (["estimate", "--config", "c.yaml", "--micro_batch_size", "8"], "--micro-batch"),
        (["queue", "ls", "--dbb", "q.db"], "--db"),  # a sub-command's option
    ],
)
def test_an_unknown_option_names_the_one_meant(argv: list[str], meant: str, tmp_path, capsys,
                                               monkeypatch) -> None:  # fmt: skip
    """fit's settings are spelt with ``_`` (``--data.micro_batch_size``), the verbs' options
    with ``-``: the other spelling is refused with the option meant, in the one line."""
    from nanolab.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.endswith(f"; did you mean {meant}?"), line
    assert not any(tmp_path.iterdir())  # nothing written


def test_an_unknown_option_with_none_near_points_at_help() -> None:
    from nanolab.helpfmt import unknown_option_hint

    options = ["--max-new-tokens", "--top-k", "--seed"]
    assert unknown_option_hint("unrecognized arguments: --xyzzy 3", options) is None
    assert unknown_option_hint("argument --seed: expected one argument", options) is None
    assert unknown_option_hint("unrecognized arguments: --top_k 5 --sed 1", options) == (
        "did you mean --top-k (for --top_k), --seed (for --sed)?"
    )


def test_a_sub_command_hint_draws_only_from_that_sub_command_options(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``queue ls --slot 2``: --slots is ``queue run``'s, so ls names none of it; its own near
    miss (``--jsn``: --json) is still named, by ls's own line."""
    from nanolab.queue.cli import build_parser

    for argv, ends in (
        (["ls", "--slot", "2"], "; see `nanolab queue ls --help`"),
        (["clear", "--jsn"], "; see `nanolab queue clear --help`"),
        (["ls", "--jsn"], "; did you mean --json?"),
    ):
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args(argv)
        assert exit_.value.code == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"nanolab queue {argv[0]}: error: "), line
        assert line.endswith(ends), line
