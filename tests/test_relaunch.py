"""A relaunch from the run's own ``config.yaml`` continues the run: the file records the run, not
the actions of the launch that wrote it (``run.fresh``, a resume from an older checkpoint)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from nanolab.callbacks.loggers import as_recorded
from nanolab.runlog import read_records


def _starts(run: Path) -> list[dict]:
    return list(read_records(run / "metrics.jsonl", "start"))


def test_a_run_started_with_run_fresh_resumes_from_its_own_config(
    tmp_path: Path, char_dataset: Path
) -> None:
    """config.yaml recorded ``run.fresh: true``: a relaunch with ``--config runs/X/config.yaml``
    (a requeue, the queue, a user) moved the run's work to previous/ and started it over.

    Mutation caught: config.yaml and the start record copying the launch's ``run.fresh``."""
    from conftest import QUICKSTART, nanolab_here, tiny_overrides, write_config

    cfg = write_config(tmp_path / "t.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    first = nanolab_here("fit", "--config", str(QUICKSTART), "--config", str(cfg),
                         "--run.fresh", "true", "--trainer.max_steps", "3", cwd=tmp_path)  # fmt: skip
    assert first.returncode == 0, first.stderr[-2000:]
    run = tmp_path / "runs" / "tiny"
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["run"]["fresh"] is False
    start = _starts(run)[0]["config"]
    assert start["run"]["fresh"] is False and start["log"]["fresh"] is False

    again = nanolab_here("fit", "--config", str(run / "config.yaml"), "--trainer.max_steps", "5",
                         cwd=tmp_path)  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    assert not (run / "previous").exists()
    assert [s["resumed_from_step"] for s in _starts(run)] == [None, 3]


def test_a_resume_from_an_older_checkpoint_is_recorded_as_a_resume_of_the_newest(
    tmp_path: Path, char_dataset: Path
) -> None:
    """``--run.resume runs/X/checkpoints/step-2.ckpt`` recorded in config.yaml: each relaunch
    from it went back to step 2 and set aside everything trained since."""
    from conftest import QUICKSTART, nanolab_here, tiny_overrides, write_config

    cfg = write_config(tmp_path / "t.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    base = ["fit", "--config", str(QUICKSTART), "--config", str(cfg),
            "--checkpoint.every_n_steps", "2", "--checkpoint.keep_last", "10"]  # fmt: skip
    run = tmp_path / "runs" / "tiny"
    assert nanolab_here(*base, "--trainer.max_steps", "4", cwd=tmp_path).returncode == 0
    back = nanolab_here(*base, "--trainer.max_steps", "6", "--run.resume",
                        str(run / "checkpoints" / "step-00000002.ckpt"), cwd=tmp_path)  # fmt: skip
    assert back.returncode == 0, back.stderr[-2000:]
    assert yaml.safe_load((run / "config.yaml").read_text())["run"]["resume"] == "auto"
    again = nanolab_here("fit", "--config", str(run / "config.yaml"), "--trainer.max_steps", "8",
                         cwd=tmp_path)  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    assert [s["resumed_from_step"] for s in _starts(run)] == [None, 2, 6]
    assert (run / "checkpoints" / "step-00000006.ckpt").exists()


def test_a_branch_relaunched_from_its_config_continues_from_its_own_newest_checkpoint(
    tmp_path: Path, char_dataset: Path
) -> None:
    """A branch's config.yaml keeps the parent's checkpoint in ``run.resume`` (a branch that
    saved nothing starts from it again); with checkpoints of its own, a relaunch goes on from
    its newest, with the branch's own rate."""
    from conftest import QUICKSTART, nanolab_here, tiny_overrides, write_config

    cfg = write_config(tmp_path / "t.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    base = ["fit", "--config", str(QUICKSTART), "--config", str(cfg)]
    assert nanolab_here(*base, "--trainer.max_steps", "3", cwd=tmp_path).returncode == 0
    parent = tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    branch = nanolab_here(*base, "--run.name", "b", "--run.resume", str(parent),
                          "--model.optimizer.lr", "0.01", "--trainer.max_steps", "5",
                          cwd=tmp_path)  # fmt: skip
    assert branch.returncode == 0, branch.stderr[-2000:]
    run = tmp_path / "runs" / "b"
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["run"]["resume"] == str(parent) and saved["model"]["optimizer"]["lr"] == 0.01
    again = nanolab_here("fit", "--config", str(run / "config.yaml"), "--trainer.max_steps", "6",
                         cwd=tmp_path)  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resuming keeps" not in again.stderr and "this branch trains" not in again.stderr
    assert [s["resumed_from_step"] for s in _starts(run)] == [3, 5]
    lrs = {r["step"]: r["lr"] for r in read_records(run / "metrics.jsonl", "train")}
    assert lrs[6] == pytest.approx(
        0.01 * 6 / 51
    )  # the branch's rate in quickstart's 50-step warm-up


def test_as_recorded_leaves_a_config_without_launch_actions_as_it_is(tmp_path: Path) -> None:
    config = {"run": {"fresh": False, "resume": "auto"}, "trainer": {"default_root_dir": "r"}}
    assert as_recorded(config) == config
    other = str(tmp_path / "other" / "checkpoints" / "last.ckpt")
    kept = {**config, "run": {"fresh": True, "resume": other}, "ckpt_path": None}
    assert as_recorded(kept)["run"] == {"fresh": False, "resume": other}
