"""Checkpoints record the data's fingerprint; a resume on data that changed is refused.

The fingerprint is each folder's ``train.bin``/``val.bin`` size and the sha256 of its
``meta.json`` (plus the mixture weights): cheap to recompute, and it changes whenever the data is
prepared again from other text or settings. ``--data.allow_changed true`` resumes anyway.
"""

from __future__ import annotations

import json
import shutil

import lightning as L
import pytest
from test_data_checks import (
    CODE_TEXT,
    TRAIN_TEXT,
    VAL_TEXT,
    fit_config,
    fit_in_process,
    write_dataset,
)

from nanolab.data.checks import DataChangedError
from nanolab.data.datamodule import TokenDataModule
from nanolab.model import GPTConfig
from nanolab.runlog import read_records
from nanolab.training.module import GPTLightningModule


def snapshot(run_dir):
    """Every file of a run directory and its bytes (to prove a refusal wrote nothing)."""
    return {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


@pytest.fixture
def finished_run(tmp_path, capsys):
    """A 4-step run with checkpoints, on a hand-written dataset; returns (data, config)."""
    data = tmp_path / "data"
    write_dataset(data)
    cfg = fit_config(tmp_path, {"dataset_dir": str(data)})
    code, err = fit_in_process(capsys, cfg)
    assert code == 0, err[-20:]
    return data, cfg


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda d: write_dataset(d, train=CODE_TEXT), "train.bin is {new:,} bytes, was {old:,}"),
        (lambda d: write_dataset(d, documents={"train": 7, "val": 1}), "meta.json changed"),
    ],
    ids=["re-prepared from other text", "meta.json edited"],
)
def test_resuming_on_changed_data_is_refused_with_the_reason(
    tmp_path, capsys, finished_run, change, reason
):
    data, cfg = finished_run
    run_dir = tmp_path / "runs" / "tiny"
    old = (data / "train.bin").stat().st_size
    change(data)
    reason = reason.format(old=old, new=(data / "train.bin").stat().st_size)
    before = snapshot(run_dir)
    code, err = fit_in_process(capsys, cfg, "--trainer.max_steps", "6")
    errors = [line for line in err if line.startswith("nanolab")]
    assert code == 2 and len(errors) == 1, err
    assert "the data changed since" in errors[0] and "step-00000004.ckpt" in errors[0]
    assert reason in errors[0] and "--data.allow_changed true" in errors[0]
    assert snapshot(run_dir) == before  # no log record, no config.yaml rewrite, no checkpoint


def test_other_data_in_another_folder_names_both_folders_and_a_new_run(
    tmp_path, capsys, finished_run
):
    """The same command on another dataset folder (docs/hf.md's "your text instead" without a
    run name of its own): the line names the old and the new folder (it set the new path
    beside the old sizes) and says a fine-tune is --data.allow_changed true and a new run another --run.name."""
    data, cfg = finished_run
    other = tmp_path / "other"
    write_dataset(other, train=CODE_TEXT)
    code, err = fit_in_process(capsys, cfg, "--data.dataset_dir", str(other))
    errors = [line for line in err if line.startswith("nanolab")]
    assert code == 2 and len(errors) == 1, err
    assert f"the data is {other} now, was {data}" in errors[0]
    assert "give another --run.name" in errors[0] and "--data.allow_changed true" in errors[0]


def test_allow_changed_resumes_on_the_new_data(tmp_path, capsys, finished_run):
    """Other text of the same tokenizer: the resume says so in one ``nanolab fit: warning:``
    line (it was a raw ``datamodule.py:574: UserWarning:`` ending in advice to pass the flag
    already given)."""
    data, cfg = finished_run
    write_dataset(data, train=CODE_TEXT)
    code, err = fit_in_process(
        capsys, cfg, "--trainer.max_steps", "6", "--data.allow_changed", "true"
    )
    assert code == 0, err[-20:]
    notes = [line for line in err if "data.allow_changed" in line]
    assert len(notes) == 1, err
    assert notes[0].startswith("nanolab fit: warning: data.allow_changed: resuming on other data")
    assert f"train.bin is {len(CODE_TEXT) * 2:,} bytes" in notes[0]
    assert "--data.allow_changed true" not in notes[0] and "UserWarning" not in "\n".join(err)
    starts = read_records(tmp_path / "runs" / "tiny" / "metrics.jsonl", "start")
    assert [s["resumed_from_step"] for s in starts] == [None, 4]
    # The new checkpoints carry the new fingerprint: the next resume needs no flag.
    code, err = fit_in_process(capsys, cfg, "--trainer.max_steps", "8")
    assert code == 0, err[-20:]


def test_a_fine_tune_on_other_data_counts_its_epochs_over_that_data(tmp_path, capsys, finished_run):
    """``allow_changed``: the order goes on at the parent's place (step 4), but ``epoch`` counts
    passes over the new data from there, 0 at step 4, and a later resume without the flag
    keeps counting from there. It was the parent's position read as a place in the new data's
    order (0.20 at step 5, where 0.04 is right)."""
    data, cfg = finished_run
    write_dataset(data, train=CODE_TEXT)
    code, err = fit_in_process(
        capsys, cfg, "--trainer.max_steps", "6", "--data.allow_changed", "true"
    )
    assert code == 0, err[-20:]
    code, err = fit_in_process(capsys, cfg, "--trainer.max_steps", "8")
    assert code == 0, err[-20:]
    windows = ((len(CODE_TEXT) - 1) // 32 - 1) // 4 * 4  # an epoch's whole micro-batches of 4
    train = read_records(tmp_path / "runs" / "tiny" / "metrics.jsonl", "train")
    epochs = {r["step"]: r["epoch"] for r in train if r["step"] > 4}
    assert epochs == {s: pytest.approx((s - 4) * 4 / windows, abs=1e-4) for s in range(5, 9)}


def test_allow_changed_never_allows_another_tokenizer(tmp_path, capsys, finished_run):
    """The same vocabulary size, another tokenizer (characters with one replaced: the ids
    shift): ``data.allow_changed`` resumed on it and the new checkpoints stored the other
    tokenizer, which ``validate`` then refused. A resume and a branch are refused as
    ``validate`` refuses, in one line, before anything is written."""
    data, cfg = finished_run
    write_dataset(data, tokenizer="chars")
    code, err = fit_in_process(capsys, cfg, "--run.name", "chars", "--trainer.max_steps", "2")
    assert code == 0, err[-20:]
    run_dir = tmp_path / "runs" / "chars"
    before = snapshot(run_dir)
    other = tmp_path / "other"
    swap = {"train": TRAIN_TEXT.replace("e", "#"), "val": VAL_TEXT.replace("e", "#")}
    write_dataset(other, **swap, tokenizer="chars")  # 24 characters either way
    branch = ("--run.name", "branch", "--run.resume", str(run_dir / "checkpoints" / "last.ckpt"))
    for extra in (("--run.name", "chars"), branch):
        code, err = fit_in_process(
            capsys, cfg, *extra, "--trainer.max_steps", "4", "--data.dataset_dir", str(other),
            "--data.allow_changed", "true",
        )  # fmt: skip
        errors = [line for line in err if line.startswith("nanolab")]
        assert code == 2 and len(errors) == 1, err
        assert "not the checkpoint's tokenizer" in errors[0]
        assert "'#' is id 1 in the data, absent in the checkpoint" in errors[0]
        assert "data.allow_changed allows other text, not another tokenizer" in errors[0]
    assert snapshot(run_dir) == before
    assert not (tmp_path / "runs" / "branch").exists()


def test_another_vocabulary_size_is_named_as_the_tokenizer_change(tmp_path, capsys, finished_run):
    """Data of another tokenizer whose vocabulary sizes the model otherwise (bytes: 256 tokens;
    chars: 24) under a resume with ``data.allow_changed`` or a branch: one line naming the
    checkpoint's tokenizer and the data's, and the fix, before anything is written. It was the
    data-change line ("was trained on the data in D; this run points at D: restore
    data.dataset_dir"), which named neither tokenizer, for a folder the run never left."""
    data, cfg = finished_run
    run_dir = tmp_path / "runs" / "tiny"
    before = snapshot(run_dir)
    other = tmp_path / "other"
    write_dataset(other, tokenizer="chars")
    last = str(run_dir / "checkpoints" / "last.ckpt")
    branch = ("--run.name", "branch", "--run.resume", last, "--data.dataset_dir", str(other))
    code, err = fit_in_process(capsys, cfg, *branch, "--trainer.max_steps", "6")
    (line,) = [line for line in err if line.startswith("nanolab")]
    assert code == 2, err
    assert line == (
        f"nanolab fit: error: data.dataset_dir {other}: prepared with tokenizer 'chars' (24 "
        f"tokens), not the checkpoint's tokenizer 'bytes' in {last} (256 tokens; e.g. ' ' is id "
        f"0 in the data, absent in the checkpoint); restore data.dataset_dir (or "
        f"data.datasets) to the data it trained on, {data}, or start a new run without its "
        "checkpoint (another --run.name, no run.resume); data.allow_changed allows other "
        "text, not another tokenizer"
    )
    assert not (tmp_path / "runs" / "branch").exists()
    write_dataset(data, tokenizer="chars")  # the run's own folder, prepared again
    code, err = fit_in_process(
        capsys, cfg, "--trainer.max_steps", "6", "--data.allow_changed", "true"
    )
    (line,) = [line for line in err if line.startswith("nanolab")]
    assert code == 2, err
    assert "prepared with tokenizer 'chars' (24 tokens), not the checkpoint's tokenizer " in line
    assert "'bytes' in " in line and "continue it on data prepared with its tokenizer" in line
    assert "was trained on the data in" not in line and "vocab_size" not in line
    assert snapshot(run_dir) == before


def test_a_moved_but_identical_dataset_resumes(tmp_path, capsys, finished_run):
    data, cfg = finished_run
    moved = tmp_path / "elsewhere" / "data"
    shutil.copytree(data, moved)
    shutil.rmtree(data)
    code, err = fit_in_process(
        capsys, cfg, "--trainer.max_steps", "6", "--data.dataset_dir", str(moved)
    )
    assert code == 0, err[-20:]


def test_the_trainer_itself_refuses_changed_data_but_evaluates_on_it(tmp_path):
    # Without nanolab fit (a fork's own script, a sharded checkpoint): the DataModule's
    # load_state_dict refuses in fit, and lets validate/test run on other data.
    data = tmp_path / "data"
    write_dataset(data)

    def parts():
        dm = TokenDataModule(dataset_dir=str(data), micro_batch_size=4, block_size=16,
                             val_windows=4)  # fmt: skip
        gpt = GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=32)
        trainer = L.Trainer(
            default_root_dir=str(tmp_path / "run"), accelerator="cpu", max_steps=2,
            logger=False, enable_progress_bar=False, enable_model_summary=False,
            use_distributed_sampler=False, limit_val_batches=1, val_check_interval=2,
            check_val_every_n_epoch=None,
        )  # fmt: skip
        return GPTLightningModule(gpt=gpt), dm, trainer

    module, dm, trainer = parts()
    trainer.fit(module, dm)
    ckpt = tmp_path / "state.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = json.loads(json.dumps(dm.state_dict()))
    assert (
        saved["data_fingerprint"]["datasets"][0]["train.bin"] == (data / "train.bin").stat().st_size
    )

    write_dataset(data, train=CODE_TEXT)
    module, dm, trainer = parts()
    with pytest.raises(DataChangedError, match=f"train.bin is {len(CODE_TEXT) * 2:,} bytes"):
        trainer.fit(module, dm, ckpt_path=str(ckpt), weights_only=True)
    module, dm, trainer = parts()
    assert trainer.validate(module, dm, ckpt_path=str(ckpt), weights_only=True, verbose=False)
