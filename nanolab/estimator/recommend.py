"""What to change when a config does not fit: micro-batch, accumulation, memory switches.

Memory grows monotonically with the micro-batch (every activation is linear in it), so the
largest fitting micro-batch is found by doubling then bisecting: ~20 evaluations of a closed
form, well under a millisecond each.
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

    if not ok(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and ok(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def sequences_per_device(setup: Setup) -> int | None:
    """Sequences each device processes per optimizer step, from ``global_batch_tokens``."""
    if setup.global_batch_tokens is None:
        return None
    return setup.global_batch_tokens // (setup.gpt.block_size * setup.world_size)


def micro_batch_for_global(setup: Setup, largest: int) -> tuple[int, int] | None:
    """(micro-batch, accumulation) reaching the global batch exactly with the largest micro-batch
    that fits: the largest divisor of the per-device sequences not above ``largest``."""
    if largest < 1:
        return None
    per_device = sequences_per_device(setup)
    if per_device is None:
        return largest, 1
    best = max(d for d in range(1, min(largest, per_device) + 1) if per_device % d == 0)
    return best, per_device // best


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
    ckpt = replace(setup, gpt=replace(gpt, gradient_checkpointing=True))
    if not gpt.gradient_checkpointing:
        out.append(Switch("gradient checkpointing", "model.gpt.gradient_checkpointing: true", ckpt))
    deepspeed_offload = s.kind == "deepspeed" and s.offload_optimizer
    if setup.optimizer != "adamw8bit" and not deepspeed_offload:
        out.append(
            Switch(
                "8-bit AdamW",
                "model.optimizer.name: adamw8bit",
                replace(setup, optimizer="adamw8bit"),
            )
        )
        if not gpt.gradient_checkpointing:
            out.append(
                Switch(
                    "checkpointing + 8-bit AdamW",
                    "gradient_checkpointing: true, optimizer.name: adamw8bit",
                    replace(ckpt, optimizer="adamw8bit"),
                )
            )
    base_opt = "adamw" if setup.optimizer == "adamw8bit" else setup.optimizer
    if setup.world_size > 1:
        for stage in (1, 2, 3):
            if s.kind == "deepspeed" and s.zero_stage >= stage:
                continue
            strat = Strategy("deepspeed", zero_stage=stage)
            out.append(
                Switch(
                    f"DeepSpeed ZeRO-{stage}",
                    f"trainer.strategy: deepspeed_stage_{stage}",
                    replace(setup, strategy=strat),
                )
            )
        if s.kind not in ("fsdp1", "fsdp2"):
            out.append(
                Switch(
                    "FSDP2",
                    "trainer.strategy: {class_path: lightning.pytorch.strategies.ModelParallelStrategy}",
                    replace(setup, strategy=Strategy("fsdp2")),
                )
            )
    for stage, name in ((2, "deepspeed_stage_2_offload"), (3, "deepspeed_stage_3_offload")):
        if s.kind == "deepspeed" and s.offload_optimizer and s.zero_stage >= stage:
            continue
        strat = Strategy(
            "deepspeed", zero_stage=stage, offload_optimizer=True, offload_params=stage == 3
        )
        off = replace(setup, strategy=strat, optimizer=base_opt)
        label = f"ZeRO-{stage} + CPU offload"
        out.append(Switch(label, f"trainer.strategy: {name}", off))
        if not gpt.gradient_checkpointing:
            out.append(
                Switch(
                    f"{label} + checkpointing",
                    f"trainer.strategy: {name}, gradient_checkpointing: true",
                    replace(off, gpt=ckpt.gpt),
                )
            )
    return out


def evaluate_switches(
    setup: Setup,
    device_memory: int,
    *,
    backend: Backend = "cuda",
    fragmentation: float = DEFAULT_FRAGMENTATION,
) -> list[Switch]:
    """Every candidate switch with the largest micro-batch it allows."""
    out = []
    for sw in candidate_switches(setup):
        sw.largest_micro_batch = largest_micro_batch(
            sw.setup, device_memory, backend=backend, fragmentation=fragmentation
        )
        out.append(sw)
    return out
