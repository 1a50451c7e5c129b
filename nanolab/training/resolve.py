"""One config resolver: from the merged ``nanolab fit`` config to everything derived from it.

``fit``, ``queue add``, ``estimate`` and ``bench`` read the same YAML and must agree on what it
means: how many devices ``trainer.devices: auto`` is, which micro-batch wins, how much gradient
accumulation makes up ``run.global_batch_tokens``, where the run directory is. :func:`resolve`
is the single answer, a pure function: whatever depends on the machine or the data (visible
GPUs, the prepared data's vocabulary, a micro-batch chosen from device memory) comes in as an
argument, so the queue and the estimator ask the same function as ``fit`` with what they know.

The config may name its model and data classes (``model: {class_path: ..., init_args: ...}``)
or give the default classes' arguments directly (``model: {gpt: ...}``); :func:`sections` reads
both, :func:`plain_config` writes the default classes back in the short form.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanolab.errors import RunConfigError, written_whole
from nanolab.training.parallelism import int_setting, parse_strategy
from nanolab.training.plugins import DEFAULT_DATA, DEFAULT_MODEL


# -- sections ----------------------------------------------------------------------------------
def _plain(node: Any) -> Any:
    """jsonargparse Namespaces (and nested ones) as dicts, dunder keys (``__path__``) dropped."""
    if hasattr(node, "as_dict"):
        node = node.as_dict()
    if isinstance(node, Mapping):
        return {k: _plain(v) for k, v in node.items() if not str(k).startswith("__")}
    return node


def section(config: Mapping[str, Any], key: str, default_class: str) -> tuple[str, dict[str, Any]]:
    """``(class_path, init_args)`` of ``config[key]`` in any form the parser accepts.

    ``{gpt: ...}`` (the default class's arguments), ``{class_path: X, init_args: {...}}``,
    ``{init_args: {...}}`` (the default class) and a bare ``"pkg.mod.Class"`` string.
    """
    node = _plain(config.get(key))
    if node is None:
        return default_class, {}
    if isinstance(node, str):
        return _class_path(node, default_class), {}
    if not isinstance(node, Mapping):
        raise RunConfigError(f"'{key}' must be a mapping of settings, got {type(node).__name__}")
    if "class_path" in node or "init_args" in node:
        args = dict(node.get("init_args") or {})
        args.update(node.get("dict_kwargs") or {})
        return _class_path(str(node.get("class_path") or default_class), default_class), args
    return default_class, dict(node)


def _class_path(given: str, default_class: str) -> str:
    """The default class named by its own name (``--model GPTLightningModule``), which the fit
    parser takes as well as its path, as that path; any other name as it is."""
    return default_class if given == default_class.rpartition(".")[2] else given


def sections(config: Mapping[str, Any]) -> tuple[str, dict[str, Any], str, dict[str, Any]]:
    """``(model class, model args, data class, data args)`` of a merged config."""
    model_class, model_args = section(config, "model", DEFAULT_MODEL)
    data_class, data_args = section(config, "data", DEFAULT_DATA)
    return model_class, model_args, data_class, data_args


def with_own_defaults(class_path: str, args: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The settings given to ``where``'s class (``args``) over that class's own defaults when a
    class path chose it, as ``fit`` reads it (:mod:`nanolab.run.class_choice`); nanolab's own
    classes as given (their defaults are filled where each setting is read)."""
    if class_path in (DEFAULT_MODEL, DEFAULT_DATA):
        return dict(args)
    from nanolab.training.plugins import class_defaults

    return deep_merge(class_defaults(class_path, where).as_dict(), args)


def plain_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config with the default model/data classes in the short form (``model: {gpt: ...}``).

    Runs of nanolab's own classes then save the ``config.yaml`` they always did (same resume
    checks, same report groups, same queue history); another class keeps its ``class_path``.
    """
    out = _plain(config)
    for key, default in (("model", DEFAULT_MODEL), ("data", DEFAULT_DATA)):
        if key in out and out[key] is not None:
            class_path, args = section(out, key, default)
            out[key] = (
                args if class_path == default else {"class_path": class_path, "init_args": args}
            )
    return out


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``override`` on top of ``base``: nested mappings merge key by key, anything else is
    replaced (the one deep merge; :func:`merge_configs` adds the class-choice rules)."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def merge_configs(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``override`` (a later ``--config`` file) on top of ``base``, as the fit parser merges them.

    Groups merge key by key and anything else is replaced, except that ``model``/``data`` are
    class choices: a class path (``model: pkg.mod.Class`` or ``{class_path: ...}``) changes the
    class and keeps the settings given so far, and plain settings apply to the class chosen so
    far. The result names nanolab's own classes in the short form.
    """
    out = deep_merge(base, {k: v for k, v in override.items() if k not in ("model", "data")})
    for key, default in (("model", DEFAULT_MODEL), ("data", DEFAULT_DATA)):
        if key not in override:
            continue
        old_class, old_args = section(base, key, default)
        node = override[key]
        if node is None:
            out[key] = None
            continue
        new_class, new_args = section(override, key, default)
        if isinstance(node, Mapping) and "class_path" not in node:
            new_class = old_class  # settings for the class chosen so far
        args = deep_merge(old_args, new_args)
        out[key] = args if new_class == default else {"class_path": new_class, "init_args": args}
    return out


# -- a fit command line as data ----------------------------------------------------------------
#: Options of ``fit`` that are not dotted: ``--config FILE``, ``--seed_everything 7``,
#: ``--ckpt_path X`` and a whole group or class choice (``--model pkg.mod.Class``).
UNDOTTED_FIT_OPTIONS = ("config", "seed_everything", "ckpt_path", "model", "data", "trainer")


def is_fit_option(token: str) -> bool:
    """An option ``fit`` reads: ``--config``, a top-level key, or a dotted ``--group.key``
    (``--model.gpt.n_layer``, ``--run.name=x``, ``--trainer.callbacks+=X``)."""
    if not token.startswith("--"):
        return False
    name = token[2:].split("=", 1)[0].removesuffix("+")
    return name in UNDOTTED_FIT_OPTIONS or ("." in name and name.split(".", 1)[0].isidentifier())


def split_fit_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the part of a command line that ``fit`` would read: ``--config`` files and dotted
    overrides, in their order; everything else) -- so ``estimate`` and ``queue add`` take the
    same ``--config a.yaml --model.gpt.n_layer 2`` as ``fit``, beside options of their own."""
    fit: list[str] = []
    rest: list[str] = []
    tokens = list(argv)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not is_fit_option(token):
            rest.append(token)
            i += 1
            continue
        if "=" in token:
            fit.append(token)
            i += 1
            continue
        if i + 1 >= len(tokens) or is_fit_option(tokens[i + 1]):
            raise RunConfigError(f"{token} needs a value, e.g. {token} VALUE")
        fit += [token, tokens[i + 1]]
        i += 2
    return fit, rest


def setting_key(key: str) -> str:
    """A dotted key as a user writes it: ``model.gpt.n_layer`` for
    ``model.init_args.gpt.n_layer`` (the class groups' ``init_args`` level left out)."""
    parts = key.split(".")
    if len(parts) >= 2 and parts[0] in CLASS_GROUPS and parts[1] == "init_args":
        parts = [parts[0], *parts[2:]]
    return ".".join(parts)


def overridden_flags(
    argv: Sequence[str], keys_in: Callable[[str], Iterable[str] | Mapping[str, Any]]
) -> list[str]:
    """A line for each option of ``argv`` whose value a later ``--config`` file replaces.

    The command line is read in order, later ones winning (the fit parser's rule, which
    ``estimate`` follows): ``--model.gpt.n_layer 3 --config x.yaml`` trains x.yaml's
    ``n_layer``. That is rarely what the flag's author meant, so each such flag is named with
    its value and the file that won. A flag given again after that file wins, and is not named.
    ``keys_in(path)``: the dotted keys a ``--config`` file sets (each verb reads its files its
    own way: a shell's ``<(...)`` pipe holds its text for one reader), or those keys with their
    values: a file that sets the flag's own key to the flag's own value replaces nothing, and
    the flag is not named."""
    given: dict[str, tuple[str, str, list[str]]] = {}  # key: (flag, value, the keys it sets)
    lost: dict[str, tuple[str, str, str]] = {}  # key: (flag, value, the file that replaced it)
    tokens = list(argv)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not is_fit_option(token):
            i += 1
            continue
        if "=" in token:
            flag, text = token.split("=", 1)
            i += 1
        elif i + 1 < len(tokens):
            flag, text = token, tokens[i + 1]
            i += 2
        else:
            break
        name = flag[2:].removesuffix("+")
        if name == "config":
            found = keys_in(text)
            values = (
                {setting_key(k): v for k, v in found.items()} if isinstance(found, Mapping) else {}
            )
            in_file = [setting_key(k) for k in found]
            for key, (flag_, value, sets) in list(given.items()):
                if key in values and _same_value(values[key], value):
                    continue  # the file sets what the flag set: nothing is replaced
                if any(_covers(f, s) for f in in_file for s in sets):
                    lost[key] = (flag_, value, text)
                    del given[key]
            continue
        key = setting_key(name)
        sets = [key]
        if name in UNDOTTED_FIT_OPTIONS and name not in ("seed_everything", "ckpt_path"):
            sets = []  # a whole group or a class choice: its settings merge with a file's
        else:
            try:
                parsed = override_value(text)
            except RunConfigError:
                parsed = None
            if isinstance(parsed, Mapping) and parsed:  # --model.gpt '{n_layer: 3}'
                sets = [f"{key}.{k}" for k in config_settings(parsed)]
        given[key] = (flag.removesuffix("+"), text, sets)
        lost.pop(key, None)
    return [
        f"{flag} {value} is overridden by config file {file}, given after it (the command "
        f"line is read in order, later ones win); put {flag} after the last --config to use it"
        for flag, value, file in lost.values()
    ]


def _same_value(in_file: Any, flag_text: str) -> bool:
    """Whether a file's value equals a flag's text read as the command line's values are."""
    try:
        return bool(override_value(flag_text) == in_file)
    except RunConfigError:
        return False


def config_settings(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A config file's settings by dotted key (its leaves, an empty group one too)."""
    found: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            found.update(config_settings(value, f"{prefix}{key}."))
        else:
            found[f"{prefix}{key}"] = value
    return found


def _covers(file_key: str, flag_key: str) -> bool:
    """Whether a file setting ``file_key`` replaces the value a flag gave ``flag_key``: the
    same key, one of its parents, or a setting inside it."""
    return (
        file_key == flag_key
        or flag_key.startswith(file_key + ".")
        or file_key.startswith(flag_key + ".")
    )


#: YAML's merge key (``<<: *anchor``).
MERGE_TAG = "tag:yaml.org,2002:merge"


@functools.cache
def config_loader() -> type:
    """The YAML loader configs are read with, matching the fit parser's reading of them.

    PyYAML follows YAML 1.1, where ``6e-4`` (an exponent without a dot) is a string and
    ``2026-12-01`` a date; the fit parser reads the first as a float and keeps the second as
    text. Both rules apply to plain (unquoted) scalars only, as in the fit parser.
    """
    import yaml

    class ConfigLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            # A key given twice: PyYAML keeps the last one, so a second `trainer:` block
            # would silently replace the first whole.
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == MERGE_TAG:
                    continue  # `<<: *base` merges (its keys may be overridden): not a duplicate
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if isinstance(key, str | int | float | bool) and key in seen:
                    raise DuplicateKeyError(key, seen[key], line)
                seen.setdefault(key, line)
            return super().construct_mapping(node, deep=deep)

    timestamp, float_tag = "tag:yaml.org,2002:timestamp", "tag:yaml.org,2002:float"
    ConfigLoader.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag != timestamp]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    ConfigLoader.add_implicit_resolver(
        float_tag, re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"), list("-+0123456789")
    )
    return ConfigLoader


#: The most values a config's YAML may expand to through anchors and aliases. A config holds
#: hundreds; a "billion laughs" file (nine levels of nine aliases) a few hundred bytes long
#: expands to 9**9 values, which every reader after PyYAML (the parser's copies and checks)
#: walks one by one until memory runs out.
MAX_YAML_VALUES = 100_000


def check_alias_expansion(text: str, source: str = "the YAML") -> None:
    """Refuse YAML whose aliases expand beyond :data:`MAX_YAML_VALUES` values, by counting the
    composed node graph (linear in the text: an alias is one shared node) before any reader
    expands it. A YAML error is left for the reader, which names it its own way."""
    import yaml

    if "*" not in text:  # no alias, nothing to expand: the text's size is its size
        return
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return
    if root is not None and _expanded_values(root, {}, set()) > MAX_YAML_VALUES:
        raise RunConfigError(
            f"{source}: its anchors and aliases expand to more than {MAX_YAML_VALUES:,} values "
            "(an alias bomb); write the settings out, or use fewer nested aliases"
        )


def _expanded_values(node: Any, sizes: dict[int, int], open_: set[int]) -> int:
    """Values under ``node`` with every alias expanded (memoised per shared node; stops
    counting past the limit, and a node that contains itself counts as too many)."""
    import yaml

    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_:
        return MAX_YAML_VALUES + 1
    if isinstance(node, yaml.ScalarNode):
        return 1
    open_.add(key)
    total = 1
    children = (
        node.value
        if isinstance(node, yaml.SequenceNode)
        else [part for pair in node.value for part in pair]
    )
    for child in children:
        total += _expanded_values(child, sizes, open_)
        if total > MAX_YAML_VALUES:
            break
    open_.discard(key)
    sizes[key] = total
    return total


def load_yaml(text: str, source: str = "the YAML") -> Any:
    """``text`` read with :func:`config_loader`; an alias bomb and a key given twice in one
    mapping are refused naming ``source``."""
    import yaml

    check_alias_expansion(text, source)
    try:
        return yaml.load(text, Loader=config_loader())
    except DuplicateKeyError as err:
        raise RunConfigError(
            f"{source}: {err}; YAML would keep only the second, dropping the first silently: "
            "merge them into one"
        ) from None


_KINDS = {"int": "a number", "float": "a number", "bool": "true/false", "list": "a list",
          "str": "text"}  # fmt: skip

#: The groups every config reader checks the shape of (``fit`` and ``queue add`` also check
#: the run callbacks' groups, which this layer does not know: ``nanolab.run.parse``).
SETTING_GROUPS = ("run", "trainer", "model", "data")
#: Groups whose value may also be a class path (``model: mylab.models.X``).
CLASS_GROUPS = ("model", "data")
#: Settings inside the model group that are groups of keys themselves.
MODEL_SUBGROUPS = ("gpt", "optimizer", "schedule", "freeze")


def check_group_shapes(data: dict[str, Any], groups: Sequence[str], where: str) -> None:
    """Refuse a group given a value that is not a mapping of settings (``checkpoint: 5``,
    ``trainer: [1, 2]``, ``model: {gpt: 3}``) or given none (``trainer:``, ``model:
    {optimizer: }``): the parser would replace the whole group with it, or fail deep inside a
    class with a traceback (``argument after ** must be a mapping, not NoneType``)."""

    def refuse(key: str, value: Any) -> None:
        if value is None:
            raise RunConfigError(f"{where}: {null_group_line(key)}")
        raise RunConfigError(
            f"{where}: `{key}: {value!r}` must be a mapping of settings (`{key}: {{...}}`), not "
            f"{_KINDS.get(type(value).__name__, type(value).__name__)}; give its keys, or leave "
            "it out for its defaults"
        )

    for group in groups:
        value = data.get(group)
        if group not in data or isinstance(value, dict):
            pass
        elif not (group in CLASS_GROUPS and isinstance(value, str)):
            refuse(group, value)
    model = data.get("model")
    if isinstance(model, dict):
        settings = model.get("init_args") if isinstance(model.get("init_args"), dict) else model
        prefix = "model.init_args" if settings is not model else "model"
        for sub in MODEL_SUBGROUPS:
            if sub in settings and not isinstance(settings[sub], dict):
                refuse(f"{prefix}.{sub}", settings[sub])


def null_group_line(key: str) -> str:
    """The one line for a group of settings given null (``trainer:``, ``model: {optimizer: }``,
    ``--model.optimizer null``): it keeps no defaults and no settings, so leaving it out is
    what was meant."""
    leaf = key.rpartition(".")[2]
    return (
        f"`{key}: null` gives the {key} group no settings; leave it out to keep its defaults, "
        f"or give its keys (`{leaf}: {{...}}`)"
    )


def check_override_group(name: str, value: Any) -> None:
    """Refuse an override that gives a group of settings null (``--model.optimizer null``,
    ``--model.init_args.gpt=null``, which fit reads as ``--model '{"init_args": {"gpt":
    null}}'``): fit's parser takes it and then fails building the model
    with a traceback; ``estimate`` and ``queue add`` would price and queue that failure."""
    key = setting_key(name)
    if key == "model" and isinstance(value, Mapping):  # --model '{"init_args": {"gpt": null}}'
        settings = value.get("init_args") if isinstance(value.get("init_args"), Mapping) else value
        for sub in MODEL_SUBGROUPS:
            if sub in settings and settings[sub] is None:
                name, key, value = f"model.{sub}", f"model.{sub}", None
                break
    group, _, sub = key.partition(".")
    if value is None and (key in SETTING_GROUPS or (group == "model" and sub in MODEL_SUBGROUPS)):
        raise RunConfigError(
            f"--{name} null gives the {key} group no settings; leave it out to keep its "
            f"defaults, or give its settings (--{key}.KEY VALUE)"
        )


class DuplicateKeyError(RunConfigError):
    """A key given twice in one YAML mapping (with both lines); :func:`load_yaml` names the
    file in the message."""

    def __init__(self, key: Any, first: int, second: int) -> None:
        super().__init__(f"`{key}` is given twice in one mapping (lines {first} and {second})")
        self.key, self.first, self.second = key, first, second


def override_value(text: str) -> Any:
    """A command-line value as the fit parser reads it: YAML (``2``, ``true``, ``null``,
    ``6e-4``, ``[a, b]``, ``{k: v}``), else the string itself. A whole number in decimal digits
    is read as the parser reads one on the command line, before YAML: ``010`` is 10 (YAML 1.1,
    and so a config file, reads it as octal 8)."""
    import yaml

    plain = text.strip()
    if plain.isdecimal() or (plain.startswith("-") and plain[1:].isdecimal()):
        return int(plain)

    try:
        return load_yaml(text)
    except yaml.YAMLError:
        return text


def shell_pipe(path: str | Path) -> bool:
    """Whether ``path`` is a pipe the shell made for ``--config <(...)`` (``/dev/fd/N``): it
    holds its text once, for the one reader that opens it."""
    import stat

    text = str(path)
    if not text.startswith(("/dev/fd/", "/proc/self/fd/")):
        return False
    try:
        return stat.S_ISFIFO(os.stat(text).st_mode)
    except OSError:
        return False


#: What an empty ``--config`` path is (said before anything reads it as the folder ``.``).
EMPTY_CONFIG = "is empty; give a YAML file, e.g. --config my.yaml"


def config_path_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot be read as a config file, in words (``is a folder; ...``), or None
    for a regular file or the shell's ``<(...)`` pipe. A named FIFO or a device would block the
    reader until something writes to it (or forever), so it is refused before it is opened.
    An empty path (``--config ''``) is named empty: ``Path('')`` is ``.``, this folder."""
    import stat

    if not str(path).strip():
        return EMPTY_CONFIG
    p = Path(path)
    try:
        mode = p.stat().st_mode
    except OSError:
        return "does not exist"
    if stat.S_ISREG(mode) or shell_pipe(p):
        return None
    if stat.S_ISDIR(mode):
        return "is a folder; give a YAML file in it"
    kind = "a named pipe (FIFO)" if stat.S_ISFIFO(mode) else "a device or socket"
    return f"is {kind}, not a file: reading it would wait for a writer; give a YAML file"


def read_config_file(path: str | Path, text: str | None = None) -> dict[str, Any]:
    """One ``--config`` file as a mapping; a missing or broken file is one line naming it.
    ``text``: the file's text as already read (a shell's ``<(...)`` pipe gives it once)."""
    import yaml

    p = Path(path)
    if (problem := config_path_problem(path)) is not None:  # the text: Path('') is '.'
        raise RunConfigError(f"config file {str(path)!r} {problem}")
    try:
        text = p.read_text(encoding="utf-8") if text is None else text
        data = load_yaml(text, f"config file {path}") or {}
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise RunConfigError(f"{path}: not valid YAML ({err.__class__.__name__})") from None
    if not isinstance(data, Mapping):
        raise RunConfigError(f"{path}: the top level must be a mapping of config groups")
    check_group_shapes(dict(data), SETTING_GROUPS, f"config file {path}")
    return dict(data)


def _append(config: dict[str, Any], keys: list[str], value: Any) -> dict[str, Any]:
    """``--a.b+=value``: ``value`` appended to the list at ``a.b`` (made if absent)."""
    out = plain_config(config)
    if keys[0] in ("model", "data") and isinstance(out.get(keys[0]), Mapping):
        node_args = out[keys[0]]
        if "init_args" in node_args:
            keys = [keys[0], "init_args", *keys[1:]]
    node = out
    for key in keys[:-1]:
        child = node.get(key)
        node[key] = dict(child) if isinstance(child, Mapping) else {}
        node = node[key]
    current = node.get(keys[-1])
    items = list(current) if isinstance(current, list) else ([] if current is None else [current])
    node[keys[-1]] = [*items, *(value if isinstance(value, list) else [value])]
    return out


def compose(
    args: Sequence[str],
    base: Mapping[str, Any] | None = None,
    *,
    read_file: Callable[[str], Mapping[str, Any]] = read_config_file,
    value: Callable[[str, str], Any] | None = None,
) -> dict[str, Any]:
    """The merged config of a ``fit`` command line, read left to right as the fit parser does.

    ``args`` holds ``--config FILE`` and dotted ``--group.key VALUE`` (or ``--group.key=VALUE``,
    or ``--group.key+=VALUE`` to append to a list); a later one wins. ``model``/``data`` are
    class choices (:func:`merge_configs`). It starts from ``base``, by default the values ``fit``
    sets before any file (:func:`fit_defaults`). This is the one reader of configs outside LightningCLI
    itself: ``estimate``, ``bench``, the estimator's API and ``queue add`` call it, and a test holds its result
    against ``fit --print_config`` for every shipped config and overlay.

    ``read_file(path)`` reads a ``--config`` file and ``value(name, text)`` an override's text
    (``name``: ``model.gpt.n_layer``, ``trainer.callbacks+``); by default YAML as it is.
    :mod:`nanolab.run.schema` passes both, to type each value as the fit parser would.
    """
    merged: dict[str, Any] = fit_defaults() if base is None else dict(base)
    tokens = list(args)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not is_fit_option(token):
            raise RunConfigError(
                f"{token!r}: expected --config FILE or a dotted --group.key VALUE override"
            )
        if "=" in token:
            flag, text = token.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(tokens):
                raise RunConfigError(f"{token} needs a value, e.g. {token} VALUE")
            flag, text = token, tokens[i + 1]
            i += 2
        name = flag[2:]
        if name == "config":
            merged = merge_configs(merged, read_file(text))
            continue
        keys = name.removesuffix("+").split(".")
        given = override_value(text) if value is None else value(name, text)
        check_override_group(name, given)
        if name.endswith("+"):
            merged = _append(merged, keys, given)
            continue
        nested: Any = given
        for key in reversed(keys):
            nested = {key: nested}
        merged = merge_configs(merged, nested)
    return merged


def fit_defaults() -> dict[str, Any]:
    """What ``fit`` holds before the first ``--config``: its seed and the Trainer settings
    nanolab changes from Lightning's (``max_steps: 5000`` among them)."""
    return {"seed_everything": FIT_SEED, "trainer": trainer_defaults()}


def load_config(paths: Sequence[str | Path]) -> dict[str, Any]:
    """Read and merge ``--config`` files in order (later files win, groups merge key by key)."""
    return compose([a for p in paths for a in ("--config", str(p))])


#: ``seed_everything`` when no config sets it.
FIT_SEED = 1337


def trainer_defaults() -> dict[str, Any]:
    """The Trainer settings nanolab changes from Lightning's (``fit``, ``queue add`` and
    ``fit --help`` read them here)."""
    return {
        "max_steps": 5000,
        # Runs are counted in steps and the training stream has no end, so no epoch limit:
        # with max_steps -1, Lightning's default (None) is 1000 epochs and a line asking for -1.
        "max_epochs": -1,
        "logger": False,
        "use_distributed_sampler": False,  # the DataModule shards windows by rank itself
        "log_every_n_steps": 1,
        "num_sanity_val_steps": 0,
        "enable_model_summary": False,  # the start banner gives the model's size (progress.py)
    }


# -- single checks -----------------------------------------------------------------------------
def count_devices(devices: Any, accelerator: Any, visible_gpus: int | None) -> tuple[int, bool]:
    """Devices per node from ``trainer.devices``, and whether ``auto`` had to be guessed.

    ``visible_gpus`` is what ``auto`` (or ``-1``) means where the question is asked: ``fit``
    passes the GPUs it can see, the queue 1 (a job gets one device unless it asks for more),
    the estimator ``None`` (unknown: 1, flagged as a guess). A CPU accelerator is one device.
    """
    if isinstance(devices, (list, tuple)):
        return max(1, len(devices)), False
    if isinstance(devices, str) and "," in devices:
        return max(1, len([d for d in devices.split(",") if d.strip()])), False
    if devices in (None, "auto", -1, "-1"):
        if str(accelerator or "auto") == "cpu" or visible_gpus is None:
            return 1, visible_gpus is None and str(accelerator or "auto") != "cpu"
        return max(1, int(visible_gpus)), False
    n = int_setting(devices, "trainer.devices")
    return n, False


def visible_gpus(accelerator: Any) -> int:
    """What ``trainer.devices: auto`` means on this machine for ``fit`` and ``bench``: every GPU
    this process sees, or 1 (a CPU run; the one impure helper here, kept out of :func:`resolve`)."""
    if str(accelerator or "auto") not in ("auto", "gpu", "cuda"):
        return 1
    import torch

    return max(1, torch.cuda.device_count())


def trainer_accumulation(accumulate_grad_batches: Any) -> int:
    """Lightning's ``trainer.accumulate_grad_batches`` as a count (``None``: its default, 1):
    the micro-batches per optimizer step wherever no ``run.global_batch_tokens`` derives them."""
    if accumulate_grad_batches is None:
        return 1
    return int_setting(accumulate_grad_batches, "trainer.accumulate_grad_batches")


def gradient_accumulation(
    global_batch_tokens: int | None,
    micro_batch_size: int,
    block_size: int,
    world_size: int,
    accumulate_grad_batches: Any = None,
    micro_batch_from: str = "data.micro_batch_size",
) -> int:
    """Micro-batches per optimizer step that make up ``global_batch_tokens``; without one,
    Lightning's own ``trainer.accumulate_grad_batches`` (default 1), so a Lightning user's
    setting is obeyed rather than replaced by 1. A global batch in tokens wins over it: it is
    what keeps the batch the same on another device count or micro-batch. ``micro_batch_from``:
    the setting the micro-batch came from, which the refusal names (the one to change)."""
    if global_batch_tokens is None:
        return trainer_accumulation(accumulate_grad_batches)
    per_step = micro_batch_size * block_size * world_size
    if global_batch_tokens <= 0 or global_batch_tokens % per_step != 0:
        raise RunConfigError(
            f"run.global_batch_tokens ({global_batch_tokens}) must be a positive multiple of "
            f"{micro_batch_from} x model.gpt.block_size x devices = {micro_batch_size} x "
            f"{block_size} x {world_size} = {per_step}; e.g. {max(1, round(global_batch_tokens / per_step)) * per_step}"
        )
    return global_batch_tokens // per_step


#: The largest seed torch's and numpy's generators take (``seed_everything`` seeds both).
MAX_SEED = 2**32 - 1


#: What ``seed_everything`` may be, as every refusal of it says.
SEED_CHOICES = (
    f"a number from 0 to {MAX_SEED}, true for a random seed (drawn at launch and recorded in "
    "config.yaml), or false for none"
)


def check_seed(seed: Any, where: str = "seed_everything") -> None:
    """A seed numpy accepts (0 .. 2^32 - 1), or ``true``/``false``; one line otherwise
    (``seed_everything(-1)`` ends in numpy's ValueError, a traceback, at start-up). Null is
    refused too: Lightning reads it as seed 0 for every such run, with a line of its own, while
    the command line's parser refuses it; neither is what a reader of ``null`` expects."""
    if isinstance(seed, bool):
        return
    if seed is None:
        raise RunConfigError(f"{where}: null is not a seed; give {SEED_CHOICES}")
    if not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise RunConfigError(f"{where}: {seed!r} is not a seed; give {SEED_CHOICES}")


#: The longest folder name file systems take (NAME_MAX), in bytes of its encoded form.
MAX_NAME_BYTES = 255

#: What a refused run name should be instead.
PLAIN_NAME = (
    "give a plain folder name (no '/', '\\' or control characters; not empty, only blanks, '.' "
    "or '..')"
)


def run_name_problem(text: str) -> str | None:
    """Why ``text`` cannot name a run directory under ``run.root``, as the fix to print (None:
    it can). One rule for ``fit --run.name`` and ``queue add --name``: printable names in any
    script are kept as given (``ablation-é 2``, ``lr-实验``)."""
    if (
        not text.strip()
        or text in (".", "..")
        or "/" in text
        or "\\" in text
        or not text.isprintable()  # a newline or tab would break every table of runs
        or Path(text).is_absolute()
    ):
        return PLAIN_NAME
    size = len(os.fsencode(text))
    if size > MAX_NAME_BYTES:  # the folder could not be made ("File name too long")
        return f"{size} bytes long, over the {MAX_NAME_BYTES} a folder name may have; give a shorter one"
    return None


def check_run_name(name: Any) -> None:
    """Refuse a run name that would put the run directory outside ``run.root`` (or be ``root``),
    or that no file system takes as a folder name."""
    text = str(name) if name is not None else ""
    problem = run_name_problem(text)
    if problem == PLAIN_NAME:
        raise RunConfigError(
            f"run.name {text!r}: {problem}; "
            "the run directory is run.root/run.name, set run.root to put it elsewhere"
        )
    if problem is not None:
        raise RunConfigError(f"run.name {shown_name(text)}: {problem}")


def shown_name(text: str, limit: int = 60) -> str:
    """``text`` quoted for a message line, its middle cut when it is long."""
    return repr(text) if len(text) <= limit else f"{text[: limit - 20]!r}...{text[-10:]!r}"


def check_max_steps(max_steps: Any) -> None:
    """Steps, not epochs: a positive number, or -1 (no limit: a budget or a signal stops it)."""
    if (whole := written_whole("trainer.max_steps", max_steps)) is not None:
        raise RunConfigError(whole)
    if (
        isinstance(max_steps, bool)
        or not isinstance(max_steps, int)
        or not (max_steps >= 1 or max_steps == -1)
    ):
        raise RunConfigError(
            f"trainer.max_steps must be a positive number of optimizer steps (or -1: no limit, "
            f"stop on a budget), got {'null' if max_steps is None else repr(max_steps)}"
        )


def check_eval_every(value: Any) -> None:
    """``run.eval_every_steps``: a whole number of optimizer steps >= 1, each way it can be
    wrong said as that way (a float written whole, another type, the range), never as a range
    a value of another type is "not in"."""
    where = "run.eval_every_steps"
    if (whole := written_whole(where, value)) is not None:
        raise RunConfigError(whole)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RunConfigError(
            f"{where}: {'null' if value is None else repr(value)} is not a whole number; give "
            "the optimizer steps between validations, e.g. 250"
        )
    if value < 1:
        raise RunConfigError(
            f"{where} must be >= 1 (optimizer steps between validations), got {value}"
        )


def check_overfit_batches(value: Any) -> None:
    """Lightning's ``trainer.overfit_batches`` replaces the loaders' samplers, which choose
    nanolab's windows (by seed, micro-batch and rank): refused before anything is written,
    naming the preset that overfits the nanolab way."""
    if value in (None, 0, 0.0) or value is False:
        return
    raise RunConfigError(
        f"trainer.overfit_batches {value!r}: nanolab's data loaders choose their windows "
        "themselves, which Lightning's overfit_batches would replace; use --config "
        "configs/debug/overfit.yaml (nanolab.callbacks.overfit.OverfitBatches) to train on a "
        "few fixed batches"
    )


def check_gradient_clip(value: Any) -> None:
    """A clipping norm that is not a finite number >= 0 (YAML's ``.nan``, ``-1``) would turn
    every step's gradients into NaN or zero, silently; null turns clipping off."""
    import math

    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        ok = False
    else:
        ok = value >= 0
    if not ok:
        raise RunConfigError(
            f"trainer.gradient_clip_val: {value!r} is not valid; it must be a finite number "
            ">= 0 (e.g. 1.0), or null: no clipping"
        )


def check_dataset_dir(data_args: Mapping[str, Any]) -> None:
    """An empty ``data.dataset_dir`` is the current folder to some readers and a path without a
    name to others (a traceback when the data is prepared into it): refuse it by name."""
    value = data_args.get("dataset_dir")
    if isinstance(value, str) and not value.strip():
        raise RunConfigError(
            "data.dataset_dir is empty; give the folder of a prepared dataset (e.g. "
            "data/shakespeare_char), or leave it out to keep the default"
        )


def check_model_settings(model_args: Mapping[str, Any]) -> None:
    """Validate ``gpt``/``optimizer``/``schedule`` where the model class takes them, so an error
    names the model key (their dataclasses check themselves and raise ``ConfigError``).

    ``model_args`` may be the raw YAML (``nanolab estimate`` reads it without fit's parser), so
    the parser's own checks are made here too, with its wording: a group that is not a mapping,
    an unknown key (with the nearest known one) and a value of the wrong type are one line
    each, never a ``TypeError`` from the dataclass."""
    from nanolab.model.config import GPTConfig
    from nanolab.training.optim import OptimizerConfig, ScheduleConfig

    for name, cls in (
        ("gpt", GPTConfig),
        ("optimizer", OptimizerConfig),
        ("schedule", ScheduleConfig),
    ):
        if name in model_args:
            settings = _typed_settings(f"model.{name}", model_args.get(name), cls)
            if "betas" in settings:
                settings["betas"] = tuple(settings["betas"])
            cls(**settings)


def _typed_settings(where: str, value: Any, cls: type) -> dict[str, Any]:
    """``value`` as keyword arguments of the dataclass ``cls``, refused in fit's words when it is
    not a mapping, has a key ``cls`` lacks, or a value of another type than the field's."""
    import dataclasses
    import math
    import types
    import typing

    from nanolab.helpfmt import suggestion

    settings = _plain(value if value is not None else {})
    if not isinstance(settings, Mapping):
        raise RunConfigError(
            f"{where} must be a mapping of settings (e.g. `{where.rpartition('.')[2]}: {{...}}`), "
            f"got {type(settings).__name__} {settings!r}"
        )
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    out = dict(settings)
    for key, given in settings.items():
        if key not in fields:
            near = suggestion(f"{where}.{key}", frozenset(f"{where}.{f}" for f in fields))
            hint = f"did you mean {near}?" if near else f"known: {', '.join(sorted(fields))}"
            raise RunConfigError(f"unknown setting {where}.{key}; {hint}")
        union = typing.get_origin(hints[key]) in (typing.Union, types.UnionType)
        kinds = typing.get_args(hints[key]) if union else (hints[key],)
        if float in kinds and isinstance(given, str):
            try:  # YAML reads nan/inf as text (it spells them .nan/.inf): the field's rule says it
                if not math.isfinite(float(given)):
                    out[key] = float(given)
                    continue
            except ValueError:
                pass
        if not any(_is_a(given, kind) for kind in kinds):
            names = ["null" if k is type(None) else getattr(k, "__name__", str(k)) for k in kinds]
            raise RunConfigError(
                f"{where}.{key}: {given!r} is not valid; expected {' or '.join(names)}"
            )
    return out


def _is_a(value: Any, kind: Any) -> bool:
    """Whether ``value`` is of the field type ``kind`` as fit's parser reads it (an int is a
    float, a bool is not an int, a list is a tuple); types it cannot tell pass (the dataclass
    decides)."""
    import typing

    origin = typing.get_origin(kind) or kind
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind is str:
        return isinstance(value, str)
    if origin is tuple:
        return isinstance(value, list | tuple)
    return True


def _check_optimizer_fits_strategy(
    model_args: Mapping[str, Any], strategy: Any, world: int
) -> None:
    """An optimizer that cannot step the shards a strategy makes (Muon needs whole matrices,
    8-bit AdamW plain tensors) is refused here, before a run folder is made, rather than when
    the optimizer is built on every rank."""
    optimizer = model_args.get("optimizer")
    name = optimizer.get("name") if isinstance(optimizer, Mapping) else None
    if not isinstance(name, str):
        return
    from nanolab.training.optim import strategy_refusal

    try:
        kind = parse_strategy(strategy, world).kind
    except RunConfigError:
        return  # a strategy of the user's own: the optimizer's build-time check decides
    why = strategy_refusal(name, kind)
    if why:
        raise RunConfigError(why)


#: Precisions Lightning's ModelParallelStrategy (nanolab's FSDP2) accepts: it has no fp16 loss
#: scaler, so ``16-mixed`` is a ValueError inside Trainer() after the run folder exists.
FSDP2_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-true")
_PRECISION_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed", "64": "64-true"}


def precision_name(precision: Any) -> str:
    """``trainer.precision`` as Lightning names it: the short spellings (``bf16``, ``16``, ``32``,
    ``64``) mapped to theirs, null to Lightning's default ``32-true``."""
    if precision is None:
        return "32-true"
    return _PRECISION_ALIASES.get(str(precision), str(precision))


def _offloads_optimizer(strategy: Any) -> bool:
    """Whether a DeepSpeed strategy's settings offload the optimizer (``offload_optimizer``,
    or a ``config`` whose ``zero_optimization.offload_optimizer`` names cpu or nvme)."""
    args = strategy.get("init_args") if isinstance(strategy, Mapping) else None
    if not isinstance(args, Mapping):
        return False
    if args.get("offload_optimizer"):
        return True
    config = args.get("config")
    zero = config.get("zero_optimization") if isinstance(config, Mapping) else None
    offload = zero.get("offload_optimizer") if isinstance(zero, Mapping) else None
    return isinstance(offload, Mapping) and offload.get("device") in ("cpu", "nvme")


def _check_deepspeed_settings(
    trainer: Mapping[str, Any], model_args: Mapping[str, Any], world: int
) -> None:
    """What DeepSpeed refuses once every rank has started (a traceback per rank, config.yaml
    already written), refused here in one line: clipping by value, and an optimizer other than
    AdamW with the optimizer offloaded (the step runs DeepSpeed's CPU Adam)."""
    strategy = trainer.get("strategy")
    try:
        kind = parse_strategy(strategy, world).kind
    except RunConfigError:
        return
    if kind != "deepspeed":
        return
    if str(trainer.get("gradient_clip_algorithm") or "norm") == "value":
        raise RunConfigError(
            "trainer.gradient_clip_algorithm value: DeepSpeed clips by the global norm only; "
            "use norm (the default), or another trainer.strategy"
        )
    optimizer = model_args.get("optimizer")
    name = optimizer.get("name") if isinstance(optimizer, Mapping) else None
    if _offloads_optimizer(strategy) and name not in (None, "adamw"):
        raise RunConfigError(
            f"model.optimizer.name {name!r} cannot run with DeepSpeed's optimizer offload; use "
            "'adamw' (offloaded states already live in CPU memory, stepped by DeepSpeed's CPU "
            "Adam)"
        )


def _check_precision_fits_strategy(precision: Any, strategy: Any, world: int) -> None:
    """FSDP2 with a precision it cannot run (fp16 with loss scaling) is refused before the run."""
    if precision is None:
        return
    try:
        kind = parse_strategy(strategy, world).kind
    except RunConfigError:
        return
    name = precision_name(precision)
    if kind == "fsdp2" and name not in FSDP2_PRECISIONS:
        why, other = (
            ("it has no fp16 loss scaler", "ddp or deepspeed")
            if name.startswith("16")
            else ("it runs 32-bit, bf16 or 16-bit weights only", "ddp")
        )
        raise RunConfigError(
            f"trainer.precision {name} cannot run under FSDP2 ({why}); use bf16-mixed, or "
            f"trainer.strategy {other}"
        )


# -- the resolver ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Resolved:
    """Everything derived from one merged config (see :func:`resolve`).

    Attributes:
        model_class / data_class: Class paths (the defaults when the config names none).
        model_args / data_args: Their init arguments, with the derived values filled in
            (``gpt.vocab_size``, ``block_size``, ``micro_batch_size``).
        devices_per_node, num_nodes, world_size: Device counts; ``devices_guessed``: ``auto``
            was read as 1 because the caller could not see the devices (the estimator).
        block_size: Tokens per window (the model's ``gpt.block_size`` when it has one).
        micro_batch_size: Sequences per device per forward pass; ``None`` for
            ``run.micro_batch_size: auto`` until the caller plans it from device memory.
        accumulate: Micro-batches per optimizer step (``None`` while the micro-batch is).
        tokens_per_step: Tokens per optimizer step over all devices (``None`` likewise).
        vocab_size: The model's vocabulary (``None`` when neither model nor data knows it yet).
        val_check_interval: Micro-batches between validations (``eval_every_steps x
            accumulate``; ``None`` while the micro-batch is).
        max_steps: ``trainer.max_steps`` (``-1``: no limit; ``None``: not in the config).
        run_dir: ``run.root / run.name`` (``None`` while the name is not chosen).
    """

    model_class: str
    model_args: dict[str, Any]
    data_class: str
    data_args: dict[str, Any]
    devices_per_node: int
    num_nodes: int
    devices_guessed: bool
    block_size: int
    micro_batch_size: int | None
    accumulate: int | None
    vocab_size: int | None
    max_steps: int | None
    eval_every_steps: int
    global_batch_tokens: int | None
    run_dir: Path | None

    @property
    def world_size(self) -> int:
        return self.devices_per_node * self.num_nodes

    @property
    def tokens_per_step(self) -> int | None:
        if self.micro_batch_size is None or self.accumulate is None:
            return None
        return self.micro_batch_size * self.block_size * self.world_size * self.accumulate

    @property
    def val_check_interval(self) -> int | None:
        return None if self.accumulate is None else self.eval_every_steps * self.accumulate


def micro_batch_setting(run: Mapping[str, Any]) -> str:
    """The setting :func:`micro_batch_choice` takes the micro-batch from (an error names it)."""
    return (
        "data.micro_batch_size" if run.get("micro_batch_size") is None else "run.micro_batch_size"
    )


def micro_batch_choice(run: Mapping[str, Any], data_args: Mapping[str, Any]) -> int | str:
    """``run.micro_batch_size`` (an integer or ``auto``) wins over ``data.micro_batch_size``."""
    choice = run.get("micro_batch_size")
    if choice is None:
        choice = data_args.get("micro_batch_size", 32)
        if choice == "auto":  # accepted in a raw YAML by the estimator
            return "auto"
        return int_setting(choice, "data.micro_batch_size")
    if choice == "auto":
        return "auto"
    if isinstance(choice, int) and not isinstance(choice, bool) and choice < 1:
        raise RunConfigError(f"run.micro_batch_size must be >= 1 or auto, got {choice}")
    return int_setting(choice, "run.micro_batch_size")


def resolve(
    config: Mapping[str, Any],
    *,
    visible_gpus: int | None,
    data_vocab: int | None = None,
    data_built: bool = False,
    micro_batch_size: int | None = None,
    devices: int | None = None,
    num_nodes: int | None = None,
    micro_batch_from: str = "run.micro_batch_size",
) -> Resolved:
    """Derive world size, micro-batch, accumulation, vocabulary and run directory from
    ``config`` (the merged ``fit`` config, as a dict or jsonargparse Namespace); pure.

    Args:
        visible_gpus: What ``trainer.devices: auto`` means here (:func:`count_devices`).
        data_vocab: The data's vocabulary, when known: fills ``model.gpt.vocab_size: null``
            and must not exceed a vocabulary the config fixes.
        data_built: The data was built and ``data_vocab`` is all it will say (``fit``): a
            ``model.gpt.vocab_size: null`` it leaves unfilled is refused here, naming both
            classes, not when the model is configured inside the Trainer (a traceback).
        micro_batch_size: A micro-batch chosen by the caller (``run.micro_batch_size: auto``
            planned from device memory, ``estimate --micro-batch``); wins over the config.
        micro_batch_from: Where a given ``micro_batch_size`` came from, as an error names it
            (``--micro-batch``); by default the ``run.micro_batch_size: auto`` it replaces.
        devices / num_nodes: Overrides of ``trainer.devices`` / ``trainer.num_nodes``.

    Raises:
        RunConfigError: A setting that cannot work, naming the key and the fix.
    """
    cfg = _plain(config)
    trainer = dict(cfg.get("trainer") or {})
    run = dict(cfg.get("run") or {})
    model_class, model_args, data_class, data_args = sections(cfg)
    if "seed_everything" in cfg:  # a raw YAML (the estimator's input) may leave it out
        check_seed(cfg["seed_everything"])

    per_node, guessed = count_devices(
        trainer.get("devices", "auto") if devices is None else devices,
        trainer.get("accelerator", "auto"),
        visible_gpus,
    )
    if num_nodes is None:  # the default only when unset: 0 is refused, as fit refuses it
        num_nodes = 1 if trainer.get("num_nodes") is None else trainer["num_nodes"]
    nodes = int_setting(num_nodes, "trainer.num_nodes")
    world = per_node * nodes
    _check_optimizer_fits_strategy(model_args, trainer.get("strategy"), world)
    _check_precision_fits_strategy(trainer.get("precision"), trainer.get("strategy"), world)
    _check_deepspeed_settings(trainer, model_args, world)

    gpt = dict(model_args.get("gpt") or {}) if "gpt" in model_args else None
    if gpt is not None:
        block = int_setting(gpt.get("block_size", 256), "model.gpt.block_size")
        asked = data_args.get("block_size")
        if asked is not None and asked != block:
            raise RunConfigError(
                f"data.block_size ({asked}) differs from model.gpt.block_size ({block}): the "
                "data's windows follow the model's context; set model.gpt.block_size, and "
                "leave data.block_size out (null)"
            )
        model_vocab = gpt.get("vocab_size")
        if data_vocab is not None:
            if model_vocab is None:
                gpt["vocab_size"] = model_vocab = int(data_vocab)
            elif int(model_vocab) < int(data_vocab):
                raise RunConfigError(
                    f"the data's vocabulary ({data_vocab}) is larger than model.gpt.vocab_size "
                    f"({model_vocab}); set model.gpt.vocab_size to null or >= {data_vocab}"
                )
        if model_vocab is None and data_built:
            raise RunConfigError(
                f"model.gpt.vocab_size is null ({model_class}) and data {data_class} provides "
                "no vocab_size to fill it; set model.gpt.vocab_size (--model.gpt.vocab_size N), "
                "or give the data class a vocab_size property (nanolab's TokenDataModule has "
                "one; docs/forking.md)"
            )
        model_args = {**model_args, "gpt": gpt}
        vocab = None if model_vocab is None else int(model_vocab)
    else:  # a model class of the user's own without a GPTConfig: the data's window length
        block = int_setting(data_args.get("block_size") or 256, "data.block_size")
        vocab = None if data_vocab is None else int(data_vocab)

    choice = (
        micro_batch_size if micro_batch_size is not None else micro_batch_choice(run, data_args)
    )
    micro = None if choice == "auto" else int(choice)
    data_args = {**data_args, "block_size": block}
    if micro is not None:
        data_args["micro_batch_size"] = micro

    gbt = run.get("global_batch_tokens")
    gbt = None if gbt is None else int_setting(gbt, "run.global_batch_tokens")
    accumulate = None
    if micro is not None:
        source = micro_batch_from if micro_batch_size is not None else micro_batch_setting(run)
        accumulate = gradient_accumulation(
            gbt, micro, block, world, trainer.get("accumulate_grad_batches"), source
        )
    elif gbt is not None and gbt % (block * world) != 0:
        raise RunConfigError(
            f"run.global_batch_tokens ({gbt}) is not a multiple of model.gpt.block_size x "
            f"devices = {block} x {world} = {block * world}"
        )

    eval_every = run.get("eval_every_steps", 250)
    check_eval_every(eval_every)
    check_gradient_clip(trainer.get("gradient_clip_val"))
    check_overfit_batches(trainer.get("overfit_batches"))
    check_dataset_dir(data_args)
    max_steps = trainer.get("max_steps")  # absent only in a raw YAML (the estimator's input)
    if "max_steps" in trainer:  # given, even as null: Lightning would fail on null mid-start
        check_max_steps(max_steps)
    name = run.get("name")
    run_dir = None
    if name is not None:
        check_run_name(name)
        root = run.get("root")
        if root is not None and not str(root).strip():
            raise RunConfigError("run.root is empty; give the folder of the runs (e.g. runs)")
        run_dir = Path(str(root or "runs")) / str(name)

    return Resolved(
        model_class=model_class,
        model_args=model_args,
        data_class=data_class,
        data_args=data_args,
        devices_per_node=per_node,
        num_nodes=nodes,
        devices_guessed=guessed,
        block_size=block,
        micro_batch_size=micro,
        accumulate=accumulate,
        vocab_size=vocab,
        max_steps=max_steps,
        eval_every_steps=eval_every,
        global_batch_tokens=gbt,
        run_dir=run_dir,
    )
