"""What a ``--config`` path may be: a regular file, or the shell's ``<(...)`` pipe, read once
and checked like a file (a key given twice, an unknown key with its nearest known one) before
the parser reads the same text. A folder, a named FIFO (which would block the reader until
something writes to it) or a device is one line saying what the path is, exit 2."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import nanolab_here

BASE = "trainer:\n  accelerator: cpu\n  max_steps: 3\n"


@pytest.fixture
def work(tmp_path: Path) -> Path:
    (tmp_path / "base.yaml").write_text(BASE)
    os.mkfifo(tmp_path / "fifo.yaml")
    (tmp_path / "dir.yaml").mkdir()
    return tmp_path


def _one_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def test_fit_refuses_a_named_fifo_at_once_instead_of_waiting_for_a_writer(work: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "nanolab", "fit", "--config", "base.yaml", "--config", "fifo.yaml"],
        cwd=work, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert "--config fifo.yaml is a named pipe (FIFO), not a file" in _one_line(proc)


def test_fit_names_a_folder_as_estimate_and_queue_add_do(work: Path) -> None:
    line = _one_line(nanolab_here("fit", "--config", "base.yaml", "--config", "dir.yaml", cwd=work))
    assert line.endswith("--config dir.yaml is a folder; give a YAML file in it")


def test_an_empty_config_path_is_named_empty_not_this_folder(work: Path) -> None:
    """``Path('')`` is ``.``: fit and estimate said the empty path was a folder."""
    line = _one_line(nanolab_here("fit", "--config", "", cwd=work))
    assert line.endswith("--config is empty; give a YAML file, e.g. --config my.yaml")
    line = _one_line(nanolab_here("estimate", "--config", "", cwd=work))
    assert line.endswith("--config is empty; give a YAML file, e.g. --config my.yaml")  # fit's


def test_estimate_and_queue_add_say_what_a_fifo_is(work: Path) -> None:
    line = _one_line(nanolab_here("estimate", "--config", "fifo.yaml", cwd=work))
    assert "--config fifo.yaml is a named pipe (FIFO)" in line  # fit's line
    line = _one_line(nanolab_here("queue", "add", "--db", "q.db", "fifo.yaml", cwd=work))
    assert "config fifo.yaml is a named pipe (FIFO)" in line


def _bash(work: Path, command: str) -> subprocess.CompletedProcess:
    nanolab = f"{shlex.quote(sys.executable)} -m nanolab"
    return subprocess.run(
        ["bash", "-c", command.replace("nanolab", nanolab)],
        cwd=work, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_a_shell_pipe_is_checked_like_a_file(work: Path) -> None:
    twice = "nanolab fit --config base.yaml --config <(printf 'trainer:\\n  max_steps: 2\\n  max_steps: 1\\n')"
    assert "`max_steps` is given twice in one mapping (lines 2 and 3)" in _one_line(
        _bash(work, twice)
    )
    typo = "nanolab fit --config base.yaml --config <(printf 'trainer:\\n  max_stepz: 2\\n')"
    line = _one_line(_bash(work, typo))
    assert "unknown setting trainer.max_stepz; did you mean trainer.max_steps?" in line


def test_the_parser_reads_the_pipe_the_checks_read(work: Path) -> None:
    """The checks read the pipe first; the parser still gets its text (not an empty pipe)."""
    proc = _bash(
        work,
        "nanolab fit --config base.yaml --config <(printf 'trainer:\\n  max_steps: 2\\n') --print_config",
    )
    assert proc.returncode == 0, proc.stderr
    assert "  max_steps: 2\n" in proc.stdout


def test_estimate_reads_the_pipe_the_checks_read(work: Path) -> None:
    """The pipe's settings reach the estimate (the typed reading once read an emptied pipe,
    so the settings were silently dropped), and its keys are checked as fit checks them."""
    pipe = "<(printf 'model:\\n  gpt:\\n    n_layer: 3\\n')"
    warm = "nanolab estimate --config base.yaml --vocab-size 65 > /dev/null"  # fit's types kept
    proc = _bash(
        work, f"{warm} && nanolab estimate --config base.yaml --config {pipe} --vocab-size 65"
    )
    assert proc.returncode == 0, proc.stderr
    assert " 3 layers x " in proc.stdout
    typo = "nanolab estimate --config base.yaml --config <(printf 'trainer:\\n  precison: 32\\n')"
    assert "unknown setting trainer.precison; did you mean trainer.precision?" in _one_line(
        _bash(work, typo)
    )


def test_queue_add_refuses_a_shell_pipe_it_could_not_read_again(work: Path) -> None:
    line = _one_line(_bash(work, "nanolab queue add --db q.db <(cat base.yaml)"))
    assert "is a pipe the shell made (<(...)), read once" in line


def test_a_relative_data_path_not_found_says_it_was_read_from_the_current_folder(
    tmp_path: Path,
) -> None:
    """A project's config run from the folder above it: its relative ``data.source`` and
    ``data.dataset_dir`` are read from the current folder (the rule stays), and the line says
    so, naming the folder, with the two fixes (it said only "does not exist")."""
    project = tmp_path / "my-lm"
    (project / "configs").mkdir(parents=True)
    (project / "data" / "text").mkdir(parents=True)
    (project / "data" / "text" / "a.txt").write_text("hello world\n" * 50)
    config = project / "configs" / "x.yaml"
    config.write_text(
        BASE + "data:\n  dataset_dir: data/tokens\n  source: [data/text]\n  tokenizer: chars\n"
    )
    rule = (
        f"relative paths are read from the current folder ({tmp_path}), not the config file's: "
        "run from the folder the path is relative to (a project's own), or give an absolute path"
    )
    result = nanolab_here("fit", "--config", "my-lm/configs/x.yaml", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip() == (
        f"nanolab fit: error: data.source: source 'data/text' does not exist; {rule}"
    )
    result = nanolab_here(
        "fit", "--config", "my-lm/configs/x.yaml", "--data.source", "null", cwd=tmp_path
    )
    assert result.returncode == 2 and result.stderr.strip() == (
        "nanolab fit: error: data.dataset_dir data/tokens holds no prepared dataset (meta.json) "
        f"and does not exist; {rule}; or run `nanolab prepare` or set data.source"
    ), result.stderr[-2000:]
    assert not (tmp_path / "data").exists() and not (tmp_path / "runs").exists()
