"""``trainer.strategy`` read as data: how a config spreads model states over devices.

The strategy classes themselves (:mod:`nanolab.training.strategies`) import Lightning; this
description of them does not, so the resolver and the estimator read a strategy in a fraction of
a second. :func:`parse_strategy` accepts what Lightning's ``trainer.strategy`` accepts: a registry
name (``ddp``, ``deepspeed_stage_3_offload``, ``fsdp``) or a ``class_path`` mapping.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from nanolab.errors import RunConfigError, written_whole

StrategyKind = Literal["single", "ddp", "fsdp1", "fsdp2", "deepspeed"]

#: Lightning's DeepSpeedStrategy defaults (elements, not bytes).
DEEPSPEED_REDUCE_BUCKET = 200_000_000


@dataclass(frozen=True)
class Strategy:
    """How model states are spread over devices.

    Attributes:
        kind: ``single`` (one device), ``ddp``, ``fsdp1`` (Lightning's FSDPStrategy),
            ``fsdp2`` (Lightning's ModelParallelStrategy with nanolab's per-block
            ``fully_shard``) or ``deepspeed``.
        zero_stage: DeepSpeed ZeRO stage (1, 2, 3); 0 otherwise.
        offload_optimizer: Optimizer states (and the fp32 master copy) live in CPU memory.
        offload_params: Parameters live in CPU memory too (ZeRO-3 / FSDP ``cpu_offload``).
        gradient_as_bucket_view: DDP's gradients alias its communication buckets (saves one
            gradient-sized buffer); Lightning's default is False.
        fsdp_wrapped_blocks: FSDP1 gathers one block at a time (an ``auto_wrap_policy`` is set);
            without one the whole model is a single unit, gathered whole.
        shard_grad_op: FSDP ``SHARD_GRAD_OP``: parameters stay gathered between forward and
            backward (ZeRO-2 like).
        reduce_bucket_size: DeepSpeed's gradient bucket, in elements.
        overlap_comm: DeepSpeed double-buffers the gradient bucket.
        contiguous_gradients: DeepSpeed copies gradients into the bucket buffer.
    """

    kind: StrategyKind = "single"
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False
    gradient_as_bucket_view: bool = False
    fsdp_wrapped_blocks: bool = False
    shard_grad_op: bool = False
    reduce_bucket_size: int = DEEPSPEED_REDUCE_BUCKET
    overlap_comm: bool = True
    contiguous_gradients: bool = True

    def describe(self) -> str:
        if self.kind == "deepspeed":
            text = f"DeepSpeed ZeRO-{self.zero_stage}"
            if self.offload_params:
                text += " + param/optimizer offload"
            elif self.offload_optimizer:
                text += " + optimizer offload"
            return text
        if self.kind in ("fsdp1", "fsdp2"):
            text = "FSDP2 (per-block fully_shard)" if self.kind == "fsdp2" else "FSDP1"
            if self.shard_grad_op:
                text += " SHARD_GRAD_OP"
            if self.offload_params:
                text += " + CPU offload"
            return text
        return {"single": "single device", "ddp": "DDP"}[self.kind]


def int_setting(value: Any, where: str, minimum: int = 1) -> int:
    """``value`` as an int >= ``minimum`` (``4``, ``"4"``); ``where`` names the key. A whole
    float (``1e3``) is refused as the fit parser refuses it (:func:`written_whole`)."""
    if (whole := written_whole(where, value)) is not None:
        raise RunConfigError(whole)
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise RunConfigError(f"{where} must be an integer, got {value!r}")
    try:
        n = int(value)
    except ValueError:
        raise RunConfigError(f"{where} must be an integer, got {value!r}") from None
    if n != float(value) or n < minimum:
        raise RunConfigError(f"{where} must be an integer >= {minimum}, got {value!r}")
    return n


def parse_strategy(raw: Any, world_size: int) -> Strategy:
    """Lightning's ``trainer.strategy`` (a registry name or a ``class_path`` dict)."""
    if raw is None or raw == "auto":
        return Strategy("ddp" if world_size > 1 else "single")
    if isinstance(raw, Mapping):
        class_path = str(raw.get("class_path", ""))
        args = dict(raw.get("init_args") or {})
        name = class_path.rsplit(".", 1)[-1].lower()
    elif isinstance(raw, str):
        name, args = raw.lower(), {}
    else:
        raise RunConfigError(
            f"trainer.strategy must be a name or a class_path mapping, got {raw!r}"
        )

    if "deepspeed" in name:
        stage = args.get("stage")
        m = re.search(r"stage_(\d)", name)
        if stage is None:
            stage = int(m.group(1)) if m else 2  # Lightning's DeepSpeedStrategy default
        stage = int_setting(stage, "trainer.strategy stage", minimum=0)
        if stage not in (1, 2, 3):
            raise RunConfigError(f"DeepSpeed ZeRO stage must be 1, 2 or 3, got {stage}")
        offload = "offload" in name
        offload_params = bool(args.get("offload_parameters", offload and stage == 3))
        offload_opt = bool(args.get("offload_optimizer", offload)) or offload_params
        if offload_params and stage != 3:
            raise RunConfigError("DeepSpeed offload_parameters needs ZeRO stage 3")
        return Strategy(
            "deepspeed",
            zero_stage=stage,
            offload_optimizer=offload_opt,
            offload_params=offload_params,
            reduce_bucket_size=int_setting(
                args.get("reduce_bucket_size", DEEPSPEED_REDUCE_BUCKET), "reduce_bucket_size"
            ),
            overlap_comm=bool(args.get("overlap_comm", True)),
            contiguous_gradients=bool(args.get("contiguous_gradients", True)),
        )
    if "modelparallel" in name or "fsdp2" in name:
        tp = args.get("tensor_parallel_size", 1)
        if tp not in (1, "auto", None):
            raise RunConfigError("tensor parallelism is not modelled; set tensor_parallel_size: 1")
        return Strategy("fsdp2")
    if "fsdp" in name:
        sharding = str(args.get("sharding_strategy", "FULL_SHARD")).upper()
        if sharding not in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"):
            raise RunConfigError(f"unknown FSDP sharding_strategy {sharding!r}")
        if sharding == "NO_SHARD":
            return Strategy("ddp", gradient_as_bucket_view=False)
        offload = "offload" in name or bool(args.get("cpu_offload", False))
        return Strategy(
            "fsdp1",
            offload_params=offload,
            offload_optimizer=offload,
            fsdp_wrapped_blocks=args.get("auto_wrap_policy") is not None,
            shard_grad_op=sharding == "SHARD_GRAD_OP",
        )
    if "ddp" in name:
        return Strategy("ddp", gradient_as_bucket_view=bool(args.get("gradient_as_bucket_view")))
    if name in ("single_device", "singledevicestrategy"):
        if world_size > 1:
            raise RunConfigError(f"strategy single_device cannot use {world_size} devices")
        return Strategy("single")
    raise RunConfigError(
        f"unknown trainer.strategy {raw!r}; the estimator knows auto, ddp, fsdp, "
        "deepspeed_stage_{1,2,3}[_offload] and ModelParallelStrategy (FSDP2)"
    )
