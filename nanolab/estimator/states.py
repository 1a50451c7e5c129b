"""Model states per device: parameters, gradients, optimizer states, master weights, buckets.

Byte counts follow what the real objects allocate (validated to the byte against a real model and
optimizer in tests/test_estimator_exact.py), then sharded the way each strategy shards them:

* single device / DDP: everything replicated. DDP's reducer also allocates flat communication
  buckets covering every gradient (one more gradient-sized buffer) unless
  ``gradient_as_bucket_view=True``.
* FSDP (FULL_SHARD): parameters, gradients and optimizer states divided by the world size, plus
  the parameters gathered for the unit that is computing (and the next one, prefetched) and their
  unsharded gradients before the reduce-scatter.
* DeepSpeed ZeRO-1/2/3 (16-bit): 16-bit parameters (sharded only in ZeRO-3), 16-bit gradients
  (sharded from ZeRO-2), and per shard the fp32 gradient, fp32 master weights and Adam's two
  fp32 moments; this is DeepSpeed's own ``estimate_zero2/3`` accounting (2 + 18/N bytes per
  parameter for ZeRO-2; 18/N + 4 x largest layer for ZeRO-3), plus its gradient buckets
  (``reduce_bucket_size`` elements, double-buffered with ``overlap_comm``).
* Offload moves the optimizer states, master weights and fp32 gradients (and in ZeRO-3 / FSDP
  ``cpu_offload`` the parameters) to CPU memory, reported as its own figure.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanolab.estimator.numerics import Numerics
from nanolab.estimator.setup import Setup
from nanolab.estimator.shapes import Inventory, Tensor, buffer_numel

#: bitsandbytes 8-bit optimizers keep tensors smaller than this in fp32 (``min_8bit_size``).
BNB_MIN_8BIT_SIZE = 4096
#: bitsandbytes' block-wise quantisation block (0.45+): one fp32 absmax per block per state.
BNB_BLOCK = 256
#: The two 256-entry fp32 quantisation maps (signed, unsigned) shared by all tensors.
BNB_QMAPS = 2 * 256 * 4
#: torch AdamW's per-tensor ``step`` counter (an fp32 scalar).
ADAM_STEP_BYTES = 4


def adamw_state_bytes(inv: Inventory, state_bytes: int) -> int:
    """torch AdamW: ``exp_avg`` and ``exp_avg_sq`` in the parameter dtype, plus ``step``.

    (``step`` lives on the CPU in the default foreach path and on the device when fused; it is
    counted either way: 4 bytes per tensor.)
    """
    return sum(2 * t.numel * state_bytes + ADAM_STEP_BYTES for t in inv.tensors)


def adamw8bit_state_bytes(inv: Inventory) -> int:
    """bitsandbytes AdamW8bit: per tensor of >= 4096 elements two uint8 states plus one fp32
    absmax per 256-element block for each; smaller tensors keep two fp32 states; plus the two
    shared quantisation maps."""
    total, any_8bit = 0, False
    for t in inv.tensors:
        n = t.numel
        if n < BNB_MIN_8BIT_SIZE:
            total += 2 * n * 4
        else:
            any_8bit = True
            blocks = -(-n // BNB_BLOCK)
            total += 2 * n + 2 * blocks * 4
    return total + (BNB_QMAPS if any_8bit else 0)


def is_hidden_matrix(t: Tensor) -> bool:
    """A weight Muon trains (``nanolab.training.optim.hidden_matrices``): a 2-D tensor inside a
    block. Embeddings, the head, norms and biases stay with AdamW."""
    return t.block is not None and len(t.shape) == 2


def muon_state_bytes(inv: Inventory, state_bytes: int) -> int:
    """``muon``: one momentum buffer (the gradient's dtype) per hidden matrix, no step counter;
    AdamW's two moments and ``step`` for every other tensor."""
    hidden = [t for t in inv.tensors if is_hidden_matrix(t)]
    rest = Inventory(tuple(t for t in inv.tensors if not is_hidden_matrix(t)))
    return sum(t.numel * state_bytes for t in hidden) + adamw_state_bytes(rest, state_bytes)


def muon_step_temp(inv: Inventory, state_bytes: int) -> int:
    """Bytes of scratch torch Muon's per-matrix loop peaks at (the largest matrix decides).

    For an ``A x B`` matrix (``n`` elements, ``m = min(A, B)``): the Nesterov update
    ``grad.lerp(buf)`` (``n`` in the gradient's dtype) lives through the Newton-Schulz iteration,
    which works in bf16 on a copy: from its second iteration the new Gram matrix is made while
    the previous one and its polynomial are alive (``n + 3m^2``), and the new iterate while the
    old one is (``2n + 2m^2``).
    """
    peak = 0
    for t in inv.tensors:
        if is_hidden_matrix(t):
            n, m = t.numel, min(t.shape)
            peak = max(peak, n * state_bytes + 2 * max(n + 3 * m * m, 2 * n + 2 * m * m))
    return peak


def optimizer_state_bytes(inv: Inventory, optimizer: str, state_bytes: int) -> int:
    if optimizer == "adamw8bit":
        return adamw8bit_state_bytes(inv)
    if optimizer == "muon":
        return muon_state_bytes(inv, state_bytes)
    return adamw_state_bytes(inv, state_bytes)


def single_tensor_adamw_temp(inv: Inventory) -> int:
    """Elements of scratch torch AdamW's per-tensor loop (its CPU default) peaks at.

    For each tensor it makes ``sqrt(v)`` and the bias-corrected denominator (two tensors of its
    size) while the previous tensor's denominator is still referenced by the loop variable. The
    loop runs per parameter group: matrices (decay) first, then vectors, as nanolab builds them.
    """
    peak = 0
    for group in (
        [t for t in inv.tensors if len(t.shape) >= 2],
        [t for t in inv.tensors if len(t.shape) < 2],
    ):
        prev = 0
        for t in group:
            peak = max(peak, prev + 2 * t.numel)
            prev = t.numel
    return peak


@dataclass
class ModelStates:
    """Per-device model-state bytes (``cpu``: what offload puts in host memory per device)."""

    params: int = 0
    buffers: int = 0
    grads: int = 0
    optimizer: int = 0
    master: int = 0
    buckets: int = 0
    gathered: int = 0
    optimizer_temp: int = 0
    cpu: int = 0
    notes: dict[str, str] | None = None

    @property
    def resident(self) -> int:
        """Alive for the whole step (gradients counted separately: see ``grads``)."""
        return (
            self.params + self.buffers + self.optimizer + self.master + self.buckets + self.gathered
        )


def model_states(setup: Setup, inv: Inventory, num: Numerics) -> ModelStates:
    """Per-device model-state memory for ``setup``; see the module docstring."""
    P = inv.numel
    N = setup.world_size
    s = setup.strategy
    notes: dict[str, str] = {}
    opt_total_16 = optimizer_state_bytes(inv, setup.optimizer, num.param)
    fused = setup.fused if setup.fused is not None else True
    if setup.optimizer == "muon":
        # Muon steps the hidden matrices, then AdamW the rest: their scratch never overlaps.
        rest = Inventory(tuple(t for t in inv.tensors if not is_hidden_matrix(t)))
        if setup.fused is None and not num.gpu:
            adamw_temp = single_tensor_adamw_temp(rest) * num.param
        else:
            adamw_temp = 0 if fused else rest.numel * num.param
        foreach_temp = max(muon_step_temp(inv, num.param), adamw_temp)
    elif setup.optimizer == "adamw8bit":
        # The CUDA kernel updates 8-bit states in registers. bitsandbytes 0.50's CPU path works on
        # one tensor at a time with five fp32 buffers of its size (states, update), one more for
        # a 16-bit parameter's fp32 copy (measured, tests/test_estimator_peak.py).
        largest = max(t.numel for t in inv.tensors)
        foreach_temp = 0 if num.gpu else (5 + (num.param != 4)) * largest * 4
    elif setup.fused is None and not num.gpu:
        foreach_temp = single_tensor_adamw_temp(inv) * num.param
    else:
        # foreach AdamW allocates one state-sized buffer (the sqrt of exp_avg_sq); fused: none.
        foreach_temp = 0 if fused else P * num.param

    if s.kind in ("single", "ddp"):
        st = ModelStates(
            params=P * num.param,
            grads=P * num.grad,
            optimizer=opt_total_16,
            optimizer_temp=foreach_temp,
        )
        if s.kind == "ddp" and not s.gradient_as_bucket_view:
            st.buckets = P * num.grad
            notes["buckets"] = "DDP reducer buckets (gradient_as_bucket_view: true removes them)"
        elif s.kind == "ddp":
            notes["buckets"] = "gradients are views of the buckets"
    elif s.kind in ("fsdp1", "fsdp2"):
        st = ModelStates(
            params=-(-P * num.param // N),
            grads=-(-P * num.grad // N),
            optimizer=-(-opt_total_16 // N),
            optimizer_temp=-(-foreach_temp // N),
        )
        g = num.gather
        block, root = inv.block_numel(0), inv.root_numel
        if s.kind == "fsdp1" and not (s.fsdp_wrapped_blocks and not s.shard_grad_op):
            # One unit (no auto_wrap_policy) or SHARD_GRAD_OP: all parameters gathered, and all
            # unsharded gradients before the reduce-scatter.
            st.gathered = 2 * P * g
            notes["gathered"] = "whole model gathered (one FSDP unit) + unsharded gradients"
        else:
            # Root unit (embeddings, final norm, head) stays gathered from forward to backward,
            # its unsharded gradient accumulates over the backward; two blocks gathered
            # (computing + prefetched) and one block's unsharded gradient.
            st.gathered = root * g + root * num.grad + 2 * block * g + block * num.grad
            notes["gathered"] = "root unit + 2 blocks gathered, their unsharded gradients"
        if s.offload_params:
            st.cpu = st.params + st.grads + st.optimizer
            st.params = st.grads = st.optimizer = st.optimizer_temp = 0
            notes["cpu"] = "FSDP cpu_offload: sharded params, grads and optimizer on the CPU"
    else:  # deepspeed
        stage = s.zero_stage
        half = num.param == 2
        shard = -(-P // N)
        # DeepSpeed's optimizer sees one flat fp32 partition per parameter group.
        if setup.optimizer == "adamw8bit":
            opt_shard = 2 * shard + 2 * (-(-shard // BNB_BLOCK)) * 4 + BNB_QMAPS
        else:
            opt_shard = 2 * shard * 4
        st = ModelStates()
        st.params = P * num.param if stage < 3 else shard * num.param
        if stage == 3:
            # fp32 gradient partitions; the 16-bit gradient never exists unsharded for long.
            st.grads = shard * 4
        elif half:
            st.grads = (P if stage == 1 else shard) * 2 + shard * 4
            notes["grads"] = "16-bit gradients + fp32 gradient partition"
        else:
            st.grads = (P if stage == 1 else shard) * 4
        st.master = shard * 4 if half else 0
        st.optimizer = opt_shard
        if s.contiguous_gradients:  # double-buffered with overlap_comm, except in ZeRO-3
            st.buckets = (
                (2 if s.overlap_comm and stage < 3 else 1) * s.reduce_bucket_size * num.grad
            )
        notes["buckets"] = f"ZeRO gradient bucket: {s.reduce_bucket_size:,} elements" + (
            " x 2 (overlap_comm)" if s.overlap_comm and stage < 3 else ""
        )
        if stage == 3:
            st.gathered = 4 * inv.largest_module_numel
            notes["gathered"] = "largest layer gathered + its gradient (DeepSpeed's 4 x rule)"
        if s.offload_optimizer:
            cpu = st.master + st.optimizer + shard * 4
            st.grads = 0 if stage >= 2 else P * num.grad
            notes["grads"] = (
                "reduced straight into CPU buffers" if stage >= 2 else "fp32 partition on the CPU"
            )
            notes["master"] = "on the CPU (offload)"
            st.master = st.optimizer = 0
            if s.offload_params:
                cpu += st.params
                st.params = 0
            st.cpu = cpu
            notes["cpu"] = "offloaded: fp32 master, Adam moments, fp32 gradients" + (
                ", 16-bit parameters" if s.offload_params else ""
            )
    # RoPE tables: fp32 buffers, cast with the module under 16-bit "true" precision/DeepSpeed.
    st.buffers = buffer_numel(setup.gpt) * (2 if num.param == 2 else 4)
    st.notes = notes
    return st
