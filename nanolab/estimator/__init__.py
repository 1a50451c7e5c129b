"""Memory and cost estimator: will a config fit, with which micro-batch, and what will it cost.

Public API (cheap to call before a run starts: the model is built on the meta device)::

    from nanolab.estimator import estimate_from_config, largest_fitting_micro_batch

    est = estimate_from_config("configs/gpt2-124m.yaml", gpu="rtx4070")
    est.fits, est.memory.total, est.recommended_micro_batch, est.compute.step_seconds

Modules, one job each: ``gpus`` (the device table ``gpus.json``: memory, peaks, family MFU, each
with its source; memory strings), ``setup`` (YAML -> facts), ``shapes`` (parameter tensors,
buffers, FLOPs, read from the model built on the meta device), ``numerics`` (dtypes per
precision/strategy/backend), ``activations`` (what autograd saves), ``derived`` (what a block of
other variants saves, measured from the module on fake tensors), ``states`` (parameters,
gradients, optimizer, sharding), ``memory`` (the moments of the step, peak and overheads),
``compute`` (time and cost at the run's matmul rate), ``runtime`` (how long a run takes: the
fit banner's and the queue's estimate), ``history`` (measured tokens/s of finished
queue runs), ``cpu`` (this machine as a device), ``recommend`` (micro-batch and switches),
``trace`` (the model the run builds, one whole step traced on fake tensors), ``estimate`` (the front door), ``cli`` (``nanolab estimate``), ``measure`` and
``measure_trainer`` (ground truth from real tensors and a real Trainer, for tests and the
benchmark).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "Estimate",
    "EstimateError",
    "estimate_from_config",
    "largest_fitting_micro_batch",
    "setup_for",
]


def __getattr__(name: str) -> Any:
    # Lazy, so that ``import nanolab.estimator.gpus`` stays free of torch and Lightning.
    if name in __all__:
        from nanolab.estimator import estimate

        return getattr(estimate, name)
    raise AttributeError(f"module 'nanolab.estimator' has no attribute {name!r}")
