"""Text tables: the one place ``nanolab report`` formats one, through ``tabulate``.

The look is tabulate's ``simple`` format: columns two spaces apart, each left- or right-aligned
as asked, a line of dashes under the header; plain text whether stdout is a terminal or a pipe.
Cells are given as the strings to print (numbers already formatted: tabulate's own number
parsing is off, so ``0.0060`` stays ``0.0060``). A table wider than :data:`WIDTH` is cut into
tables that each repeat the first column (:func:`table_within`).

``tabulate`` is imported when a table is printed (~25 ms), not when the module is.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

#: The widest line of a report table.
WIDTH = 100


def table(
    rows: Sequence[Sequence[str]],
    headers: Sequence[str] | None = None,
    right: Container[int] = (),
    rule: bool = True,
) -> list[str]:
    """``rows`` under ``headers`` (none: the rows alone) as lines, column ``i`` right-aligned
    when ``i in right``, dashes under the header when ``rule``; trailing spaces dropped."""
    import tabulate

    width = len(headers) if headers else max((len(r) for r in rows), default=0)
    align = ["right" if i in right else "left" for i in range(width)]
    # tabulate makes a column at least 2 wider than its header (MIN_PADDING, a module setting);
    # here a column is as wide as its widest cell, header included.
    padding = tabulate.MIN_PADDING
    tabulate.MIN_PADDING = 0
    try:
        text = tabulate.tabulate(
            [list(r) for r in rows],
            list(headers) if headers else (),
            tablefmt="simple" if headers and rule else "plain",
            disable_numparse=True,
            colalign=align,
        )
    finally:
        tabulate.MIN_PADDING = padding
    return [line.rstrip() for line in text.splitlines()]


def table_within(
    rows: Sequence[Sequence[str]],
    headers: Sequence[str],
    right: Container[int] = (),
    width: int = WIDTH,
) -> list[str]:
    """:func:`table` cut into tables of at most ``width`` characters, each repeating the first
    column (the run), so a wide report reads in a terminal or a pasted message; a table holds
    at least one column beside the first, however wide. Tables after the first are preceded by
    an empty line."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    chunks: list[list[int]] = [[]]
    for i in range(1, len(widths)):
        used = widths[0] + sum(widths[j] + 2 for j in chunks[-1])
        if chunks[-1] and used + 2 + widths[i] > width:
            chunks.append([])
        chunks[-1].append(i)
    out: list[str] = []
    for chunk in chunks:
        picked = [0, *chunk]
        part = table(
            [[r[i] for i in picked] for r in rows],
            [headers[i] for i in picked],
            {n for n, i in enumerate(picked) if i in right},
        )
        out += part if not out else ["", *part]
    return out
