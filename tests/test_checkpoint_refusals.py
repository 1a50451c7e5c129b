"""Checkpoints that are not what nanolab writes, refused in one line naming the file (exit 2)
by every command that reads one: a malformed stored tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import QUICKSTART, nanolab_here, tiny_overrides, write_config


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, char_dataset: Path) -> Path:
    """A folder holding a tiny run (runs/tiny, 4 steps) and its config (t.yaml)."""
    work = tmp_path_factory.mktemp("refusals")
    cfg = tiny_overrides(char_dataset, work / "runs", trainer__max_steps=4)
    write_config(work / "t.yaml", cfg)
    res = nanolab_here("fit", "--config", str(QUICKSTART), "--config", "t.yaml", cwd=work)
    assert res.returncode == 0, res.stderr[-2000:]
    return work


BAD_SPECS = {
    "no-chars": ({"name": "chars"}, "chars (its list of characters) is missing"),
    "int-chars": ({"name": "chars", "chars": 5}, "chars is '5' (int), not a list"),
    "word-in-chars": ({"name": "chars", "chars": ["a", "bc"]}, "chars holds 'bc', not one"),
    "bpe-not-json": ({"name": "bpe", "json": "{not json"}, "json is not JSON"),
    "bpe-json-list": ({"name": "bpe", "json": "[1]"}, "json is not a tokenizer.json"),
    "eot-id-text": ({"name": "hf", "json": "{}", "eot_id": "0"}, "eot_id is '0', not a token"),
}


@pytest.mark.parametrize("case", sorted(BAD_SPECS))
def test_a_malformed_tokenizer_spec_is_a_tokenizer_error_naming_the_field(case: str) -> None:
    """It was a KeyError, TypeError or a tokenizers exception: a traceback."""
    from nanolab.data.tokenizers import TokenizerSpecError, tokenizer_from_spec

    spec, words = BAD_SPECS[case]
    with pytest.raises(TokenizerSpecError, match=words.replace("(", r"\(").replace(")", r"\)")):
        tokenizer_from_spec(spec)


def test_json_that_tokenizers_cannot_read_is_a_tokenizer_error() -> None:
    from nanolab.data.tokenizers import TokenizerSpecError, tokenizer_from_spec

    with pytest.raises(TokenizerSpecError, match=r"not a tokenizer\.json tokenizers reads"):
        tokenizer_from_spec({"name": "bpe", "json": '{"model": 3}'})


def test_every_reader_refuses_a_checkpoint_with_a_malformed_tokenizer_in_one_line(
    trained: Path,
) -> None:
    """generate, export, eval and validate gave a traceback; fit resumed from it silently."""
    ckpt = torch.load(trained / "runs/tiny/checkpoints/last.ckpt", weights_only=True)
    ckpt["nanolab"]["tokenizer"] = {"name": "chars"}
    bad = trained / "bad.ckpt"
    torch.save(ckpt, bad)
    line = f"{bad}: its stored tokenizer is not valid (nanolab.tokenizer: chars (its list"
    for args in (
        ("generate", "--ckpt", str(bad), "--prompt", "a"),
        ("export", "--ckpt", str(bad), "-o", str(trained / "out")),
        ("export", "--ckpt", str(bad), "-o", str(trained / "out"), "--format", "safetensors"),
        ("eval", str(bad)),
        ("validate", "--config", "t.yaml", "--ckpt_path", str(bad)),
        ("fit", "--config", "t.yaml", "--run.name", "again", "--run.resume", str(bad)),
    ):
        res = nanolab_here(*args, cwd=trained)
        assert res.returncode == 2, (args, res.stderr[-2000:])
        last = res.stderr.strip().splitlines()[-1]
        assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, args
        assert str(bad) in last and "its stored tokenizer is not valid" in last, (args, last)
        assert line in last or args[0] in ("validate", "fit"), (args, last)
    assert not (trained / "out").exists() and not (trained / "runs" / "again").exists()
