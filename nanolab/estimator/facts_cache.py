"""What the estimator read from a model, kept on disk so the next ``nanolab estimate`` of the same
model starts without torch.

Reading a model's facts needs torch: the parameter tensors and FLOPs per token come from the model
built on the meta device, and two checks (do its FLOPs cover the matmuls it runs; do the
activation rules describe it) run it on fake tensors. Importing torch and its fake-tensor
machinery costs ~2.5 s of CPU per launch, for answers that change only when the model's code does.
So each answer is stored under a key made of

- the question (which fact, the ``GPTConfig`` fields, and what else it depends on),
- a fingerprint of the code that answers it: every ``.py`` file of ``nanolab/model`` and
  ``nanolab/estimator``, so an edit of the model (a fork's ``gpt.py``) or of the estimator is a
  new key, and
- the torch and Python versions.

Only models made entirely of built-in parts are remembered (a project's own variant lives in code
the fingerprint does not cover), and only by a process that imports the model code for the first
time to answer: a process that already imported it (a notebook, a test, ``nanolab fit``) may have
patched a class since, so it reads the live model and neither reads nor writes here. Files are
written atomically; an unreadable or stale file is recomputed. ``NANOLAB_ESTIMATOR_CACHE=0`` turns
the cache off; it lives in ``$XDG_CACHE_HOME/nanolab/estimator`` (``~/.cache/...``), or
``NANOLAB_ESTIMATOR_CACHE=/some/dir``. A user without a home folder (no ``HOME``, no passwd
entry) and no ``XDG_CACHE_HOME`` has no cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

from nanolab.atomic import write_whole
from nanolab.home import home_folder
from nanolab.model.config import GPTConfig

T = TypeVar("T")

#: The module whose import means "the model code is loaded in this process".
MODEL_MODULE = "nanolab.model.gpt"
_PACKAGE = Path(__file__).resolve().parents[1]
_FOLDERS = ("model", "estimator")


class _State:
    #: None until the first question; then whether this process loaded the model code itself.
    pristine: bool | None = None


def cache_dir() -> Path | None:
    """Where answers live, or None when the cache is off (or has nowhere to live: no
    ``XDG_CACHE_HOME`` and no home folder)."""
    setting = os.environ.get("NANOLAB_ESTIMATOR_CACHE", "").strip()
    if setting.lower() in ("0", "off", "false", "no"):
        return None
    if setting and setting.lower() not in ("1", "on", "true", "yes"):
        return Path(setting)
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        home = home_folder()
        if home is None:  # a user id without HOME or a passwd entry: no home, no cache
            return None
        base = str(home / ".cache")
    return Path(base) / "nanolab" / "estimator"


@lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """SHA-256 over the model and estimator sources, the torch version and Python's."""
    from importlib.metadata import PackageNotFoundError, version

    digest = hashlib.sha256()
    for folder in _FOLDERS:
        for path in sorted((_PACKAGE / folder).glob("*.py")):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "none"
    digest.update(f"torch={torch_version} python={sys.version_info[:3]}".encode())
    return digest.hexdigest()


def built_in_only(gpt: GPTConfig) -> bool:
    """Whether every registered part ``gpt`` names is one of nanolab's built-ins."""
    from nanolab.model import registry

    regs = (registry.POSITIONS, registry.NORMS, registry.ATTENTIONS, registry.MLPS)
    return all(getattr(gpt, reg.field) in reg.builtins for reg in regs)


def note_model_code_unloaded() -> None:
    """Decide now, before a caller imports the model code for a reason of its own that leaves
    it as nanolab wrote it (``estimate`` reading a config with fit's parser, which imports
    nanolab's model class), whether this process loads that code itself: the first question
    would otherwise find it loaded and neither read nor write here."""
    if _State.pristine is None:
        _State.pristine = MODEL_MODULE not in sys.modules


def remembered(
    fact: str,
    gpt: GPTConfig,
    question: Any,
    answer: Callable[[], T],
    encode: Callable[[T], Any] = lambda value: value,
    decode: Callable[[Any], T] = lambda data: data,
) -> T:
    """``answer()``, or what it returned for the same ``fact``, model and ``question`` before.

    ``question`` is whatever besides ``gpt`` the answer depends on (JSON-serialisable);
    ``encode``/``decode`` turn the answer into JSON data and back.
    """
    if _State.pristine is None:
        _State.pristine = MODEL_MODULE not in sys.modules
    folder = cache_dir()
    if not _State.pristine or folder is None or not built_in_only(gpt):
        return answer()
    key = json.dumps(
        [fact, sorted(gpt.to_dict().items()), question, code_fingerprint()],
        sort_keys=True,
        default=str,
    )
    path = folder / f"{fact}-{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"
    try:
        stored = json.loads(path.read_text())
        if stored.get("key") == key:
            return decode(stored["answer"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent, unreadable or from other code: compute it again
    value = answer()
    write_json(path, {"key": key, "answer": encode(value)})
    return value


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` under ``path`` atomically; a cache that cannot be written is no error."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(path, json.dumps(data), durable=False)
