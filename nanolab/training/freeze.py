"""Freezing part of a model for fine-tuning (``model.freeze``).

Fine-tuning a pretrained GPT on a small corpus overfits fast; keeping the embeddings and the
lowest blocks as they were is the usual remedy (and saves their gradients and optimizer state).
Frozen parameters get ``requires_grad=False``, so the optimizer never sees them (see
:func:`~nanolab.training.optim.parameter_groups`); checkpoints still hold them.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from nanolab.model.config import ConfigError


@dataclass
class FreezeConfig:
    """What fine-tuning leaves unchanged.

    Args:
        embeddings: Token and position embeddings. With a tied head (GPT-2) the head is the
            token embedding, so it stays unchanged too.
        blocks: The first ``blocks`` transformer blocks (0 = none).
    """

    embeddings: bool = False
    blocks: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.blocks, bool) or not isinstance(self.blocks, int) or self.blocks < 0:
            raise ConfigError(
                f"model.freeze.blocks must be an integer >= 0 (the first N blocks), "
                f"got {self.blocks!r}"
            )


def apply_freeze(model: nn.Module, freeze: FreezeConfig) -> list[str]:
    """Turn off gradients for what ``freeze`` names; returns the frozen parameter names."""
    n_layer = len(model.blocks)
    if freeze.blocks > n_layer:
        raise ConfigError(
            f"model.freeze.blocks {freeze.blocks} is more than the model's {n_layer} blocks "
            f"(model.gpt.n_layer); choose 0 to {n_layer}"
        )
    modules: list[nn.Module] = list(model.blocks[: freeze.blocks])
    if freeze.embeddings:
        modules += [m for m in (model.wte, model.wpe) if m is not None]
    frozen = {id(p) for m in modules for p in m.parameters()}
    names = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in frozen:
            p.requires_grad_(False)
            names.append(name)
    return names
