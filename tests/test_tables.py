"""The report's tables (``nanolab.tables``, through tabulate): the layout, the 100-column cut,
plain text.

Each test names, in its docstring, the mutation of nanolab it was seen to catch.
"""

from __future__ import annotations

import re

from nanolab.tables import WIDTH, table, table_within

HEADERS = ["run", "status", "steps", "train loss", "Δ train loss", "GPU-h", "cost"]
ROWS = [
    ["qs-lr1e-3-s1", "completed", "100", "2.5241", "-1.7373 (-41%)", "0.0060", "-"],
    ["long-run-name-s2", "crashed: CUDA out of memory", "7", "-", "-", "0.100", "$1.20"],
]
RIGHT = {2, 3, 5, 6}


def test_a_table_is_the_report_layout_and_the_hand_made_one() -> None:
    """Columns two spaces apart, each as wide as its widest cell (header included), aligned
    as asked, dashes under the header, the cells printed as given (``0.0060`` stays), no
    trailing spaces (the layout ``report``, ``status`` and ``queue ls`` print). Without a rule
    (``report --compare``, ``status``): the rows alone, the first one as a plain row.

    Mutations caught: tabulate's 2-space minimum header padding left on (every column 2
    wider); its number parsing left on (``0.0060`` printed as ``0.006``).
    """
    lines = table(ROWS, HEADERS, RIGHT)
    assert lines == [
        "run               status                       steps  train loss  Δ train loss     GPU-h   cost",
        "----------------  ---------------------------  -----  ----------  --------------  ------  -----",
        "qs-lr1e-3-s1      completed                      100      2.5241  -1.7373 (-41%)  0.0060      -",
        "long-run-name-s2  crashed: CUDA out of memory      7           -  -                0.100  $1.20",
    ]  # fmt: skip
    plain = table([HEADERS, *ROWS], right=RIGHT, rule=False)
    assert plain == [lines[0], *lines[2:]]


def test_a_wide_table_is_cut_at_100_columns_repeating_the_first() -> None:
    """A table wider than 100 columns is cut into tables of at most 100, each starting with the
    run column and its own header and rule, every other column in exactly one of them, in
    order, the tables an empty line apart; plain text (no escape codes).

    Mutations caught: the first column not repeated; the cut made after the width is passed
    (lines over 100 columns).
    """
    headers = ["run", *(f"column {i}" for i in range(1, 13))]
    rows = [["some-long-run-name-s1", *(f"{i * 1.2345:.4f}" for i in range(1, 13))]]
    lines = table_within(rows, headers, set(range(1, 13)))
    assert max(len(line) for line in lines) <= WIDTH
    assert "\x1b" not in "".join(lines)
    parts = "\n".join(lines).split("\n\n")
    assert len(parts) == 2
    seen = []
    for part in parts:
        head, rule, row = part.splitlines()
        assert head.startswith("run ") and rule.startswith("-" * 21 + "  ")
        assert row.startswith("some-long-run-name-s1")
        seen += re.split(r"\s{2,}", head.strip())[1:]
    assert seen == headers[1:]
    narrow = [rows[0][:3]]
    assert table_within(narrow, headers[:3]) == table(narrow, headers[:3])
