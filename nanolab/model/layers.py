"""The model's registered parts, now in :mod:`nanolab.model.gpt` (the whole model in one file).

Kept so that ``from nanolab.model.layers import CausalSelfAttention`` (a fork's variant that
subclasses a built-in one) keeps working.
"""

from nanolab.model.gpt import (  # noqa: F401
    MLP,
    CausalSelfAttention,
    LayerNorm,
    LearnedPositions,
    QKNormAttention,
    ReLU2MLP,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    swiglu_hidden,
)
