"""Compute: FLOPs per token and per step, step time at a stated MFU, tokens/day and cost.

FLOPs are model FLOPs (``GPT.flops_per_token``: 6N plus attention), the numerator of MFU.
Gradient checkpointing re-runs every block's forward; that work is not model FLOPs, so at the
same hardware efficiency the achieved MFU drops by the recompute share. The time estimate
applies exactly that: ``effective MFU = MFU x model / (model + recompute)``. The peak is the
GPU's dense bf16 figure (its TF32/fp32 matmul figure for ``32-true``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from nanolab.estimator.gpus import GPU
from nanolab.estimator.setup import Setup
from nanolab.estimator.shapes import flops_per_token, num_params, recompute_flops_per_token

CHINCHILLA_TOKENS_PER_PARAM = 20
DEFAULT_MFU = 0.40
SECONDS_PER_DAY = 86_400


@dataclass
class ComputeEstimate:
    params: int
    flops_per_token: int
    recompute_flops_per_token: int
    tokens_per_step: int
    flops_per_step: float
    mfu: float
    effective_mfu: float
    peak_tflops_per_device: float
    step_seconds: float
    tokens_per_second: float
    tokens_per_day: float
    token_budget: int
    token_budget_source: str
    chinchilla_tokens: int
    steps: int
    hours: float
    gpu_hours: float
    usd_per_gpu_hour: float
    cost_usd: float

    def to_dict(self) -> dict:
        return asdict(self)


def tokens_per_step(setup: Setup, micro_batch: int, accumulate: int) -> int:
    """Tokens one optimizer step consumes over all devices."""
    return micro_batch * setup.gpt.block_size * setup.world_size * accumulate


def estimate_compute(
    setup: Setup,
    gpu: GPU,
    micro_batch: int,
    accumulate: int,
    *,
    mfu: float = DEFAULT_MFU,
    tokens: int | None = None,
    usd_per_gpu_hour: float | None = None,
) -> ComputeEstimate:
    """Time and money for ``setup`` on ``setup.world_size`` devices of ``gpu``.

    The token budget is ``tokens`` if given, else ``trainer.max_steps`` x tokens per step, else
    the Chinchilla-optimal 20 tokens per parameter.
    """
    if not 0 < mfu <= 1:
        raise ValueError(f"MFU must be in (0, 1], got {mfu}")
    gpt = setup.gpt
    n = num_params(gpt)
    fpt = flops_per_token(gpt)
    rpt = recompute_flops_per_token(gpt) if gpt.gradient_checkpointing else 0
    tps = tokens_per_step(setup, micro_batch, accumulate)
    eff = mfu * fpt / (fpt + rpt)
    peak_tflops = gpu.fp32_tflops if setup.precision == "32-true" else gpu.bf16_tflops
    peak = peak_tflops * 1e12
    flops_step = float(fpt) * tps
    step_s = flops_step / (setup.world_size * peak * eff)
    tok_s = tps / step_s
    chinchilla = CHINCHILLA_TOKENS_PER_PARAM * n
    if tokens is not None:
        budget, source = tokens, "--tokens"
    elif setup.max_steps:
        budget, source = setup.max_steps * tps, "trainer.max_steps"
    else:
        budget, source = chinchilla, "Chinchilla 20 tokens/param"
    steps = -(-budget // tps)
    hours = steps * step_s / 3600
    price = gpu.usd_per_hour if usd_per_gpu_hour is None else usd_per_gpu_hour
    gpu_hours = hours * setup.world_size
    return ComputeEstimate(
        params=n,
        flops_per_token=fpt,
        recompute_flops_per_token=rpt,
        tokens_per_step=tps,
        flops_per_step=flops_step,
        mfu=mfu,
        effective_mfu=eff,
        peak_tflops_per_device=peak_tflops,
        step_seconds=step_s,
        tokens_per_second=tok_s,
        tokens_per_day=tok_s * SECONDS_PER_DAY,
        token_budget=budget,
        token_budget_source=source,
        chinchilla_tokens=chinchilla,
        steps=steps,
        hours=hours,
        gpu_hours=gpu_hours,
        usd_per_gpu_hour=price,
        cost_usd=gpu_hours * price,
    )
