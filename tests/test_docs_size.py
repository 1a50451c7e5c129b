"""The README is the front door and each docs page one topic: their sizes stay readable."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted((REPO / "docs").glob("*.md"))


def test_the_readme_stays_within_250_lines():
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_a_docs_page_stays_within_300_lines(page):
    """Mutation caught: a page grown past 300 lines (split it by what its reader wants)."""
    assert len(page.read_text().splitlines()) <= 300, page.name
