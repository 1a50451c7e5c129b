"""Peak memory per device: model states + activations + transients, then overheads.

The peak allocated figure is what ``torch.cuda.max_memory_allocated`` would report; it is the
larger of two moments of a training step:

* forward/backward turn-around: resident model states, the gradients if they already exist
  (gradient accumulation > 1 keeps them across micro-batches), everything autograd saved, and
  the larger of the loss's logits transients and (with checkpointing) one block's recompute;
* optimizer step: resident states, all gradients and the optimizer's temporaries.

On top of the peak come two lines that ``max_memory_allocated`` does not see but the device
does: the framework's own memory (CUDA/ROCm context, kernels, communication buffers) and a
margin for the caching allocator's fragmentation (reserved but unusable blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nanolab.estimator.activations import Saved, loss_transient, saved_activations
from nanolab.estimator.gpus import MiB
from nanolab.estimator.numerics import Backend, numerics_for
from nanolab.estimator.setup import Setup
from nanolab.estimator.shapes import inventory
from nanolab.estimator.states import ModelStates, model_states

#: Memory the framework holds outside PyTorch's allocator, per device. The CUDA context with
#: lazy module loading plus cuBLAS/cuDNN handles is ~0.4-0.6 GiB on recent drivers; ROCm's
#: context and rocBLAS/hipBLASLt workspaces are larger. NCCL/RCCL adds its own buffers once
#: there is more than one device. Conservative constants, to be refined by the GPU benchmark.
CONTEXT_BYTES = {"cuda": 600 * MiB, "rocm": 1024 * MiB, "cpu": 0}
COMM_BYTES = {"cuda": 384 * MiB, "rocm": 512 * MiB, "cpu": 0}
#: Share of the peak kept free for the caching allocator's fragmentation.
DEFAULT_FRAGMENTATION = 0.10


@dataclass
class Line:
    """One row of the memory table."""

    key: str
    label: str
    bytes: int
    note: str = ""
    in_peak: bool = True  # part of the peak-allocated sum (else informational)


@dataclass
class MemoryEstimate:
    lines: list[Line]
    peak_allocated: int
    total: int
    cpu_bytes: int
    peak_phase: str
    saved: Saved
    states: ModelStates
    accumulate: int
    details: dict = field(default_factory=dict)

    def line(self, key: str) -> Line:
        return next(ln for ln in self.lines if ln.key == key)


def grad_accumulation(setup: Setup, micro_batch: int) -> int:
    """Micro-batches per optimizer step that reach ``global_batch_tokens`` (1 without one);
    rounded up when it does not divide (the estimate then describes the closest run)."""
    if setup.global_batch_tokens is None:
        return 1
    per = micro_batch * setup.gpt.block_size * setup.world_size
    return max(1, -(-setup.global_batch_tokens // per))


def estimate_memory(
    setup: Setup,
    micro_batch: int | None = None,
    *,
    backend: Backend = "cuda",
    fragmentation: float = DEFAULT_FRAGMENTATION,
) -> MemoryEstimate:
    """Per-device memory for one training step of ``setup`` at ``micro_batch`` sequences."""
    B = micro_batch if micro_batch is not None else setup.micro_batch_size
    if B is None or B < 1:
        raise ValueError("a micro-batch size >= 1 is needed")
    gpt = setup.gpt
    num = numerics_for(setup, backend)
    inv = inventory(gpt)
    st = model_states(setup, inv, num)
    saved = saved_activations(gpt, B, gpt.block_size, num)
    lt = loss_transient(gpt, B, gpt.block_size, num)
    accumulate = grad_accumulation(setup, B)

    grads_in_fwd = st.grads if accumulate > 1 else 0
    transient = max(lt.peak, saved.recompute_block)
    fwd_bwd = grads_in_fwd + saved.total + transient
    # Last in the backward, a tied embedding's dense gradient (V x C) arrives while the head's
    # gradient is already there, and autograd accumulates the two out of place.
    # (Under FSDP / ZeRO the head's unsharded gradient is in the "gathered" line: one more.)
    tied = gpt.padded_vocab_size * gpt.n_embd * num.grad if gpt.tie_weights else 0
    tied *= 2 if setup.strategy.kind in ("single", "ddp") else 1
    step = st.grads + max(st.optimizer_temp, tied)
    peak = st.resident + max(fwd_bwd, step)
    phase = "forward/backward" if fwd_bwd >= step else "backward end / optimizer step"

    p_name = {4: "fp32", 2: "16-bit"}
    V = gpt.padded_vocab_size
    per_block = saved.per_block
    embed_head = sum(saved.embed.values()) + sum(saved.head.values())
    notes = st.notes or {}
    logits_win = lt.peak >= saved.recompute_block
    at_fb = fwd_bwd >= step
    lines = [
        Line("params", f"parameters ({p_name[num.param]})", st.params, _share(setup, "params")),
        Line("buffers", "buffers (RoPE cos/sin tables)", st.buffers, ""),
        Line(
            "grads",
            f"gradients ({p_name[num.grad]})",
            st.grads,
            notes.get("grads", "kept across micro-batches" if accumulate > 1 else ""),
            in_peak=not at_fb or accumulate > 1,
        ),
        Line("optimizer", _opt_label(setup), st.optimizer, _share(setup, "optimizer")),
        Line("master", "fp32 master weights", st.master, notes.get("master", _master_note(setup))),
        Line("buckets", "gradient communication buckets", st.buckets, notes.get("buckets", "")),
        Line(
            "gathered", "FSDP / ZeRO-3 gathered parameters", st.gathered, notes.get("gathered", "")
        ),
        Line(
            "activations",
            "activations saved for backward",
            saved.blocks + embed_head,
            f"{gpt.n_layer} x {per_block / MiB:,.1f} MiB"
            + (" block inputs (checkpointed)" if saved.checkpointing else "")
            + f" + {embed_head / MiB:,.1f} MiB embeddings/final norm",
            in_peak=at_fb,
        ),
        Line(
            "weight_copies",
            "autocast 16-bit weight copies",
            saved.weight_copies,
            "saved for backward" if num.weight_copies else "",
            in_peak=at_fb,
        ),
        Line(
            "loss",
            "log-softmax saved by the loss",
            sum(saved.loss.values()),
            f"B*T*V = {B}*{gpt.block_size}*{V} in {'fp32' if num.loss == 4 else '16-bit'}",
            in_peak=at_fb,
        ),
        Line(
            "logits",
            "logits + loss transients",
            lt.peak,
            _logits_note(lt),
            in_peak=at_fb and logits_win,
        ),
        Line(
            "recompute",
            "recompute of one checkpointed block",
            saved.recompute_block,
            "one block rebuilt in backward" if saved.checkpointing else "",
            in_peak=at_fb and not logits_win,
        ),
        Line(
            "tied_grad",
            "tied embedding gradient sum (backward end)",
            tied,
            "dense V x C gradient + out-of-place sum" if tied else "",
            in_peak=not at_fb and tied > st.optimizer_temp,
        ),
        Line(
            "optimizer_temp",
            "optimizer step temporaries",
            st.optimizer_temp,
            _temp_note(setup) if st.optimizer_temp else "",
            in_peak=not at_fb and tied <= st.optimizer_temp,
        ),
    ]
    assert sum(ln.bytes for ln in lines if ln.in_peak) == peak
    ctx = CONTEXT_BYTES[backend] + (COMM_BYTES[backend] if setup.world_size > 1 else 0)
    frag = int(fragmentation * peak)
    total = peak + ctx + frag
    lines.append(
        Line(
            "context",
            f"framework overhead ({backend})",
            ctx,
            "context, kernels" + (", NCCL buffers" if setup.world_size > 1 else ""),
            in_peak=False,
        )
    )
    lines.append(
        Line(
            "fragmentation",
            f"allocator fragmentation margin ({fragmentation:.0%})",
            frag,
            "of peak allocated",
            in_peak=False,
        )
    )
    return MemoryEstimate(
        lines=lines,
        peak_allocated=peak,
        total=total,
        cpu_bytes=st.cpu,
        peak_phase=phase,
        saved=saved,
        states=st,
        accumulate=accumulate,
        details={
            "block": dict(saved.block),
            "embed": dict(saved.embed),
            "head": dict(saved.head),
            "loss": dict(saved.loss),
        },
    )


def _share(setup: Setup, what: str) -> str:
    s = setup.strategy
    n = setup.world_size
    if s.kind in ("fsdp1", "fsdp2"):
        return "on the CPU (offload)" if s.offload_params else f"sharded over {n}"
    if s.kind == "deepspeed":
        if what == "params":
            if s.offload_params:
                return "on the CPU (offload)"
            return f"sharded over {n}" if s.zero_stage == 3 else "16-bit copy on every device"
        return "on the CPU (offload)" if s.offload_optimizer else f"sharded over {n}"
    return "replicated" if n > 1 else ""


def _opt_label(setup: Setup) -> str:
    if setup.optimizer == "adamw8bit":
        return "optimizer states (AdamW8bit)"
    if setup.strategy.kind == "deepspeed":
        return "optimizer states (Adam fp32 m+v)"
    return "optimizer states (AdamW m+v)"


def _master_note(setup: Setup) -> str:
    if setup.strategy.kind == "deepspeed":
        return "DeepSpeed keeps fp32 weights" if setup.precision != "32-true" else "fp32 run"
    if setup.precision.endswith("-mixed"):
        return "none: the fp32 parameters are the master copy"
    return "none" if setup.precision == "32-true" else "none: 16-bit updates"


def _logits_note(lt) -> str:
    if lt.backward >= lt.forward_peak:
        return "loss backward: d(log-softmax) + d(logits)"
    return "logits + fp32 copy" if lt.fp32_copy else "logits"


def _temp_note(setup: Setup) -> str:
    if setup.optimizer == "adamw8bit":
        return "CPU 8-bit AdamW: one tensor's states in fp32"
    return "foreach AdamW: one state-sized buffer"
