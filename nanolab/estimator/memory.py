"""Peak memory per device: model states + activations + transients, then overheads.

The peak allocated figure is what ``torch.cuda.max_memory_allocated`` would report: resident
model states plus the largest of the moments of one ``nanolab fit`` step (:func:`moments`: the
loss, the lm_head's backward, the MLP backward of the last and first blocks, a tied embedding's
gradient sum, the optimizer step). The step is Lightning's, with the gradients freed right after
each optimizer step (``GPTLightningModule.optimizer_step``), so they exist during a forward only
from the second micro-batch of an accumulation window on. Validated against a real Trainer step
on CPU (tests/test_estimator_lightning.py, docs/estimator.md).

On top of the peak come two lines that ``max_memory_allocated`` does not see but the device
does: the framework's own memory (CUDA/ROCm context, kernels, communication buffers) and a
margin for the caching allocator's fragmentation (reserved but unusable blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from nanolab.estimator.activations import LossTransient, Saved, loss_transient, saved_activations
from nanolab.estimator.gpus import MiB
from nanolab.estimator.numerics import Backend, Numerics, numerics_for
from nanolab.estimator.setup import Setup
from nanolab.estimator.shapes import Inventory, Tensor, inventory
from nanolab.estimator.states import ModelStates, model_states

#: Memory the framework holds outside PyTorch's allocator, per device: the CUDA context with
#: lazy module loading plus cuBLAS/cuDNN handles. Measured on an H200 (torch 2.11.0+cu130,
#: 2026-12-04, benches/bench_memory.py): 767 MiB during a bf16 fit of 124M and of 350M alike.
#: ROCm's context and rocBLAS/hipBLASLt workspaces are larger (not measured yet). NCCL/RCCL
#: adds its own buffers once there is more than one device.
#: On a CPU the line is the training process itself before its model and data (Python, torch,
#: Lightning, the loaders): peak RSS of a 1-layer, 32-wide quickstart fit, 468 MiB (torch 2.13
#: CPU build, Lightning 2.6.6, 2026-12-05), rounded up. The queue's CPU packing adds the same.
CONTEXT_BYTES = {"cuda": 768 * MiB, "rocm": 1024 * MiB, "cpu": 512 * MiB}
COMM_BYTES = {"cuda": 384 * MiB, "rocm": 512 * MiB, "cpu": 0}
#: Share of the peak kept free for the caching allocator's slack (reserved / allocated - 1).
#: Measured on an H200 with expandable segments (which `fit` turns on): 10.9% for 124M at
#: micro-batch 16, 3.6% for 350M at 8; the default allocator left 22.1% and 6.2%.
DEFAULT_FRAGMENTATION = 0.12
#: The same margin on a CPU: resident memory the C heap keeps beyond the allocator's peak (freed
#: blocks it does not hand back at once). Measured as the growth of a quickstart fit's peak RSS
#: against the growth of its allocator peak between micro-batches 8, 128 and 256: 1.23x, 1.29x
#: (1.26x over the whole range; 2026-12-05, torch 2.13 CPU build), rounded up. ``nanolab estimate --device
#: cpu`` and fit's refusal of a run too big for this machine's RAM both use it.
CPU_FRAGMENTATION = 0.35


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
    """Micro-batches per optimizer step that reach ``global_batch_tokens`` (without one, the
    trainer's ``accumulate_grad_batches``, as fit trains it); rounded up when it does not
    divide (the estimate then describes the closest run)."""
    if setup.global_batch_tokens is None:
        return setup.accumulate_grad_batches
    per = micro_batch * setup.gpt.block_size * setup.world_size
    return max(1, -(-setup.global_batch_tokens // per))


@dataclass
class Moment:
    """One instant of the training step and what is allocated then (beyond resident states)."""

    phase: str
    parts: list[Line]

    @property
    def bytes(self) -> int:
        return sum(ln.bytes for ln in self.parts)


def estimate_memory(
    setup: Setup,
    micro_batch: int | None = None,
    *,
    backend: Backend = "cuda",
    fragmentation: float = DEFAULT_FRAGMENTATION,
) -> MemoryEstimate:
    """Per-device memory for one ``nanolab fit`` step of ``setup`` at ``micro_batch`` sequences
    (the step of the module docstring; the peak is the largest of its :func:`moments`)."""
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
    all_moments = moments(setup, B, accumulate, num, inv, st, saved, lt)
    top = max(all_moments, key=lambda m: m.bytes)
    peak = st.resident + top.bytes

    p_name = {4: "fp32", 2: "16-bit"}
    notes = st.notes or {}
    resident = [
        Line("params", f"parameters ({p_name[num.param]})", st.params, _share(setup, "params")),
        Line("buffers", "buffers (RoPE cos/sin tables)", st.buffers, ""),
        Line("optimizer", _opt_label(setup), st.optimizer, _share(setup, "optimizer")),
        Line("master", "fp32 master weights", st.master, notes.get("master", _master_note(setup))),
        Line("buckets", "gradient communication buckets", st.buckets, notes.get("buckets", "")),
        Line(
            "gathered", "FSDP / ZeRO-3 gathered parameters", st.gathered, notes.get("gathered", "")
        ),
    ]
    lines = resident + list(top.parts)
    keys = {ln.key for ln in lines}
    # The whole-step figures, shown in parentheses when the peak moment holds less of them.
    info = [
        Line("grads", f"gradients ({p_name[num.grad]})", st.grads, notes.get("grads", "")),
        Line(
            "activations",
            "activations saved for backward",
            saved.blocks + sum(saved.embed.values()) + sum(saved.head.values()),
            f"{gpt.n_layer} x {saved.per_block / MiB:,.1f} MiB"
            + (" block inputs (checkpointed)" if saved.checkpointing else ""),
        ),
        Line("logits", "logits + loss transients", lt.peak, _logits_note(lt, num)),
        Line("optimizer_temp", "optimizer step temporaries", st.optimizer_temp, ""),
    ]
    lines += [replace(ln, in_peak=False) for ln in info if ln.key not in keys]
    assert sum(ln.bytes for ln in lines if ln.in_peak) == peak
    comm = setup.world_size > 1
    ctx = CONTEXT_BYTES[backend] + (COMM_BYTES[backend] if comm else 0)
    frag = int(fragmentation * peak)
    total = peak + ctx + frag
    note = "the process: Python, torch, Lightning" if backend == "cpu" else "context, kernels"
    note += ", NCCL buffers" if comm else ""
    lines.append(Line("context", f"framework overhead ({backend})", ctx, note, in_peak=False))
    lines.append(fragmentation_line(fragmentation, frag))
    return MemoryEstimate(
        lines=lines,
        peak_allocated=peak,
        total=total,
        cpu_bytes=st.cpu,
        peak_phase=top.phase,
        saved=saved,
        states=st,
        accumulate=accumulate,
        details={
            "block": dict(saved.block),
            "embed": dict(saved.embed),
            "head": dict(saved.head),
            "loss": dict(saved.loss),
            "moments": {m.phase: st.resident + m.bytes for m in all_moments},
        },
    )


def moments(
    setup: Setup,
    B: int,
    accumulate: int,
    num: Numerics,
    inv: Inventory,
    st: ModelStates,
    saved: Saved,
    lt: LossTransient,
) -> list[Moment]:
    """The candidate peaks of one step, each as the tensors alive at that instant.

    In the order the step reaches them (``G`` = gradients left from earlier micro-batches of
    the window; none in the first, and none at all without accumulation):

    * loss: ``G`` + everything saved + the logits and loss transients;
    * head backward: the lm_head's input gradient and weight gradient arrive while the logits
      gradient and every block's activations are alive;
    * block backward, for the last block (most activations alive) and the first (most
      gradients computed): the MLP's down-projection, then up-projection backward (the two
      largest transients: a B*T*F input gradient and a weight gradient), with the gradients of
      the blocks after it already allocated; under checkpointing the block's recomputed
      activations too;
    * embedding backward: a tied embedding's two gradient contributions and their sum;
    * optimizer step: every gradient and the optimizer's scratch.
    """
    gpt = setup.gpt
    T, C, V = gpt.block_size, gpt.n_embd, gpt.padded_vocab_size
    # The MLP's widths as the model builds them (GELU: 4C; SwiGLU: gate and up stacked).
    mlp = inv.mlp_linears(0)
    F = mlp[0].shape[0] if mlp else gpt.mlp_ratio * C
    L = gpt.n_layer
    c, r, g = num.compute, num.resid, num.grad
    BT, BTC, BTF = B * T, B * T * C, B * T * F
    replicated = setup.strategy.kind in ("single", "ddp")
    P = max(1, inv.numel)
    G = st.grads if accumulate > 1 else 0
    tied = V * C * g if gpt.tie_weights and replicated else 0
    autocast = num.weight_copies
    embed = sum(saved.embed.values())
    head = sum(saved.head.values())
    loss_saved = sum(saved.loss.values())
    targets = BT * 8
    notes = st.notes or {}

    def grads_line(nbytes: int, note: str) -> Line:
        return Line("grads", f"gradients ({'fp32' if g == 4 else '16-bit'})", nbytes, note)

    out: list[Moment] = []
    acts = Line(
        "activations",
        "activations saved for backward",
        saved.blocks + embed + head,
        f"{L} x {saved.per_block / MiB:,.1f} MiB"
        + (" block inputs (checkpointed)" if saved.checkpointing else " per block")
        + f" + {(embed + head) / MiB:,.1f} MiB embeddings/final norm",
    )
    copies = Line("weight_copies", "autocast 16-bit weight copies", saved.weight_copies, "")
    loss_label, loss_note = _loss_label(num, B, T, V)
    base = [acts, copies] + ([grads_line(G, "kept across micro-batches")] if G else [])
    out.append(
        Moment(
            "forward end / loss backward",
            [
                *base,
                Line("loss", loss_label, loss_saved, loss_note),
                Line("logits", "logits + loss transients", lt.peak, _logits_note(lt, num)),
            ],
        )
    )
    # lm_head backward: d(logits) in the compute dtype, d(input) and d(weight).
    head_out = BTC * c + V * C * c
    out.append(
        Moment(
            "lm_head backward",
            [
                *base,
                Line("targets", "targets (held by the batch)", targets, ""),
                Line("logits_grad", "logits gradient", BT * V * c, "B*T*V"),
                Line("backward", "lm_head input + weight gradients", head_out, ""),
            ],
        )
    )
    # Blocks: what one block's backward allocates around its MLP.
    blk = sum(saved.block.values())
    wcopy = saved.block_weight_copies
    fc_w = _with_bias(inv, mlp[0]) if mlp else F * C + (F if gpt.bias else 0)
    proj_w = _with_bias(inv, mlp[-1]) if mlp else C * F + (C if gpt.bias else 0)
    block_grads = inv.block_numel(0) * st.grads // P
    head_grads = (P - inv.block_numel(0) * L) * st.grads // P  # root params (embeddings too)
    emb_grads = inv.lookup_numel * st.grads // P  # untied token table, position table
    head_grads -= emb_grads
    drop = gpt.dropout > 0
    mask = saved.block.get("mlp residual dropout mask", 0)
    proj_copy = (mlp[-1].numel if mlp else C * F) * c if autocast else 0
    # The down-projection's output gradient is a tensor of its own when the residual dropout's
    # backward made it (its mask is gone by then) or the residual stream has another dtype.
    down = (BTC * c if drop or r != c else 0) - mask + BTF * c + proj_w * c
    up = -2 * BTF * c - proj_copy - mask + (0 if G else proj_w * g) + BTF * c + BTC * c + fc_w * c
    transient = max(down, up)
    for b, where in sorted({(L - 1, "last"), (0, "first")}, reverse=True):
        above = L - 1 - b
        if saved.checkpointing:
            # The rebuilt block saves its own input for ln_1: the checkpoint's stored tensor.
            shared = saved.checkpoint_input if num.ln_in == num.resid else 0
            alive = embed + (b + 1) * saved.checkpoint_input - shared
            recompute = blk + wcopy
        else:
            alive = embed + b * (blk + wcopy)
            recompute = 0
        own = 0 if saved.checkpointing else blk + wcopy
        so_far = G + tied if G else head_grads + above * block_grads
        parts = [
            Line(
                "activations",
                "activations still saved",
                alive + own,
                f"embeddings + blocks 0..{b}" + (" inputs" if saved.checkpointing else ""),
            ),
            Line(
                "recompute",
                "recompute of one checkpointed block",
                recompute,
                "block rebuilt in backward" if recompute else "",
            ),
            Line("targets", "targets (held by the batch)", targets, ""),
            Line(
                "grads_so_far",
                "gradients already computed",
                so_far,
                "kept across micro-batches" if G else f"head + {above} later block(s)",
            ),
            Line(
                "backward",
                "residual gradient + MLP backward outputs",
                BTC * r + transient,
                "B*T*F input gradient + weight gradient",
            ),
        ]
        out.append(Moment(f"backward of the {where} block", [p for p in parts if p.bytes]))
    # Embedding backward: a tied embedding sums the head's contribution with its own.
    if tied:
        parts = [
            Line("grads", "gradients", st.grads, "all but the tied embedding's final sum"),
            Line(
                "tied_grad",
                "tied embedding gradient sum",
                (3 if G else 2) * tied,
                "head + embedding contributions and their sum",
            ),
            Line("activations", "activations still saved", BT * 8, "token ids"),
            Line("targets", "targets (held by the batch)", targets, ""),
        ]
        out.append(Moment("embedding backward", parts))
    out.append(
        Moment(
            "optimizer step",
            [
                grads_line(st.grads, notes.get("grads", "")),
                Line(
                    "optimizer_temp",
                    "optimizer step temporaries",
                    st.optimizer_temp,
                    _temp_note(setup) if st.optimizer_temp else "",
                ),
            ],
        )
    )
    return out


def _with_bias(inv: Inventory, weight: Tensor) -> int:
    """Elements of a Linear's weight plus its bias, if the model has one."""
    bias = weight.name[: -len("weight")] + "bias"
    return weight.numel + sum(t.numel for t in inv.tensors if t.name == bias)


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
    adam = "Adam fp32 m+v" if setup.strategy.kind == "deepspeed" else "AdamW m+v"
    names = {"adamw8bit": "AdamW8bit", "muon": "Muon momentum + AdamW m+v"}
    return f"optimizer states ({names.get(setup.optimizer, adam)})"


def _master_note(setup: Setup) -> str:
    if setup.strategy.kind == "deepspeed":
        return "DeepSpeed keeps fp32 weights" if setup.precision != "32-true" else "fp32 run"
    if setup.precision.endswith("-mixed"):
        return "none: the fp32 parameters are the master copy"
    return "none" if setup.precision == "32-true" else "none: 16-bit updates"


def _loss_label(num: Numerics, B: int, T: int, V: int) -> tuple[str, str]:
    """The label and note of the line for what the loss saves."""
    btv = f"B*T*V = {B}*{T}*{V}"
    if num.compiled_loss:
        width = "fp32" if num.compute == 4 else "16-bit"
        return "logits saved by the loss (compiled)", f"{btv} in {width} (no log-softmax kept)"
    if num.gpu_autocast_loss:
        return "log-softmax + logits saved by the loss", f"{btv} in fp32 + in 16-bit (GPU autocast)"
    return "log-softmax saved by the loss", f"{btv} in {'fp32' if num.loss == 4 else '16-bit'}"


def _logits_note(lt, num: Numerics) -> str:
    if lt.backward >= lt.forward_peak:
        if num.gpu_autocast_loss:
            return "loss backward: one fp32 B*T*V gradient (measured, H200)"
        if num.compiled_loss:  # measured under autocast only; 16-bit models likely hold less
            return "loss backward: one fp32 B*T*V gradient (as bf16-mixed measured, H200)"
        return "loss backward: d(log-softmax) + d(logits)"
    return "logits + fp32 copy" if lt.fp32_copy else "logits"


_TEMP_NOTES = {
    "adamw8bit": "CPU 8-bit AdamW: one tensor's states in fp32",
    "muon": "Muon: Newton-Schulz on the largest matrix, in bf16",
}


def _temp_note(setup: Setup) -> str:
    return _TEMP_NOTES.get(setup.optimizer, "foreach AdamW: one state-sized buffer")


def fragmentation_line(fragmentation: float, frag: int) -> Line:
    """The margin line added on top of the peak for the allocator's fragmentation."""
    return Line(
        "fragmentation",
        f"allocator fragmentation margin ({fragmentation:.0%})",
        frag,
        "of peak allocated",
        in_peak=False,
    )
