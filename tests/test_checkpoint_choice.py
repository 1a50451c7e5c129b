"""Which checkpoint "the run" means: a run directory given to generate, export, validate or eval
resolves to its newest complete checkpoint by one rule, never to an older ``last.ckpt`` left
beside newer step files (``checkpoint.save_last false``, or a resume from an older checkpoint),
and fit's own summary names the file it saved last."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import QUICKSTART, nanolab_here, tiny_overrides, write_config


def _fit(tmp_path: Path, char_dataset: Path, *extra: str):
    cfg = write_config(
        tmp_path / "t.yaml",
        tiny_overrides(char_dataset, tmp_path / "runs", checkpoint__every_n_steps=1),
    )
    return nanolab_here(
        "fit", "--config", str(QUICKSTART), "--config", str(cfg), *extra, cwd=tmp_path
    )


def test_a_run_resumed_from_an_older_checkpoint_without_save_last_reads_as_its_newest(
    tmp_path: Path, char_dataset: Path
) -> None:
    """Resuming from step 4 made last.ckpt a link to step 4 though save_last was false, never
    updated after: the summary named it and generate/export of the run read step 4, not 8."""
    from nanolab.model.checkpoint import load_checkpoint
    from nanolab.training.resume import resolve_checkpoint

    flags = ["--checkpoint.save_last", "false", "--checkpoint.keep_last", "5"]
    assert _fit(tmp_path, char_dataset, *flags).returncode == 0
    run = tmp_path / "runs" / "tiny"
    older = run / "checkpoints" / "step-00000004.ckpt"
    res = _fit(tmp_path, char_dataset, *flags, "--run.resume", str(older),
               "--trainer.max_steps", "8")  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert not (run / "checkpoints" / "last.ckpt").exists()
    newest = run / "checkpoints" / "step-00000008.ckpt"
    assert f"  checkpoint {newest}" in res.stdout, res.stdout[-800:]
    assert resolve_checkpoint(run) == newest
    assert load_checkpoint(resolve_checkpoint(run / "checkpoints"))["global_step"] == 8


def test_export_of_a_run_skips_a_last_ckpt_older_than_its_step_files(
    tmp_path: Path, char_dataset: Path
) -> None:
    """A run trained to 6 (last.ckpt = step 6), then on to 12 with save_last false: export of
    the run wrote step 6 while validate and eval used 12."""
    assert _fit(tmp_path, char_dataset).returncode == 0
    res = _fit(tmp_path, char_dataset, "--trainer.max_steps", "12", "--checkpoint.save_last",
               "false")  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    run = tmp_path / "runs" / "tiny"
    assert "step-00000012.ckpt" in res.stdout and "last.ckpt" not in res.stdout
    out = tmp_path / "exported"
    res = nanolab_here("export", "--ckpt", str(run), "-o", str(out), "--format", "safetensors",
                       cwd=tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads((out / "nanolab.json").read_text())["global_step"] == 12
    res = nanolab_here("generate", "--ckpt", str(run), "--prompt", "a", "--max-new-tokens",
                       "2", cwd=tmp_path)  # fmt: skip
    assert res.returncode == 0 and "step-00000012.ckpt" in res.stderr + res.stdout


def test_setting_checkpoints_aside_makes_no_last_ckpt_and_repoints_one_that_is_there(
    tmp_path: Path,
) -> None:
    from nanolab.callbacks.checkpoint import set_aside_newer

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for step in (2, 4, 6):
        (folder / f"step-{step:08d}.ckpt").write_bytes(bytes([step]))
    assert set_aside_newer(folder, folder / "step-00000004.ckpt", 4) == ["step-00000006.ckpt"]
    assert not (folder / "last.ckpt").exists()
    (folder / "last.ckpt").write_bytes(b"an older launch's")
    set_aside_newer(folder, folder / "step-00000002.ckpt", 2)
    assert os.path.samefile(folder / "last.ckpt", folder / "step-00000002.ckpt")


def test_a_folder_without_a_complete_checkpoint_says_so(tmp_path: Path) -> None:
    from nanolab.model.checkpoint import CheckpointError
    from nanolab.training.resume import resolve_checkpoint

    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step-00000003.ckpt").write_bytes(b"torn")
    with pytest.raises(CheckpointError) as err:
        resolve_checkpoint(tmp_path / "run")
    assert str(err.value) == (
        f"--ckpt {tmp_path / 'run'}: none of its checkpoints can be read (step-00000003.ckpt "
        "(truncated or not a checkpoint)); pass a .ckpt file"
    )
    (tmp_path / "run" / "checkpoints" / "step-00000003.ckpt").unlink()
    with pytest.raises(CheckpointError, match=r"folder without a complete checkpoint"):
        resolve_checkpoint(tmp_path / "run")
