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
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """argparse without the usage block on errors: one ``error:`` line, exit code 2; an
    unknown option gets the nearest one the verb takes (``--max_new_tokens``: did you mean
    ``--max-new-tokens``?)."""

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        """argparse's own, but arguments left over are said by the sub-command that was given
        (``queue ls``), so its line names that sub-command and the hint draws only from its
        options: argparse says them from the top parser, which knows every sub-command's."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            chosen_parser(self, parsed).error(f"{_UNRECOGNIZED}{' '.join(extras)}")
        return parsed

    def error(self, message: str) -> NoReturn:
        hint = unknown_option_hint(message, option_strings(self))
        if hint:
            self.exit(2, f"{self.prog}: error: {message}; {hint}\n")
        if "; did you mean " in message:  # the caller named the option meant: the line ends there
            self.exit(2, f"{self.prog}: error: {message}\n")
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


#: argparse's message for options it does not know (``parse_args``), the words after it.
_UNRECOGNIZED = "unrecognized arguments: "


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """The long options ``parser`` itself takes; never a sub-command's (``queue add``'s
    ``--seeds`` is no hint for ``queue ls``): a sub-command's own parser says its errors
    (:meth:`OneLineParser.parse_args`)."""
    return [s for action in parser._actions for s in action.option_strings if s.startswith("--")]


def chosen_parser(
    parser: argparse.ArgumentParser, parsed: argparse.Namespace
) -> argparse.ArgumentParser:
    """The parser of the innermost sub-command ``parsed`` chose (``queue ls``: ls's own), or
    ``parser`` itself when it has none (or the choice is not recorded: ``dest`` unset)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and action.dest != argparse.SUPPRESS:
            sub = action.choices.get(getattr(parsed, action.dest, None))
            if sub is not None:
                return chosen_parser(sub, parsed)
    return parser


def near_options(name: str, options: Iterable[str]) -> list[str]:
    """The options nearest ``name`` (a mistyped option's name), nearest first: at most three,
    each close enough to be the one meant (``ckpt_pth``: ``ckpt_path``). The one closeness rule
    of every verb's "did you mean"."""
    return difflib.get_close_matches(name, sorted(set(options)), n=3, cutoff=0.7)


def nearest_option(given: str, options: list[str]) -> str | None:
    """The option of ``options`` that ``given`` (``--max_new_tokens``, ``--bpe_vocab_size=300``)
    most likely meant: the same words with ``_`` and ``-`` swapped (the spelling fit's dotted
    settings use), else the closest by :mod:`difflib`; None when none is close."""
    word = given.split("=", 1)[0]
    if not word.startswith("--") or word in options:
        return None
    for swapped in ("--" + word[2:].replace("_", "-"), "--" + word[2:].replace("-", "_")):
        if swapped in options:
            return swapped
    near = near_options("--" + word[2:].replace("_", "-"), options)
    return near[0] if near else None


def unknown_option_hint(message: str, options: list[str]) -> str | None:
    """``did you mean --max-new-tokens?`` for argparse's ``unrecognized arguments: ...``
    message, naming the nearest option for each unknown one that has one (None: no hint)."""
    if not message.startswith(_UNRECOGNIZED):
        return None
    pairs = [(word, near) for word in message[len(_UNRECOGNIZED) :].split()
             if (near := nearest_option(word, options))]  # fmt: skip
    if not pairs:
        return None
    if len(pairs) == 1:
        return f"did you mean {pairs[0][1]}?"
    return "did you mean " + ", ".join(f"{near} (for {word})" for word, near in pairs) + "?"


def given_path(text: str) -> Path:
    """An argparse ``type`` for a path the user must spell: an empty value (an unset shell
    variable, ``report "$RUNS"``) is refused, where ``Path("")`` would quietly be the current
    folder."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            f"{text!r} is an empty path (or only blanks); give a folder or a file"
        )
    return Path(text)


def working_directory_gone() -> str | None:
    """Why this process has no working directory (a shell still ``cd``-ed into a folder that
    was deleted since), or None where it has one.

    Every verb reads it: relative paths, the default queue database, the folders ``report`` and
    ``status`` look in by default, and torch's import (which ends in a native fatal error
    without it). So it is checked once, before any verb is imported, and said in one line
    (exit 2); ``status`` and ``report``, which import no torch, check only the paths they read
    (:func:`relative_path_without_working_directory`)."""
    try:
        os.getcwd()
    except FileNotFoundError:
        return "the working directory no longer exists: cd to an existing folder"
    except OSError as err:
        return f"the working directory cannot be read ({err.strerror}): cd to another folder"
    return None


def relative_path_without_working_directory(paths: Iterable[Path]) -> str | None:
    """Why ``paths`` cannot be found (a relative one among them, in a working directory that
    was deleted since), or None: a verb that reads only paths given in full (``status
    /abs/runs``) works from anywhere, even a folder removed under its shell."""
    if all(Path(p).is_absolute() for p in paths):
        return None
    return working_directory_gone()


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
