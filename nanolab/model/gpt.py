"""A GPT-2 style decoder-only transformer, readable top to bottom.

Token embedding (+ learned positions, or RoPE inside attention) -> ``n_layer`` pre-LayerNorm blocks
(causal self-attention, GELU MLP, each on a residual branch) -> final LayerNorm -> linear head
tied to the token embedding. Initialisation follows GPT-2: N(0, 0.02) everywhere, with the two
projections that write into the residual stream scaled by 1/sqrt(2 * n_layer) so the residual's
variance does not grow with depth.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from nanolab.model.config import GPTConfig


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (``nn.LayerNorm`` has no ``bias=False`` on older torch)."""

    def __init__(self, dim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoFormer), applied to queries and keys.

    cos/sin tables are non-persistent buffers: they are recomputed from the config, so checkpoints
    stay small and a model can be loaded with a different ``block_size`` for generation.
    """

    def __init__(self, head_dim: int, max_len: int, base: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        t = torch.arange(max_len, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # (T, head_dim/2)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` of shape (B, H, T, D) by position."""
        T = x.size(-2)
        cos = self.cos[:T].to(x.dtype)
        sin = self.sin[:T].to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
        return rotated.flatten(-2)


class CausalSelfAttention(nn.Module):
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
        self.rope = (
            RotaryEmbedding(config.head_dim, config.block_size, config.rope_base)
            if config.position_embedding == "rope"
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        if self.rope is not None:
            q, k = self.rope(q), self.rope(k)
        if self.impl == "sdpa":
            # Flash / memory-efficient kernels when available: the T x T scores never exist.
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
            )
        else:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            scores = scores.masked_fill(~mask, float("-inf"))
            y = self.attn_dropout(F.softmax(scores, dim=-1)) @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
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


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, config.bias)
        self.mlp = MLP(config)

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
        self.wpe = (
            nn.Embedding(config.block_size, config.n_embd)
            if config.position_embedding == "learned"
            else None
        )
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = LayerNorm(config.n_embd, config.bias)
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
            x = x + self.wpe(torch.arange(T, device=idx.device))
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

        ``non_embedding=True`` leaves out the learned position embedding (and, when the head is
        not tied, the token embedding), the convention of the scaling-law papers.
        """
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            if self.wpe is not None:
                n -= self.wpe.weight.numel()
            if not self.config.tie_weights:
                n -= self.wte.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs (forward + backward) per token, PaLM appendix B convention.

        ``6 * N + 12 * L * H * Q * T`` where N counts the parameters that take part in matmuls,
        L layers, H heads, Q head size and T the sequence length: 6N for the weight matmuls
        (2 forward, 4 backward) and the last term for the attention score and value matmuls.
        Embedding lookups are not matmuls: the position embedding and an *untied* token
        embedding are left out of N (a tied one is counted once, as the head's matmul), which
        ``torch.utils.flop_counter`` confirms (tests/test_estimator_flops.py). Element-wise work
        (norms, GELU, softmax) is left out, as in nanoGPT and torchtitan, so MFU figures are
        comparable across them.
        """
        c = self.config
        T = seq_len if seq_len is not None else c.block_size
        N = self.num_params(non_embedding=True)
        return 6 * N + 12 * c.n_layer * c.n_head * c.head_dim * T

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
