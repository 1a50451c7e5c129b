"""``data.tokenizer`` names the dataset's tokenizer: null is the prepared folder's own, another
name is refused in one line (older configs' default ``chars`` warns), and the run records it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from test_data_checks import fit_config, fit_in_process, write_dataset

from nanolab.data.datamodule import TokenDataModule
from nanolab.data.prepare import PrepareError


def _data(tmp_path: Path, tokenizer: str | None) -> TokenDataModule:
    write_dataset(tmp_path / "d", tokenizer="bytes")
    return TokenDataModule(dataset_dir=str(tmp_path / "d"), tokenizer=tokenizer, block_size=8)


def test_null_is_the_prepared_datasets_own(tmp_path):
    data = _data(tmp_path, None)
    assert data.vocab_size == 256
    assert data.tokenizer == "bytes"


def test_another_tokenizer_than_the_datasets_is_refused_in_one_line(tmp_path):
    """Mutation caught: data.tokenizer bpe on a bytes dataset trained on bytes while the run's
    config.yaml and start record said bpe."""
    data = _data(tmp_path, "bpe")
    with pytest.raises(PrepareError) as err:
        _ = data.vocab_size
    line = str(err.value)
    assert "\n" not in line
    assert "data.tokenizer bpe" in line and "prepared with bytes" in line
    assert "data.tokenizer: null" in line


def test_an_unknown_tokenizer_name_is_refused(tmp_path):
    with pytest.raises(PrepareError, match=r"data.tokenizer 'nope' is not a tokenizer"):
        _data(tmp_path, "nope")


def test_chars_the_old_default_is_read_as_the_datasets_own_with_a_warning(tmp_path, capsys):
    """A config.yaml written before null meant "the dataset's own" spells chars for gpt2/bpe
    data: its test and resume still run, and say once what the data is."""
    data = _data(tmp_path, "chars")
    assert data.vocab_size == 256
    assert data.tokenizer == "bytes"
    err = capsys.readouterr().err
    assert "data.tokenizer chars" in err and "prepared with bytes" in err


def test_fit_refuses_a_mismatch_and_records_the_datasets_tokenizer(tmp_path, capsys):
    write_dataset(tmp_path / "d", tokenizer="bytes")
    config = fit_config(tmp_path, {"dataset_dir": str(tmp_path / "d")})
    code, err = fit_in_process(capsys, config, "--data.tokenizer", "bpe", "--run.name", "bad")
    assert code == 2
    assert len(err) == 1 and "data.tokenizer bpe" in err[0], err
    assert not (tmp_path / "runs" / "bad" / "checkpoints").exists()

    code, err = fit_in_process(capsys, config, "--trainer.max_steps", "1")
    assert code == 0, err
    saved = yaml.safe_load((tmp_path / "runs" / "tiny" / "config.yaml").read_text())
    assert saved["data"]["tokenizer"] == "bytes"
