"""argparse as nanolab's own verbs use it: one error line, and help that shows defaults.

:class:`OneLineParser`: bad input to a verb (``report``, ``queue``, ``prepare``, ``estimate``,
``generate``, ``export``, ``init``) is one ``error:`` line naming the option and exit code 2, not
argparse's usage block first. Sub-commands (``queue ls``) inherit it.

:class:`DefaultsHelpFormatter`: help pages that show each option's default beside what it means
(``prepare``, ``generate``). argparse's own ``ArgumentDefaultsHelpFormatter`` also prints
``(default: None)`` and ``(default: False)`` for options that have no default and for on/off
flags; this one leaves those out, and options whose help already names their default.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Iterable
from pathlib import Path
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """argparse without the usage block on errors: one ``error:`` line, exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


def given_path(text: str) -> Path:
    """An argparse ``type`` for a path the user must spell: an empty value (an unset shell
    variable, ``report "$RUNS"``) is refused, where ``Path("")`` would quietly be the current
    folder."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            f"{text!r} is an empty path (or only blanks); give a folder or a file"
        )
    return Path(text)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to every option's help that has a real default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or default is None
            or default is argparse.SUPPRESS
            or isinstance(default, bool)
            or "default" in text
        ):
            return text
        return f"{text} (default: %(default)s)"


def suggestion(key: str, known: frozenset[str]) -> str | None:
    """The nearest known key: a sibling in the same group first (a looser match: the group is
    right), then any key."""
    parent, _, leaf = key.rpartition(".")
    siblings = {k.rpartition(".")[2]: k for k in known if k.rpartition(".")[0] == parent}
    near = difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.4)
    if near:
        return siblings[near[0]]
    near = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return near[0] if near else None


def either(items: Iterable[str]) -> str:
    """Choices as a hint names them: ``a``, ``a or b``, ``a, b or c``."""
    names = list(items)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
