"""GPT architecture hyper-parameters, validated when they are made.

A config that cannot describe a real model (``n_embd`` not divisible by ``n_head``, a RoPE head
with an odd dimension, a negative dropout, ...) fails here, with the field named, rather than as a
shape error deep inside the first forward pass.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

from nanolab.errors import NanolabError, written_whole

AttentionImpl = Literal["sdpa", "math", "flex"]
Activation = Literal["gelu_tanh", "gelu"]


class ConfigError(NanolabError):
    """A configuration value that cannot work; the message names the field and the fix."""


#: The deepest model nanolab builds. Every block is a Python object built one by one (~1.5 ms
#: each even on the meta device the estimator uses), so the depth bounds the work before any
#: tensor exists: 4096 is four times the deepest transformer trained to date (DeepNet's 1000
#: layers) and builds in seconds, while ``n_layer: 1000000000`` would spin for days.
MAX_LAYERS = 4096


@dataclass
class GPTConfig:
    """Shape of a decoder-only transformer in the GPT-2 family.

    Args:
        vocab_size: Number of token ids the tokenizer produces. ``None`` means "take it from the
            prepared dataset's ``meta.json``" (the CLI fills it in before the model is built).
        block_size: Context length in tokens (maximum sequence length).
        n_layer: Number of transformer blocks.
        n_head: Attention heads per block; must divide ``n_embd``.
        n_embd: Width of the residual stream.
        dropout: Dropout on attention probabilities, residual branches and embeddings.
        bias: Biases in Linear layers and LayerNorms (GPT-2 has them; dropping them is slightly
            faster and no worse).
        position_embedding: A registered position encoding: ``"learned"`` absolute positions
            (GPT-2) or ``"rope"`` rotary embeddings applied to queries and keys.
        rope_base: RoPE frequency base (10000 in the RoFormer paper).
        tie_weights: Share the token embedding matrix with the output head (GPT-2 does).
        vocab_multiple: The embedding and head are padded to a multiple of this many rows so the
            matmuls hit tensor-core friendly shapes (50257 -> 50304 for 64). Padded ids are never
            produced by the tokenizer, so the model learns to give them ~zero probability.
        mlp_ratio: Hidden width of the MLP as a multiple of ``n_embd``.
        attention: ``"sdpa"`` uses ``F.scaled_dot_product_attention`` (flash / memory-efficient
            kernels when the device has them); ``"math"`` spells attention out and materialises
            the B x H x T x T score matrix (useful as a reference and for the memory estimator);
            ``"flex"`` runs FlexAttention (torch >= 2.5) with a block mask, compiled on a GPU
            (and unfused, as a reference, on a CPU). With ``document_mask`` or
            ``attention_window``, ``"sdpa"`` passes SDPA a boolean mask on every device.
        gradient_checkpointing: Recompute each block's activations in the backward pass instead
            of storing them (non-reentrant ``torch.utils.checkpoint``): less memory, ~30% more
            compute.
        activation: The MLP's GELU. ``"gelu_tanh"`` is GPT-2's tanh approximation: GPT-2
            checkpoints were trained with it, so Hugging Face import/export keeps it, and it is
            the default (and what checkpoints written before this field existed used).
            ``"gelu"`` is the exact, erf-based GELU of nanoGPT and ``nn.GELU()``: the two differ
            by < 1e-3 per value, and on CPUs the exact one trains ~5% faster (its kernel and its
            backward are cheaper; docs/performance.md). GPUs run both at the same speed.
            Used by the ``"gelu"`` MLP.
        norm: A registered normalization: ``"layernorm"`` (GPT-2) or ``"rmsnorm"``.
        mlp: A registered MLP: ``"gelu"`` (GPT-2), ``"relu2"`` (ReLU squared) or ``"swiglu"``.
        attention_variant: A registered attention (what it computes; ``attention`` is the
            kernel that computes it): ``"causal"`` (GPT-2) or ``"qk_norm"`` (RMS-normalised
            queries and keys).
        document_mask: Attention never crosses an end-of-text token: a token sees only the
            tokens of its own document (the end-of-text that opens it included), as when
            documents are trained one by one. Pairs with ``data.align: document``.
        eot_id: The end-of-text id that separates documents; ``null``: read from the data
            (``nanolab fit`` fills it in when ``document_mask`` is on).
        attention_window: Local causal attention: a token sees at most this many tokens, itself
            included (sliding-window attention, as in Mistral and modded-nanogpt); ``null``:
            the whole context.

    The four registered fields accept every name in :mod:`nanolab.model.registry`, including
    variants a project registers itself (docs/forking.md, "Adding a model variant").

    Fields added later must default to the behaviour before they existed: a checkpoint that
    lacks a field is read as having its default (:func:`with_defaults`).
    """

    vocab_size: int | None = None
    block_size: int = 256
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    bias: bool = True
    position_embedding: str = "learned"
    rope_base: float = 10000.0
    tie_weights: bool = True
    vocab_multiple: int = 64
    mlp_ratio: int = 4
    attention: AttentionImpl = "sdpa"
    gradient_checkpointing: bool = False
    activation: Activation = "gelu_tanh"
    norm: str = "layernorm"
    mlp: str = "gelu"
    attention_variant: str = "causal"
    document_mask: bool = False
    eot_id: int | None = None
    attention_window: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first field that cannot work."""
        positive = {
            "block_size": self.block_size,
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "n_embd": self.n_embd,
            "vocab_multiple": self.vocab_multiple,
            "mlp_ratio": self.mlp_ratio,
        }
        for name, value in positive.items():
            if (whole := written_whole(f"model.gpt.{name}", value)) is not None:
                raise ConfigError(whole)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"model.gpt.{name} must be a positive integer, got {value!r}")
        if self.n_layer > MAX_LAYERS:
            raise ConfigError(
                f"model.gpt.n_layer {self.n_layer:,} is deeper than nanolab builds (at most "
                f"{MAX_LAYERS} blocks); lower model.gpt.n_layer"
            )
        if self.vocab_size is not None and (
            not isinstance(self.vocab_size, int) or self.vocab_size < 2
        ):
            raise ConfigError(
                f"model.gpt.vocab_size must be an integer >= 2 or null (from the data), "
                f"got {self.vocab_size!r}"
            )
        if self.n_embd % self.n_head != 0:
            raise ConfigError(
                f"model.gpt.n_embd ({self.n_embd}) must be divisible by model.gpt.n_head ({self.n_head}); "
                f"try n_head={_nearest_divisor(self.n_embd, self.n_head)}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.gpt.dropout must be in [0, 1), got {self.dropout!r}")
        self._validate_registered()
        if self.rope_base <= 1.0:
            raise ConfigError(f"model.gpt.rope_base must be > 1, got {self.rope_base!r}")
        if self.attention not in ("sdpa", "math", "flex"):
            raise ConfigError(
                f"model.gpt.attention must be 'sdpa', 'math' or 'flex', got {self.attention!r}"
            )
        if self.attention == "flex" and self.dropout > 0:
            raise ConfigError(
                "model.gpt.attention 'flex' has no attention dropout; set model.gpt.dropout: 0 "
                "or use attention 'sdpa' (a boolean mask, with dropout)"
            )
        if self.attention == "flex" and not flex_available():
            raise ConfigError(
                f"model.gpt.attention 'flex' needs torch >= 2.5 (this is {_torch_version()}); "
                "upgrade torch or use attention 'sdpa'"
            )
        window = self.attention_window
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ConfigError(
                f"model.gpt.attention_window must be a positive number of tokens or null "
                f"(the whole context), got {window!r}"
            )
        if self.eot_id is not None and (not isinstance(self.eot_id, int) or self.eot_id < 0):
            raise ConfigError(
                f"model.gpt.eot_id must be a token id >= 0 or null (from the data), "
                f"got {self.eot_id!r}"
            )
        if self.activation not in ("gelu_tanh", "gelu"):
            raise ConfigError(
                f"model.gpt.activation must be 'gelu_tanh' (GPT-2) or 'gelu' (exact), "
                f"got {self.activation!r}"
            )

    def _validate_registered(self) -> None:
        """Each registered field names a registered class, which may check the rest."""
        from nanolab.model import registry

        for reg in (registry.POSITIONS, registry.NORMS, registry.ATTENTIONS, registry.MLPS):
            name = getattr(self, reg.field)
            if not isinstance(name, str) or name not in reg:
                raise ConfigError(reg.unknown(name))
            check = reg.config_check(name)
            if check is not None:
                check(self)

    def min_params(self) -> int:
        """A lower bound on the parameter count, by arithmetic alone (nothing is built).

        Every block holds at least its attention's query and output projections (2 x n_embd^2)
        and the model a token embedding when the vocabulary is known; registered variants only
        add to that. Checks of memory use it to refuse an absurd config in microseconds,
        before the estimator builds a meta model block by block.
        """
        C = self.n_embd
        embedding = self.padded_vocab_size * C if self.vocab_size is not None else 0
        return self.n_layer * 2 * C * C + embedding

    @property
    def masks_attention(self) -> bool:
        """Whether attention is narrower than plain causal (documents or a window)."""
        return self.document_mask or self.attention_window is not None

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding/head: ``vocab_size`` rounded up to ``vocab_multiple``."""
        if self.vocab_size is None:
            raise ConfigError(
                "model.gpt.vocab_size is not set; set it or let `nanolab fit` read it from the data"
            )
        m = self.vocab_multiple
        return ((self.vocab_size + m - 1) // m) * m

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def with_defaults(saved: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's ``model.gpt`` with the fields it predates filled in with their defaults.

    Comparing only the keys both sides have would let a run trained before a field existed
    resume under a config that sets the field to something else (e.g. an old tanh-GELU run
    continued with ``activation: gelu``), changing the model in the middle of training.
    """
    defaults = {f.name: f.default for f in fields(GPTConfig)}
    return {**defaults, **saved}


def flex_available() -> bool:
    """Whether this torch has FlexAttention (2.5 and later); without it a mask is dense."""
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def _nearest_divisor(n: int, near: int) -> int:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return min(divisors, key=lambda d: (abs(d - near), d))
