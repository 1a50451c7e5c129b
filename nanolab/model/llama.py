"""nanolab's modern variant as transformers' ``LlamaForCausalLM``, and back.

A GPT with RoPE, RMSNorm, a SwiGLU MLP and no biases *is* the Llama architecture: the same
blocks (pre-norm, attention and gated MLP on residual branches), the same norm (``x /
rms(x) * g``, eps 1e-5), the same rotary frequencies (``base^(-2i/D)``). What differs is naming
and two layouts:

* nanolab keeps q, k, v in one ``c_attn`` matrix and SwiGLU's gate and up in one ``c_fc``;
  Llama has ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj``;
* nanolab rotates neighbouring pairs of a head's dimensions (0,1), (2,3), ...; transformers
  rotates dimension i with i + D/2 (``rotate_half``). The rows of ``q_proj`` and ``k_proj`` are
  permuted per head to match (the dot products q . k are unchanged: both get the same order).

Anything else (QK-norm, ReLU², GELU, learned positions, LayerNorm, biases) is not Llama and is
refused by :func:`llama_refusals`, each with its reason; GPT-2-shaped models export as GPT-2
(:mod:`nanolab.model.hf`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nanolab.model.config import GPTConfig

if TYPE_CHECKING:
    import torch

#: What each ``model.gpt`` setting must be for the Llama architecture.
LLAMA = {
    "position_embedding": "rope",
    "norm": "rmsnorm",
    "mlp": "swiglu",
    "attention_variant": "causal",
}


def llama_refusals(config: GPTConfig) -> list[str]:
    """The settings Llama cannot compute, each named with what Llama has."""
    out = [
        f"model.gpt.{key} {getattr(config, key)!r} (Llama has {value!r})"
        for key, value in LLAMA.items()
        if getattr(config, key) != value
    ]
    if config.bias:
        out.append("model.gpt.bias true (Llama has no biases)")
    if config.attention_window is not None:
        out.append(
            f"model.gpt.attention_window {config.attention_window} (Llama attends to the "
            "whole context)"
        )
    return out


def _to_half_split(w: torch.Tensor, heads: int, inverse: bool = False) -> torch.Tensor:
    """Rows of a q/k projection from nanolab's interleaved pairs to rotate_half's halves
    (``inverse``: back)."""
    rows, cols = w.shape
    pairs = (2, rows // heads // 2) if inverse else (rows // heads // 2, 2)
    return w.view(heads, *pairs, cols).transpose(1, 2).reshape(rows, cols)


def llama_state_from_nanolab(
    state: dict[str, torch.Tensor], config: GPTConfig
) -> dict[str, torch.Tensor]:
    """nanolab's tensors under ``LlamaForCausalLM``'s names and layouts."""
    C, H = config.n_embd, config.n_head
    out = {
        "model.embed_tokens.weight": state["wte.weight"],
        "model.norm.weight": state["ln_f.weight"],
    }
    for i in range(config.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        q, k, v = state[ours + "attn.c_attn.weight"].split(C, dim=0)
        gate, up = state[ours + "mlp.c_fc.weight"].chunk(2, dim=0)
        out.update({
            theirs + "input_layernorm.weight": state[ours + "ln_1.weight"],
            theirs + "self_attn.q_proj.weight": _to_half_split(q, H),
            theirs + "self_attn.k_proj.weight": _to_half_split(k, H),
            theirs + "self_attn.v_proj.weight": v,
            theirs + "self_attn.o_proj.weight": state[ours + "attn.c_proj.weight"],
            theirs + "post_attention_layernorm.weight": state[ours + "ln_2.weight"],
            theirs + "mlp.gate_proj.weight": gate,
            theirs + "mlp.up_proj.weight": up,
            theirs + "mlp.down_proj.weight": state[ours + "mlp.c_proj.weight"],
        })  # fmt: skip
    if not config.tie_weights:
        out["lm_head.weight"] = state["lm_head.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def nanolab_state_from_llama(
    llama: dict[str, torch.Tensor], config: GPTConfig
) -> dict[str, torch.Tensor]:
    """``LlamaForCausalLM`` tensors as nanolab's GPT state dict (the inverse of the export)."""
    import torch

    H = config.n_head
    state = {
        "wte.weight": llama["model.embed_tokens.weight"],
        "ln_f.weight": llama["model.norm.weight"],
    }
    for i in range(config.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        q = _to_half_split(llama[theirs + "self_attn.q_proj.weight"], H, inverse=True)
        k = _to_half_split(llama[theirs + "self_attn.k_proj.weight"], H, inverse=True)
        state.update({
            ours + "ln_1.weight": llama[theirs + "input_layernorm.weight"],
            ours + "attn.c_attn.weight": torch.cat((q, k, llama[theirs + "self_attn.v_proj.weight"])),
            ours + "attn.c_proj.weight": llama[theirs + "self_attn.o_proj.weight"],
            ours + "ln_2.weight": llama[theirs + "post_attention_layernorm.weight"],
            ours + "mlp.c_fc.weight": torch.cat(
                (llama[theirs + "mlp.gate_proj.weight"], llama[theirs + "mlp.up_proj.weight"])
            ),
            ours + "mlp.c_proj.weight": llama[theirs + "mlp.down_proj.weight"],
        })  # fmt: skip
    head = llama.get("lm_head.weight")
    state["lm_head.weight"] = state["wte.weight"] if config.tie_weights or head is None else head
    return state


def llama_config_from_nanolab(
    config: GPTConfig, eot_id: int | None, dtype: Any, record: dict[str, Any]
) -> dict[str, Any]:
    """A ``LlamaForCausalLM`` ``config.json`` for ``config``; ``record`` kept under ``nanolab``."""
    from nanolab.model.gpt import swiglu_hidden

    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.padded_vocab_size,
        "hidden_size": config.n_embd,
        "intermediate_size": swiglu_hidden(config),
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_head,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.block_size,
        "rms_norm_eps": 1e-5,
        "rope_theta": config.rope_base,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": config.dropout,
        "tie_word_embeddings": config.tie_weights,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "nanolab": {
            **record,
            "vocab_size": config.vocab_size,
            "vocab_multiple": config.vocab_multiple,
        },
    }


def rope_of_llama(config: dict[str, Any]) -> tuple[Any, list[str]]:
    """A Llama ``config.json``'s RoPE base (as written), and its RoPE types other than plain.

    transformers 4 writes a top-level ``rope_theta`` and, for a scaled RoPE, ``rope_scaling``
    (its type under ``rope_type``, or ``type`` in older files); transformers 5 writes both in
    ``rope_parameters`` (``{"rope_theta": ..., "rope_type": "default"}``) and neither at the
    top. Reading only one spelling would take the default base 10000 for a model trained with
    another, or import a scaled RoPE as a plain one: both compute other logits, silently.
    """
    theta = config.get("rope_theta", 10000.0)
    other: list[str] = []
    for key in ("rope_scaling", "rope_parameters"):
        params = config.get(key)
        if not params:
            continue
        if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
            other.append(f"{key} not one mapping of settings")  # e.g. one per layer type
            continue
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            other.append(f"{key} rope_type {kind!r}")
        theta = params.get("rope_theta", theta)
    return theta, other


def architecture_from_llama(config: dict[str, Any]) -> dict[str, Any]:
    """``model.gpt`` settings of a Llama ``config.json`` nanolab wrote (or one shaped alike)."""
    heads = int(config["num_attention_heads"])
    if int(config.get("num_key_value_heads", heads)) != heads:
        raise ValueError("grouped-query attention (num_key_value_heads < num_attention_heads)")
    mlp_ratio = max(1, round(3 * int(config["intermediate_size"]) / 2 / int(config["hidden_size"])))
    record = config.get("nanolab") or {}
    return {
        "vocab_size": int(record.get("vocab_size", config["vocab_size"])),
        "vocab_multiple": int(record.get("vocab_multiple", 1)),
        "block_size": int(config["max_position_embeddings"]),
        "n_layer": int(config["num_hidden_layers"]),
        "n_head": heads,
        "n_embd": int(config["hidden_size"]),
        "mlp_ratio": mlp_ratio,
        "bias": False,
        "tie_weights": bool(config.get("tie_word_embeddings", False)),
        "rope_base": float(rope_of_llama(config)[0]),
        **LLAMA,
    }
