"""Peak allocated memory of a whole training step, estimated vs measured on CPU.

On a GPU the benchmark compares with ``torch.cuda.max_memory_allocated``; here the profiler's
allocation events give the same quantity for CPU tensors, which checks how the estimator adds
model states, saved activations and transients up over the step (which moment is the peak).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from nanolab.estimator.measure import measure_peak_cpu
from nanolab.estimator.memory import estimate_memory
from nanolab.estimator.setup import Setup
from nanolab.model.config import GPTConfig

TOLERANCE = 0.05
BASE = GPTConfig(vocab_size=2000, block_size=64, n_layer=3, n_head=4, n_embd=128)

CASES = [
    # (id, gpt, micro-batch, precision, optimizer, accumulation, foreach)
    ("fp32", BASE, 8, "32-true", "adamw", 1, True),
    ("bf16-mixed-accum2", BASE, 8, "bf16-mixed", "adamw", 2, True),
    (
        "bf16-mixed-ckpt-dropout",
        replace(BASE, gradient_checkpointing=True, dropout=0.1),
        8,
        "bf16-mixed",
        "adamw",
        1,
        True,
    ),
    ("fp32-math", replace(BASE, attention="math"), 4, "32-true", "adamw", 1, True),
    ("bf16-true-rope", replace(BASE, position_embedding="rope"), 8, "bf16-true", "adamw", 1, True),
    (
        "step-bound-foreach",
        replace(BASE, vocab_size=300, n_embd=256),
        1,
        "32-true",
        "adamw",
        1,
        True,
    ),
    ("step-bound-loop", replace(BASE, vocab_size=300, n_embd=256), 1, "32-true", "adamw", 1, None),
    ("step-bound-8bit", BASE, 1, "32-true", "adamw8bit", 1, True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_peak_allocated_matches_cpu_allocations(case: tuple) -> None:
    _, gpt, batch, precision, optimizer, accumulate, foreach = case
    measured = measure_peak_cpu(
        gpt, batch, precision=precision, optimizer=optimizer, accumulate=accumulate, foreach=foreach
    )
    setup = Setup(
        gpt=gpt,
        precision=precision,
        optimizer=optimizer,
        fused=None if foreach is None else False,
        global_batch_tokens=batch * gpt.block_size * accumulate,
    )
    est = estimate_memory(setup, batch, backend="cpu")
    assert est.peak_allocated == pytest.approx(measured, rel=TOLERANCE), est.peak_phase
    assert sum(ln.bytes for ln in est.lines if ln.in_peak) == est.peak_allocated
