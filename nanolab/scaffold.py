"""``nanolab init DIR``: write a starter project folder for your own model and data.

The starter is an installable Python package around nanolab's quickstart recipe, pointed at the
user's own text::

    DIR/
      pyproject.toml          `pip install -e .` makes the package importable (no PYTHONPATH)
      src/PKG/model.py        Model (a GPTLightningModule) and the model variants the user adds
      src/PKG/data.py         Data (a TokenDataModule) and the dataset classes the user adds
      src/PKG/callbacks.py    an example Lightning callback, ready to enable
      configs/experiment.yaml the quickstart recipe; model and data chosen by class path
      README.md               install, train, change the attention, add a dataset, resume, queue
      data/README.md          what goes in data/text/ and what `nanolab prepare` makes of it
      data/text/              (empty) the user's text files
      .gitignore              runs/, prepared tokens and windows, the queue database: out of git

The README's walk-through is run, as written, by tests/test_fork_story.py. The files live in
``nanolab/templates/init/`` (package data, so ``init`` works from an installed wheel without the
repository's ``configs/``). ``{{name}}`` in them becomes the project name and ``{{package}}`` the
package's (the name made a Python identifier); a path component ``PACKAGE`` becomes the package's
name, and ``dot-X`` becomes ``.X`` because packaging globs skip dot-files.

``init`` never overwrites: it checks every target first and writes nothing if any exists.
"""

from __future__ import annotations

import importlib.util
import keyword
import os
import re
import shlex
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from nanolab.errors import (
    NanolabError,
    one_line_errors,
    storage_message,
    storage_refused,
    with_errno_of,
)
from nanolab.helpfmt import OneLineParser
from nanolab.runlog import refuse_inside_run

if TYPE_CHECKING:  # importlib.resources.abc is 3.11+; only annotations need it
    from importlib.resources.abc import Traversable

TEMPLATE = "init"
NAME_PLACEHOLDER = "{{name}}"
PACKAGE_PLACEHOLDER = "{{package}}"
#: The path component that becomes the package's name (``src/PACKAGE/model.py``).
PACKAGE_DIR = "PACKAGE"
# Run names become directory names and YAML values: keep them to portable characters.
VALID_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
EMPTY_DIRS = ("data/text",)


class ScaffoldError(NanolabError):
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


def package_name(name: str) -> str:
    """The project's Python package: the run name as an identifier (``tiny-poems`` ->
    ``tiny_poems``; ``2024`` and a keyword such as ``class``, which ``import`` cannot take,
    become ``project_2024``, ``project_class``), refused when it would shadow a module Python
    already finds (``nanolab``, ``json``, an installed library): the configs import the
    project's classes by that name."""
    package = re.sub(r"\W+", "_", name).strip("_").lower()
    if not package or package[0].isdigit() or keyword.iskeyword(package):
        package = f"project_{package}".rstrip("_")
    if package in sys.stdlib_module_names or _importable(package):
        raise ScaffoldError(
            f"the project's package would be named {package!r} (from the name {name!r}), which "
            f"is already an importable module; choose another --name"
        )
    return package


def _importable(module: str) -> bool:
    """A regular module or package Python already finds. A plain folder of that name on the
    path (a namespace package, e.g. the project folder itself) does not count: an installed
    package takes precedence over it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin is not None


def render(files: dict[str, str], name: str, package: str) -> dict[str, str]:
    """The starter's files for project ``name``, its placeholders and paths filled in."""
    out = {}

    def fill(text: str) -> str:
        return text.replace(NAME_PLACEHOLDER, name).replace(PACKAGE_PLACEHOLDER, package)

    for path, text in files.items():
        parts = [package if part == PACKAGE_DIR else part for part in path.split("/")]
        lines = []
        for line in text.splitlines(keepends=True):
            m = re.match(r"^(.*?\S)(\s{2,})(#.*\n?)$", line)
            if m and (NAME_PLACEHOLDER in m.group(1) or PACKAGE_PLACEHOLDER in m.group(1)):
                # a filled-in value moves its line's comment: keep it in the file's column
                code, column = fill(m.group(1)), len(m.group(1)) + len(m.group(2))
                lines.append(code + " " * max(2, column - len(code)) + fill(m.group(3)))
            else:
                lines.append(fill(line))
        out["/".join(parts)] = "".join(lines)
    return out


def write_project(directory: str | Path, name: str | None = None) -> list[Path]:
    """Write the starter into ``directory``; return the files written.

    Raises :class:`ScaffoldError`, having written nothing, when ``directory`` is a file or any
    target already exists.
    """
    if not str(directory):  # Path("") is the current folder: the starter would land in it
        raise ScaffoldError(
            "the project folder is empty (''); give a folder to create, e.g. nanolab init my-lab"
        )
    root = Path(directory)
    if root.exists() and not root.is_dir():
        raise ScaffoldError(f"{root} exists and is not a folder")
    run_name = project_name(root, name)
    files = render(template_files(), run_name, package_name(run_name))
    targets = {root / rel: text for rel, text in files.items()}

    blocked = [str(p) for p in targets if p.exists() or p.is_symlink()]
    # A file standing where a folder must go (e.g. DIR/configs is a file).
    folders = {p for path in targets for p in path.parents} | {root / r for r in EMPTY_DIRS}
    blocked += [str(p) for p in folders if p.exists() and not p.is_dir()]
    if blocked:
        listed = sorted(set(blocked))
        verb = "exists" if len(listed) == 1 else "exist"
        raise ScaffoldError(
            f"{', '.join(listed)} already {verb}; nothing was written "
            "(choose a new folder, or move those files away)"
        )

    # Where each file really lands: a link inside the folder (DIR/data -> runs/x) must not
    # carry the project's files into a run's folder.
    for path in [*targets, *(root / rel for rel in EMPTY_DIRS)]:
        refuse_inside_run(os.path.realpath(path), "init: the project's", ScaffoldError)

    written: list[Path] = []
    try:
        for path, text in targets.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                with open(path, "x", encoding="utf-8") as f:  # "x": never replace, even in a race
                    written.append(path)  # ours from here: a write cut short is removed too
                    f.write(text)
            except OSError as err:
                # write() names no file, nor does the close that writes a small file's
                # buffered text (where a full disk or a size limit stops it)
                err.filename = err.filename or str(path)
                raise
    except OSError as err:
        # said before the files go: their removal frees the room the line reports as left
        said = storage_message(err) if storage_refused(err) else f"cannot write {root}: {err}"
        for path in written:
            path.unlink(missing_ok=True)
        raise with_errno_of(ScaffoldError(f"{said}; no file was left in {root}"), err) from None
    for rel in EMPTY_DIRS:
        (root / rel).mkdir(parents=True, exist_ok=True)
    return written


@one_line_errors("nanolab init")
def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(
        prog="nanolab init",
        description="Write a starter project: an installable package with the project's model, "
        "data and callback classes, a config that selects them, a data folder, and a README "
        "that walks through training, changing the attention and adding a dataset.",
    )
    parser.add_argument(
        "directory", help="project folder to create (may exist if it holds none of the files)"
    )
    parser.add_argument(
        "--name",
        help="the project's name, its run name as it is (default: the folder's name); its "
        "package and pyproject name are the name as a Python identifier (my-lm: src/my_lm/, "
        "my_lm.model.Model)",
    )
    args = parser.parse_args(argv)
    refuse_inside_run(args.directory, "init", ScaffoldError)
    written = write_project(args.directory, args.name)
    root = Path(args.directory)
    for path in written:
        print(f"wrote {path}")
    print(
        f"\nnext:\n  cd {shlex.quote(str(root))}\n  pip install -e .\n  # put your .txt files in data/text/, then\n"
        "  nanolab prepare data/text -o data/tokens --tokenizer bpe --bpe-vocab-size 4096\n"
        "  nanolab fit --config configs/experiment.yaml"
    )
    return 0
