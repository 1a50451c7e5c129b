"""configs/debug/: fast_dev_run, overfit and profile presets composed after a base config, through
the CLI's entry point (in the test's process); each lands in its own runs/debug/<preset>-<time>/ and leaves the base run alone."""

from __future__ import annotations

import pytest
from conftest import REPO, nanolab_here, tiny_overrides, write_config

from nanolab.runlog import read_records

DEBUG = REPO / "configs" / "debug"


def _launch(tmp_path, char_dataset, preset: str, *extra: str, micro_batches: int = 1):
    cfg = tiny_overrides(char_dataset, tmp_path / "runs")
    cfg["run"]["global_batch_tokens"] = micro_batches * 4 * 32  # micro-batch 4 x block 32
    base = write_config(tmp_path / "base.yaml", cfg)
    done = nanolab_here("fit", "--config", str(base), "--config", str(DEBUG / f"{preset}.yaml"),
                       *extra, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (run,) = (tmp_path / "runs" / "debug").glob(f"{preset}-*")
    assert not (tmp_path / "runs" / "tiny").exists()  # the base config's run is not touched
    _launch.stderr = done.stderr  # type: ignore[attr-defined]  # the last launch's console
    return run, read_records(run / "metrics.jsonl")


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_fast_dev_run_trains_three_steps_and_validates_once(tmp_path, char_dataset, micro_batches):
    """Three optimizer steps whatever the base's accumulation (Lightning's fast_dev_run counts
    batches). Mutation caught: the preset keeping the base's global batch (with 4 micro-batches
    a step its 3 batches ended at step 1, and the banner promised 3)."""
    run, records = _launch(tmp_path, char_dataset, "fast_dev_run", micro_batches=micro_batches)
    assert [r["step"] for r in records if r["event"] == "train"] == [1, 2, 3]
    assert len([r for r in records if r["event"] == "val"]) == 1
    # Its whole config, as every run: with the model section alone, report grouped it (and
    # every run beside it) by the model only.
    assert (run / "config.yaml").is_file()
    assert {"model", "data", "trainer", "run"} <= set(records[0]["config"])
    # Lightning's "Logging and checkpointing is suppressed" is not true of nanolab's files
    assert "suppressed" not in _launch.stderr  # type: ignore[attr-defined]


def test_a_fast_dev_run_flag_with_accumulation_promises_the_steps_it_trains(tmp_path, char_dataset):
    """``--trainer.fast_dev_run 3`` on a config that accumulates 2 micro-batches: Lightning
    trains 3 micro-batches, 2 optimizer steps; the banner promised 3."""
    cfg = tiny_overrides(char_dataset, tmp_path / "runs")
    cfg["run"]["global_batch_tokens"] = 2 * 4 * 32
    base = write_config(tmp_path / "base.yaml", cfg)
    done = nanolab_here("fit", "--config", str(base), "--trainer.fast_dev_run", "3", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout + done.stderr
    assert "steps      0 -> 2 " in out and "completed at step 2" in out, out[-2000:]


@pytest.mark.slow  # 40 steps: ~20 s
def test_overfit_memorises_one_batch(tmp_path, char_dataset):
    _, records = _launch(tmp_path, char_dataset, "overfit", "--trainer.max_steps", "40", "--run.eval_every_steps", "20",
                         "--model.optimizer.lr", "0.01")  # fmt: skip
    losses = [r["loss"] for r in records if r["event"] == "train"]
    vals = [r["val_loss"] for r in records if r["event"] == "val"]
    assert losses[-1] < 0.3 * losses[0]  # a normal run of 40 tiny steps stays near ln(71)
    assert vals[-1] > 2 * losses[-1]  # memorised, not learned


@pytest.mark.slow
def test_profile_writes_the_table_into_the_run_directory(tmp_path, char_dataset):
    run, _ = _launch(tmp_path, char_dataset, "profile", "--trainer.max_steps", "6")
    table = (run / "fit-profile.txt").read_text()
    assert "run_training_batch" in table and "Mean duration" in table
