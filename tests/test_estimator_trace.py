"""The estimate follows the model the run builds, not the estimator's picture of nanolab's GPT.

Two kinds of fork, nothing in the estimator changed for either:

* variants registered in this test module only (a SwiGLU MLP with three separate matrices,
  attention with LayerNorm QK-norm and its own scale) with an untied head: the block's saved
  activations are measured from the module (:mod:`nanolab.estimator.derived`), so the estimate
  follows without a full trace, within 1% of a real Trainer step on CPU, where the GPT-2 rules
  at the same size are far off;
* a fork that edits ``Block`` itself (a second MLP in each block, built from classes the rules
  know, so they would describe it wrongly): the default ``trace="auto"`` notices (a tiny model
  of the config traced on fake tensors differs from the rules), traces the real one, and lands
  within 2% of a real Trainer step of the edited model on CPU.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanolab.model.gpt as gpt_module
from nanolab.estimator import estimate_from_config
from nanolab.estimator.derived import forget_models
from nanolab.estimator.measure_trainer import measure_trainer_peak_cpu
from nanolab.estimator.setup import Setup
from nanolab.estimator.trace import model_matches_rules, traced_peak_cpu
from nanolab.model.config import GPTConfig
from nanolab.model.gpt import CausalSelfAttention
from nanolab.model.registry import register_attention, register_mlp


@register_mlp("test_trace_swiglu")
class SwiGLU(nn.Module):
    """LLaMA's MLP: silu(x W1) * (x W3), then W2; 2/3 of the width so the size stays GPT-2's."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = int(2 * config.mlp_ratio * config.n_embd / 3)
        self.w1 = nn.Linear(config.n_embd, hidden, bias=False)
        self.w3 = nn.Linear(config.n_embd, hidden, bias=False)
        self.w2 = nn.Linear(hidden, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


@register_attention("test_trace_qknorm")
class QKNormAttention(CausalSelfAttention):
    """Causal attention with LayerNorm on each head's queries and keys."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.q_norm = nn.LayerNorm(config.head_dim)
        self.k_norm = nn.LayerNorm(config.head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        q, k = self.q_norm(q), self.k_norm(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1 / math.sqrt(C))
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


SHIPPED = GPTConfig(
    vocab_size=3000, block_size=96, n_layer=3, n_head=4, n_embd=192, tie_weights=False
)
FORK = replace(SHIPPED, mlp="test_trace_swiglu", attention_variant="test_trace_qknorm")


class TwoMLPBlock(gpt_module.Block):
    """A fork's edit of ``Block``: a second norm and MLP on the residual stream."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.ln_3 = type(self.ln_2)(config.n_embd, config)
        self.mlp2 = type(self.mlp)(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = super().forward(x)
        return x + self.mlp2(self.ln_3(x))


@pytest.fixture
def edited_block(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(gpt_module, "Block", TwoMLPBlock)
    forget_models()  # the estimator reads each config's model once per process
    yield
    monkeypatch.undo()
    forget_models()


def test_registered_variants_are_followed_without_a_trace() -> None:
    """(32-true: tests/test_estimator_variants.py, the predicted peak.)"""
    B, precision = 4, "bf16-mixed"
    real = measure_trainer_peak_cpu(FORK, B, precision=precision).peak
    setup = Setup(gpt=FORK, precision=precision, micro_batch_size=B)
    followed = estimate_from_config(setup, device="cpu", history=False, trace="auto")
    gpt2 = Setup(gpt=SHIPPED, precision=precision, micro_batch_size=B)
    gpt2_rules = estimate_from_config(gpt2, device="cpu", history=False, trace="never")
    assert abs(gpt2_rules.memory.peak_allocated / real - 1) > 0.05  # GPT-2's numbers are wrong
    assert not followed.memory.details["model_check"]["traced"]
    assert followed.memory.peak_allocated == pytest.approx(real, rel=0.01)
    assert "measured from the module" in " ".join(followed.memory.details["block"])


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_forked_model_is_followed(edited_block: None, precision: str) -> None:
    B = 4
    setup = Setup(gpt=SHIPPED, precision=precision, micro_batch_size=B)
    real = measure_trainer_peak_cpu(SHIPPED, B, precision=precision).peak
    rules = estimate_from_config(setup, device="cpu", history=False, trace="never")
    followed = estimate_from_config(setup, device="cpu", history=False, trace="auto")
    assert abs(rules.memory.peak_allocated / real - 1) > 0.05  # the rules alone are wrong
    check = followed.memory.details["model_check"]
    assert check["traced"] and abs(check["tiny_model_difference"]) > 0.005
    assert followed.memory.peak_allocated == pytest.approx(real, rel=0.02)
    data = followed.to_dict()["memory"]
    assert data["peak_source"] == "CPU trace of the model"
    assert data["peak_allocated_bytes"] == followed.memory.peak_allocated


def test_the_gpu_estimate_carries_the_models_difference(edited_block: None) -> None:
    """On a GPU the rules' peak gets what the CPU trace finds beyond the CPU rules, as a line."""
    setup = Setup(gpt=SHIPPED, precision="bf16-mixed", micro_batch_size=4)
    rules = estimate_from_config(setup, gpu="h100", history=False, trace="never").memory
    followed = estimate_from_config(setup, gpu="h100", history=False, trace="auto").memory
    check = followed.details["model_check"]
    delta = check["cpu_trace_peak_bytes"] - check["cpu_rules_peak_bytes"]
    assert followed.line("model_derived").bytes == delta != 0
    assert followed.peak_allocated == rules.peak_allocated + delta
    assert sum(ln.bytes for ln in followed.lines if ln.in_peak) == followed.peak_allocated


def test_the_shipped_model_matches_the_rules_without_a_full_trace() -> None:
    setup = Setup(gpt=SHIPPED, precision="bf16-mixed", micro_batch_size=4)
    matches, diff = model_matches_rules(setup)
    assert matches and abs(diff) < 0.005
    est = estimate_from_config(setup, device="cpu", history=False, trace="auto")
    check = est.memory.details["model_check"]
    assert not check["traced"] and check["tiny_model_difference"] == pytest.approx(diff, abs=1e-6)
    # ...and a full trace of it agrees with the rules to the byte or nearly.
    traced = traced_peak_cpu(setup, 4).peak_allocated
    assert traced == pytest.approx(est.memory.peak_allocated, rel=1e-4)
