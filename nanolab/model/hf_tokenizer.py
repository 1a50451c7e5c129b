"""nanolab's tokenizers as Hugging Face ``tokenizer.json`` files, and the check that a dataset was
tokenized the way an imported checkpoint expects.

A token id means nothing without its tokenizer: fine-tuning GPT-2 on data prepared with another
vocabulary trains on noise without any error. So both directions compare *vocabularies* (token
text -> id, in the byte-level spelling GPT-2 uses): an import refuses data whose vocabulary is not
the checkpoint folder's, and an export writes a ``tokenizer.json`` whose vocabulary is the data's.

Every nanolab tokenizer has a Hugging Face form: ``bpe``/``hf`` already are one; ``gpt2``
(tiktoken) is the same byte-level BPE, its merges recovered from tiktoken's ranks; ``bytes`` is a
byte-level model without merges; ``chars`` one token per character without merges.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nanolab.data.tokenizers import (
    EOT_TEXT,
    ByteTokenizer,
    CharTokenizer,
    HFTokenizer,
    TiktokenGPT2,
    Tokenizer,
    TokenizerError,
    load_tokenizer,
    portable_spec,
    tokenizer_from_spec,
)
from nanolab.model.hf import RECORD_KEY, HFFormatError


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> character table: printable Latin-1 bytes stand for themselves, the other
    68 bytes take the code points from 256 up, in byte order (so every token is printable)."""
    keep = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    shifted = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(shifted)) for b in range(256)}


def _spell(token: bytes, alphabet: dict[int, str]) -> str:
    return "".join(alphabet[b] for b in token)


def _tiktoken_ranks() -> tuple[dict[bytes, int], dict[str, int]]:
    """GPT-2's mergeable ranks and special tokens, through tiktoken's public API."""
    import tiktoken

    enc = tiktoken.get_encoding("gpt2")
    specials = {s: enc.encode_single_token(s) for s in enc.special_tokens_set}
    special_ids = set(specials.values())
    ranks = {
        enc.decode_single_token_bytes(i): i for i in range(enc.n_vocab) if i not in special_ids
    }
    return ranks, specials


def vocabulary(tok: Tokenizer) -> dict[str, int]:
    """Token text -> id for a nanolab tokenizer, spelled as its ``tokenizer.json`` spells it."""
    if isinstance(tok, HFTokenizer):
        from tokenizers import Tokenizer as RustTokenizer

        return dict(RustTokenizer.from_str(tok.to_json()).get_vocab(with_added_tokens=True))
    alphabet = byte_alphabet()
    if isinstance(tok, TiktokenGPT2):
        ranks, specials = _tiktoken_ranks()
        return {**{_spell(t, alphabet): i for t, i in ranks.items()}, **specials}
    if isinstance(tok, ByteTokenizer):
        vocab = {alphabet[b]: b for b in range(256)}
    elif isinstance(tok, CharTokenizer):
        vocab = {c: i for i, c in enumerate(tok.chars)}
    else:
        raise HFFormatError(f"tokenizer {tok.name!r} has no Hugging Face form")
    if tok.eot_id is not None:
        vocab[EOT_TEXT] = tok.eot_id
    return vocab


def _merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """BPE merges in rank order: each multi-byte token is the merge of the two pieces that BPE
    with only the lower ranks leaves of it (how tiktoken's ranks encode GPT-2's merges)."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) < 2:
            continue
        parts = [token[i : i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best, best_rank = -1, rank
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and r < best_rank:
                    best, best_rank = i, r
            if best < 0:
                break
            parts[best : best + 2] = [parts[best] + parts[best + 1]]
        if len(parts) != 2:
            raise HFFormatError(f"GPT-2 token {token!r} is not a merge of two lower-ranked tokens")
        merges.append((parts[0], parts[1]))
    return merges


def tokenizer_json(tok: Tokenizer) -> str:
    """The ``tokenizer.json`` text that encodes and decodes like ``tok`` (documents encoded
    without special tokens, as ``nanolab prepare`` does)."""
    if isinstance(tok, HFTokenizer):
        return tok.to_json()
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RustTokenizer

    alphabet = byte_alphabet()
    if isinstance(tok, TiktokenGPT2):
        ranks, specials = _tiktoken_ranks()
        vocab = {_spell(t, alphabet): i for t, i in ranks.items()}
        merges = [(_spell(a, alphabet), _spell(b, alphabet)) for a, b in _merges_from_ranks(ranks)]
        hf = RustTokenizer(models.BPE(vocab=vocab, merges=merges))
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's regex
        hf.decoder = decoders.ByteLevel()
        hf.add_special_tokens([AddedToken(s, special=True) for s in sorted(specials)])
        return str(hf.to_str())
    vocab = {k: v for k, v in vocabulary(tok).items() if k != EOT_TEXT or tok.eot_id is None}
    hf = RustTokenizer(models.BPE(vocab=vocab, merges=[]))
    if isinstance(tok, ByteTokenizer):
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        hf.decoder = decoders.ByteLevel()
    else:  # chars: the whole text is one word split into its characters
        hf.decoder = decoders.Fuse()
    if tok.eot_id is not None:
        hf.add_special_tokens([AddedToken(EOT_TEXT, special=True)])
    return str(hf.to_str())


def write_tokenizer_files(tok: Tokenizer, out: Path, max_length: int) -> None:
    """``tokenizer.json`` and the ``tokenizer_config.json`` that lets ``AutoTokenizer`` load it."""
    text = tokenizer_json(tok)
    (out / "tokenizer.json").write_text(text, encoding="utf-8")
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    if tok.eot_id is not None:
        from tokenizers import Tokenizer as RustTokenizer

        eot = RustTokenizer.from_str(text).id_to_token(tok.eot_id)
        config.update(eos_token=eot, bos_token=eot)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def folder_vocabulary(folder: Path) -> dict[str, int] | None:
    """The vocabulary of a model folder's ``tokenizer.json`` (or GPT-2's older ``vocab.json``);
    ``None`` when the folder has neither."""
    path = folder / "tokenizer.json"
    if path.is_file():
        from tokenizers import Tokenizer as RustTokenizer

        try:
            return dict(RustTokenizer.from_file(str(path)).get_vocab(with_added_tokens=True))
        except Exception as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise HFFormatError(f"{path}: not a readable tokenizer.json ({first[:160]})") from None
    path = folder / "vocab.json"
    if path.is_file():
        try:
            vocab = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise HFFormatError(f"{path}: not readable JSON ({err})") from None
        if isinstance(vocab, dict) and all(isinstance(v, int) for v in vocab.values()):
            return vocab
        raise HFFormatError(f"{path}: must map token text to ids")
    return None


def _first_difference(ours: dict[str, int], theirs: dict[str, int]) -> str:
    for token, i in sorted(ours.items(), key=lambda item: item[1]):
        if theirs.get(token) != i:
            other = "absent" if token not in theirs else f"id {theirs[token]}"
            return f"e.g. {token!r} is id {i} in the data, {other} in the checkpoint"
    extra = sorted(set(theirs) - set(ours), key=lambda t: theirs[t])
    return f"e.g. the checkpoint also has {extra[0]!r}" if extra else ""


def check_data_tokenizer(folder: Path, dataset_dir: Path, vocab_size: int) -> str | None:
    """Refuse data tokenized differently from the checkpoint in ``folder``.

    Compared: the dataset's vocabulary with the folder's ``tokenizer.json``/``vocab.json``;
    without those files, the tokenizer a nanolab export recorded; without that, the vocabulary
    size alone (``vocab_size``, the checkpoint's), and the returned warning says it could not do
    more.
    """
    tok = load_tokenizer(dataset_dir)
    theirs = folder_vocabulary(folder)
    fix = (
        f"prepare the data with the checkpoint's tokenizer (nanolab prepare <text> --tokenizer "
        f"{folder / 'tokenizer.json'} -o <folder>)"
    )
    if theirs is None:
        from nanolab.model.exported import exported_info

        info = exported_info(folder)  # a safetensors export keeps its tokenizer in nanolab.json
        if info is not None:
            recorded = info.get("tokenizer")
        else:
            config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
            recorded = (config.get(RECORD_KEY) or {}).get("tokenizer")
        if isinstance(recorded, dict):
            spec = json.loads((dataset_dir / "meta.json").read_text())["tokenizer"]
            recorded = {k: v for k, v in recorded.items() if k != "json"}
            if {k: v for k, v in spec.items() if k != "json"} != recorded:
                raise HFFormatError(
                    f"data.dataset_dir {dataset_dir}: prepared with tokenizer {spec.get('name')!r}, "
                    f"but the checkpoint in {folder} was trained on {recorded.get('name')!r} data "
                    "with another vocabulary; prepare the data as the checkpoint's was"
                )
            return None
        if tok.vocab_size != vocab_size:
            raise HFFormatError(
                f"data.dataset_dir {dataset_dir}: its tokenizer ({tok.name}) has "
                f"{tok.vocab_size} ids but the checkpoint in {folder} has {vocab_size}: they are "
                f"not the same tokenizer; {fix}"
            )
        return (
            f"{folder} has no tokenizer.json or vocab.json: only the vocabulary size "
            f"({vocab_size}) of data.dataset_dir {dataset_dir} could be checked against it"
        )
    check_same_vocabulary(dataset_dir, tok, theirs, f"in {folder}", fix)
    return None


def check_same_vocabulary(
    dataset_dir: Path,
    tok: Tokenizer,
    theirs: dict[str, int],
    where: str,
    fix: str,
    field: str = "data.dataset_dir",
) -> None:
    """Refuse data whose tokenizer ``tok`` maps text to ids otherwise than the checkpoint's
    vocabulary ``theirs`` (``where`` says which checkpoint), naming the first difference: the
    one comparison behind ``model.init_from`` and ``validate``/``test`` of a checkpoint.
    ``field`` names where ``dataset_dir`` comes from (a project's DataModule may not have it
    as a setting)."""
    try:
        ours = vocabulary(tok)
    except HFFormatError:
        ours = {}
    if ours != theirs:
        raise HFFormatError(
            f"{field} {dataset_dir}: prepared with tokenizer {tok.name!r} "
            f"({len(ours)} tokens), not the checkpoint's tokenizer {where} ({len(theirs)} "
            f"tokens; {_first_difference(ours, theirs)}); {fix}"
        )


def check_scored_data(
    dataset_dir: Path,
    spec: Any,
    source: Path,
    verb: str,
    fix: str | None = None,
    field: str = "data.dataset_dir",
) -> None:
    """``validate``/``test`` of checkpoint ``source``, and every resume or branch from one:
    refuse data ``dataset_dir`` that is not tokenized with the checkpoint's tokenizer
    (``spec``, as the checkpoint stores it). Its ids would index other tokens' rows, and a loss
    over them means nothing; when the data's vocabulary is no larger than the model's it even
    scores (and trains) without an error. A checkpoint that stores no tokenizer (or one this
    nanolab cannot build) is not checked. ``fix``: what works instead (default: ``verb`` it on
    data prepared with its tokenizer). ``field``: what names ``dataset_dir`` in the message."""
    if not isinstance(spec, dict) or portable_spec(dataset_dir) == spec:
        return  # nothing to compare, or the very tokenizer (a bpe's file included)
    try:
        theirs = vocabulary(tokenizer_from_spec(spec))
    except (TokenizerError, HFFormatError):
        return
    fix = fix or f"{verb} it on data prepared with its tokenizer (as its run's data was)"
    name = spec.get("name")
    where = f"{name!r} in {source}" if isinstance(name, str) else f"in {source}"
    tok = load_tokenizer(dataset_dir)
    check_same_vocabulary(dataset_dir, tok, theirs, where, fix, field)


def check_init_from_data(model_cfg: Any, datamodule: Any) -> None:
    """``nanolab fit`` with ``model.init_from``: refuse data whose tokenizer is not the
    checkpoint's (a mixture's folders share one tokenizer, checked by the data module)."""
    from lightning.pytorch.utilities import rank_zero_warn

    from nanolab.model.hf import hf_folder

    folder = hf_folder(model_cfg.init_from)
    vocab = int(model_cfg.gpt.vocab_size)
    warning = check_data_tokenizer(folder, Path(datamodule.dataset_dir), vocab)
    if warning:
        rank_zero_warn(warning)
