"""The merged config of a ``nanolab fit`` command line, read as the fit parser reads it, without
importing Lightning whenever the parser's remembered schema can say.

``queue add`` reads every job of a sweep here: :mod:`nanolab.run.schema` answers in
milliseconds from what an earlier parse of this code remembered, and whatever it cannot say
(no schema yet, a value its types refuse, a class of one's own) goes to the parser itself
(:func:`nanolab.run.parse.parse_fit_config`, seconds: Lightning is imported), which then
remembers the schema for the next launch.
"""

from __future__ import annotations

from typing import Any

from nanolab.run import keys, schema
from nanolab.run.schema import FitParseError  # noqa: F401  (public here too)


def fit_config(args: list[str]) -> dict[str, Any]:
    """The merged config ``nanolab fit ARGS`` would run, as plain data (every default filled
    in, ``config`` the list of ``--config`` files). Nothing is built and this process's RNG is
    not touched. Raises :class:`FitParseError` with the parser's one error line.
    """
    from nanolab.training.resolve import plain_config

    remembered = schema.load("fit")
    known = keys.known_keys("fit")
    if remembered is not None and known is not None:
        try:
            return remembered.read(args, known)
        except schema.AskTheParser:
            pass
    from nanolab.run import parse

    config = plain_config(parse.parse_fit_config(args))
    config["config"] = keys.config_file_paths(args)
    if remembered is None and schema.load("fit") is None:  # remembered with the keys, else now
        parse.remember_schema("fit")
    return config
