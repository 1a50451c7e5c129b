"""``nanolab prepare``: text files or folders -> ``train.bin``, ``val.bin`` and ``meta.json``.

The bins are flat arrays of token ids (uint16 when the vocabulary fits, else uint32) that the
DataModule memory-maps, nanoGPT's format. ``meta.json`` records the tokenizer, vocabulary size,
dtype, token counts and a hash of the sources, so a dataset directory says what it holds and a
second ``prepare`` of the same sources is a no-op.

The directory is built under a temporary name and renamed into place, so a crash or a bad input
never leaves a half-written dataset, and an existing dataset is never overwritten without
``--force``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gzip
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from nanolab.data.tokenizers import TOKENIZER_NAMES, TokenizerError, train_tokenizer

BUNDLED_PREFIX = "bundled:"
BUNDLED = {"shakespeare": "shakespeare.txt.gz"}
TEXT_SUFFIXES = (".txt", ".md", ".text", ".txt.gz")


class PrepareError(ValueError):
    """Input that cannot become a dataset; the message names it and the fix."""


@dataclass(frozen=True)
class Source:
    name: str
    text: str


def _read_text(path: Path) -> str:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise PrepareError(
            f"{path} is not UTF-8 text (bad byte at offset {err.start}); convert it with "
            f"`iconv -f <encoding> -t utf-8` first"
        ) from None


def read_sources(sources: Sequence[str]) -> list[Source]:
    """Read every source: ``bundled:<name>``, a text file, or a folder of text files (sorted)."""
    if not sources:
        raise PrepareError("no sources given; pass text files, folders, or bundled:shakespeare")
    out: list[Source] = []
    for spec in sources:
        if spec.startswith(BUNDLED_PREFIX):
            key = spec[len(BUNDLED_PREFIX) :]
            if key not in BUNDLED:
                raise PrepareError(
                    f"unknown bundled corpus {spec!r}; available: "
                    + ", ".join(BUNDLED_PREFIX + k for k in BUNDLED)
                )
            blob = resources.files("nanolab.data").joinpath("corpus", BUNDLED[key]).read_bytes()
            out.append(Source(spec, gzip.decompress(blob).decode("utf-8")))
            continue
        path = Path(spec).expanduser()
        if path.is_dir():
            files = sorted(
                p for p in path.rglob("*") if p.is_file() and p.name.endswith(TEXT_SUFFIXES)
            )
            if not files:
                raise PrepareError(
                    f"folder {path} holds no text files ({', '.join(TEXT_SUFFIXES)})"
                )
            out.extend(Source(str(p), _read_text(p)) for p in files)
        elif path.is_file():
            out.append(Source(str(path), _read_text(path)))
        else:
            raise PrepareError(f"source {spec!r} does not exist; give a text file or a folder")
    if not any(s.text.strip() for s in out):
        raise PrepareError(f"the sources {list(sources)} hold no text (empty files)")
    return out


def source_hash(
    sources: Sequence[Source], tokenizer: str, bpe_vocab_size: int, val_fraction: float
) -> str:
    """Identity of a dataset: the texts and every setting that changes the token stream."""
    h = hashlib.sha256()
    h.update(
        json.dumps(
            [tokenizer, bpe_vocab_size if tokenizer == "bpe" else None, val_fraction]
        ).encode()
    )
    for s in sources:
        h.update(hashlib.sha256(s.text.encode("utf-8")).digest())
    return h.hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab <= 65536), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def read_meta(dataset_dir: str | Path) -> dict[str, Any] | None:
    path = Path(dataset_dir) / "meta.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def prepare_dataset(
    sources: Sequence[str],
    dataset_dir: str | Path,
    tokenizer: str = "chars",
    bpe_vocab_size: int = 4096,
    val_fraction: float = 0.1,
    force: bool = False,
    quiet: bool = False,
) -> dict[str, Any]:
    """Tokenize ``sources`` into ``dataset_dir``; return its meta. A no-op when already prepared."""
    if tokenizer not in TOKENIZER_NAMES:
        raise PrepareError(
            f"unknown tokenizer {tokenizer!r}; choose one of {', '.join(TOKENIZER_NAMES)}"
        )
    if not 0.0 < val_fraction < 0.5:
        raise PrepareError(f"val_fraction must be in (0, 0.5), got {val_fraction}")
    out_dir = Path(dataset_dir)
    texts = read_sources(sources)
    digest = source_hash(texts, tokenizer, bpe_vocab_size, val_fraction)
    # Every rank of a torchrun/srun launch may get here at once: one prepares, the others wait
    # on the lock and then find the dataset ready (same hash: a no-op).
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(out_dir.with_name(f".{out_dir.name}.lock")):
        return _prepare_locked(
            texts, digest, out_dir, tokenizer, bpe_vocab_size, val_fraction, force, quiet
        )


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _prepare_locked(
    texts: list[Source],
    digest: str,
    out_dir: Path,
    tokenizer: str,
    bpe_vocab_size: int,
    val_fraction: float,
    force: bool,
    quiet: bool,
) -> dict[str, Any]:
    existing = read_meta(out_dir)
    if existing is not None and existing.get("source_hash") == digest:
        return existing
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        what = "a dataset of other sources or settings" if existing else "other files"
        raise PrepareError(
            f"{out_dir} already holds {what}; choose another dataset_dir or pass --force to replace it"
        )

    started = time.perf_counter()
    text = "\n".join(s.text for s in texts)
    tok = train_tokenizer(tokenizer, text, bpe_vocab_size)
    ids = np.asarray(tok.encode(text), dtype=np.int64)
    dtype = token_dtype(tok.vocab_size)
    n_val = max(1, int(len(ids) * val_fraction))
    train_ids, val_ids = ids[:-n_val], ids[-n_val:]
    meta: dict[str, Any] = {
        "format": "nanolab-tokens-v1",
        "tokenizer": tok.to_meta(),
        "vocab_size": tok.vocab_size,
        "dtype": dtype.name,
        "train_tokens": len(train_ids),
        "val_tokens": len(val_ids),
        "sources": [s.name for s in texts],
        "characters": len(text),
        "source_hash": digest,
        "val_fraction": val_fraction,
    }

    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; a dataset is meant to be shared
    try:
        for split, arr in (("train", train_ids), ("val", val_ids)):
            with open(tmp / f"{split}.bin", "wb") as f:
                f.write(arr.astype(dtype).tobytes())
                f.flush()
                os.fsync(f.fileno())
        tok.save_files(tmp)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not quiet:
        secs = time.perf_counter() - started
        print(
            f"prepared {out_dir}: {tok.name} tokenizer, vocab {tok.vocab_size}, "
            f"{meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens ({secs:.1f}s)",
            file=sys.stderr,
        )
    return meta


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="nanolab prepare",
        description="Tokenize text files or folders into train.bin / val.bin / meta.json.",
    )
    parser.add_argument("sources", nargs="+", help="text files, folders, or bundled:shakespeare")
    parser.add_argument("-o", "--out", required=True, help="dataset directory to create")
    parser.add_argument("--tokenizer", default="chars", choices=TOKENIZER_NAMES)
    parser.add_argument("--bpe-vocab-size", type=int, default=4096)
    parser.add_argument("--val-fraction", type=float, default=0.1)
    parser.add_argument("--force", action="store_true", help="replace an existing dataset")
    args = parser.parse_args(argv)
    try:
        meta = prepare_dataset(
            args.sources,
            args.out,
            args.tokenizer,
            args.bpe_vocab_size,
            args.val_fraction,
            args.force,
        )
    except (PrepareError, TokenizerError) as err:
        print(f"nanolab prepare: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps({k: v for k, v in meta.items() if k != "tokenizer"}, indent=2))
    return 0
