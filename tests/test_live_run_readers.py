"""validate, test, eval and lm-eval read the checkpoints of a run that is still training, whose
rotation deletes a step file as the next is saved (docs/evaluate.md).

A real rotating run makes the race a matter of timing. Here the deletion happens exactly where
rotation can strike: right after the real pick returns, or between the listing and the opening
of the files. What is scored must be the file picked, the record must name its step, and the
run directory must be free for a ``fit`` while the evaluation runs.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

import pytest
from conftest import nanolab_here, tiny_overrides, write_config

import nanolab.training.evaluate as evaluate_module
import nanolab.training.resume as resume_module
from nanolab.callbacks.runlock import LOCK_NAME
from nanolab.runlog import read_records


@pytest.fixture(scope="module")
def trained(tmp_path_factory, char_dataset) -> Path:
    """A finished 6-step run: checkpoints at steps 3 and 6 (last.ckpt links step 6)."""
    root = tmp_path_factory.mktemp("live")
    overrides = tiny_overrides(char_dataset, Path("runs"))
    overrides["checkpoint"] = {"every_n_steps": 3, "keep_last": 5}
    cfg = write_config(root / "tiny.yaml", overrides)
    res = nanolab_here("fit", "--config", str(cfg), cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]
    return root


@pytest.fixture
def run(trained, tmp_path) -> Path:
    shutil.copytree(trained, tmp_path / "w")
    return tmp_path / "w" / "runs" / "tiny"


def rotate(run: Path) -> None:
    """What rotation does once the run saves step 7: step 6 is deleted and last.ckpt moves on
    (here it goes too, so nothing of step 6 is left under any name)."""
    for name in ("step-00000006.ckpt", "last.ckpt"):
        (run / "checkpoints" / name).unlink()


def rotate_after_the_pick(monkeypatch, module, name: str, run: Path) -> None:
    """``module.name`` as it is, then the rotation, before anything reads what it picked."""
    real = getattr(module, name)

    def pick_then_rotate(*args, **kwargs):
        picked = real(*args, **kwargs)
        rotate(run)
        return picked

    monkeypatch.setattr(module, name, pick_then_rotate)


def fit_val_loss(run: Path, step: int) -> float:
    vals = [r for r in read_records(run / "metrics.jsonl", "val") if r.get("evaluated_by") is None]
    return [r["val_loss"] for r in vals if r["step"] == step][-1]


def test_validate_scores_and_logs_the_checkpoint_it_picked_after_rotation_deleted_it(
    run, monkeypatch
):
    """The pick named step 6, rotation deleted it, and the name was opened again: "checkpoint
    ... does not exist; pass an existing .ckpt" (an option never given), exit 2, or Lightning's
    FileNotFoundError traceback. The file picked is held open and scored."""
    rotate_after_the_pick(monkeypatch, evaluate_module, "eval_target", run)
    res = nanolab_here("validate", "--config", "tiny.yaml", cwd=run.parent.parent)
    assert res.returncode == 0, res.stderr[-3000:]
    assert not (run / "checkpoints" / "step-00000006.ckpt").exists()
    record = read_records(run / "metrics.jsonl")[-1]
    assert record["evaluated_by"] == "nanolab validate" and record["step"] == 6
    assert record["checkpoint"] == "runs/tiny/checkpoints/step-00000006.ckpt"
    # Step 6's weights, not step 3's (the file left): the loss the fit logged at step 6.
    assert record["val_loss"] == pytest.approx(fit_val_loss(run, 6), abs=1e-5)
    assert "step-00000006.ckpt (step 6)" in res.stdout


def test_validate_leaves_the_run_free_for_a_fit_while_it_evaluates(run, monkeypatch):
    """validate held the run directory from before the restore to its exit, so a continuation
    started meanwhile (a queued --continue, a resume loop) failed "is in use by ... (validate)".
    It is held for the append only."""
    from lightning.pytorch import Trainer

    seen = []
    real = Trainer.validate

    def validate_and_probe(self, *args, **kwargs):
        seen.append(held_by_another_launch(run))  # a fit started now takes the lock this way
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "validate", validate_and_probe)
    res = nanolab_here("validate", "--config", "tiny.yaml", cwd=run.parent.parent)
    assert res.returncode == 0, res.stderr[-3000:]
    assert seen == [False]
    assert read_records(run / "metrics.jsonl")[-1]["evaluated_by"] == "nanolab validate"
    assert not (run / LOCK_NAME).exists()  # taken for the append, and given back


def held_by_another_launch(run: Path) -> bool:
    """Whether the run lock (flock on its file, which two opens contend for even in one
    process) is held now."""
    try:
        fd = os.open(run / LOCK_NAME, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_eval_scores_and_logs_the_checkpoint_it_picked_after_rotation_deleted_it(run, monkeypatch):
    """``nanolab eval RUN`` picked step 6 by name and loaded it by name after rotation deleted
    it: "checkpoint ... does not exist; pass a .ckpt file or a run dir", exit 2."""
    rotate_after_the_pick(monkeypatch, resume_module, "find_resume_checkpoint", run)
    res = nanolab_here("eval", "runs/tiny", "--limit", "5", cwd=run.parent.parent)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "runs/tiny/checkpoints/step-00000006.ckpt (step 6)" in res.stderr
    record = read_records(run / "metrics.jsonl")[-1]
    assert record["event"] == "tasks" and record["step"] == 6


def test_lm_eval_loads_the_checkpoint_it_picked_after_rotation_deleted_it(run, monkeypatch):
    """The lm-eval model's pick of a run directory is the same held pick as eval's."""
    from nanolab.downstream.harness import checkpoint_path
    from nanolab.model.checkpoint import load_checkpoint

    rotate_after_the_pick(monkeypatch, resume_module, "find_resume_checkpoint", run)
    path = checkpoint_path(str(run))
    assert path == run / "checkpoints" / "step-00000006.ckpt" and not path.exists()
    assert load_checkpoint(path)["global_step"] == 6


def test_a_checkpoint_deleted_during_the_scan_is_not_called_corrupt(run, monkeypatch):
    """Step 6, listed and then deleted by rotation before it was opened, was reported as
    "skipped incomplete or corrupt checkpoint(s): step-00000006.ckpt (empty file)". It was
    rotated, not damaged: nothing is said, and the folder is listed again for what the run
    saved meanwhile (here nothing: step 3 is the newest left)."""
    backup = shutil.copytree(run / "checkpoints", run.parent.parent / "backup")
    real = resume_module.checkpoint_files
    listings = []

    def list_then_rotate(run_dir):
        listed = real(run_dir)
        listings.append(sorted(p.name for p in listed))
        if (run / "checkpoints" / "last.ckpt").exists():
            rotate(run)
        return listed

    monkeypatch.setattr(resume_module, "checkpoint_files", list_then_rotate)
    choice = resume_module.find_resume_checkpoint(run)
    assert choice.chosen is not None and choice.chosen.step == 3
    assert choice.warning() is None and choice.skipped == []
    assert "step-00000006.ckpt" in listings[0] and listings[1:] == [["step-00000003.ckpt"]]
    # Through the command: no warning line, and what it scores is what was left.
    shutil.copytree(backup, run / "checkpoints", dirs_exist_ok=True)
    res = nanolab_here("eval", "runs/tiny", "--limit", "5", "--no-log", cwd=run.parent.parent)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "warning" not in res.stderr and "step-00000003.ckpt (step 3)" in res.stderr
