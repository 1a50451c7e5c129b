"""The estimator follows registered model variants, with no copy of them in the estimator.

Two variants are registered here, in a test-only module, as a project would register its own:
a three-matrix gated MLP of another width and an attention that computes two score maps (so it
declares twice plain attention's activation FLOPs). Parameter count, FLOPs per token, saved
activations and the predicted peak are compared with the real model: ``named_parameters``,
``torch.utils.flop_counter``, ``saved_tensors_hooks`` and a real Trainer step's peak on CPU.
The built-in variants (RMSNorm, SwiGLU, ReLU², QK-norm) are checked the same way.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from nanolab.estimator import estimate_from_config
from nanolab.estimator.activations import saved_activations
from nanolab.estimator.derived import flops_difference, saved_bytes
from nanolab.estimator.measure import measure_saved
from nanolab.estimator.measure_trainer import measure_trainer_peak_cpu
from nanolab.estimator.numerics import numerics_for
from nanolab.estimator.setup import Setup
from nanolab.estimator.shapes import flops_per_token, num_params
from nanolab.model.config import GPTConfig
from nanolab.model.gpt import GPT, CausalSelfAttention
from nanolab.model.registry import register_attention, register_mlp


@register_mlp("test_est_geglu3")
class GeGLU3(nn.Module):
    """gelu(x W_g) * (x W_u) W_d with a 3C hidden width and separate matrices."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = 3 * config.n_embd
        self.w_gate = nn.Linear(config.n_embd, hidden, bias=False)
        self.w_up = nn.Linear(config.n_embd, hidden, bias=False)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.w_gate(x)) * self.w_up(x))


@register_attention("test_est_two_maps")
class TwoMapAttention(CausalSelfAttention):
    """The average of attention at two temperatures: two score maps, so twice the matmuls."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return 0.5 * (super().attend(q, k, v) + super().attend(2.0 * q, k, v))

    def activation_flops_per_token(self, seq_len: int) -> int:
        return 2 * super().activation_flops_per_token(seq_len)


# attention "math": the flop counter has no formula for the CPU flash kernel.
BASE = GPTConfig(vocab_size=500, block_size=32, n_layer=2, n_head=2, n_embd=64, attention="math")
OURS = replace(BASE, mlp="test_est_geglu3", attention_variant="test_est_two_maps")
BUILTIN = {
    "rmsnorm": replace(BASE, norm="rmsnorm"),
    "swiglu": replace(BASE, mlp="swiglu", bias=False),
    "relu2-rope": replace(BASE, mlp="relu2", position_embedding="rope"),
    "qk_norm-untied": replace(BASE, attention_variant="qk_norm", tie_weights=False),
}


def _counted_flops_per_token(cfg: GPTConfig, batch: int = 2) -> float:
    torch.manual_seed(0)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size))
    with FlopCounterMode(display=False) as counter:
        model(idx, idx)[1].backward()
    return counter.get_total_flops() / (batch * cfg.block_size)


def _measured_saved(cfg: GPTConfig, batch: int, precision: str) -> int:
    torch.manual_seed(0)
    amp = torch.bfloat16 if precision == "bf16-mixed" else None
    return measure_saved(GPT(cfg), batch, cfg.block_size, autocast_dtype=amp).bytes


def _estimated_saved(cfg: GPTConfig, batch: int, precision: str) -> int:
    num = numerics_for(Setup(gpt=cfg, precision=precision), "cpu")
    return saved_activations(cfg, batch, cfg.block_size, num).total


@pytest.mark.parametrize("cfg", [OURS, *BUILTIN.values()], ids=["test-only", *BUILTIN])
def test_params_and_flops_follow_the_variant(cfg: GPTConfig) -> None:
    assert num_params(cfg) == sum(p.numel() for p in GPT(cfg).parameters())
    assert flops_per_token(cfg) == _counted_flops_per_token(cfg)


def test_the_estimate_moves_with_a_test_only_variant() -> None:
    """Each number changes from GPT-2's by what the variant changes in the real model."""
    real_params = sum(p.numel() for p in GPT(OURS).parameters())
    gpt2_params = sum(p.numel() for p in GPT(BASE).parameters())
    assert num_params(OURS) - num_params(BASE) == real_params - gpt2_params != 0
    counted = _counted_flops_per_token(OURS) - _counted_flops_per_token(BASE)
    assert flops_per_token(OURS) - flops_per_token(BASE) == counted != 0
    for precision in ("32-true", "bf16-mixed"):
        measured = _measured_saved(OURS, 3, precision)
        assert _estimated_saved(OURS, 3, precision) == pytest.approx(measured, rel=0.005)
        gpt2 = _measured_saved(BASE, 3, precision)
        assert abs(measured / gpt2 - 1) > 0.1  # the variant really changes what is saved


@pytest.mark.parametrize("name", ["rmsnorm", "qk_norm-untied"])
def test_builtin_variants_saved_activations(name: str) -> None:
    cfg = BUILTIN[name]
    for batch, precision in ((1, "32-true"), (5, "bf16-mixed")):
        measured = _measured_saved(cfg, batch, precision)
        assert _estimated_saved(cfg, batch, precision) == pytest.approx(measured, rel=0.005)


def test_the_predicted_peak_follows_a_test_only_variant() -> None:
    """The whole estimate (model states, activations, the step's moments) against a real
    Trainer step of the variant on CPU, without the whole-model trace."""
    cfg = replace(OURS, attention="sdpa", block_size=64, n_layer=3)
    setup = Setup(gpt=cfg, precision="32-true", micro_batch_size=4)
    estimate = estimate_from_config(setup, device="cpu", history=False, trace="never")
    real = measure_trainer_peak_cpu(cfg, 4).peak
    assert estimate.memory.peak_allocated == pytest.approx(real, rel=0.02)
    assert estimate.compute.params == sum(p.numel() for p in GPT(cfg).parameters())


@register_attention("test_est_two_maps_undeclared")
class UndeclaredTwoMapAttention(CausalSelfAttention):
    """Two score maps, but only plain attention's activation FLOPs declared (inherited)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return 0.5 * (super().attend(q, k, v) + super().attend(2.0 * q, k, v))


def test_undeclared_activation_matmuls_are_flagged() -> None:
    """The estimator counts a tiny model's matmuls on fake tensors and says when the model's
    FLOPs per token miss some; conforming models, either kernel, agree exactly."""
    for cfg in (BASE, replace(BASE, attention="sdpa"), OURS, *BUILTIN.values()):
        assert flops_difference(cfg) == 0.0
    bad = replace(OURS, attention_variant="test_est_two_maps_undeclared")
    tiny = replace(bad, vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64)
    real = flops_per_token(tiny) / _counted_flops_per_token(tiny) - 1
    assert flops_difference(bad) == pytest.approx(real, abs=1e-9) and real < -0.01
    setup = Setup(gpt=bad, precision="32-true", micro_batch_size=2)
    estimate = estimate_from_config(setup, device="cpu", history=False, trace="auto")
    (warning,) = [w for w in estimate.warnings if w.startswith("FLOPs per token differ")]
    assert f"{real:+.1%}" in warning and "activation_flops_per_token" in warning


@pytest.mark.parametrize("backend", ["cuda", "cpu"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_measuring_gpt2s_block_gives_the_validated_rules(backend: str, precision: str) -> None:
    """The measurement a variant's block gets, applied to GPT-2's block, equals the rules to the
    byte, GPU kernels' differences included (fused SDPA with dropout, 1-byte masks, fp32
    softmax and norm statistics): what a variant is measured with is what the rules know."""
    for gpt in (
        replace(BASE, attention="sdpa", position_embedding="rope", dropout=0.1, block_size=64),
        replace(BASE, dropout=0.1, block_size=64),
    ):
        num = numerics_for(Setup(gpt=gpt, precision=precision), backend)
        rules = saved_activations(gpt, 4, gpt.block_size, num)
        block = sum(rules.block.values()) + rules.block_weight_copies
        assert saved_bytes(gpt, "block", 4, gpt.block_size, num) == block
        final = rules.head["ln_f input"] + rules.head["ln_f mean+rstd"]
        assert saved_bytes(gpt, "final_norm", 4, gpt.block_size, num) == final
