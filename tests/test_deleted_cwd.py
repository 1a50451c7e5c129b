"""A shell still ``cd``-ed into a folder deleted since (a run folder cleaned up from another
shell, a scratch directory a job's epilogue removed): every verb says so in one line, exit 2,
instead of a traceback from the first relative path, a false "the queue database cannot be
opened" (there is none), or torch's native fatal error at import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINE = "the working directory no longer exists: cd to an existing folder"


def _in_deleted_folder(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """``nanolab ARGS`` started by a shell whose working directory was removed under it."""
    gone = tmp_path / "gone"
    gone.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    script = 'cd "$1" && rmdir "$1" && shift && exec "$@"'
    return subprocess.run(
        ["sh", "-c", script, "sh", str(gone), sys.executable, "-m", "nanolab", *args],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize(
    "args",
    [
        ("status",),
        ("report",),
        ("queue", "ls"),
        ("queue", "ls", "--db", "{tmp}/q.db"),
        ("fit", "--config", str(REPO / "configs" / "quickstart.yaml")),
    ],
    ids=["status", "report", "queue-ls", "queue-ls-db", "fit"],
)
def test_a_verb_in_a_deleted_working_directory_says_so_in_one_line(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    proc = _in_deleted_folder(tmp_path, *argv)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"nanolab {argv[0]}: error: {LINE}"
    assert not (tmp_path / "q.db").exists()  # nothing was written


def test_version_and_help_need_no_working_directory(tmp_path: Path) -> None:
    proc = _in_deleted_folder(tmp_path, "--version")
    assert proc.returncode == 0 and proc.stdout.startswith("nanolab "), proc.stderr


def test_status_and_report_of_folders_given_in_full_need_no_working_directory(
    tmp_path: Path,
) -> None:
    """The refusal came before any verb ran: ``status /abs/runs`` and ``report /abs/runs``,
    which read only the paths given in full and import no torch, were refused too. They work
    as before; a relative path, or none (``runs``), is still refused in one line."""
    import json

    run = tmp_path / "runs" / "a"
    run.mkdir(parents=True)
    records = [{"event": "start", "time": 1.0, "step": 0, "run_name": "a"},
               {"event": "train", "time": 2.0, "step": 1, "loss": 3.0},
               {"event": "end", "time": 3.0, "step": 1, "reason": "completed", "elapsed_s": 2.0}]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    runs = str(tmp_path / "runs")
    for verb in ("status", "report"):
        proc = _in_deleted_folder(tmp_path, verb, runs)
        assert proc.returncode == 0, proc.stderr
        assert "a " in proc.stdout and "completed" in proc.stdout, proc.stdout
        proc = _in_deleted_folder(tmp_path, verb, "runs")
        assert proc.returncode == 2 and proc.stderr.strip() == f"nanolab {verb}: error: {LINE}"
    proc = _in_deleted_folder(tmp_path, "report", runs, "--plot", "loss.png")
    assert proc.returncode == 2 and proc.stderr.strip() == f"nanolab report: error: {LINE}"
