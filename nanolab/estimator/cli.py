"""``nanolab estimate``: will this config fit, with which micro-batch, and what will it cost?

    nanolab estimate --config configs/gpt2-124m.yaml --gpu rtx4070
    nanolab estimate --config a.yaml --config b.yaml --gpu-mem 12GiB --devices 4 --json
    nanolab estimate --config x.yaml --device cpu --json     # a CPU run: checkable on any laptop
    nanolab estimate --config configs/gpt2-124m.yaml --model.gpt.n_layer 2   # fit's overrides

Bad input (unknown GPU, unreadable memory size, a config that cannot exist) ends in one line on
stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

from nanolab.errors import one_line_errors
from nanolab.estimator import facts_cache
from nanolab.estimator.estimate import (
    DEFAULT_GPU,
    Estimate,
    estimate_from_config,
    largest_fitting_micro_batch,
)
from nanolab.estimator.gpus import GPUS, GiB, decimal_size_note, format_bytes, format_rate
from nanolab.estimator.memory import DEFAULT_FRAGMENTATION
from nanolab.estimator.setup import EstimateError
from nanolab.helpfmt import OneLineParser
from nanolab.messages import note
from nanolab.model.config import GPTConfig
from nanolab.run.keys import preflight, read_config_files
from nanolab.run.read import fit_config
from nanolab.tables import table
from nanolab.training.resolve import split_fit_args


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="nanolab estimate",
        description="Predict per-device memory, the micro-batch that fits, step time and cost "
        "of a `nanolab fit` config before running it.",
    )
    p.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="X.yaml",
        help="fit config; repeat to merge several (later files win); dotted overrides such as "
        "--model.gpt.n_layer 2 apply in order, as in `nanolab fit`",
    )
    p.add_argument("--gpu", help=f"device model (default {DEFAULT_GPU}); --list-gpus shows them")
    p.add_argument(
        "--gpu-mem",
        metavar="SIZE",
        help='memory per device, e.g. 12GiB, 24GB; a card\'s "12 GB" is binary, about 12GiB, '
        "while 12GB is 12e9 bytes (11.18 GiB)",
    )
    p.add_argument(
        "--device",
        choices=("gpu", "cpu"),
        help="gpu (--gpu picks which) or cpu: this machine, CPU kernels, no fragmentation "
        "margin, measured matmul rates (default: cpu where the config sets "
        "trainer.accelerator: cpu and no --gpu/--gpu-mem is given, else gpu)",
    )
    p.add_argument("--devices", type=int, help="devices per node (overrides trainer.devices)")
    p.add_argument("--nodes", type=int, help="nodes (overrides trainer.num_nodes)")
    p.add_argument("--micro-batch", type=int, help="micro-batch size (overrides the config)")
    p.add_argument("--vocab-size", type=int, help="vocabulary size when the config leaves it null")
    p.add_argument(
        "--mfu",
        type=float,
        help="model FLOPs utilisation for the time (default: a finished queue run's measured "
        "tokens/s, else the GPU family's default from gpus.json)",
    )
    p.add_argument(
        "--tokens",
        type=float,
        help="token budget (default: the steps the run trains, the first of trainer.max_steps "
        "(fit's 5000 when the config sets none) and where its budget stops it; Chinchilla's 20 "
        "tokens per parameter when nothing bounds it)",
    )
    p.add_argument(
        "--usd-per-gpu-hour",
        type=float,
        help="price (default: budget.price_per_gpu_hour, else the indicative table)",
    )
    p.add_argument(
        "--fragmentation",
        type=float,
        help="allocator fragmentation margin as a share of the peak "
        f"({DEFAULT_FRAGMENTATION:g} on GPUs, 0 on CPU)",
    )
    p.add_argument(
        "--detail",
        action="store_true",
        help="also list what one block saves for backward, tensor by tensor",
    )
    p.add_argument(
        "--trace",
        choices=("auto", "always", "never"),
        default="auto",
        help="follow the model the run builds: auto (default) traces a tiny model of the config "
        "on fake tensors and, when it differs from the analytic rules (a fork changed the "
        "model), traces the real one (seconds); always; never (rules only)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument(
        "--list-gpus",
        action="store_true",
        help="list known GPUs and exit (with --json: every number's source)",
    )
    return p


_OVERHEAD = ("context", "fragmentation")


def _gib(n: float) -> str:
    return f"{n / GiB:8.2f}"


def _peak_meter(est: Estimate) -> str:
    return "CPU allocator" if est.backend == "cpu" else "torch.cuda.max_memory_allocated"


def format_estimate(
    est: Estimate,
    *,
    per_gpu: dict[str, int] | None = None,
    detail: bool = False,
    device_from: str | None = None,
) -> str:
    """The estimate as text; ``device_from``: why the device was chosen, where no
    ``--device`` was given (:func:`default_device`), said in the first line."""
    s, g, m, c = est.setup, est.gpu, est.memory, est.compute
    gpt = s.gpt
    vocab = f"vocab {gpt.vocab_size:,}"
    if gpt.padded_vocab_size != gpt.vocab_size:
        vocab += f" (padded to {gpt.padded_vocab_size:,})"
    flags = [f"attention {gpt.attention}"]
    # The registered variants that differ from GPT-2's defaults (docs/forking.md).
    defaults = GPTConfig()
    for key in ("attention_variant", "mlp", "norm"):
        if getattr(gpt, key) != getattr(defaults, key):
            flags.append(f"{key} {getattr(gpt, key)}")
    if gpt.gradient_checkpointing:
        flags.append("gradient checkpointing")
    if gpt.dropout:
        flags.append(f"dropout {gpt.dropout}")
    out = [f"device    {device_from}"] if device_from else []
    out += [
        f"model     GPT, {c.params:,} parameters: {gpt.n_layer} layer{'s' if gpt.n_layer != 1 else ''} x {gpt.n_embd} wide, "
        f"{gpt.n_head} heads, context {gpt.block_size}, {vocab}",
        f"setup     {s.precision}, {s.strategy.describe()}, {s.world_size} x {g.label} "
        f"({format_bytes(est.device_memory)} each), {s.optimizer}; {', '.join(flags)}",
        f"batch     micro-batch {est.micro_batch} ({est.micro_batch_source}) x accumulation "
        f"{m.accumulate} x {s.world_size} device(s) = {c.tokens_per_step:,} tokens/step",
        "",
    ]
    out += _memory_table(est)
    check = m.details.get("model_check")
    if check and check.get("traced"):
        out.append(
            f"  model-derived: a fake-tensor trace of the built model on a CPU peaks at "
            f"{check['cpu_trace_peak_bytes'] / GiB:.2f} GiB vs the rules' "
            f"{check['cpu_rules_peak_bytes'] / GiB:.2f} GiB ({check['seconds']} s)"
        )
    elif check:
        out.append(
            "  model check: a tiny model of this config traced on fake tensors matches the rules "
            f"({check['tiny_model_difference']:+.2%})"
        )
    if any(not ln.in_peak and ln.bytes for ln in m.lines if ln.key not in _OVERHEAD):
        out.append("  (values in parentheses exist at another moment of the step than the peak)")
    if detail:
        sv = m.saved
        title = "one block, recomputed in backward" if sv.checkpointing else "one block"
        out.append(f"  saved for backward by {title} (MiB):")
        for name, n in m.details["block"].items():
            out.append(f"    {name:<46}{n / 2**20:10,.2f}")
        if sv.block_weight_copies:
            label = "autocast weight copies (their own line above)"
            out.append(f"    {label:<46}{sv.block_weight_copies / 2**20:10,.2f}")
    out += ["", "recommendations"]
    if est.largest_micro_batch:
        out.append(f"  largest micro-batch that fits: {est.largest_micro_batch}")
    else:
        out.append("  not even micro-batch 1 fits as configured")
    if est.recommended_micro_batch and s.global_batch_tokens:
        why = ""
        if est.largest_micro_batch and est.recommended_micro_batch < est.largest_micro_batch:
            why = f" (the largest up to {est.largest_micro_batch} that divides the step's batch)"
        out.append(
            f"  for run.global_batch_tokens {s.global_batch_tokens:,}: micro-batch "
            f"{est.recommended_micro_batch} x gradient accumulation {est.recommended_accumulation}"
            + why
        )
        given = est.micro_batch_source == "--micro-batch"  # the config's may still differ
        if est.micro_batch_source != "auto" and (
            given or est.recommended_micro_batch != est.micro_batch
        ):
            devices = f" --trainer.devices {s.devices}" if s.devices > 1 else ""
            auto = (
                ""  # on a CPU, auto trains at data.micro_batch_size
                if est.backend == "cpu"
                else ", or --run.micro_batch_size auto (fit picks it for the GPU it runs on)"
            )
            out.append(
                f"  to train so: --run.micro_batch_size {est.recommended_micro_batch}{devices}"
                + auto
            )
    if est.switches:
        out.append("  switches that save memory (largest micro-batch that fits with each):")
        rows = [[sw.name, str(sw.largest_micro_batch or "none"), sw.yaml] for sw in est.switches]
        out += ["    " + line for line in table(rows, right={1})]
    if per_gpu:
        out.append(f"  largest micro-batch per GPU (no --gpu given; table above is for {g.name}):")
        items = [f"{name} {mb}" for name, mb in per_gpu.items()]
        for i in range(0, len(items), 6):
            out.append("    " + ", ".join(items[i : i + 6]))
    recompute = f" (effective {c.effective_mfu:.1%} with recompute)"
    out += [
        "",
        f"compute   {c.matmul_dtype} matmuls, dense peak {format_rate(c.peak_tflops_per_device)} "
        f"per device; MFU {c.mfu:.0%}" + (recompute if c.recompute_flops_per_token else ""),
        *([f"  32-bit matmuls as {c.matmul_dtype_note}"] if c.matmul_dtype_note else []),
        f"  MFU from: {c.mfu_source}",
        f"  tokens/s from: {c.tokens_per_second_source}",
        f"  FLOPs per token (6N + attention)    {c.flops_per_token:.3e}",
    ]
    if s.gpt.attention_window is not None:
        out.append(f"    attention within a window of {s.gpt.attention_window} tokens")
    if s.gpt.document_mask:
        out.append("    attention counted as causal: the document mask skips more (an upper bound)")
    kind = "CPU" if est.backend == "cpu" else "GPU"  # a CPU run's hours are no GPU-hours
    out += [
        f"  FLOPs per step                      {c.flops_per_step:.3e}",
        f"  step time                           {c.step_seconds:.3f} s",
        f"  throughput                          {c.tokens_per_second:,.0f} tokens/s, "
        f"{c.tokens_per_day / 1e9:,.2f} B tokens/day",
        f"  token budget ({c.token_budget_source})".ljust(37)
        + f" {c.token_budget / 1e9:,.3f} B tokens = {c.steps:,} steps",
        f"  wall-clock                          {_hours(c.hours)} on {s.world_size} device(s)",
        f"  {kind}-hours and cost                  {_amount(c.gpu_hours)} {kind}-h x "
        + _priced(c.usd_per_gpu_hour, c.cost_usd, c.currency)
        + ("" if c.price_source == "GPU table" else f" ({c.price_source})"),
        f"  Chinchilla-optimal budget           {c.chinchilla_tokens / 1e9:,.2f} B tokens "
        "(20 per parameter)",
    ]
    for w in est.warnings:
        out.append(f"note: {w}")
    return "\n".join(out)


def _priced(price: float, cost: float, currency: str) -> str:
    """``$2.50 = $12.3`` in dollars, ``2.00 EUR = 9.84 EUR`` in another currency."""
    if currency == "USD":
        return f"${price:.2f} = ${_amount(cost, whole_at=10)}"
    return f"{price:.2f} {currency} = {_amount(cost, whole_at=10)} {currency}"


def _memory_table(est: Any) -> list[str]:
    """Memory per device, line by line, then the peak, the overheads and the total, as one
    table (GiB right-aligned under its header, a rule above the sums)."""
    m = est.memory
    rows = []
    for ln in m.lines:
        if ln.key in _OVERHEAD or (ln.bytes == 0 and not ln.note):
            continue
        value = _gib(ln.bytes) if ln.in_peak or ln.bytes == 0 else f"({ln.bytes / GiB:.2f})"
        rows.append([ln.label, value.strip(), ln.note])
    parts = len(rows)
    rows.append([f"peak allocated ({_peak_meter(est)})", _gib(m.peak_allocated).strip(),
                 f"at the {m.peak_phase}"])  # fmt: skip
    for key in ("context", "fragmentation"):
        ln = m.line(key)
        rows.append([ln.label, _gib(ln.bytes).strip(), ln.note])
    verdict = "fits" if est.fits else "DOES NOT FIT"
    rows.append(
        ["total", _gib(m.total).strip(), f"of {est.device_memory / GiB:.2f} GiB: {verdict}"]
    )
    if m.cpu_bytes:
        rows.append(["CPU memory for offloaded states (per device)", _gib(m.cpu_bytes).strip(),
                     "host memory, not in the total"])  # fmt: skip
    lines = table(rows, ["", "GiB", "note"], right={1})
    widths = [len(cell) for cell in lines[1].split("  ")]  # the header's rule: one per column
    lines.insert(2 + parts, "  ".join("-" * w for w in widths[:2]))
    return [f"memory per device at micro-batch {est.micro_batch}", *("  " + ln for ln in lines)]


def list_gpus() -> str:
    """The table: memory (* = datasheet capacity, not a reported value), dense TFLOP/s per
    dtype (- = no such units), the family's default MFU."""

    dtypes = ("fp32", "tf32", "bf16", "fp16", "fp8")
    rows = []
    for g in GPUS.values():
        mem = format_bytes(g.memory_bytes) + (" " if g.memory_reported else "*")  # digits align
        peaks = ["-" if v is None else f"{v:,.1f}" for v in map(g.peak, dtypes)]
        rows.append([g.name, mem, *peaks, f"{g.default_mfu:.2f}", g.label])
    headers = ["name", "memory", *dtypes, "MFU", "label"]
    lines = table(rows, headers, right=set(range(1, len(dtypes) + 3)))
    lines.append("* datasheet capacity (no reported value found); sources: --list-gpus --json")
    return "\n".join(lines)


def list_gpus_json() -> str:
    from dataclasses import asdict

    return json.dumps([asdict(g) for g in GPUS.values()], indent=2)


@one_line_errors("nanolab estimate")
def main(argv: Sequence[str] | None = None) -> int:
    # ``--config`` files and dotted overrides are read as ``fit`` reads them, in their order.
    fit_args, own = split_fit_args(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(own)
    if args.list_gpus:
        print(list_gpus_json() if args.json else list_gpus())
        return 0
    if "--config" not in fit_args and not any(a.startswith("--config=") for a in fit_args):
        raise EstimateError("give at least one --config X.yaml")
    # fit's own checks before anything is priced: its key check and override warnings here,
    # its reading of every value below (the one resolver: fit, estimate and queue add agree).
    preflight("fit", fit_args, prog="nanolab estimate")
    for name, value in (
        ("--devices", args.devices),
        ("--nodes", args.nodes),
        ("--micro-batch", args.micro_batch),
    ):
        if value is not None and value < 1:
            raise EstimateError(f"{name} must be >= 1, got {value}")
    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise EstimateError(f"--mfu must be in (0, 1], got {args.mfu}")
    if args.gpu is not None and not args.gpu.strip():
        raise EstimateError("--gpu is empty; name a device (nanolab estimate --list-gpus)")
    if args.device == "cpu" and args.gpu:
        raise EstimateError("--gpu names a GPU; leave it out with --device cpu")
    if args.fragmentation is not None and not 0 <= args.fragmentation < 1:
        raise EstimateError(f"--fragmentation must be in [0, 1), got {args.fragmentation}")
    if args.tokens is not None and not 0 < args.tokens < math.inf:
        raise EstimateError(f"--tokens must be a finite number > 0, got {args.tokens}")
    price = args.usd_per_gpu_hour
    if price is not None and not 0 <= price < math.inf:
        raise EstimateError(f"--usd-per-gpu-hour must be a finite price >= 0, got {price}")
    if args.gpu_mem is not None and (mem_note := decimal_size_note(args.gpu_mem)):
        note("nanolab estimate", mem_note)
    if not _names_a_class(fit_args):  # the parser then imports nanolab's own model code only
        facts_cache.note_model_code_unloaded()
    # fit's own reading: its verdict on every key and value. Where the parser must read it (a
    # strategy class), the classes it imports may print about this machine (DeepSpeed's
    # "Setting accelerator to CPU"), which the estimate is not about: not on stdout, which
    # holds the answer alone (--json is read by scripts), nor before a one-line error.
    with contextlib.redirect_stdout(io.StringIO()):
        config = fit_config(fit_args)
    device, device_from = default_device(config, args)
    est = estimate_from_config(
        config,
        gpu=args.gpu,
        device_memory=args.gpu_mem,
        devices=args.devices,
        num_nodes=args.nodes,
        micro_batch_size=args.micro_batch,
        vocab_size=args.vocab_size,
        mfu=args.mfu,
        tokens=int(args.tokens) if args.tokens is not None else None,
        usd_per_gpu_hour=args.usd_per_gpu_hour,
        fragmentation=args.fragmentation,
        device=device,
        trace=args.trace,
    )
    if args.json:
        out = est.to_dict()
        chosen = "--device" if args.device else "trainer.accelerator" if device_from else "default"
        out["device"]["chosen_by"] = chosen
        print(json.dumps(out, indent=2))
        return 0
    per_gpu = None
    if args.gpu is None and args.gpu_mem is None and device == "gpu":
        kw = {"fragmentation": args.fragmentation, "divide_global_batch": False}
        per_gpu = {n: largest_fitting_micro_batch(est.setup, gpu=g, **kw) for n, g in GPUS.items()}
    print(format_estimate(est, per_gpu=per_gpu, detail=args.detail, device_from=device_from))
    return 0


def _names_a_class(fit_args: list[str]) -> bool:
    """Whether the command line or its files name a class of their own (a model, data or
    callback class: code that may change nanolab's model classes when imported)."""
    from nanolab.training.plugins import class_paths_in_argv, class_paths_in_config

    files = read_config_files(fit_args, ())
    return bool(class_paths_in_argv(fit_args) or any(map(class_paths_in_config, files)))


def default_device(config: dict[str, Any], args: argparse.Namespace) -> tuple[str, str | None]:
    """``(device, why)``: ``--device`` as given (why None), else ``cpu`` for a config that
    trains on a CPU (``trainer.accelerator: cpu``, as the quickstart does) unless ``--gpu`` or
    ``--gpu-mem`` asks about a GPU, else ``gpu`` (why None: the default). Estimating an H100
    for a run that will train on this machine's CPU would answer another question."""
    if args.device is not None:
        return args.device, None
    trainer = config.get("trainer") if isinstance(config.get("trainer"), dict) else {}
    if (
        str(trainer.get("accelerator")).lower() == "cpu"
        and args.gpu is None
        and args.gpu_mem is None
    ):
        return (
            "cpu",
            "CPU, as the config's trainer.accelerator: cpu says (--device gpu estimates a GPU)",
        )
    return "gpu", None


def _hours(hours: float) -> str:
    """A run's wall-clock: minutes under an hour (a CPU check of minutes is not "0.0 h")."""
    return f"{hours * 60:,.1f} min" if hours < 1 else f"{hours:,.1f} h"


def _amount(value: float, whole_at: float | None = None) -> str:
    """Hours or dollars: whole from ``whole_at`` on (a cost of $11), small values legible."""
    if whole_at is not None and value >= whole_at:
        return f"{value:,.0f}"
    return f"{value:,.1f}" if value >= 1 else f"{value:.3f}"
