"""Model-derived memory: one training step of the model the run builds, on fake tensors.

The analytic rules (``activations``, ``states``, ``memory``) describe nanolab's GPT. A fork that
changes the attention, the MLP or the head would get a silently wrong estimate from them, so this
module runs the step itself: ``GPT(config)`` is built as ``GPTLightningModule`` builds it (so
``nanolab/model/gpt.py`` as the fork has it) with the optimizer ``nanolab.training.optim``
builds, then one warm-up step and one measured step run under ``FakeTensorMode`` (shapes
and dtypes only, no memory, no FLOPs) in the order ``nanolab fit`` uses: forward (under autocast
for ``*-mixed``), backward, optimizer step, gradients freed. A dispatch mode records every
storage an operator creates and a weak reference notices when it is freed, as PyTorch's own
memory tracker does; the running sum's maximum plus the resident states is the peak.

What it sees is what a CPU run allocates through operators (CPU kernels, CPU autocast, torch's
per-tensor AdamW); not kernel-internal scratch (oneDNN's bf16 packing buffers), nor a GPU's
kernels. So it gives the CPU estimate directly, and for GPUs :func:`model_correction` (CPU
trace minus the CPU rules) says how far the model has moved from what the rules describe.
Single device, torch AdamW only; anything else raises :class:`TraceUnavailable`.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import asdict, dataclass, replace

from nanolab.estimator.facts_cache import remembered
from nanolab.estimator.setup import Setup


class TraceUnavailable(RuntimeError):
    """This setup cannot be traced on fake tensors (the message says why)."""


@dataclass
class Traced:
    """Peak bytes of one traced training step and what was resident before it."""

    peak_allocated: int
    resident: int
    seconds: float


def _check(setup: Setup) -> None:
    if setup.world_size > 1 or setup.strategy.kind != "single":
        raise TraceUnavailable("the trace covers one device; sharded strategies use the rules")
    if setup.optimizer not in ("adamw", "muon"):  # bitsandbytes' kernels need real tensors
        raise TraceUnavailable(f"{setup.optimizer}'s kernels cannot run on fake tensors")
    if setup.precision.startswith("16"):
        raise TraceUnavailable("fp16 precisions need a GPU")


def traced_peak_cpu(setup: Setup, micro_batch: int, accumulate: int = 1) -> Traced:
    """Peak allocated bytes of one ``nanolab fit`` step of ``setup`` on a CPU, model-derived."""
    _check(setup)
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from torch.utils.weak import WeakIdKeyDictionary

    from nanolab.model.gpt import GPT
    from nanolab.training.optim import OptimizerConfig, build_optimizer

    class Allocations(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.live: WeakIdKeyDictionary = WeakIdKeyDictionary()
            self.current = 0
            self.peak = 0

        def _freed(self, nbytes: int) -> None:
            self.current -= nbytes

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    if storage not in self.live:
                        n = storage.nbytes()
                        self.live[storage] = n
                        self.current += n
                        weakref.finalize(storage, self._freed, n)
            self.peak = max(self.peak, self.current)
            return out

    start = time.perf_counter()
    gpt = setup.gpt
    half = {"bf16-true": torch.bfloat16}.get(setup.precision)
    amp = torch.bfloat16 if setup.precision == "bf16-mixed" else None
    previous_dtype = torch.get_default_dtype()
    with FakeTensorMode(allow_non_fake_inputs=True):
        if half is not None:  # Lightning's "-true": the module in 16 bits, buffers too
            torch.set_default_dtype(half)
        try:
            model = GPT(replace(gpt))
        finally:
            torch.set_default_dtype(previous_dtype)
        if half is not None:
            for m in model.modules():
                for name, b in list(m._buffers.items()):
                    if b is not None and b.is_floating_point():
                        m._buffers[name] = b.to(half)
        model.train()
        config = OptimizerConfig(name=setup.optimizer, fused=setup.fused)
        opt = build_optimizer(model, config, torch.device("cpu"))
        V, T = gpt.vocab_size or 2, gpt.block_size

        def step(micro_batches: int) -> None:
            for _ in range(micro_batches):
                x = torch.randint(0, V, (micro_batch, T))
                y = torch.randint(0, V, (micro_batch, T))
                with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None,
                                    cache_enabled=False):  # fmt: skip
                    loss = model(x, y)[1]
                (loss / accumulate).backward()
                del loss, x, y
            opt.step()
            opt.zero_grad(set_to_none=True)

        # The optimizer states exist from the first step on; make them without a forward.
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        held = list(model.parameters()) + list(model.buffers())
        held += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        tracker = Allocations()
        resident: dict[int, int] = {}
        for t in held:
            st = t.untyped_storage()
            tracker.live[st] = 0
            resident[id(st)] = st.nbytes()
        with tracker:
            # Every micro-batch after the first of a window allocates the same (the gradients
            # exist, are accumulated in place): two of them show the window's peak.
            step(min(accumulate, 2))
    return Traced(
        peak_allocated=sum(resident.values()) + tracker.peak,
        resident=sum(resident.values()),
        seconds=time.perf_counter() - start,
    )


def model_matches_rules(setup: Setup) -> tuple[bool, float]:
    """Trace a tiny model of ``setup``'s kind and compare with the CPU rules at the same size.

    A fork whose model saves, allocates or holds anything the rules do not describe shows up
    here in well under a second; then the full trace is worth its seconds. Returns (matches,
    relative difference of the tiny model's peak).
    """
    from nanolab.estimator.derived import tiny_model
    from nanolab.estimator.memory import estimate_memory

    tiny_gpt = tiny_model(setup.gpt)
    tiny = replace(
        setup,
        gpt=tiny_gpt,
        micro_batch_size=2,
        global_batch_tokens=None,
        accumulate_grad_batches=1,
        devices=1,
        num_nodes=1,
    )

    def compare() -> tuple[bool, float]:
        traced = traced_peak_cpu(tiny, 2).peak_allocated
        rules = estimate_memory(tiny, 2, backend="cpu", fragmentation=0.0).peak_allocated
        diff = traced / rules - 1
        return abs(diff) < 0.005, diff

    question = {k: v for k, v in asdict(tiny).items() if k != "gpt"}
    return remembered("matches_rules", tiny_gpt, question, compare, list, tuple)
