"""A group of settings given one plain value (``--progress plain``, ``--checkpoint 5``,
``--model GPT``), said as the setting meant.

On the command line a group (``--progress``, ``--model.optimizer``) takes all its settings at
once, a mapping or a YAML file of them, and ``--model``/``--data`` take a class path besides.
Given one plain value, the parser answers "Unable to load config '5'" or "Expected a path but
GPT either not accessible or invalid", twice over, naming no setting. The value is almost always
meant for one setting of the group: the settings whose type takes it (a choice it is, before a
number it reads as, before any text) are named with the value, ready to type.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from nanolab.helpfmt import either
from nanolab.home import expand_user
from nanolab.run.keys import CLASS_GROUPS
from nanolab.training.plugins import DEFAULT_DATA, DEFAULT_MODEL

#: The most settings a hint names; when more take the value equally well, it gives the form.
MOST_NAMED = 3
#: How plainly a type takes a value, best first: one of its choices, a number or a boolean it
#: reads as, a float an integer widens to, any text.
CHOICE, EXACT, WIDENED, TEXT = range(4)
_TRUE_FALSE = {"true", "false", "yes", "no", "on", "off"}
_NULLS = {"null", "none", "~"}


def group_value_problem(
    argv: list[str], known: frozenset[str], error: str, settings: Mapping[str, Any] | None
) -> str | None:
    """The one line for the first ``--GROUP VALUE`` of ``argv`` that the parser's ``error``
    is about (``Parser key "GROUP"``), or None. ``known``: the parser's keys; ``settings``:
    each setting's remembered type (:mod:`nanolab.run.schema`; None: names without types)."""
    for group, value in _group_values(argv, known):
        if f'Parser key "{group}"' not in error or not _plain(value, group):
            continue
        return _line(group, value, known, settings or {})
    return None


def _group_values(argv: list[str], known: frozenset[str]) -> Iterator[tuple[str, str]]:
    """``(group, value)`` for each ``--GROUP VALUE`` and ``--GROUP=VALUE`` of ``argv``."""
    for i, arg in enumerate(argv):
        if not arg.startswith("--"):
            continue
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                continue
            value = argv[i + 1]
        if name not in known and any(k.startswith(name + ".") for k in known):
            yield name, value


def _plain(value: str, group: str) -> bool:
    """One value, not what a group takes: a mapping or a list (YAML/JSON), a file of settings,
    or (for ``model``/``data``) a dotted class path."""
    text = value.strip()
    if text[:1] in ("{", "[") or expand_user(text, keep_unknown=True).exists():
        return False
    return not (group in CLASS_GROUPS and re.fullmatch(r"[\w]+(\.[\w]+)+", text))


def _line(group: str, value: str, known: frozenset[str], settings: Mapping[str, Any]) -> str:
    key, eq, rest = value.partition("=")  # --progress mode=plain: a setting's name is in it
    if eq and f"{group}.{key}" in known:
        return (
            f"--{group} is a group of settings, not a value; did you mean --{group}.{key} {rest}?"
        )
    meant = settings_taking(value, [k for k in known if k.startswith(group + ".")], settings)
    if group in CLASS_GROUPS:
        default = DEFAULT_MODEL if group == "model" else DEFAULT_DATA
        head = (
            f"--{group} takes a class path (module.Class; the default: {default}) or a mapping "
            f"of its settings, not {value!r}"
        )
    else:
        head = f"--{group} is a group of settings, not a value"
    if meant and len(meant) <= MOST_NAMED:
        return f"{head}; did you mean {either(f'--{k} {value}' for k in meant)}?"
    return f"{head}; a setting of it is --{group}.KEY VALUE (nanolab fit --help-all lists them)"


def settings_taking(value: str, keys: list[str], settings: Mapping[str, Any]) -> list[str]:
    """Those of ``keys`` whose type takes ``value`` most plainly (sorted): the settings a
    value given to their group is meant for. Keys of an unknown type are left out."""
    ranked: dict[int, list[str]] = {}
    for key in keys:
        rank = _rank(settings.get(key, {}).get("type"), value)
        if rank is not None:
            ranked.setdefault(rank, []).append(key)
    return sorted(ranked[min(ranked)]) if ranked else []


def _rank(desc: Any, value: str) -> int | None:
    """How plainly a remembered type (``"int"``, ``["Literal", [...]]``, ``["Union", [...]]``)
    takes the command line's ``value``; None: not at all, or a type not known here."""
    if isinstance(desc, list) and len(desc) == 2 and desc[0] == "Literal":
        return CHOICE if value in map(str, desc[1]) else None
    if isinstance(desc, list) and len(desc) == 2 and desc[0] == "Union":
        ranks = [r for member in desc[1] if (r := _rank(member, value)) is not None]
        return min(ranks) if ranks else None
    if desc == "None":
        return EXACT if value.lower() in _NULLS else None
    if desc == "bool":
        return EXACT if value.lower() in _TRUE_FALSE else None
    if desc == "int":
        return EXACT if re.fullmatch(r"[+-]?\d+", value) else None
    if desc == "float":
        return _float_rank(value)
    return TEXT if desc == "str" else None


def _float_rank(value: str) -> int | None:
    try:
        float(value)
    except ValueError:
        return None
    return WIDENED if re.fullmatch(r"[+-]?\d+", value) else EXACT
