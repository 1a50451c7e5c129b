"""A long document (a JSON line of tens of MB) is encoded slice by slice where the tokenizer's
ids cannot depend on the cut, to the ids of encoding it whole, in memory that follows the
slice rather than the document."""

from __future__ import annotations

import hashlib
import json
import random
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from nanolab.data import encode, sources, tokenizers
from nanolab.data.prepare import prepare_dataset
from nanolab.data.sources import FileReader, resolve_sources
from nanolab.data.tokenizers import HFTokenizer, build_tokenizer

WORDS = ["the", "cat's", "sat", "on", "mat", "42", "3.14", "naïve", "Ελλάδα", "東京", "😀", "--"]
GAPS = [" ", "  ", "\n", "\t", " \n ", "", ", ", "'s "]


def awkward_prose(seed: int, n: int) -> str:
    """Words of letters, digits, punctuation and non-Latin scripts, joined by every kind of gap
    (none, runs of spaces, newlines, contractions): the places a cut could change a token."""
    rng = random.Random(seed)
    return "".join(rng.choice(WORDS) + rng.choice(GAPS) for _ in range(n))


def nanolab_bpe(text: str) -> HFTokenizer:
    tok = build_tokenizer("bpe", lambda: [text], 600)
    assert isinstance(tok, HFTokenizer)
    return tok


def normalizing_tokenizer(path: Path) -> HFTokenizer:
    """A tokenizer.json whose ids can change where a text is cut (a Metaspace pre-tokenizer
    marks every text's start): never sliced."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", "</s>"])
    tok.train_from_iterator([awkward_prose(9, 3000)], trainer=trainer)
    tok.save(str(path))
    return HFTokenizer.from_file(path)


@pytest.mark.parametrize("name", ["bytes", "chars", "bpe", "hf"])
def test_a_long_text_encoded_in_slices_has_the_ids_of_the_whole(tmp_path, monkeypatch, name):
    """Slices of ~500 characters of 20 texts: bytes and chars cut anywhere (an id per byte or
    character), nanolab's BPE before a space between two letters (GPT-2's pre-tokenizer ends a
    word there), a tokenizer.json with a normalizer nowhere."""
    monkeypatch.setattr(tokenizers, "SLICE_CHARS", 500)
    sample = awkward_prose(0, 5000)
    if name == "bpe":
        tok = nanolab_bpe(sample)
    elif name == "hf":
        tok = normalizing_tokenizer(tmp_path / "tokenizer.json")
    else:
        tok = build_tokenizer(name, lambda: [sample])
    sliced = 0
    for seed in range(20):
        text = awkward_prose(seed, 2000)
        pieces = list(tok.encode_long(text))
        assert np.concatenate(pieces).tolist() == tok.encode_batch([text])[0].tolist(), seed
        sliced += len(pieces) > 1
    assert sliced == (0 if name == "hf" else 20)


def test_only_a_gpt2_style_tokenizer_json_is_cut_between_words(tmp_path):
    """A tokenizer.json is sliced only when its pre-tokenization is GPT-2's byte-level one with
    nothing before it; a prefix space, a normalizer or an added token holding a space would let
    a cut change the ids."""
    from tokenizers import AddedToken, normalizers, pre_tokenizers

    tok = nanolab_bpe(awkward_prose(0, 2000))
    assert tok._word_slices
    raw = tok._tok
    for change in (
        lambda t: setattr(t, "normalizer", normalizers.NFC()),
        lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.ByteLevel(add_prefix_space=True)),
        lambda t: t.add_tokens([AddedToken("the cat")]),
        lambda t: t.add_special_tokens([AddedToken("<x>", lstrip=True)]),
    ):
        edited = type(raw).from_str(raw.to_str())
        change(edited)
        assert not HFTokenizer(edited, "hf", 0)._word_slices


def one_line_jsonl(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps({"text": "a short document before"}) + "\n")
        f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
        f.write(json.dumps({"text": "and one after"}) + "\n")


@pytest.mark.parametrize(
    ("name", "digests"),
    [
        ("bytes", ("527637168cbcbb57", "f3b903c1ec6ef560")),
        ("chars", ("c461af4c3c1c7e3b", "ef2d7882a364b01b")),
        ("bpe", ("9f1a5706a20068fa", "0209e98f4013168b")),
    ],
)
def test_a_long_json_line_prepares_to_the_tokens_it_always_did(tmp_path, name, digests):
    """A 450 KB JSON document (two slices) between two short ones: the bins' sha256 were made
    when a document was encoded whole."""
    src = tmp_path / "long.jsonl"
    one_line_jsonl(src, awkward_prose(1, 60_000))
    assert len(awkward_prose(1, 60_000)) > tokenizers.SLICE_CHARS  # encoded in two slices
    out = tmp_path / "ds"
    prepare_dataset([str(src)], out, name, bpe_vocab_size=600, quiet=True)
    got = tuple(
        hashlib.sha256((out / n).read_bytes()).hexdigest()[:16] for n in ("train.bin", "val.bin")
    )
    assert got == digests


def test_a_long_json_line_is_read_and_encoded_in_a_few_times_its_size(tmp_path, monkeypatch):
    """A 4 MB one-line JSON document, read and encoded (chars): its chunks, their join and the
    block's slice were held together while it was encoded, then a copy of the line, its UTF-8
    to count its bytes, its code points as utf-32 three times over (12x) and its ids twice:
    ~14x the line at the peak. Now the block, the line decoded, its text and its ids: ~5x."""
    src = tmp_path / "long.jsonl"
    text = "".join(random.Random(0).choices("abcdefgh \n", k=4_000_000))
    one_line_jsonl(src, text)
    monkeypatch.setattr(sources, "_READ_BYTES", 1 << 18)  # reads small beside the line
    file = resolve_sources([str(src)]).files[0]
    spec = build_tokenizer("chars", lambda: [src.read_text()]).to_meta()
    encode.init_worker(spec, encode.EncodeSettings("text", 0.1, 0, "uint16"))
    tracemalloc.start()
    try:
        tokens = 0
        for block in FileReader(file, 0, "text").blocks():
            result = encode.encode_block(block)
            tokens += result.train.size + result.val.size
            del block, result
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert tokens == len(text) + len("a short document before") + len("and one after") + 3
    size = src.stat().st_size
    assert peak < 6 * size, f"peak {peak / size:.1f}x the line"


def test_long_documents_wait_for_room_in_the_workers(tmp_path, monkeypatch):
    """Each worker took two blocks whatever their size: 16 workers held 32 lines of up to
    64 MB, each encoded in a multiple of its size. A block that would put more raw bytes in
    flight than one longest line (or two usual blocks a worker) waits for the ones before it,
    and the bins are those of one worker."""
    from concurrent.futures import Future

    from nanolab.data import prepare

    monkeypatch.setattr(sources, "BLOCK_BYTES", 1000)
    monkeypatch.setattr(sources, "_READ_BYTES", 500)
    monkeypatch.setattr(sources, "JSON_LINE_MAX_BYTES", 20_000)
    budget = prepare.in_flight_budget(2)
    assert budget == 20_000
    src = tmp_path / "lines.jsonl"
    rng = random.Random(0)
    with open(src, "w") as f:
        for i in range(40):
            text = awkward_prose(i, rng.choice([3, 1800]))  # ~12 KB lines among short ones
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    flight = {"now": 0, "peak": 0, "largest": 0}

    class Tracked(Future):
        def result(self, timeout=None):
            if not self.taken:
                self.taken = True
                flight["now"] -= self.size
            return super().result(timeout)

    class InlinePool:
        """Runs each block at once; counts a block in flight until its result is taken."""

        def __init__(self, workers, mp_context=None, initializer=None, initargs=()):
            initializer(*initargs[:2])  # not as a worker of this process

        def submit(self, func, block, *extra):
            future = Tracked()
            future.size, future.taken = prepare.block_bytes(block), False
            flight["now"] += future.size
            flight["peak"] = max(flight["peak"], flight["now"])
            flight["largest"] = max(flight["largest"], future.size)
            future.set_result(func(block, *extra))
            return future

        def shutdown(self, wait=True, cancel_futures=False):
            pass

    monkeypatch.setattr(prepare, "default_workers", lambda: 2)
    monkeypatch.setattr(prepare, "ProcessPoolExecutor", InlinePool)
    prepare_dataset([str(src)], tmp_path / "two", "bytes", quiet=True, workers=2)
    assert flight["largest"] > budget / 2  # two such blocks would not fit together
    assert flight["peak"] <= max(budget, flight["largest"]), flight
    prepare_dataset([str(src)], tmp_path / "one", "bytes", quiet=True, workers=1)
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / "two" / name).read_bytes() == (tmp_path / "one" / name).read_bytes()
