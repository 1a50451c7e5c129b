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

import inspect
import json
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
    """The settings of ``init_args`` that are ``cls``'s own (no nanolab class defines them), as
    plain data (what JSON can hold; anything else as its text)."""
    ours = nanolab_parameters(cls)
    own = {k: v for k, v in init_args.items() if k not in ours and not k.startswith("__")}
    return json.loads(json.dumps(own, default=str))


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
            if key in new and not _same(new[key], value):
                changed.append((f"{section}.{key}", value, new[key]))
    return changed


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
