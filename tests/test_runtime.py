"""One estimate of how long a run takes: ``estimate --device cpu``, the fit banner and the queue."""

from __future__ import annotations

import pytest
from conftest import QUICKSTART

from nanolab.estimator.cpu import cpu_device
from nanolab.estimator.estimate import estimate_from_config
from nanolab.estimator.runtime import STARTUP_S, run_seconds
from nanolab.training.resolve import compose


def test_estimate_banner_and_queue_give_one_number_on_cpu() -> None:
    cfg = compose(["--config", str(QUICKSTART), "--model.gpt.vocab_size", "71"])
    est = estimate_from_config(cfg, device="cpu", history=False)
    seconds, how = run_seconds(cfg, devices=1, tokens_per_step=4096, max_steps=600)
    # The same formula over the same probe (measured once in this process).
    assert seconds - STARTUP_S == pytest.approx(est.compute.step_seconds * 600, rel=1e-9)
    rate = est.compute.peak_tflops_per_device
    assert rate == cpu_device(bf16=False).peak("fp32") == cpu_device().peak("fp32")
    assert f"{rate * 1e3:,.0f} GFLOP/s" in how  # a CPU's rate is not printed as "0.2 TFLOP/s"
