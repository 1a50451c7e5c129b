"""A dataset folder is checked against its meta.json before training: one line, exit 2.

The folders are written by hand (``write_dataset``), so each test breaks exactly one thing and does
not depend on how ``nanolab prepare`` happens to write them today. The other data test files
import ``write_dataset`` and ``fit_config`` from here.
"""

from __future__ import annotations

import json
import logging
import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import QUICKSTART, write_config

from nanolab.cli import main
from nanolab.data.checks import (
    SAMPLE_CHUNK,
    SAMPLE_CHUNKS,
    DataCheckError,
    check_files,
    check_token_ids,
    load_meta,
)

TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune "
TRAIN_TEXT = TEXT * 40
VAL_TEXT = TEXT * 8
CODE_TEXT = "def step(model, batch):\n    return model(batch).mean()\n" * 60


def write_dataset(
    folder: Path,
    train: str = TRAIN_TEXT,
    val: str = VAL_TEXT,
    tokenizer: str = "bytes",
    dtype: str = "uint16",
    byte_counts: bool = True,
    **meta_overrides: Any,
) -> dict[str, Any]:
    """A prepared dataset as ``nanolab prepare`` lays it out, from two texts (no end-of-text)."""
    folder.mkdir(parents=True, exist_ok=True)
    if tokenizer == "bytes":
        spec: dict[str, Any] = {"name": "bytes"}
        vocab = 256

        def encode(text: str) -> list[int]:
            return list(text.encode("utf-8"))
    else:
        chars = sorted(set(train + val))
        spec = {"name": "chars", "chars": chars}
        vocab = len(chars)
        index = {c: i for i, c in enumerate(chars)}

        def encode(text: str) -> list[int]:
            return [index[c] for c in text]

    meta: dict[str, Any] = {
        "format": "nanolab-tokens-v1",
        "tokenizer": spec,
        "vocab_size": vocab,
        "dtype": dtype,
        "eot_id": None,
    }
    for split, text in (("train", train), ("val", val)):
        ids = np.asarray(encode(text), dtype=dtype)
        (folder / f"{split}.bin").write_bytes(ids.tobytes())
        meta[f"{split}_tokens"] = len(ids)
        if byte_counts:
            meta[f"{split}_bytes"] = len(text.encode("utf-8"))
    if byte_counts:
        meta["documents"] = {"train": 1, "val": 1}
    meta.update(meta_overrides)
    (folder / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


def fit_config(tmp_path: Path, data: dict[str, Any], **sections: dict[str, Any]) -> Path:
    """A tiny run (1 layer, 32 wide, block 32) on ``data``: a few milliseconds a step."""
    cfg: dict[str, Any] = {
        "trainer": {"max_steps": 4, "enable_progress_bar": False, "enable_model_summary": False},
        "model": {"gpt": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32}},
        "data": {"source": None, "micro_batch_size": 4, "val_windows": 8, **data},
        "run": {"root": str(tmp_path / "runs"), "name": "tiny", "eval_every_steps": 2},
        "checkpoint": {"every_n_steps": 2},
    }
    for key, values in sections.items():
        cfg.setdefault(key, {}).update(values)
    return write_config(tmp_path / "tiny.yaml", cfg)


def fit_in_process(capsys, config: Path, *args: str) -> tuple[int, list[str]]:
    """``nanolab fit`` through the real CLI entry point, in this process: (exit code, stderr
    lines). What it printed to stdout (the progress bar) is left in ``fit_in_process.stdout``."""
    # Lightning's log handlers keep the stderr of the test that first imported it, which
    # pytest has closed since: point them at this test's.
    for name in [n for n in logging.root.manager.loggerDict if n.startswith("lightning")]:
        for handler in logging.getLogger(name).handlers:
            if type(handler) is logging.StreamHandler:
                handler.stream = sys.stderr  # not setStream: it flushes the closed one
    try:
        code = main(["fit", "--config", str(QUICKSTART), "--config", str(config), *args])
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    fit_in_process.stdout = captured.out
    return code, captured.err.splitlines()


# -- one row per bad input: (what is broken, how to break it, what the one line must say) -----
def _set_meta(**changes: Any) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        meta = json.loads((folder / "meta.json").read_text())
        meta.update(changes)
        (folder / "meta.json").write_text(json.dumps(meta))

    return apply


def _write(name: str, data: bytes) -> Callable[[Path], None]:
    return lambda folder: (folder / name).write_bytes(data)


def _as_uint32(folder: Path) -> None:
    """uint32 token files under a meta.json that says uint16 (counts unchanged)."""
    for split in ("train", "val"):
        ids = np.fromfile(folder / f"{split}.bin", dtype=np.uint16)
        (folder / f"{split}.bin").write_bytes(ids.astype(np.uint32).tobytes())


def _as_uint32_counts_doubled(folder: Path) -> None:
    """Same, with the token counts "fixed" so the sizes match: the ids read as id, 0, id, 0."""
    _as_uint32(folder)
    meta = json.loads((folder / "meta.json").read_text())
    meta["train_tokens"] *= 2
    meta["val_tokens"] *= 2
    (folder / "meta.json").write_text(json.dumps(meta))


def _truncate(name: str, drop: int) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[:-drop])

    return apply


def _id_beyond_vocab(folder: Path) -> None:
    ids = np.fromfile(folder / "train.bin", dtype=np.uint16)
    ids[len(ids) // 2] = 300  # the bytes vocabulary has 256 ids
    (folder / "train.bin").write_bytes(ids.tobytes())


def _empty_val(folder: Path) -> None:
    (folder / "val.bin").write_bytes(b"")
    _set_meta(val_tokens=0, val_bytes=0)(folder)


BAD_DATA = [
    ("meta.json garbage", _write("meta.json", b"{not json"), "meta.json is not valid JSON"),
    ("meta.json binary", _write("meta.json", b"\xff\xfe\x00"), "meta.json is not valid JSON"),
    ("meta.json {}", _write("meta.json", b"{}"), "lacks vocab_size, dtype, train_tokens"),
    ("meta.json a list", _write("meta.json", b"[1, 2]"), "holds a JSON list"),
    ("unknown dtype", _set_meta(dtype="float16"), "dtype 'float16' is not a token dtype"),
    ("dtype not a name", _set_meta(dtype=16), "dtype 16 is not a token dtype"),
    ("token count a string", _set_meta(train_tokens="3600"), "train_tokens must be a whole"),
    ("val_bytes 0", _set_meta(val_bytes=0), "val_bytes is 0 for 720 val_tokens"),
    ("val_bytes negative", _set_meta(val_bytes=-720), "val_bytes must be a whole number >= 0"),
    ("val_bytes a fraction", _set_meta(val_bytes=719.5), "val_bytes must be a whole number"),
    ("vocab wider than dtype", _set_meta(vocab_size=70_000), "does not fit in dtype uint16"),
    ("unknown format", _set_meta(format="nanogpt"), "has format 'nanogpt'"),
    ("uint32 labelled uint16", _as_uint32, "it was written as uint32, not uint16"),
    ("uint32 labelled uint16, counts doubled", _as_uint32_counts_doubled, "uint32 tokens read"),
    ("size not a multiple of dtype", _truncate("train.bin", 1), "not a whole number of uint16"),
    ("size short of meta", _truncate("val.bin", 2), "meta.json says val_tokens"),
    ("empty val.bin", _empty_val, "val.bin is empty"),
    ("val.bin missing", lambda f: (f / "val.bin").unlink(), "val.bin is missing"),
    ("token id >= vocab", _id_beyond_vocab, "holds token id 300 at position"),
    # A meta.json edited, or its tokenizer from another folder: the ids decode as other text.
    ("vocab_size not the tokenizer's", _set_meta(vocab_size=300), "has 256 ids where meta.json"),
    (
        "chars list cut short",
        _set_meta(tokenizer={"name": "chars", "chars": list("abcde")}),
        "its tokenizer has 5 ids where meta.json says vocab_size 256",
    ),
    # A bpe dataset copied as "three files": it trained, then the first save lost the run.
    (
        "bpe tokenizer.json missing",
        _set_meta(tokenizer={"name": "bpe", "file": "tokenizer.json"}),
        "tokenizer.json is missing: a bpe dataset is four files",
    ),
]


@pytest.mark.parametrize(("what", "damage", "message"), BAD_DATA, ids=[r[0] for r in BAD_DATA])
def test_bad_data_files_end_in_one_line_and_exit_2(tmp_path, capsys, what, damage, message):
    data = tmp_path / "data"
    write_dataset(data)
    damage(data)
    before = {p.name: p.read_bytes() for p in data.iterdir()}
    code, err = fit_in_process(capsys, fit_config(tmp_path, {"dataset_dir": str(data)}))
    assert code == 2, err
    errors = [line for line in err if "error" in line.lower()]
    assert len(errors) == 1 and message in errors[0], errors
    assert str(data) in errors[0]  # names the folder or file
    assert "Traceback" not in "\n".join(err)
    assert not (tmp_path / "runs").exists()  # nothing written for the run
    assert {p.name: p.read_bytes() for p in data.iterdir()} == before  # the data is untouched


def test_a_tokenizer_json_from_another_bpe_dataset_is_refused_before_training(tmp_path, capsys):
    """Two bpe folders of one corpus (300 and 260 ids); the first given the second's
    tokenizer.json would train, then generate and eval would decode 300-id data with 260 ids."""
    from nanolab.data.prepare import prepare_dataset

    text = tmp_path / "corpus.txt"
    text.write_text(TRAIN_TEXT + CODE_TEXT)
    folders = {}
    for vocab in (300, 260):
        folders[vocab] = tmp_path / f"bpe{vocab}"
        prepare_dataset([str(text)], folders[vocab], "bpe", bpe_vocab_size=vocab, quiet=True)
    swapped = folders[300] / "tokenizer.json"
    swapped.write_bytes((folders[260] / "tokenizer.json").read_bytes())
    code, err = fit_in_process(capsys, fit_config(tmp_path, {"dataset_dir": str(folders[300])}))
    assert code == 2, err
    errors = [line for line in err if "error" in line.lower()]
    assert len(errors) == 1, err
    assert f"{swapped} has 260 ids where meta.json says vocab_size 300" in errors[0]
    assert f"-o {folders[300]} --force" in errors[0]  # the command that makes it whole again
    assert "Traceback" not in "\n".join(err)
    assert not (tmp_path / "runs").exists()


def test_a_good_folder_passes_every_check(tmp_path):
    data = tmp_path / "data"
    meta = write_dataset(data)
    check_files(data, load_meta(data))
    assert meta["train_tokens"] == len(TRAIN_TEXT)


def test_the_id_check_reads_a_bounded_sample_of_a_huge_file(tmp_path):
    # A 1 GiB token file (sparse: no disk used) is checked by reading SAMPLE_CHUNKS runs of
    # SAMPLE_CHUNK tokens; Python-side memory stays at one run, not the file.
    path = tmp_path / "train.bin"
    tokens = 1 << 29
    with open(path, "wb") as f:
        f.truncate(tokens * 2)
    tracemalloc.start()
    read = check_token_ids(path, np.dtype("uint16"), 256)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert read == SAMPLE_CHUNKS * SAMPLE_CHUNK < tokens // 100
    assert peak < 4 * SAMPLE_CHUNK * 8  # a few runs' worth of bytes at most
    # ...and the sample includes the last token: an id out of range there is found.
    with open(path, "r+b") as f:
        f.seek(tokens * 2 - 2)
        f.write(np.uint16(999).tobytes())
    with pytest.raises(DataCheckError, match=f"token id 999 at position {tokens - 1:,}"):
        check_token_ids(path, np.dtype("uint16"), 256)


def test_a_folder_prepared_otherwise_names_the_exact_prepare_command_that_replaces_it(tmp_path):
    """fit never overwrites a dataset prepared from other sources or settings; its error line
    gives the ``nanolab prepare ... --force`` command with the config's sources and tokenizer
    settings (it had a ``<sources>`` placeholder and no tokenizer), and that command, run as
    printed, makes the same fit train."""
    import shlex

    from conftest import nanolab_here, tiny_overrides

    text = tmp_path / "a.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    assert (
        nanolab_here("prepare", str(text), "-o", str(tmp_path / "d"), cwd=tmp_path).returncode == 0
    )
    cfg = tiny_overrides(tmp_path / "d", tmp_path / "runs", trainer__max_steps=2)
    cfg["data"].update(source=[str(text)], tokenizer="bpe", bpe_vocab_size=300, val_windows=4)
    config = write_config(tmp_path / "c.yaml", cfg)
    refused = nanolab_here(
        "fit", "--config", str(QUICKSTART), "--config", str(config), cwd=tmp_path
    )
    assert refused.returncode == 2, refused.stderr[-2000:]
    command = refused.stderr.strip().splitlines()[-1].split("`")[-2]
    assert command == (f"nanolab prepare {text} -o {tmp_path / 'd'} --tokenizer bpe "
                       "--bpe-vocab-size 300 --force")  # fmt: skip
    assert nanolab_here(*shlex.split(command)[1:], cwd=tmp_path).returncode == 0
    done = nanolab_here("fit", "--config", str(QUICKSTART), "--config", str(config), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_folder_of_other_sources_is_not_offered_for_replacement_as_if_it_were_stale(tmp_path):
    """The stale-dataset refusal offered `nanolab prepare <data.source> -o <folder> --force`
    also where the folder holds a dataset of other sources (the user's own): run as offered,
    it deleted that dataset. It now says whose dataset the command deletes, after training on
    the folder as it is; the same sources edited since keep the plain replacement."""
    from conftest import nanolab_here, tiny_overrides

    mine, other = tmp_path / "mine.txt", tmp_path / "other.txt"
    mine.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    other.write_text("pack my box with five dozen liquor jugs. " * 400)
    folder = tmp_path / "d"
    assert nanolab_here("prepare", str(mine), "-o", str(folder), cwd=tmp_path).returncode == 0

    def refusal(source: Path) -> str:
        cfg = tiny_overrides(folder, tmp_path / "runs", trainer__max_steps=2)
        cfg["data"].update(source=[str(source)], val_windows=4)
        config = write_config(tmp_path / "c.yaml", cfg)
        refused = nanolab_here("fit", "--config", str(QUICKSTART), "--config", str(config),
                               cwd=tmp_path)  # fmt: skip
        assert refused.returncode == 2, refused.stderr[-2000:]
        (line,) = [x for x in refused.stderr.splitlines() if "error:" in x]
        return line

    line = refusal(other)
    assert f"holds a dataset prepared from {mine}, not from data.source {other}," in line
    assert line.index("--data.source null") < line.index("--force")
    assert f"or delete the dataset of {mine} in {folder} and prepare {other} there: `" in line

    with open(mine, "a") as f:  # the same source, edited: the plain replacement
        f.write("an edit. " * 20)
    line = refusal(mine)
    assert (
        "other sources or settings" in line and f"replace it with `nanolab prepare {mine}" in line
    )
    assert "delete" not in line


def test_the_same_file_named_through_a_link_another_folder_or_a_glob_is_not_another_dataset(
    tmp_path, monkeypatch
):
    """meta.json's sources are stored as typed (relative to the folder prepare ran in): made
    absolute under today's folder, the same file named through a linked folder, from another
    folder or by a glob was called "a dataset prepared from corpus/a.txt, not from data.source
    src/a.txt" and the user told to delete it. Judged from the files' real paths now; a
    dataset that does not store them is never called another's."""
    import json

    from nanolab.data.prepare import prepare_dataset
    from nanolab.data.stale import other_sources

    project = tmp_path / "p"
    corpus = project / "corpus"
    corpus.mkdir(parents=True)
    (corpus / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    (corpus / "b.txt").write_text("pack my box with five dozen liquor jugs. " * 200)
    monkeypatch.chdir(project)
    prepare_dataset(["corpus/a.txt"], "data", quiet=True)
    (project / "src").symlink_to("corpus")

    assert other_sources("data", ["src/a.txt"]) is None  # through a linked folder
    assert other_sources("p/data", ["p/corpus/a.txt"], cwd=tmp_path) is None  # another folder
    assert other_sources("data", ["corpus/*.txt"]) is None  # a glob naming it and more
    assert other_sources("data", ["src/b.txt"]) == ["corpus/a.txt"]  # another file's dataset

    meta = json.loads((project / "data" / "meta.json").read_text())
    del meta["source_paths"]  # a folder of many files keeps only their digest
    (project / "data" / "meta.json").write_text(json.dumps(meta))
    assert other_sources("data", ["src/a.txt"]) is None  # the same file: its digest
    assert other_sources("data", ["src/b.txt"]) == ["corpus/a.txt"]  # another: said so

    del meta["source_paths_sha256"]  # prepared by an older nanolab: the typed specs cannot tell
    (project / "data" / "meta.json").write_text(json.dumps(meta))
    assert other_sources("data", ["src/b.txt"]) is None


def test_checkpoints_store_the_tokenizer_checked_at_start_not_the_folders_at_save(
    tmp_path, capsys, monkeypatch
):
    """A folder prepared again during a run (another alphabet, renamed into place as
    ``prepare --force`` does) changes neither what the run trains on nor the tokenizer its
    checkpoints store: generate decodes with the run's own."""
    import os

    import torch

    from nanolab.data.datamodule import TokenDataModule

    data = tmp_path / "data"
    checked = write_dataset(data, tokenizer="chars")
    setup = TokenDataModule.setup

    def setup_then_prepare_again(self: TokenDataModule, stage: str) -> None:
        setup(self, stage)
        other = tmp_path / "other"
        write_dataset(other, train=CODE_TEXT, val=CODE_TEXT[:500], tokenizer="chars")
        os.replace(data, tmp_path / "old")
        os.replace(other, data)

    monkeypatch.setattr(TokenDataModule, "setup", setup_then_prepare_again)
    code, err = fit_in_process(capsys, fit_config(tmp_path, {"dataset_dir": str(data)}))
    assert code == 0, err[-20:]
    ckpt = torch.load(
        tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt", map_location="cpu",
        weights_only=True,
    )  # fmt: skip
    assert ckpt["nanolab"]["tokenizer"] == checked["tokenizer"]


def test_a_data_tokenizer_that_prepared_data_ignores_is_one_warning_line(tmp_path, monkeypatch):
    """With data.source null the data's own tokenizer trains: a data.tokenizer naming another
    (it was ignored without a word) is one warning line; the data's own, or none, says nothing."""
    from nanolab import messages
    from nanolab.data.datamodule import TokenDataModule

    data = tmp_path / "data"
    write_dataset(data)  # bytes
    warned: list[str] = []
    monkeypatch.setattr(messages, "warn", lambda prog, text: warned.append(text))
    for setting in ("bytes", "chars", "bpe", "bpe"):
        dm = TokenDataModule(str(data), None, setting, block_size=16, micro_batch_size=4)
        _ = dm.parts
    assert warned == [
        f"data.tokenizer bpe is not used: it applies only when fit prepares data.source, which "
        f"is null, so this run trains on the tokenizer {data} was prepared with (bytes); set "
        "data.tokenizer: bytes or leave it out, or set data.source to prepare the data with it"
    ]


def test_the_tokenizer_json_the_data_was_prepared_with_is_no_warning_however_it_is_written(
    tmp_path, monkeypatch
):
    """A data.tokenizer naming the very tokenizer.json the data was prepared with warned "is
    not used" when the file was not written byte for byte by the tokenizers library (pretty-
    printed, an older hub file): its bytes differ from the dataset's copy, its tokenizer not."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from nanolab import messages
    from nanolab.data.datamodule import TokenDataModule
    from nanolab.data.prepare import prepare_dataset

    vocab = {chr(c): i for i, c in enumerate(range(32, 127))}
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    mine = tmp_path / "mytok.json"
    mine.write_text(json.dumps(json.loads(tok.to_str()), indent=4))  # by hand: pretty-printed
    (tmp_path / "in.txt").write_text("some words to prepare, and more of them\n" * 200)
    data = tmp_path / "data"
    prepare_dataset([str(tmp_path / "in.txt")], data, str(mine), quiet=True)
    assert mine.read_bytes() != (data / "tokenizer.json").read_bytes()
    warned: list[str] = []
    monkeypatch.setattr(messages, "warn", lambda prog, text: warned.append(text))
    _ = TokenDataModule(str(data), None, str(mine), block_size=16, micro_batch_size=4).parts
    assert warned == []
    other = tmp_path / "other.json"
    del vocab["~"]
    Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>")).save(str(other))
    _ = TokenDataModule(str(data), None, str(other), block_size=16, micro_batch_size=4).parts
    assert len(warned) == 1 and f"data.tokenizer {other} is not used" in warned[0]


def test_the_in_loop_tasks_take_the_tokenizer_checked_at_start(tmp_path):
    """The in-loop task scores encode with the run's tokenizer, the one its checkpoints store,
    not whatever the folder holds when the callback sets up (prepared again meanwhile)."""
    import os

    from nanolab.data.datamodule import TokenDataModule
    from nanolab.data.tokenizers import data_tokenizer, tokenizer_from_spec

    data = tmp_path / "data"
    checked = write_dataset(data, tokenizer="chars")
    dm = TokenDataModule(str(data), None, "chars", block_size=16, micro_batch_size=4)
    _ = dm.parts  # the data check
    other = tmp_path / "other"
    write_dataset(other, train=CODE_TEXT, val=CODE_TEXT[:500], tokenizer="chars")
    os.replace(data, tmp_path / "old")
    os.replace(other, data)
    expected = tokenizer_from_spec(checked["tokenizer"])
    assert data_tokenizer(dm).to_meta() == expected.to_meta()


def test_prepare_settings_that_prepared_data_ignores_are_one_warning_line(tmp_path, monkeypatch):
    """With data.source null, data.bpe_vocab_size and data.val_fraction were ignored without a
    word (and config.yaml recorded them as if used): set, they are one warning line naming
    each with what the data's meta.json records; left at their defaults, or at the values the
    data was prepared with, they say nothing. The config still runs."""
    from nanolab import messages
    from nanolab.data.datamodule import TokenDataModule
    from nanolab.data.prepare import prepare_dataset

    (tmp_path / "in.txt").write_text("some words to prepare, and more of them\n" * 200)
    data = tmp_path / "data"
    prepare_dataset([str(tmp_path / "in.txt")], data, "chars", val_fraction=0.2, quiet=True)
    warned: list[str] = []
    monkeypatch.setattr(messages, "warn", lambda prog, text: warned.append(text))

    def parts(**settings: object) -> None:
        dm = TokenDataModule(str(data), None, block_size=16, micro_batch_size=4, **settings)
        assert len(dm.parts) == 1

    parts()  # the defaults
    parts(val_fraction=0.2)  # what the data was prepared with
    parts(bpe_vocab_size=8192, val_fraction=0.05)
    parts(bpe_vocab_size=512)
    assert warned == [
        "data.bpe_vocab_size 8192 and data.val_fraction 0.05 are not used: they apply only when "
        f"fit prepares data.source, which is null, so this run trains on {data} as it was "
        "prepared (its meta.json: bpe_vocab_size null, val_fraction 0.2); leave them out, or "
        "set data.source to prepare the data with them",
        "data.bpe_vocab_size 512 is not used: it applies only when fit prepares data.source, "
        f"which is null, so this run trains on {data} as it was prepared (its meta.json: "
        "bpe_vocab_size null); leave it out, or set data.source to prepare the data with it",
    ]
