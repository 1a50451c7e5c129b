"""``nanolab prepare``: formats, streaming in bounded memory, determinism across workers, the
document-level validation split, interrupted runs, and one-line errors for bad input."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zstandard

from nanolab.data import sources
from nanolab.data.prepare import FIT_KEYS, PrepareError, main, prepare_dataset
from nanolab.data.tokenizers import load_tokenizer

SAMPLE = (
    "ROMEO:\nBut soft, what light through yonder window breaks?\nJuliet — ünïcödé ✓ 日本\n" * 20
)
DOCS = [f"Document {i}: {'lorem ipsum dolor ' * (i % 7 + 1)}ünï {i}" for i in range(200)]


def split_docs(out: Path) -> dict[str, list[str]]:
    """Each split's documents, decoded and cut at the end-of-text id."""
    meta = json.loads((out / "meta.json").read_text())
    tok = load_tokenizer(out)
    docs = {}
    for split in ("train", "val"):
        ids = np.fromfile(out / f"{split}.bin", dtype=meta["dtype"]).tolist()
        pieces, cur = [], []
        for i in ids:
            if i == meta["eot_id"]:
                pieces.append(tok.decode(cur))
                cur = []
            else:
                cur.append(i)
        assert not cur, f"{split}.bin does not end with an end-of-text"
        docs[split] = pieces
    return docs


def write_jsonl(path: Path, records: list[dict], opener=open) -> None:
    with opener(path, "wt", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def zst_open(path, mode, encoding=None):
    import io

    import zstandard

    raw = open(path, "wb")  # noqa: SIM115 - closed with the wrapper
    return io.TextIOWrapper(zstandard.ZstdCompressor().stream_writer(raw), encoding=encoding)


@pytest.mark.parametrize("workers", [1, 2])
def test_skip_bad_counts_whitespace_only_documents_of_any_size(tmp_path, monkeypatch, workers):
    """A small whitespace-only text file was a bad document, one of 200 KB (many units) was
    kept as a document, and so was a JSON line whose text is " \\n": each is now skipped and
    counted like the small file, and a file with text after a long blank start keeps it all.
    The lookahead is made small so that the second read of a long blank start runs too."""
    monkeypatch.setattr(sources, "BLANK_LOOKAHEAD_BYTES", 1 << 16)
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.txt").write_text("A is for apple.\n" * 100)
    (d / "blank.txt").write_bytes((b" " * 99 + b"\n") * 1000 + b"\t" * 100_000)  # 200 KB
    (d / "small.txt").write_bytes(b" \n\t\n")
    (d / "unicode.txt").write_text("\u00a0\u2003 \n" * 30_000)  # blank in str.isspace's sense
    (d / "late.txt").write_bytes(b" " * 150_000 + b"late text\n")
    (d / "docs.jsonl").write_text('{"text": "kept"}\n{"text": " \\n"}\n{"text": "\\t"}\n')
    meta = prepare_dataset(
        [str(d)], tmp_path / "ds", "bytes", skip_bad=True, quiet=True, workers=workers
    )
    examples = meta["skipped"]["examples"]
    assert meta["skipped"]["count"] == 5, examples
    for name in ("blank.txt", "small.txt", "unicode.txt"):
        assert f"{d / name}: empty document (the file holds only whitespace)" in " ".join(examples)
    assert sum("field 'text' is only whitespace" in e for e in examples) == 2
    assert sum(meta["documents"].values()) == 3  # a.txt, late.txt, "kept"
    assert meta["train_bytes"] + meta["val_bytes"] == 1600 + 150_010 + 4


@pytest.mark.parametrize("tokenizer", ["bytes", "chars", "bpe"])
def test_documents_round_trip_with_one_end_of_text_each(tmp_path, tokenizer):
    src = tmp_path / "docs.jsonl"
    write_jsonl(src, [{"text": d} for d in DOCS])
    out = tmp_path / "ds"
    meta = prepare_dataset([str(src)], out, tokenizer, bpe_vocab_size=400, quiet=True)
    docs = split_docs(out)
    assert sorted(docs["train"] + docs["val"]) == sorted(DOCS)
    assert meta["documents"] == {"train": len(docs["train"]), "val": len(docs["val"])}
    assert 0 < len(docs["val"]) < len(docs["train"])
    # Bytes per split are the UTF-8 bytes of the documents in it (val_bpb's denominator).
    assert meta["val_bytes"] == sum(len(d.encode()) for d in docs["val"])
    assert meta["train_bytes"] + meta["val_bytes"] == sum(len(d.encode()) for d in DOCS)
    tok = load_tokenizer(out)
    assert meta["eot_id"] == tok.eot_id and meta["vocab_size"] == tok.vocab_size
    assert tok.decode(tok.encode(DOCS[5])) == DOCS[5]


def test_parquet_blocks_hold_about_a_megabyte_of_text_whatever_the_row_size(tmp_path, monkeypatch):
    """A block was 256 rows whatever their size: rows of 1.5 MB made blocks of 384 MB, and
    90 MB of such text peaked at 840 MB (364 MB at 4.3 GB with 2 workers). A batch is now as
    many rows as make ~1 MB by the file's own sizes, and cut into ~1 MB slices where rows are
    longer than their row group's average; a row over the per-document limit is refused."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [f"{i:03d} " * (n // 4) for i, n in enumerate([300_000] * 12 + [3_000] * 600)]
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"text": rows, "id": list(range(len(rows)))}), path, row_group_size=400)
    f = sources.resolve_sources([str(path)]).files[0]
    blocks = list(sources.FileReader(f, 0, "text").blocks())
    assert [v for b in blocks for v in b.payload] == rows
    assert [b.first_unit for b in blocks] == list(
        itertools.accumulate([0] + [len(b.payload) for b in blocks[:-1]])
    )
    assert max(sum(len(v) for v in b.payload) for b in blocks) <= sources.BLOCK_BYTES
    assert len(blocks[0].payload) < 12  # the first row group's long rows: a few to a block
    monkeypatch.setattr(sources, "JSON_LINE_MAX_BYTES", 200_000)
    with pytest.raises(
        sources.SourceError, match=r"rows.parquet row 0 is over 200,000 bytes: a parquet"
    ):
        list(sources.FileReader(f, 0, "text").blocks())


def test_every_format_and_compression_gives_the_same_documents(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [{"meta": {"body": d}, "id": i} for i, d in enumerate(DOCS[:60])]
    inputs = tmp_path / "in"
    inputs.mkdir()
    write_jsonl(inputs / "a.jsonl", records[:20])
    write_jsonl(inputs / "b.json.gz", records[20:30], opener=gzip.open)
    write_jsonl(inputs / "c.jsonl.zst", records[30:40], opener=zst_open)
    pq.write_table(pa.Table.from_pylist(records[40:60]), inputs / "d.parquet", row_group_size=7)
    out = tmp_path / "ds"
    prepare_dataset([str(inputs)], out, "chars", text_field="meta.body", quiet=True)
    docs = split_docs(out)
    assert sorted(docs["train"] + docs["val"]) == sorted(DOCS[:60])

    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text(SAMPLE)
    (texts / "b.md.gz").write_bytes(gzip.compress(SAMPLE.upper().encode()))
    with zst_open(texts / "c.txt.zst", "wt", encoding="utf-8") as f:
        f.write(SAMPLE.lower())
    prepare_dataset([str(texts / "*.*")], tmp_path / "t", "chars", quiet=True)
    got = split_docs(tmp_path / "t")
    # A small text file is one unit: one document per file, in train or in validation.
    assert sorted(got["train"] + got["val"]) == sorted([SAMPLE, SAMPLE.upper(), SAMPLE.lower()])


def test_long_text_files_split_by_unit_across_every_source(tmp_path):
    """Validation draws ~16 KB pieces from every file, not the tail of the last one."""
    a, b = tmp_path / "bible.txt", tmp_path / "plays.txt"
    a.write_text("".join(f"Verse {i}: in the beginning was the word.\n" for i in range(8000)))
    b.write_text("".join(f"HAMLET {i}:\nTo be, or not to be.\n" for i in range(12000)))
    out = tmp_path / "ds"
    meta = prepare_dataset([str(a), str(b)], out, "chars", val_fraction=0.2, quiet=True)
    tok = load_tokenizer(out)
    val = tok.decode(np.fromfile(out / "val.bin", dtype=meta["dtype"]).tolist())
    assert "Verse" in val and "HAMLET" in val
    total = a.stat().st_size + b.stat().st_size
    assert meta["train_bytes"] + meta["val_bytes"] == total
    assert 0.1 < meta["val_bytes"] / total < 0.3


def test_the_bytes_are_the_same_for_any_number_of_workers(tmp_path):
    inputs = tmp_path / "in"
    inputs.mkdir()
    for i in range(4):
        write_jsonl(inputs / f"part{i}.jsonl", [{"text": d} for d in DOCS[i::4]] * 30)
    (inputs / "long.txt").write_text(SAMPLE * 200)
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"ds{workers}"
        prepare_dataset([str(inputs)], out, "bpe", bpe_vocab_size=300, workers=workers, quiet=True)
        outs.append(out)
    for name in ("train.bin", "val.bin", "tokenizer.json"):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name


def test_a_corpus_larger_than_the_memory_cap_prepares_in_bounded_memory(tmp_path):
    """Under an address-space cap of ~1.5x the interpreter's own, a corpus of 3x that cap
    (as text, decompressed on the fly from a small .gz) still prepares: nothing scales with it."""
    line = "".join(f"line {i} of a long corpus, with some words in it.\n" for i in range(2000))
    src = tmp_path / "big.txt.gz"
    with gzip.open(src, "wt", compresslevel=1) as f:
        for _ in range(3000):  # ~290 MB of text
            f.write(line)
    probe = (
        "import resource, sys\n"
        "soft = int(sys.argv[1])\n"
        "resource.setrlimit(resource.RLIMIT_AS, (soft, soft))\n"
        "from nanolab.data.prepare import main\n"
        "sys.exit(main(sys.argv[2:]))\n"
    )
    base = subprocess.run(
        [
            sys.executable,
            "-c",
            "import resource, nanolab.data.prepare, pyarrow, zstandard;"
            "print(open('/proc/self/status').read().split('VmSize:')[1].split()[0])",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    cap = int(base.stdout) * 1024 + (200 << 20)
    text_bytes = 3000 * len(line)
    assert text_bytes > cap - int(base.stdout) * 1024
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = tmp_path / "ds"
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            probe,
            str(cap),
            str(src),
            "-o",
            str(out),
            "--tokenizer",
            "bytes",
            "--workers",
            "1",
            "-q",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["train_bytes"] + meta["val_bytes"] == text_bytes
    assert meta["train_tokens"] + meta["val_tokens"] == text_bytes + 1  # one end-of-text


@pytest.mark.slow  # 30-100 s on 2 cores; `pytest -m slow`
def test_sigkill_leaves_no_dataset_and_a_rerun_gives_the_same_bytes(tmp_path):
    src = tmp_path / "text.txt"
    src.write_text(SAMPLE * 3000)  # ~0.5 MB, chars: a second or so
    reference = tmp_path / "ref"
    prepare_dataset([str(src)], reference, "bpe", bpe_vocab_size=300, quiet=True)
    out = tmp_path / "ds"
    cmd = [
        sys.executable,
        "-m",
        "nanolab",
        "prepare",
        str(src),
        "-o",
        str(out),
        "--tokenizer",
        "bpe",
        "--bpe-vocab-size",
        "300",
        "-q",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".ds.tmp-*")) and time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "meta.json").exists()  # nothing `fit` would take for a dataset
    assert (
        main([str(src), "-o", str(out), "--tokenizer", "bpe", "--bpe-vocab-size", "300", "-q"]) == 0
    )
    for name in ("train.bin", "val.bin", "tokenizer.json"):
        assert (out / name).read_bytes() == (reference / name).read_bytes()
    assert not list(tmp_path.glob(".ds.tmp-*"))  # the killed run's leftovers are gone


def test_prepare_is_a_no_op_for_the_same_sources_and_refuses_other_ones(tmp_path):
    a = tmp_path / "a.txt"
    a.write_text(SAMPLE)
    out = tmp_path / "ds"
    prepare_dataset([str(a)], out, "chars", quiet=True)
    before = (out / "train.bin").stat().st_mtime_ns
    prepare_dataset([str(a)], out, "chars", quiet=True)
    assert (out / "train.bin").stat().st_mtime_ns == before
    b = tmp_path / "b.txt"
    b.write_text("other text " * 100)
    with pytest.raises(PrepareError, match="--force"):
        prepare_dataset([str(b)], out, "chars", quiet=True)
    assert (out / "train.bin").stat().st_mtime_ns == before  # nothing overwritten
    meta = prepare_dataset([str(b)], out, "chars", force=True, quiet=True)
    assert meta["sources"] == [str(b)]


def test_force_replaces_a_dataset_but_never_a_folder_of_other_files(tmp_path, capsys):
    """`--force` on a folder holding the user's own files (beside or instead of a dataset) is
    one line naming them, exit 2, every file as it was."""
    src = tmp_path / "a.txt"
    src.write_text(SAMPLE)
    user = tmp_path / "userdir"
    (user / "sub").mkdir(parents=True)
    (user / "notes.txt").write_text("mine")
    (user / "sub" / "more.txt").write_text("mine too")
    assert main([str(src), "-o", str(user), "-q", "--force"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds files that are not a dataset's (notes.txt, sub/)" in err[0]
    assert (user / "notes.txt").read_text() == "mine" and (user / "sub" / "more.txt").exists()
    prepare_dataset([str(src)], tmp_path / "ds", "chars", quiet=True)
    (tmp_path / "ds" / "README").write_text("a note beside a dataset")
    assert (
        main([str(src), "-o", str(tmp_path / "ds"), "-q", "--force", "--tokenizer", "bytes"]) == 2
    )
    assert "(README)" in capsys.readouterr().err
    (tmp_path / "ds" / "README").unlink()
    (tmp_path / "ds" / "packing" / "train-0-row9-eot0").mkdir(parents=True)  # fit's, the data's
    assert (
        main([str(src), "-o", str(tmp_path / "ds"), "-q", "--force", "--tokenizer", "bytes"]) == 0
    )
    assert not (tmp_path / "ds" / "packing").exists()  # replaced with the rest of the dataset


def test_the_bundled_corpus_and_folders(tmp_path):
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "docs" / "one.txt").write_text("first")
    (tmp_path / "docs" / "sub" / "two.md").write_text("second")
    (tmp_path / "docs" / "skip.bin").write_bytes(b"\x00\x01")
    (tmp_path / "docs" / "sub" / "loop").symlink_to(tmp_path / "docs")
    resolved = sources.resolve_sources([str(tmp_path / "docs")])
    assert [Path(f.path).name for f in resolved.files] == ["one.txt", "two.md"]
    notes = " ".join(resolved.skipped)
    assert "symlink loop" in notes and "1 files of other types skipped (1 .bin)" in notes
    bundled = sources.resolve_sources(["bundled:shakespeare"]).files[0]
    assert bundled.kind == "text" and bundled.compression == "gz"


def _gpt2_style_tokenizer():
    """A user's tiny byte-level BPE ``tokenizer.json`` (GPT-2's scheme), ``</s>`` its end of text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([SAMPLE], trainer=trainer)
    return tok


def test_a_tokenizer_json_that_truncates_or_pads_still_gives_every_document_whole(tmp_path):
    """A tokenizer.json saved for a model's inputs (truncation to 8 tokens, padding) cut every
    document to 8 tokens, or filled a batch's documents with pad ids, and the dataset kept it
    silently: both are off for a dataset, and off in the copy saved with it."""
    tok = _gpt2_style_tokenizer()
    tok.enable_truncation(max_length=8)
    tok.enable_padding(pad_id=0, pad_token="<s>")
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    assert json.loads(path.read_text())["truncation"] and json.loads(path.read_text())["padding"]
    src = tmp_path / "docs.jsonl"
    write_jsonl(src, [{"text": d} for d in DOCS[:50]])
    prepare_dataset([str(src)], tmp_path / "ds", str(path), quiet=True)
    docs = split_docs(tmp_path / "ds")
    assert sorted(docs["train"] + docs["val"]) == sorted(DOCS[:50])
    saved = json.loads((tmp_path / "ds" / "tokenizer.json").read_text())
    assert saved["truncation"] is None and saved["padding"] is None


def test_a_users_tokenizer_json_and_its_end_of_text(tmp_path):
    tok = _gpt2_style_tokenizer()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    src = tmp_path / "docs.jsonl"
    write_jsonl(src, [{"text": d} for d in DOCS[:50]])
    meta = prepare_dataset([str(src)], tmp_path / "ds", str(path), quiet=True)
    assert meta["tokenizer"]["name"] == "hf" and meta["eot_id"] == tok.token_to_id("</s>")
    docs = split_docs(tmp_path / "ds")
    assert sorted(docs["train"] + docs["val"]) == sorted(DOCS[:50])
    assert (
        main(
            [str(src), "-o", str(tmp_path / "x"), "--tokenizer", str(path), "--eot-token", "<nope>"]
        )
        == 2
    )


def test_bpe_learns_from_a_bounded_sample(tmp_path):
    src = tmp_path / "docs.jsonl"
    write_jsonl(src, [{"text": d} for d in DOCS] * 20)
    small = prepare_dataset(
        [str(src)], tmp_path / "a", "bpe", bpe_vocab_size=300, bpe_sample_bytes=4096, quiet=True
    )
    full = prepare_dataset([str(src)], tmp_path / "b", "bpe", bpe_vocab_size=300, quiet=True)
    # Same documents, a tokenizer learnt from less text: a different (worse) token count.
    assert small["train_bytes"] + small["val_bytes"] == full["train_bytes"] + full["val_bytes"]
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() != (
        tmp_path / "b" / "tokenizer.json"
    ).read_bytes()


#: 140 kB of words that do not repeat (15 kB compressed): half of it still decodes to text.
WORDS = " ".join(
    "".join(random.Random(i).choice("abcdefghij") for _ in range(6)) for i in range(20_000)
)


def half(data: bytes) -> bytes:
    return data[: len(data) // 2]


BAD_INPUTS = [
    (
        "bad-json",
        "docs.jsonl",
        b'{"text": "fine"}\n{"text": oops}\n',
        "docs.jsonl line 2: not valid JSON",
    ),
    ("missing-field", "docs.jsonl", b'{"text": "a"}\n{"body": "b"}\n', "line 2: no field 'text'"),
    ("not-a-string", "docs.jsonl", b'{"text": 3}\n', "line 1: field 'text' is a int"),
    ("empty-doc", "docs.jsonl", b'{"text": "a"}\n{"text": ""}\n', "line 2: empty document"),
    ("not-utf8", "in.txt", b"caf\xe9 latin-1\n", "not UTF-8"),
    ("empty-file", "in.txt", b"", "empty document (the file is empty)"),
    ("blank-file", "in.txt", b" \n\t\n", "empty document (the file holds only whitespace)"),
    # Many units (past a long line's 64 KB): each unit was blank, the file was kept.
    ("blank-200kb", "in.txt", b" " * 200_000, "empty document (the file holds only whitespace)"),
    (
        "blank-field",
        "docs.jsonl",
        b'{"text": "a"}\n{"text": " \\n"}\n',
        "line 2: empty document (field 'text' is only whitespace)",
    ),
    (
        "truncated-gz",
        "in.txt.gz",
        gzip.compress(SAMPLE.encode() * 50)[:-200],
        "truncated or corrupt",
    ),
    ("garbage-gz", "in.txt.gz", b"\x1f\x8b\x08garbage" * 10, "truncated or corrupt"),
    # Cut inside a zstd frame: zstandard's stream reader calls that end-of-file (it kept half).
    (
        "truncated-zst",
        "in.txt.zst",
        half(zstandard.ZstdCompressor().compress(WORDS.encode())),
        "ends inside a zstd frame",
    ),
    (
        "truncated-zst-jsonl",
        "docs.jsonl.zst",
        half(
            zstandard.ZstdCompressor().compress(
                "".join(json.dumps({"text": w}) + "\n" for w in WORDS.split()).encode()
            )
        ),
        "ends inside a zstd frame",
    ),
    ("corrupt-parquet", "in.parquet", b"PAR1" + b"\x00" * 64 + b"PAR1", "not a readable parquet"),
    ("json-array", "in.json", b'[{"text": "a"}]', "one JSON array, not JSON lines"),
]


@pytest.mark.parametrize(
    ("name", "filename", "content", "message"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS]
)
def test_bad_input_is_one_line_exit_2_and_nothing_left(
    tmp_path, capsys, name, filename, content, message
):
    src = tmp_path / filename
    src.write_bytes(content)
    out = tmp_path / "ds"
    assert main([str(src), "-o", str(out), "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and str(src) in err[0], err
    assert "Traceback" not in err[0]
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ds.tmp")]


def test_skip_bad_counts_bad_documents_in_meta(tmp_path):
    src = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": d}) for d in DOCS[:40]]
    lines[3], lines[7], lines[9] = "{oops", json.dumps({"body": "x"}), json.dumps({"text": ""})
    src.write_text("\n".join(lines) + "\n")
    meta = prepare_dataset([str(src)], tmp_path / "ds", "chars", skip_bad=True, quiet=True)
    assert meta["skipped"]["count"] == 3
    assert "line 4" in meta["skipped"]["examples"][0]
    assert sum(meta["documents"].values()) == 37


def test_a_lone_surrogate_or_a_deeply_nested_line_is_a_bad_document_not_a_traceback(tmp_path):
    """``"\\ud83d"`` (half an emoji, common in web dumps) is valid JSON but not text: encoding
    it raised UnicodeEncodeError through prepare, ``--skip-bad`` or not; a line nested 5,000
    deep raised RecursionError. Both are bad documents: named by line, or skipped and counted."""
    src = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": d}) for d in DOCS[:20]]
    lines[2] = '{"text": "broken emoji \\ud83d here"}'
    lines[5] = '{"text": "x", "meta": ' + "[" * 5000 + "]" * 5000 + "}"
    src.write_text("\n".join(lines) + "\n")
    with pytest.raises(PrepareError, match="line 3: field 'text' holds an unpaired surrogate"):
        prepare_dataset([str(src)], tmp_path / "ds", "bytes", quiet=True)
    meta = prepare_dataset([str(src)], tmp_path / "ds", "bytes", skip_bad=True, quiet=True)
    assert meta["skipped"]["count"] == 2
    assert any("line 6: JSON nested too deeply" in e for e in meta["skipped"]["examples"])


def test_output_that_is_a_file_and_missing_sources(tmp_path, capsys):
    src = tmp_path / "a.txt"
    src.write_text(SAMPLE)
    target = tmp_path / "file"
    target.write_text("mine")
    assert main([str(src), "-o", str(target)]) == 2
    assert main([str(tmp_path / "missing.txt"), "-o", str(tmp_path / "ds")]) == 2
    assert main([str(tmp_path / "*.nothing"), "-o", str(tmp_path / "ds")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3
    assert "is a file" in err[0] and "does not exist" in err[1] and "matches no files" in err[2]
    assert target.read_text() == "mine"


def test_a_missing_data_source_names_the_setting(tmp_path):
    """fit prepares ``data.source`` through the same reader as ``nanolab prepare``; a path that
    is not there was refused as "source 'data/txt' does not exist" without saying which setting
    held it. prepare's own arguments are still called sources."""
    from nanolab.data.datamodule import TokenDataModule

    missing, glob_ = str(tmp_path / "txt"), str(tmp_path / "*.nothing")
    for source, says in (
        (missing, f"data.source: source {missing!r} does not exist; give a file, a folder or"),
        (glob_, f"data.source: the glob {glob_!r} matches no files nanolab reads"),
        ("", "data.source: a source is empty"),
    ):
        data = TokenDataModule(str(tmp_path / "ds"), [source], "chars")
        with pytest.raises(PrepareError, match=f"^{re.escape(says)}"):
            data.meta  # noqa: B018  (fit prepares data.source here)
    assert not (tmp_path / "ds").exists()


@pytest.mark.parametrize("size", ["nan", "inf", "-inf", "1e400", "lots"])
def test_a_bpe_sample_size_that_is_not_a_number_is_one_line(tmp_path, capsys, size):
    """``inf`` and ``1e400`` overflowed int() past the ValueError that ``nan`` raises: a
    traceback instead of the line naming the flag."""
    src = tmp_path / "a.txt"
    src.write_text(SAMPLE)
    argv = [str(src), "-o", str(tmp_path / "ds"), "--tokenizer", "bpe"]
    assert main([*argv, f"--bpe-sample-bytes={size}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"nanolab prepare: error: --bpe-sample-bytes {size!r} is not a size; use e.g. "
                   "256M or 2G"]  # fmt: skip
    assert not (tmp_path / "ds").exists()


def test_an_empty_source_or_output_is_refused_not_taken_as_the_current_folder(
    tmp_path, capsys, monkeypatch
):
    """``prepare ''`` tokenized every file of the current folder, and ``-o ''`` made the
    current folder itself the dataset (replaced by a renamed one: the user's folder gone)."""
    here = tmp_path / "here"
    here.mkdir()
    (here / "notes.txt").write_text(SAMPLE)
    src = tmp_path / "a.txt"
    src.write_text(SAMPLE)
    monkeypatch.chdir(here)
    inode = here.stat().st_ino
    assert main(["", "-o", str(tmp_path / "ds")]) == 2
    assert main([str(src), "-o", ""]) == 2
    assert main([str(src), "-o", "", "--force"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        err[0] == "nanolab prepare: error: a source is empty (''); give a file, a folder or a glob"
    )
    assert err[1:] == ["nanolab prepare: error: -o is empty; give the dataset folder to create "
                       "(e.g. data/mine)"] * 2  # fmt: skip
    assert here.stat().st_ino == inode and [p.name for p in here.iterdir()] == ["notes.txt"]
    assert not (tmp_path / "ds").exists()
    with pytest.raises(PrepareError, match=r"^data\.dataset_dir is empty"):
        prepare_dataset([str(src)], "", setting_names=FIT_KEYS)


def test_a_tiny_corpus_still_gets_both_splits(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text(SAMPLE * 20)  # ~54 KB: three or four units
    meta = prepare_dataset([str(src)], tmp_path / "ds", "chars", quiet=True)
    assert meta["units"]["val"] >= 1 and meta["units"]["train"] >= 1
    # One short file is one unit: its tail is the validation split, bytes counted exactly.
    one = tmp_path / "one.txt"
    one.write_text(SAMPLE)
    meta = prepare_dataset([str(one)], tmp_path / "ds1", "chars", quiet=True)
    tok = load_tokenizer(tmp_path / "ds1")
    train, val = (
        np.fromfile(tmp_path / "ds1" / f"{s}.bin", dtype=meta["dtype"]) for s in ("train", "val")
    )
    assert tok.decode(train.tolist()) + tok.decode(val.tolist()) == SAMPLE
    # The cut is at a tenth of the tokens, moved to the next space (64 characters at most).
    assert 0 <= int((len(SAMPLE) + 1) * 0.1) - meta["val_tokens"] < 64
    assert val[-1] == meta["eot_id"] and SAMPLE[len(train)].isspace()
    assert meta["train_bytes"] + meta["val_bytes"] == len(SAMPLE.encode())
    (tmp_path / "x.txt").write_text("a")
    with pytest.raises(PrepareError, match="too small to split"):
        prepare_dataset([str(tmp_path / "x.txt")], tmp_path / "ds2", "chars", quiet=True)


def test_the_docs_prepare_commands_run(tmp_path, monkeypatch):
    """Each `nanolab prepare` line of docs/data.md, on small stand-ins for its /data paths."""
    import re
    import shlex

    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    docs_md = (Path(__file__).resolve().parents[1] / "docs" / "data.md").read_text()
    block = docs_md.split("## Preparing a corpus", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line for line in block.splitlines() if line.startswith("nanolab prepare")]
    assert len(commands) == 3

    data = tmp_path / "src"  # the docs' /data/...; their outputs go to ./data/...
    shards = data / "fineweb-edu" / "sample" / "10BT"
    shards.mkdir(parents=True)
    for i in range(2):
        rows = [{"text": d, "id": j} for j, d in enumerate(DOCS[i::2])]
        pq.write_table(pa.Table.from_pylist(rows), shards / f"{i:03d}_00000.parquet")
    (data / "dump").mkdir()
    lines = [{"meta": {"body": d}} for d in DOCS[:50]] + [{"meta": {}}]
    write_jsonl(data / "dump" / "a.jsonl.zst", lines, opener=zst_open)
    (data / "books").mkdir()
    (data / "books" / "one.txt").write_text(SAMPLE * 30)
    (data / "books" / "two.txt").write_text(SAMPLE.upper() * 30)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        [SAMPLE, SAMPLE.upper()],
        trainer=trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"]),
    )
    (tmp_path / "models" / "neox").mkdir(parents=True)
    tok.save(str(tmp_path / "models" / "neox" / "tokenizer.json"))

    monkeypatch.chdir(tmp_path)
    for command in commands:
        command = re.sub(r"(?<=[\s'])/data/", f"{tmp_path}/src/", command)
        command = re.sub(r"(?<=[\s'])/models/", f"{tmp_path}/models/", command)
        argv = shlex.split(command.split("#")[0])[2:]
        argv = [a.replace("50257", "400") for a in argv]  # a small BPE keeps the test quick
        assert main([*argv, "-q"]) == 0, command
    fw = json.loads((tmp_path / "data" / "fw" / "meta.json").read_text())
    assert sum(fw["documents"].values()) == len(DOCS) and fw["vocab_size"] == 400
    dump = json.loads((tmp_path / "data" / "dump" / "meta.json").read_text())
    assert dump["skipped"]["count"] == 1 and sum(dump["documents"].values()) == 50
    books = json.loads((tmp_path / "data" / "books" / "meta.json").read_text())
    assert books["tokenizer"]["name"] == "hf" and books["eot_id"] == tok.token_to_id(
        "<|endoftext|>"
    )


def test_a_zst_of_several_frames_is_read_whole(tmp_path, capsys) -> None:
    """Frames concatenated (what `zstd` writes for appended files) are all read, in order."""
    parts = [SAMPLE * 3, SAMPLE.upper() * 2, "the end\n"]
    src = tmp_path / "in.txt.zst"
    src.write_bytes(b"".join(zstandard.ZstdCompressor().compress(p.encode()) for p in parts))
    assert main([str(src), "-o", str(tmp_path / "ds"), "-q", "--tokenizer", "bytes"]) == 0
    meta = json.loads((tmp_path / "ds" / "meta.json").read_text())
    assert meta["train_bytes"] + meta["val_bytes"] == len("".join(parts).encode())


def test_output_inside_an_input_folder_is_not_read_back_and_no_lock_file_stays(tmp_path):
    """``-o`` inside the folder being prepared: a rerun is the same no-op (it does not read its
    own meta.json and .bin files as input), and the lock file beside the output is gone after a
    success and after a failure."""
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.txt").write_text("some text to prepare here\n" * 500)
    first = prepare_dataset([str(folder)], folder / "out", "bytes", quiet=True)
    again = prepare_dataset([str(folder)], folder / "out", "bytes", quiet=True)
    assert again["source_hash"] == first["source_hash"]
    assert sorted(p.name for p in folder.iterdir()) == ["a.txt", "out"]
    with pytest.raises(PrepareError):
        prepare_dataset([str(tmp_path / "missing")], folder / "other", "bytes", quiet=True)
    assert sorted(p.name for p in folder.iterdir()) == ["a.txt", "out"]


def test_bpe_says_when_the_text_holds_fewer_tokens_than_asked(tmp_path):
    """A small corpus cannot give GPT-2's 50257 tokens: prepare says how many it learned
    instead of writing a smaller vocabulary silently (the dataset is still written)."""
    src = tmp_path / "small.txt"
    src.write_text(SAMPLE * 20)
    out = tmp_path / "ds"
    proc = subprocess.run(
        [sys.executable, "-m", "nanolab", "prepare", str(src), "-o", str(out),
         "--tokenizer", "bpe", "--bpe-vocab-size", "50257", "-q"],  # said even when quiet
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    vocab = json.loads((out / "meta.json").read_text())["vocab_size"]
    assert vocab < 50257
    assert f"BPE learned {vocab:,} of the 50,257 tokens asked" in proc.stderr, proc.stderr


@pytest.mark.parametrize("size", ["10000000000", "1048577"])
def test_a_bpe_vocabulary_beyond_what_the_trainer_can_reserve_is_one_line(tmp_path, size):
    """10**10 ids made the trainer reserve 567 GB before reading a word: the process aborted
    with a 60-line Rust backtrace (exit 134). Above the bound it is refused in one line."""
    src = tmp_path / "small.txt"
    src.write_text(SAMPLE * 20)
    proc = subprocess.run(
        [sys.executable, "-m", "nanolab", "prepare", str(src), "-o", str(tmp_path / "ds"),
         "--tokenizer", "bpe", "--bpe-vocab-size", size],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "must be <= 1,048,576" in lines[0], lines
    assert f"got {int(size):,}" in lines[0]
    assert not (tmp_path / "ds").exists()


@pytest.mark.parametrize(
    ("option", "value", "key", "says"),
    [
        ("--bpe-vocab-size", "10", "bpe_vocab_size", "must be >= 258"),
        ("--val-fraction", "1.0", "val_fraction", "must be in (0, 0.5)"),
    ],
)
def test_a_refused_setting_is_named_as_prepare_or_fit_takes_it(
    tmp_path, capsys, option, value, key, says
):
    """prepare's ``--bpe-vocab-size 10`` was refused as ``data.bpe_vocab_size`` and its
    ``--val-fraction 1.0`` as ``val_fraction``: each command now names its own setting."""
    from nanolab.data.datamodule import TokenDataModule

    src = tmp_path / "a.txt"
    src.write_text(SAMPLE)
    argv = [str(src), "-o", str(tmp_path / "ds"), "--tokenizer", "bpe", option, value]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"nanolab prepare: error: {option} {says}") and f"got {value}" in err
    settings = {key: type(getattr(TokenDataModule(), key))(value)}
    data = TokenDataModule(str(tmp_path / "ds"), [str(src)], "bpe", **settings)
    with pytest.raises(PrepareError, match=rf"^data\.{key} {re.escape(says)}.*, got "):
        data.meta  # noqa: B018  (fit prepares data.source here)
    assert not (tmp_path / "ds").exists()


def test_a_dataset_folder_inside_a_run_is_refused_before_anything_is_written(tmp_path):
    # fit's data.dataset_dir prepares through prepare_dataset too, not only `prepare -o`.
    from nanolab.data.prepare import PrepareError, prepare_dataset

    run = tmp_path / "runs" / "qa"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"event": "start", "run_id": "qa"}\n')
    with pytest.raises(PrepareError, match=r"the dataset folder .*tokens is inside the run"):
        prepare_dataset(["bundled:shakespeare"], run / "tokens", "chars", quiet=True)
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]


def test_bpe_training_sees_long_runs_of_letters_as_words_of_bounded_length():
    # The trainer's cost grows with the square of a word's length (500k letters: ~100 s); a
    # run is cut into pieces of MAX_TRAIN_WORD, each its own text, and nothing else changes.
    from nanolab.data.tokenizers import MAX_TRAIN_WORD, chunked, train_tokenizer

    rng = random.Random(0)
    text = "".join(rng.choice("ab c\n") for _ in range(3000))
    text += "x" * (3 * MAX_TRAIN_WORD + 5) + " mid " + "y" * MAX_TRAIN_WORD + "\n" + text
    for size in (97, 1000, 1 << 20):
        pieces = list(chunked([text, "tail"], size=size))
        assert "".join(pieces) == text + "tail"
        assert max(len(word) for piece in pieces for word in piece.split()) <= MAX_TRAIN_WORD
    plain = "the quick brown fox jumps over the lazy dog\n" * 200
    assert list(chunked([plain])) == [plain]  # ordinary text: the same input as before
    tok = train_tokenizer("bpe", "x" * 200_000 + " the end", bpe_vocab_size=300)
    assert tok.decode(list(tok.encode("xxxx the end"))) == "xxxx the end"


def test_a_replacement_killed_between_its_two_renames_gets_the_old_dataset_back(tmp_path):
    # The old dataset sat only in .<name>.old-PID: the next prepare puts it back (here the same
    # sources: a no-op on it), where it used to delete it as a leftover.
    out = tmp_path / "data"
    first = prepare_dataset(["bundled:shakespeare"], out, "chars", quiet=True)
    inode = (out / "train.bin").stat().st_ino
    os.replace(out, tmp_path / ".data.old-99999")
    again = prepare_dataset(["bundled:shakespeare"], out, "chars", quiet=True)
    assert again == first and (out / "train.bin").stat().st_ino == inode  # the same file
    assert not list(tmp_path.glob(".data.old-*"))


def test_a_no_op_prepare_clears_a_killed_prepares_half_written_folder(tmp_path):
    """A prepare killed while writing leaves ``.NAME.tmp-XXXXXXXX``, as large as the dataset. A
    later prepare of the same dataset ("nothing to do"), and every fit that prepares it from
    data.source, returned before the only place that removed it. The lock is held, so no live
    prepare is writing it; the folder another dataset (``ds.tmp-x``) is being written to is not
    this one's, and stays."""
    out = tmp_path / "ds"
    first = prepare_dataset(["bundled:shakespeare"], out, "chars", quiet=True)
    inode = (out / "train.bin").stat().st_ino
    killed = tmp_path / ".ds.tmp-k1ll3d_x"
    killed.mkdir()
    (killed / "train.bin").write_bytes(b"\0" * 4096)
    others = tmp_path / ".ds.tmp-x.tmp-abcd1234"
    others.mkdir()
    assert prepare_dataset(["bundled:shakespeare"], out, "chars", quiet=True) == first
    assert (out / "train.bin").stat().st_ino == inode  # nothing to do: not written again
    assert not killed.exists() and others.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ds.tmp-x.tmp-abcd1234", "ds"]


def test_leftovers_of_another_dataset_are_never_matched_by_a_name_with_glob_characters(tmp_path):
    other = tmp_path / ".ab.tmp-1"
    other.mkdir()
    (other / "keep").write_text("another dataset's half-written output")
    prepare_dataset(["bundled:shakespeare"], tmp_path / "a*", "chars", quiet=True)
    assert (other / "keep").is_file()


def test_prepare_again_says_nothing_to_do_and_a_refusal_names_what_differs(tmp_path, capsys):
    text = tmp_path / "in.txt"
    text.write_text("some words to prepare, and a few more of them\n" * 400)
    out = str(tmp_path / "data")
    assert main([str(text), "-o", out, "--tokenizer", "chars", "-q"]) == 0
    capsys.readouterr()
    assert main([str(text), "-o", out, "--tokenizer", "chars"]) == 0
    assert "already holds this dataset (the same files and settings): nothing to do" in (
        capsys.readouterr().err
    )
    assert main([str(text), "-o", out, "--tokenizer", "bytes", "--val-fraction", "0.2"]) == 2
    err = capsys.readouterr().err
    assert "it differs in --tokenizer chars, asked bytes; --val-fraction 0.1, asked 0.2" in err
    # BPE learns fewer tokens than asked from a small text: the vocabulary asked is compared,
    # not the one learned, so only what really differs is named.
    bpe = str(tmp_path / "bpe")
    assert main([str(text), "-o", bpe, "--tokenizer", "bpe", "--bpe-vocab-size", "600", "-q"]) == 0
    capsys.readouterr()
    again = [str(text), "-o", bpe, "--tokenizer", "bpe", "--bpe-vocab-size", "600"]
    assert main([*again, "--val-fraction", "0.2", "-q"]) == 2
    assert "(it differs in --val-fraction 0.1, asked 0.2)" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["truncate train.bin", "delete val.bin", "delete tokenizer"])
def test_a_damaged_dataset_is_prepared_again_not_called_ready(tmp_path, capsys, damage):
    """fit sends a user whose bins are cut short back to prepare: prepare must not call the
    folder ready on its meta alone (it did, --force or not)."""
    text = tmp_path / "in.txt"
    text.write_text("some words to prepare, and a few more of them\n" * 400)
    out = tmp_path / "data"
    args = [str(text), "-o", str(out), "--tokenizer", "bpe", "--bpe-vocab-size", "300"]
    assert main([*args, "-q"]) == 0
    whole = {p.name: p.read_bytes() for p in out.iterdir()}
    if damage == "truncate train.bin":
        os.truncate(out / "train.bin", 10)
        said = "train.bin holds 10 bytes, not "
    elif damage == "delete val.bin":
        (out / "val.bin").unlink()
        said = "val.bin is missing"
    else:
        (out / "tokenizer.json").unlink()
        said = "tokenizer.json is missing"
    capsys.readouterr()
    assert main(args) == 0
    err = capsys.readouterr().err
    assert f"holds this dataset damaged ({said}" in err and "preparing it again" in err
    assert "nothing to do" not in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == whole


def test_a_damaged_dataset_beside_the_users_files_is_refused_not_rebuilt(tmp_path, capsys):
    """Preparing a damaged dataset again (no --force needed) replaced the whole folder: a
    NOTES.md the user kept beside it was deleted without a word."""
    text = tmp_path / "c1.txt"
    text.write_text("hello world text\n")
    out = tmp_path / "d1"
    assert main([str(text), "-o", str(out), "-q"]) == 0
    (out / "NOTES.md").write_text("notes")
    (out / "val.bin").unlink()
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert main([str(text), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "damaged (val.bin is missing) and files that are not a " in err[0]
    assert "(NOTES.md); preparing it again replaces the whole folder: move those" in err[0]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_refusal_leaves_out_the_bpe_settings_of_a_dataset_that_is_not_bpe(tmp_path, capsys):
    text = tmp_path / "in.txt"
    text.write_text("some words to prepare, and a few more of them\n" * 400)
    out = str(tmp_path / "data")
    assert main([str(text), "-o", out, "-q"]) == 0
    capsys.readouterr()
    assert main([str(text), "-o", out, "--tokenizer", "bpe", "-q"]) == 2
    err = capsys.readouterr().err
    assert "(it differs in --tokenizer chars, asked bpe)" in err, err


@pytest.mark.parametrize("tokenizer", ["chars", "bytes", "bpe"])
def test_sources_with_no_documents_are_refused_and_nothing_is_written(tmp_path, capsys, tokenizer):
    """An empty .jsonl, one of blank lines and an empty parquet made an empty dataset, rc 0:
    fit could then neither train on it nor replace it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n\n  \n")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    inputs = [str(tmp_path / n) for n in ("empty.jsonl", "blank.jsonl", "empty.parquet")]
    out = tmp_path / "data"
    assert main([*inputs, "-o", str(out), "--tokenizer", tokenizer]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "nanolab prepare: error: the sources hold no documents: 3 files, all empty or blank; "
        "give files with text"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["empty.jsonl", "blank.jsonl", "empty.parquet"]
    )


@pytest.mark.parametrize(
    ("out", "said"),
    [
        ("in.txt/ds", "-o in.txt/ds: in.txt is a file, not a folder; choose a folder for"),
        ("in.txt/a/b", "-o in.txt/a/b: in.txt is a file, not a folder;"),
        ("loop", "loop is a symlink loop (a link that leads back to itself); remove it"),
        ("loop/ds", "-o loop/ds: loop is a symlink loop"),
        ("x" * 250, "the name is too long: 250 bytes, at most 241 (prepare writes .NAME.tmp-*"),
    ],
)
def test_an_output_that_can_never_be_a_folder_is_one_line_before_reading(
    tmp_path, monkeypatch, capsys, out, said
):
    """A file as a parent was a FileExistsError traceback, a name with no room for the lock
    beside it an OSError one, and a symlink loop was found only after the whole corpus was
    tokenized, called a full disk."""
    monkeypatch.chdir(tmp_path)
    Path("in.txt").write_text(SAMPLE)
    os.symlink("loop", "loop")
    before = sorted(os.listdir())
    assert main(["in.txt", "-o", out]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0], err
    assert sorted(os.listdir()) == before


def test_a_long_name_prepares_up_to_the_room_a_pid_needs_and_a_dataset_there_is_a_no_op(
    tmp_path, capsys
):
    """Room was kept for a 10-digit PID (Linux's are at most 7): a 239-241 byte name the older
    code prepared was refused, even as a no-op on the dataset it had written there."""
    src = tmp_path / "in.txt"
    src.write_text(SAMPLE)
    assert main([str(src), "-o", str(tmp_path / ("x" * 241)), "-q"]) == 0
    (tmp_path / ("x" * 241)).rename(tmp_path / ("y" * 249))  # room for .NAME.lock only
    capsys.readouterr()
    assert main([str(src), "-o", str(tmp_path / ("y" * 249))]) == 0
    assert "nothing to do" in capsys.readouterr().err
    (tmp_path / ("y" * 249) / "val.bin").unlink()  # preparing it again needs .NAME.tmp-* room
    assert main([str(src), "-o", str(tmp_path / ("y" * 249))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the name is too long: 249 bytes, at most 241" in err[0]


def test_a_folder_of_thousands_of_files_keeps_meta_json_small(tmp_path, monkeypatch, capsys):
    """meta.json listed every input path: 220,000 small files gave 19.6 MB (285 MB to write),
    and past the 16 MB a dataset's meta.json is told by, preparing from that folder was
    refused as "meta.json line 1: not valid JSON ...; fix the line or pass --skip-bad". Past
    META_LIST_MAX files it keeps their count and digest; and a large meta.json written so by
    an earlier version is still told for a dataset's, and its dataset still trains."""
    from nanolab.data.checks import check_files, load_meta
    from nanolab.data.sources import META_LIST_MAX, paths_sha256

    many = tmp_path / "many"
    many.mkdir()
    count = META_LIST_MAX + 500
    for i in range(count):
        (many / f"{i:05d}.txt").write_text(f"document {i} of a folder of many small files\n")
    out = tmp_path / "data"
    assert main([str(many), "-o", str(out), "--tokenizer", "bytes", "-q"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    paths = sorted(str(p.resolve()) for p in many.iterdir())
    assert "source_paths" not in meta and meta["files"] == count
    assert meta["source_paths_sha256"] == paths_sha256(paths)
    assert (out / "meta.json").stat().st_size < 4096
    # As an earlier version wrote it: every path listed, over the size parsed to tell.
    meta["source_paths"] = paths
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    monkeypatch.setattr(sources, "DATASET_META_MAX_BYTES", 4096)
    capsys.readouterr()
    assert main([str(out), "-o", str(tmp_path / "again")]) == 2
    assert "is a prepared nanolab dataset, not a corpus" in capsys.readouterr().err
    (many / "data").symlink_to(out)  # met inside an input folder: skipped, not read as text
    assert main([str(many), "-o", str(tmp_path / "third"), "--tokenizer", "bytes"]) == 0
    assert "a prepared nanolab dataset (its meta.json), skipped" in capsys.readouterr().err
    check_files(out, load_meta(out))  # its dataset still loads


def test_a_validation_share_far_from_val_fraction_is_a_warning(tmp_path, capsys):
    """Whole documents go to one split: 5 JSON lines of ~250 KB put 60% of the tokens in
    validation at --val-fraction 0.1, without a word. One long document among short ones
    puts nearly all or nearly none of them there, whichever split it falls in: one warning
    line with the share and why; a corpus of many like documents, none."""
    lines = tmp_path / "few.jsonl"
    docs = ["a long document " * 12_000] + [f"short document {i}" for i in range(9)]
    write_jsonl(lines, [{"text": d} for d in docs])
    out = tmp_path / "few"
    assert main([str(lines), "-o", str(out), "--tokenizer", "bytes", "-q"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    share = meta["val_tokens"] / (meta["train_tokens"] + meta["val_tokens"])
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warned) == 1, warned
    assert warned[0].startswith(f"nanolab prepare: warning: {out}: validation holds ")
    assert f"holds {share * 100:.3g}% of the tokens" in warned[0]
    assert "not the 10% --val-fraction 0.1 asks" in warned[0]
    assert "goes to one split whole, and these 10 are too few" in warned[0]
    many = tmp_path / "many.jsonl"
    write_jsonl(many, [{"text": f"document {i} " * 20} for i in range(400)])
    assert main([str(many), "-o", str(tmp_path / "many"), "--tokenizer", "bytes", "-q"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_a_write_that_fails_is_worded_by_its_cause(tmp_path):
    import errno

    from nanolab.data.prepare import write_refused

    out = tmp_path / "data"
    loop = write_refused(out, OSError(errno.ENOTDIR, "Not a directory", str(out)))
    assert loop == f"cannot write {out} (Not a directory: {out}); choose another output folder"
    full = write_refused(out, OSError(errno.ENOSPC, "No space left on device"))
    assert "No space left on device; " in full and " free there); " in full
    assert " GB free" not in write_refused(out, OSError(errno.EACCES, "Permission denied"))


def test_a_prepared_dataset_inside_an_input_folder_is_skipped_not_read_as_corpus(tmp_path, capsys):
    """Its meta.json was read as JSON lines: "corp/web/meta.json line 1: not valid JSON ...;
    fix the line or pass --skip-bad", advice that edits another dataset."""
    corp = tmp_path / "corp"
    corp.mkdir()
    (corp / "a.txt").write_text(SAMPLE)
    web = corp / "web"
    args = ["--tokenizer", "bpe", "--bpe-vocab-size", "300", "-q"]
    assert main([str(corp / "a.txt"), "-o", str(web), *args]) == 0
    capsys.readouterr()
    out = tmp_path / "data"
    assert main([str(corp), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"{web}: a prepared nanolab dataset (its meta.json), skipped" in err
    assert json.loads((out / "meta.json").read_text())["files"] == 1
    assert main([str(web), "-o", str(tmp_path / "again")]) == 2
    assert "is a prepared nanolab dataset, not a corpus" in capsys.readouterr().err
    # A recursive glob reaches its meta.json too: skipped with its dataset, not refused as a
    # bad JSON line with advice to edit it.
    (corp / "b.jsonl").write_text(json.dumps({"text": "a document"}) + "\n")
    assert main([str(corp / "**" / "*.json*"), "-o", str(tmp_path / "g")]) == 0
    err = capsys.readouterr().err
    assert f"{web}: a prepared nanolab dataset (its meta.json), skipped" in err
    assert json.loads((tmp_path / "g" / "meta.json").read_text())["files"] == 1
    assert main([str(web / "*"), "-o", str(tmp_path / "g2")]) == 2
    assert f"it matched the files of 1 prepared nanolab dataset(s) ({web})" in (
        capsys.readouterr().err
    )
    # A folder holding only a dataset says so, not that it holds nothing nanolab reads.
    only = tmp_path / "only"
    only.mkdir()
    web.rename(only / "web")
    assert main([str(only), "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"only a prepared nanolab dataset ({only / 'web'}, skipped)" in err[0]
    assert not (tmp_path / "g2").exists() and not (tmp_path / "o").exists()
    from nanolab.data.prepare import FORMAT
    from nanolab.data.sources import DATASET_FORMAT_PREFIX

    assert FORMAT.startswith(DATASET_FORMAT_PREFIX)  # the two modules agree on what one is


@pytest.mark.parametrize("name", ["train.bin", "val.bin", "meta.json"])
def test_a_file_of_a_prepared_dataset_named_as_a_source_is_refused(tmp_path, capsys, name):
    """``prepare ds/train.bin -o ds2`` tokenized the token ids' bytes as text (with --skip-bad,
    or ids that happen to be UTF-8), where naming the folder ``ds`` is refused; ``ds/meta.json``
    was a bad JSON line with advice to edit it. Refused in the folder's words, nothing written.
    A text file kept beside a dataset is still read."""
    ds = tmp_path / "ds"
    prepare_dataset(["bundled:shakespeare"], ds, "chars", quiet=True)
    capsys.readouterr()
    assert main([str(ds / name), "-o", str(tmp_path / "ds2"), "--skip-bad"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"nanolab prepare: error: {ds / name} is a file of the prepared nanolab dataset {ds}, "
        "not a corpus; give the files or folder of text it was prepared from"
    ]
    assert not (tmp_path / "ds2").exists()
    with pytest.raises(sources.SourceError, match=r"^data\.source: .* is a file of the prepared"):
        sources.resolve_sources([str(ds / name)], setting="data.source")  # fit's words
    (ds / "notes.txt").write_text(SAMPLE)
    assert len(sources.resolve_sources([str(ds / "notes.txt")]).files) == 1


def test_a_file_reached_by_two_paths_is_read_once(tmp_path):
    """A link beside its target (or a file inside a folder also given, overlapping globs) was
    read twice: the text doubled, and each copy was split into train and validation on its
    own, so one copy's validation text sat in the other's training text."""
    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "plays.txt").write_text("".join(f"line {i} of a play\n" for i in range(3000)))
    (folder / "plays-link.txt").symlink_to("plays.txt")
    resolved = sources.resolve_sources(
        [str(folder), str(folder / "plays.txt"), str(folder / "*.txt")]
    )
    assert [Path(f.path).name for f in resolved.files] == ["plays-link.txt"]
    assert sum("(read once), skipped" in note for note in resolved.skipped) == 4
    bundled = sources.resolve_sources(["bundled:shakespeare", "bundled:shakespeare"])
    assert len(bundled.files) == 1 and "(read once)" in bundled.skipped[0]
    stats = prepare_dataset([str(folder)], tmp_path / "ds", tokenizer="bytes")
    once = prepare_dataset([str(folder / "plays.txt")], tmp_path / "one", tokenizer="bytes")
    assert stats["train_tokens"] + stats["val_tokens"] == once["train_tokens"] + once["val_tokens"]


def test_a_recursive_glob_reads_each_folder_once_past_a_symlink_loop(tmp_path):
    """``'c/**'`` with ``c/sub/loop -> ..`` followed the loop until the path was too long: each
    file listed ~40 times (300 files: 12,000 warning lines, a 3 MB meta.json, 24 s). Each
    folder is read once, the loop named once, as a folder's walk does."""
    folder = tmp_path / "c"
    (folder / "sub").mkdir(parents=True)
    for i in range(3):
        (folder / f"d{i}.txt").write_text(f"document {i}\n")
    (folder / "sub" / "s.txt").write_text("in a sub folder\n")
    (folder / "sub" / "loop").symlink_to("..")
    for spec in (folder / "**", folder / "**" / "*.txt"):
        resolved = sources.resolve_sources([str(spec)])
        names = sorted(os.path.relpath(f.path, folder) for f in resolved.files)
        assert names == ["d0.txt", "d1.txt", "d2.txt", os.path.join("sub", "s.txt")], spec
        assert resolved.skipped == [
            f"{folder / 'sub' / 'loop'}: a symlink loop (folder already read), skipped"
        ]


def test_a_glob_names_what_it_matched_and_did_not_read_and_leaves_out_the_output(tmp_path):
    """``'c/*'`` dropped the folders and the files of other types it matched without a word,
    and ``'c/**'`` read the dataset it had written into ``c/ds`` on the next run."""
    folder = tmp_path / "c"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "a.txt").write_text("under a folder\n")
    (folder / "top.txt").write_text("top level text\n" * 50)
    (folder / "t.csv").write_text("a,b\n")
    resolved = sources.resolve_sources([str(folder / "*")])
    assert [Path(f.path).name for f in resolved.files] == ["top.txt"]
    assert any("1 file(s) matched of other types (t.csv) skipped" in n for n in resolved.skipped)
    assert any("matched and skipped 1 folder(s)" in n for n in resolved.skipped)
    # A glob that matches folders only: the error says so, and how to read them.
    with pytest.raises(
        sources.SourceError, match=r"it matched 1 folder\(s\) .*name a folder to read"
    ):
        sources.resolve_sources([str(folder / "s*")])
    spec = str(folder / "**")
    first = prepare_dataset([spec], folder / "ds", tokenizer="bytes")
    again = sources.resolve_sources([spec], exclude=[folder / "ds"])
    assert sorted(Path(f.path).name for f in again.files) == ["a.txt", "top.txt"]
    assert first["train_tokens"] > 0
    # a killed run's leftovers beside the output, inside the input folder, are not input
    (folder / ".ds.tmp-123").mkdir()
    (folder / ".ds.tmp-123" / "half.txt").write_text("half written\n")
    again = prepare_dataset([str(folder)], folder / "ds", tokenizer="bytes", force=True)
    assert again["files"] == 2


def test_an_output_that_is_a_link_to_a_folder_fills_that_folder(tmp_path):
    """``-o dsl`` with ``dsl -> /scratch/ds``: the swap replaced the link by a local folder and
    left the data off the disk it was meant for (and a dangling ``.dsl.dead-*`` behind)."""
    src = tmp_path / "a.txt"
    src.write_text(SAMPLE)
    (tmp_path / "scratch" / "ds").mkdir(parents=True)
    link = tmp_path / "dsl"
    link.symlink_to(tmp_path / "scratch" / "ds")
    prepare_dataset([str(src)], link, "bytes", quiet=True)
    prepare_dataset([str(src)], link, "chars", force=True, quiet=True)  # a replacement too
    assert link.is_symlink() and (tmp_path / "scratch" / "ds" / "meta.json").is_file()
    meta = json.loads((tmp_path / "scratch" / "ds" / "meta.json").read_text())
    assert meta["tokenizer"]["name"] == "chars"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "dsl", "scratch"]


def test_a_bpe_sample_of_mostly_new_words_is_cut_to_what_memory_holds(monkeypatch, capsys):
    """The BPE trainer holds ~110 bytes per byte of distinct words: text without spaces or of
    random tokens (every word new) took 1.05 GB for 8 MB, ~28 GB for the default 256 MB
    sample. Its first 4 MB say how much is new; the sample stops where half of the free memory
    is spent, and says so. English repeats its words and keeps the whole sample."""
    import random

    from nanolab import processes
    from nanolab.data import prepare as prep

    monkeypatch.setattr(processes, "host_memory_available", lambda: 8 << 30)
    rng = random.Random(0)
    han = [chr(c) for c in range(0x4E00, 0x4E00 + 3000)]
    new_words = _probe_cap(prep, lambda: "".join(rng.choice(han) for _ in range(20)) + "。")
    words = [
        "the",
        "of",
        "and",
        "to",
        "in",
        "a",
        "is",
        "that",
        "for",
        "it",
        "as",
        "was",
        "with",
        "be",
        "by",
        "on",
        "not",
        "he",
        "this",
        "are",
    ]
    english = _probe_cap(prep, lambda: " ".join(rng.choice(words) for _ in range(40)) + ".\n")
    wanted = 256 << 20
    assert english == wanted
    assert prep.PROBE_BYTES <= new_words < wanted / 10
    said = capsys.readouterr().err
    assert said.count("the BPE sample stops at") == 1 and "--bpe-sample-bytes sets it" in said


def _probe_cap(prep, piece) -> int:
    probe = prep._DistinctWords()
    while not probe.full():
        probe.add("".join(piece() for _ in range(100)))
    return probe.bounded_cap(256 << 20, 1 << 40)  # a corpus far larger than the sample


def test_a_one_file_corpus_cut_for_validation_counts_its_bytes(tmp_path):
    """A corpus of one short document is cut: its tail is the validation split. The cut fell
    inside a two-byte character and counted the decoded U+FFFD (3 bytes), so val_bytes (the
    bits-per-byte denominator) was 17 where the text holds 19."""
    src = tmp_path / "u.txt"
    src.write_text("é" * 100)
    meta = prepare_dataset([str(src)], tmp_path / "ds", "bytes", quiet=True)
    assert meta["train_bytes"] + meta["val_bytes"] == 200
    val = np.fromfile(tmp_path / "ds" / "val.bin", dtype=meta["dtype"])
    text = bytes(int(i) for i in val if i < 256)
    assert len(text) == meta["val_bytes"] and text.decode("utf-8") == "é" * (len(text) // 2)


def test_a_json_line_over_the_cap_is_refused_in_one_line_and_shorter_ones_stream(
    tmp_path, monkeypatch, capsys
):
    """A JSON line is one document, held whole: one over the cap is refused by its number
    (a 100 MB line peaked at 1.6 GB, its chunks re-copied until the newline), and lines under
    it read the same in chunks of any size."""
    monkeypatch.setattr(sources, "JSON_LINE_MAX_BYTES", 1000)
    monkeypatch.setattr(sources, "BLOCK_BYTES", 300)
    monkeypatch.setattr(sources, "_READ_BYTES", 7)
    texts = [f"doc {i} " + "y" * (900 if i == 5 else i * 13) for i in range(40)]
    ok = tmp_path / "ok.jsonl"
    write_jsonl(ok, [{"text": t} for t in texts])
    prepare_dataset([str(ok)], tmp_path / "ok", "chars", quiet=True)
    docs = split_docs(tmp_path / "ok")
    assert sorted(docs["train"] + docs["val"]) == sorted(texts)

    big = tmp_path / "big.jsonl"
    write_jsonl(big, [{"text": "a"}, {"text": "b"}, {"text": "z" * 5000}, {"text": "c"}])
    for flags in ([], ["--skip-bad"]):
        assert main([str(big), "-o", str(tmp_path / "ds"), "-q", *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        assert f"{big} line 3 is over 1,000 bytes: JSON lines hold one document" in err[0]
        assert not (tmp_path / "ds").exists()
    # A line just over the cap that ends inside a read is measured whole, not from the read.
    monkeypatch.setattr(sources, "_READ_BYTES", 600)
    edge = tmp_path / "edge.jsonl"
    write_jsonl(edge, [{"text": "z" * 1090}, {"text": "c"}])
    assert main([str(edge), "-o", str(tmp_path / "ds"), "-q"]) == 2
    assert f"{edge} line 1 is over 1,000 bytes" in capsys.readouterr().err


@pytest.mark.parametrize("workers", [1, 2])
def test_skip_bad_skips_a_text_file_that_is_not_utf8_whole(tmp_path, monkeypatch, workers):
    """A text file is one document: a byte that is not UTF-8 anywhere in it skips all of it,
    counted once, and every document kept ends with its end-of-text. Only the bad ~16 KB
    unit used to go; in a file's last unit that took the end-of-text with it, and the
    document ran into the next file's."""
    monkeypatch.setattr(sources, "TEXT_UNIT_BYTES", 64)
    monkeypatch.setattr(sources, "BLOCK_BYTES", 256)  # many blocks of a few units each
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.txt").write_bytes(b"A is for apple.\n" * 100 + b"\xff\n")  # bad in its last unit
    (d / "b.txt").write_text("Bb bb bb.\n" * 90)
    (d / "c.txt").write_text("Cc cc cc.\n" * 70)
    (d / "m.txt").write_bytes(b"M is for mango.\n" * 60 + b"\xfe" + b"M is for mango.\n" * 60)
    meta = prepare_dataset(
        [str(d)], tmp_path / "ds", "bytes", skip_bad=True, quiet=True, workers=workers
    )
    assert meta["skipped"]["count"] == 2
    assert "a.txt: not UTF-8" in meta["skipped"]["examples"][0]
    assert "m.txt: not UTF-8" in meta["skipped"]["examples"][1]
    assert sum(meta["documents"].values()) == 2
    # Units of a text go to either split: the splits together hold b and c, their two ends.
    out = tmp_path / "ds"
    ids = np.concatenate([np.fromfile(out / f"{s}.bin", np.uint16) for s in ("train", "val")])
    assert int((ids == meta["eot_id"]).sum()) == 2
    text = bytes(ids[ids != meta["eot_id"]].astype(np.uint8)).decode()
    assert "A" not in text and "M" not in text
    assert sorted(text) == sorted("Bb bb bb.\n" * 90 + "Cc cc cc.\n" * 70)
    assert meta["train_bytes"] + meta["val_bytes"] == 90 * 10 + 70 * 10


@pytest.mark.parametrize("tokenizer", ["bytes", "chars", "bpe"])
def test_skip_bad_refuses_when_every_document_is_bad(tmp_path, capsys, tokenizer):
    """An empty dataset was written with exit 0, and only `fit` refused it."""
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.txt").write_text("")
    (d / "b.txt").write_text("")
    (d / "c.jsonl").write_text('{"body": "x"}\n{oops\n')
    out = tmp_path / "ds"
    assert main([str(d), "-o", str(out), "--tokenizer", tokenizer, "--skip-bad", "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "every document was skipped as bad (4); nothing to prepare" in err[0]
    assert f"the first: {d / 'a.txt'}: empty document" in err[0]
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ds.")]


def _word_level(path: Path, vocab: dict[str, int], unk: str | None = "[UNK]") -> Path:
    """A WordLevel tokenizer.json over whitespace-split words, with an end-of-text token."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(path))
    return path


@pytest.mark.parametrize(("top", "dtype"), [(65540, "uint32"), (1000, "uint16")])
def test_a_tokenizer_json_with_gaps_in_its_ids_keeps_every_id(tmp_path, top, dtype):
    """Seven tokens whose largest id is 65540: the vocabulary was the count (7), the bins
    uint16, and 65540 was written as 4 ("the" trained as "mat"); with 1000 fit refused the
    data (ids past a vocabulary of 7). The vocabulary is the largest id + 1."""
    vocab = {"[UNK]": 0, "cat": 1, "sat": 2, "on": 3, "mat": 4, "the": top}
    path = _word_level(tmp_path / "sparse.json", vocab)
    for name in ("a", "b"):
        (tmp_path / "txt").mkdir(exist_ok=True)
        (tmp_path / "txt" / f"{name}.txt").write_text("the cat sat on the mat\n" * 400)
    out = tmp_path / "ds"
    assert main([str(tmp_path / "txt"), "-o", str(out), "--tokenizer", str(path), "-q"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["vocab_size"] == top + 1 and meta["dtype"] == dtype
    ids = np.fromfile(out / "train.bin", dtype=meta["dtype"])
    assert ids[:7].tolist() == [top, 1, 2, 3, top, 4, top]


def test_an_id_the_dtype_cannot_hold_is_refused_not_wrapped(tmp_path):
    """The encoder's last guard: an id past its dtype stops the run (``--skip-bad`` too,
    since no document is at fault) instead of being written modulo 65536."""
    from nanolab.data import encode
    from nanolab.data.sources import Block
    from nanolab.data.tokenizers import TokenizerError, build_tokenizer

    path = _word_level(tmp_path / "sparse.json", {"[UNK]": 0, "cat": 1, "the": 65540})
    tok = build_tokenizer(str(path), lambda: [])
    spec = {**tok.to_meta(), "json": tok.to_json()}
    settings = encode.EncodeSettings("text", 0.1, 0, "uint16")
    encode.init_worker(spec, settings)
    text = b"the cat"
    block = Block("text", 0, "a.txt", 0, text, [len(text)], 0, True)
    with pytest.raises(TokenizerError, match="gave id 65,540, past the uint16"):
        encode.encode_block(block)


def test_characters_a_tokenizer_json_cannot_represent_are_refused_not_dropped(tmp_path, capsys):
    """A BPE with no unknown token and no byte fallback (what a chars model exports) left
    out every character it lacks: 'Genesis 1:1 ... God (Elohim)' trained as 'Genesis : ...
    God Elohim', with no bad document counted and val_bytes counting the lost text."""
    from tokenizers import Tokenizer, decoders, models

    chars = sorted(set("Genesis In the beginning, God Elohim created:\n"))
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<|endoftext|>"])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    good, bad = tmp_path / "good", tmp_path / "bad"
    for folder, text in (
        (good, "In the beginning, God created\n"),
        (bad, "Genesis 1:1 God (Elohim)\n"),
    ):
        folder.mkdir()
        (folder / "a.txt").write_text(text * 200)
    assert main([str(good), "-o", str(tmp_path / "ok"), "--tokenizer", str(path), "-q"]) == 0
    meta = json.loads((tmp_path / "ok" / "meta.json").read_text())
    ids = [np.fromfile(tmp_path / "ok" / f"{s}.bin", dtype=meta["dtype"]) for s in ("train", "val")]
    text = load_tokenizer(tmp_path / "ok").decode(np.concatenate(ids)[:-1].tolist())
    assert text == "In the beginning, God created\n" * 200
    capsys.readouterr()
    out = tmp_path / "ds"
    assert main([str(bad), "-o", str(out), "--tokenizer", str(path), "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "800 characters this tokenizer cannot represent" in err[0], err
    assert "(such as '1', '(', ')')" in err[0] and "unknown token or byte fallback" in err[0]
    assert not out.exists()


def test_a_metaspace_bpe_that_drops_a_character_is_refused_too(tmp_path, capsys):
    """A SentencePiece-style BPE (Metaspace pre-tokenizer) encodes a character it lacks as the
    word-start mark alone: the ids were not empty, so 'emoji \U0001f600 done' trained as
    'emoji  done' with no word. What a character encodes to must decode to something."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = [*sorted(set("emoji done hello world\n")), "\u2581"]
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.add_special_tokens(["</s>"])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    good, bad = tmp_path / "good", tmp_path / "bad"
    for folder, text in ((good, "hello world\n"), (bad, "emoji \U0001f600 done\n")):
        folder.mkdir()
        (folder / "a.txt").write_text(text * 100)
    assert main([str(good), "-o", str(tmp_path / "ok"), "--tokenizer", str(path), "-q"]) == 0
    capsys.readouterr()
    assert main([str(bad), "-o", str(tmp_path / "ds"), "--tokenizer", str(path), "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "100 characters this tokenizer cannot represent" in err[0], err


@pytest.mark.parametrize("fraction", [0.1, 0.3])
def test_one_short_file_with_a_tokenizer_that_drops_spaces_is_cut_at_its_fraction(
    tmp_path, fraction
):
    """A WordLevel tokenizer's decode leaves out the spaces, so decoded sizes never added up
    to the file's bytes and the cut slid to the last token: validation was the end-of-text
    alone (val_tokens 1, val_bytes 1) whatever --val-fraction. The cut is at the fraction and
    each side's bytes are the text's."""
    vocab = {"[UNK]": 0, "cat": 1, "sat": 2, "on": 3, "mat": 4, "the": 5}
    path = _word_level(tmp_path / "wl.json", vocab)
    text = "the cat sat on the mat\n" * 100
    (tmp_path / "a.txt").write_text(text)
    out = tmp_path / "ds"
    args = [str(tmp_path / "a.txt"), "-o", str(out), "--tokenizer", str(path), "-q"]
    assert main([*args, "--val-fraction", str(fraction)]) == 0
    meta = json.loads((out / "meta.json").read_text())
    tokens = 6 * 100 + 1
    assert abs(meta["val_tokens"] - tokens * fraction) <= 3
    assert meta["train_tokens"] + meta["val_tokens"] == tokens
    assert meta["train_bytes"] + meta["val_bytes"] == len(text)
    assert abs(meta["val_bytes"] - len(text) * fraction) <= 10
    ids = np.concatenate(
        [np.fromfile(out / f"{s}.bin", dtype=meta["dtype"]) for s in ("train", "val")]
    )
    assert 0 not in ids.tolist()  # no word cut in two ([UNK])


def test_one_file_of_uneven_words_is_cut_at_its_token_share(tmp_path):
    """The cut took the fraction of the characters for the fraction of the tokens: a 92-letter
    word then nine short ones at --val-fraction 0.3 gave validation 6 of 7 tokens (86%)."""
    vocab = {"[UNK]": 0, **{c: i + 1 for i, c in enumerate("bcdefghij")}}
    path = _word_level(tmp_path / "wl.json", vocab)
    (tmp_path / "a.txt").write_text("a" * 92 + " b c d e f g h i j\n")
    out = tmp_path / "ds"
    args = [str(tmp_path / "a.txt"), "-o", str(out), "--tokenizer", str(path), "-q"]
    assert main([*args, "--val-fraction", "0.3"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["train_tokens"] + meta["val_tokens"] == 11  # [UNK], b..j, end-of-text
    assert meta["val_tokens"] == 3, meta


def test_the_one_unit_cut_encodes_about_the_unit_once(tmp_path):
    """The cut's search encoded the whole prefix at every bisection step: a 5 MB one-document
    JSON line took 53 s to prepare where it had taken 6 s. It now encodes the prefix up to a
    whitespace once and searches a window after it: the characters encoded stay within a small
    multiple of the unit, and the cut is where the prefix holds ``keep`` tokens."""
    from nanolab.data.prepare import _token_position
    from nanolab.data.tokenizers import CharTokenizer

    words = ("a", "bb", "cccc", "dddddddd")
    text = " ".join(words[i % 4] * (1 + i % 3) for i in range(60_000))
    tok = CharTokenizer(sorted(set(text)))
    encoded = []

    class Counting:
        def encode_batch(self, texts):
            encoded.append(sum(len(t) for t in texts))
            return tok.encode_batch(texts)

    for keep in (1, 1000, len(text) // 2, len(text) - 3):
        encoded.clear()
        at = _token_position(text, keep, len(text), Counting())
        assert at == max(1, keep)  # one token per character: the cut is at the keep-th
        assert sum(encoded) <= 1.2 * len(text), (keep, sum(encoded), len(text))


def text_unit_sizes(path: Path) -> list[int]:
    """Every unit's byte length of a text file, as the reader cuts it."""
    file = sources.resolve_sources([str(path)]).files[0]
    return [n for block in sources.FileReader(file, 0, "text").blocks() for n in block.unit_sizes]


@pytest.mark.parametrize(
    "text", ["a" * 3_000_000, "lorem ipsum " * 250_000, "lorem " * 500_000 + "\n"]
)
def test_text_with_no_newlines_is_split_by_small_units_not_three_of_1_mb(
    tmp_path, monkeypatch, text
):
    """A line with no line start was cut every 1 MB: 3 MB of it made 3 units, one of them
    validation, 30% at --val-fraction 0.1. It is cut at a whitespace after the usual unit
    size, mid-word at 64 KB when there is none, wherever the reads end."""
    path = tmp_path / "long.txt"
    path.write_text(text)
    sizes = text_unit_sizes(path)
    assert sum(sizes) == len(text) and max(sizes) <= 64 << 10
    if " " in text:
        assert all(text[sum(sizes[: i + 1])] == " " for i in range(len(sizes) - 1))
    monkeypatch.setattr(sources, "_READ_BYTES", 100_003)
    assert text_unit_sizes(path) == sizes
    meta = prepare_dataset([str(path)], tmp_path / "ds", "bytes", quiet=True)
    assert 0.05 < meta["val_tokens"] / (meta["train_tokens"] + meta["val_tokens"]) < 0.15


def test_text_with_lines_prepares_to_the_same_bytes_as_before_long_lines_were_cut(tmp_path):
    """The long-line cut is only for lines with no line start within 1 MB: the bundled corpus
    prepares to the bytes it always did (sha256 of its bins, chars tokenizer, seed 0)."""
    import hashlib

    out = tmp_path / "ds"
    prepare_dataset(["bundled:shakespeare"], out, "chars", quiet=True)
    digests = {
        n: hashlib.sha256((out / n).read_bytes()).hexdigest()[:16] for n in ("train.bin", "val.bin")
    }
    assert digests == {"train.bin": "c2bb76de863fbb63", "val.bin": "8cd72a1e97cd181e"}


def test_text_whose_lines_all_start_with_a_space_prepares_to_the_same_bytes_as_before(tmp_path):
    """Indented lines (poetry, code, logs) have no line start (a newline before a non-blank)
    and fell into the long-line cut: a 264 KB text went 90/10 to 94/6 and other bytes. The
    sha256 of its bins were made before long lines were cut (chars tokenizer, seed 0)."""
    import hashlib

    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "lazy",
        "dog",
        "and",
        "some",
        "more",
        "words",
        "here",
    ]
    rng = random.Random(0)
    lines = ["    " + " ".join(rng.choice(words) for _ in range(8)) for _ in range(6000)]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    out = tmp_path / "ds"
    meta = prepare_dataset([str(tmp_path / "in.txt")], out, "chars", quiet=True)
    assert (meta["train_tokens"], meta["val_tokens"]) == (237_759, 26_416)
    digests = {
        n: hashlib.sha256((out / n).read_bytes()).hexdigest()[:16] for n in ("train.bin", "val.bin")
    }
    assert digests == {"train.bin": "f3e33cd25c589c0a", "val.bin": "2b90ed2ba48197e3"}
