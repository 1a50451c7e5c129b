"""The Shakespeare cloze: a real multiple-choice task built from the bundled corpus.

Each example is the start of a speech from the corpus's *validation* split (the text the
quickstart never trains on): the speaker's name and the speech's first lines. The options are
the true next line and three other lines (not of the same speech) drawn from the speeches around it (the same play),
in a seeded order. A model that has learned anything of verse, syntax and sense picks the true
line more often than one in four; an untrained model picks at chance.

The task file ships with nanolab (``builtin:shakespeare``, ``data/shakespeare-cloze.jsonl``).
It is rebuilt exactly, byte for byte, by ``python -m nanolab.downstream.cloze`` (a test holds the
shipped file to it): the split is the one ``nanolab prepare`` makes with the quickstart's
settings (``chars`` tokenizer, ``val_fraction`` 0.1, split seed 0).
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
from pathlib import Path

import numpy as np

from nanolab.atomic import write_whole
from nanolab.downstream.tasks import BUILTIN_DIR

#: The shipped file and how it was built.
CLOZE_FILE = BUILTIN_DIR / "shakespeare-cloze.jsonl"
EXAMPLES = 1000
OPTIONS = 4
SEED = 0
#: Distractors come from the speeches within this many speeches of the example's (same play).
NEIGHBOURHOOD = 40
#: Gaps cut into one speech (different lines), at most.
GAPS_PER_SPEECH = 3


def validation_text() -> str:
    """The bundled corpus's validation split as ``nanolab prepare`` splits it (chars)."""
    from nanolab.data.prepare import prepare_dataset
    from nanolab.data.tokenizers import load_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        meta = prepare_dataset(["bundled:shakespeare"], tmp, tokenizer="chars", quiet=True)
        ids = np.fromfile(Path(tmp) / "val.bin", dtype=np.dtype(meta["dtype"]))
        tokenizer = load_tokenizer(tmp)
        eot = tokenizer.eot_id
        pieces = np.split(ids, np.flatnonzero(ids == eot)) if eot is not None else [ids]
        return "\n\n".join(tokenizer.decode([int(i) for i in p if i != eot]) for p in pieces)


def speeches(text: str) -> list[tuple[str, list[str]]]:
    """(speaker, verse lines) of every speech: a block ``NAME:`` then its lines."""
    out = []
    for block in text.split("\n\n"):
        lines = [ln for ln in block.strip("\n").split("\n") if ln.strip()]
        if len(lines) >= 3 and lines[0].endswith(":") and lines[0][:-1].isupper():
            out.append((lines[0], lines[1:]))
    return out


def build_examples(text: str, count: int = EXAMPLES, seed: int = SEED) -> list[dict[str, object]]:
    """Up to ``count`` cloze examples in nanolab's multiple-choice layout."""
    rng = random.Random(seed)
    found = speeches(text)
    order = list(range(len(found)))
    rng.shuffle(order)
    examples: list[dict[str, object]] = []
    for s in order:
        speaker, lines = found[s]
        near = range(max(0, s - NEIGHBOURHOOD), min(len(found), s + NEIGHBOURHOOD + 1))
        pool = sorted({ln for i in near if i != s for ln in found[i][1]} - set(lines))
        if len(pool) < OPTIONS - 1:
            continue
        # Up to GAPS_PER_SPEECH gaps, each after at least one line of the speech.
        for at in sorted(rng.sample(range(1, len(lines)), min(GAPS_PER_SPEECH, len(lines) - 1))):
            true = lines[at]
            choices = [*rng.sample(pool, OPTIONS - 1), true]
            rng.shuffle(choices)
            context = "\n".join([speaker, *lines[:at]])
            examples.append({"context": context, "choices": choices, "label": choices.index(true)})
            if len(examples) == count:
                return examples
    return examples


def render(examples: list[dict[str, object]]) -> str:
    return "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in examples)


def main(argv: list[str] | None = None) -> int:
    """Rebuild the shipped task file (or write it to the path given)."""
    args = sys.argv[1:] if argv is None else argv
    out = Path(args[0]) if args else CLOZE_FILE
    examples = build_examples(validation_text())
    # A name of this call's own, synced before the rename: the shipped file is whole or the old
    # one, and two rebuilds at once cannot publish each other's half-written text.
    write_whole(out, render(examples))
    print(f"{len(examples)} examples -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
