"""Ground truth for the estimator: what a real model, optimizer and forward pass hold.

Used by the tests and by ``benches/bench_memory.py``. Everything here runs a real ``GPT`` (on
CPU in the tests) and counts real tensors, so it imports torch; the estimator itself does not.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from nanolab.model.config import GPTConfig
from nanolab.model.gpt import GPT


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and shared tensors once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


@dataclass
class SavedMeasurement:
    """Distinct storages autograd saved during one forward (parameters and buffers excluded)."""

    bytes: int
    count: int
    logits_dtype: torch.dtype


def measure_saved(
    model: GPT,
    batch: int,
    seq_len: int,
    *,
    autocast_dtype: torch.dtype | None = None,
    device: str = "cpu",
    seed: int = 0,
) -> SavedMeasurement:
    """Run one training forward under ``saved_tensors_hooks`` and count unique storages.

    Model parameters and buffers are excluded (they are model state, not activations); a
    16-bit copy autocast makes of a parameter is a new storage and is counted, as it is
    allocated memory. ``autocast_dtype`` mimics Lightning's ``*-mixed`` (cache off).
    """
    model.train()
    owned = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in owned:
            seen[ptr] = max(seen.get(ptr, 0), st.nbytes())
        return t

    g = torch.Generator(device="cpu").manual_seed(seed)
    vocab = model.config.vocab_size or 2
    idx = torch.randint(0, vocab, (batch, seq_len), generator=g).to(device)
    tgt = torch.randint(0, vocab, (batch, seq_len), generator=g).to(device)
    amp = (
        torch.autocast(device, dtype=autocast_dtype, cache_enabled=False)
        if autocast_dtype is not None
        else nullcontext()
    )
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), amp:
        logits, loss = model(idx, tgt)
    dtype = logits.dtype
    del logits, loss
    return SavedMeasurement(sum(seen.values()), len(seen), dtype)


@dataclass
class StateMeasurement:
    """Bytes the model and optimizer hold after one optimizer step."""

    params: int
    grads: int
    optimizer: int
    buffers: int


def measure_states(
    gpt: GPTConfig,
    optimizer: str = "adamw",
    *,
    dtype: torch.dtype = torch.float32,
    batch: int = 2,
    seed: int = 0,
) -> StateMeasurement:
    """Build ``GPT(gpt)`` in ``dtype``, take one optimizer step, count the real tensors.

    The optimizer is the one ``fit`` builds (:func:`build_optimizer` below).
    """
    torch.manual_seed(seed)
    model = GPT(gpt).to(dtype)
    opt = build_optimizer(model, optimizer, foreach=None)
    T = min(8, gpt.block_size)
    idx = torch.randint(0, gpt.vocab_size or 2, (batch, T))
    _, loss = model(idx, idx)
    loss.backward()
    opt.step()
    state_tensors = [
        v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)
    ]
    return StateMeasurement(
        params=storage_bytes(model.parameters()),
        grads=storage_bytes(p.grad for p in model.parameters() if p.grad is not None),
        optimizer=storage_bytes(state_tensors),
        buffers=storage_bytes(model.buffers()),
    )


def build_optimizer(
    model: GPT, optimizer: str = "adamw", foreach: bool | None = True
) -> torch.optim.Optimizer:
    """The optimizer ``fit`` builds, from :func:`nanolab.training.optim.build_optimizer` itself
    (its parameter groups, tied weights once, betas, eps), so the ground truth follows any change
    there. Only torch AdamW's implementation is chosen here: its foreach form by default (what it
    runs on a GPU; the estimator's ``fused: false``), or torch's CPU default per-tensor loop with
    ``foreach=None`` (the estimator's ``fused: null`` on CPU). The update is the same either way;
    the temporaries the optimizer step allocates are not.
    """
    from nanolab.training.optim import OptimizerConfig
    from nanolab.training.optim import build_optimizer as build_fit_optimizer

    device = next(model.parameters()).device
    config = OptimizerConfig(name=optimizer, lr=1e-3, fused=False)  # type: ignore[arg-type]
    opt = build_fit_optimizer(model, config, device)
    for group in opt.param_groups:  # AdamW's groups (also muon's AdamW part); Muon has none
        if "foreach" in group and "amsgrad" in group:
            group["foreach"] = foreach
    return opt


def measure_peak_cpu(
    gpt: GPTConfig,
    batch: int,
    *,
    precision: str = "32-true",
    optimizer: str = "adamw",
    accumulate: int = 1,
    foreach: bool | None = True,
    seed: int = 0,
) -> int:
    """Peak bytes allocated on the CPU during one full training step, like
    ``torch.cuda.max_memory_allocated`` on a GPU.

    One warm-up step creates the optimizer states; the second step runs under the profiler with
    ``profile_memory=True`` and the running sum of its allocation events gives the peak above
    what was resident before (parameters, buffers, optimizer states), which is added back. The
    loop mirrors Lightning's: the logits are dropped before ``backward`` (the training step
    returns only the loss) and gradients are set to ``None`` after each optimizer step.
    """
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(seed)
    model = GPT(gpt)
    if precision.endswith("-true") and precision != "32-true":
        model = model.to(torch.bfloat16 if precision.startswith("bf16") else torch.float16)
    model.train()
    opt = build_optimizer(model, optimizer, foreach)
    T, V = gpt.block_size, gpt.vocab_size or 2
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, V, (batch, T), generator=g)
    tgt = torch.randint(0, V, (batch, T), generator=g)
    amp = precision == "bf16-mixed"

    def step() -> None:
        for _ in range(accumulate):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp, cache_enabled=False):
                loss = model(idx, tgt)[1]
            loss.backward()
            del loss
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    states = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    resident = storage_bytes(list(model.parameters()) + list(model.buffers()) + states)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return resident + allocation_peak(prof)


def memory_events(prof) -> list[tuple[int, int]]:
    """A CPU profiler's ``[memory]`` events as (start in ``time.time_ns`` nanoseconds, bytes
    allocated, negative when freed), in time order."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    return sorted((e.start_ns(), e.nbytes()) for e in events)


def allocation_peak(prof) -> int:
    """Highest running sum (from 0) of a CPU profiler's ``[memory]`` events, in time order."""
    return max(itertools.accumulate((n for _, n in memory_events(prof)), initial=0))
