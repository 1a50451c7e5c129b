"""The GPT model (``gpt``) and its configuration (``config``).

``GPT`` is imported lazily: importing the package does not import torch (validating a
``GPTConfig`` does, for the registered variants in :mod:`nanolab.model.gpt`).
"""

from typing import Any

from nanolab.model.config import ConfigError, GPTConfig

__all__ = ["GPT", "ConfigError", "GPTConfig"]


def __getattr__(name: str) -> Any:
    if name == "GPT":
        from nanolab.model.gpt import GPT

        return GPT
    raise AttributeError(f"module 'nanolab.model' has no attribute {name!r}")
