"""A dataset folder prepared again while a run starts is not what the run trains on.

The launch checks each folder, takes its fingerprint (which every checkpoint records) and its
token counts and byte counts (val_bpb) from it. `nanolab prepare --force` of the same folder
after that (during the checkpoint restore, the strategy's setup, a callback's on_fit_start)
must not slip the new files under the run: it reads the very files it checked, or stops in one
line with nothing written to its checkpoints.
"""

from __future__ import annotations

import hashlib
import multiprocessing
from pathlib import Path

import lightning as L
import pytest
from test_data_checks import fit_config, fit_in_process

from nanolab.data.checks import DataReplacedError, checkpoint_fingerprint
from nanolab.data.datamodule import TokenDataModule
from nanolab.data.prepare import prepare_dataset

OLD_TEXT = "A truth universally acknowledged, that a single man in possession of a good fortune. "
NEW_TEXT = OLD_TEXT.upper()  # the same sizes: a run on it would not crash, only be wrong


class PrepareAgainOnFitStart(L.Callback):
    """`nanolab prepare --force` of the run's data folder while the run starts."""

    def __init__(self, source: str, folder: str) -> None:
        self.source, self.folder = source, folder

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        prepare_dataset([self.source], self.folder, "bytes", force=True, quiet=True)


class WindowLog(L.Callback):
    """A hash of every batch the run trains and validates on, one line each, to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def _log(self, stage: str, batch: tuple) -> None:
        with open(self.path, "a") as f:
            f.write(f"{stage} {hashlib.sha256(batch[0].numpy().tobytes()).hexdigest()}\n")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._log("train", batch)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, *args) -> None:
        self._log("val", batch)


def _source(tmp_path: Path, name: str, text: str) -> Path:
    source = tmp_path / f"{name}.txt"
    source.write_text(text * 60)
    return source


def _run(tmp_path: Path, capsys, name: str, workers: int, callbacks: list) -> tuple[int, list]:
    cfg = fit_config(
        tmp_path,
        {"dataset_dir": str(tmp_path / "data"), "num_workers": workers},
        run={"name": name},
        trainer={"callbacks": callbacks},
        downstream={"suite": None},
    )
    return fit_in_process(capsys, cfg)


def _window_log(tmp_path: Path, name: str) -> dict:
    return {
        "class_path": "test_data_replaced.WindowLog",
        "init_args": {"path": str(tmp_path / name)},
    }


def _fingerprint(tmp_path: Path, name: str) -> dict | None:
    last = tmp_path / "runs" / name / "checkpoints" / "last.ckpt"
    return checkpoint_fingerprint(last, TokenDataModule.__qualname__)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_folder_prepared_again_at_fit_start_is_not_what_the_run_trains_on(
    tmp_path, capsys, workers
):
    old, new = _source(tmp_path, "old", OLD_TEXT), _source(tmp_path, "new", NEW_TEXT)
    prepare_dataset([str(old)], tmp_path / "data", "bytes", quiet=True)
    code, err = _run(tmp_path, capsys, "plain", 0, [_window_log(tmp_path, "plain.log")])
    assert code == 0, err[-20:]

    swap = {
        "class_path": "test_data_replaced.PrepareAgainOnFitStart",
        "init_args": {"source": str(new), "folder": str(tmp_path / "data")},
    }
    code, err = _run(tmp_path, capsys, "swapped", workers, [swap, _window_log(tmp_path, "w.log")])
    forked = workers == 0 or multiprocessing.get_start_method() == "fork"
    if forked:  # the run reads the maps the check opened (inherited by forked workers)
        assert code == 0, err[-20:]
        assert (tmp_path / "w.log").read_text() == (tmp_path / "plain.log").read_text()
        assert _fingerprint(tmp_path, "swapped") == _fingerprint(tmp_path, "plain")
    else:  # a worker that maps the file itself finds another file there: one line, no checkpoint
        errors = [line for line in err if "error" in line.lower()]
        assert code == 2 and len(errors) == 1, err[-20:]
        assert "train.bin was replaced after this run checked it" in errors[0]
        assert not list((tmp_path / "runs" / "swapped").glob("checkpoints/*"))


@pytest.mark.slow
def test_a_spawned_worker_reads_the_checked_file_or_refuses_a_replaced_one_in_one_line(tmp_path):
    data = tmp_path / "data"
    prepare_dataset([str(_source(tmp_path, "old", OLD_TEXT))], data, "bytes", quiet=True)
    dm = TokenDataModule(
        dataset_dir=str(data), source=None, micro_batch_size=4, block_size=16, val_windows=4,
        num_workers=1,
    )  # fmt: skip
    dm.setup("fit")

    def first_batch() -> tuple:
        loader = dm.train_dataloader()
        loader.multiprocessing_context = "spawn"  # Python 3.14 defaults Linux to forkserver
        try:
            return next(iter(loader))
        finally:
            del loader

    x, _ = first_batch()  # the checked file, mapped anew in the worker
    keys = next(iter(dm.train_sampler))
    assert x.equal(dm.train_parts[0][keys][0])

    prepare_dataset(
        [str(_source(tmp_path, "new", NEW_TEXT))], data, "bytes", force=True, quiet=True
    )
    with pytest.raises(DataReplacedError) as caught:
        first_batch()
    message = str(caught.value)
    assert "\n" not in message and "Traceback" not in message, message
    assert message.startswith(f"{data / 'train.bin'} was replaced after this run checked it")
    assert "nanolab prepare --force" in message and "rerun" in message
