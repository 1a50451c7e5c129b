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
from typing import Any

from nanolab.errors import RunConfigError
from nanolab.model.config import GPTConfig


class OtherNetworkError(RunConfigError):
    """A model class the estimator cannot describe: its network is not nanolab's GPT of its
    ``model.gpt``. Whatever vocabulary an estimate guesses, the verdict is the same, so the
    callers that retry an unprepared data's config with a guessed one do not retry this."""


def other_network(model_class: str, model_args: Mapping[str, Any], gpt: GPTConfig) -> str | None:
    """The refusal for a ``model_class`` whose network is not nanolab's GPT of ``gpt`` (another
    parameter count, or a class that cannot be built from the config to count), else None.
    ``model_args`` is the config's ``model`` section (class path resolved): the class's own
    settings are passed to it, nanolab's keep their defaults (they change no shape: ``gpt`` is
    given resolved, without ``init_from``'s weights)."""
    own = {k: v for k, v in model_args.items() if k != "gpt"}
    counts = _parameter_counts(
        model_class,
        json.dumps(own, default=str, sort_keys=True),
        json.dumps(gpt.to_dict(), sort_keys=True),
    )
    if isinstance(counts, str):
        return counts
    trains, plain = counts
    if trains == plain:
        return None
    return (
        f"model {model_class} trains another network than nanolab's GPT ({trains:,} "
        f"parameters, not {plain:,}); it cannot be estimated: the estimator describes only the "
        "GPT of model.gpt (its parameters, memory and time); fit trains the class all the same "
        "(docs/estimate.md, 'A model class of your own')"
    )


@functools.lru_cache(maxsize=16)
def _parameter_counts(model_class: str, own_json: str, gpt_json: str) -> tuple[int, int] | str:
    """(the class's parameters, nanolab's GPT's) built on the meta device, or the line saying
    the class could not be built. Cached: ``largest_fitting_micro_batch`` and the queue read
    one config many times."""
    import torch

    from nanolab.model import GPT
    from nanolab.training.class_settings import nanolab_parameters
    from nanolab.training.plugins import load_class

    cls = load_class(model_class, "model")  # imported already: the caller checked it
    ours = nanolab_parameters(cls)
    kwargs = {k: v for k, v in json.loads(own_json).items() if k not in ours}
    gpt = GPTConfig(**json.loads(gpt_json))
    try:
        with torch.device("meta"):
            module = cls(gpt=gpt, **kwargs)
            configure = getattr(module, "configure_model", None)
            if getattr(module, "model", True) is None and callable(configure):
                configure()  # a class that builds its network only there
            plain = GPT(gpt)
    except Exception as err:  # the class's own error: named, not the GPT's numbers
        first = (str(err).splitlines() or [""])[0]
        return (
            f"model {model_class} cannot be estimated: building it from the config to count its "
            f"parameters failed ({type(err).__name__}: {first}); the estimator describes "
            "nanolab's GPT of model.gpt only where the class builds that network; fit trains it "
            "all the same (docs/estimate.md, 'A model class of your own')"
        )
    return _count(module), _count(plain)


def _count(module: Any) -> int:
    """Unique parameters (a tied head once)."""
    return sum(p.numel() for p in module.parameters())
