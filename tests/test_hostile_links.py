"""Links and names that would point one run's writes at another run's files.

Each test swaps a path under a live run (a callback in the run's own config does it at a fixed
step, so the swap lands mid-run every time) or names an existing run from the queue, and checks
the contract of docs/guarantees.md ("Links and names"): the other run's files hash the same
before and after, and the command ends in one line (exit 2, no traceback) or says what it does.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import run_nanolab, tiny_overrides, write_config

from nanolab.runlog import read_records

EXIT_USAGE = 2

#: A callback the run under test loads from its config: at ``at_step`` it does what a hostile
#: shell would (``mv`` the run's ``name`` to ``<name>.moved``, or ``rm`` it, then ``ln -s``
#: ``target`` in its place; or copy ``target`` to ``name``).
SWAPPER = """
import os, shutil
from lightning.pytorch import Callback

class Swap(Callback):
    def __init__(self, name: str, target: str, at_step: int = 3, how: str = "move") -> None:
        self.name, self.target, self.at_step, self.how, self.done = name, target, at_step, how, False

    def on_train_batch_end(self, trainer, *args):
        if self.done or trainer.global_step < self.at_step:
            return
        self.done = True
        path = os.path.join(trainer.default_root_dir, self.name)
        if self.how == "move":
            os.rename(path, path + ".moved")
        else:
            os.unlink(path)
        os.symlink(self.target, path)
"""


def digests(root: Path) -> dict[str, str]:
    """sha256 of every regular file under ``root`` (links are not followed)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def last_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


@pytest.fixture(scope="module")
def victim(tmp_path_factory, char_dataset) -> Path:
    """A finished tiny run ``b`` (checkpoints at steps 4 and 6, ``last.ckpt``), trained once."""
    root = tmp_path_factory.mktemp("victim")
    cfg = tiny_overrides(char_dataset, root / "runs", run__name="b")
    cfg["checkpoint"] = {"every_n_steps": 2, "keep_last": 2}
    res = run_nanolab("fit", "--config", str(write_config(root / "b.yaml", cfg)), cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]
    return root / "runs" / "b"


def _fit_with_swap(
    tmp_path: Path, char_dataset: Path, victim: Path, **swap: object
) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """Run ``a`` next to a copy of ``victim`` (as ``b``) with the swap; (result, a, b)."""
    runs = tmp_path / "runs"
    shutil.copytree(victim, runs / "b")
    (tmp_path / "swapper.py").write_text(SWAPPER)
    cfg = tiny_overrides(char_dataset, runs, run__name="a", trainer__max_steps=8)
    cfg["checkpoint"] = {"every_n_steps": 1, "keep_last": 1, "keep_best": 0}
    cfg["trainer"]["callbacks"] = [{"class_path": "swapper.Swap", "init_args": swap}]
    config = write_config(tmp_path / "a.yaml", cfg)
    path = os.pathsep.join(filter(None, (str(tmp_path), os.environ.get("PYTHONPATH"))))
    res = run_nanolab("fit", "--config", str(config), cwd=tmp_path, env={"PYTHONPATH": path})
    return res, runs / "a", runs / "b"


def test_checkpoints_swapped_for_a_link_to_another_run_mid_run(tmp_path, char_dataset, victim):
    """Item 1: `mv runs/a/checkpoints x; ln -s ../b/checkpoints runs/a/checkpoints` at step 3
    of a run that saves every step and keeps one: it stops with one line at its next save,
    `b`'s files are untouched (none overwritten, none rotated away), `a`'s are in the moved
    folder."""
    before = digests(victim)
    res, a, b = _fit_with_swap(
        tmp_path, char_dataset, victim, name="checkpoints", target="../b/checkpoints"
    )
    detail = f"exit {res.returncode}; stderr tail:\n{res.stderr[-2500:]}"
    assert res.returncode == EXIT_USAGE, detail
    assert "Traceback" not in res.stderr, detail
    line = last_line(res.stderr)
    assert "now leads to" in line and "checkpoints.moved" in line, line
    assert digests(b) == before
    moved = sorted(p.name for p in (a / "checkpoints.moved").iterdir())
    assert moved[0] == "last.ckpt" and len(moved) == 2, moved  # and one step file, before the swap
    end = read_records(a / "metrics.jsonl", "end")[-1]
    assert end["reason"] == "error" and "LeftClaimedDir" in end["error"]


def test_run_log_swapped_for_a_link_to_another_runs_log_mid_run(tmp_path, char_dataset, victim):
    """Item 2: `rm runs/a/metrics.jsonl; ln -s ../b/metrics.jsonl runs/a/metrics.jsonl` at
    step 3: the run does not follow the link (not one of its records lands in `b`'s log); it
    stops with one line naming the link, and `b` hashes the same."""
    before = digests(victim)
    res, a, b = _fit_with_swap(
        tmp_path, char_dataset, victim, name="metrics.jsonl", target="../b/metrics.jsonl",
        how="remove",
    )  # fmt: skip
    detail = f"exit {res.returncode}; stderr tail:\n{res.stderr[-2500:]}"
    assert res.returncode == EXIT_USAGE, detail
    assert "Traceback" not in res.stderr, detail
    assert "metrics.jsonl is a link" in last_line(res.stderr), detail
    assert digests(b) == before
    assert (a / "checkpoints" / "last.ckpt").exists()  # the checkpoints are kept
