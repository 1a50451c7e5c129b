"""The ``gpt2`` tokenizer: GPT-2's byte-level BPE through tiktoken, and one clear error line when
tiktoken or its files are not on this machine.

tiktoken downloads GPT-2's merge files on first use, which an offline machine (this one) cannot.
So the real path runs on GPT-2-format files made here: a byte-level BPE trained with Hugging Face
``tokenizers`` on a little text, written as GPT-2's ``vocab.bpe`` (merges) and ``encoder.json``,
read by tiktoken's own GPT-2 loader and used with GPT-2's pre-tokenizer regex and
``<|endoftext|>``. Only the download is replaced (``tiktoken.get_encoding("gpt2")`` returns that
encoding); everything nanolab does with it — building the tokenizer, ``nanolab prepare``,
rebuilding it from ``meta.json`` — is the code users run.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import run_nanolab

from nanolab.data.tokenizers import TokenizerError, load_tokenizer, tokenizer_from_spec

TEXT = (
    "ROMEO: But soft, what light through yonder window breaks?\n"
    "JULIET: Ay me! — ünïcödé ✓ 日本 <|endoftext|> stays text here.\n"
) * 4


def gpt2_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (printable bytes stand for themselves)."""
    kept = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    table = {b: chr(b) for b in kept}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def write_gpt2_files(folder: Path, text: str, merges: int = 200) -> tuple[Path, Path, object]:
    """``vocab.bpe`` and ``encoder.json`` in GPT-2's format for a BPE learnt from ``text``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=256 + merges,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator([text], trainer=trainer)
    pairs = [
        m.split(" ") if isinstance(m, str) else m
        for m in json.loads(hf.to_str())["model"]["merges"]
    ]
    alphabet = gpt2_alphabet()
    # GPT-2's ranks: the 256 bytes in the alphabet's order, then one per merge, in merge order.
    order = [b for b in range(256) if alphabet[b] == chr(b)]
    order += [b for b in range(256) if alphabet[b] != chr(b)]
    encoder = {alphabet[b]: rank for rank, b in enumerate(order)}
    for first, second in pairs:
        encoder.setdefault(first + second, len(encoder))
    folder.mkdir(parents=True, exist_ok=True)
    vocab_bpe, encoder_json = folder / "vocab.bpe", folder / "encoder.json"
    vocab_bpe.write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in pairs))
    encoder_json.write_text(json.dumps(encoder))
    return vocab_bpe, encoder_json, hf


@pytest.fixture
def local_gpt2(tmp_path, monkeypatch):
    """tiktoken's ``gpt2`` encoding, built from GPT-2-format files made here (no download)."""
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str  # GPT-2's pre-tokenizer regex

    vocab_bpe, encoder_json, hf = write_gpt2_files(tmp_path / "gpt2-files", TEXT)
    ranks = data_gym_to_mergeable_bpe_ranks(str(vocab_bpe), str(encoder_json))
    enc = tiktoken.Encoding(
        name="gpt2",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": len(ranks)},
    )
    real = tiktoken.get_encoding
    monkeypatch.setattr(
        tiktoken, "get_encoding", lambda name: enc if name == "gpt2" else real(name)
    )
    return enc, hf


def test_gpt2_tokenizer_encodes_with_tiktoken(local_gpt2, tmp_path, capsys):
    """The tokenizer GPT-2 configs name, through tiktoken: its vocabulary and end-of-text are
    the encoding's, ``<|endoftext|>`` written in a document is ordinary text, ids round-trip, and
    the pieces are the ones a byte-level BPE with GPT-2's regex and the same merges gives.
    ``nanolab prepare --tokenizer gpt2`` writes a dataset that decodes back to its documents.

    Mutations caught: ``encode`` calling tiktoken's ``encode`` (raises on ``<|endoftext|>`` in
    the text) instead of ``encode_ordinary``; ``vocab_size`` returning 50257 whatever the
    encoding holds.
    """
    enc, hf = local_gpt2
    tok = tokenizer_from_spec({"name": "gpt2"})
    assert tok.vocab_size == enc.n_vocab > 256 + 1  # bytes, merges and <|endoftext|>
    ids = tok.encode(TEXT)
    assert len(ids) < len(TEXT.encode()) / 2  # merges applied
    assert tok.decode(ids) == TEXT
    assert enc.eot_token not in ids  # the literal marker is text, not the end-of-text id
    alphabet = {c: b for b, c in gpt2_alphabet().items()}
    hf_pieces = [bytes(alphabet[c] for c in t) for t in hf.encode(TEXT).tokens]
    assert [enc.decode_single_token_bytes(i) for i in ids] == hf_pieces

    docs = tmp_path / "docs"
    docs.mkdir()
    lines = TEXT.splitlines()
    for i, line in enumerate(lines):
        (docs / f"doc{i}.txt").write_text(line + "\n")
    from nanolab.cli import main

    out = tmp_path / "ds"
    assert main(["prepare", str(docs), "--tokenizer", "gpt2", "-o", str(out), "-q"]) == 0
    capsys.readouterr()
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"]["name"] == "gpt2" and meta["vocab_size"] == enc.n_vocab
    loaded = load_tokenizer(out)
    stored = np.concatenate(
        [np.fromfile(out / f"{s}.bin", dtype=meta["dtype"]) for s in ("train", "val")]
    )
    assert int(stored.max()) < enc.n_vocab
    ends = int((stored == enc.eot_token).sum())
    text = loaded.decode(stored.tolist())
    assert all(line in text for line in lines)
    # Each document's literal marker survived as text; only document ends became the id.
    assert text.count("<|endoftext|>") == TEXT.count("<|endoftext|>") + ends


def test_gpt2_without_its_files_is_one_error_line(tmp_path):
    """tiktoken installed, its GPT-2 files neither cached nor downloadable: ``nanolab prepare``
    says so in one line (the fix: copy the files, or use ``bpe``), exit 2, nothing written.

    Mutation caught: ``TiktokenGPT2`` letting tiktoken's download error through (a traceback,
    exit 1).
    """
    pytest.importorskip("tiktoken")
    src = tmp_path / "t.txt"
    src.write_text(TEXT)
    offline = {
        "TIKTOKEN_CACHE_DIR": str(tmp_path / "empty-cache"),  # no cached files
        "HTTPS_PROXY": "http://127.0.0.1:9",  # and no way to download them
        "HTTP_PROXY": "http://127.0.0.1:9",
        "NO_PROXY": "",
        "no_proxy": "",
    }
    res = run_nanolab(
        "prepare", str(src), "--tokenizer", "gpt2", "-o", str(tmp_path / "ds"),
        cwd=tmp_path, env=offline, timeout=120,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    errors = [line for line in res.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, res.stderr
    assert "not available offline" in errors[0] and "TIKTOKEN_CACHE_DIR" in errors[0]
    assert "'bpe'" in errors[0]
    assert not (tmp_path / "ds").exists()


def test_gpt2_without_tiktoken_says_how_to_install_it(monkeypatch):
    """Mutation caught: the ImportError escaping (no install hint)."""
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # `import tiktoken` fails
    with pytest.raises(TokenizerError) as err:
        tokenizer_from_spec({"name": "gpt2"})
    message = str(err.value)
    assert "pip install 'nanolab[tiktoken]'" in message and "'bpe'" in message
    assert "\n" not in message and os.linesep not in message


def test_gpt2_encodes_a_long_text_in_slices_to_the_ids_of_the_whole(local_gpt2, monkeypatch):
    """A long document (a JSON line of tens of MB) is encoded in slices cut before a space
    between two letters, where GPT-2's regex ends a word whatever follows: the ids are those
    of the whole, and memory follows the slice."""
    import random

    from nanolab.data import tokenizers

    monkeypatch.setattr(tokenizers, "SLICE_CHARS", 300)
    tok = tokenizer_from_spec({"name": "gpt2"})
    words = ["soft", "what's", "light", "42", "3.14", "ünï", "日本", "✓", "--", "<|endoftext|>"]
    gaps = [" ", "  ", "\n", "\t", " \n ", "", ", ", "'s "]
    rng = random.Random(0)
    for _ in range(10):
        text = "".join(rng.choice(words) + rng.choice(gaps) for _ in range(1500))
        pieces = list(tok.encode_long(text))
        assert len(pieces) > 1
        assert np.concatenate(pieces).tolist() == tok.encode_batch([text])[0].tolist()
