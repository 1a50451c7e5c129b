"""The estimator's model-state bytes equal what real tensors hold, to the byte.

Also: the parameter list and FLOPs it reads from a meta-device build match ``GPT``'s exactly, the
GPT-2 124M parameter counts, and DeepSpeed's own ZeRO estimates on a real model.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from nanolab.estimator.measure import measure_states
from nanolab.estimator.numerics import numerics_for
from nanolab.estimator.setup import Setup, Strategy
from nanolab.estimator.shapes import flops_per_token, inventory, num_params
from nanolab.estimator.states import model_states
from nanolab.model.config import GPTConfig
from nanolab.model.gpt import GPT

SMALL = GPTConfig(vocab_size=300, block_size=32, n_layer=2, n_head=2, n_embd=64)
VARIANTS = [
    SMALL,
    replace(SMALL, bias=False),
    replace(SMALL, tie_weights=False, vocab_multiple=1),
    replace(SMALL, position_embedding="rope", mlp_ratio=2),
    GPTConfig(
        vocab_size=5000,
        block_size=64,
        n_layer=3,
        n_head=4,
        n_embd=96,
        bias=False,
        tie_weights=False,
        position_embedding="rope",
    ),
]


@pytest.mark.parametrize(
    "cfg",
    VARIANTS,
    ids=lambda c: f"bias{c.bias}-tie{c.tie_weights}-{c.position_embedding}-V{c.vocab_size}",
)
def test_parameter_list_and_flops_mirror_the_model(cfg: GPTConfig) -> None:
    model = GPT(cfg)
    real = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    mirror = [(t.name, t.shape) for t in inventory(cfg).tensors]
    assert mirror == real
    linear = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    by_name = dict(model.named_parameters())
    assert [t.matmul for t in inventory(cfg).tensors] == [
        id(by_name[t.name]) in linear for t in inventory(cfg).tensors
    ]
    assert num_params(cfg) == model.num_params()
    assert flops_per_token(cfg) == model.flops_per_token()
    assert flops_per_token(cfg, 17) == model.flops_per_token(17)


def test_gpt2_124m_parameter_counts() -> None:
    """The published GPT-2 small figure (vocab 50257, tied head, biases), and the padded one."""
    gpt2 = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    assert num_params(replace(gpt2, vocab_multiple=1)) == 124_439_808
    assert num_params(gpt2) == 124_475_904  # vocab padded to 50304: +47 x 768


PRECISIONS = {"32-true": torch.float32, "bf16-mixed": torch.float32, "bf16-true": torch.bfloat16}


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit"])
@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("cfg", [SMALL, VARIANTS[-1]], ids=["small", "rope-untied"])
def test_model_states_equal_real_tensors(cfg: GPTConfig, precision: str, optimizer: str) -> None:
    real = measure_states(cfg, optimizer, dtype=PRECISIONS[precision])
    setup = Setup(gpt=cfg, precision=precision, optimizer=optimizer)
    est = model_states(setup, inventory(cfg), numerics_for(setup, "cpu"))
    assert est.params == real.params
    assert est.grads == real.grads
    assert est.optimizer == real.optimizer
    assert est.buffers == real.buffers


def _deepspeed_printed_gib(text: str, **offload: bool) -> float:
    """The 'per GPU' column of the row whose ``offload_<x>`` options are on/off as given."""
    for line in text.splitlines():
        if "|" not in line or "GB" not in line:
            continue
        options = dict(re.findall(r"offload_(\w+)=(\S+?),?(?:\s|$)", line))
        if all((options.get(k) != "none") == on for k, on in offload.items()):
            return float(re.findall(r"([\d.]+)GB", line)[1])
    raise AssertionError(f"no row with {offload} in:\n{text}")


@pytest.mark.parametrize("world", [1, 2, 8])
def test_zero2_model_states_match_deepspeed(world: int, capsys: pytest.CaptureFixture) -> None:
    from deepspeed.runtime.zero.stage_1_and_2 import (
        estimate_zero2_model_states_mem_needs,
        estimate_zero2_model_states_mem_needs_all_live,
        model_to_params,
    )

    cfg = GPTConfig(vocab_size=50257, block_size=256, n_layer=2, n_head=8, n_embd=512)
    model = GPT(cfg)  # a real model: on the meta device DeepSpeed counts 0 parameters
    P = model_to_params(model)
    assert num_params(cfg) == P
    for offload in (False, True):
        setup = Setup(
            gpt=cfg,
            devices=world,
            precision="bf16-mixed",
            strategy=Strategy("deepspeed", zero_stage=2, offload_optimizer=offload),
        )
        st = model_states(setup, inventory(cfg), numerics_for(setup))
        ours = st.params + st.grads + st.master + st.optimizer
        _, theirs = estimate_zero2_model_states_mem_needs(
            P, num_gpus_per_node=world, cpu_offload=offload
        )
        assert abs(ours - theirs) <= 24 * world  # their int() of 18P/N vs our per-shard ceil
        estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=world)
        printed = _deepspeed_printed_gib(capsys.readouterr().out, optimizer=offload)
        assert ours / 2**30 == pytest.approx(printed, abs=0.006)


@pytest.mark.parametrize("world", [1, 4])
def test_zero3_model_states_match_deepspeed(world: int, capsys: pytest.CaptureFixture) -> None:
    from deepspeed.runtime.zero.stage3 import (
        estimate_zero3_model_states_mem_needs,
        estimate_zero3_model_states_mem_needs_all_live,
        model_to_params,
    )

    cfg = GPTConfig(vocab_size=50257, block_size=256, n_layer=2, n_head=8, n_embd=512)
    model = GPT(cfg)
    P, largest = model_to_params(model)
    assert largest == inventory(cfg).largest_module_numel
    estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=world)
    text = capsys.readouterr().out
    for opt_off, param_off in ((False, False), (True, False), (True, True)):
        strategy = Strategy(
            "deepspeed", zero_stage=3, offload_optimizer=opt_off, offload_params=param_off
        )
        setup = Setup(gpt=cfg, devices=world, precision="bf16-mixed", strategy=strategy)
        st = model_states(setup, inventory(cfg), numerics_for(setup))
        ours = st.params + st.grads + st.master + st.optimizer + st.gathered
        _, theirs, _ = estimate_zero3_model_states_mem_needs(
            P,
            largest,
            num_gpus_per_node=world,
            cpu_offload=opt_off,
            cpu_offload_params=param_off,
        )
        assert abs(ours - theirs) <= 24 * world
        printed = _deepspeed_printed_gib(text, param=param_off, optimizer=opt_off)
        assert ours / 2**30 == pytest.approx(printed, abs=0.006)
