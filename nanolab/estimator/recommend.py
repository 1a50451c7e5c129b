"""What to change when a config does not fit: micro-batch, accumulation, memory switches.

Every activation grows with the micro-batch, so at a fixed step structure the peak is monotone
in it. One thing is not fixed: with ``run.global_batch_tokens`` a smaller micro-batch means
gradient accumulation, and from the second micro-batch of a window on the gradients are alive
during the forward (``nanolab fit`` frees them after every optimizer step). So the search runs
in two monotone regions (accumulation 1, and accumulation > 1), each by doubling then bisecting
(~20 evaluations of a closed form, well under a millisecond each), and a global batch's
micro-batch is the largest *divisor* that fits, checked one by one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from nanolab.estimator.memory import DEFAULT_FRAGMENTATION, estimate_memory
from nanolab.estimator.numerics import Backend
from nanolab.estimator.setup import Setup, Strategy

MAX_MICRO_BATCH = 4096


def fits(
    setup: Setup,
    micro_batch: int,
    device_memory: int,
    *,
    backend: Backend = "cuda",
    fragmentation: float = DEFAULT_FRAGMENTATION,
) -> bool:
    est = estimate_memory(setup, micro_batch, backend=backend, fragmentation=fragmentation)
    return est.total <= device_memory


def _largest_in(ok, lo: int, hi: int) -> int:
    """Largest ``b`` in ``[lo, hi]`` with ``ok(b)``, for ``ok`` true up to a point; ``lo - 1``
    when not even ``lo`` is."""
    if lo > hi or not ok(lo):
        return lo - 1
    step = 1
    good = lo
    while good + step <= hi and ok(good + step):
        good += step
        step *= 2
    bad = min(good + step, hi + 1)
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if ok(mid) else (good, mid)
    return good


def largest_micro_batch(
    setup: Setup,
    device_memory: int,
    *,
    backend: Backend = "cuda",
    fragmentation: float = DEFAULT_FRAGMENTATION,
    limit: int = MAX_MICRO_BATCH,
) -> int:
    """Largest micro-batch (sequences per device) whose estimate fits; 0 when not even 1 does."""

    def ok(b: int) -> bool:
        return fits(setup, b, device_memory, backend=backend, fragmentation=fragmentation)

    per_device = sequences_per_device(setup)
    if per_device is None or per_device < 2:
        return max(0, _largest_in(ok, 1, limit))
    # From per_device on there is no accumulation; below it the gradients of earlier
    # micro-batches are alive too, so a smaller micro-batch can need *more* memory.
    no_accumulation = _largest_in(ok, per_device, limit)
    if no_accumulation >= per_device:
        return no_accumulation
    return max(0, _largest_in(ok, 1, min(per_device - 1, limit)))


def sequences_per_device(setup: Setup) -> int | None:
    """Sequences each device processes per optimizer step, from ``global_batch_tokens``."""
    if setup.global_batch_tokens is None:
        return None
    return setup.global_batch_tokens // (setup.gpt.block_size * setup.world_size)


def micro_batch_for_global(
    setup: Setup,
    device_memory: int,
    *,
    backend: Backend = "cuda",
    fragmentation: float = DEFAULT_FRAGMENTATION,
    limit: int = MAX_MICRO_BATCH,
) -> tuple[int, int] | None:
    """(micro-batch, accumulation) that reach the global batch exactly with the largest
    micro-batch that fits: the largest divisor of the per-device sequences whose estimate
    fits (``None`` when none does). Without a global batch: the largest that fits, and the
    trainer's ``accumulate_grad_batches`` (fit keeps it whatever the micro-batch)."""
    per_device = sequences_per_device(setup)
    if per_device is None:
        largest = largest_micro_batch(
            setup, device_memory, backend=backend, fragmentation=fragmentation, limit=limit
        )
        return (largest, setup.accumulate_grad_batches) if largest else None
    divisors = [d for d in range(1, min(per_device, limit) + 1) if per_device % d == 0]
    for d in reversed(divisors):
        if fits(setup, d, device_memory, backend=backend, fragmentation=fragmentation):
            return d, per_device // d
    return None


@dataclass
class Switch:
    """A configuration change and what it buys."""

    name: str
    yaml: str
    setup: Setup
    largest_micro_batch: int = 0


def candidate_switches(setup: Setup) -> list[Switch]:
    """Memory-saving changes not already on, cheapest in speed first."""
    gpt, s = setup.gpt, setup.strategy
    out: list[Switch] = []

    def add(name: str, yaml: str, switched: Setup) -> None:
        out.append(Switch(name, yaml, switched))

    ckpt = replace(setup, gpt=replace(gpt, gradient_checkpointing=True))
    if not gpt.gradient_checkpointing:
        add("gradient checkpointing", "model.gpt.gradient_checkpointing: true", ckpt)
    if setup.optimizer == "muon":
        # Muon is another algorithm than 8-bit AdamW and needs whole matrices (no sharding).
        return out
    from nanolab.training.optim import strategy_refusal

    deepspeed_offload = s.kind == "deepspeed" and s.offload_optimizer
    eight_bit_runs = strategy_refusal("adamw8bit", s.kind) is None
    if setup.optimizer != "adamw8bit" and not deepspeed_offload and eight_bit_runs:
        add("8-bit AdamW", "model.optimizer.name: adamw8bit", replace(setup, optimizer="adamw8bit"))
        if not gpt.gradient_checkpointing:
            yaml = "gradient_checkpointing: true, optimizer.name: adamw8bit"
            add("checkpointing + 8-bit AdamW", yaml, replace(ckpt, optimizer="adamw8bit"))
    base_opt = "adamw" if setup.optimizer == "adamw8bit" else setup.optimizer
    if setup.world_size > 1:
        for stage in (1, 2, 3):
            if not (s.kind == "deepspeed" and s.zero_stage >= stage):
                strat = Strategy("deepspeed", zero_stage=stage)
                yaml = f"trainer.strategy: deepspeed_stage_{stage}"
                add(f"DeepSpeed ZeRO-{stage}", yaml, replace(setup, strategy=strat))
        if s.kind not in ("fsdp1", "fsdp2"):
            yaml = (
                "trainer.strategy: {class_path: lightning.pytorch.strategies.ModelParallelStrategy}"
            )
            fsdp2 = replace(setup, strategy=Strategy("fsdp2"))
            if strategy_refusal(setup.optimizer, "fsdp2") is not None:  # 8-bit AdamW
                fsdp2 = replace(fsdp2, optimizer="adamw")
                yaml += ", model.optimizer.name: adamw"
            add("FSDP2", yaml, fsdp2)
    for stage, name in ((2, "deepspeed_stage_2_offload"), (3, "deepspeed_stage_3_offload")):
        if s.kind == "deepspeed" and s.offload_optimizer and s.zero_stage >= stage:
            continue
        strat = Strategy(
            "deepspeed", zero_stage=stage, offload_optimizer=True, offload_params=stage == 3
        )
        off = replace(setup, strategy=strat, optimizer=base_opt)
        label = f"ZeRO-{stage} + CPU offload"
        add(label, f"trainer.strategy: {name}", off)
        if not gpt.gradient_checkpointing:
            yaml = f"trainer.strategy: {name}, gradient_checkpointing: true"
            add(f"{label} + checkpointing", yaml, replace(off, gpt=ckpt.gpt))
    return out


def evaluate_switches(
    setup: Setup,
    device_memory: int,
    *,
    backend: Backend = "cuda",
    fragmentation: float = DEFAULT_FRAGMENTATION,
) -> list[Switch]:
    """Every candidate switch with the largest micro-batch it allows."""
    out = candidate_switches(setup)
    for sw in out:
        sw.largest_micro_batch = largest_micro_batch(
            sw.setup, device_memory, backend=backend, fragmentation=fragmentation
        )
    return out
