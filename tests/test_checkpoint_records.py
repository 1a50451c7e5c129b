"""A checkpoint's zip records: torch.save stores every one as is, so a compressed record is a
file torch.save did not write, refused from the archive's directory without inflating it (a
record of 8 bytes on disk can announce gigabytes; the CRC check would inflate them all)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch
from conftest import QUICKSTART, nanolab_here, tiny_overrides, write_config


def bomb(path: Path, inflated: int = 64 << 20) -> Path:
    """A torch.save file with one extra deflated record of ``inflated`` zero bytes."""
    torch.save({"state_dict": {"w": torch.zeros(4)}, "global_step": 1}, path)
    with (
        zipfile.ZipFile(path, "a", compression=zipfile.ZIP_DEFLATED) as archive,
        archive.open("archive/extra_blob", "w", force_zip64=True) as record,
    ):
        for _ in range(inflated >> 20):
            record.write(bytes(1 << 20))
    return path


def test_a_compressed_record_is_refused_without_being_inflated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nanolab.model.checkpoint import (
        CheckpointError,
        compressed_record,
        corrupt_record,
        load_checkpoint,
    )
    from nanolab.training.resume import inspect_checkpoint

    path = bomb(tmp_path / "bomb.ckpt")
    assert path.stat().st_size < 1 << 20
    assert compressed_record(path) == "archive/extra_blob"
    opened: list[str] = []
    real_open = zipfile.ZipFile.open

    def spy(self: zipfile.ZipFile, name: object, *args: object, **kwargs: object) -> object:
        opened.append(getattr(name, "filename", name))
        return real_open(self, name, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipFile, "open", spy)
    assert corrupt_record(path) is None  # the stored records pass; the deflated one: unread
    assert "archive/extra_blob" not in opened and opened
    opened.clear()
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    assert str(err.value) == (
        f"{path} is not a checkpoint written by torch.save (its record archive/extra_blob is "
        "compressed; torch.save stores every record as is); pass a .ckpt written by nanolab fit"
    )
    assert "archive/extra_blob" not in opened
    cand = inspect_checkpoint(path, training=False)
    assert not cand.ok and "not a checkpoint written by torch.save" in (cand.error or "")


@pytest.mark.parametrize("async_save", [False, True])
def test_every_checkpoint_fit_writes_has_only_stored_records(
    tmp_path: Path, char_dataset: Path, async_save: bool
) -> None:
    """The refusal must never meet a real checkpoint: the synchronous and the background
    writer both go through torch.save, which stores every record."""
    from nanolab.model.checkpoint import compressed_record, load_checkpoint

    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=2)
    cfg["checkpoint"] = {"every_n_steps": 1, "async_save": async_save}
    write_config(tmp_path / "t.yaml", cfg)
    res = nanolab_here("fit", "--config", str(QUICKSTART), "--config", "t.yaml", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    files = sorted((tmp_path / "runs" / "tiny" / "checkpoints").glob("*.ckpt"))
    assert len(files) >= 2
    for file in files:
        assert compressed_record(file) is None, file
        assert load_checkpoint(file)["global_step"] in (1, 2)
