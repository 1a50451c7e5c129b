"""The model's parameter tensors and FLOPs, from a :class:`GPTConfig` alone (no torch).

Building even a meta-device ``GPT`` costs seconds (importing torch, then constructing modules),
and the micro-batch search evaluates hundreds of shapes; so this module mirrors ``GPT``'s
parameter list and ``GPT.flops_per_token`` in plain Python. ``tests/test_estimator_exact.py``
compares every tensor name, shape and the FLOPs figure with the real model, so a change to
``nanolab/model/gpt.py`` that is not mirrored here fails a test instead of drifting silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from nanolab.model.config import GPTConfig


@dataclass(frozen=True)
class Tensor:
    """One parameter tensor as ``GPT.named_parameters()`` lists it (a tied head appears once)."""

    name: str
    shape: tuple[int, ...]
    matmul: bool  # the weight of an nn.Linear (autocast makes a low-precision copy of it)
    block: int | None  # index of the transformer block holding it, None for embeddings/head

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Inventory:
    """Parameter tensors of one model and the sums the estimator uses."""

    tensors: tuple[Tensor, ...]

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def matmul_numel(self) -> int:
        return sum(t.numel for t in self.tensors if t.matmul)

    def block_numel(self, i: int = 0) -> int:
        return sum(t.numel for t in self.tensors if t.block == i)

    def block_matmul_numel(self, i: int = 0) -> int:
        return sum(t.numel for t in self.tensors if t.block == i and t.matmul)

    @property
    def root_numel(self) -> int:
        """Parameters outside the blocks: embeddings, final norm, (untied) head."""
        return sum(t.numel for t in self.tensors if t.block is None)

    @property
    def largest_module_numel(self) -> int:
        """Parameters of the largest single module (DeepSpeed's ``largest_layer_params``)."""
        modules: dict[str, int] = {}
        for t in self.tensors:
            owner = t.name.rsplit(".", 1)[0]
            modules[owner] = modules.get(owner, 0) + t.numel
        return max(modules.values())


@lru_cache(maxsize=256)
def _inventory(key: tuple) -> Inventory:
    c = GPTConfig(**dict(key))
    C, V, F = c.n_embd, c.padded_vocab_size, c.mlp_ratio * c.n_embd
    out: list[Tensor] = [Tensor("wte.weight", (V, C), c.tie_weights, None)]
    if c.position_embedding == "learned":
        out.append(Tensor("wpe.weight", (c.block_size, C), False, None))
    for i in range(c.n_layer):
        p = f"blocks.{i}."
        layer: list[tuple[str, tuple[int, ...], bool]] = [("ln_1.weight", (C,), False)]
        if c.bias:
            layer.append(("ln_1.bias", (C,), False))
        for name, shape in (("attn.c_attn", (3 * C, C)), ("attn.c_proj", (C, C))):
            layer.append((f"{name}.weight", shape, True))
            if c.bias:
                layer.append((f"{name}.bias", (shape[0],), False))
        layer.append(("ln_2.weight", (C,), False))
        if c.bias:
            layer.append(("ln_2.bias", (C,), False))
        for name, shape in (("mlp.c_fc", (F, C)), ("mlp.c_proj", (C, F))):
            layer.append((f"{name}.weight", shape, True))
            if c.bias:
                layer.append((f"{name}.bias", (shape[0],), False))
        out.extend(Tensor(p + n, s, m, i) for n, s, m in layer)
    out.append(Tensor("ln_f.weight", (C,), False, None))
    if c.bias:
        out.append(Tensor("ln_f.bias", (C,), False, None))
    if not c.tie_weights:
        out.append(Tensor("lm_head.weight", (V, C), True, None))
    return Inventory(tuple(out))


def _key(gpt: GPTConfig) -> tuple:
    return tuple(sorted(gpt.to_dict().items()))


def inventory(gpt: GPTConfig) -> Inventory:
    """Parameter tensors of ``GPT(gpt)`` in ``named_parameters()`` order."""
    return _inventory(_key(gpt))


def num_params(gpt: GPTConfig) -> int:
    """Same as ``GPT(gpt).num_params()``: unique parameters, a tied head counted once."""
    return inventory(gpt).numel


def buffer_numel(gpt: GPTConfig) -> int:
    """Elements of the model's buffers: each block's RoPE cos/sin tables (T x D/2 each)."""
    if gpt.position_embedding != "rope":
        return 0
    return gpt.n_layer * 2 * gpt.block_size * (gpt.head_dim // 2)


def flops_per_token(gpt: GPTConfig, seq_len: int | None = None) -> int:
    """Same as ``GPT(gpt).flops_per_token(seq_len)``: 6N + 12·L·H·Q·T (PaLM appendix B).

    N leaves out what takes part in no matmul: the learned position embedding and an untied
    token embedding (lookups); a tied embedding is counted once, as the head.
    """
    T = gpt.block_size if seq_len is None else seq_len
    n = num_params(gpt)
    if gpt.position_embedding == "learned":
        n -= gpt.block_size * gpt.n_embd
    if not gpt.tie_weights:
        n -= gpt.padded_vocab_size * gpt.n_embd
    return 6 * n + 12 * gpt.n_layer * gpt.n_head * gpt.head_dim * T


def recompute_flops_per_token(gpt: GPTConfig, seq_len: int | None = None) -> int:
    """Extra FLOPs per token that gradient checkpointing spends re-running every block's
    forward in the backward pass: 2·N_blocks + 4·L·H·Q·T (the forward third of the above)."""
    T = gpt.block_size if seq_len is None else seq_len
    inv = inventory(gpt)
    n_blocks = sum(t.numel for t in inv.tensors if t.block is not None)
    return 2 * n_blocks + 4 * gpt.n_layer * gpt.n_head * gpt.head_dim * T
