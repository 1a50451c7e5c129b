"""The user's home folder, where there is one.

A batch job or a container may run as a user id without a passwd entry and without ``HOME``
(``docker run --user 54321``, some schedulers): Python's ``Path.home()`` and ``Path.expanduser()``
then raise ``RuntimeError("Could not determine home directory.")``. nanolab's only own use of the
home folder is a cache, which is optional: no home, no cache. A path the user wrote with ``~``
cannot mean anything there, so it is one line saying so and asking for the full path.
"""

from __future__ import annotations

import os
from pathlib import Path

from nanolab.errors import NanolabError


def home_folder() -> Path | None:
    """This user's home folder (``HOME``, else the passwd entry), or None where it has none."""
    try:
        return Path.home()
    except (RuntimeError, KeyError):  # HOME unset and no passwd entry for this user id
        return None


def expand_user(
    path: str | os.PathLike[str], *, field: str | None = None, keep_unknown: bool = False
) -> Path:
    """``path`` with a leading ``~`` (or ``~name``) expanded, as ``Path.expanduser`` does; where
    that home cannot be found, a :class:`~nanolab.errors.NanolabError` naming the path and
    ``field`` (the setting that gave it), or, with ``keep_unknown`` (a check that only looks),
    the path as written."""
    text = os.fspath(path)
    if keep_unknown:
        return Path(os.path.expanduser(text))  # unchanged where the home is unknown
    return Path(expanded_text(text, field=field))


def expanded_text(text: str, *, field: str | None = None) -> str:
    """``text`` with a leading ``~`` (or ``~name``) expanded (a glob pattern keeps its form, which
    a ``Path`` would normalise); a :class:`~nanolab.errors.NanolabError` naming it where that home
    cannot be found, where ``Path.expanduser`` raises a RuntimeError."""
    expanded = os.path.expanduser(text)
    if not expanded.startswith("~"):
        return expanded
    name = text[1:].split("/", 1)[0].split(os.sep, 1)[0]
    if name:  # ~name: a user this system does not know
        raise NanolabError(
            f"{text} starts with '~{name}', and there is no user {name!r} here to read it as",
            field=field,
            fix="write the full path instead",
        )
    user = f"user id {os.getuid()}" if hasattr(os, "getuid") else "this user"
    raise NanolabError(
        f"{text} starts with '~', and there is no home folder to read it as (HOME is unset and "
        f"{user} has no passwd entry)",
        field=field,
        fix="write the full path instead, or set HOME",
    )
