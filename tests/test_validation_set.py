"""Every launch of a config scores the same validation windows, or says that it does not
(``nanolab.run.validation_set``): a batch-count ``trainer.limit_val_batches`` cuts the fixed
``data.val_windows`` at a point that moves with the micro-batch and the device count."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import yaml
from conftest import nanolab_here, tiny_overrides, write_config

from nanolab.run.validation_set import partial_validation_warning

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("limit", "windows", "micro", "world", "scored"),
    [
        (20, 1024, 8, 1, 160),  # the 124M recipe's old limit at auto's micro-batch on a 4070
        (20, 1024, 16, 2, 640),
        (2, 16, 4, 1, 8),
    ],
)
def test_a_count_that_cuts_the_windows_names_what_is_scored_and_the_fix(
    limit, windows, micro, world, scored
):
    text = partial_validation_warning(limit, windows, micro, world)
    assert text is not None
    assert f"scores {scored} of data.val_windows {windows}" in text
    assert f"set data.val_windows {scored} and trainer.limit_val_batches null" in text


@pytest.mark.parametrize(
    ("limit", "windows", "micro", "world"),
    [
        (None, 1024, 8, 1),  # no limit: every window
        (1.0, 1024, 8, 1),  # a fraction: the same share at any micro-batch
        (0.25, 1024, 8, 1),
        (True, 1024, 8, 1),
        (0, 1024, 8, 1),  # validation off
        (20, 320, 16, 1),  # the count reaches every window
        (20, None, 8, 1),  # a data module without fixed windows
    ],
)
def test_no_warning_where_every_launch_scores_the_same_set(limit, windows, micro, world):
    assert partial_validation_warning(limit, windows, micro, world) is None


def test_the_shipped_configs_score_their_whole_validation_set():
    for path in sorted((ROOT / "configs").rglob("*.yaml")):
        trainer = (yaml.safe_load(path.read_text()) or {}).get("trainer") or {}
        assert not isinstance(trainer.get("limit_val_batches"), int), path


def test_a_fit_that_cuts_its_validation_set_says_so_once(tmp_path, char_dataset):
    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__limit_val_batches=2)
    config = write_config(tmp_path / "cut.yaml", cfg)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        done = nanolab_here("fit", "--config", "configs/quickstart.yaml", "--config", str(config),
                            cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr
    said = [str(w.message) for w in caught if "trainer.limit_val_batches" in str(w.message)]
    assert len(said) == 1 and "scores 8 of data.val_windows 16 validation windows" in said[0]
    vals = [json.loads(line) for line in (tmp_path / "runs/tiny/metrics.jsonl").open()]
    assert [r["step"] for r in vals if r.get("event") == "val"] == [3, 6]


def test_a_mixture_counts_the_windows_of_every_dataset():
    # 2 datasets x 128 windows, 4 batches of 32: the second dataset is never scored.
    text = partial_validation_warning(4, 128, 32, 1, datasets=2)
    assert text is not None and "scores 128 of data.val_windows 128 x 2 datasets" in text
    assert "set data.val_windows 64 and" in text
    assert partial_validation_warning(8, 128, 32, 1, datasets=2) is None
