"""Name -> class registries for the model's swappable parts: attention, MLP, norm, positions.

A config names each part (``model.gpt.norm: rmsnorm``); the model looks the class up here, and
``GPTConfig`` validates the name against what is registered, so the allowed values have one
source. A new variant is one class with one decorator, in any module::

    from nanolab.model.registry import register_mlp

    @register_mlp("my_mlp")
    class MyMLP(nn.Module):
        def __init__(self, config): ...

Registration happens when that module is imported; docs/forking.md ("Adding a model variant")
shows how a project makes sure it is imported before the config is read. This module imports no
torch: the built-in variants live in :mod:`nanolab.model.gpt`, which is imported the first
time a class is asked for. Each registry also knows its built-in names (and which of them check
the config) without that import, so validating a config of built-in parts — what ``nanolab
estimate`` does for the stock recipes — costs no torch import; a test checks those names against
what ``gpt`` registers.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from nanolab import installed_plugins
from nanolab.errors import NanolabError

T = TypeVar("T")

#: The module whose import registers the built-in variants.
BUILTINS = "nanolab.model.gpt"


class Registry:
    """Classes of one kind of model part, by the name a config uses for them.

    Args:
        kind: What the classes are (``"attention"``), for messages.
        field: The ``model.gpt`` field that names one (``"attention_variant"``), for messages.
        builtins: The names :mod:`nanolab.model.gpt` registers, each with whether its class
            has a ``validate_config`` (known here so those names validate without torch).
    """

    def __init__(self, kind: str, field: str, builtins: Mapping[str, bool]) -> None:
        self.kind = kind
        self.field = field
        self.builtins = dict(builtins)
        self._classes: dict[str, type] = {}

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        """Decorator: make ``cls`` selectable as ``model.gpt.<field>: name``.

        Registering a second class under a taken name is refused (two modules silently
        replacing each other's variant would change a model without a word); registering the
        same class again (a module imported twice, e.g. as a script and as a package) is fine.
        """
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"a {self.kind} name must be an identifier, got {name!r}")

        def add(cls: type[T]) -> type[T]:
            if name in self.builtins and cls.__module__ != BUILTINS:
                raise ValueError(
                    f"{self.kind} {name!r} is a built-in variant ({BUILTINS}); "
                    f"pick another name for {_qualname(cls)}"
                )
            have = self._classes.get(name)
            if have is not None and _qualname(have) != _qualname(cls):
                raise ValueError(
                    f"{self.kind} {name!r} is already registered by {_qualname(have)}; "
                    f"pick another name for {_qualname(cls)}"
                )
            self._classes[name] = cls
            return cls

        return add

    def names(self) -> list[str]:
        """Registered names, built-ins first, in registration order."""
        return list(self.builtins) + [n for n in self._classes if n not in self.builtins]

    def get(self, name: str) -> type:
        """The class registered as ``name``; an unknown name lists the registered ones."""
        _load_builtins()
        installed_plugins.known_after_plugins(name, self._classes)  # a project's, on first need
        try:
            return self._classes[name]
        except KeyError:
            raise KeyError(self.unknown(name)) from None

    def unknown(self, name: Any) -> str:
        """The one-line message for a name nothing is registered under."""
        known = ", ".join(repr(n) for n in self.names())
        return (
            f"model.gpt.{self.field} must be one of the registered {self.kind} variants "
            f"({known}), got {name!r}; a variant of your own registers itself when its module "
            f"is imported: name that module in your package's '{PLUGIN_GROUP}' entry point "
            f"(pip install -e . again after editing entry points), or "
            f"pass --import MODULE to generate/eval/export (docs/forking.md, 'Adding a model "
            f"variant')"
        )

    def module_of(self, name: str) -> str | None:
        """The module that registered ``name``, for a variant of a project's own (None for a
        built-in or an unknown name): a checkpoint records it, so a later command can say
        which module to import."""
        if name in self.builtins:
            return None
        cls = self._classes.get(name)
        return None if cls is None else cls.__module__

    def config_check(self, name: str) -> Callable[[Any], None] | None:
        """The ``validate_config`` of the class registered as ``name``, if it has one.

        A built-in without one answers without importing the built-ins (and torch).
        """
        if self.builtins.get(name) is False:
            return None
        return getattr(self.get(name), "validate_config", None)

    def __contains__(self, name: object) -> bool:
        if name in self.builtins:
            return True
        return installed_plugins.known_after_plugins(name, self._classes)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


#: The entry-point group whose modules register a project's own variants (and optimizers):
#: :mod:`nanolab.installed_plugins`, which every registry asks before it calls a name unknown.
PLUGIN_GROUP = installed_plugins.PLUGIN_GROUP
load_plugins = installed_plugins.load_plugins


def imports_needed(modules: Iterable[str]) -> list[str]:
    """Which of ``modules`` (those that registered a checkpoint's own model parts) a command
    that builds the model from the checkpoint alone (generate, eval, export) must be given with
    ``--import``: each that no installed ``nanolab.plugins`` entry point names or imports,
    the modules those commands import by themselves (:func:`load_plugins`; loaded here where
    this process has not yet: the same installed code). A plugin that fails to import covers
    only its own name."""
    from importlib.metadata import entry_points

    plugged = {point.value.split(":")[0].strip() for point in entry_points(group=PLUGIN_GROUP)}
    with contextlib.suppress(NanolabError):  # that command says why; here they are not known
        load_plugins()
    covered = plugged | installed_plugins.plugin_modules()
    return [m for m in dict.fromkeys(modules) if m not in covered]


def add_import_option(parser: Any) -> None:
    """``--import MODULE`` (repeatable) on a verb that builds a model from a checkpoint alone
    (generate, eval, export), read by :func:`import_modules`."""
    parser.add_argument(
        "--import",
        dest="imports",
        action="append",
        metavar="MODULE",
        help="a module that registers model parts of your own (repeatable; a project "
        "installed with a nanolab.plugins entry point needs none): docs/forking.md",
    )


def import_modules(modules: list[str] | None) -> None:
    """Import the modules a command's ``--import`` names (a project's variants, not installed
    as a package); one line naming the module when one cannot be imported."""
    for name in modules or []:
        try:
            importlib.import_module(name)
        except Exception as err:
            raise NanolabError(
                f"--import {name}: cannot import it ({type(err).__name__}: {err}); give a "
                "module importable from here (PYTHONPATH, or pip install -e your project)"
            ) from None


def _load_builtins() -> None:
    """Import the built-in variants once (a module being imported is already in sys.modules,
    so a registry read while they register does not import them again)."""
    if BUILTINS not in sys.modules:
        importlib.import_module(BUILTINS)


# Built-in names -> whether the class checks the config (RoPE needs an even head size).
ATTENTIONS = Registry("attention", "attention_variant", {"causal": False, "qk_norm": False})
MLPS = Registry("MLP", "mlp", {"gelu": False, "relu2": False, "swiglu": False})
NORMS = Registry("normalization", "norm", {"layernorm": False, "rmsnorm": False})
POSITIONS = Registry("position encoding", "position_embedding", {"learned": False, "rope": True})

register_attention = ATTENTIONS.register
register_mlp = MLPS.register
register_norm = NORMS.register
register_position = POSITIONS.register


#: Every registry, by the ``model.gpt`` field that names its part.
REGISTRIES = {r.field: r for r in (ATTENTIONS, MLPS, NORMS, POSITIONS)}


def part_modules(gpt_config: Any) -> dict[str, str]:
    """``{field: module}`` for the parts of ``gpt_config`` that a project registered (not
    built in): what a checkpoint records, so a command loading it can name the ``--import``."""
    out = {}
    for field, registry in REGISTRIES.items():
        module = registry.module_of(getattr(gpt_config, field, None))
        if module is not None:
            out[field] = module
    return out
