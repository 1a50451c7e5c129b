"""How ``nanolab prepare`` cuts a text file into units: the cut points on awkward text (no
newlines, CR-only, CRLF, indented lines, unicode with no whitespace) stay the bytes they were,
and the search for them reads each byte about once."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest

from nanolab.data import sources
from nanolab.data.prepare import prepare_dataset

#: What awkward text is made of: letters, spaces, every line ending, blank runs, indents, and
#: characters of two, three and four UTF-8 bytes (a cut never falls inside one).
ATOMS = ["a", "b", " ", "\n", "\r", "\t", "é", "語", "😀", "\n ", "\r\n", "\n\n", "  "]


def awkward_text(seed: int, n: int) -> str:
    """``n`` atoms drawn with skewed weights: some texts are all one kind of line ending or
    none, some have no whitespace at all."""
    rng = random.Random(seed)
    weights = [rng.random() ** 3 for _ in ATOMS]
    return "".join(rng.choices(ATOMS, weights, k=n))


def units_of(path: Path) -> list[tuple[int, int, list[int], bool]]:
    """Every block of a text file as the reader cuts it: first unit, offset, unit sizes, end."""
    file = sources.resolve_sources([str(path)]).files[0]
    return [
        (b.first_unit, b.byte_offset, list(b.unit_sizes), b.ends_document)
        for b in sources.FileReader(file, 0, "text").blocks()
    ]


def digest(value: object) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]


def test_units_of_awkward_text_are_cut_where_they_always_were(tmp_path, monkeypatch):
    """Small units, reads and blocks, so that 60 random texts hit every rule of the cut (line
    start, line break at the limit, whitespace, mid-word at a character boundary) at read and
    block edges. The digest was made before the newline search resumed where it had found
    nothing: resuming must not move a single cut."""
    for name, value in (
        ("TEXT_UNIT_BYTES", 16),
        ("TEXT_UNIT_LONG_LINE_BYTES", 64),
        ("TEXT_UNIT_MAX_BYTES", 256),
        ("BLOCK_BYTES", 300),
    ):
        monkeypatch.setattr(sources, name, value)
    path = tmp_path / "t.txt"
    cuts = []
    for seed in range(60):
        path.write_text(awkward_text(seed, 2000 + 50 * seed), newline="")
        monkeypatch.setattr(sources, "_READ_BYTES", (1, 7, 64, 1000)[seed % 4])
        cuts.append(units_of(path))
    assert digest(cuts) == "7d1097f6593fcd90"


def mixed_corpus(n: int) -> str:
    """About ``n`` characters of prose, in pieces of up to 1.5 MB each with one way of ending
    its lines: newlines, none, CR only, CRLF, indented, blank lines, unicode."""
    rng = random.Random(1)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "héllo", "語"]
    line = lambda: " ".join(rng.choice(words) for _ in range(rng.randint(1, 14)))  # noqa: E731
    ends = ["\n", " ", "\r", "\r\n", "\n    ", "\n\n\n", "😀"]
    out, size = [], 0
    while size < n:
        end, count = rng.choice(ends), rng.choice([3, 300, 30_000, 100_000])
        piece = end.join(line() for _ in range(count))
        out.append(piece + "\n")
        size += len(piece) + 1
    return "".join(out)


def test_awkward_text_prepares_to_the_tokens_it_always_did(tmp_path):
    """Full-size units on 5 MB of text whose pieces end their lines every way: the bins'
    sha256 were made before the newline search resumed where it had found nothing."""
    path = tmp_path / "mixed.txt"
    path.write_text(mixed_corpus(4 << 20), newline="")
    assert digest(units_of(path)) == "00c0f88f22d4bc9d"
    out = tmp_path / "ds"
    prepare_dataset([str(path)], out, "bytes", quiet=True)
    bins = {
        n: hashlib.sha256((out / n).read_bytes()).hexdigest()[:16] for n in ("train.bin", "val.bin")
    }
    assert bins == {"train.bin": "7f830ba9f07add86", "val.bin": "b484225075d8aa85"}


class CountingSearch:
    """A compiled pattern that counts the bytes its searches span."""

    def __init__(self, pattern) -> None:
        self.pattern = pattern
        self.spanned = 0

    def search(self, buf: bytes, start: int, end: int):
        self.spanned += max(0, end - start)
        return self.pattern.search(buf, start, end)


@pytest.mark.parametrize("ending", [" ", "\r"])
def test_the_newline_search_reads_each_byte_about_once(tmp_path, monkeypatch, ending):
    """With no newline in reach, each ~16 KB unit searched the 1 MB ahead of it twice (for a
    line start, then for a line break): 4 MB of text with no newlines or with CR-only line
    ends searched ~1 GB, and prepare ran 5-7x slower than on text with lines. Each search now
    resumes where the last one found nothing."""
    text = ending.join("lorem ipsum dolor sit amet" for _ in range(150_000))
    path = tmp_path / "long.txt"
    path.write_text(text, newline="")
    searches = {}
    for name in ("_LINE_START", "_LINE_BREAK"):
        searches[name] = CountingSearch(getattr(sources, name))
        monkeypatch.setattr(sources, name, searches[name])
    sizes = [n for block in units_of(path) for n in block[2]]
    assert sum(sizes) == len(text) and len(sizes) > 200
    for name, search in searches.items():
        assert search.spanned <= 1.1 * len(text), (name, search.spanned, len(text))
