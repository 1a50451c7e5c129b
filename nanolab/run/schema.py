"""``nanolab fit``'s parser remembered: each setting's type and default, so that a config is
read as the parser reads it without importing Lightning.

The fit parser (LightningCLI) exists only after Lightning is imported, seconds into a launch, yet
what it makes of a config depends on nothing but the types and defaults of its settings, the same
at every launch of the same code. So the parse that remembers the parser's keys
(:mod:`nanolab.run.keys`, keyed alike: nanolab's files, Lightning, jsonargparse, torch, Python)
also remembers, for every setting, its type (``int``, ``float | None``, ``Literal[...]``,
``list[str]``, ...) and default, and the parser's defaults as a whole. :meth:`Schema.read` then
reads a command line the parser's way in milliseconds:

1. every ``--config`` file is read first, and an unknown key is refused with the nearest known
   one (the parser's own first two steps: the same one-line errors);
2. :func:`nanolab.training.resolve.compose`, the one reader of configs, merges the files and the
   overrides onto the parser's defaults, each value typed on the way by jsonargparse itself
   (the library the parser is made of) against the setting's remembered type: ``2`` for an
   ``int``, ``1.0`` for a ``float`` given ``1``, the string ``"2"`` for ``trainer.devices`` on
   the command line, exactly as the parser would have it;
3. the parser's links (``run.fresh`` -> ``log.fresh``) are applied.

Whatever the remembered types cannot say is left to the parser itself
(:func:`nanolab.run.read.fit_config` then calls :func:`nanolab.run.parse.parse_fit_config`,
which remembers the schema if it was missing): a value a type refuses (the parser words the
error), a class of one's own (``model: {class_path: ...}``, ``trainer.callbacks``), a setting
whose type tries a Lightning class first (``trainer.logger``, ``trainer.profiler``; a plain
string for ``trainer.accelerator`` or ``strategy`` is read here), a list append (``+=``),
``ckpt_path``. ``tests/test_queue_add_fast.py`` holds the reading against the parser's for
every shipped config, overlay and a list of overrides chosen for the parser's quirks.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from nanolab.errors import RunConfigError
from nanolab.run import keys

#: Bumped when the file's layout changes (an older file is then read as missing).
VERSION = 1
#: A type the schema does not rebuild (a Lightning class, ``timedelta``, ``Path``).
OPAQUE = "?"
NULL_WORDS = ("null", "Null", "NULL", "~")


class FitParseError(RunConfigError):
    """``fit``'s parser refused a command line; the message is its one error line."""


class AskTheParser(Exception):
    """The remembered schema cannot say what the parser makes of this command line."""


# -- the command line the parser reads -----------------------------------------------------------
def nulls_as_class_settings(argv: list[str]) -> list[str]:
    """``--model.gpt.vocab_size null`` rewritten as ``--model '{"init_args": {...: null}}'``.

    With ``model``/``data`` as class choices, jsonargparse (4.53) hands a nested ``null`` to the
    class's parser as the string ``"None"``, so every ``Optional`` setting refused ``null`` on the
    command line. The same setting given as an ``init_args`` dict merges into the chosen class
    and keeps everything given before and after it.
    """
    out: list[str] = []
    i = 0
    for start, width, key in class_nulls(argv):
        out += argv[i:start]
        group, *path = key.split(".")
        if path and path[0] == "init_args":
            path = path[1:]
        nested: object = None
        for part in reversed(path):
            nested = {part: nested}
        out += [f"--{group}", json.dumps({"init_args": nested})]
        i = start + width
    return out + argv[i:]


def class_nulls(argv: list[str]) -> Iterator[tuple[int, int, str]]:
    """``(index, tokens, key)`` of each ``--model.X`` / ``--data.X`` given ``null`` (one token
    ``--key=null`` or two), as :func:`nulls_as_class_settings` rewrites them."""
    i = 0
    while i < len(argv):
        arg, key, value, width = argv[i], None, None, 1
        for group in ("--model.", "--data."):
            if arg.startswith(group) and not arg.startswith(group + "class_path"):
                if "=" in arg:
                    key, value = arg.split("=", 1)
                elif i + 1 < len(argv):
                    key, value, width = arg, argv[i + 1], 2
                break
        if key is not None and value in NULL_WORDS:
            yield i, width, key[2:]
            i += width
        else:
            i += 1


# -- types and defaults as data ------------------------------------------------------------------
_SCALARS: dict[str, type] = {"int": int, "float": float, "bool": bool, "str": str}


def describe(typehint: Any) -> Any:
    """A setting's type as JSON data (``"int"``, ``["Union", ["int", "None"]]``, ...);
    :data:`OPAQUE` for a type the schema does not rebuild."""
    import types
    import typing

    if typehint is type(None):
        return "None"
    if typehint is typing.Any:
        return "Any"
    for name, kind in _SCALARS.items():
        if typehint is kind:
            return name
    origin, args = typing.get_origin(typehint), typing.get_args(typehint)
    if origin is typing.Literal:
        if all(a is None or type(a) in (str, int, bool) for a in args):
            return ["Literal", list(args)]
    elif origin in (typing.Union, types.UnionType):
        return ["Union", [describe(a) for a in args]]
    elif origin is list and len(args) == 1:
        return ["list", describe(args[0])]
    elif origin is tuple and args:
        if len(args) == 2 and args[1] is Ellipsis:
            return ["tuple...", describe(args[0])]
        return ["tuple", [describe(a) for a in args]]
    elif origin is dict and len(args) == 2:
        return ["dict", describe(args[0]), describe(args[1])]
    return OPAQUE


def rebuild(desc: Any) -> Any:
    """The type :func:`describe` wrote (never called on an :data:`OPAQUE` part)."""
    import typing

    if isinstance(desc, str):
        return {"None": type(None), "Any": typing.Any, **_SCALARS}[desc]
    kind = desc[0]
    if kind == "Literal":
        return typing.Literal[tuple(desc[1])]
    if kind == "Union":
        return typing.Union[tuple(rebuild(d) for d in desc[1])]  # noqa: UP007 (built from data)
    if kind == "list":
        return list[rebuild(desc[1])]
    if kind == "tuple...":
        return tuple[rebuild(desc[1]), ...]
    if kind == "tuple":
        return tuple[tuple(rebuild(d) for d in desc[1])]
    if kind == "dict":
        return dict[rebuild(desc[1]), rebuild(desc[2])]
    raise ValueError(f"unknown type description {desc!r}")


def opaque(desc: Any) -> bool:
    """Whether any part of a type description is :data:`OPAQUE`."""
    if desc == OPAQUE:
        return True
    if not isinstance(desc, list) or desc[0] == "Literal":
        return False
    parts = desc[1] if desc[0] in ("Union", "tuple") else desc[1:]
    return any(opaque(d) for d in parts)


def encode(value: Any) -> Any:
    """A default as JSON data, tuples tagged (``betas``); TypeError for anything else."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v) for v in value]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, Mapping) and "__tuple__" not in value:
        if not all(isinstance(k, str) for k in value):
            raise TypeError("a mapping with keys that are not strings")
        return {k: encode(v) for k, v in value.items()}
    raise TypeError(f"{type(value).__name__} is not remembered")


def decode(data: Any) -> Any:
    if isinstance(data, list):
        return [decode(v) for v in data]
    if isinstance(data, dict):
        if set(data) == {"__tuple__"}:
            return tuple(decode(v) for v in data["__tuple__"])
        return {k: decode(v) for k, v in data.items()}
    return data


def schema_of(parser: Any, defaults: Mapping[str, Any], groups: Iterable[str]) -> dict[str, Any]:
    """The schema of a verb's parser (a jsonargparse parser, Lightning loaded): every setting's
    type and default, the class groups' settings from their default classes' parsers, links.

    ``defaults``: the parser's result for no arguments, as plain data (``plain_config``);
    ``groups``: the config groups a file may not set to null, in the order they are checked.
    """
    import importlib

    settings: dict[str, Any] = {}
    links: list[list[str]] = []

    def add(action: Any, prefix: str) -> None:
        dest = getattr(action, "dest", None)
        if type(action).__name__ == "ActionLink":
            sources = getattr(action, "source", None) or []
            if getattr(action, "compute_fn", None) is not None or len(sources) != 1:
                raise TypeError(f"the link to {action.target[0]} computes its value")
            if getattr(action, "apply_on", "parse") == "parse":
                links.append([prefix + sources[0][0], prefix + action.target[0]])
            return
        if not dest or not hasattr(action, "_typehint") or dest.endswith(".help"):
            return
        try:
            settings[prefix + dest] = {
                "type": describe(action._typehint),
                "default": encode(action.default),
            }
        except TypeError:  # a default that is not data: the setting is the parser's to read
            settings[prefix + dest] = {"type": OPAQUE, "default": None}

    for action in parser._actions:
        if getattr(action, "dest", None) in ("model", "data"):
            group = action.dest
            class_path = (defaults.get(group) or {}).get("class_path") or _default_class(group)
            module, _, name = class_path.rpartition(".")
            cls = getattr(importlib.import_module(module), name)
            inner = type(parser)(exit_on_error=False, parser_mode=parser.parser_mode)
            inner.add_class_arguments(cls, **dict(getattr(action, "sub_add_kwargs", {}) or {}))
            for sub in inner._actions:
                add(sub, f"{group}.")
        else:
            add(action, "")
    plain = {k: v for k, v in defaults.items() if k != "config"}
    return {
        "version": VERSION,
        "parser_mode": parser.parser_mode,
        "settings": settings,
        "links": links,
        "groups": list(groups),
        "defaults": encode(plain),
    }


def _default_class(group: str) -> str:
    from nanolab.training.plugins import DEFAULT_DATA, DEFAULT_MODEL

    return DEFAULT_MODEL if group == "model" else DEFAULT_DATA


def remember(verb: str, schema: dict[str, Any]) -> None:
    """Write ``verb``'s schema for the next launches (atomically; skipped when it cannot be)."""
    keys.write_remembered(keys._cache_file(verb, "schema"), schema)


def load(verb: str) -> Schema | None:
    """``verb``'s schema remembered by an earlier parse of this code, or None (read once per
    process and file: the jobs of a sweep share it, and what it has typed)."""
    path = keys._cache_file(verb, "schema")
    try:
        if path is None:
            return None
        st = path.stat()
        stamp = (str(path), st.st_mtime_ns, st.st_size)
        if stamp not in _LOADED:
            data = json.loads(path.read_text())
            _LOADED.clear()
            _LOADED[stamp] = Schema(data) if data.get("version") == VERSION else None
        return _LOADED[stamp]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


_LOADED: dict[tuple[str, int, int], Schema | None] = {}


# -- reading a command line with it --------------------------------------------------------------
class Schema:
    """A verb's remembered settings; :meth:`read` reads a command line as the parser would."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self.settings: dict[str, dict[str, Any]] = dict(data["settings"])
        self.links = [tuple(link) for link in data["links"]]
        self.groups = tuple(data["groups"])
        self.mode = str(data["parser_mode"])
        self.defaults: dict[str, Any] = decode(data["defaults"])
        self._inner = {k.rpartition(".")[0] for k in self.settings}
        self._inner |= {p for k in self._inner for p in _prefixes(k)}
        self._targets = {dst for _, dst in self.links}
        self._parsers: dict[str, Any] = {}
        self._typed: dict[tuple[str, bool, str], Any] = {}
        self._files: dict[tuple[str, str], dict[str, Any]] = {}

    def read(self, args: list[str], known: frozenset[str]) -> dict[str, Any]:
        """The merged config of ``fit ARGS`` (plain data, every default filled in), as
        ``plain_config(parse_fit_config(ARGS))`` holds it.

        Raises :class:`FitParseError` for what the parser refuses before it parses (a config
        file that cannot be read, an unknown key), :class:`AskTheParser` for anything else the
        schema cannot answer (a value its type refuses among them)."""
        from nanolab.training.plugins import class_paths_in_argv, class_paths_in_config
        from nanolab.training.resolve import compose

        argv = list(args)
        parsed = nulls_as_class_settings(argv)  # what the parser's checks read
        try:
            files = keys.read_config_files(parsed, self.groups)
            classes = class_paths_in_argv(parsed) + [
                c for data in files for c in class_paths_in_config(data)
            ]
            if classes:
                raise AskTheParser(f"{classes[0][1]} is a class of its own")
            keys.check_keys(parsed, known)  # a group given a null: its keys are typed below
        except RunConfigError as err:
            raise FitParseError(str(err)) from None
        try:
            merged = compose(
                argv, base=copy.deepcopy(self.defaults), read_file=self._file, value=self._option
            )
        except RunConfigError as err:  # worded by the resolver: the parser words it its way
            raise AskTheParser(str(err)) from None
        for source, target in self.links:
            _put(merged, target, copy.deepcopy(_get(merged, source)))
        merged["config"] = keys.config_file_paths(argv)
        return merged

    # compose's hooks: a config file, an override's text, each value typed as the parser would
    def _file(self, raw: str) -> dict[str, Any]:
        from nanolab.training.resolve import read_config_file

        try:  # a shell's <(...) pipe holds its text once: read as the checks read it
            memo = (raw, keys.read_config_text(raw))
        except (OSError, UnicodeDecodeError) as err:
            raise AskTheParser(f"{raw}: {err}") from None
        if memo not in self._files:
            self._files[memo] = self._tree(read_config_file(raw, text=memo[1]), "")
        return copy.deepcopy(self._files[memo])

    def _tree(self, node: Mapping[str, Any], prefix: str) -> dict[str, Any]:
        out = {}
        for key, value in node.items():
            dotted = f"{prefix}{key}"
            if dotted in self.settings:
                out[key] = self.typed(dotted, value, from_text=False)
            elif isinstance(value, Mapping) and dotted in self._inner:
                out[key] = self._tree(value, dotted + ".")
            else:
                raise AskTheParser(f"{dotted} is not one setting")
        return out

    def _option(self, name: str, text: str) -> Any:
        if name.endswith("+") or name not in self.settings:
            raise AskTheParser(f"--{name} is not one setting")
        if any(key == name for _, _, key in class_nulls([f"--{name}={text}"])):
            return self.typed(name, None, from_text=False)  # given to the class as a null
        return self.typed(name, text, from_text=True)

    def typed(self, key: str, value: Any, *, from_text: bool) -> Any:
        """``value`` (a file's, or an option's text) as the parser holds it at ``key``."""
        if key in self._targets or key == "ckpt_path":
            raise AskTheParser(f"{key} is set through another setting or checked on its own")
        try:
            memo = (key, from_text, json.dumps(value, sort_keys=True))
        except (TypeError, ValueError):
            memo = None
        if memo is not None and memo in self._typed:
            return copy.deepcopy(self._typed[memo])
        desc = self.settings[key]["type"]
        if not opaque(desc):
            result = self._adapt(key, desc, value, from_text)
        elif isinstance(desc, list) and desc[0] == "Union":
            result = self._first_kinds(key, desc[1], value, from_text)
        else:
            raise AskTheParser(f"{key}: its type is the parser's to read")
        if not _data(result):
            raise AskTheParser(f"{key}: {result!r} is not plain data")
        if memo is not None:
            self._typed[memo] = copy.deepcopy(result)
        return result

    def _first_kinds(self, key: str, members: list[Any], value: Any, from_text: bool) -> Any:
        """A setting whose type mixes plain kinds and classes (``trainer.accelerator: str |
        Accelerator``): the parser tries the kinds in order and keeps the first that takes the
        value, so the plain kinds before the first class decide, if one of them takes it."""
        from nanolab.training.resolve import override_value

        given = override_value(value) if from_text else value
        if given is None and "None" in members:
            return None  # classes and the other kinds refuse null; None takes it
        first: list[Any] = []
        for member in members:
            if opaque(member):
                break
            first.append(member)
        if not first:
            raise AskTheParser(f"{key}: a class is tried first")
        result = self._adapt(key, ["Union", first], value, from_text)
        if isinstance(result, str) and not isinstance(given, str):
            # Kept as text only because nothing before the classes took it: they are next.
            raise AskTheParser(f"{key}: {value!r} may name a class")
        return result

    def _adapt(self, key: str, desc: Any, value: Any, from_text: bool) -> Any:
        """jsonargparse's reading of ``value`` for a setting of type ``desc`` and the setting's
        default: an option's text as the command line gives it, a file's value as a file does."""
        parser = self._parser(key, desc)
        try:
            if from_text:
                return parser.parse_args([f"--v={value}"], defaults=False).v
            return parser.parse_object({"v": value}, defaults=False).v
        except Exception as err:  # refused (the parser words it), or a reading it cannot do
            raise AskTheParser(f"{key}: {err}") from None

    def _parser(self, key: str, desc: Any) -> Any:
        """A parser of one setting of type ``desc`` and ``key``'s default (which the parser
        compares a value with), shared by the settings with the same two."""
        default = self.settings[key]["default"]
        memo = json.dumps([desc, default])
        if memo not in self._parsers:
            from jsonargparse import ArgumentParser

            parser = ArgumentParser(exit_on_error=False, parser_mode=self.mode, default_env=False)
            try:
                parser.add_argument("--v", type=rebuild(desc), default=decode(default))
            except Exception as err:
                raise AskTheParser(f"{key}: {err}") from None
            self._parsers[memo] = parser
        return self._parsers[memo]


def _prefixes(key: str) -> list[str]:
    parts = key.split(".")
    return [".".join(parts[:n]) for n in range(1, len(parts))]


def _data(value: Any) -> bool:
    """Plain data: what a parsed setting holds (no parser objects, no classes)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_data(v) for v in value)
    if type(value) is dict:
        return all(isinstance(k, str) and _data(v) for k, v in value.items())
    return False


def _get(config: Mapping[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    return node


def _put(config: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
