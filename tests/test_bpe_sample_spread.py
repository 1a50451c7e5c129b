"""The BPE training sample of a compressed corpus is drawn from all of it.

The sample's rate came from a fixed guess of 3x text per compressed byte: four zstd shards at
~9x drew their sample from the first two, where the cap then stopped the pass without a word.
"""

from __future__ import annotations

import collections
import json
import random
from pathlib import Path

import pytest

from nanolab.data import encode
from nanolab.data import prepare as prep


class _Trained(Exception):
    """Raised in place of training: the sample is all that is looked at."""


def _shards(folder: Path, n: int = 4, docs: int = 1500) -> list[Path]:
    """``n`` .jsonl.zst files of ~2 MB of text each, compressed well over 3x."""
    import zstandard

    rng = random.Random(0)
    words = ["".join(rng.choices("abcdef", k=4)) for _ in range(60)]
    pool = [json.dumps({"text": " ".join(rng.choices(words, k=260))}) + "\n" for _ in range(40)]
    folder.mkdir()
    paths = []
    for i in range(n):
        lines = rng.choices(pool, k=docs)
        path = folder / f"part{i:02d}.jsonl.zst"
        path.write_bytes(zstandard.ZstdCompressor().compress("".join(lines).encode()))
        paths.append(path)
    return paths


def _sample_per_file(monkeypatch, folder: Path, target: int) -> collections.Counter[str]:
    """The characters the BPE sample draws from each file of ``folder``."""
    drawn: collections.Counter[str] = collections.Counter()
    draw = encode.block_sample

    def counted(block, *args):
        texts, errors, kept = draw(block, *args)
        drawn[Path(block.file_path).name] += sum(len(t) for t in texts)
        return texts, errors, kept

    def train(texts, vocab_size):
        for _ in texts:
            pass
        raise _Trained

    monkeypatch.setattr(encode, "block_sample", counted)
    monkeypatch.setattr(prep, "train_bpe", train)
    with pytest.raises(_Trained):
        prep.prepare_dataset(
            [str(folder)], folder.parent / "ds", "bpe", 300, workers=1, quiet=True,
            bpe_sample_bytes=target,
        )  # fmt: skip
    return drawn


def test_the_sample_of_well_compressed_shards_comes_from_every_shard(tmp_path, monkeypatch, capsys):
    paths = _shards(tmp_path / "c")
    text = sum(len(zst_text(p)) for p in paths)
    assert text > 3 * 3 * sum(p.stat().st_size for p in paths)  # the old guess: 3x
    target = text // 8
    drawn = _sample_per_file(monkeypatch, tmp_path / "c", target)
    assert sorted(drawn) == [p.name for p in paths]
    total = sum(drawn.values())
    assert 0.75 * target < total < 1.25 * target, (total, target)
    assert all(0.15 * total < n < 0.35 * total for n in drawn.values()), drawn
    assert "BPE sample" not in capsys.readouterr().err


def test_a_sample_the_cap_ends_early_says_where(tmp_path, monkeypatch, capsys):
    _shards(tmp_path / "c")
    rate = prep._SampleRate.keep  # its bookkeeping kept, its rate far too high
    monkeypatch.setattr(prep._SampleRate, "keep", lambda self, *a: rate(self, *a) and 1.0)
    drawn = _sample_per_file(monkeypatch, tmp_path / "c", 1 << 20)
    assert list(drawn) == ["part00.jsonl.zst"]
    said = capsys.readouterr().err
    assert "the BPE sample reached its cap" in said and "in file 1 of 4" in said, said
    assert "part00.jsonl.zst): the rest of the corpus is not in it" in said


def zst_text(path: Path) -> bytes:
    import zstandard

    return zstandard.ZstdDecompressor().decompressobj().decompress(path.read_bytes())
