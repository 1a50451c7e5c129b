"""The model, readable top to bottom: its parts (norms, positions, attention, MLPs), the block,
the GPT.

Token embedding (+ learned positions, or RoPE inside attention) -> ``n_layer`` pre-norm blocks
(causal self-attention, MLP, each on a residual branch) -> final norm -> linear head tied to the
token embedding. Initialisation follows GPT-2: N(0, 0.02) everywhere, with the two projections
that write into the residual stream scaled by 1/sqrt(2 * n_layer) so the residual's variance does
not grow with depth.

Each part registers itself under the name a config selects it by (``model.gpt.norm: rmsnorm``;
:mod:`nanolab.model.registry`), and the block looks its parts up by those names; the defaults are
GPT-2's and keep GPT-2's parameter names (``ln_1``, ``attn.c_attn``, ``mlp.c_fc``, ``wpe``, ...),
so checkpoints and the Hugging Face mapping are unchanged. The contracts, which a variant of your own follows too:

* norm: ``cls(dim, config)``, ``forward(x)`` over the last dimension;
* position: ``cls(config)`` with ``applies_to = "input"`` (``forward(x)`` adds positions to the
  token embeddings; the model keeps it as ``wpe``) or ``"qk"`` (``forward(q, k)`` rotates the
  (B, H, T, D) queries and keys; each attention keeps one as ``rope``);
* attention and MLP: ``cls(config)``, ``forward(x)`` from (B, T, C) to (B, T, C).

Key/value cache: ``GPT.forward(idx, cache=KVCache(...))`` runs only the new tokens and lets
them attend to the cached ones (sampling, and scoring the options of one context once the
context has run). An attention or position class takes part when it declares
``supports_kv_cache = True`` in its own body (a subclass declares it again, having checked
that its overrides take the ``positions``/``mask``/``cache`` arguments); a model with any
other part runs without a cache, as before.

FLOPs: the model counts 6 per parameter per token (the weight matmuls, forward and backward);
a module whose matmuls multiply two activations (attention's scores and values) declares those
with ``activation_flops_per_token(seq_len)``, so ``GPT.flops_per_token`` and the estimator follow
a variant without a hand-kept formula.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from nanolab.model import registry
from nanolab.model.config import ConfigError, GPTConfig
from nanolab.model.param_sizes import parameter_ndim, parameter_numel
from nanolab.model.registry import (
    POSITIONS,
    register_attention,
    register_mlp,
    register_norm,
    register_position,
)

#: The target id that carries no loss: a forked data module's masked prompt tokens, padding.
#: A batch without any other target has no mean (NaN): GPTLightningModule makes it 0, in
#: validation and where the data module declares masks (:mod:`nanolab.training.masked_targets`).
IGNORE_INDEX = -1


# -- normalization ------------------------------------------------------------------------------


@register_norm("layernorm")
class LayerNorm(nn.Module):
    """GPT-2's LayerNorm, with a bias only when ``model.gpt.bias`` (``nn.LayerNorm`` has no
    ``bias=False`` on older torch)."""

    def __init__(self, dim: int, config: GPTConfig, bias: bool | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        use_bias = config.bias if bias is None else bias
        self.bias = nn.Parameter(torch.zeros(dim)) if use_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


@register_norm("rmsnorm")
class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019): scale by the root mean square, no centring, no bias.

    Cheaper than LayerNorm and what most recent LMs (LLaMA, nanochat) use.
    """

    def __init__(self, dim: int, config: GPTConfig | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The gain in the input's dtype: under autocast, QK-norm sees 16-bit q and k, and a
        # dtype mismatch sends rms_norm to its slower unfused path.
        return F.rms_norm(x, self.weight.shape, self.weight.to(x.dtype), 1e-5)


# -- position encoding --------------------------------------------------------------------------


@register_position("learned")
class LearnedPositions(nn.Embedding):
    """GPT-2's learned absolute positions, added to the token embeddings (kept as ``wpe``)."""

    applies_to: ClassVar[str] = "input"
    supports_kv_cache: ClassVar[bool] = True

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config.block_size, config.n_embd)

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x`` plus the embedding of each token's position (0, 1, ... unless ``positions``,
        of shape (B, T), says where cached tokens left off)."""
        if positions is None:
            positions = torch.arange(x.size(1), device=x.device)
        return x + super().forward(positions)


@register_position("rope")
class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoFormer), applied to queries and keys.

    cos/sin tables are non-persistent buffers: they are recomputed from the config, so checkpoints
    stay small and a model can be loaded with a different ``block_size`` for generation.
    """

    applies_to: ClassVar[str] = "qk"
    supports_kv_cache: ClassVar[bool] = True

    @staticmethod
    def validate_config(config: GPTConfig) -> None:
        """Rotation pairs up a head's dimensions, so the head size must be even."""
        if config.head_dim % 2 != 0:
            raise ConfigError(
                f"model.gpt.position_embedding='rope' needs an even head size, but "
                f"n_embd/n_head = {config.head_dim}; change n_embd or n_head"
            )

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        head_dim = config.head_dim
        inv_freq = 1.0 / (
            config.rope_base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        )
        t = torch.arange(config.block_size, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # (T, head_dim/2)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate ``x`` of shape (B, H, T, D) by position: 0..T-1, or ``positions`` (B, T)."""
        if positions is None:
            T = x.size(-2)
            cos, sin = self.cos[:T].to(x.dtype), self.sin[:T].to(x.dtype)
        else:  # (B, 1, T, D/2): one row of angles per sequence, shared by its heads
            cos = self.cos[positions].unsqueeze(1).to(x.dtype)
            sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
        return rotated.flatten(-2)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotate(q, positions), self.rotate(k, positions)


# -- attention ----------------------------------------------------------------------------------


def attended_span(seq_len: int, window: int | None) -> float:
    """The key span per query that the FLOP count charges, PaLM's convention: causal attention
    is charged the full ``seq_len`` (the kernels compute about half of it); a sliding window
    the same share of that as the pairs it keeps are of the causal pairs."""
    if window is None or window >= seq_len:
        return float(seq_len)
    kept = window * seq_len - window * (window - 1) / 2  # sum over queries of min(q + 1, W)
    return seq_len * kept / (seq_len * (seq_len + 1) / 2)


class AttentionMask:
    """Which keys each query of one forward pass sees: causal, within its own document
    (``model.gpt.document_mask``) and within the last ``attention_window`` positions.

    Made once per forward and shared by the blocks. A document is numbered by the end-of-text
    tokens up to and including each position, so an end-of-text opens the document after it
    (as a beginning-of-sequence token would) and nothing after it sees what came before. The
    dense boolean form (SDPA, ``math``) and FlexAttention's block mask are each built on first
    use.
    """

    def __init__(self, idx: torch.Tensor, config: GPTConfig, compiled: bool | None = None) -> None:
        self.batch, self.length = idx.shape
        self.device = idx.device
        #: Whether the block mask (and the FlexAttention it feeds) are compiled; ``None``:
        #: :func:`compiles_flex` decides by the device. A test sets it to run a GPU's path on CPU.
        self.compiled = compiles_flex(idx.device) if compiled is None else compiled
        self.window = config.attention_window
        self.documents: torch.Tensor | None = None
        if config.document_mask:
            if config.eot_id is None:
                raise ConfigError(
                    "model.gpt.document_mask needs the end-of-text id: set model.gpt.eot_id, "
                    "or train on prepared data, whose meta.json records it"
                )
            self.documents = (idx == config.eot_id).cumsum(dim=1)
        self._dense: torch.Tensor | None = None
        self._block: object | None = None

    def allows(self, b: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Whether query position ``q`` of row ``b`` may see key position ``k`` (broadcast
        index tensors; FlexAttention's ``mask_mod`` signature without the head)."""
        ok = q >= k
        if self.window is not None:
            ok = ok & (q - k < self.window)
        if self.documents is not None:
            ok = ok & (self.documents[b, q] == self.documents[b, k])
        return ok

    def dense(self) -> torch.Tensor:
        """The mask as booleans (B, 1, T, T) for SDPA and the spelled-out kernel."""
        if self._dense is None:
            at = torch.arange(self.length, device=self.device)
            rows = torch.arange(self.batch, device=self.device)[:, None, None]
            self._dense = self.allows(rows, at[None, :, None], at[None, None, :]).unsqueeze(1)
        return self._dense

    def block_mask(self) -> object:
        """FlexAttention's block mask: blocks that no pair reaches are skipped, not computed."""
        if self._block is None:
            from torch.nn.attention.flex_attention import create_block_mask

            # Compiled on a GPU: uncompiled, it materialises every (b, q, k) triple. torch
            # compiles the function itself (its ``_compile=True`` flag is deprecated).
            build = _compiled("create_block_mask") if self.compiled else create_block_mask
            batch = None if self.documents is None else self.batch
            self._block = build(  # type: ignore[operator]
                lambda b, h, q, k: self.allows(b, q, k),
                batch,
                None,
                self.length,
                self.length,
                device=self.device,
            )
        return self._block


def compiles_flex(device: torch.device) -> bool:
    """Whether FlexAttention and its block mask are compiled on ``device``: on a GPU, where the
    compiled kernel is the fast one; a CPU runs them eagerly (the scores materialised, as a
    reference), where they are only for tests."""
    return device.type == "cuda"


_COMPILED_FLEX: dict[str, Any] = {}


def _compiled(name: str) -> Any:
    """torch's ``flex_attention`` or ``create_block_mask``, compiled once per process."""
    from torch.nn.attention import flex_attention as flex

    if name not in _COMPILED_FLEX:
        options = {"dynamic": False} if name == "flex_attention" else {}
        _COMPILED_FLEX[name] = torch.compile(getattr(flex, name), **options)
    return _COMPILED_FLEX[name]


def flex_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: object,
    compiled: bool | None = None,
) -> torch.Tensor:
    """FlexAttention over (B, H, T, D): compiled into one fused kernel when ``compiled``
    (``None``: :func:`compiles_flex` decides by the device), else run unfused."""
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    if compiles_flex(q.device) if compiled is None else compiled:
        return _compiled("flex_attention")(q, k, v, block_mask=block_mask)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(q, k, v, block_mask=block_mask)  # type: ignore[return-value]


@register_attention("causal")
class CausalSelfAttention(nn.Module):
    """GPT-2's multi-head causal self-attention.

    ``model.gpt.attention`` picks the kernel, not the maths: ``sdpa`` (flash / memory-efficient
    kernels, the T x T scores never exist) or ``math`` (spelled out; a reference). A variant
    subclasses this and overrides :meth:`prepare_qk` (QK-norm) or :meth:`attend` (the kernel).
    """

    supports_kv_cache: ClassVar[bool] = True

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        self.impl = config.attention
        self.window = config.attention_window
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        position = POSITIONS.get(config.position_embedding)
        self.rope = position(config) if position.applies_to == "qk" else None

    def prepare_qk(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries and keys (B, H, T, D) as the scores see them: rotated, when RoPE is on."""
        if self.rope is not None:
            q, k = self.rope(q, k, positions)
        return q, k

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """softmax(q k^T / sqrt(D)) v over (B, H, T, D), with attention dropout: causal, or
        where the boolean ``mask`` (B, 1, T, S) allows (cached keys before the new ones); a
        single query after cached keys and no mask sees all of them."""
        # No mask: causal over T x T, or (one new token after the cache) everything.
        causal = mask is None and q.size(-2) == k.size(-2)
        if self.impl == "sdpa":
            dropout = self.dropout if self.training else 0.0
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal
            )
        T = q.size(-2)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        if causal:
            mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return self.attn_dropout(F.softmax(scores, dim=-1)) @ v

    def attend_masked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: AttentionMask
    ) -> torch.Tensor:
        """Attention under an :class:`AttentionMask`: FlexAttention's block mask with
        ``attention: flex``; the dense boolean mask through :meth:`attend` with ``sdpa`` and
        ``math`` (the kernel a config names is the kernel that runs: docs/configs.md gives the
        measured times of both). FlexAttention has no backward on a CPU, so there it runs only
        where no gradient is needed."""
        backward_on_cpu = not q.is_cuda and torch.is_grad_enabled() and q.requires_grad
        if self.impl == "flex" and not backward_on_cpu:
            return flex_attend(q, k, v, visible.block_mask(), visible.compiled)
        return self.attend(q, k, v, visible.dense())

    def forward(
        self,
        x: torch.Tensor,
        cache: LayerCache | None = None,
        visible: AttentionMask | None = None,
    ) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        if cache is None:
            q, k = self.prepare_qk(q, k)
            y = self.attend(q, k, v) if visible is None else self.attend_masked(q, k, v, visible)
        else:  # new tokens at their positions, attending to the cached ones too
            q, k = self.prepare_qk(q, k, cache.positions)
            k, v = cache.extend(k, v)
            y = self.attend(q, k, v, cache.mask)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))

    def activation_flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token of q k^T and scores @ v (no weights, so not in 6N):
        2 matmuls x 2·D·T per head forward, twice that backward (PaLM appendix B); a sliding
        window charges its share of T (:func:`attended_span`). A document mask is charged as
        plain causal attention: what it saves depends on the documents of each batch."""
        span = attended_span(seq_len, self.window)
        return round(12 * self.n_head * self.head_dim * span)


@register_attention("qk_norm")
class QKNormAttention(CausalSelfAttention):
    """Causal attention with RMS-normalised queries and keys (per head, learned gains), before
    RoPE: bounded attention logits, which lets larger learning rates train stably (OLMo 2,
    Gemma, modded-nanogpt)."""

    supports_kv_cache: ClassVar[bool] = True

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.q_norm = RMSNorm(config.head_dim)
        self.k_norm = RMSNorm(config.head_dim)

    def prepare_qk(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return super().prepare_qk(self.q_norm(q), self.k_norm(k), positions)


# -- MLP ----------------------------------------------------------------------------------------


@register_mlp("gelu")
class MLP(nn.Module):
    """GPT-2's MLP: Linear -> GELU (``model.gpt.activation``: tanh or exact) -> Linear."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)
        # "tanh": GPT-2's approximation; "none": the exact GELU (model.gpt.activation).
        self.approximate = "tanh" if config.activation == "gelu_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate)))


@register_mlp("relu2")
class ReLU2MLP(MLP):
    """Linear -> ReLU(x)² -> Linear (So et al. 2021, "Primer"; modded-nanogpt, nanochat):
    GPT-2's shapes, parameter names and count (the layers are :class:`MLP`'s), a cheaper and
    sparser activation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.relu(self.c_fc(x)).square()))


def swiglu_hidden(config: GPTConfig) -> int:
    """SwiGLU's hidden width: 2/3 of the GELU MLP's, so its three matrices hold about as many
    parameters as GELU's two (LLaMA), rounded up to a multiple of 64 for tensor cores."""
    hidden = -(-2 * config.mlp_ratio * config.n_embd // 3)
    return -(-hidden // 64) * 64


@register_mlp("swiglu")
class SwiGLU(nn.Module):
    """Gated MLP (Shazeer 2020): silu(x W_gate) * (x W_up), then W_down. ``c_fc`` holds W_gate
    and W_up stacked (one matmul), ``c_proj`` is W_down, so the scaled residual init applies."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = swiglu_hidden(config)
        self.c_fc = nn.Linear(config.n_embd, 2 * hidden, bias=config.bias)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.c_fc(x).chunk(2, dim=-1)
        return self.dropout(self.c_proj(F.silu(gate) * up))


# -- key/value cache ----------------------------------------------------------------------------


@dataclass
class KVCache:
    """Keys and values of the tokens a model has already run, per block, so that new tokens
    attend to them without running them again.

    ``keys[i]``/``values[i]`` are block i's (B, H, S, D); ``valid`` (B, S) marks which cached
    positions hold a token when rows of different lengths were run right-padded together
    (:meth:`keep`); None means all of them. A new token's position is the number of valid
    tokens before it in its row, so a row continues where its own text ended.
    """

    keys: list[torch.Tensor | None]
    values: list[torch.Tensor | None]
    valid: torch.Tensor | None = None

    @classmethod
    def empty(cls, n_layer: int) -> KVCache:
        return cls([None] * n_layer, [None] * n_layer)

    @property
    def length(self) -> int:
        """Cached positions per row (padding included)."""
        return 0 if self.keys[0] is None else int(self.keys[0].size(2))

    def keep(self, lengths: torch.Tensor) -> None:
        """Only the first ``lengths[b]`` positions of row b hold tokens (the rest was padding)."""
        at = torch.arange(self.length, device=lengths.device)
        self.valid = at[None, :] < lengths[:, None]

    def select(self, rows: torch.Tensor) -> KVCache:
        """A cache whose row j is row ``rows[j]`` of this one (rows may repeat): one context's
        cache under each of its continuations."""

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.index_select(0, rows.to(t.device))

        valid = None if self.valid is None else pick(self.valid)
        return KVCache([pick(k) for k in self.keys], [pick(v) for v in self.values], valid)

    def step(
        self, batch: int, new: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The new tokens' positions (B, T) and the attention mask (B, 1, T, S + T) for a
        forward pass of ``new`` tokens per row (None: plain causal when nothing is cached, or
        one new token per row that attends to every cached one)."""
        past = self.length
        causal = torch.ones(new, new, dtype=torch.bool, device=device).tril()
        if self.valid is None:
            positions = torch.arange(past, past + new, device=device).expand(batch, new)
            if past == 0 or new == 1:  # causal, or one token that sees everything cached
                return positions, None
            seen = torch.ones(batch, past, dtype=torch.bool, device=device)
        else:
            seen = self.valid.to(device)
            positions = seen.sum(dim=1, keepdim=True) + torch.arange(new, device=device)
        mask = torch.cat(
            (seen[:, None, :].expand(batch, new, past), causal.expand(batch, new, new)), dim=2
        )
        return positions, mask.unsqueeze(1)

    def close(self, batch: int, new: int, device: torch.device) -> None:
        """After a forward pass: the new tokens are valid cached positions too."""
        if self.valid is not None:
            fresh = torch.ones(batch, new, dtype=torch.bool, device=self.valid.device)
            self.valid = torch.cat((self.valid, fresh), dim=1)


@dataclass
class LayerCache:
    """One block's view of a :class:`KVCache` during a forward pass: where the new tokens
    are, what they may attend to, and where their keys and values go."""

    cache: KVCache
    layer: int
    positions: torch.Tensor
    mask: torch.Tensor | None

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new keys/values (B, H, T, D) and return all of them."""
        past_k, past_v = self.cache.keys[self.layer], self.cache.values[self.layer]
        if past_k is not None and past_v is not None:
            k, v = torch.cat((past_k, k), dim=2), torch.cat((past_v, v), dim=2)
        self.cache.keys[self.layer], self.cache.values[self.layer] = k, v
        return k, v


# -- the model ----------------------------------------------------------------------------------


def _built(reg: registry.Registry, name: str, *args: object) -> nn.Module:
    """``reg``'s class ``name`` built with ``args``; a class whose constructor does not take
    them is one line naming the setting, the class and the signature the block calls."""
    import inspect

    cls = reg.get(name)
    try:
        inspect.signature(cls).bind(*args)
    except TypeError as err:  # the signature, not an error inside the constructor's body
        call = "cls(dim, config)" if len(args) == 2 else "cls(config)"
        raise ConfigError(
            f"model.gpt.{reg.field} {name!r} ({cls.__module__}.{cls.__qualname__}) cannot be "
            f"built as {call}: {err} (docs/forking.md lists what each part takes)"
        ) from None
    except ValueError:  # no signature to read (a builtin): the call decides
        pass
    return cls(*args)


def _part(config: GPTConfig, field: str, module: nn.Module) -> str:
    cls = type(module)
    return f"model.gpt.{field} {getattr(config, field)!r} ({cls.__module__}.{cls.__qualname__})"


def check_attention(config: GPTConfig, attn: nn.Module) -> None:
    """Settings an attention of one's own would silently ignore are refused: RoPE (``"qk"``
    positions) and the kernel are CausalSelfAttention's (``prepare_qk``, ``attend``), and a
    document mask or window reaches the attention as its ``visible`` argument."""
    import inspect

    where = _part(config, "attention_variant", attn)
    if not isinstance(attn, CausalSelfAttention):
        if registry.POSITIONS.get(config.position_embedding).applies_to == "qk":
            raise ConfigError(
                f"{where} does not subclass CausalSelfAttention, whose prepare_qk applies "
                f"model.gpt.position_embedding {config.position_embedding!r}: the model would "
                "train without positions; subclass CausalSelfAttention, or use learned positions"
            )
        if config.attention != "sdpa":
            raise ConfigError(
                f"{where} does not subclass CausalSelfAttention, whose kernel model.gpt.attention "
                f"{config.attention!r} picks; subclass it (its attend), or leave attention: sdpa"
            )
    if config.masks_attention or config.attention == "flex":
        params = inspect.signature(type(attn).forward).parameters
        if "visible" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            raise ConfigError(
                f"{where}: its forward takes no `visible` argument, which carries "
                "model.gpt.document_mask / attention_window to it; add `visible=None` and attend "
                "with self.attend_masked(q, k, v, visible) when it is given"
            )


def check_parts(config: GPTConfig) -> None:
    """A block's parts, checked before a run builds the model, on one block on the meta device
    (no memory, no compute, outside any strategy's set-up): :func:`check_attention`, and each
    part maps (B, T, C) to (B, T, C): a part of one's own returning another shape is one line
    naming it, not a traceback at the first step, nor a (B, T, 1) silently broadcast into the
    residual stream. A part that cannot run on meta tensors is left to its first real step."""
    try:
        with torch.device("meta"):
            block = Block(config)
    except ConfigError:
        raise
    except Exception:  # a part that reads a tensor's value while it is built: the real build
        return
    check_attention(config, block.attn)
    with torch.device("meta"):
        x = torch.empty(2, min(4, config.block_size), config.n_embd)
        for field, part in (
            ("norm", block.ln_1),
            ("mlp", block.mlp),
            ("attention_variant", block.attn),
        ):
            try:
                out = part(x)
            except Exception:  # meta tensors are not every op's: the first step decides
                continue
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            if shape != tuple(x.shape):
                raise ConfigError(
                    f"{_part(config, field, part)} returned {shape} for an input of "
                    f"{tuple(x.shape)} (B, T, C); a block's parts map (B, T, C) to (B, T, C)"
                )


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = _built(registry.NORMS, config.norm, config.n_embd, config)
        self.attn = _built(registry.ATTENTIONS, config.attention_variant, config)
        self.ln_2 = _built(registry.NORMS, config.norm, config.n_embd, config)
        self.mlp = _built(registry.MLPS, config.mlp, config)

    def forward(
        self,
        x: torch.Tensor,
        cache: LayerCache | None = None,
        visible: AttentionMask | None = None,
    ) -> torch.Tensor:
        if cache is not None:
            attn = self.attn(self.ln_1(x), cache)
        elif visible is not None:
            attn = self.attn(self.ln_1(x), visible=visible)
        else:
            attn = self.attn(self.ln_1(x))
        x = x + attn
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """The language model. ``forward(idx, targets)`` returns ``(logits, loss)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        V = config.padded_vocab_size
        self.wte = nn.Embedding(V, config.n_embd)
        position = registry.POSITIONS.get(config.position_embedding)
        # Added to the token embeddings here ("input"), or applied to q, k in attention ("qk").
        self.wpe = position(config) if position.applies_to == "input" else None
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        check_attention(config, self.blocks[0].attn)
        self.ln_f = registry.NORMS.get(config.norm)(config.n_embd, config)
        self.lm_head = nn.Linear(config.n_embd, V, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        residual_std = 0.02 / math.sqrt(2 * config.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=residual_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @property
    def supports_kv_cache(self) -> bool:
        """Whether every attention and position module declares it can run with a
        :class:`KVCache` (in its own class body: a subclass must declare it again), and
        attention is plain causal (a document mask or window runs without a cache)."""
        return not self.config.masks_attention and not self.uncached_parts()

    def uncached_parts(self) -> list[nn.Module]:
        """The attention and position modules that do not declare ``supports_kv_cache`` in
        their own class body."""
        parts: list[nn.Module] = [] if self.wpe is None else [self.wpe]
        for block in self.blocks:
            parts.append(block.attn)
            rope = getattr(block.attn, "rope", None)
            if rope is not None:
                parts.append(rope)
        return [p for p in parts if not vars(type(p)).get("supports_kv_cache", False)]

    def no_cache_reason(self) -> str:
        """Why this model samples without a key/value cache, in one line (``nanolab generate``
        says it; an explicit ``use_cache=True`` is refused with it)."""
        config = self.config
        if config.masks_attention:
            what = " and ".join(
                name
                for name, on in (
                    ("model.gpt.document_mask", config.document_mask),
                    ("model.gpt.attention_window", config.attention_window is not None),
                )
                if on
            )
            verb = "run" if " and " in what else "runs"
            return f"{what} {verb} without a key/value cache: each new token runs the whole context"
        missing = {f"{type(p).__module__}.{type(p).__qualname__}" for p in self.uncached_parts()}
        which = ", ".join(sorted(missing)) or "a part of this model"
        return (
            f"{which} does not declare supports_kv_cache in its class body (docs/forking.md): "
            "each new token runs the whole context"
        )

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        cache: KVCache | None = None,
        head: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Logits of shape (B, T, padded_vocab) and, given targets, the mean cross-entropy.

        Targets equal to -1 (:data:`IGNORE_INDEX`) carry no loss (masked, padding). With
        ``cache``, ``idx`` holds only new tokens: they attend to the cached ones, and their keys
        and values are added to it (check :attr:`supports_kv_cache` first). ``head=False``
        skips the output layer and returns ``(None, None)``: a pass that only fills the cache.
        """
        B, T = idx.shape
        past = 0 if cache is None else cache.length
        if cache is not None and cache.valid is not None:
            # Rows of different lengths: the shortest must fit; a longer row's positions past
            # the block can only be its right padding, which no real token attends to.
            past = int(cache.valid.sum(dim=1).min())
        if self.config.block_size < past + T:
            raise ValueError(
                f"sequence length {past + T} exceeds model.gpt.block_size {self.config.block_size}"
            )
        positions, mask = (None, None) if cache is None else cache.step(B, T, idx.device)
        if positions is not None:
            positions = positions.clamp(max=self.config.block_size - 1)
        x = self.wte(idx)
        if self.wpe is not None:
            x = self.wpe(x) if positions is None else self.wpe(x, positions)
        x = self.drop(x)
        visible = None
        if cache is None and (self.config.masks_attention or self.config.attention == "flex"):
            visible = AttentionMask(idx, self.config)
        for i, block in enumerate(self.blocks):
            if cache is not None:
                x = block(x, LayerCache(cache, i, positions, mask))  # type: ignore[arg-type]
            elif self.config.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, None, visible, use_reentrant=False)
            elif visible is not None:
                x = block(x, visible=visible)
            else:
                x = block(x)
        if cache is not None:
            cache.close(B, T, idx.device)
        if not head:
            return None, None
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            flat = logits.view(-1, logits.size(-1))
            if flat.dtype != torch.float32 and not torch.is_autocast_enabled(flat.device.type):
                # A model cast whole to 16 bits (DeepSpeed, bf16-true): the loss in fp32, as
                # autocast computes it. A bf16 loss is rounded to 1/128 at a loss of 3 and
                # biased: runs would not compare with DDP's or FSDP2's at the 0.01 level.
                flat = flat.float()
            loss = F.cross_entropy(flat, targets.reshape(-1), ignore_index=IGNORE_INDEX)
        return logits, loss

    def num_params(self, non_embedding: bool = False) -> int:
        """Unique parameters (a tied head is counted once).

        ``non_embedding=True`` leaves out what only embedding lookups read (the learned
        position embedding and, when the head is not tied, the token embedding), the convention
        of the scaling-law papers. Whole parameters, also while ZeRO-3 partitions them
        (:mod:`nanolab.model.param_sizes`).
        """
        n = sum(parameter_numel(p) for p in self.parameters())
        if non_embedding:
            head = self.lm_head.weight
            n -= sum(
                parameter_numel(m.weight)
                for m in self.modules()
                if isinstance(m, nn.Embedding) and m.weight is not head
            )
        return n

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs (forward + backward) per token, PaLM appendix B convention.

        ``6 * N`` plus what the modules declare: N counts the parameters that take part in
        matmuls, the matrices (2 FLOPs per parameter forward, 4 backward; biases and norm gains
        are element-wise work, left out below), and each module whose matmuls
        multiply two activations declares them with ``activation_flops_per_token(T)`` (plain
        attention: ``12 * H * Q * T`` per layer, the score and value matmuls). Embedding lookups
        are not matmuls: the position embedding and an *untied* token embedding are left out of
        N (a tied one is counted once, as the head's matmul), which ``torch.utils.flop_counter``
        confirms (tests/test_estimator_flops.py). Element-wise work (norms, activations,
        softmax) is left out, as in nanoGPT and torchtitan, so MFU figures are comparable
        across them.
        """
        T = seq_len if seq_len is not None else self.config.block_size
        n = self.num_params(non_embedding=True) - _vector_numel(self)
        return 6 * n + _activation_flops(self, T)

    def recompute_flops_per_token(self, seq_len: int | None = None) -> int:
        """FLOPs per token that gradient checkpointing adds by re-running every block's forward
        in the backward pass: a third of the blocks' training FLOPs (2 per matmul parameter)."""
        T = seq_len if seq_len is not None else self.config.block_size
        n = sum(parameter_numel(p) for p in self.blocks.parameters())
        n -= _vector_numel(self.blocks)
        return 2 * n + _activation_flops(self.blocks, T) // 3

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool | None = None,
        top_p: float | None = None,
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` (B, T) and return it.

        ``temperature`` 0 means greedy decoding; ``top_k`` keeps only the k most likely tokens,
        ``top_p`` only the likeliest tokens whose probabilities sum to ``top_p`` (nucleus
        sampling; both may be given). Padded vocabulary rows are never sampled. See
        :meth:`stream` for the cache.
        """
        new = self.stream(idx, max_new_tokens, temperature, top_k, generator, use_cache, top_p)
        return torch.cat([idx, *new], dim=1)

    @torch.no_grad()
    def stream(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool | None = None,
        top_p: float | None = None,
    ) -> Iterator[torch.Tensor]:
        """Yield each token (B, 1) as it is sampled after the prompts ``idx`` (B, T).

        With a key/value cache (``use_cache``, default: whenever :attr:`supports_kv_cache`)
        each new token is one position of work instead of the whole context again; greedy
        tokens are the same as without it while prompt and sample fit in ``block_size``.
        Past it the two differ by design: without a cache every token sees the newest
        ``block_size`` tokens; with one, the cache is refilled from the newest half block
        when it is full (one pass per half block), so a token sees between half a block and
        a block of context. One draw from ``generator`` per token either way. ``use_cache``
        True on a model without :attr:`supports_kv_cache` is refused: the cached pass would
        drop its window or document mask, or run a part that never saw the cache's arguments.
        """
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if use_cache and not self.supports_kv_cache:
            raise ValueError(
                f"use_cache=True, but {self.no_cache_reason()}; leave use_cache unset (or False)"
            )
        use_cache = self.supports_kv_cache if use_cache is None else use_cache
        block, vocab = self.config.block_size, self.config.vocab_size
        context = idx[:, -block:]
        cache: KVCache | None = None
        for _ in range(max_new_tokens):
            if not use_cache:
                logits, _ = self(context)
            elif cache is not None and cache.length < block:  # the newest token, one position
                logits, _ = self(context[:, -1:], cache=cache)
            else:  # the first pass, or a full cache: (re)fill it from the newest tokens
                fill = context if cache is None else context[:, -(block // 2) :]
                cache = KVCache.empty(len(self.blocks))
                logits, _ = self(fill, cache=cache)
            assert logits is not None
            logits = logits[:, -1, :vocab].float()
            if temperature < torch.finfo(logits.dtype).tiny:  # 0, or 0 once in float32: greedy
                next_id = logits.argmax(dim=-1, keepdim=True)
            else:
                # Shifted so the largest is 0 first: a tiny temperature sends the others to
                # -inf (greedy in the limit), never the largest to inf (NaN probabilities).
                shifted = logits - logits.amax(dim=-1, keepdim=True)
                probs = sampling_probs(shifted / temperature, top_k, top_p)
                next_id = torch.multinomial(probs, num_samples=1, generator=generator)
            context = torch.cat((context, next_id), dim=1)[:, -block:]
            yield next_id


def sampling_probs(
    logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """Probabilities (B, V) to draw the next token from: the ``top_k`` likeliest tokens, then
    the smallest set of the likeliest whose probabilities reach ``top_p`` (the token that
    crosses it is kept, so at least one always is), renormalised."""
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the likelier ones
        cut = before >= top_p
        cut[..., 0] = False  # the likeliest token stays, whatever top_p rounds to in float32
        sorted_probs = sorted_probs.masked_fill(cut, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _vector_numel(root: nn.Module) -> int:
    """Elements of the 1-D parameters under ``root``: biases and norm gains, added or multiplied
    element-wise, which the FLOP convention (and ``torch.utils.flop_counter``) counts no matmul
    FLOPs for. What is left of a model's non-embedding parameters are its matrices."""
    return sum(parameter_numel(p) for p in root.parameters() if parameter_ndim(p) < 2)


def _activation_flops(root: nn.Module, seq_len: int) -> int:
    """Sum of ``activation_flops_per_token`` over the modules under ``root`` that declare it."""
    total = 0
    for m in root.modules():
        declared = getattr(m, "activation_flops_per_token", None)
        if callable(declared):
            total += int(declared(seq_len))
    return total
