"""The installed projects' ``nanolab.plugins`` entry points, imported once, on first need.

A project installed with ``pip install -e .`` declares, in its pyproject.toml,
``[project.entry-points."nanolab.plugins"] myproj = "myproj.layers"``; importing that module
registers what it adds: model parts (``register_attention`` ... in
:mod:`nanolab.model.registry`) and optimizers (``register_optimizer`` in
:mod:`nanolab.training.optim`). Every registry calls :func:`load_plugins` before it answers
that a name is unknown, so a name a plugin registers is known to every verb that reads a
config (fit, queue add, estimate) and to those that build a model from a checkpoint alone.

Only installed code is imported here, which the user chose to install: nothing a checkpoint or
a config names is imported because a file names it. This module imports no torch (a plugin
may).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Container

from nanolab.errors import NanolabError

#: The entry-point group whose modules register a project's own parts.
PLUGIN_GROUP = "nanolab.plugins"
#: The entry points' values imported so far, after a first ``""`` that marks "done" (also when
#: none is installed).
_plugins_loaded: list[str] = []
#: The error line of the entry point that failed to import (None: none failed): said again by
#: every later call, since the entry points after it were never imported and a name one of
#: them registers would otherwise read as unknown ("not a registered optimizer").
_load_error: str | None = None
#: Every module the plugins' imports brought in (a plugin's package importing its own layers
#: module): a command that loads the plugins has those too, without ``--import``.
_plugin_modules: set[str] = set()


def load_plugins() -> list[str]:
    """Import the modules of every installed ``nanolab.plugins`` entry point, once per process;
    their names. A plugin that fails to import is an error naming it (a half-registered
    project would otherwise read as an unknown name), on this call and every later one. A
    plugin's own import that asks again (its module importing a registry) gets those imported
    so far."""
    global _load_error
    if _plugins_loaded:
        if _load_error is not None:
            raise NanolabError(_load_error)
        return _plugins_loaded[1:]
    _load_error = None
    _plugins_loaded.append("")  # marks "started", so a plugin's own import does not loop
    from importlib.metadata import entry_points

    for point in entry_points(group=PLUGIN_GROUP):
        before = set(sys.modules)
        try:
            importlib.import_module(point.value.split(":")[0])
        except Exception as err:
            _load_error = (
                f"the {PLUGIN_GROUP} entry point {point.name!r} = {point.value!r} failed to "
                f"import ({type(err).__name__}: {err}); fix that module or uninstall its package"
            )
            raise NanolabError(_load_error) from None
        finally:
            _plugin_modules.update(set(sys.modules) - before)
        _plugins_loaded.append(point.value)
    return _plugins_loaded[1:]


def plugin_modules() -> set[str]:
    """The modules the loaded plugins imported (empty before :func:`load_plugins`)."""
    return set(_plugin_modules)


def known_after_plugins(name: object, registered: Container[object]) -> bool:
    """Whether ``name`` is in ``registered``, loading the installed plugins first when it is not
    yet: the one lookup every registry makes before it calls a name unknown."""
    if name in registered:
        return True
    load_plugins()
    return name in registered
