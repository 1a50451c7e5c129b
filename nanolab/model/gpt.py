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

FLOPs: the model counts 6 per parameter per token (the weight matmuls, forward and backward);
a module whose matmuls multiply two activations (attention's scores and values) declares those
with ``activation_flops_per_token(seq_len)``, so ``GPT.flops_per_token`` and the estimator follow
a variant without a hand-kept formula.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from nanolab.model import registry
from nanolab.model.config import ConfigError, GPTConfig
from nanolab.model.registry import (
    POSITIONS,
    register_attention,
    register_mlp,
    register_norm,
    register_position,
)

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

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config.block_size, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        positions = torch.arange(x.size(1), device=x.device)
        return x + super().forward(positions)


@register_position("rope")
class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoFormer), applied to queries and keys.

    cos/sin tables are non-persistent buffers: they are recomputed from the config, so checkpoints
    stay small and a model can be loaded with a different ``block_size`` for generation.
    """

    applies_to: ClassVar[str] = "qk"

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

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` of shape (B, H, T, D) by position."""
        T = x.size(-2)
        cos = self.cos[:T].to(x.dtype)
        sin = self.sin[:T].to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
        return rotated.flatten(-2)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotate(q), self.rotate(k)


# -- attention ----------------------------------------------------------------------------------


@register_attention("causal")
class CausalSelfAttention(nn.Module):
    """GPT-2's multi-head causal self-attention.

    ``model.gpt.attention`` picks the kernel, not the maths: ``sdpa`` (flash / memory-efficient
    kernels, the T x T scores never exist) or ``math`` (spelled out; a reference). A variant
    subclasses this and overrides :meth:`prepare_qk` (QK-norm) or :meth:`attend` (the kernel).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        self.impl = config.attention
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        position = POSITIONS.get(config.position_embedding)
        self.rope = position(config) if position.applies_to == "qk" else None

    def prepare_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries and keys (B, H, T, D) as the scores see them: rotated, when RoPE is on."""
        if self.rope is not None:
            q, k = self.rope(q, k)
        return q, k

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal softmax(q k^T / sqrt(D)) v over (B, H, T, D), with attention dropout."""
        if self.impl == "sdpa":
            return F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
            )
        T = q.size(-2)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        return self.attn_dropout(F.softmax(scores, dim=-1)) @ v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        q, k = self.prepare_qk(q, k)
        y = self.attend(q, k, v)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))

    def activation_flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token of q k^T and scores @ v (no weights, so not in 6N):
        2 matmuls x 2·D·T per head forward, twice that backward (PaLM appendix B)."""
        return 12 * self.n_head * self.head_dim * seq_len


@register_attention("qk_norm")
class QKNormAttention(CausalSelfAttention):
    """Causal attention with RMS-normalised queries and keys (per head, learned gains), before
    RoPE: bounded attention logits, which lets larger learning rates train stably (OLMo 2,
    Gemma, modded-nanogpt)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.q_norm = RMSNorm(config.head_dim)
        self.k_norm = RMSNorm(config.head_dim)

    def prepare_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return super().prepare_qk(self.q_norm(q), self.k_norm(k))


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


# -- the model ----------------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        norm = registry.NORMS.get(config.norm)
        self.ln_1 = norm(config.n_embd, config)
        self.attn = registry.ATTENTIONS.get(config.attention_variant)(config)
        self.ln_2 = norm(config.n_embd, config)
        self.mlp = registry.MLPS.get(config.mlp)(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
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

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of shape (B, T, padded_vocab) and, given targets, the mean cross-entropy.

        Targets equal to -1 are ignored (padding).
        """
        T = idx.size(1)
        if self.config.block_size < T:
            raise ValueError(
                f"sequence length {T} exceeds model.block_size {self.config.block_size}"
            )
        x = self.wte(idx)
        if self.wpe is not None:
            x = self.wpe(x)
        x = self.drop(x)
        for block in self.blocks:
            if self.config.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1
            )
        return logits, loss

    def num_params(self, non_embedding: bool = False) -> int:
        """Unique parameters (a tied head is counted once).

        ``non_embedding=True`` leaves out what only embedding lookups read (the learned
        position embedding and, when the head is not tied, the token embedding), the convention
        of the scaling-law papers.
        """
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            head = self.lm_head.weight
            n -= sum(
                m.weight.numel()
                for m in self.modules()
                if isinstance(m, nn.Embedding) and m.weight is not head
            )
        return n

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs (forward + backward) per token, PaLM appendix B convention.

        ``6 * N`` plus what the modules declare: N counts the parameters that take part in
        matmuls (2 FLOPs per parameter forward, 4 backward), and each module whose matmuls
        multiply two activations declares them with ``activation_flops_per_token(T)`` (plain
        attention: ``12 * H * Q * T`` per layer, the score and value matmuls). Embedding lookups
        are not matmuls: the position embedding and an *untied* token embedding are left out of
        N (a tied one is counted once, as the head's matmul), which ``torch.utils.flop_counter``
        confirms (tests/test_estimator_flops.py). Element-wise work (norms, activations,
        softmax) is left out, as in nanoGPT and torchtitan, so MFU figures are comparable
        across them.
        """
        T = seq_len if seq_len is not None else self.config.block_size
        return 6 * self.num_params(non_embedding=True) + _activation_flops(self, T)

    def recompute_flops_per_token(self, seq_len: int | None = None) -> int:
        """FLOPs per token that gradient checkpointing adds by re-running every block's forward
        in the backward pass: a third of the blocks' training FLOPs (2 per parameter)."""
        T = seq_len if seq_len is not None else self.config.block_size
        n = sum(p.numel() for p in self.blocks.parameters())
        return 2 * n + _activation_flops(self.blocks, T) // 3

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` (B, T) and return it.

        ``temperature`` 0 means greedy decoding; ``top_k`` keeps only the k most likely tokens.
        Padded vocabulary rows are never sampled.
        """
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        vocab = self.config.vocab_size
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size :]
            logits, _ = self(context)
            logits = logits[:, -1, :vocab].float()
            if temperature == 0:
                next_id = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    k = min(top_k, logits.size(-1))
                    kth = torch.topk(logits, k).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = F.softmax(logits, dim=-1)
                next_id = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat((idx, next_id), dim=1)
        return idx


def _activation_flops(root: nn.Module, seq_len: int) -> int:
    """Sum of ``activation_flops_per_token`` over the modules under ``root`` that declare it."""
    total = 0
    for m in root.modules():
        declared = getattr(m, "activation_flops_per_token", None)
        if callable(declared):
            total += int(declared(seq_len))
    return total
