"""What the rules cannot know about a model variant, read from the real module on fake tensors:
the activations a part saves (:func:`saved_bytes`) and whether FLOPs per token cover the matmuls
the model runs (:func:`flops_difference`).

The rules in :mod:`nanolab.estimator.activations` were written, tensor by tensor, for the GPT-2
block (LayerNorm, causal attention, GELU MLP) and validated on GPUs too. A block made of other
registered variants (RMSNorm, SwiGLU, QK-norm, ReLU², or a project's own) is measured instead:
one block is built from the config, as the model builds it, and runs one training forward on
fake tensors (shapes and dtypes only: no memory, no FLOPs) under the run's precision, while
``torch.autograd.graph.saved_tensors_hooks`` collects every storage autograd keeps for the
backward. Views share storage and count once; parameters are model states, not activations.

What it runs are CPU kernels, made to save what a GPU's do where the two differ (fused SDPA
with dropout, 1-byte dropout masks, softmax in fp32 under autocast, fp32 norm statistics): on GPT-2's block the result
equals the GPU-validated rules (tests/test_estimator_variants.py). Sizes are affine in the micro-batch for B >= 2 (every activation
has a batch dimension, a few tables do not), so two traces give every larger B.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import Literal

from nanolab.estimator.numerics import Numerics
from nanolab.model.config import GPTConfig

Part = Literal["block", "final_norm"]


def saved_bytes(gpt: GPTConfig, part: Part, batch: int, seq_len: int, num: Numerics) -> int:
    """Bytes one ``part`` (a transformer block, or the final norm) saves for its backward.

    Autocast's 16-bit copies of a block's Linear weights are included (they are saved too);
    :func:`nanolab.estimator.activations.saved_activations` accounts for them on their own line.
    """
    key = tuple(sorted(gpt.to_dict().items()))
    # The module's dtype; autocast on top of fp32 parameters; the residual stream's dtype; and
    # what a GPU's kernels do differently (fused SDPA with dropout, 1-byte dropout masks, softmax
    # in fp32 under autocast, the norms' statistics in fp32).
    modes = (
        num.param == 2 and not num.weight_copies,
        num.weight_copies,
        num.resid == 2,
        not num.sdpa_dropout_math,
        num.dropout_mask_bool,
        num.softmax == 4,
        num.ln_stats,
    )
    if batch <= 3:
        return _traced(key, part, batch, seq_len, *modes)
    two, three = _traced(key, part, 2, seq_len, *modes), _traced(key, part, 3, seq_len, *modes)
    return two + (batch - 2) * (three - two)


@lru_cache(maxsize=1024)
def _traced(
    key: tuple,
    part: Part,
    batch: int,
    seq_len: int,
    half: bool,
    autocast: bool,
    half_resid: bool,
    fused_dropout: bool,
    bool_masks: bool,
    fp32_softmax: bool,
    stats_bytes: int,
) -> int:
    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.weak import WeakIdKeyDictionary

    from nanolab.estimator.shapes import skip_random_init
    from nanolab.model.gpt import Block
    from nanolab.model.registry import NORMS

    gpt = GPTConfig(**dict(key))
    saved: WeakIdKeyDictionary = WeakIdKeyDictionary()
    kept: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.append(t)  # alive until counted, so a storage cannot be freed and its id reused
        st = t.untyped_storage()
        if st not in saved:
            saved[st] = st.nbytes()
        return t

    masks: WeakIdKeyDictionary = WeakIdKeyDictionary()  # dropout masks: storage -> numel
    stats: WeakIdKeyDictionary = WeakIdKeyDictionary()  # norm statistics: storage -> numel
    norms = {
        torch.ops.aten.native_layer_norm.default: (1, 2),  # mean, rstd
        torch.ops.aten._fused_rms_norm.default: (1,),  # rstd
    }

    class GpuKernels(TorchFunctionMode):
        """The CPU kernels made to save what a GPU's do (docs: nanolab/estimator/numerics.py)."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func is F.scaled_dot_product_attention and fused_dropout:
                # Flash / memory-efficient kernels regenerate dropout from a seed: no mask,
                # no scores (the CPU falls back to spelled-out attention with dropout).
                if len(args) > 3:
                    args = (*args[:3], 0.0, *args[4:])
                kwargs["dropout_p"] = 0.0
            if func is F.softmax and fp32_softmax and args[0].dtype != torch.float32:
                kwargs["dtype"] = torch.float32  # CUDA autocast runs softmax in fp32
            return func(*args, **kwargs)

    class DropoutMasks(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.native_dropout.default:
                masks[out[1].untyped_storage()] = out[1].numel()
            elif func is torch.ops.aten.bernoulli_.float:  # the CPU's dropout: a float mask
                masks[out.untyped_storage()] = out.numel()
            for i in norms.get(func, ()):  # a GPU keeps them in fp32 also for 16-bit inputs
                stats[out[i].untyped_storage()] = out[i].numel()
            return out

    previous_dtype = torch.get_default_dtype()
    with FakeTensorMode():
        try:  # Lightning's "-true" precisions build the module in 16 bits, buffers too
            torch.set_default_dtype(torch.bfloat16 if half else previous_dtype)
            with skip_random_init():
                module = Block(gpt) if part == "block" else NORMS.get(gpt.norm)(gpt.n_embd, gpt)
        finally:
            torch.set_default_dtype(previous_dtype)
        if half:
            for m in module.modules():
                for name, b in list(m._buffers.items()):
                    if b is not None and b.is_floating_point():
                        m._buffers[name] = b.to(torch.bfloat16)
        module.train()
        params = {id(t.untyped_storage()) for t in (*module.parameters(), *module.buffers())}
        resid = torch.bfloat16 if half_resid else torch.float32
        x = torch.empty(batch, seq_len, gpt.n_embd, dtype=resid, requires_grad=True)
        with (
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            GpuKernels(),
            DropoutMasks(),
        ):
            module(x)
        if bool_masks:
            for st, numel in masks.items():
                if st in saved:
                    saved[st] = numel
        for st, numel in stats.items():
            if st in saved:
                saved[st] = numel * stats_bytes
        return sum(n for st, n in saved.items() if id(st) not in params)


def tiny_model(gpt: GPTConfig) -> GPTConfig:
    """A model of ``gpt``'s parts, 2 layers of 2 heads, 64 wide, 32 tokens: traced in well under
    a second, it shows whether the rules and FLOPs describe the kind of model."""
    return replace(
        gpt, vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64, vocab_multiple=64
    )


def flops_difference(gpt: GPTConfig) -> float:
    """How far ``GPT.flops_per_token`` is from the matmuls the model really runs, relative.

    A tiny model of ``gpt`` (its variants, 2 layers, 64 wide) runs a training step on fake tensors
    under ``torch.utils.flop_counter``; the model's own figure should equal the count. It does not when a module multiplies two activations (attention-like) and
    does not declare them with ``activation_flops_per_token``. 0.0 means they agree.
    """
    from nanolab.estimator.facts_cache import remembered

    return remembered("flops_difference", gpt, None, lambda: _counted_flops_difference(gpt))


def _counted_flops_difference(gpt: GPTConfig) -> float:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from nanolab.estimator.shapes import skip_random_init
    from nanolab.model.gpt import GPT

    tiny = tiny_model(gpt)
    aten = torch.ops.aten
    # The CPU flash kernel has no formula in the counter; it does what CUDA's flash kernel does.
    kernels = {
        aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_flops,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_backward_flops,
    }
    with FakeTensorMode():
        with skip_random_init():
            model = GPT(tiny)
        idx = torch.zeros(1, tiny.block_size, dtype=torch.long)
        with FlopCounterMode(display=False, custom_mapping=kernels) as counter:
            model(idx, idx)[1].backward()
    expected = model.flops_per_token()
    counted = counter.get_total_flops() / tiny.block_size
    return expected / counted - 1


def _sdpa_flops(q, k, v, *args, out_shape=None, **kwargs) -> int:
    """q k^T and scores @ v: 2 FLOPs per multiply-add, over (B, H, T, S) scores."""
    b, h, t, d = q
    return 2 * b * h * t * k[-2] * d + 2 * b * h * t * k[-2] * v[-1]


def _sdpa_backward_flops(grad, q, k, v, *args, out_shape=None, **kwargs) -> int:
    """The gradients of q, k, v and the scores: twice the forward (the counter's convention)."""
    return 2 * _sdpa_flops(q, k, v)


def forget_models() -> None:
    """Drop every model read so far (here and in :mod:`nanolab.estimator.shapes`).

    Each config's model is read once per process; a session that redefines a class the model
    is built from (a notebook, a test patching ``Block``) calls this to read the new one.
    """
    from nanolab.estimator.shapes import _flops, _model, _read

    for cached in (_model, _read, _flops, _traced):
        cached.cache_clear()
