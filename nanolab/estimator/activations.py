"""What autograd keeps between forward and backward, tensor by tensor, for ``nanolab.model.GPT``.

Each entry below is one storage that a backward formula saves, in the order the forward makes
it. Views share storage and are counted once (q, k and v are views of the ``c_attn`` output; the
flash kernel's output is laid out so that ``c_proj``'s input is a view of it). Parameters are not
activations (they are counted with the model states), but autocast's 16-bit copies of them are,
in their own group. The numbers are validated against ``torch.autograd.graph.saved_tensors_hooks``
on CPU (tests/test_estimator_activations.py) for both attention paths, dropout, RoPE,
checkpointing and the precisions.

The block rules hold for GPT-2's block (LayerNorm, causal attention, GELU MLP: exactly these
classes, not subclasses). A block built from other registered variants, and a final norm other
than LayerNorm, are measured from the real module instead (:mod:`nanolab.estimator.derived`).

Shapes: B micro-batch, T sequence, C width, H heads, D = C/H, F = mlp_ratio·C, V padded vocab.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nanolab.estimator.derived import saved_bytes
from nanolab.estimator.numerics import Numerics
from nanolab.estimator.shapes import Inventory, inventory
from nanolab.model.config import GPTConfig

INT64 = 8


@dataclass
class Saved:
    """Saved storages by group, in bytes (``items`` keeps the per-tensor detail)."""

    embed: dict[str, int] = field(default_factory=dict)
    block: dict[str, int] = field(default_factory=dict)  # one block, not checkpointed
    checkpoint_input: int = 0  # one block's saved input when checkpointed
    head: dict[str, int] = field(default_factory=dict)  # final norm + lm_head input
    loss: dict[str, int] = field(default_factory=dict)
    block_weight_copies: int = 0  # autocast copies of one block's Linear weights
    head_weight_copy: int = 0  # autocast copy of the lm_head weight
    n_layer: int = 1
    checkpointing: bool = False

    @property
    def per_block(self) -> int:
        """Bytes one block keeps until its backward (its input only, when checkpointed)."""
        return self.checkpoint_input if self.checkpointing else sum(self.block.values())

    @property
    def blocks(self) -> int:
        return self.n_layer * self.per_block

    @property
    def weight_copies(self) -> int:
        """Autocast weight copies alive at the end of the forward."""
        blocks = 0 if self.checkpointing else self.n_layer * self.block_weight_copies
        return blocks + self.head_weight_copy

    @property
    def recompute_block(self) -> int:
        """What re-running one checkpointed block creates in the backward pass."""
        if not self.checkpointing:
            return 0
        return sum(self.block.values()) + self.block_weight_copies

    @property
    def total(self) -> int:
        """Every saved storage: what ``saved_tensors_hooks`` would count (no recompute)."""
        parts = (self.embed, self.head, self.loss)
        return sum(sum(p.values()) for p in parts) + self.blocks + self.weight_copies


def _mask(n: int, dtype_bytes: int, num: Numerics) -> int:
    return n * (1 if num.dropout_mask_bool else dtype_bytes)


def saved_activations(
    gpt: GPTConfig,
    batch: int,
    seq_len: int | None = None,
    num: Numerics | None = None,
    *,
    checkpointing: bool | None = None,
) -> Saved:
    """Storages autograd saves for one training forward of ``GPT(gpt)`` on ``batch`` sequences.

    ``checkpointing`` defaults to ``gpt.gradient_checkpointing``; ``num`` to fp32 on CUDA.
    """
    if num is None:
        num = Numerics(4, 4, 4, 4, 4, 4, 4, 4, False, False, False, True, False, 4)
    B, T = batch, gpt.block_size if seq_len is None else seq_len
    C, H, V = gpt.n_embd, gpt.n_head, gpt.padded_vocab_size
    D, F = gpt.head_dim, gpt.mlp_ratio * gpt.n_embd
    BT, BTC = B * T, B * T * C
    c, r = num.compute, num.resid
    drop = gpt.dropout > 0
    rope = gpt.position_embedding == "rope"
    ckpt = gpt.gradient_checkpointing if checkpointing is None else checkpointing
    s = Saved(n_layer=gpt.n_layer, checkpointing=ckpt)

    # -- embeddings: the token ids (embedding backward), positions, dropout mask.
    s.embed["token ids"] = BT * INT64
    if gpt.position_embedding == "learned":
        s.embed["position ids"] = T * INT64
    if drop:
        s.embed["dropout mask"] = _mask(BTC, r, num)

    # -- one block: the rules below when it is GPT-2's, else measured from the real module.
    inv = inventory(gpt)
    blk = s.block
    s.checkpoint_input = BTC * r
    if num.weight_copies:
        s.block_weight_copies = inv.block_matmul_numel(0) * c
        s.head_weight_copy = V * C * c
    if not rules_describe_block(inv):
        traced = saved_bytes(gpt, "block", B, T, num) - s.block_weight_copies
        blk["block, measured from the module (fake-tensor trace)"] = max(0, traced)
        _head_and_loss(s, gpt, inv, B, T, num)
        return s
    blk["ln_1 input"] = BTC * num.ln_in
    blk["ln_1 mean+rstd"] = 2 * BT * num.ln_stats
    blk["c_attn input"] = BTC * c
    rope_tables = 4 * T * (D // 2) * c if (rope and num.rope_table_copies) else 0
    # A document mask differs per row; a window alone is one (T, T) mask for every row.
    mask_rows = B if gpt.document_mask else 1
    if gpt.masks_attention and num.gpu and gpt.attention != "math" and not drop:
        # FlexAttention on a GPU: a block mask of a few KB; q, k, v, output and log-sum-exp
        # as a fused kernel saves them (the rules below).
        pass
    elif gpt.masks_attention and gpt.attention != "math":
        # SDPA with a boolean mask turns it into an additive one in q's dtype, per block.
        blk["attention mask (additive copy)"] = mask_rows * T * T * c
    if gpt.attention in ("sdpa", "flex") and not (drop and num.sdpa_dropout_math):
        # Fused (flash / memory-efficient) kernel: q, k, v, the output and the row
        # log-sum-exp (fp32); never the T x T scores. Dropout is regenerated from its seed.
        blk["q,k,v (c_attn output)"] = 3 * BTC * c
        if rope:
            blk["rotated q, k"] = 2 * BTC * c
            blk["rope cos/sin casts"] = rope_tables
        blk["attention output"] = BTC * c
        blk["softmax log-sum-exp"] = B * H * T * 4
        if rope and H > 1:
            # The kernel lays its output out like q: (B, H, T, D) when q is the rotated copy, so
            # c_proj's (B, T, C) input is a transposed copy. Without RoPE it is a free view.
            blk["c_proj input (transposed copy)"] = BTC * c
    else:
        scores = B * H * T * T
        if gpt.attention == "sdpa":
            # CPU SDPA with dropout: the math fallback upcasts to fp32 and saves scaled q, k^T
            # and v copies, the softmax, the dropout mask (fp32) and the dropped-out scores.
            # (v stays a view of the fp32 c_attn output when B or H is 1; see the math path.)
            v = 3 * BTC * 4 if (c == 4 and (B == 1 or H == 1)) else BTC * 4
            blk["q, k^T, v copies (fp32)"] = 2 * BTC * 4 + v
            if rope:
                blk["rope cos/sin casts"] = rope_tables
            blk["softmax (fp32)"] = scores * 4
            blk["attention dropout mask"] = scores * 4
            blk["dropped-out probabilities"] = scores * 4
        else:
            # Spelled-out attention: matmul copies q (or saves rotated q), k^T and v to
            # contiguous tensors; the causal mask; the softmax output; the probabilities the
            # value matmul reads (a 16-bit cast or the dropout output, else the softmax itself).
            # A (B, H, T, D) view of the c_attn output folds into a bmm batch without a copy only
            # when B or H is 1; then the bmm saves the whole q,k,v storage instead.
            if rope:
                v = BTC * c if (B > 1 and H > 1) else 3 * BTC * c
                blk["rotated q, k; v operand"] = 2 * BTC * c + v
            else:
                blk["q, k^T, v matmul operands"] = 3 * BTC * c
            if rope:
                blk["rope cos/sin casts"] = rope_tables
            blk["causal mask (bool)"] = mask_rows * T * T
            blk["softmax output"] = scores * num.softmax
            if drop:
                blk["attention dropout mask"] = _mask(scores, num.softmax, num)
            if drop or num.softmax != c:
                blk["probabilities for @v"] = scores * c
        blk["attention output (c_proj input copy)"] = BTC * c
    if drop:
        blk["attn residual dropout mask"] = _mask(BTC, c, num)
    blk["ln_2 input"] = BTC * num.ln_in
    blk["ln_2 mean+rstd"] = 2 * BT * num.ln_stats
    blk["c_fc input"] = BTC * c
    blk["GELU input"] = B * T * F * c
    blk["mlp c_proj input"] = B * T * F * c
    if drop:
        blk["mlp residual dropout mask"] = _mask(BTC, c, num)
    for k in [k for k, v in blk.items() if v == 0]:
        del blk[k]
    _head_and_loss(s, gpt, inv, B, T, num)
    return s


#: The classes the block rules above were written for (a subclass is another model).
RULED_CLASSES = frozenset(
    {
        "nanolab.model.gpt.LayerNorm",
        "nanolab.model.gpt.CausalSelfAttention",
        "nanolab.model.gpt.RotaryEmbedding",
        "nanolab.model.gpt.MLP",
        "torch.nn.modules.linear.Linear",
        "torch.nn.modules.dropout.Dropout",
    }
)
LAYER_NORM = "nanolab.model.gpt.LayerNorm"


def rules_describe_block(inv: Inventory) -> bool:
    """Whether a block of this model is made only of the classes the rules describe."""
    return all(cls in RULED_CLASSES for _, cls in inv.block_parts)


def _head_and_loss(s: Saved, gpt: GPTConfig, inv: Inventory, B: int, T: int, num: Numerics) -> None:
    """Final norm (rules for LayerNorm, else measured), the head's input, the loss."""
    BT, BTC, V = B * T, B * T * gpt.n_embd, gpt.padded_vocab_size
    if inv.final_norm == LAYER_NORM:
        s.head["ln_f input"] = BTC * num.ln_in
        s.head["ln_f mean+rstd"] = 2 * BT * num.ln_stats
    else:
        s.head["final norm, measured from the module"] = saved_bytes(gpt, "final_norm", B, T, num)
    s.head["lm_head input"] = BTC * num.compute
    if num.compiled_loss:
        # Inductor's fused loss recomputes the log-softmax in the backward from these.
        s.loss["logits (the compiled loss's input)"] = BT * V * num.compute
        s.loss["row max + log-sum-exp (fp32)"] = 2 * BT * 4
    else:
        s.loss["log-softmax"] = BT * V * num.loss
        if num.gpu_autocast_loss:
            s.loss["16-bit logits (autocast on a GPU)"] = BT * V * num.compute
    s.loss["targets"] = BT * INT64
    s.loss["loss weight scalar"] = num.loss


@dataclass
class LossTransient:
    """Short-lived logits tensors around the loss, beyond the saved log-softmax."""

    logits: int  # B·T·V in the compute dtype (the model's output)
    fp32_copy: int  # the loss's fp32 cast of it (autocast)
    backward: int  # d(log-softmax) and d(logits) in fp32 while the log-softmax backward runs

    @property
    def forward_peak(self) -> int:
        return self.logits + self.fp32_copy

    @property
    def peak(self) -> int:
        return max(self.forward_peak, self.backward)


def loss_transient(gpt: GPTConfig, batch: int, seq_len: int | None, num: Numerics) -> LossTransient:
    """Logits memory around ``F.cross_entropy`` beyond what autograd saves.

    Forward: the logits (compute dtype) and, under autocast, their fp32 copy exist together with
    the saved log-softmax. Backward: the log-softmax backward reads the incoming gradient and
    writes d(logits), both B·T·V in the loss dtype, while the saved log-softmax is still alive.
    """
    T = gpt.block_size if seq_len is None else seq_len
    btv = batch * T * gpt.padded_vocab_size
    if num.compiled_loss:
        # Measured on a GPU (Numerics.compiled_loss): nothing beyond the saved logits in the
        # forward; the backward holds one fp32 B·T·V gradient, as eager's does.
        return LossTransient(logits=0, fp32_copy=0, backward=btv * 4)
    if num.gpu_autocast_loss:
        # Measured on a GPU (Numerics.gpu_autocast_loss): the logits are saved, not transient;
        # the forward peaks one 16-bit B·T·V above its end, the backward one fp32 B·T·V.
        return LossTransient(logits=btv * num.compute, fp32_copy=0, backward=btv * 4)
    return LossTransient(
        logits=btv * num.compute,
        fp32_copy=btv * 4 if num.fp32_logits_copy else 0,
        backward=2 * btv * num.loss,
    )
