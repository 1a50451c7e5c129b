"""``nanolab init DIR``: write a starter project folder for your own model and data.

The starter is nanolab's quickstart recipe pointed at the user's own text, plus what a new
project needs around it::

    DIR/
      README.md               the two commands: prepare the text, train
      configs/experiment.yaml the quickstart config, commented, reading data/text/
      data/README.md          what goes in data/text/ and what `nanolab prepare` makes of it
      data/text/              (empty) the user's text files
      callbacks.py            an example Lightning callback, ready to enable
      .gitignore              runs/ and prepared tokens stay out of git

The files live in ``nanolab/templates/init/`` (package data, so ``init`` works from an installed
wheel without the repository's ``configs/``). ``{{name}}`` in them becomes the project name; a
path component ``dot-X`` becomes ``.X`` because packaging globs skip dot-files.

``init`` never overwrites: it checks every target first and writes nothing if any exists.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importlib.resources.abc is 3.11+; only annotations need it
    from importlib.resources.abc import Traversable

TEMPLATE = "init"
NAME_PLACEHOLDER = "{{name}}"
# Run names become directory names and YAML values: keep them to portable characters.
VALID_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
EMPTY_DIRS = ("data/text",)


class ScaffoldError(ValueError):
    """A project folder that cannot be written as asked; nothing has been written."""


def _walk(node: Traversable, prefix: str = "") -> list[tuple[str, Traversable]]:
    out: list[tuple[str, Traversable]] = []
    for child in sorted(node.iterdir(), key=lambda c: c.name):
        if child.name == "__pycache__":
            continue
        rel = f"{prefix}{child.name}"
        if child.is_dir():
            out.extend(_walk(child, rel + "/"))
        else:
            out.append((rel, child))
    return out


def template_files() -> dict[str, str]:
    """Target path (relative, POSIX) -> template text, for every file of the starter."""
    root = resources.files("nanolab").joinpath("templates", TEMPLATE)
    files = {}
    for rel, node in _walk(root):
        target = "/".join(
            "." + part[len("dot-") :] if part.startswith("dot-") else part
            for part in rel.split("/")
        )
        files[target] = node.read_text(encoding="utf-8")
    if not files:
        raise ScaffoldError(f"nanolab's starter templates are missing ({root}); reinstall nanolab")
    return files


def project_name(directory: Path, name: str | None) -> str:
    """The run name: ``name`` if given, else the folder's name made portable."""
    if name is not None:
        if not VALID_NAME.fullmatch(name):
            raise ScaffoldError(
                f"--name {name!r} must start with a letter or digit and use only letters, "
                "digits, '.', '_' and '-' (it becomes a directory name)"
            )
        return name
    base = directory.resolve().name
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", base).strip("-._")
    return cleaned or "experiment"


def render(files: dict[str, str], name: str) -> dict[str, str]:
    return {path: text.replace(NAME_PLACEHOLDER, name) for path, text in files.items()}


def write_project(directory: str | Path, name: str | None = None) -> list[Path]:
    """Write the starter into ``directory``; return the files written.

    Raises :class:`ScaffoldError`, having written nothing, when ``directory`` is a file or any
    target already exists.
    """
    root = Path(directory)
    if root.exists() and not root.is_dir():
        raise ScaffoldError(f"{root} exists and is not a folder")
    files = render(template_files(), project_name(root, name))
    targets = {root / rel: text for rel, text in files.items()}

    blocked = [str(p) for p in targets if p.exists() or p.is_symlink()]
    for rel in EMPTY_DIRS:
        path = root / rel
        if path.exists() and not path.is_dir():
            blocked.append(str(path))
    for path in targets:
        # A file standing where a folder must go (e.g. DIR/configs is a file).
        blocked.extend(str(p) for p in path.parents if p.exists() and not p.is_dir())
    if blocked:
        listed = sorted(set(blocked))
        verb = "exists" if len(listed) == 1 else "exist"
        raise ScaffoldError(
            f"{', '.join(listed)} already {verb}; nothing was written "
            "(choose a new folder, or move those files away)"
        )

    written: list[Path] = []
    try:
        for path, text in targets.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "x", encoding="utf-8") as f:  # "x": never replace, even in a race
                f.write(text)
            written.append(path)
    except OSError as err:
        for path in written:
            path.unlink(missing_ok=True)
        raise ScaffoldError(f"cannot write {root}: {err}") from None
    for rel in EMPTY_DIRS:
        (root / rel).mkdir(parents=True, exist_ok=True)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="nanolab init",
        description="Write a starter project folder: a commented config reading your own text, "
        "a data folder, an example callback and a README with the commands to run.",
    )
    parser.add_argument(
        "directory", help="project folder to create (may exist if it holds none of the files)"
    )
    parser.add_argument("--name", help="run name used in the config (default: the folder's name)")
    args = parser.parse_args(argv)
    try:
        written = write_project(args.directory, args.name)
    except ScaffoldError as err:
        print(f"nanolab init: error: {err}", file=sys.stderr)
        return 2
    root = Path(args.directory)
    for path in written:
        print(f"wrote {path}")
    print(
        f"\nnext:\n  cd {root}\n  # put your .txt files in data/text/, then\n"
        "  nanolab prepare data/text -o data/tokens --tokenizer bpe --bpe-vocab-size 4096\n"
        "  nanolab fit --config configs/experiment.yaml"
    )
    return 0
