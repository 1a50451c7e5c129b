"""What a resume checks in a checkpoint before anything loads it: a sharded folder's pickles are
data (torch and DeepSpeed unpickle them unrestricted), a folder is complete, the chosen file's
bytes pass their CRC-32s, the opening leaves no mapping of the file behind, and a change of
precision is said."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
from conftest import QUICKSTART, nanolab_here, tiny_overrides, write_config

from nanolab.model.checkpoint import CheckpointError, load_checkpoint
from nanolab.training.resume import (
    ResumeError,
    find_resume_checkpoint,
    inspect_checkpoint,
    resume_candidate,
)


def _fit(tmp_path: Path, char_dataset: Path, *extra: str) -> Path:
    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=4)
    cfg["checkpoint"] = {"every_n_steps": 2}
    config = write_config(tmp_path / "t.yaml", cfg)
    res = nanolab_here("fit", "--config", str(QUICKSTART), "--config", str(config), *extra,
                       cwd=tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    return tmp_path / "runs" / "tiny"


def _flip_tensor_byte(path: Path) -> str:
    """Flip one byte inside a tensor record, headers untouched (a bad sector); its name."""
    with zipfile.ZipFile(path) as archive:
        info = max(
            (i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size
        )
    start = info.header_offset + 30 + len(info.orig_filename.encode()) + len(info.extra)
    data = bytearray(path.read_bytes())
    data[start + info.file_size // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return info.filename


def test_a_checkpoint_whose_bytes_fail_their_crc_is_skipped_or_refused(tmp_path, char_dataset):
    """A flipped bit inside a tensor leaves every header in place: the run resumed from it,
    logged val nan and stopped as diverged, advising a lower LR. The chosen file's records are
    now checked against their CRC-32s: auto skips it (one line naming it), a given path and
    generate/eval/export are refused in one line."""
    run = _fit(tmp_path, char_dataset)
    newest = run / "checkpoints" / "step-00000004.ckpt"
    (run / "checkpoints" / "last.ckpt").unlink()
    record = _flip_tensor_byte(newest)
    assert inspect_checkpoint(newest).ok  # the cheap opening cannot see it
    choice = find_resume_checkpoint(run, verify=True)
    assert choice.chosen is not None and choice.chosen.path.name == "step-00000002.ckpt"
    assert f"step-00000004.ckpt (damaged: its record {record} fails its CRC-32 check)" in (
        choice.warning() or ""
    )
    for training in (True, False):
        with pytest.raises(ResumeError, match="fails its CRC-32 check") as err:
            resume_candidate(str(newest), run, None, training=training)
        assert "\n" not in str(err.value)
    with pytest.raises(CheckpointError, match="fail their CRC-32"):
        load_checkpoint(newest)
