"""A bad document met by ``fit`` preparing ``data.source`` names what fit can do.

Prepare's own message ends "remove it or pass --skip-bad" or "name the text field with
--text-field": fit has neither option (``--data.skip_bad`` is an unknown setting), so a user
following it got a second refusal. Fit's line keeps the problem and the fix to the file, and
gives the ``nanolab prepare`` command, with the run's own paths, that prepares past it.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from conftest import tiny_overrides, write_config

from nanolab.cli import main
from nanolab.data.bad_text import bad_text_message
from nanolab.data.datamodule import TokenDataModule
from nanolab.data.prepare import BadTextError, prepare_dataset
from nanolab.data.sources import TextColumnError
from nanolab.errors import RunConfigError
from nanolab.run.compose import data_vocab


def _corpus(folder: Path) -> Path:
    folder.mkdir()
    (folder / "a.txt").write_text("a small corpus of its own, line after line\n" * 300)
    (folder / "b.txt").write_text("")  # an empty document
    return folder


def _data(**given: object) -> tuple[TokenDataModule, object]:
    from jsonargparse import Namespace

    return TokenDataModule(**given), Namespace(init_args=Namespace(**given))


def test_fit_names_its_own_fix_and_the_prepare_command_that_works(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = _corpus(tmp_path / "corpus")
    dataset = tmp_path / "d"
    config = write_config(
        tmp_path / "fit.yaml",
        tiny_overrides(dataset, tmp_path / "runs", data__source=[str(corpus)]),
    )
    assert main(["fit", "--config", str(config)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith(f"nanolab fit: error: {corpus / 'b.txt'}: empty document")
    assert "pass --skip-bad" not in line and "--text-field" not in line
    assert "remove it, or prepare the data yourself, skipping bad documents" in line
    assert line.endswith("then train on it with --data.source null")
    command = line.split("`")[1]
    assert command == f"nanolab prepare {corpus} -o {dataset} --tokenizer chars --skip-bad"
    assert not dataset.exists()  # nothing written
    # The command given works, and fit can then read the folder with data.source null.
    assert main([*shlex.split(command)[1:], "-q"]) == 0
    data, data_cfg = _data(dataset_dir=str(dataset), source=None)
    assert data_vocab(data, data_cfg) == data.vocab_size > 0


def test_a_record_without_the_text_field_gives_the_text_field_command(tmp_path: Path) -> None:
    records = tmp_path / "r.jsonl"
    lines = [json.dumps({"text": f"record {i} of a small corpus"}) for i in range(300)]
    records.write_text("\n".join([*lines, json.dumps({"body": "elsewhere"})]) + "\n")
    data, data_cfg = _data(
        dataset_dir=str(tmp_path / "d"), source=[str(records)], tokenizer="chars"
    )
    with pytest.raises(RunConfigError) as err:
        data_vocab(data, data_cfg, "validate")
    message = str(err.value)
    assert message.startswith(f"{records} line 301: no field 'text' (keys: body); ")
    assert "name the text field with --text-field" not in message
    assert "pass --skip-bad" not in message
    assert "validate reads the field 'text' only" in message
    assert f"`nanolab prepare {records} -o {tmp_path / 'd'} --tokenizer chars " in message
    assert "--text-field <field>`, then use it with --data.source null" in message


def test_a_parquet_file_without_the_column_is_not_offered_skip_bad(tmp_path: Path) -> None:
    """The column check is the reader's (sources.py), not a bad document: no --skip-bad."""
    column = TextColumnError("x.parquet: no column 'text' (columns: body)")
    assert str(column).endswith("; name the text column with --text-field")  # prepare's words
    err = BadTextError(str(column), column.problem, "", False, True)
    message = bad_text_message(err, ["x.parquet"], tmp_path / "d", "bpe", 512, 0.05)
    assert message == (
        "x.parquet: no column 'text' (columns: body); fit reads the column 'text' only: "
        "prepare the data yourself naming the text's column: `nanolab prepare x.parquet -o "
        f"{tmp_path / 'd'} --tokenizer bpe --bpe-vocab-size 512 --val-fraction 0.05 "
        "--text-field <column>`, then train on it with --data.source null"
    )


def test_a_damaged_dataset_in_the_folder_gets_force_and_own_source_classes_a_fix(
    tmp_path: Path,
) -> None:
    corpus = _corpus(tmp_path / "corpus")
    dataset = tmp_path / "d"
    (corpus / "b.txt").write_text("now some text\n")
    prepare_dataset([str(corpus)], dataset, "chars", quiet=True)
    (dataset / "val.bin").unlink()  # damaged: fit prepares it again, and meets the bad file
    (corpus / "b.txt").write_text("")
    err = BadTextError.of_document(
        f"{corpus / 'b.txt'}: empty document; remove it or pass --skip-bad"
    )
    message = bad_text_message(err, [str(corpus)], dataset, "chars", 4096, 0.1)
    assert "--tokenizer chars --skip-bad --force`" in message  # prepare refuses it otherwise
    own = bad_text_message(err, [str(corpus)], dataset, "chars", 4096, 0.1, "fit", False)
    assert own == (
        f"{corpus / 'b.txt'}: empty document; remove it: fit prepares the data class's source "
        "as it is"
    )
