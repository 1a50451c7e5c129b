"""The GPT model and its configuration."""

from nanolab.model.config import ConfigError, GPTConfig
from nanolab.model.gpt import GPT

__all__ = ["GPT", "ConfigError", "GPTConfig"]
