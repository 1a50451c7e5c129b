"""Gradient clipping and loss-scale handling for optimizers that unscale inside their step.

torch's fused AdamW (nanolab's default on CUDA) takes the loss scale and the overflow flag into
its own kernel: a ``GradScaler`` hands them over instead of unscaling the gradients first.
Lightning's mixed-precision plugin therefore refuses to clip such an optimizer ("does not allow
for gradient clipping because it performs unscaling of gradients internally") and, under fp16,
runs ``on_before_optimizer_step`` on gradients still multiplied by the loss scale.

Both follow GradScaler's documented order for clipping instead: run the backward, call
``scaler.unscale_(optimizer)``, then read and clip the gradients, then ``scaler.step``. After an
explicit ``unscale_`` the scaler passes the fused kernel no scale (nothing is unscaled twice) and
the overflow flag that ``unscale_`` found (a step with inf/NaN gradients is still skipped). Under
bf16 and fp32 there is no scaler and the clip is the plain global-norm clip before the step.

DeepSpeed's engine owns its gradients and clips them itself; nothing here applies to it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch


def handles_unscaling(optimizer: Any) -> bool:
    """Whether ``optimizer`` unscales fp16 gradients inside its own step (torch's fused
    optimizers set ``_step_supports_amp_scaling``; a LightningOptimizer copies the flag)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def raw_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer under Lightning's wrapper: GradScaler keys its per-optimizer state
    (unscaled yet? overflow found?) by the object's id, and Lightning steps the raw one."""
    return getattr(optimizer, "optimizer", optimizer)


def unscale_after_backward(
    closure: Callable[[], Any], scaler: torch.amp.GradScaler, optimizer: Any
) -> Callable[[], Any]:
    """``closure`` (forward + backward) followed by ``scaler.unscale_``, for an optimizer that
    unscales inside its step: the hooks that read gradients after the closure (the logged
    gradient norm, the clip) then see true gradients, and ``scaler.step`` still skips the step
    when they overflowed. A closure that returns ``None`` skipped its backward: nothing to do."""
    raw = raw_optimizer(optimizer)

    def closure_then_unscale() -> Any:
        result = closure()
        if result is not None:
            scaler.unscale_(raw)
        return result

    return closure_then_unscale


def step_closure(
    trainer: Any, optimizer: Any, closure: Callable[[], Any] | None
) -> Callable[[], Any] | None:
    """The closure a LightningModule's ``optimizer_step`` should step with: under fp16 (the
    precision plugin has a scaler) with an optimizer that unscales inside its step, one that
    unscales right after the backward (:func:`unscale_after_backward`); else ``closure``."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None and closure is not None and handles_unscaling(optimizer):
        return unscale_after_backward(closure, scaler, optimizer)
    return closure


def _with_gradients(optimizer: Any) -> Iterator[torch.Tensor]:
    for group in optimizer.param_groups:
        yield from (p for p in group["params"] if p.grad is not None)


def clip_gradients(optimizer: Any, clip_val: float, algorithm: str = "norm") -> None:
    """Clip the gradients of ``optimizer``'s parameters in place, as Lightning's plain precision
    plugin does (global L2 norm, or element-wise value), without its fused-optimizer refusal.
    Called only once the gradients are unscaled (see :func:`unscale_after_backward`)."""
    if not clip_val or clip_val <= 0:
        return
    params = list(_with_gradients(optimizer))
    if not params:
        return
    if str(algorithm).lower().endswith("value"):
        torch.nn.utils.clip_grad_value_(params, clip_val)
    else:
        torch.nn.utils.clip_grad_norm_(params, clip_val)
