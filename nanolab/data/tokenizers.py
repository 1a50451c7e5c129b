"""Offline tokenizers: bytes, characters, a locally trained byte-level BPE, any Hugging Face
``tokenizer.json``, and GPT-2 via tiktoken.

Every tokenizer round-trips (``decode(encode(text)) == text``), has an end-of-text id that
``nanolab prepare`` appends after each document (so documents do not run into each other), and
describes itself as a small JSON-able dict stored in the dataset's ``meta.json`` (plus
``tokenizer.json`` for the Hugging Face based ones), so ``nanolab generate`` decodes with exactly
the tokenizer the data was prepared with.

``encode_batch`` is the hot path of ``prepare``: it returns one int32 array per text and is
vectorised where the tokenizer allows (bytes and chars go through NumPy, not a Python loop).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from nanolab.errors import NanolabError
from nanolab.home import expand_user

TOKENIZER_NAMES = ("bytes", "chars", "bpe", "gpt2")

#: A text longer than this many characters is encoded in slices about this long where the
#: tokenizer's ids cannot depend on the cut (:meth:`Tokenizer.encode_long`).
SLICE_CHARS = 1 << 18

#: Where GPT-2's pre-tokenizer ends one word and starts the next whatever comes before or after:
#: a space between two ASCII letters. Its pattern (``'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+|
#: ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+``) takes a letter only into a match of letters that stops
#: at the space, looks ahead only past a run of whitespace, and never behind, so the text on each
#: side splits into the same pieces alone as together, and BPE encodes each piece on its own.
_WORD_GAP = re.compile(r"(?<=[A-Za-z]) (?=[A-Za-z])")


def char_slices(text: str, size: int | None = None) -> Iterator[str]:
    """``text`` in slices of ``size`` (:data:`SLICE_CHARS`) characters (for ids of one
    character or byte each)."""
    size = size or SLICE_CHARS
    for start in range(0, len(text), size):
        yield text[start : start + size]
    if not text:
        yield text


def word_slices(text: str, size: int | None = None) -> Iterator[str]:
    """``text`` in slices of at least ``size`` (:data:`SLICE_CHARS`) characters, each cut
    before a space between two ASCII letters (:data:`_WORD_GAP`): GPT-2-style pre-tokenization
    gives each slice the ids it has inside the whole text. A text with no such space after
    ``size`` stays one slice."""
    size = size or SLICE_CHARS
    start = 0
    while len(text) - start > size:
        gap = _WORD_GAP.search(text, start + size)
        if gap is None:
            break
        yield text[start : gap.start()]
        start = gap.start()
    yield text[start:]


#: Vocabulary of the tokenizers that do not learn from the corpus (end-of-text included).
KNOWN_VOCAB = {"bytes": 257, "gpt2": 50257}

#: The vocabulary a locally trained BPE may ask for: 256 bytes, a merge and end-of-text at
#: least; at most 2**20, four times the largest vocabularies in use (262,144). The uint32 ids of
#: the bins would hold 2**32, but the trainer reserves ~57 bytes per id asked before it reads a
#: word: 60 MB at this bound, 240 GB at that one, where 10**10 aborted the process on an
#: allocation it could not make (a Rust backtrace, not a line naming the setting).
BPE_VOCAB_RANGE = (258, 1 << 20)

#: The end-of-text token nanolab's own BPE adds, and the names looked for in a user's file.
EOT_TEXT = "<|endoftext|>"
EOT_CANDIDATES = (EOT_TEXT, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "<|im_end|>")


class TokenizerError(NanolabError):
    """A tokenizer that cannot be built or cannot encode the text; the message says the fix."""


class TokenizerSpecError(TokenizerError):
    """A stored tokenizer spec (a checkpoint's, an export's) whose fields cannot be what nanolab
    wrote: a field missing or of another type, a ``tokenizer.json`` that is not JSON. An edited
    or damaged file; the message names the field."""


class Tokenizer:
    """The base of every tokenizer here: ``encode`` is ``encode_batch`` of one text, and no
    files besides ``meta.json`` unless :meth:`save_files` says otherwise."""

    name: str

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def eot_id(self) -> int | None:
        """The id appended after each document (``None`` only for datasets from before it)."""
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0].tolist()  # type: ignore[no-any-return]

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """One int32 id array per text; no end-of-text is added here."""
        raise NotImplementedError

    def encode_long(self, text: str) -> Iterator[np.ndarray]:
        """The ids of one long text in pieces of about :data:`SLICE_CHARS` characters each,
        which end to end are exactly ``encode_batch([text])[0]``: an encoding's memory is a
        multiple of its text (utf-32 code points, a Hugging Face encoding's ~200 bytes per
        token), so a 60 MB JSON line encoded whole peaked at gigabytes. This base encodes the
        text whole: the right answer for a tokenizer whose ids can change where a text is cut
        (a normalizer, a prefix space added to every text, merges across words)."""
        yield from self.encode_batch([text])

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def to_meta(self) -> dict[str, Any]:
        """What ``meta.json`` stores to rebuild this tokenizer with :func:`load_tokenizer`."""
        raise NotImplementedError

    def save_files(self, directory: Path) -> None:
        """Write any files the tokenizer needs besides ``meta.json`` (BPE merges)."""


def is_tokenizer_file(name: str) -> bool:
    """Whether ``--tokenizer`` names a Hugging Face ``tokenizer.json`` rather than a built-in."""
    return name not in TOKENIZER_NAMES and name.endswith(".json")


def check_tokenizer_name(name: str) -> None:
    if name in TOKENIZER_NAMES:
        return
    if is_tokenizer_file(name):
        if not expand_user(name).is_file():
            raise TokenizerError(
                f"tokenizer file {name} does not exist; give the path of a Hugging Face "
                "tokenizer.json"
            )
        return
    raise TokenizerError(
        f"unknown tokenizer {name!r}; choose one of {', '.join(TOKENIZER_NAMES)} "
        "or give the path of a Hugging Face tokenizer.json"
    )


def check_bpe_vocab_size(size: int, name: str) -> None:
    """Refuse a BPE vocabulary outside :data:`BPE_VOCAB_RANGE` before the trainer sees it;
    ``name`` is the setting as the caller's user typed it (a flag, a config key)."""
    low, high = BPE_VOCAB_RANGE
    if size < low:
        raise TokenizerError(
            f"{name} must be >= {low} (256 bytes, merges, end-of-text), got {size}"
        )
    if size > high:
        raise TokenizerError(
            f"{name} must be <= {high:,} (the trainer reserves memory for every id asked), got "
            f"{size:,}; GPT-2 uses 50,257, the largest tokenizers ~262,144"
        )


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes plus one end-of-text id (256): nothing to train, nothing unknown."""

    name = "bytes"

    def __init__(self, eot: bool = True) -> None:
        self._eot = eot

    @property
    def vocab_size(self) -> int:
        return 257 if self._eot else 256

    @property
    def eot_id(self) -> int | None:
        return 256 if self._eot else None

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int32) for t in texts]

    def encode_long(self, text: str) -> Iterator[np.ndarray]:
        for piece in char_slices(text):  # whole characters: their UTF-8 bytes are the ids
            yield from self.encode_batch([piece])

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def to_meta(self) -> dict[str, Any]:
        return {"name": self.name, "eot": self._eot}


class CharTokenizer(Tokenizer):
    """One id per distinct character of the corpus (nanoGPT's shakespeare_char), then end-of-text.

    Encoding maps code points through a lookup table in NumPy, about 50x faster than a dict
    lookup per character, which matters on a corpus of gigabytes.
    """

    name = "chars"

    def __init__(self, chars: list[str], eot: bool = True) -> None:
        self.chars = chars
        self._eot = eot
        codes = np.array([ord(c) for c in chars], dtype=np.int64)
        # One slot past the largest code point stays -1: every unknown character lands on a -1.
        self._lut = np.full(int(codes.max(initial=0)) + 2, -1, dtype=np.int32)
        self._lut[codes] = np.arange(len(chars), dtype=np.int32)

    @classmethod
    def from_texts(cls, texts: Iterable[str]) -> CharTokenizer:
        """The alphabet of a stream of texts, in one pass that holds only the alphabet."""
        alphabet: set[str] = set()
        for text in texts:
            alphabet.update(text)
        return cls(sorted(alphabet))

    @property
    def vocab_size(self) -> int:
        return len(self.chars) + (1 if self._eot else 0)

    @property
    def eot_id(self) -> int | None:
        return len(self.chars) if self._eot else None

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        out = []
        top = len(self._lut) - 1
        for text in texts:
            codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
            ids = self._lut[np.minimum(codes, top)]
            if ids.size and ids.min() < 0:
                bad = chr(int(codes[int(np.argmax(ids < 0))]))
                raise TokenizerError(
                    f"character {bad!r} is not in this character vocabulary; "
                    "use tokenizer 'bytes' or 'bpe', or prepare the data with that text included"
                )
            out.append(ids)
        return out

    def encode_long(self, text: str) -> Iterator[np.ndarray]:
        for piece in char_slices(text):  # one id per character
            yield from self.encode_batch([piece])

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids if 0 <= i < len(self.chars))

    def to_meta(self) -> dict[str, Any]:
        return {"name": self.name, "chars": self.chars, "eot": self._eot}


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` model: nanolab's own byte-level BPE (``bpe``) or a user's
    ``tokenizer.json`` (``hf``: a Llama, Mistral or GPT-NeoX tokenizer, say).

    Documents are encoded without the file's post-processor template (no BOS per chunk) and
    without its truncation or padding settings (whole documents, no pad ids); the end-of-text id is a special token of the file, found by name or given with ``--eot-token``.
    Like the ``transformers`` tokenizers, a special token's literal text inside a document
    is read as that token.
    """

    FILE = "tokenizer.json"

    def __init__(self, tokenizer: Any, name: str, eot_id: int | None) -> None:
        # A tokenizer.json saved for a model's inputs may truncate (every document cut to its
        # max_length) or pad (every document of a batch filled with pad ids to the longest):
        # a dataset needs each document's ids, whole and alone. Both are turned off, so the
        # copy saved with the dataset has neither.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self._tok = tokenizer
        self.name = name
        self._eot_id = eot_id
        self._vocab_size: int | None = None
        self._drops = _can_drop(tokenizer)
        self._kept: dict[int, bool] = {}  # code point -> whether it gets an id
        self._word_slices = _pre_tokenizes_like_gpt2(tokenizer)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> HFTokenizer:
        """Byte-level BPE (GPT-2's scheme) with ``vocab_size`` ids, end-of-text included, trained
        in this process (``nanolab prepare`` trains in a child: :mod:`nanolab.data.bpe_process`)."""
        return cls.from_learned(learn_bpe(chunked(texts), vocab_size), vocab_size)

    @classmethod
    def from_learned(cls, tok: Any, vocab_size: int) -> HFTokenizer:
        """The tokenizer :func:`learn_bpe` returned, its end-of-text token added."""
        tok.add_special_tokens([EOT_TEXT])
        learned = tok.get_vocab_size()
        if learned < vocab_size:  # the text ran out of pairs to merge: say so, not silently
            from nanolab.messages import warn

            warn(
                "nanolab",  # prepare, or fit preparing a data.source
                f"BPE learned {learned:,} of the {vocab_size:,} tokens asked: the text holds no "
                "more pairs to merge; the vocabulary is that size (a larger fixed "
                "model.gpt.vocab_size still trains, with unused rows)",
            )
        return cls(tok, "bpe", tok.token_to_id(EOT_TEXT))

    @classmethod
    def from_file(cls, path: str | Path, eot_token: str | None = None) -> HFTokenizer:
        """A user's ``tokenizer.json``; its end-of-text token is ``eot_token`` or found by name."""
        from tokenizers import Tokenizer as RustTokenizer

        try:
            tok = RustTokenizer.from_file(str(expand_user(path)))
        except Exception as err:
            raise TokenizerError(
                f"{path} is not a Hugging Face tokenizer.json ({str(err).splitlines()[0]}); "
                "give the tokenizer.json of a tokenizers/transformers model"
            ) from None
        names = (eot_token,) if eot_token else EOT_CANDIDATES
        for token in names:
            eot = tok.token_to_id(token)
            if eot is not None:
                return cls(tok, "hf", int(eot))
        if eot_token:
            raise TokenizerError(f"--eot-token {eot_token!r} is not a token of {path}")
        raise TokenizerError(
            f"{path} has none of the usual end-of-text tokens ({', '.join(EOT_CANDIDATES)}); "
            "name it with --eot-token"
        )

    @classmethod
    def load(cls, directory: Path, spec: dict[str, Any]) -> HFTokenizer:
        from tokenizers import Tokenizer as RustTokenizer

        path = directory / cls.FILE
        if not path.is_file():
            raise TokenizerError(
                f"{path} is missing; prepare the dataset again with `nanolab prepare`"
            )
        return cls(RustTokenizer.from_file(str(path)), spec["name"], spec.get("eot_id"))

    @classmethod
    def from_json(cls, text: str, spec: dict[str, Any]) -> HFTokenizer:
        return cls(_rust_from_json(text), spec["name"], spec.get("eot_id"))

    @property
    def vocab_size(self) -> int:
        """The largest id plus one, not the number of tokens: a file's ids may leave gaps (a
        WordLevel vocabulary of 7 tokens whose last id is 65540), and the model's embedding
        and the bins' dtype must hold every id it can give."""
        if self._vocab_size is None:
            self._vocab_size = _id_span(self._tok)
        return self._vocab_size

    @property
    def eot_id(self) -> int | None:
        return self._eot_id

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encodings = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
        if self._drops:
            self._refuse_dropped(texts)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    def encode_long(self, text: str) -> Iterator[np.ndarray]:
        if not self._word_slices or self._drops:
            # A normalizer or another pre-tokenizer: whole, to be sure. One that drops
            # characters too: its refusal counts them in the whole text.
            yield from self.encode_batch([text])
            return
        for piece in word_slices(text):
            yield from self.encode_batch([piece])

    def _refuse_dropped(self, texts: Sequence[str]) -> None:
        """Refuse text with characters this tokenizer leaves out of its ids, as CharTokenizer
        refuses a character it lacks. A character is tried alone once (cached: the cost grows
        with the alphabet, not the text) and must decode to something; the encoding's offsets
        cannot show it, since a dropped character shifts every later offset of its word onto
        the characters after it."""
        codes = np.frombuffer("".join(texts).encode("utf-32-le"), dtype=np.uint32)
        bad = []
        for code in np.unique(codes).tolist():
            if code not in self._kept:
                char = chr(code)
                ids = self._tok.encode(char, add_special_tokens=False).ids
                # Kept when its ids decode to something: a Metaspace pre-tokenizer gives a
                # dropped character the word-start mark alone, which decodes to nothing
                # (whitespace is a pre-tokenizer's split, never dropped).
                self._kept[code] = char.isspace() or bool(self._tok.decode(ids).strip())
            if not self._kept[code]:
                bad.append(code)
        if bad:
            lost = codes[np.isin(codes, bad)]
            _, first = np.unique(lost, return_index=True)
            shown = ", ".join(repr(chr(lost[i])) for i in sorted(first)[:5])
            raise TokenizerError(
                f"{lost.size:,} characters this tokenizer cannot represent would be dropped "
                f"(such as {shown}); use a tokenizer.json with an unknown token or byte "
                "fallback, or remove those characters from the text"
            )

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(list(ids)))

    def to_meta(self) -> dict[str, Any]:
        return {"name": self.name, "file": self.FILE, "eot_id": self._eot_id}

    def to_json(self) -> str:
        return str(self._tok.to_str())

    def save_files(self, directory: Path) -> None:
        self._tok.save(str(directory / self.FILE))


def _rust_from_json(text: str) -> Any:
    """The ``tokenizers`` model of a tokenizer.json's text; TokenizerSpecError in one line."""
    from tokenizers import Tokenizer as RustTokenizer

    try:
        return RustTokenizer.from_str(text)
    except Exception as err:  # JSON of another shape: the library's own words, one line
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise TokenizerSpecError(
            f"the tokenizer spec json is not a tokenizer.json tokenizers reads ({first})"
        ) from None


def _id_span(tokenizer: Any) -> int:
    """A ``tokenizers`` model's largest id plus one (see :attr:`HFTokenizer.vocab_size`)."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1


def _can_drop(tokenizer: Any) -> bool:
    """Whether a ``tokenizers`` model can leave characters out of its ids without a trace: a
    BPE with neither an unknown token nor byte fallback drops a character it has no symbol for
    (the tokenizer.json a chars model exports, say). A byte-level BPE holding all 256 byte
    symbols cannot: every character is bytes it has. The other models give an unknown token."""
    from tokenizers import models, pre_tokenizers

    model = tokenizer.model
    if not isinstance(model, models.BPE) or model.unk_token or model.byte_fallback:
        return False
    pre = tokenizer.pre_tokenizer
    if pre is not None and b'"ByteLevel"' in pre.__getstate__():
        return not set(pre_tokenizers.ByteLevel.alphabet()) <= set(tokenizer.get_vocab())
    return True


def _pre_tokenizes_like_gpt2(tokenizer: Any) -> bool:
    """Whether a ``tokenizers`` model encodes a text cut at :data:`_WORD_GAP` into the ids of
    the whole: no normalizer, GPT-2's byte-level pre-tokenizer (its regex, no prefix space),
    a model without dropout, and added tokens that hold no whitespace and take none from beside
    them. nanolab's own BPE is one, and so is GPT-2's own ``tokenizer.json``."""
    try:
        spec = json.loads(tokenizer.to_str())
    except Exception:  # a model the library cannot write out: not one to reason about
        return False
    pre = spec.get("pre_tokenizer") or {}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
    if spec.get("normalizer") is not None or any(pre.get(k) != v for k, v in byte_level.items()):
        return False
    if (spec.get("model") or {}).get("dropout") is not None:
        return False
    return all(
        not any(ch.isspace() for ch in added.get("content", " "))
        and not added.get("lstrip")
        and not added.get("rstrip")
        for added in spec.get("added_tokens") or []
    )


#: The name older datasets and checkpoints use for nanolab's own BPE class.
BPETokenizer = HFTokenizer


class TiktokenGPT2(Tokenizer):
    """GPT-2's BPE through ``tiktoken``: only when its files are already on this machine."""

    name = "gpt2"

    def __init__(self) -> None:
        try:
            import tiktoken
        except ImportError:
            raise TokenizerError(
                "tokenizer 'gpt2' needs tiktoken: pip install 'nanolab[tiktoken]' "
                "(and its gpt2 files on this machine), or use tokenizer 'bpe' to train one "
                "locally, or give a GPT-2 tokenizer.json with --tokenizer PATH"
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

    @property
    def eot_id(self) -> int | None:
        return int(self._enc.eot_token)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.asarray(self._enc.encode_ordinary(t), dtype=np.int32) for t in texts]

    def encode_long(self, text: str) -> Iterator[np.ndarray]:
        for piece in word_slices(text):  # GPT-2's own pre-tokenizer: see _WORD_GAP
            yield from self.encode_batch([piece])

    def decode(self, ids: list[int]) -> str:
        return str(self._enc.decode(list(ids)))

    def to_meta(self) -> dict[str, Any]:
        return {"name": self.name}


#: The longest run of non-space characters the BPE trainer sees as one word. Its cost grows
#: with the square of a word's length (a 500k-letter run: 100 s; minified code, base64 and
#: long tables hold such runs), and no merge it would learn past this length is ever used.
MAX_TRAIN_WORD = 256
_LONG_RUN = re.compile(rf"\S{{{MAX_TRAIN_WORD},}}")


def chunked(texts: Iterable[str], size: int = 1 << 20) -> Iterable[str]:
    """Long texts in pieces of ``size`` characters (the BPE trainer holds one piece at a time),
    with every run of non-space characters longer than :data:`MAX_TRAIN_WORD` cut into pieces
    of that length, each its own text (the trainer never joins two texts into one word)."""
    for text in texts:
        for i in range(0, len(text), size):
            piece, start = text[i : i + size], 0
            for run in _LONG_RUN.finditer(piece):
                if run.start() > start:
                    yield piece[start : run.start()]
                for j in range(run.start(), run.end(), MAX_TRAIN_WORD):
                    yield piece[j : min(j + MAX_TRAIN_WORD, run.end())]
                start = run.end()
            if start < len(piece):
                yield piece[start:]


def learn_bpe(pieces: Iterable[str], vocab_size: int) -> Any:
    """A ``tokenizers`` byte-level BPE learned from ``pieces`` (already cut by :func:`chunked`),
    with ``vocab_size - 1`` ids: the end-of-text token is the last."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    check_bpe_vocab_size(vocab_size, "the BPE vocab_size")
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(pieces, trainer=trainer)
    return tok


def build_tokenizer(
    name: str,
    texts: Callable[[], Iterable[str]],
    bpe_vocab_size: int = 4096,
    eot_token: str | None = None,
) -> Tokenizer:
    """Build tokenizer ``name``; ``texts()`` streams what it learns from (chars: the whole corpus,
    bpe: a bounded sample), and is not called by tokenizers that learn nothing."""
    check_tokenizer_name(name)
    if name == "bytes":
        return ByteTokenizer()
    if name == "chars":
        tok = CharTokenizer.from_texts(texts())
        if not tok.chars:
            raise TokenizerError("the sources hold no text to build a character vocabulary from")
        return tok
    if name == "bpe":
        return HFTokenizer.train(texts(), bpe_vocab_size)
    if name == "gpt2":
        return TiktokenGPT2()
    return HFTokenizer.from_file(name, eot_token)


def train_tokenizer(name: str, text: str, bpe_vocab_size: int = 4096) -> Tokenizer:
    """Build tokenizer ``name`` for one in-memory ``text`` (tests, small corpora)."""
    return build_tokenizer(name, lambda: [text], bpe_vocab_size)


def load_tokenizer(dataset_dir: str | Path) -> Tokenizer:
    """Rebuild the tokenizer a dataset was prepared with, from its ``meta.json``."""
    directory = Path(dataset_dir)
    meta_path = directory / "meta.json"
    if not meta_path.is_file():
        raise TokenizerError(f"{meta_path} not found; run `nanolab prepare` for this dataset")
    return tokenizer_from_spec(json.loads(meta_path.read_text())["tokenizer"], directory)


#: Tokenizers whose vocabulary lives in the dataset's ``tokenizer.json``, not in ``meta.json``.
FILE_TOKENIZERS = ("bpe", "hf")


def data_tokenizer(datamodule: Any) -> Tokenizer:
    """The tokenizer a run trains with and its checkpoints store: the copy its DataModule took
    when it checked the data (``tokenizer_spec``), since a folder prepared again during the run
    holds another; from a DataModule without that copy, its folder's."""
    spec = getattr(datamodule, "tokenizer_spec", None)
    if spec:
        return tokenizer_from_spec(spec)
    return load_tokenizer(datamodule.dataset_dir)


def portable_spec(dataset_dir: str | Path, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """The tokenizer spec with any files inlined, for checkpoints that must decode on their own.

    ``meta`` is the dataset's ``meta.json`` as already read (and checked) by the caller; without
    it the file is read now. A run passes the meta it checked, so its checkpoints describe the
    data it trains on even if the folder is prepared again meanwhile."""
    directory = Path(dataset_dir)
    if meta is None:
        meta = json.loads((directory / "meta.json").read_text())
    spec = dict(meta["tokenizer"])
    if spec["name"] in FILE_TOKENIZERS:
        spec["json"] = (directory / HFTokenizer.FILE).read_text()
    return spec


def spec_problem(spec: Any) -> str | None:
    """What is wrong with the fields of a stored tokenizer spec (None: nothing this can see),
    in words naming the field. Cheap, so a checkpoint is checked whenever it is opened: the
    fields of every kind nanolab writes (and wrote: a ``bpe``/``hf`` spec without ``json``
    reads its dataset's file) must have their types, and an inlined ``tokenizer.json`` must be
    a JSON object. A name this version does not know is left to :func:`tokenizer_from_spec`."""
    if not isinstance(spec, dict):
        return f"is a {type(spec).__name__}, not a mapping of its fields"
    name = spec.get("name")
    if not isinstance(name, str):
        return f"has no name (name: {name!r})"
    if name in ("bytes", "chars") and not isinstance(spec.get("eot", False), bool):
        return f"eot is {spec['eot']!r}, not true or false"
    if name == "chars":
        chars = spec.get("chars")
        if chars is None:
            return "chars (its list of characters) is missing"
        if not isinstance(chars, (list, str)):
            return (
                f"chars is {str(chars)[:40]!r} ({type(chars).__name__}), not a list of characters"
            )
        wrong = next((c for c in chars if not (isinstance(c, str) and len(c) == 1)), None)
        if wrong is not None:
            return f"chars holds {str(wrong)[:40]!r}, not one character"
    if name in FILE_TOKENIZERS:
        eot = spec.get("eot_id")
        if eot is not None and (isinstance(eot, bool) or not isinstance(eot, int) or eot < 0):
            return f"eot_id is {eot!r}, not a token id"
        if "json" in spec:
            text = spec["json"]
            if not isinstance(text, str):
                return f"json is a {type(text).__name__}, not the text of a tokenizer.json"
            try:
                parsed = json.loads(text)
            except ValueError as err:
                return f"json is not JSON ({err})"
            if not isinstance(parsed, dict) or "model" not in parsed:
                return "json is not a tokenizer.json (no model in it)"
    return None


def spec_ids(spec: dict[str, Any]) -> tuple[int, int | None]:
    """(vocab_size, eot_id) of the tokenizer a spec with its file inlined describes, read from
    its vocabulary alone (nothing is tokenized, and a tokenizer.json is only parsed: a 128k
    vocabulary takes under a second). eot_id is None when the tokenizer has none, or when its
    file holds no token at the spec's eot_id (the spec names it, so a file swapped for another
    may lack it). GPT-2's are fixed facts: its files may be absent where the data trains."""
    problem = spec_problem(spec)
    if problem is not None:
        raise TokenizerSpecError(f"the tokenizer spec {problem}")
    if spec["name"] == "gpt2":
        return KNOWN_VOCAB["gpt2"], KNOWN_VOCAB["gpt2"] - 1
    if spec["name"] in FILE_TOKENIZERS and "json" in spec:
        tokenizer = _rust_from_json(spec["json"])
        eot = spec.get("eot_id")
        if eot is not None and tokenizer.id_to_token(eot) is None:
            eot = None
        return _id_span(tokenizer), eot
    built = tokenizer_from_spec(spec)
    return built.vocab_size, built.eot_id


def tokenizer_from_spec(spec: dict[str, Any], directory: Path | None = None) -> Tokenizer:
    """Rebuild a tokenizer from a ``meta.json`` or checkpoint spec (older specs included).

    A spec whose fields are not what nanolab writes is :class:`TokenizerSpecError` naming the
    field (a KeyError or a tokenizers traceback otherwise); callers name the file."""
    problem = spec_problem(spec)
    if problem is not None:
        raise TokenizerSpecError(f"the tokenizer spec {problem}")
    name = spec.get("name")
    if name == "bytes":
        return ByteTokenizer(eot=bool(spec.get("eot", False)))
    if name == "chars":
        return CharTokenizer(list(spec["chars"]), eot=bool(spec.get("eot", False)))
    if name in ("bpe", "hf"):
        if "json" in spec:
            return HFTokenizer.from_json(spec["json"], spec)
        if directory is None:
            raise TokenizerError(f"a {name} tokenizer spec needs its tokenizer.json")
        return HFTokenizer.load(directory, spec)
    if name == "gpt2":
        return TiktokenGPT2()
    raise TokenizerError(f"unknown tokenizer {name!r} in the dataset or checkpoint")


def prepared_vocab(data: Mapping[str, Any], base: Path | None = None) -> int | None:
    """The vocabulary in the ``meta.json`` of the data a config's ``data`` group points to
    (``dataset_dir``, or a mixture's first folder: they share one tokenizer); None where none
    is prepared (yet) or it cannot be read (a vocabulary that is no count is refused). fit holds ``model.gpt.vocab_size`` to it, so
    ``estimate`` and ``queue add`` do too. ``base``: the folder a relative path is under (the
    job's; by default this process's working directory)."""
    folder, field = data.get("dataset_dir"), "data.dataset_dir"
    mixture = data.get("datasets")
    if mixture and isinstance(mixture[0], Mapping) and mixture[0].get("path"):
        folder, field = mixture[0]["path"], "data.datasets[0].path"
    if not folder:
        return None
    path = expand_user(str(folder), field=field)
    meta = (path if base is None else base / path) / "meta.json"
    try:
        vocab = json.loads(meta.read_text())["vocab_size"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 2:
        raise NanolabError(
            f"{meta} vocab_size must be an integer >= 2, got {vocab!r}; prepare the data again"
        )
    return vocab
