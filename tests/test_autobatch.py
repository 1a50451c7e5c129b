"""`run.micro_batch_size: auto` and the start-of-run memory warning, on the real estimator."""

from __future__ import annotations

import pytest
import yaml
from conftest import REPO

from nanolab.estimator import estimate_from_config
from nanolab.run.autobatch import AutoBatchError, plan_memory

GIB = 2**30


@pytest.fixture
def gpt2_124m() -> dict:
    cfg = yaml.safe_load((REPO / "configs" / "gpt2-124m.yaml").read_text())
    cfg.setdefault("run", {})["micro_batch_size"] = "auto"
    return cfg


def test_auto_picks_the_largest_fitting_divisor_of_the_global_batch(gpt2_124m):
    plan = plan_memory(gpt2_124m, 12 * GIB, auto=True, devices_per_node=1)
    per_device_sequences = gpt2_124m["run"]["global_batch_tokens"] // 1024
    assert plan.micro_batch_size >= 1 and per_device_sequences % plan.micro_batch_size == 0
    assert plan.warning is None and plan.predicted_bytes <= 12 * GIB
    # The next divisor up would not fit: it really is the largest.
    bigger = plan.micro_batch_size * 2
    est = estimate_from_config(gpt2_124m, device_memory=12 * GIB, micro_batch_size=bigger)
    assert not est.fits
    # More memory, a larger micro-batch.
    assert (
        plan_memory(gpt2_124m, 80 * GIB, auto=True, devices_per_node=1).micro_batch_size
        > plan.micro_batch_size
    )


def test_a_fixed_micro_batch_that_does_not_fit_gets_one_warning(gpt2_124m):
    gpt2_124m["run"]["micro_batch_size"] = None
    gpt2_124m["data"]["micro_batch_size"] = 64
    plan = plan_memory(gpt2_124m, 12 * GIB, auto=False, devices_per_node=1)
    assert plan.micro_batch_size == 64
    assert plan.warning is not None and "exceeds" in plan.warning and "12.0 GiB" in plan.warning


def test_nothing_fits_is_an_error_with_switches(gpt2_124m):
    with pytest.raises(AutoBatchError, match="not even one sequence fits"):
        plan_memory(gpt2_124m, GIB // 2, auto=True, devices_per_node=1)


def test_auto_on_a_cpu_says_it_takes_the_data_micro_batch(tmp_path, char_dataset):
    """No GPU memory to plan against: ``auto`` takes ``data.micro_batch_size`` and says so (it
    was silent, where a GPU run names what it picked)."""
    from conftest import nanolab_here, tiny_overrides, write_config

    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=1)
    config = write_config(tmp_path / "t.yaml", cfg)
    proc = nanolab_here("fit", "--config", str(config), "--run.micro_batch_size", "auto",
                        "--run.global_batch_tokens", "512", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = proc.stdout + proc.stderr
    assert "run.micro_batch_size auto: 4, data.micro_batch_size (no GPU memory" in said, said
    assert "4 micro-batch x 32 context x 4 accumulation" in said


def test_a_rocm_machine_is_held_to_the_rules_estimate_shows_for_its_gpu(gpt2_124m, monkeypatch):
    """On ROCm torch reports the GPU through ``torch.cuda`` too; fit's memory plan used the
    CUDA overheads (768 MiB context, 384 MiB communication) where ``nanolab estimate --gpu
    mi300x`` uses ROCm's, so the two disagreed by 0.25-0.4 GiB. The backend now comes from
    the torch build: a ROCm build (``torch.version.hip`` set, forced here) plans as estimate
    does for an MI300X."""
    import torch

    from nanolab.estimator.gpus import GPUS
    from nanolab.run.autobatch import device_backend

    monkeypatch.setattr(torch.version, "hip", None)
    assert device_backend() == "cuda"
    monkeypatch.setattr(torch.version, "hip", "7.2.0")
    assert device_backend() == "rocm"
    mi300x = GPUS["mi300x"].memory_bytes
    for devices in (1, 8):
        plan = plan_memory(gpt2_124m, mi300x, auto=True, devices_per_node=devices)
        est = estimate_from_config(
            gpt2_124m, gpu="mi300x", devices=devices, micro_batch_size=plan.micro_batch_size
        )
        assert plan.predicted_bytes == est.memory.total
        assert plan.micro_batch_size == est.largest_micro_batch or est.fits
