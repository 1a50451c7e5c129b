"""Which model and data classes trained a run, and the settings that are their own.

A fork's class (``--model mylab.models.SmoothedGPT --model.label_smoothing 0.1``) adds settings
nanolab has no rule for: nanolab cannot tell whether a resume may change one (a loss weight?
the subset the data trains on? the number of experts, which changes the network?). So every
checkpoint records the classes' paths and those settings (the checkpoint's ``nanolab`` section,
plain data, so it loads with ``weights_only=True``); a resume of the run that asks for another
value of one is refused before anything is written, naming the value it trained with and the
branch command that trains with the new one (:func:`changed_own_settings`). A branch (a new run
from the checkpoint) takes its own values. nanolab's own settings keep their own rules
(docs/resume.md, "What a resume keeps").
"""

from __future__ import annotations

import enum
import inspect
import json
import os
import re
import sys
from collections.abc import Mapping
from typing import Any

from nanolab.model.checkpoint import CLASSES_KEY  # noqa: F401  (the record's key: public here)


def class_path(obj_or_cls: Any) -> str:
    """``module.QualifiedName`` of an object's class (or of a class)."""
    cls = obj_or_cls if isinstance(obj_or_cls, type) else type(obj_or_cls)
    return f"{cls.__module__}.{cls.__qualname__}"


def nanolab_parameters(cls: type) -> set[str]:
    """The ``__init__`` parameters that nanolab's classes in ``cls``'s ancestry define: those
    settings follow nanolab's own rules; the others are the class's own."""
    names: set[str] = set()
    for base in cls.__mro__:
        if not base.__module__.startswith("nanolab.") or "__init__" not in vars(base):
            continue
        try:
            names |= set(inspect.signature(base.__init__).parameters)
        except (TypeError, ValueError):
            continue
    return names


def own_settings(cls: type, init_args: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of ``init_args`` that are ``cls``'s own (no nanolab class defines them)
    and have a stable plain form (:func:`plain_form`). Another value (an object, a function
    defined inside another) is left out: its text (``<function f at 0x7f...>``) holds an
    address that differs at every launch, so comparing it would refuse every resume."""
    ours = nanolab_parameters(cls)
    return plain_settings({k: v for k, v in init_args.items() if k not in ours})


def plain_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The settings that have a stable plain form (:func:`plain_form`), in it; private keys
    (``__path__``) and the others left out."""
    out = {}
    for key, value in settings.items():
        plain = plain_form(value)
        if plain is not _NO_PLAIN_FORM and not key.startswith("__"):
            out[key] = plain
    return out


_NO_PLAIN_FORM = object()


def plain_form(value: Any) -> Any:
    """``value`` as JSON data that is the same at every launch: numbers, text, booleans and
    None, lists and string-keyed dicts of those, an enum member as its name, a path as its
    text, a module-level function or class as its import path (``mylab.models.softcap``,
    what a config names it by); ``_NO_PLAIN_FORM`` for anything else."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (list, tuple)):
        items = [plain_form(v) for v in value]
        return _NO_PLAIN_FORM if any(i is _NO_PLAIN_FORM for i in items) else items
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            return _NO_PLAIN_FORM
        pairs = {k: plain_form(v) for k, v in value.items()}
        return _NO_PLAIN_FORM if _NO_PLAIN_FORM in pairs.values() else pairs
    if inspect.isfunction(value) or inspect.isclass(value) or inspect.isbuiltin(value):
        return _import_path(value)
    return _NO_PLAIN_FORM


def _import_path(value: Any) -> Any:
    """``module.name`` that imports ``value`` back (``torch.tanh``, not its ``__qualname__``
    ``_VariableFunctionsClass.tanh``), else ``_NO_PLAIN_FORM`` (a lambda, a local function)."""
    module = sys.modules.get(getattr(value, "__module__", None) or "")
    if module is None:
        return _NO_PLAIN_FORM
    for name in (getattr(value, "__qualname__", ""), getattr(value, "__name__", "")):
        found: Any = module
        for part in str(name).split("."):
            found = getattr(found, part, _NO_PLAIN_FORM) if part else _NO_PLAIN_FORM
        if found is value:
            return f"{module.__name__}.{name}"
    return _NO_PLAIN_FORM


def classes_record(
    model: Any, model_args: Mapping[str, Any] | None, data: Any, data_args: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The record a checkpoint keeps: each class's path and its own settings (``None`` where
    the launch did not say: a ``Trainer.fit`` of one's own)."""
    record: dict[str, Any] = {"model": {"class_path": class_path(model), "settings": None}}
    if model_args is not None:
        record["model"]["settings"] = own_settings(type(model), model_args)
    if data is not None:
        settings = own_settings(type(data), data_args) if data_args is not None else None
        record["data"] = {"class_path": class_path(data), "settings": settings}
    return record


def changed_own_settings(
    saved: Mapping[str, Any] | None, now: Mapping[str, Any]
) -> list[tuple[str, Any, Any]]:
    """``(dotted key, the checkpoint's value, this launch's)`` for each own setting of the same
    class that this launch changed. A checkpoint without a record (an earlier nanolab), another
    class, or a key either side lacks is not compared."""
    changed = []
    for section in ("model", "data"):
        before = (saved or {}).get(section)
        after = now.get(section)
        if not isinstance(before, Mapping) or not isinstance(after, Mapping):
            continue
        if before.get("class_path") != after.get("class_path"):
            continue
        old, new = before.get("settings"), after.get("settings")
        if not isinstance(old, Mapping) or not isinstance(new, Mapping):
            continue
        for key, value in old.items():
            if key in new and not _address_text(value) and not _same(new[key], value):
                changed.append((f"{section}.{key}", value, new[key]))
    return changed


_ADDRESS = re.compile(r"<.* at 0x[0-9a-fA-F]+>")


def _address_text(value: Any) -> bool:
    """Whether a recorded value is an object's text with its address (``<function f at
    0x7f...>``), as checkpoints of an earlier nanolab recorded what had no plain form: it is
    never the same twice, so it is not compared."""
    return isinstance(value, str) and _ADDRESS.search(value) is not None


def _same(a: Any, b: Any) -> bool:
    """Equal values, a NaN (JSON's) included: equal as their JSON text too."""
    return a == b or json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def changed_settings_line(
    changed: list[tuple[str, Any, Any]], classes: Mapping[str, Any], path: Any, branch: str
) -> str:
    """The refusal of a resume that changes a class's own settings: what the run trained with,
    and the two ways on (resume with those values, or branch with the new ones)."""
    from nanolab.training.resume import flag_value

    sections = {key.split(".")[0] for key, _, _ in changed}
    names = sorted(str((classes.get(s) or {}).get("class_path")) for s in sections)
    parts = [
        f"{key} {flag_value(new)} (it trained with {flag_value(old)})" for key, old, new in changed
    ]
    back = " ".join(f"--{key} {flag_value(old)}" for key, old, _ in changed)
    return (
        f"{path} was trained with other settings of {' and '.join(names)}: {', '.join(parts)}; "
        "nanolab cannot tell whether a resume may change a class's own setting, so the run "
        f"goes on only with the values it trained with (resume with {back}, or leave them "
        f"out of the command), or train with the new ones in a branch from this checkpoint: "
        f"{branch}"
    )
