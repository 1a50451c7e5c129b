"""Compute: FLOPs per token and per step, step time, tokens/day and cost.

FLOPs are model FLOPs (``GPT.flops_per_token``: 6N plus attention, embedding lookups free), the
numerator of MFU. The time comes from, in order of trust:

1. this machine's own measured tokens/s for the same config (finished ``nanolab queue`` runs,
   :mod:`nanolab.estimator.history`), when the caller passes it;
2. the GPU's dense peak *for the matmul dtype the run really uses* (bf16/fp16 for 16-bit
   precisions; for ``32-true`` TF32 when ``run.float32_matmul_precision`` allows it and the GPU
   has TF32 units, on an AMD GPU only with ``HIPBLASLT_ALLOW_TF32=1`` set, else plain FP32, 8x
   slower on an A100) times an MFU: ``--mfu``, else the GPU
   family's default, whose source is in ``gpus.json``; with the host's fixed work per step
   (:func:`nanolab.estimator.cpu.host_floor_seconds`: the loop, the optimizer and the per-op
   dispatch) added on a CPU and as the step's floor on a GPU, so a small model's step is not
   priced at microseconds.

Gradient checkpointing re-runs every block's forward; that work is not model FLOPs, so at the
same hardware efficiency the achieved MFU drops by the recompute share:
``effective MFU = MFU x model / (model + recompute)``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from nanolab.estimator.cpu import host_floor_seconds, sixteen_bit_mfu
from nanolab.estimator.gpus import GPU, format_rate, rocm_tf32_note
from nanolab.estimator.gpus import matmul_rate as gpu_matmul_rate
from nanolab.estimator.run_length import run_length
from nanolab.estimator.setup import Setup
from nanolab.estimator.shapes import flops_per_token, num_params, recompute_flops_per_token

CHINCHILLA_TOKENS_PER_PARAM = 20
#: The token budget's source where nothing bounds the run (``trainer.max_steps`` -1, no limit).
CHINCHILLA_SOURCE = "Chinchilla 20 tokens/param"
#: What the estimate says then, once: the length it priced is its own choice, not the run's.
UNBOUNDED_NOTE = (
    "trainer.max_steps is -1 and no budget.max_tokens, max_wall_hours, max_gpu_hours or "
    "max_cost bounds the run (it trains until stopped): the time and cost are for the "
    "Chinchilla-optimal 20 tokens per parameter; --tokens N prices another length"
)
SECONDS_PER_DAY = 86_400


@dataclass
class ComputeEstimate:
    params: int
    flops_per_token: int
    recompute_flops_per_token: int
    tokens_per_step: int
    flops_per_step: float
    mfu: float
    mfu_source: str
    effective_mfu: float
    matmul_dtype: str
    peak_tflops_per_device: float
    step_seconds: float
    tokens_per_second: float
    tokens_per_second_source: str
    tokens_per_day: float
    token_budget: int
    token_budget_source: str
    chinchilla_tokens: int
    steps: int
    hours: float
    gpu_hours: float
    usd_per_gpu_hour: float
    cost_usd: float
    #: Where the price comes from: ``--usd-per-gpu-hour``, ``budget.price_per_gpu_hour`` (in
    #: ``currency``), or the GPU table's indicative USD price.
    price_source: str = "GPU table"
    currency: str = "USD"
    #: Seconds of fixed host work a step holds at least (:func:`nanolab.estimator.cpu.
    #: host_floor_seconds`; 0 when the time is measured): in ``step_seconds``, added to the
    #: FLOPs time on a CPU, its floor on a GPU.
    floor_seconds: float = 0.0
    #: Why ``32-true`` matmuls were taken as TF32 or FP32 where the environment decides (an AMD
    #: GPU: :func:`nanolab.estimator.gpus.rocm_tf32_note`), else None.
    matmul_dtype_note: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def floor_dominates(self) -> bool:
        """Whether the fixed host work is half the step time or more: the FLOPs no longer set
        the time, and the fixed cost, measured on a quiet machine at its lower end, makes the
        figure a lower bound."""
        return self.floor_seconds > 0 and 2 * self.floor_seconds >= self.step_seconds


def tokens_per_step(setup: Setup, micro_batch: int, accumulate: int) -> int:
    """Tokens one optimizer step consumes over all devices."""
    return micro_batch * setup.gpt.block_size * setup.world_size * accumulate


def matmul_rate(setup: Setup, gpu: GPU) -> tuple[float, str]:
    """(dense TFLOP/s, dtype) the run's matmuls get on ``gpu``: :func:`nanolab.estimator.gpus.
    matmul_rate`, the same answer the MFU callback divides by."""
    value, dtype, _ = gpu_matmul_rate(gpu, setup.precision, setup.float32_matmul_precision)
    return float(value or 0.0), dtype


def estimate_compute(
    setup: Setup,
    gpu: GPU,
    micro_batch: int,
    accumulate: int,
    *,
    mfu: float | None = None,
    tokens: int | None = None,
    usd_per_gpu_hour: float | None = None,
    measured_tokens_per_second: float | None = None,
    measured_source: str = "",
) -> ComputeEstimate:
    """Time and money for ``setup`` on ``setup.world_size`` devices of ``gpu``.

    ``mfu`` defaults to the GPU family's (``gpu.default_mfu``). ``measured_tokens_per_second``
    (all devices together) replaces the MFU model for the time; the MFU it implies is reported.
    The token budget is ``tokens`` if given, else the steps the run trains (the first of
    ``trainer.max_steps`` and where the config's budget stops it, by fit's own rule:
    :func:`nanolab.estimator.run_length.run_length`) x tokens per step, else (nothing bounds
    the run) the Chinchilla-optimal 20 tokens per parameter. The price is
    ``usd_per_gpu_hour`` if given, else ``budget.price_per_gpu_hour``, else the GPU table's.
    """
    if mfu is not None and not 0 < mfu <= 1:
        raise ValueError(f"MFU must be in (0, 1], got {mfu}")
    gpt = setup.gpt
    n = num_params(gpt)
    fpt = flops_per_token(gpt)
    rpt = recompute_flops_per_token(gpt) if gpt.gradient_checkpointing else 0
    tps = tokens_per_step(setup, micro_batch, accumulate)
    peak_tflops, dtype = matmul_rate(setup, gpu)
    peak = peak_tflops * 1e12
    flops_step = float(fpt) * tps
    floor_s = 0.0
    if measured_tokens_per_second:
        tok_s = float(measured_tokens_per_second)
        step_s = tps / tok_s
        mfu_used = fpt * tok_s / (setup.world_size * peak) if peak else 0.0
        mfu_source = "implied by the measured tokens/s"
        eff = mfu_used
        tok_source = measured_source or "measured"
    else:
        on_cpu = gpu.family == "cpu"
        mfu_used = gpu.default_mfu if mfu is None else mfu
        mfu_source = gpu.mfu_source if mfu is None else "--mfu"
        if mfu is None and on_cpu:
            mfu_used, mfu_source = sixteen_bit_mfu(gpu, dtype)
        eff = mfu_used * fpt / (fpt + rpt)
        floor_s = host_floor_seconds(gpt.n_layer, accumulate)
        step_s = step_time(flops_step / (setup.world_size * peak * eff), floor_s, on_cpu=on_cpu)
        tok_s = tps / step_s
        tok_source = f"{mfu_used:.0%} MFU of {format_rate(peak_tflops)} ({dtype}), " + (
            f"plus {floor_s * 1e3:.3g} ms a step of fixed host work"
            if on_cpu
            else f"a step no shorter than its {floor_s * 1e3:.3g} ms of fixed host work"
        )
    chinchilla = CHINCHILLA_TOKENS_PER_PARAM * n
    length = run_length(setup.max_steps, setup.budget, tps, step_s, setup.world_size)
    if tokens is not None:
        budget, source = tokens, "--tokens"
    elif length is not None:
        budget, source = length.steps * tps, length.source
    else:
        budget, source = chinchilla, CHINCHILLA_SOURCE
    steps = -(-budget // tps)
    hours = steps * step_s / 3600
    price, price_source, currency = gpu.usd_per_hour, "GPU table", "USD"
    if usd_per_gpu_hour is not None:
        price, price_source = usd_per_gpu_hour, "--usd-per-gpu-hour"
    elif setup.budget.price_per_gpu_hour is not None:
        price, price_source = setup.budget.price_per_gpu_hour, "budget.price_per_gpu_hour"
        currency = setup.budget.currency
    gpu_hours = hours * setup.world_size
    return ComputeEstimate(
        params=n,
        flops_per_token=fpt,
        recompute_flops_per_token=rpt,
        tokens_per_step=tps,
        flops_per_step=flops_step,
        mfu=mfu_used,
        mfu_source=mfu_source,
        effective_mfu=eff,
        matmul_dtype=dtype,
        matmul_dtype_note=rocm_tf32_note(gpu, setup.precision, setup.float32_matmul_precision),
        peak_tflops_per_device=peak_tflops,
        step_seconds=step_s,
        tokens_per_second=tok_s,
        tokens_per_second_source=tok_source,
        tokens_per_day=tok_s * SECONDS_PER_DAY,
        token_budget=budget,
        token_budget_source=source,
        chinchilla_tokens=chinchilla,
        steps=steps,
        hours=hours,
        gpu_hours=gpu_hours,
        usd_per_gpu_hour=price,
        cost_usd=gpu_hours * price,
        price_source=price_source,
        currency=currency,
        floor_seconds=floor_s,
    )


def step_time(flops_s: float, floor_s: float, *, on_cpu: bool) -> float:
    """A step's seconds from its FLOPs time and the host's fixed work per step: on a CPU both
    run on the host, one after the other (their sum); on a GPU the host works while the device
    runs the queued step (the larger of the two)."""
    return flops_s + floor_s if on_cpu else max(flops_s, floor_s)
