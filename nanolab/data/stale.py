"""A dataset folder that ``data.source`` will not be prepared into, said in one message.

``nanolab fit`` (and ``validate``/``test``) prepare ``data.source`` into ``data.dataset_dir``
but never overwrite a dataset there that was prepared otherwise; ``nanolab queue add`` refuses
a job that fit would refuse at night, in the same words. The message offers what works: train
on the folder as it is, choose another folder, or replace it with ``nanolab prepare ...
--force``. That last command replaces the folder's dataset, so where the folder was prepared
from *other* sources than ``data.source`` (a user's own dataset, not the same text edited
since) the message says whose data it would replace.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from pathlib import Path

from nanolab.data.sources import BUNDLED_PREFIX
from nanolab.home import expand_user


def prepare_command(
    source: Sequence[str],
    dataset_dir: str | Path,
    tokenizer: str,
    bpe_vocab_size: int,
    val_fraction: float,
    options: Sequence[str] = (),
    force: bool = True,
) -> str:
    """The ``nanolab prepare`` command that prepares ``source`` with these tokenizer settings
    into ``dataset_dir`` (what fit would have prepared), with prepare's own ``options`` too,
    replacing what is there when ``force``."""
    words = ["nanolab", "prepare", *source, "-o", str(dataset_dir), "--tokenizer", str(tokenizer)]
    if tokenizer == "bpe":
        words += ["--bpe-vocab-size", str(bpe_vocab_size)]
    if val_fraction != 0.1:
        words += ["--val-fraction", str(val_fraction)]
    return shlex.join([*words, *options, *(["--force"] if force else [])])


def other_sources(
    dataset_dir: str | Path, source: Sequence[str], cwd: Path | None = None
) -> list[str] | None:
    """The sources ``meta.json`` of ``dataset_dir`` says its dataset was prepared from (as they
    were typed then), when it holds the text of a file that ``source`` (read under ``cwd``, the
    current folder by default) does not name today and that is still there: another dataset,
    which the replacement would delete. None when every file it was prepared from is among
    ``source``'s or gone (the same text edited, grown or shrunk since), when ``source`` cannot
    be listed, or when the folder does not say where its files really were (a dataset
    prepared before nanolab stored ``source_paths``): the specs as typed were read under
    another folder, maybe through links, and cannot tell. A folder of more files than
    ``meta.json`` lists keeps only their digest: files other than ``source``'s then count as
    another dataset (the wording that warns before a replacement deletes it)."""
    import json

    from nanolab.data.sources import SourceError, paths_sha256, real_paths, resolve_sources

    folder = expand_user(dataset_dir, keep_unknown=True)
    base = cwd or Path.cwd()
    folder = folder if folder.is_absolute() else base / folder
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict):
        return None
    theirs, paths = meta.get("sources"), meta.get("source_paths")
    digest = meta.get("source_paths_sha256")
    if paths is None and isinstance(digest, str):
        paths = []  # a corpus of many files lists only their digest: compared below
    if not all(isinstance(v, list) and all(isinstance(s, str) for s in v) for v in (theirs, paths)):
        return None

    def under_base(spec: str) -> str:
        if spec.startswith(BUNDLED_PREFIX):
            return spec
        return str(base / expand_user(spec, keep_unknown=True))

    try:
        listed = real_paths(resolve_sources([under_base(s) for s in source], (folder,)).files)
    except SourceError:
        return None
    if not paths:  # only their digest (many files): not ours, so maybe another dataset: say so
        return theirs if digest != paths_sha256(listed) else None
    ours = set(listed)
    left_out = [
        p for p in paths if p not in ours and (p.startswith(BUNDLED_PREFIX) or os.path.isfile(p))
    ]
    return theirs if left_out else None


def stale_dataset_message(
    dataset_dir: str | Path,
    source: Sequence[str],
    prepare: str,
    verb: str,
    holds_dataset: bool,
    source_is_setting: bool = True,
    theirs: Sequence[str] | None = None,
) -> str:
    """Why ``verb`` will not prepare ``source`` into ``dataset_dir`` and the fixes that work.

    Args:
        prepare: :func:`prepare_command` for this data (the replacement).
        holds_dataset: The folder holds a dataset (else other files: only another folder).
        source_is_setting: ``--data.source null`` leaves the class nothing to prepare (a class
            that sets its own ``source``, like a records renderer, ignores a null).
        theirs: The folder's own sources where they differ from ``source``
            (:func:`other_sources`): the replacement is then worded as replacing that data.
    """
    where = f"data.dataset_dir {dataset_dir}"
    if not holds_dataset:
        return (
            f"{where} holds files that are not a dataset; {verb} prepares data.source only "
            "into a new or empty folder: choose another --data.dataset_dir"
        )
    use = "train on" if verb == "fit" else "use"
    keep = f"{use} it as it is with --data.source null, " if source_is_setting else ""
    if theirs:  # not the same text edited since: the replacement deletes another dataset
        prepared, asked = ", ".join(theirs), ", ".join(source)
        setting = "data.source" if source_is_setting else "the data class's source"
        return (
            f"{where} already holds a dataset prepared from {prepared}, not from {setting} "
            f"{asked}, and {verb} never overwrites one: {keep}choose another "
            f"--data.dataset_dir for it, or delete the dataset of {prepared} in "
            f"{dataset_dir} and prepare {asked} there: `{prepare}`"
        )
    return (
        f"{where} already holds a dataset prepared from other sources or settings than "
        f"data.source/data.tokenizer (or its source files changed since: sizes or times), "
        f"and {verb} never overwrites one: {keep}choose another --data.dataset_dir, or replace "
        f"it with `{prepare}`"
    )
