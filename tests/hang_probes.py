"""Classes that CLI tests name in a ``nanolab fit`` config to make start-up hang or fail the way
a fork's code might. The subprocess gets ``tests/`` on its ``PYTHONPATH``."""

from __future__ import annotations

import time
from pathlib import Path

import lightning as L


class HangsWhenBuilt(L.Callback):
    """A callback whose constructor does not return for ``seconds`` (a start-up stuck after it
    began to write); it touches ``marker`` first, so a test knows when to signal."""

    def __init__(self, marker: str, seconds: float = 600.0) -> None:
        Path(marker).touch()
        time.sleep(seconds)


class FailsWhenBuilt(L.Callback):
    """A callback whose constructor raises, as a fork's broken callback would."""

    def __init__(self) -> None:
        raise RuntimeError("this callback cannot be built")
