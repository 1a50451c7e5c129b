"""What a checkpoint may hold: plain data that ``torch.load(weights_only=True)`` reads back.

Every nanolab reader of a checkpoint (a resume, validate and test, generate, export) loads it
with ``weights_only=True``: a checkpoint is data, never code. That loader refuses any pickled
class or function outside torch's short allowlist (tensors, dicts, lists, tuples, numbers,
strings, ``OrderedDict``, dtypes ...), so one numpy float in a fork callback's ``state_dict()``
makes the whole file unreadable to every one of them. ``nanolab fit`` therefore checks each
checkpoint before it writes it (:func:`unloadable_value`) and refuses to save one no reader
could load, and the readers name the refused class (:func:`refused_global`) rather than
calling the file foreign.

The check serializes the checkpoint with every tensor replaced by one empty tensor and loads
that back through torch's own weights-only rules, so it is exactly as strict as the readers and
costs milliseconds however large the weights are. It applies torch's rules alone: a class a
fork allowed with ``torch.serialization.add_safe_globals`` is allowed only in the processes
that import the fork (fit, validate), not in ``generate``/``export``, which read the file alone.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from nanolab.errors import NanolabError

#: How torch names the class it refused: ``Unsupported global: GLOBAL numpy._core.multiarray.
#: scalar was not an allowed global``, or for a module it blocks outright ``Trying to load
#: unsupported GLOBAL os.system whose module os is blocked``.
_REFUSED = re.compile(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) ([\w.]+)")

#: Who put each top-level entry of a Lightning checkpoint there, for the error line.
_OWNERS = {
    "state_dict": "the module's state_dict()",
    "hyper_parameters": "the module's saved hyperparameters",
    "nanolab": "the module's checkpoint section",
    "optimizer_states": "the optimizer's state_dict()",
    "lr_schedulers": "the LR scheduler's state_dict()",
    "loops": "Lightning's loop state",
    "datamodule_hyper_parameters": "the data module's saved hyperparameters",
}

#: What to store instead, said by the error line and docs/callbacks.md.
PLAIN_DATA_FIX = (
    "store plain data instead (float(x), int(x), x.tolist(), torch.tensor(x), dicts and "
    "lists of those)"
)


class UnloadableStateError(NanolabError):
    """A checkpoint about to be saved holds a value no ``weights_only`` load reads back."""


def refused_global(err: BaseException) -> str | None:
    """The class or function a ``weights_only`` load refused, as torch names it
    (``numpy._core.multiarray.scalar``); None when ``err`` is another failure."""
    found = _REFUSED.search(str(err))
    return found.group(1) if found else None


def refused_text(name: str) -> str:
    """Why a checkpoint holding the pickled global ``name`` cannot be read, for a reader's line."""
    return (
        f"it holds a pickled {name}, which weights_only loading refuses (a checkpoint is data, "
        "never code; docs/callbacks.md, Checkpoints, says what a callback's state may hold)"
    )


def _weights_only_refusal(value: Any) -> str | None:
    """Why no reader could load ``value`` back (None: a ``weights_only`` load reads it), as a
    clause of the error line. Every tensor in dicts, lists and tuples is replaced by one empty
    tensor (their bytes are beside the point) and torch's own allowlist alone is in force.
    Any failure of the check itself is an answer too, never the save's traceback: a value
    ``torch.save`` cannot pickle (a lock, a lambda), or a frozen dataclass, which Lightning's
    tensor walk refuses to rebuild (weights_only refuses its class anyway)."""
    empty = torch.empty(0)
    try:
        stripped = apply_to_collection(value, torch.Tensor, lambda _: empty)
    except Exception:  # a frozen dataclass among the values: a class weights_only refuses
        return _refuses(_class_name(value))
    buffer = io.BytesIO()
    try:
        # torch.serialization's own names, not torch.save/torch.load: code that wraps
        # torch.save to watch or fail the checkpoint's writes (a fork's, a test's) sees the
        # real write alone.
        torch.serialization.save(stripped, buffer)
    except Exception as err:  # not picklable at all: nothing could even write it
        first = (str(err).strip().splitlines() or [""])[0][:200]
        return f"torch.save cannot write it ({type(err).__name__}: {first})"
    buffer.seek(0)
    allowed = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()  # what generate and export, importing no fork, see
    try:
        torch.serialization.load(buffer, map_location="cpu", weights_only=True)
    except Exception as err:  # UnpicklingError: the refused global, as torch names it
        return _refuses(refused_global(err) or str(err).strip().splitlines()[0][:200])
    finally:
        torch.serialization.add_safe_globals(allowed)
    return None


def _refuses(name: str) -> str:
    return "every nanolab reader loads a checkpoint with weights_only=True, which refuses " + name


def _class_name(value: Any) -> str:
    kind = type(value)
    return f"{kind.__module__}.{kind.__qualname__}"


def _children(value: Any) -> Iterator[tuple[str, Any]]:
    """``(how to reach it, item)`` for each item of a dict, list or tuple."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield f"[{key!r}]", item
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield f"[{i}]", item


def _innermost(value: Any, where: str) -> tuple[str, Any]:
    """The deepest item under ``value`` (reached by ``where``) that alone is refused."""
    for step, item in _children(value):
        if _weights_only_refusal(item) is not None:
            return _innermost(item, where + step)
    return where, value


def unloadable_value(checkpoint: Mapping[str, Any]) -> str | None:
    """One line naming the value of ``checkpoint`` that a ``weights_only`` load refuses, who
    stored it, its type and the fix; None when every reader can load the checkpoint (the
    common case, decided by one check of the whole)."""
    if _weights_only_refusal(dict(checkpoint)) is None:
        return None
    for key, item in checkpoint.items():
        if _weights_only_refusal(item) is None:
            continue
        if key == "callbacks" and isinstance(item, Mapping):
            for state_key, state in item.items():
                if _weights_only_refusal(state) is not None:
                    return _line(f"callback {state_key}'s state_dict()", *_innermost(state, ""))
        owner = _OWNERS.get(str(key), f"the checkpoint's entry {key!r}")
        return _line(owner, *_innermost(item, ""))
    return _line("the checkpoint", "", checkpoint)  # only a dict subclass refused


def _line(owner: str, where: str, bad: Any) -> str:
    """The error line for the value ``bad``, reached by ``where`` in what ``owner`` stored."""
    return (
        f"{owner}{where} is a {_class_name(bad)}, which no checkpoint can hold: "
        f"{_weights_only_refusal(bad)}; {PLAIN_DATA_FIX}"
    )
