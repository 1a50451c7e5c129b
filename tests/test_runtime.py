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


def test_a_small_model_s_steps_are_priced_at_the_host_s_fixed_work_and_called_a_lower_bound() -> (
    None
):
    """A 2-layer, 32-wide model's 3,000 CPU steps (256 tokens each) were estimated at ~3 s of
    training, FLOPs alone, where they took 99 s: each step's fixed host work (the loop, the
    optimizer, the per-op dispatch of every micro-batch) is at least ~4 ms here. The banner's
    and the queue's figure (``run_seconds``) and ``estimate``'s carry it, on a CPU added to the
    FLOPs time and on a GPU as the step's floor, and say the figure is a lower bound.

    Mutations caught: no fixed cost per step (3 s); the floor not per micro-batch."""
    from nanolab.estimator.cpu import HOST_LAYER_S, HOST_MICRO_BATCH_S, HOST_STEP_S

    cfg = compose(["--config", str(QUICKSTART), "--model.gpt.vocab_size", "71",
                   "--model.gpt.n_layer", "2", "--model.gpt.n_head", "2",
                   "--model.gpt.n_embd", "32", "--model.gpt.block_size", "32",
                   "--data.micro_batch_size", "4", "--trainer.accumulate_grad_batches", "2"])  # fmt: skip
    floor = HOST_STEP_S + 2 * (HOST_MICRO_BATCH_S + 2 * HOST_LAYER_S)
    assert floor >= 3e-3
    est = estimate_from_config(cfg, device="cpu", history=False)
    assert est.compute.floor_seconds == pytest.approx(floor)
    flops_s = est.compute.flops_per_step / (est.compute.peak_tflops_per_device * 1e12 * 0.55)
    assert est.compute.step_seconds == pytest.approx(flops_s + floor, rel=1e-6)
    seconds, how = run_seconds(cfg, devices=1, tokens_per_step=256, max_steps=3000)
    assert seconds - STARTUP_S == pytest.approx(est.compute.step_seconds * 3000, rel=1e-9)
    assert seconds - STARTUP_S >= 3000 * floor
    assert "a lower bound" in how and "fixed host work" in how
    gpu_s, gpu_how = run_seconds(cfg, devices=1, tokens_per_step=256, max_steps=3000, gpu="h100")
    assert gpu_s - STARTUP_S == pytest.approx(3000 * floor)  # the floor, not microseconds
    assert "a lower bound" in gpu_how


def test_a_projects_own_optimizer_is_timed_from_its_flops_and_its_memory_said_unknown() -> None:
    """An optimizer registered as docs/optimizers.md shows ("Add an optimizer") got no time at
    all: the estimator refused it for its state memory, so ``queue add`` printed ``~?`` and
    ``queue run --until`` could not judge it. The FLOPs, and so the time, are the model's: it is
    timed as AdamW is; its memory is still refused, in words that say the way forward."""
    import torch

    from nanolab.estimator.setup import EstimateError
    from nanolab.queue.jobs import ParsedConfig
    from nanolab.queue.predict import memory_need
    from nanolab.training.optim import OPTIMIZERS, register_optimizer

    if "test_own_sign" not in OPTIMIZERS:

        @register_optimizer("test_own_sign")
        class OwnSign(torch.optim.SGD):
            """A project's optimizer the memory model does not know."""

    base = ["--config", str(QUICKSTART), "--model.gpt.vocab_size", "71"]
    adamw = compose(base)
    own = compose([*base, "--model.optimizer.name", "test_own_sign"])
    timed = run_seconds(own, devices=1, tokens_per_step=4096, max_steps=600)
    assert timed == run_seconds(adamw, devices=1, tokens_per_step=4096, max_steps=600)
    assert timed[0] is not None
    with pytest.raises(EstimateError) as refused:
        estimate_from_config(own, device="cpu", history=False)
    assert "'test_own_sign': its state memory is not modelled" in str(refused.value)
    assert "--model.optimizer.name adamw estimates the same FLOPs and time" in str(refused.value)
    parsed = ParsedConfig(config=own, run_root="runs", max_steps=600, devices=1,
                          tokens_per_step=4096, step_bound=600)  # fmt: skip
    peak, why = memory_need(parsed)
    assert peak is None and why == (
        "no memory estimate: model.optimizer.name 'test_own_sign': its state memory is not "
        "modelled (the estimate covers adamw, adamw8bit, muon)"
    )
