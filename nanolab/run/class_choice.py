"""A model or data class chosen by class path keeps its own defaults; the settings given carry over.

``model:`` and ``data:`` start as nanolab's own classes. jsonargparse, asked to change a class
(``model: {class_path: mylab.small.SmallGPT}``, ``--data mylab.rdata.Records``), carries every
value the group held to the new class, and before anything is given the group holds nanolab's
defaults: a fork class whose ``__init__`` says ``compile=True`` or a 2-layer ``gpt`` would train
nanolab's ``compile: false`` and 6 x 384 model without a word. After the parse, a chosen class's
settings are rebuilt here from its own defaults (:func:`nanolab.training.plugins.class_defaults`,
which ``estimate`` reads too) with the values of the settings the config files and the command
line GAVE on top. A given setting the chosen class does not take (the quickstart's ``model.gpt``
for a plain LightningModule) is left out by the parser; :func:`dropped_line` says so in one line.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from nanolab.run import keys
from nanolab.training.plugins import DEFAULT_DATA, DEFAULT_MODEL, class_defaults

#: Each class group's default class, the one the parser starts from.
DEFAULT_CLASSES = {"model": DEFAULT_MODEL, "data": DEFAULT_DATA}
#: Keys of a class group that choose the class rather than set one of its arguments.
CLASS_KEYS = ("class_path", "init_args", "dict_kwargs")


def given_settings(args: Sequence[str], group: str) -> dict[str, str]:
    """``{setting: where}`` for every argument of ``group``'s class that ``args`` give, dotted
    below ``init_args`` (``gpt.n_layer``), in the order given: the keys of each ``--config``
    file and of a ``--model '{...}'`` value, and each ``--model.KEY`` flag."""
    found: dict[str, str] = {}
    for i, arg in enumerate(args):
        flag, sep, value = arg.partition("=")
        if not sep and i + 1 < len(args):
            value = args[i + 1]
        if flag == "--config" and (sep or i + 1 < len(args)):
            for data in keys.read_config_files(["--config", value], ()):
                node = data.get(group)
                found.update(dict.fromkeys(_node_settings(node), f"config file {value}"))
        elif flag == f"--{group}" and (sep or i + 1 < len(args)):
            found.update(dict.fromkeys(_node_settings(_flag_node(value)), f"--{group}"))
        elif flag.startswith(f"--{group}."):
            key = flag[len(group) + 3 :].removesuffix("+")
            key = key.removeprefix("init_args.")
            if key.split(".", 1)[0] not in CLASS_KEYS and key != "help":
                found.setdefault(key, flag)
    return found


def _flag_node(value: str) -> Any:
    """What ``--model VALUE`` gives: a class path (no settings), a YAML/JSON mapping, or the
    mapping in a file it names."""
    import yaml

    path = Path(value)
    if value.endswith((".yaml", ".yml", ".json")) and path.is_file():
        data = keys.read_config_files(["--config", value], ())
        return data[0] if data else None
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError:
        return None


def _node_settings(node: Any) -> Iterator[str]:
    """The dotted arguments one group's value sets: its ``init_args`` and the keys written
    beside ``class_path`` (the parser takes both)."""
    if not isinstance(node, Mapping):
        return
    yield from _leaves({k: v for k, v in node.items() if k not in CLASS_KEYS})
    if isinstance(node.get("init_args"), Mapping):
        yield from _leaves(node["init_args"])


def _leaves(data: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    for key, value in data.items():
        if isinstance(value, Mapping) and value and "class_path" not in value:
            yield from _leaves(value, f"{prefix}{key}.")
        elif not (isinstance(value, Mapping) and not value):  # ``gpt: {}`` sets nothing
            yield f"{prefix}{key}"


def settle_chosen_classes(cfg: Any, args: Sequence[str]) -> dict[str, list[tuple[str, str]]]:
    """Give every class group whose chosen class is not nanolab's its class's own defaults with
    the settings ``args`` gave on top (``cfg``: the verb's parsed config, changed in place).

    Returns ``{group: [(setting, where), ...]}``: the given settings its class does not take
    (the parser left them out). A group of nanolab's own class is left as the parser made it."""
    from jsonargparse import Namespace

    dropped: dict[str, list[tuple[str, str]]] = {}
    for group, default in DEFAULT_CLASSES.items():
        spec = cfg.get(group)
        class_path = spec.get("class_path") if isinstance(spec, Namespace) else None
        if not isinstance(class_path, str) or class_path == default:
            continue
        parsed = spec.get("init_args") or Namespace()
        settled = class_defaults(class_path, group)
        for setting, where in given_settings(args, group).items():
            key = _parsed_key(parsed, setting)
            if key is None:
                dropped.setdefault(group, []).append((setting, where))
            else:
                settled[key] = copy.deepcopy(parsed[key])
        spec["init_args"] = settled
    return dropped


def _parsed_key(parsed: Any, setting: str) -> str | None:
    """The key of ``parsed`` that holds the given ``setting``: the setting itself, or the
    argument it lies inside (a dict, a list, a class spec), or None when the class dropped it."""
    from jsonargparse import Namespace

    parts = setting.split(".")
    for n in range(1, len(parts) + 1):
        key = ".".join(parts[:n])
        if key not in parsed:
            return None
        value = parsed[key]
        if not isinstance(value, Namespace) or "class_path" in value or n == len(parts):
            return key
    return None  # pragma: no cover (the loop returns at its last part)


def dropped_line(dropped: Mapping[str, list[tuple[str, str]]], cfg: Any) -> str | None:
    """One line naming the given settings the chosen classes do not take, where each was
    given, and the settings each class does take; None when none was dropped."""
    if not dropped:
        return None
    parts = []
    for group, settings in dropped.items():
        by_where: dict[str, list[str]] = {}
        for setting, where in settings:
            top = f"{group}.{setting.split('.', 1)[0]}"
            if top not in by_where.setdefault(where, []):
                by_where[where].append(top)
        names = [name for found in by_where.values() for name in found]
        wheres = ", ".join(by_where)
        spec = cfg[group]
        takes = ", ".join(vars(spec.get("init_args") or {})) or "no settings"
        parts.append(
            f"{', '.join(names)} (given in {wheres}) {'is' if len(names) == 1 else 'are'} left "
            f"out of this run: {spec['class_path']} does not take "
            f"{'it' if len(names) == 1 else 'them'} (it takes {takes})"
        )
    return "; ".join(parts)
