"""The global gradient norm of an optimizer step, taken once for the clip and every reader.

A step's gradient norm is read by the clip (``gradient_clip_val``, by norm), the run log
(``grad_norm``) and the divergence stop (a non-finite norm). Each pass over the gradients is a
kernel per parameter group on a GPU and host time on a CPU, so :class:`GPTLightningModule`
takes it once, in ``configure_gradient_clipping``: Lightning calls that after every
``on_before_optimizer_step`` hook (so it sees the gradients as the optimizer will, after any
callback changed them, unscaled under fp16) and before the optimizer step. The clip then uses
it (:func:`clip_with_norm`) and the callbacks read it after the step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def gradient_norm(parameters: Iterable[torch.nn.Parameter]) -> torch.Tensor | None:
    """Global L2 norm of the parameters' gradients, as a float32 tensor (no host sync); ``None``
    if none has a gradient (DeepSpeed keeps its partitioned gradients outside ``.grad``).

    Plain tensors on one device take a single ``_foreach_norm`` (torch's private API): the public
    ``get_total_norm`` makes the same per-tensor pass but also reduces the norms in the gradients'
    dtype, which rounds the result to 3 digits under ``bf16-true``. Sharded gradients (FSDP2's
    DTensors) go through ``get_total_norm`` and come back whole.
    """
    return norm_of([p.grad for p in parameters if p.grad is not None])


def norm_of(grads: list[torch.Tensor]) -> torch.Tensor | None:
    """:func:`gradient_norm` of gradients already gathered."""
    if not grads:
        return None
    if plain_on_one_device(grads):
        norms = torch._foreach_norm(grads)
        return torch.linalg.vector_norm(torch.stack(norms).float())
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)  # DTensor / mixed devices
    full_tensor = getattr(total, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else total


def plain_on_one_device(tensors: list[torch.Tensor]) -> bool:
    """Whether ``tensors`` are plain tensors (not DTensors or other subclasses) on one device."""
    first = tensors[0]
    return type(first) is torch.Tensor and all(
        type(t) is torch.Tensor and t.device == first.device for t in tensors
    )


def clip_with_norm(
    parameters: list[torch.nn.Parameter],
    max_norm: float,
    total_norm: torch.Tensor,
    scale: torch.Tensor | None = None,
) -> None:
    """Scale the parameters' gradients in place so their global norm ``total_norm`` is at most
    ``max_norm``: ``torch.nn.utils.clip_grad_norm_``'s scaling (coefficient
    ``max_norm / (norm + 1e-6)``, capped at 1, no host sync), with the norm already taken.

    ``scale``: a factor the gradients still owe (a step's mean over its targets,
    GPTLightningModule.training_step), taken into the same multiply; ``total_norm`` is then the
    norm they will have once scaled. A scale of exactly 1.0 changes no bit of torch's clip."""
    clip = getattr(torch.nn.utils, "clip_grads_with_norm_", None)  # torch >= 2.6
    if clip is not None and scale is None:
        clip(parameters, max_norm, total_norm)
        return
    grads = [p.grad for p in parameters if p.grad is not None]
    if grads:
        coefficient = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        if scale is not None:
            coefficient = coefficient * scale
        torch._foreach_mul_(grads, coefficient.to(grads[0].device))


def scale_gradients(grads: list[torch.Tensor], scale: torch.Tensor) -> None:
    """Multiply ``grads`` in place by the device scalar ``scale`` (no host sync): one
    ``_foreach_mul_`` for plain tensors on one device; else one at a time, a sharded (DTensor)
    gradient taking the plain scalar as replicated."""
    if plain_on_one_device(grads):
        torch._foreach_mul_(grads, scale.to(grads[0].device))
        return
    from torch.distributed.tensor.experimental import implicit_replication

    with implicit_replication():
        for grad in grads:
            grad.mul_(scale.to(grad.device))
