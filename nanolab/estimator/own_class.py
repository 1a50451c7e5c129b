"""Whether a model class of a project's own trains the GPT its ``model.gpt`` describes.

The estimator reads a model from ``model.gpt`` alone (parameters, memory and FLOPs of nanolab's
GPT). A ``GPTLightningModule`` subclass that only changes the loss trains exactly that GPT; one
that overrides ``_build_model`` (a mixture of experts in each block, say) trains another
network, and the GPT's numbers would be false for it. So the class is built once on the meta
device (no memory, no initialisation cost: shapes only) with the config's settings, and its
parameter count compared with the GPT's: another count is one line naming the class, rather
than the plain GPT's estimate.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nanolab.errors import RunConfigError
from nanolab.model.config import GPTConfig


class OtherNetworkError(RunConfigError):
    """A model class the estimator cannot describe: its network is not nanolab's GPT of its
    ``model.gpt``. Whatever vocabulary an estimate guesses, the verdict is the same, so the
    callers that retry an unprepared data's config with a guessed one do not retry this."""


#: How far a class's parameter count may be from its GPT's and still be estimated as that GPT
#: (a learned temperature, a gate: a few parameters change no memory or time the estimate
#: could show); beyond it the class trains another network.
NEAR_SHARE = 0.01


@dataclass(frozen=True)
class OwnClassVerdict:
    """What the estimator makes of a model class of a project's own: ``refusal`` (its
    network is not the GPT), else ``note`` (one line said with the GPT's estimate; "" when the
    class trains exactly that GPT)."""

    refusal: str | None = None
    note: str = ""


def own_class_verdict(
    model_class: str, model_args: Mapping[str, Any], gpt: GPTConfig
) -> OwnClassVerdict:
    """Whether ``model_class`` trains nanolab's GPT of ``gpt``: the same parameter count (no
    note), one within :data:`NEAR_SHARE` (estimated as the GPT, the difference said), one
    further (refused), or a class that cannot be built from the config to count (estimated as
    the GPT, said: fit may build it where this count could not). ``model_args`` is the
    config's ``model`` section (class path resolved): the class's own settings are given to it
    as the fit parser instantiates them (a dataclass, a function by its path), nanolab's keep
    their defaults (they change no shape: ``gpt`` is given resolved, without ``init_from``'s
    weights)."""
    from nanolab.training.class_settings import plain_settings

    own = plain_settings({k: v for k, v in model_args.items() if k != "gpt"})
    counts = _parameter_counts(
        model_class,
        json.dumps(own, sort_keys=True),
        json.dumps(gpt.to_dict(), sort_keys=True),
    )
    as_gpt = (
        "estimated as nanolab's GPT of model.gpt (docs/estimate.md, 'A model class of your own')"
    )
    if isinstance(counts, str):
        return OwnClassVerdict(note=f"model {model_class} {counts}; {as_gpt}")
    trains, plain = counts
    if trains == plain:
        return OwnClassVerdict()
    if abs(trains - plain) <= NEAR_SHARE * plain:
        apart = abs(trains - plain)
        words = f"{apart:,} parameter{'s' if apart > 1 else ''} " + (
            "more" if trains > plain else "fewer"
        )
        return OwnClassVerdict(
            note=f"model {model_class} has {words} than nanolab's GPT ({trains:,}, not "
            f"{plain:,}: {apart / plain:.2%}, within {NEAR_SHARE:.0%}); {as_gpt}"
        )
    return OwnClassVerdict(
        refusal=f"model {model_class} trains another network than nanolab's GPT ({trains:,} "
        f"parameters, not {plain:,}); it cannot be estimated: the estimator describes only the "
        "GPT of model.gpt (its parameters, memory and time); fit trains the class all the same "
        "(docs/estimate.md, 'A model class of your own')"
    )


@functools.lru_cache(maxsize=16)
def _parameter_counts(model_class: str, own_json: str, gpt_json: str) -> tuple[int, int] | str:
    """(the class's parameters, nanolab's GPT's) built on the meta device, or the words saying
    why the class could not be built. Cached: ``largest_fitting_micro_batch`` and the queue
    read one config many times."""
    import torch

    from nanolab.model import GPT
    from nanolab.training.plugins import load_class

    cls = load_class(model_class, "model")  # imported already: the caller checked it
    gpt = GPTConfig(**json.loads(gpt_json))
    try:
        kwargs = _instantiated(cls, json.loads(own_json))
        with torch.device("meta"):
            module = cls(gpt=gpt, **kwargs)
            configure = getattr(module, "configure_model", None)
            if getattr(module, "model", True) is None and callable(configure):
                configure()  # a class that builds its network only there
            plain = GPT(gpt)
    except Exception as err:  # the class's own error: named, not hidden
        first = (str(err).splitlines() or [""])[0]
        return (
            "could not be built from the config to count its parameters "
            f"({type(err).__name__}: {first})"
        )
    return _count(module), _count(plain)


def _instantiated(cls: type, own: dict[str, Any]) -> dict[str, Any]:
    """The class's own settings (``own``, plain data; the rest at the class's defaults) as the
    fit parser gives them to its ``__init__``: a dataclass or a class as an instance, a
    function path as the function."""
    from jsonargparse import ArgumentParser

    from nanolab.training.class_settings import nanolab_parameters

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, fail_untyped=False, sub_configs=True)
    parsed = parser.parse_object(own)
    build = getattr(parser, "instantiate", None) or parser.instantiate_classes
    values = build(parsed)
    ours = nanolab_parameters(cls)
    return {k: v for k, v in vars(values).items() if k not in ours and not k.startswith("__")}


def _count(module: Any) -> int:
    """Unique parameters (a tied head once)."""
    return sum(p.numel() for p in module.parameters())
