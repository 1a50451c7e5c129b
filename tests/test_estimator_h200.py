"""The estimator's GPU rules against what a GPU measured (docs/gpu-check.md).

On one NVIDIA H200 (torch 2.11.0+cu130, Lightning 2.6.6, 2026-12-04) ``benches/bench_memory.py``
trained the shipped recipes eager with a real Trainer (bf16-mixed, fused AdamW, clip 1.0,
accumulation 2), each in its own process, and read ``torch.cuda.max_memory_allocated`` and what
autograd saved. These rows are that run's figures, and below them the compiled runs' peaks; the
CPU rules are checked against real CPU fits elsewhere (tests/test_estimator_lightning.py), which
cannot see a GPU's kernels.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from nanolab.estimator.memory import estimate_memory
from nanolab.estimator.setup import load_config, on_one_device, setup_from_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
MiB = 2**20

# (recipe, micro-batch, accumulation, measured peak allocated MiB, saved activations MiB)
H200 = [
    (["gpt2-124m.yaml"], 16, 2, 15_328.51, 10_220.07),
    (["gpt2-124m.yaml", "gpt2-350m.yaml"], 8, 2, 17_059.52, 10_007.45),
    # `nanolab fit` with run.micro_batch_size: auto and model.compile false (gpu_check's
    # micro_batch_auto): 139 sequences, one micro-batch a step, 113.06 GiB in the run log.
    (["gpt2-124m.yaml"], 139, 1, 113.06 * 1024, None),
]


@pytest.mark.parametrize(
    ("files", "B", "accumulate", "peak", "saved"), H200, ids=["124m-B16", "350m-B8", "124m-B139"]
)
def test_the_gpu_prediction_is_within_two_percent_of_the_h200(files, B, accumulate, peak, saved):
    """Mutation caught: the CPU loss rule on a GPU (two fp32 B*T*V gradients in the loss
    backward and no saved 16-bit logits: +9.8% on 124M), a dropped saved-logits line (-15%
    saved activations)."""
    base = setup_from_config(load_config([str(CONFIGS / f) for f in files]))
    setup = on_one_device(base, B, accumulate)
    est = estimate_memory(setup, B, backend="cuda")
    assert est.peak_allocated / MiB == pytest.approx(peak, rel=0.02)
    if saved is not None:
        assert est.saved.total / MiB == pytest.approx(saved, rel=0.02)


# Compiled (model.compile true, fused AdamW, clip 1.0), from `benches/gpu_check.sh` on the same
# H200: bench_124m's `nanolab fit` side (2 x 16 x 1024 tokens a step) and memory_compiled_350m
# (one micro-batch a step), the largest `mem_allocated_bytes` of each run log, in GiB.
H200_COMPILED = [
    (["gpt2-124m.yaml"], 16, 2, 11.90),
    (["gpt2-124m.yaml", "gpt2-350m.yaml"], 8, 1, 13.81),
]


@pytest.mark.parametrize(
    ("files", "B", "accumulate", "peak_gib"), H200_COMPILED, ids=["124m-B16", "350m-B8"]
)
def test_the_compiled_prediction_is_within_two_percent_of_the_h200(files, B, accumulate, peak_gib):
    """Mutation caught: the eager loss rule under compile (the fp32 log-softmax kept: +25% on
    124M, +11% on 350M)."""
    base = setup_from_config(load_config([str(CONFIGS / f) for f in files]))
    setup = replace(on_one_device(base, B, accumulate), compile=True)
    est = estimate_memory(setup, B, backend="cuda")
    assert est.peak_allocated / 2**30 == pytest.approx(peak_gib, rel=0.02)
    assert "log-softmax" not in " ".join(est.saved.loss)
