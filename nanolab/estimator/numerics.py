"""Which dtype each tensor has, for a Lightning precision, a strategy and a device backend.

What the ``trainer.precision`` strings mean in Lightning (and so in nanolab):

* ``32-true``: fp32 parameters, gradients, optimizer states and activations.
* ``bf16-mixed`` / ``16-mixed``: fp32 parameters, gradients and optimizer states; the forward
  runs under ``torch.autocast``, which casts each Linear's input *and weight* to 16 bits. The
  fp32 parameters already are the "master weights", so there is no separate master copy, but
  autocast's 16-bit weight copies are saved for the backward pass (Lightning turns autocast's
  weight cache off; each copy still lives until its backward ran). The residual stream stays
  fp32, the LayerNorm statistics and the loss run in fp32.
* ``bf16-true`` / ``16-true``: the whole model is cast to 16 bits; parameters, gradients,
  optimizer states (torch AdamW's states follow the parameter dtype) and every activation are
  16-bit, and the loss's log-softmax too. Half the model-state memory, less accurate updates.

Strategies change this: DeepSpeed casts the module to 16 bits under ``*-mixed`` (no autocast)
and keeps an fp32 master copy inside its optimizer; Lightning's FSDP1 gathers 16-bit parameters
(``MixedPrecision(param_dtype=bf16)``) and still runs autocast; FSDP2 as nanolab applies it has
no mixed-precision policy, so it behaves like plain autocast on fp32 parameters.

The backend matters for a few kernels: on CUDA/ROCm dropout saves a 1-byte bool mask, SDPA uses
fused kernels also with dropout, and autocast runs softmax in fp32; on CPU dropout saves a mask
in the input's dtype, SDPA with dropout falls back to an fp32 math kernel that saves the scores,
and autocast leaves softmax in bf16. The CPU column exists so the tests can measure it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from nanolab.estimator.setup import Setup

Backend = Literal["cuda", "rocm", "cpu"]


@dataclass(frozen=True)
class Numerics:
    """Bytes per element of each kind of tensor.

    Attributes:
        param: Parameters as stored on the device (the copy the forward reads, unless FSDP1
            gathers them in ``gather`` precision).
        grad: Gradients (``param.grad``).
        compute: Matmul inputs and outputs (the Linear activations, attention, GELU).
        resid: The residual stream between blocks (what gradient checkpointing keeps).
        ln_in: LayerNorm's saved input (autocast on CUDA casts it to fp32 when the stream is
            16-bit).
        ln_stats: LayerNorm's saved mean and reciprocal std.
        softmax: The math attention path's saved softmax output.
        loss: The loss's saved log-softmax (and its scalar weight).
        fp32_logits_copy: The loss casts 16-bit logits to fp32 first (autocast).
        weight_copies: Autocast saves a ``compute``-dtype copy of each Linear weight.
        rope_table_copies: RoPE's fp32 cos/sin buffers are cast per call (autocast only).
        dropout_mask_bool: Dropout saves a 1-byte mask (CUDA); else a mask in the input dtype.
        sdpa_dropout_math: SDPA with dropout falls back to the fp32 math kernel (CPU).
        gather: Dtype FSDP gathers parameters in.
        gpu: A CUDA/ROCm device (False: CPU, where some kernels allocate differently).
        gpu_autocast_loss: Autocast on a GPU: the loss keeps the 16-bit logits for backward as
            well as its fp32 log-softmax, and its backward holds one fp32 B·T·V gradient, not
            two (measured on an H200, 2026-12-04: GPT-2 124M at B16 and 350M at B8 both saved
            exactly 2·B·T·V bytes more than the CPU rule and peaked 4·B·T·V above the forward's
            end; benches/bench_memory.py prints both).
        compiled_loss: ``torch.compile`` on a GPU: Inductor fuses the log-softmax into the loss,
            which then saves its input logits (compute dtype) and each row's max and
            log-sum-exp, never a B·T·V log-softmax; its backward holds one fp32 B·T·V gradient.
            The blocks save what eager saves (Inductor's partition of GPT-2's block, checked on
            CPU by tests/test_estimator_compiled.py). Measured on an H200, 2026-12-04: 124M at
            B16 and 350M at B8 compiled peaked 4·B·T·V bytes under the eager rule, the
            log-softmax it no longer keeps.
    """

    param: int
    grad: int
    compute: int
    resid: int
    ln_in: int
    ln_stats: int
    softmax: int
    loss: int
    fp32_logits_copy: bool
    weight_copies: bool
    rope_table_copies: bool
    dropout_mask_bool: bool
    sdpa_dropout_math: bool
    gather: int
    gpu: bool = True
    gpu_autocast_loss: bool = False
    compiled_loss: bool = False


def numerics_for(setup: Setup, backend: Backend = "cuda") -> Numerics:
    """The dtype sizes that ``setup`` trains with on ``backend``."""
    gpu = backend != "cpu"
    kind = setup.strategy.kind
    kernels = {
        "dropout_mask_bool": gpu,
        "sdpa_dropout_math": not gpu,
        "gpu": gpu,
        "compiled_loss": gpu and setup.compile,
    }
    fp32 = Numerics(4, 4, 4, 4, 4, 4, 4, 4, False, False, False, gather=4, **kernels)
    if setup.precision == "32-true":
        return fp32
    if kind == "deepspeed" or not setup.precision.endswith("-mixed"):
        # Every activation is 16-bit; the loss casts the logits to fp32 first (GPT.forward).
        sixteen = {k: 2 for k in ("param", "grad", "compute", "resid", "ln_in", "softmax")}
        return replace(fp32, **sixteen, ln_stats=4 if gpu else 2, gather=2, fp32_logits_copy=True)
    # Autocast on fp32 parameters (single device, DDP, FSDP2).
    autocast = replace(
        fp32,
        compute=2,
        softmax=4 if gpu else 2,
        fp32_logits_copy=True,
        weight_copies=True,
        rope_table_copies=True,
        gpu_autocast_loss=gpu,
    )
    if kind == "fsdp1":
        # 16-bit gathered parameters and buffers, fp32 sharded master, autocast on top.
        return replace(
            autocast,
            resid=2,
            ln_in=4 if gpu else 2,
            weight_copies=False,
            rope_table_copies=False,
            gather=2,
        )
    return autocast
