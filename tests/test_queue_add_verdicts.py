"""``fit``, ``estimate`` and ``queue add`` reach one verdict on one command line.

A job ``queue add`` accepts and that fails at launch at 3 a.m. is the harm: each setting refused
here is refused by all three, in one line and exit 2 (``estimate`` where it reads the setting).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import nanolab_here, tiny_overrides, write_config


def _verdicts(
    tmp_path: Path, dataset: Path, args: list[str], verbs: tuple[str, ...], files: tuple = ()
) -> dict:
    """``{verb: (exit code, stderr)}`` for ``nanolab VERB --config tiny.yaml [--config FILE]
    ARGS`` (``queue add tiny.yaml [FILE] ARGS``: its configs are arguments)."""
    config = write_config(tmp_path / "tiny.yaml", tiny_overrides(dataset, tmp_path / "runs"))
    configs = [str(config), *map(str, files)]
    out = {}
    for verb in verbs:
        if verb == "queue":
            argv = ["queue", "add", "--db", str(tmp_path / "q.db"), *configs, *args]
        else:
            argv = [verb, *(a for c in configs for a in ("--config", c)), *args]
        done = nanolab_here(*argv, cwd=tmp_path)
        out[verb] = (done.returncode, done.stderr)
    return out


def assert_refused(verdicts: dict, message: str) -> None:
    for verb, (code, err) in verdicts.items():
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and message in lines[0], (verb, code, err)


ALL = ("fit", "estimate", "queue")


# -- a group of settings given null ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "key"),
    [("model:\n  optimizer:\n", "model.optimizer"), ("model: {gpt: }\n", "model.gpt"),
     ("model: {schedule: }\n", "model.schedule")],
)  # fmt: skip
def test_a_nested_group_given_null_in_a_file(tmp_path, char_dataset, text, key) -> None:
    (tmp_path / "null.yaml").write_text(text)
    verdicts = _verdicts(tmp_path, char_dataset, [], ALL, files=[tmp_path / "null.yaml"])
    assert_refused(verdicts, f"`{key}: null` gives the {key} group no settings; leave it out")


@pytest.mark.parametrize("args", [["--model.optimizer", "null"], ["--model.optimizer=null"]])
def test_a_nested_group_given_null_on_the_command_line(tmp_path, char_dataset, args) -> None:
    verdicts = _verdicts(tmp_path, char_dataset, args, ALL)
    assert_refused(verdicts, "--model.optimizer null gives the model.optimizer group no settings")


# -- trainer.num_nodes: 0 is refused, not read as the default 1 -----------------------------------
def test_zero_nodes_is_refused_not_priced_as_one(tmp_path, char_dataset) -> None:
    verdicts = _verdicts(tmp_path, char_dataset, ["--trainer.num_nodes", "0"], ALL)
    assert_refused(verdicts, "trainer.num_nodes must be an integer >= 1, got 0")


# -- model.gpt.vocab_size below the prepared data's -----------------------------------------------
def test_a_vocabulary_smaller_than_the_datas_is_refused_before_launch(
    tmp_path, char_dataset
) -> None:
    verdicts = _verdicts(tmp_path, char_dataset, ["--model.gpt.vocab_size", "10"], ALL)
    assert_refused(verdicts, "is larger than model.gpt.vocab_size (10); set model.gpt.vocab_size")


# -- data.source set, its folder already prepared: the data's size and align still checked --------
SOURCED = ["--data.source", "[bundled:shakespeare]", "--data.tokenizer", "chars"]


@pytest.mark.parametrize(
    ("micro", "message"),
    [("64", "windows of 200001 tokens, fewer than micro_batch_size x world_size = 64"),
     ("4", "the validation split has 98446 tokens, fewer than one block (block_size 200000 + 1)")],
)  # fmt: skip
def test_too_small_sourced_data_already_prepared(tmp_path, char_dataset, micro, message) -> None:
    args = [*SOURCED, "--model.gpt.block_size", "200000", "--data.micro_batch_size", micro]
    verdicts = _verdicts(tmp_path, char_dataset, args, ("fit", "queue"))
    assert_refused(verdicts, message)


def test_an_unknown_align_with_a_source_is_refused(tmp_path, char_dataset) -> None:
    verdicts = _verdicts(tmp_path, char_dataset, [*SOURCED, "--data.align", "documents"], ALL[::2])
    assert_refused(verdicts, "data.align must be 'stream' (windows anywhere) or 'document'")


# -- an unknown tokenizer name is that, not a folder prepared otherwise ---------------------------
def test_an_unknown_tokenizer_is_named_before_the_folder_is_called_stale(
    tmp_path, char_dataset
) -> None:
    args = ["--data.source", "[bundled:shakespeare]", "--data.tokenizer", "char"]
    verdicts = _verdicts(tmp_path, char_dataset, args, ("fit", "queue"))
    assert_refused(verdicts, "unknown tokenizer 'char'; choose one of bytes, chars, bpe, gpt2")


# -- queue add's own words: the setting typed is blamed, and a fix that works is suggested -------
def test_a_typed_list_the_parser_writes_back_is_blamed_on_the_set(tmp_path, char_dataset) -> None:
    verdicts = _verdicts(
        tmp_path, char_dataset, ["--set", "model.optimizer.lr=[1e-3,2e-3]"], ("queue",)
    )
    assert_refused(verdicts, "error: --set model.optimizer.lr=[1e-3,2e-3]: model.optimizer.lr:")


@pytest.mark.parametrize(
    ("value", "fix"),
    [("1.5", "use --seeds with integers from 0 to 4294967295 (not 1.5), e.g. --seeds 42,43,44"),
     ("3", "use --seeds 3")],
)  # fmt: skip
def test_seeds_are_suggested_only_for_a_seed(tmp_path, char_dataset, value, fix) -> None:
    verdicts = _verdicts(tmp_path, char_dataset, ["--seed_everything", value], ("queue",))
    assert_refused(verdicts, f"--seed_everything {value}: set by the queue; {fix}")
