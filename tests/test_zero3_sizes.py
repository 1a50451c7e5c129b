"""A model that DeepSpeed's ZeRO-3 holds partitioned is sized and checked whole.

ZeRO-3 leaves every parameter an empty placeholder (``numel() == 0``) once the strategy wraps
the model, the shards in ``ds_tensor``: the banner said ``model 0 parameters``, the start
record ``num_params 0`` and ``flops_per_token`` only the attention term (MFU 0.0%, the scaling
fit dropped the run), and the checkpoint's finite check looked at nothing. The model here is
partitioned by DeepSpeed itself (``deepspeed.zero.Init``, one gloo process).
"""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import yaml
from conftest import QUICKSTART, run_nanolab, tiny_overrides, write_config

from nanolab.model import GPT, GPTConfig
from nanolab.runlog import read_records

CONFIG = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32, vocab_size=71)


def _deepspeed_or_skip() -> None:
    pytest.importorskip("deepspeed")
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("DeepSpeed's CPU backend JIT-builds C++ ops; no compiler here")


@pytest.fixture
def partitioned(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """The GPT as ZeRO-3 holds it, in a one-process group taken down afterwards."""
    _deepspeed_or_skip()
    import deepspeed
    import torch.distributed as dist

    monkeypatch.setenv("LOCAL_RANK", "0")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        zero3 = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}
        with deepspeed.zero.Init(config_dict_or_path=zero3):
            model = GPT(CONFIG)
        yield model
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # importing DeepSpeed into the test process: ~30 s
def test_a_zero3_model_counts_its_whole_parameters_and_flops(partitioned) -> None:
    """Mutation caught: ``numel()`` (0 each) or ``dim()`` (the placeholder is 1-D) counted."""
    plain = GPT(CONFIG)
    assert all(p.numel() == 0 for p in partitioned.parameters())  # partitioned for real
    assert partitioned.num_params() == plain.num_params() > 0
    assert partitioned.num_params(non_embedding=True) == plain.num_params(non_embedding=True)
    assert partitioned.flops_per_token() == plain.flops_per_token()
    assert partitioned.recompute_flops_per_token() == plain.recompute_flops_per_token()


@pytest.mark.slow  # importing DeepSpeed into the test process: ~30 s
def test_a_zero3_model_s_finite_check_reads_its_shards(partitioned) -> None:
    """Mutation caught: the empty placeholders checked (always finite)."""
    from nanolab.callbacks.checkpoint import parameters_finite

    trainer = SimpleNamespace(lightning_module=partitioned, world_size=1)
    assert parameters_finite(trainer)
    next(partitioned.parameters()).ds_tensor.view(-1)[0] = float("nan")
    assert not parameters_finite(trainer)


@pytest.mark.slow  # DeepSpeed's start-up in its own process
def test_a_zero3_run_s_banner_and_start_record_count_the_model(tmp_path, char_dataset) -> None:
    """One process reproduces it: ``model 0 parameters``, ``num_params 0``."""
    _deepspeed_or_skip()
    cfg = tiny_overrides(char_dataset, tmp_path / "runs", run__name="z3", trainer__max_steps=2)
    args = ("fit", "--config", str(write_config(tmp_path / "z3.yaml", cfg)), "--config",
            str(QUICKSTART.parent / "strategy" / "deepspeed_stage3.yaml"), "--trainer.devices", "1")  # fmt: skip
    res = run_nanolab(*args, cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    gpt = yaml.safe_load((tmp_path / "runs" / "z3" / "config.yaml").read_text())["model"]["gpt"]
    plain = GPT(GPTConfig(**{k: v for k, v in gpt.items() if k in CONFIG.__dataclass_fields__}))
    start = next(iter(read_records(tmp_path / "runs" / "z3" / "metrics.jsonl")))
    assert start["num_params"] == plain.num_params()
    assert start["flops_per_token"] == plain.flops_per_token()
    count = f"{plain.num_params() / 1000:.1f}k parameters"
    assert f"model      {count}" in res.stdout + res.stderr
