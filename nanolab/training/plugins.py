"""What nanolab needs from a model or data class, and how a class named in a config is loaded.

``model:`` and ``data:`` in a ``nanolab fit`` config are choices: a class path (``--model
myproj.models.MyGPT``, or ``model: {class_path: ..., init_args: ...}`` in YAML) picks the class,
and nanolab's own :class:`~nanolab.training.module.GPTLightningModule` and
:class:`~nanolab.data.datamodule.TokenDataModule` are the defaults. ``fit``, ``queue add``,
``estimate`` and ``bench`` use a class only through the two small protocols below, so any class
that has these members works with every verb (docs/forking.md, "Your own model or data class").

A class path that cannot be imported, or names a class of another kind than its setting takes
(a ``data`` class that is not a LightningDataModule), is reported in one line naming the module
or the class and the fix, before the config parser would report it as a value that "does not
validate".
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

from nanolab.errors import NanolabError

#: The classes a config gets when it names none.
DEFAULT_MODEL = "nanolab.training.module.GPTLightningModule"
DEFAULT_DATA = "nanolab.data.datamodule.TokenDataModule"


class PluginImportError(NanolabError):
    """A class path in the config whose module cannot be imported or lacks the class."""


@runtime_checkable
class DataModuleProtocol(Protocol):
    """What ``fit``, the queue and the estimator need from a LightningDataModule.

    Attributes:
        micro_batch_size: Sequences per device per forward pass (``data.micro_batch_size``;
            ``run.micro_batch_size`` overrides it). With ``block_size`` it makes the tokens of
            one micro-batch, from which gradient accumulation is derived.
        block_size: Tokens per window (one training sequence). ``nanolab fit`` sets it to the
            model's ``gpt.block_size`` when the model has one.

    Optional: ``masked_targets = True`` declares batches whose targets may be ``-1`` (no loss),
    so each optimizer step averages over its targets (nanolab/training/masked_targets.py); a
    ``check_validation_fits(world_size)`` is what ``validate``/``test`` call instead of
    ``check_fits``, so an evaluation need not prepare a training split it never reads.
    """

    micro_batch_size: int
    block_size: int

    @property
    def vocab_size(self) -> int:
        """Token ids the data uses (fills ``model.gpt.vocab_size: null``); may prepare the data."""
        ...

    def check_fits(self, world_size: int) -> None:
        """Raise (a ``ValueError`` naming the setting) when the data cannot fill one optimizer
        step of every rank, so the run fails at start-up rather than after it."""
        ...

    def window_plan(self, world_size: int = 1) -> Any:
        """The order in which training windows are served, a pure function of the settings and
        ``world_size``: an exact resume restarts it at the consumed micro-batch count."""
        ...


@runtime_checkable
class NetworkProtocol(Protocol):
    """What the throughput meter and the run log read from ``LightningModule.model``.

    A module without a ``model`` attribute, or a network without these methods, still trains:
    the log then counts every parameter of the module and leaves ``mfu`` empty.
    """

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (forward + backward) at ``seq_len`` tokens per sequence."""
        ...

    def num_params(self) -> int:
        """Parameter count reported in the run log's ``start`` record."""
        ...


def load_class(class_path: str, where: str) -> type:
    """Import ``package.module.Class``; one :class:`PluginImportError` line when that fails.

    ``where`` names the config key (``model``, ``data``, ``trainer.callbacks``) for the message,
    and, through :func:`expected_base`, the kind of class a "did you mean" may suggest.
    """
    module_name, _, name = str(class_path).rpartition(".")
    if not module_name or not name:
        raise PluginImportError(
            f"{where}: {class_path!r} is not a class path; give package.module.ClassName"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ImportError, and whatever the module raises while importing
        raise PluginImportError(import_failure(err, module_name, class_path, where)) from None
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        near = nearest_class(module, name, expected_base(where))
        hint = f"; did you mean {module_name}.{near}?" if near else ""
        raise PluginImportError(
            f"{where}: module {module_name!r} has no class {name!r} (from {class_path}){hint}"
        )
    check_kind(cls, class_path, where)
    return cls


#: For a module of the class path that is not there: where it could be and why it is not found.
INSTALL_HINT = (
    "install the package that provides it (pip install -e . in your project: a package outside "
    "its src/ is not installed, move it there or put its folder on PYTHONPATH) or fix the name"
)


def import_failure(err: Exception, module_name: str, class_path: str, where: str) -> str:
    """The one line for importing ``module_name`` (of ``class_path``, at config key ``where``)
    having raised ``err``.

    The module itself (or its package) not found is the class path's fault: install it or fix
    the name. Anything else happened inside the fork's module while it ran (a NameError, a
    dependency it imports that is not installed): the line names the file and line it came
    from, and ``-v`` shows the traceback, as for any bug in the fork's code.
    """
    kind = type(err).__name__
    missing = getattr(err, "name", None) if isinstance(err, ModuleNotFoundError) else None
    if missing is not None and (module_name == missing or module_name.startswith(missing + ".")):
        return (
            f"{where}: cannot import module {module_name!r} for {class_path} ({kind}: {err}); "
            f"{INSTALL_HINT}"
        )
    import traceback

    from nanolab.messages import debug

    debug("nanolab", "".join(traceback.format_exception(err)).rstrip())
    at = raised_at(err)
    if missing is None:
        fix = "fix the module (-v shows the traceback)"
    elif missing.partition(".")[0] == module_name.partition(".")[0]:
        fix = f"the module imports {missing!r}, which its package does not have: fix the import"
    else:
        fix = (
            f"install the package that provides {missing!r} in this environment (the module "
            "imports it)"
        )
    return (
        f"{where}: importing module {module_name!r} for {class_path} failed"
        + (f" at {at}" if at else "")
        + f" ({kind}: {err}); {fix}"
    )


def raised_at(err: BaseException) -> str | None:
    """``file:line`` where ``err`` was raised: a syntax error's own place, else the innermost
    frame of its traceback that is a file (not importlib's frozen machinery)."""
    import traceback

    if isinstance(err, SyntaxError) and err.filename:
        return f"{err.filename}:{err.lineno}"
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith("<")]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None


#: What a class at each config key should subclass, for the error line that refuses another.
SUBCLASS_FIX = {
    "model": "subclass nanolab's GPTLightningModule (docs/forking.md)",
    "data": "subclass nanolab's TokenDataModule (docs/forking.md)",
    "trainer.callbacks": "subclass lightning.pytorch.Callback (docs/callbacks.md)",
}


def check_kind(cls: type, class_path: str, where: str) -> None:
    """Refuse a class that is not of the kind ``where`` takes (:func:`expected_base`) in one
    line with the fix: the parser would say it "does not validate against any of the Union
    subtypes", and a class of another kind (a DataModule given as ``--model``) is named as
    what it is."""
    base = expected_base(where)
    if base is None or issubclass(cls, base):
        return
    others = [b for b in map(expected_base, SUBCLASS_FIX) if b is not None and issubclass(cls, b)]
    what = f"a {others[0].__name__}, not a {base.__name__}" if others else f"not a {base.__name__}"
    raise PluginImportError(f"{where}: {class_path} is {what}; {SUBCLASS_FIX[where]}")


def expected_base(where: str) -> type | None:
    """The class a class named at the config key ``where`` must subclass (the config parser
    refuses any other), or None for a key without one."""
    import lightning as L

    bases = {
        "model": L.LightningModule,
        "data": L.LightningDataModule,
        "trainer.callbacks": L.Callback,
    }
    return bases.get(where)


def nearest_class(module: Any, name: str, base: type | None = None) -> str | None:
    """The class ``module`` defines whose name is nearest ``name`` (a typo of it), or None.

    Only classes defined there or, for a package, in its own submodules (``nanolab.callbacks``
    re-exports ``MetricsLog``), not those it imports from elsewhere, such as the base it
    subclasses: the suggestion is the module's own, ``Modle`` -> ``Model``, never
    ``GPTLightningModule``; and, given ``base``, only its subclasses, so the suggestion is one
    the setting takes (a config dataclass ``LossCfg`` next to the model is never offered for
    ``--model ...LossCfgg``, a ``Tokenizer`` or a function next to a callback never for
    ``--trainer.callbacks+=...Tokenize``)."""
    import difflib

    package = hasattr(module, "__path__")
    defined = [
        key
        for key, value in vars(module).items()
        if isinstance(value, type)
        and (
            value.__module__ == module.__name__
            or (package and value.__module__.startswith(module.__name__ + "."))
        )
        and (base is None or issubclass(value, base))
    ]
    near = difflib.get_close_matches(name, defined, n=1, cutoff=0.6)
    if not near:  # a case slip: ``model`` for ``Model``
        near = [key for key in defined if key.lower() == name.lower()]
    return near[0] if near else None


def class_defaults(class_path: str, where: str) -> Any:
    """The arguments of the class at ``class_path`` at its own defaults, as the fit parser reads
    its ``__init__`` (and, through ``**kwargs``, its bases'): a jsonargparse Namespace (its
    ``as_dict()`` is plain data). ``fit`` gives a class chosen by class path these, with the
    settings given on top (:mod:`nanolab.run.class_choice`), and ``estimate`` reads the same.
    """
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    # The options the fit parser gives a class of ``model``/``data`` (LightningCLI's subclass mode)
    parser.add_class_arguments(load_class(class_path, where), fail_untyped=False, sub_configs=True)
    return parser.get_defaults()


def class_paths_in_argv(argv: list[str]) -> list[tuple[str, str]]:
    """``(where, class_path)`` for ``--model X``, ``--data=X``, ``--model.class_path X``,
    ``--trainer.callbacks+=X`` ...: the flags that name a class, as
    :func:`class_paths_in_config` finds the same keys in a file (both are checked alike).

    Only dotted values are class paths; a bare name (``--model GPTLightningModule``) is left to
    the parser, which resolves the names of classes it already knows, and so is a YAML or JSON
    value (``--trainer.callbacks '[...]'``).
    """
    found = []
    flags = {"--model": "model", "--data": "data"}
    flags.update({f"{flag}.class_path": where for flag, where in list(flags.items())})
    flags.update(
        {"--trainer.callbacks": "trainer.callbacks", "--trainer.callbacks+": "trainer.callbacks"}
    )
    for i, arg in enumerate(argv):
        flag, sep, value = arg.partition("=")
        if flag not in flags:
            continue
        if not sep:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        literal = any(c in value for c in "{[") or value.endswith((".yaml", ".yml", ".json"))
        if "." in value and not literal:
            found.append((flags[flag], value))
    return found


def class_paths_in_config(config: Any) -> list[tuple[str, str]]:
    """``(where, class_path)`` for ``model``/``data``/``trainer.callbacks`` in one YAML mapping."""
    if not isinstance(config, dict):
        return []
    found = []
    for key in ("model", "data"):
        node = config.get(key)
        if isinstance(node, str) and "." in node:
            found.append((key, node))
        elif isinstance(node, dict) and isinstance(node.get("class_path"), str):
            found.append((key, node["class_path"]))
    trainer = config.get("trainer")
    callbacks = trainer.get("callbacks") if isinstance(trainer, dict) else None
    if isinstance(callbacks, dict):
        callbacks = [callbacks]
    for item in callbacks if isinstance(callbacks, list) else []:
        if isinstance(item, dict) and isinstance(item.get("class_path"), str):
            found.append(("trainer.callbacks", item["class_path"]))
    return found


def check_importable(paths: Iterable[tuple[str, str]]) -> None:
    """Import every named class first and check its kind, so a broken plug-in or a class of
    the wrong kind is one line, not a parser error."""
    for where, class_path in paths:
        if "." in class_path:
            load_class(class_path, where)


#: What Lightning's Trainer needs to run each verb (its "expects as minimum"), by the config key
#: of the class that should have it, and the nanolab class that has it.
NEEDED = {
    "fit": (
        ("model", "training_step"),
        ("model", "configure_optimizers"),
        ("data", "train_dataloader"),
    ),
    "validate": (("model", "validation_step"),),
    "test": (("model", "test_step"),),
}


def check_needed_methods(verb: str, model: Any, data: Any) -> None:
    """Refuse a model or data class without a method Lightning needs for ``verb`` (a
    LightningModule without ``training_step``) before the run directory is claimed: one line
    naming the class and the fix, not Lightning's ``MisconfigurationException`` traceback from
    inside ``trainer.fit``. A dataloader may come from either class, as Lightning allows."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    from nanolab.errors import RunConfigError

    built = {"model": model, "data": data}
    for where, method in NEEDED.get(verb, ()):
        holders = (model, data) if method.endswith("_dataloader") else (built[where],)
        if any(h is not None and is_overridden(method, h) for h in holders):
            continue
        cls = type(built[where])
        raise RunConfigError(
            f"{where}: {cls.__module__}.{cls.__qualname__} has no {method}() method, which "
            f"nanolab {verb} needs; define it, or {SUBCLASS_FIX[where]}"
        )
