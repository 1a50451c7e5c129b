"""A GPT-2 style decoder-only transformer, readable top to bottom.

Token embedding (+ learned positions, or RoPE inside attention) -> ``n_layer`` pre-norm blocks
(causal self-attention, MLP, each on a residual branch) -> final norm -> linear head tied to the
token embedding. The norm, attention, MLP and position encoding are looked up by the names the
config gives (:mod:`nanolab.model.registry`; the variants are in :mod:`nanolab.model.layers`);
the defaults are GPT-2's. Initialisation follows GPT-2: N(0, 0.02) everywhere, with the two
projections that write into the residual stream scaled by 1/sqrt(2 * n_layer) so the residual's
variance does not grow with depth.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from nanolab.model import registry
from nanolab.model.config import GPTConfig

# The GPT-2 parts, importable from here as before they moved to layers.py.
from nanolab.model.layers import MLP, CausalSelfAttention, LayerNorm, RotaryEmbedding

__all__ = ["GPT", "MLP", "Block", "CausalSelfAttention", "LayerNorm", "RotaryEmbedding"]


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
