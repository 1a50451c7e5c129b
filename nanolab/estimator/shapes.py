"""The model's parameter tensors, buffers and FLOPs, read from the model itself.

The estimator keeps no copy of the model: it builds ``GPT(config)`` on the meta device (shapes,
no storage, the random initialisation skipped: ~0.1 s for GPT-2 XL) and reads what it needs,
once per config (and remembers it on disk for the next launch:
:mod:`nanolab.estimator.facts_cache`). So a registered variant (:mod:`nanolab.model.registry`) or a fork's edit of
``nanolab/model/gpt.py`` changes the estimate the moment it changes the model: parameter names,
shapes and which of them are matmul weights; buffers; FLOPs per token from
``GPT.flops_per_token`` (6 per parameter plus what modules declare with
``activation_flops_per_token``); and the classes a block is made of, which decide whether the
activation rules or a trace describe it (:mod:`nanolab.estimator.activations`).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from nanolab.estimator.facts_cache import remembered
from nanolab.model.config import GPTConfig

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class Tensor:
    """One parameter tensor as ``GPT.named_parameters()`` lists it (a tied head appears once)."""

    name: str
    shape: tuple[int, ...]
    matmul: bool  # the weight of an nn.Linear (autocast makes a low-precision copy of it)
    block: int | None  # index of the transformer block holding it, None for embeddings/head
    lookup: bool = False  # read only by an embedding lookup (no matmul, no FLOPs)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Inventory:
    """Parameter tensors of one model, what its parts are, and the sums the estimator uses.

    ``block_parts`` maps a block's submodule name (``ln_1``, ``attn``, ``attn.rope``, ...) to
    its class's qualified name; ``final_norm`` is ``ln_f``'s class. The activation rules hold
    for a block only when these are the classes they were written for.
    """

    tensors: tuple[Tensor, ...]
    buffer_numel: int = 0
    block_parts: tuple[tuple[str, str], ...] = ()
    final_norm: str = ""

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
    def lookup_numel(self) -> int:
        """Parameters only embedding lookups read (position table, an untied token table)."""
        return sum(t.numel for t in self.tensors if t.lookup)

    @property
    def largest_module_numel(self) -> int:
        """Parameters of the largest single module (DeepSpeed's ``largest_layer_params``)."""
        modules: Counter[str] = Counter()
        for t in self.tensors:
            modules[t.name.rsplit(".", 1)[0]] += t.numel
        return max(modules.values())

    def mlp_linears(self, i: int = 0) -> list[Tensor]:
        """The matmul weights of block ``i``'s MLP, in order (up-projection first)."""
        return [t for t in self.tensors if t.block == i and t.matmul and ".mlp." in t.name]


def meta_model(gpt: GPTConfig) -> nn.Module:
    """``GPT(gpt)`` on the meta device, its random initialisation skipped (shapes only)."""
    import torch

    from nanolab.model.gpt import GPT, check_parts

    check_parts(gpt)  # a part of one's own the run would refuse: the same line here
    with torch.device("meta"), skip_random_init():
        return GPT(replace(gpt))


def skip_random_init() -> Any:
    """A torch-function mode in which the in-place initialisers return their input untouched.

    On meta or fake tensors there is nothing to fill, and filling goes through reference
    kernels at ~4 ms a call (seconds for a GPT-2 XL); what is built is the same module tree.
    """
    from torch.overrides import TorchFunctionMode

    class SkipRandomInit(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in _INITIALISERS:
                return args[0] if args else next(iter((kwargs or {}).values()))
            return func(*args, **(kwargs or {}))

    return SkipRandomInit()


_INITIALISERS = frozenset(
    {"normal_", "uniform_", "zero_", "fill_", "trunc_normal_", "exponential_", "bernoulli_"}
)


def _qualname(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


@lru_cache(maxsize=64)
def _model(key: tuple) -> nn.Module:
    return meta_model(GPTConfig(**dict(key)))


@lru_cache(maxsize=64)
def _read(key: tuple) -> Inventory:
    return remembered(
        "inventory", GPTConfig(**dict(key)), None, lambda: _read_model(key), _to_json, _from_json
    )


def _to_json(inv: Inventory) -> dict[str, Any]:
    return {
        "tensors": [[t.name, list(t.shape), t.matmul, t.block, t.lookup] for t in inv.tensors],
        "buffer_numel": inv.buffer_numel,
        "block_parts": [list(part) for part in inv.block_parts],
        "final_norm": inv.final_norm,
    }


def _from_json(data: dict[str, Any]) -> Inventory:
    return Inventory(
        tensors=tuple(
            Tensor(name, tuple(shape), matmul, block, lookup)
            for name, shape, matmul, block, lookup in data["tensors"]
        ),
        buffer_numel=data["buffer_numel"],
        block_parts=tuple((name, cls) for name, cls in data["block_parts"]),
        final_norm=data["final_norm"],
    )


def _read_model(key: tuple) -> Inventory:
    from torch import nn

    model = _model(key)
    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    tensors = []
    for name, p in model.named_parameters():
        block = int(name.split(".")[1]) if name.startswith("blocks.") else None
        matmul = id(p) in linear_weights
        lookup = id(p) in lookups and not matmul
        tensors.append(Tensor(name, tuple(p.shape), matmul, block, lookup))
    return Inventory(
        tensors=tuple(tensors),
        buffer_numel=sum(b.numel() for b in model.buffers()),
        block_parts=tuple((n, _qualname(m)) for n, m in model.blocks[0].named_modules() if n),
        final_norm=_qualname(model.ln_f),
    )


@lru_cache(maxsize=256)
def _flops(key: tuple, seq_len: int | None) -> tuple[int, int]:
    def read() -> tuple[int, int]:
        model = _model(key)
        return model.flops_per_token(seq_len), model.recompute_flops_per_token(seq_len)

    return remembered("flops", GPTConfig(**dict(key)), seq_len, read, list, tuple)


def _key(gpt: GPTConfig) -> tuple:
    return tuple(sorted(gpt.to_dict().items()))


def inventory(gpt: GPTConfig) -> Inventory:
    """Parameter tensors of ``GPT(gpt)`` in ``named_parameters()`` order, and its parts."""
    return _read(_key(gpt))


def num_params(gpt: GPTConfig) -> int:
    """Same as ``GPT(gpt).num_params()``: unique parameters, a tied head counted once."""
    return inventory(gpt).numel


def buffer_numel(gpt: GPTConfig) -> int:
    """Elements of the model's buffers (RoPE's cos/sin tables, T x D/2 each per block)."""
    return inventory(gpt).buffer_numel


def flops_per_token(gpt: GPTConfig, seq_len: int | None = None) -> int:
    """``GPT(gpt).flops_per_token(seq_len)``: 6N + what modules declare (PaLM appendix B)."""
    return _flops(_key(gpt), seq_len)[0]


def recompute_flops_per_token(gpt: GPTConfig, seq_len: int | None = None) -> int:
    """Extra FLOPs per token that gradient checkpointing spends re-running every block's
    forward in the backward pass (``GPT.recompute_flops_per_token``)."""
    return _flops(_key(gpt), seq_len)[1]
