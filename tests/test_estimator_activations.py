"""Activation bytes: the estimate against what autograd really saves in a CPU forward pass.

The ground truth counts the distinct storages passed to ``saved_tensors_hooks`` (parameters and
buffers excluded), the spec's measure. The issue asks for +-5%; the model is exact on these
shapes, so a larger error means a model or PyTorch change that the estimator must follow.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pytest
import torch

from nanolab.estimator.activations import saved_activations
from nanolab.estimator.measure import measure_saved
from nanolab.estimator.numerics import numerics_for
from nanolab.estimator.setup import Setup
from nanolab.model.config import GPTConfig
from nanolab.model.gpt import GPT, Block

TOLERANCE = 0.05


@dataclass(frozen=True)
class Case:
    name: str
    gpt: GPTConfig
    batch: int
    precision: str  # 32-true | bf16-mixed | bf16-true

    @property
    def seq_len(self) -> int:
        return self.gpt.block_size


BASE = GPTConfig(vocab_size=500, block_size=64, n_layer=2, n_head=4, n_embd=64)
CASES = [
    Case("fp32-sdpa", BASE, 4, "32-true"),
    Case("bf16mixed-sdpa", BASE, 4, "bf16-mixed"),
    Case("fp32-math", replace(BASE, attention="math"), 2, "32-true"),
    Case("bf16mixed-math", replace(BASE, attention="math", n_layer=3), 3, "bf16-mixed"),
    Case("fp32-ckpt", replace(BASE, gradient_checkpointing=True, n_layer=4), 4, "32-true"),
    Case("bf16mixed-ckpt", replace(BASE, gradient_checkpointing=True), 2, "bf16-mixed"),
    Case("bf16true-sdpa", replace(BASE, n_layer=3, block_size=96), 2, "bf16-true"),
    Case("fp32-dropout-sdpa", replace(BASE, dropout=0.1), 2, "32-true"),
    Case("bf16mixed-dropout-math", replace(BASE, dropout=0.1, attention="math"), 2, "bf16-mixed"),
    Case("fp32-rope-nobias", replace(BASE, position_embedding="rope", bias=False), 3, "32-true"),
    Case(
        "bf16mixed-rope-untied",
        replace(BASE, position_embedding="rope", tie_weights=False, vocab_size=3000),
        2,
        "bf16-mixed",
    ),
    Case(
        "fp32-bigvocab-deep", replace(BASE, vocab_size=8000, n_layer=6, block_size=32), 1, "32-true"
    ),
]


def _measure(case: Case) -> int:
    torch.manual_seed(0)
    model = GPT(case.gpt)
    if case.precision == "bf16-true":
        model = model.to(torch.bfloat16)
    amp = torch.bfloat16 if case.precision == "bf16-mixed" else None
    return measure_saved(model, case.batch, case.seq_len, autocast_dtype=amp).bytes


def _estimate(case: Case) -> int:
    num = numerics_for(Setup(gpt=case.gpt, precision=case.precision), "cpu")
    return saved_activations(case.gpt, case.batch, case.seq_len, num).total


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_saved_activations_within_5_percent(case: Case) -> None:
    measured, estimated = _measure(case), _estimate(case)
    assert estimated == pytest.approx(measured, rel=TOLERANCE), (estimated, measured)


def test_random_shapes_within_5_percent() -> None:
    """Odd shapes (B or H of 1, short sequences, padding) exercise the view/copy rules."""
    rng = random.Random(1234)
    for _ in range(10):
        heads, head_dim = rng.choice([1, 2, 3]), rng.choice([8, 12])
        gpt = GPTConfig(
            vocab_size=rng.choice([61, 200]),
            block_size=rng.choice([16, 24]),
            n_layer=rng.choice([1, 2]),
            n_head=heads,
            n_embd=heads * head_dim,
            dropout=rng.choice([0.0, 0.1]),
            bias=rng.choice([True, False]),
            position_embedding=rng.choice(["learned", "rope"]),
            tie_weights=rng.choice([True, False]),
            vocab_multiple=rng.choice([1, 64]),
            attention=rng.choice(["sdpa", "math"]),
            gradient_checkpointing=rng.choice([True, False]),
        )
        case = Case("random", gpt, rng.choice([1, 2]), rng.choice(["32-true", "bf16-mixed"]))
        measured, estimated = _measure(case), _estimate(case)
        assert estimated == pytest.approx(measured, rel=TOLERANCE), (case, estimated, measured)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_recompute_line_is_one_block_forward(precision: str) -> None:
    """With checkpointing, the backward re-runs one block at a time: what that block's forward
    saves (its weight casts included under autocast) is the recompute line."""
    gpt = replace(BASE, gradient_checkpointing=True, dropout=0.1)
    num = numerics_for(Setup(gpt=gpt, precision=precision), "cpu")
    est = saved_activations(gpt, 3, gpt.block_size, num).recompute_block

    torch.manual_seed(0)
    block = Block(gpt).train()
    owned = {p.untyped_storage().data_ptr() for p in block.parameters()}
    owned |= {b.untyped_storage().data_ptr() for b in block.buffers()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in owned:
            seen[st.data_ptr()] = st.nbytes()
        return t

    x = torch.randn(3, gpt.block_size, gpt.n_embd, requires_grad=True)
    amp = torch.autocast(
        "cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed", cache_enabled=False
    )
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), amp:
        block(x)
    assert est == pytest.approx(sum(seen.values()), rel=TOLERANCE)


def test_activations_scale_linearly_with_batch() -> None:
    """The micro-batch search relies on memory growing with the micro-batch."""
    num = numerics_for(Setup(gpt=BASE, precision="bf16-mixed"))
    sizes = [saved_activations(BASE, b, None, num).total for b in (1, 2, 4, 8)]
    assert sizes == sorted(sizes)
    assert sizes[3] - sizes[2] == 2 * (sizes[2] - sizes[1])
