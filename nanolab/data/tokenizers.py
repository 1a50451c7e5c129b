"""Offline tokenizers: bytes, characters, a locally trained byte-level BPE, and GPT-2 via tiktoken.

Every tokenizer round-trips (``decode(encode(text)) == text``) and describes itself as a small
JSON-able dict stored in the dataset's ``meta.json`` (plus ``tokenizer.json`` for BPE), so
``nanolab generate`` decodes with exactly the tokenizer the data was prepared with.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

TOKENIZER_NAMES = ("bytes", "chars", "bpe", "gpt2")


class TokenizerError(ValueError):
    """A tokenizer that cannot be built or cannot encode the text; the message says the fix."""


class Tokenizer(Protocol):
    name: str

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def to_meta(self) -> dict[str, Any]:
        """What ``meta.json`` stores to rebuild this tokenizer with :func:`load_tokenizer`."""
        ...

    def save_files(self, directory: Path) -> None:
        """Write any files the tokenizer needs besides ``meta.json`` (BPE merges)."""
        ...


class ByteTokenizer:
    """UTF-8 bytes, vocab 256: nothing to train, nothing unknown."""

    name = "bytes"

    @property
    def vocab_size(self) -> int:
        return 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def to_meta(self) -> dict[str, Any]:
        return {"name": self.name}

    def save_files(self, directory: Path) -> None:
        pass


class CharTokenizer:
    """One id per distinct character of the corpus (nanoGPT's shakespeare_char)."""

    name = "chars"

    def __init__(self, chars: list[str]) -> None:
        self.chars = chars
        self._stoi = {c: i for i, c in enumerate(chars)}

    @classmethod
    def train(cls, text: str) -> CharTokenizer:
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        try:
            return [self._stoi[c] for c in text]
        except KeyError as err:
            raise TokenizerError(
                f"character {err.args[0]!r} is not in this character vocabulary; "
                "use tokenizer 'bytes' or 'bpe', or prepare the data with that text included"
            ) from None

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids if 0 <= i < len(self.chars))

    def to_meta(self) -> dict[str, Any]:
        return {"name": self.name, "chars": self.chars}

    def save_files(self, directory: Path) -> None:
        pass


class BPETokenizer:
    """Byte-level BPE trained locally with Hugging Face ``tokenizers`` (GPT-2's scheme)."""

    name = "bpe"
    FILE = "tokenizer.json"

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    @classmethod
    def train(cls, text: str, vocab_size: int) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        if vocab_size < 257:
            raise TokenizerError(
                f"data.bpe_vocab_size must be >= 257 (256 bytes + merges), got {vocab_size}"
            )
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        chunk = 1 << 20
        tok.train_from_iterator(
            (text[i : i + chunk] for i in range(0, len(text), chunk)), trainer=trainer
        )
        return cls(tok)

    @classmethod
    def load(cls, directory: Path) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        path = directory / cls.FILE
        if not path.is_file():
            raise TokenizerError(
                f"{path} is missing; prepare the dataset again with `nanolab prepare`"
            )
        return cls(HFTokenizer.from_file(str(path)))

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size())

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(list(ids)))

    def to_meta(self) -> dict[str, Any]:
        return {"name": self.name, "file": self.FILE}

    def save_files(self, directory: Path) -> None:
        self._tok.save(str(directory / self.FILE))


class TiktokenGPT2:
    """GPT-2's BPE through ``tiktoken``: only when its files are already on this machine."""

    name = "gpt2"

    def __init__(self) -> None:
        try:
            import tiktoken
        except ImportError:
            raise TokenizerError(
                "tokenizer 'gpt2' needs tiktoken: pip install 'nanolab[tiktoken]' "
                "(and its gpt2 files on this machine), or use tokenizer 'bpe' to train one locally"
            ) from None
        try:
            self._enc = tiktoken.get_encoding("gpt2")
        except Exception as err:
            raise TokenizerError(
                "the GPT-2 BPE files are not available offline (tiktoken could not load 'gpt2': "
                f"{type(err).__name__}); copy them into $TIKTOKEN_CACHE_DIR on this machine, "
                "or use tokenizer 'bpe' to train one locally"
            ) from None

    @property
    def vocab_size(self) -> int:
        return int(self._enc.n_vocab)

    def encode(self, text: str) -> list[int]:
        return list(self._enc.encode_ordinary(text))

    def decode(self, ids: list[int]) -> str:
        return str(self._enc.decode(list(ids)))

    def to_meta(self) -> dict[str, Any]:
        return {"name": self.name}

    def save_files(self, directory: Path) -> None:
        pass


def train_tokenizer(name: str, text: str, bpe_vocab_size: int = 4096) -> Tokenizer:
    """Build tokenizer ``name`` for ``text`` (training it where it learns from the corpus)."""
    if name == "bytes":
        return ByteTokenizer()
    if name == "chars":
        return CharTokenizer.train(text)
    if name == "bpe":
        return BPETokenizer.train(text, bpe_vocab_size)
    if name == "gpt2":
        return TiktokenGPT2()
    raise TokenizerError(f"unknown tokenizer {name!r}; choose one of {', '.join(TOKENIZER_NAMES)}")


def load_tokenizer(dataset_dir: str | Path) -> Tokenizer:
    """Rebuild the tokenizer a dataset was prepared with, from its ``meta.json``."""
    directory = Path(dataset_dir)
    meta_path = directory / "meta.json"
    if not meta_path.is_file():
        raise TokenizerError(f"{meta_path} not found; run `nanolab prepare` for this dataset")
    return tokenizer_from_spec(json.loads(meta_path.read_text())["tokenizer"], directory)


def portable_spec(dataset_dir: str | Path) -> dict[str, Any]:
    """The tokenizer spec with any files inlined, for checkpoints that must decode on their own."""
    directory = Path(dataset_dir)
    spec = dict(json.loads((directory / "meta.json").read_text())["tokenizer"])
    if spec["name"] == "bpe":
        spec["json"] = (directory / BPETokenizer.FILE).read_text()
    return spec


def tokenizer_from_spec(spec: dict[str, Any], directory: Path | None = None) -> Tokenizer:
    """Rebuild a tokenizer from a ``meta.json`` or checkpoint spec."""
    name = spec.get("name")
    if name == "bytes":
        return ByteTokenizer()
    if name == "chars":
        return CharTokenizer(list(spec["chars"]))
    if name == "bpe":
        if "json" in spec:
            from tokenizers import Tokenizer as HFTokenizer

            return BPETokenizer(HFTokenizer.from_str(spec["json"]))
        if directory is None:
            raise TokenizerError("a BPE tokenizer spec needs its tokenizer.json")
        return BPETokenizer.load(directory)
    if name == "gpt2":
        return TiktokenGPT2()
    raise TokenizerError(f"unknown tokenizer {name!r} in the dataset or checkpoint")
