"""A bad document in ``data.source``, said with what ``fit`` can do about it.

``fit`` (and ``validate``/``test``, and a queued job, which runs fit) prepares ``data.source``
with prepare's defaults: it stops at the first bad document and reads the field or column
``text``. Prepare's own message for a bad document offers ``--skip-bad`` and ``--text-field``,
which fit does not have; this one keeps the problem and the fix to the file, and offers the
``nanolab prepare`` command, with the run's own sources, folder and tokenizer, that prepares
the data with those options, to train on with ``--data.source null``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from nanolab.data.prepare import BadTextError
from nanolab.data.stale import prepare_command
from nanolab.home import expand_user

#: Where fit reads a JSON line's or a parquet row's text (prepare's ``--text-field`` default).
FIT_TEXT_FIELD = "text"


def bad_text_message(
    err: BadTextError,
    source: Sequence[str],
    dataset_dir: str | Path,
    tokenizer: str,
    bpe_vocab_size: int,
    val_fraction: float,
    verb: str = "fit",
    source_is_setting: bool = True,
) -> str:
    """``verb``'s one line for ``err``, met preparing ``source`` into ``dataset_dir``.

    Args:
        source_is_setting: ``--data.source null`` leaves the data class nothing to prepare (a
            class that sets its own ``source``, like a records renderer, ignores a null: the
            data can then only be fixed, not prepared otherwise).
    """
    if not source_is_setting:
        fix = err.fix if err.fix and not err.names_field else "fix it"
        return f"{err.problem}; {fix}: {verb} prepares the data class's source as it is"
    folder = expand_user(dataset_dir)
    force = folder.is_dir() and any(folder.iterdir())  # this dataset, damaged: replaced
    use = "train on" if verb == "fit" else "use"
    then = f"then {use} it with --data.source null"
    if err.names_field:
        # A parquet file without the column is refused whole (no --skip-bad); a record
        # without the field is one bad document.
        what = "field" if err.skippable else "column"
        command = prepare_command(
            source, dataset_dir, tokenizer, bpe_vocab_size, val_fraction, force=force
        )
        skip = " (or with --skip-bad, skipping the records without it)" if err.skippable else ""
        return (
            f"{err.problem}; {verb} reads the {what} {FIT_TEXT_FIELD!r} only: prepare the data "
            f"yourself naming the text's {what}{skip}: `{command} --text-field <{what}>`, {then}"
        )
    command = prepare_command(
        source, dataset_dir, tokenizer, bpe_vocab_size, val_fraction, ["--skip-bad"], force
    )
    fix = f"{err.fix}, or" if err.fix else "fix it, or"
    return (
        f"{err.problem}; {fix} prepare the data yourself, skipping bad documents ({verb} "
        f"stops at the first): `{command}`, {then}"
    )
