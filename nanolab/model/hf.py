"""Hugging Face GPT-2 folders <-> nanolab's :class:`~nanolab.model.GPT`: architecture and weights.

GPT-2 (OpenAI's checkpoints, ``transformers``' ``GPT2LMHeadModel``) is the network nanolab's GPT
builds with its GPT-2 settings: learned positions, pre-LayerNorm blocks with biases, GELU with the
tanh approximation, LayerNorm eps 1e-5, a head tied to the token embedding. Only names and one
layout differ: GPT-2's ``Conv1D`` layers store a linear weight as (in, out), the transpose of
``nn.Linear``. So an import is a renaming plus four transposes, and so is an export.

Everything here reads and writes local files. No name is ever looked up on the Hub: a path that
is not a folder is refused with the line that says where to put the files.

Two things an export records so an import restores them (``config.json``'s ``nanolab`` entry):
the unpadded vocabulary (nanolab pads the embedding to a multiple of ``vocab_multiple`` rows, and
those rows are exported as they are, so logits match over every id; ``generation_config.json``
keeps ``generate`` from sampling them) and the data's tokenizer.
"""

from __future__ import annotations

import json
import re
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanolab.home import expand_user
from nanolab.model import exported
from nanolab.model.config import ConfigError, GPTConfig

if TYPE_CHECKING:  # torch is imported where tensors are handled: `nanolab estimate` reads
    import torch  # an init_from folder's config.json without paying for it

#: GELU variants that are the tanh approximation nanolab's MLP computes (activation gelu_tanh).
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
#: The activation an export writes: the very kernel nanolab uses (``F.gelu(approximate="tanh")``).
EXPORT_ACTIVATION = "gelu_pytorch_tanh"
#: transformers' name of the exact GELU (``model.gpt.activation: gelu``).
EXACT_GELU = "gelu"
#: ``config.json`` entry where ``nanolab export`` records what GPT-2's config cannot say.
RECORD_KEY = "nanolab"
#: Architecture keys that come from the checkpoint; a user value that disagrees is an error.
#: A nanolab export's, but ``rope_base`` (GPT-2 has no RoPE; Llama's is read on its own).
ARCHITECTURE_KEYS = tuple(k for k in exported.ARCHITECTURE_KEYS if k != "rope_base")

#: (name, transposed by Conv1D) of the tensors of block ``i``: nanolab's and GPT-2's names agree.
_BLOCK_TENSORS = tuple(
    (f"{layer}.{kind}", kind == "weight" and not layer.startswith("ln_"))
    for layer in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj")
    for kind in ("weight", "bias")
)
#: Old GPT-2 checkpoints store each block's causal mask as a buffer; it is not a weight.
_MASK_BUFFER = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")


class HFFormatError(ConfigError):
    """A Hugging Face folder (or an export target) that cannot be used; one line with the fix."""


# -- the folder and its config -----------------------------------------------------------------
def hf_folder(path: str | Path, field: str = "model.init_from") -> Path:
    """The local folder ``path`` names; a Hub name or a missing path is refused (no network)."""
    folder = expand_user(str(path), field=field)
    if folder.is_dir():
        return folder
    if folder.exists():
        raise HFFormatError(
            f"{field} {path}: is a file; give the folder that holds config.json and "
            "model.safetensors (or pytorch_model.bin)"
        )
    name = str(path) if re.fullmatch(r"[A-Za-z0-9][\w.-]*", str(path)) else "gpt2"  # a Hub name
    raise HFFormatError(
        f"{field} {path!r}: no such folder, and nanolab never downloads (no Hub names): put the "
        "model's config.json, model.safetensors (or pytorch_model.bin) and tokenizer.json in a "
        f"folder (e.g. `hf download {name} --local-dir models/{name}` on a machine with "
        f"network) and pass that folder: {field} models/{name}"
    )


def read_hf_config(folder: Path, field: str = "model.init_from") -> dict[str, Any]:
    """``config.json`` of a GPT-2 folder; anything else (no file, not JSON, not GPT-2) refused."""
    path = folder / "config.json"
    if not path.is_file() and (folder / "nanolab.json").is_file():
        raise HFFormatError(
            f"{field} {folder}: is a `nanolab export --format safetensors` folder, which "
            "model.init_from reads but this command does not: give a Hugging Face folder "
            "(--format hf)"
        )
    if not path.is_file():
        raise HFFormatError(
            f"{field} {folder}: has no config.json; give a Hugging Face model folder "
            "(what save_pretrained writes)"
        )
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HFFormatError(f"{field} {path}: is not readable JSON ({err})") from None
    if not isinstance(config, dict):
        raise HFFormatError(f"{field} {path}: must hold a JSON object")
    model_type = config.get("model_type")
    if model_type not in ("gpt2", "llama"):
        raise HFFormatError(
            f"{field} {folder}: model_type is {model_type!r}, but nanolab imports GPT-2 "
            "('gpt2': learned positions, GELU, biases) and Llama ('llama': RoPE, RMSNorm, "
            "SwiGLU, no biases); give a folder of one of them"
        )
    return config


def _llama_architecture(config: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The :class:`GPTConfig` fields of a Llama ``config.json``, after refusing what nanolab's
    RoPE + RMSNorm + SwiGLU GPT does not compute."""
    from nanolab.model.gpt import swiglu_hidden
    from nanolab.model.llama import architecture_from_llama, rope_of_llama

    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "vocab_size", "max_position_embeddings"):  # fmt: skip
        _int_key(config, key, folder)
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    refusals = []
    if config.get("hidden_act", "silu") != "silu":
        refusals.append(f"hidden_act {config.get('hidden_act')!r} (nanolab: silu)")
    eps = config.get("rms_norm_eps", 1e-6)
    if not isinstance(eps, int | float) or abs(float(eps) - 1e-5) > 1e-12:
        refusals.append(f"rms_norm_eps {eps!r} (nanolab: 1e-05)")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            refusals.append(f"{key} true (nanolab's Llama has no biases)")
    refusals += [f"{rope} (nanolab: plain RoPE)" for rope in rope_of_llama(config)[1]]
    if config.get("num_key_value_heads", heads) != heads:
        refusals.append("num_key_value_heads below num_attention_heads (grouped-query attention)")
    if config.get("head_dim", hidden // heads) != hidden // heads or hidden % heads:
        refusals.append("head_dim other than hidden_size / num_attention_heads")
    try:
        arch = architecture_from_llama(config)
    except (KeyError, ValueError, TypeError) as err:
        refusals.append(str(err))
        arch = {}
    if (
        arch
        and swiglu_hidden(GPTConfig(**{**arch, "vocab_size": 2})) != config["intermediate_size"]
    ):
        refusals.append(
            f"intermediate_size {config['intermediate_size']} (nanolab's SwiGLU width for "
            f"n_embd {hidden} is 2/3 x mlp_ratio x n_embd rounded up to 64)"
        )
    if refusals:
        raise HFFormatError(
            f"model.init_from {folder}: this Llama is not nanolab's GPT: {'; '.join(refusals)}"
        )
    return arch


def _int_key(config: dict[str, Any], key: str, folder: Path) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HFFormatError(
            f"model.init_from {folder}: config.json {key} must be a positive integer, got {value!r}"
        )
    return value


def architecture_from_hf(config: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The :class:`GPTConfig` fields a GPT-2 ``config.json`` describes (block size: its
    ``n_positions``), after refusing GPT-2 variants nanolab's GPT does not compute."""
    n_embd = _int_key(config, "n_embd", folder)
    refusals = []
    activation = config.get("activation_function", "gelu_new")
    if activation not in (*TANH_GELUS, EXACT_GELU):
        refusals.append(f"activation_function {activation!r} (nanolab: tanh or exact GELU)")
    eps = config.get("layer_norm_epsilon", 1e-5)
    if not isinstance(eps, (int, float)) or abs(float(eps) - 1e-5) > 1e-12:
        refusals.append(f"layer_norm_epsilon {eps!r} (nanolab: 1e-05)")
    if not config.get("scale_attn_weights", True):
        refusals.append("scale_attn_weights false (nanolab scales by 1/sqrt(head size))")
    if config.get("scale_attn_by_inverse_layer_idx", False):
        refusals.append("scale_attn_by_inverse_layer_idx true")
    if config.get("add_cross_attention", False):
        refusals.append("add_cross_attention true")
    n_inner = config.get("n_inner")
    if n_inner is not None and (not isinstance(n_inner, int) or n_inner % n_embd != 0):
        refusals.append(f"n_inner {n_inner!r} (nanolab: a multiple of n_embd {n_embd})")
    if refusals:
        raise HFFormatError(
            f"model.init_from {folder}: this GPT-2 variant is not nanolab's GPT: "
            f"{'; '.join(refusals)}"
        )
    vocab = _int_key(config, "vocab_size", folder)
    arch = {
        "n_layer": _int_key(config, "n_layer", folder),
        "n_head": _int_key(config, "n_head", folder),
        "n_embd": n_embd,
        "block_size": _int_key(config, "n_positions", folder),
        "vocab_size": vocab,
        "vocab_multiple": 1,  # every row of the checkpoint, no padding added
        "bias": True,
        "position_embedding": "learned",
        "tie_weights": bool(config.get("tie_word_embeddings", True)),
        "mlp_ratio": 4 if n_inner is None else n_inner // n_embd,
        "activation": "gelu" if activation == EXACT_GELU else "gelu_tanh",
        "norm": "layernorm",
        "mlp": "gelu",
        "attention_variant": "causal",
    }
    record = config.get(RECORD_KEY)
    if isinstance(record, dict):
        # A nanolab export: its padded vocabulary rows, with the tokenizer's vocabulary.
        size, multiple = record.get("vocab_size"), record.get("vocab_multiple")
        valid = isinstance(size, int) and isinstance(multiple, int) and size >= 2 and multiple >= 1
        if valid and ((size + multiple - 1) // multiple) * multiple == vocab:
            arch["vocab_size"], arch["vocab_multiple"] = size, multiple
    if n_embd % arch["n_head"] != 0:
        raise HFFormatError(
            f"model.init_from {folder}: config.json n_embd {n_embd} is not divisible by "
            f"n_head {arch['n_head']}"
        )
    return arch


def resolve_architecture(gpt: dict[str, Any], init_from: str | Path) -> dict[str, Any]:
    """``gpt`` (the user's ``model.gpt``) with the architecture of the GPT-2 in ``init_from``.

    A key left at its default takes the checkpoint's value; a key set to another value is an
    error naming both. ``block_size`` stays the user's (the context to train on): it may be
    shorter than the checkpoint's ``n_positions`` (the position table is cut), not longer.
    """
    folder = hf_folder(init_from)
    info = exported.exported_info(folder)
    config = {} if info is not None else read_hf_config(folder)
    keys: tuple[str, ...] = ARCHITECTURE_KEYS
    if info is not None:  # nanolab's own export: any nanolab model
        imported = exported.exported_architecture(info)
        keys = exported.ARCHITECTURE_KEYS
    elif config.get("model_type") == "llama":
        imported = _llama_architecture(config, folder)
        keys = (*(k for k in ARCHITECTURE_KEYS if k != "activation"), "rope_base")  # SwiGLU: silu
    else:
        imported = architecture_from_hf(config, folder)
    defaults = {f.name: f.default for f in fields(GPTConfig)}
    resolved = dict(gpt)
    for key in keys:
        given = resolved.get(key, defaults[key])
        if given != defaults[key] and given != imported[key]:
            raise HFFormatError(
                f"model.gpt.{key} is {given!r} but the checkpoint in {folder} has "
                f"{imported[key]!r}; leave model.gpt.{key} out (the architecture comes from "
                f"model.init_from) or set it to {imported[key]!r}"
            )
        resolved[key] = imported[key]
    block = resolved.get("block_size", defaults["block_size"])
    # A learned table has no rows past its length; RoPE of a nanolab export has no limit.
    if block > imported["block_size"] and (
        info is None or resolved["position_embedding"] == "learned"
    ):
        where = "nanolab.json block_size" if info is not None else "config.json n_positions"
        raise HFFormatError(
            f"model.gpt.block_size {block} is longer than the checkpoint's {imported['block_size']} "
            f"positions ({folder} {where}); set model.gpt.block_size to "
            f"{imported['block_size']} or less"
        )
    return resolved


# -- reading weights ---------------------------------------------------------------------------
def read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's ``model.safetensors`` (single or sharded) or, failing that,
    ``pytorch_model.bin`` read with ``weights_only=True``: a pickle that asks for anything but
    tensors is refused, never run."""
    import safetensors.torch as st
    import torch

    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if single.is_file() or index.is_file():
        files = [single]
        if not single.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                files = [folder / name for name in sorted(set(weight_map.values()))]
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
                raise HFFormatError(f"model.init_from {index}: not a shard index ({err})") from None
        state: dict[str, torch.Tensor] = {}
        for path in files:
            try:
                state.update(st.load_file(str(path), device="cpu"))
            except Exception as err:  # safetensors raises its own error types
                first = str(err).strip().splitlines()[0] if str(err).strip() else ""
                raise HFFormatError(
                    f"model.init_from {path}: not a readable safetensors file "
                    f"({type(err).__name__}: {first[:160]})"
                ) from None
        return state
    binary = folder / "pytorch_model.bin"
    if not binary.is_file():
        raise HFFormatError(
            f"model.init_from {folder}: has neither model.safetensors nor pytorch_model.bin; "
            "copy the model's weights file next to its config.json"
        )
    try:
        state = torch.load(binary, map_location="cpu", weights_only=True)
    except Exception as err:
        found = re.search(r"(?:unsupported|Unsupported global:) GLOBAL ([\w.]+)", str(err))
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        why = f"its pickle calls {found.group(1)}" if found else first[:160]
        raise HFFormatError(
            f"model.init_from {binary}: refused, it is not plain tensors ({why}); nanolab never "
            "runs code from a checkpoint: convert it to model.safetensors on a machine you trust"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise HFFormatError(
            f"model.init_from {binary}: does not hold a state dict of tensors; give the weights "
            "file save_pretrained writes"
        )
    return state


# -- the mapping -------------------------------------------------------------------------------
def gpt_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor in :class:`~nanolab.model.GPT`'s state dict, from the config
    alone (building the model on the meta device would import torch's compiler, seconds).
    tests/test_hf.py holds it equal to the real model's for every option that changes it."""
    C, H, V = config.n_embd, config.mlp_ratio * config.n_embd, config.padded_vocab_size
    bias = config.bias and config.norm == "layernorm"  # RMSNorm has no bias
    norm = {"weight": (C,), "bias": (C,)} if bias else {"weight": (C,)}
    fc = (H, C)
    if config.mlp == "swiglu":  # gate and up stacked, each of SwiGLU's own width
        from nanolab.model.gpt import swiglu_hidden

        H = swiglu_hidden(config)
        fc = (2 * H, C)
    linears = {
        "attn.c_attn": (3 * C, C),
        "attn.c_proj": (C, C),
        "mlp.c_fc": fc,
        "mlp.c_proj": (C, H),
    }
    shapes: dict[str, tuple[int, ...]] = {"wte.weight": (V, C)}
    if config.position_embedding == "learned":
        shapes["wpe.weight"] = (config.block_size, C)
    for i in range(config.n_layer):
        for ln in ("ln_1", "ln_2"):
            shapes.update({f"blocks.{i}.{ln}.{k}": v for k, v in norm.items()})
        for name, (out, into) in linears.items():
            shapes[f"blocks.{i}.{name}.weight"] = (out, into)
            if config.bias:
                shapes[f"blocks.{i}.{name}.bias"] = (out,)
        if config.attention_variant == "qk_norm":
            for qk in ("q_norm", "k_norm"):
                shapes[f"blocks.{i}.attn.{qk}.weight"] = (config.head_dim,)
    shapes.update({f"ln_f.{k}": v for k, v in norm.items()})
    shapes["lm_head.weight"] = (V, C)
    return shapes


def _pairs(config: GPTConfig) -> list[tuple[str, str, bool]]:
    """(nanolab name, GPT-2 name without ``transformer.``, transposed) for every tensor."""
    pairs = [("wte.weight", "wte.weight", False), ("wpe.weight", "wpe.weight", False)]
    for i in range(config.n_layer):
        pairs += [(f"blocks.{i}.{a}", f"h.{i}.{a}", t) for a, t in _BLOCK_TENSORS]
    pairs += [("ln_f.weight", "ln_f.weight", False), ("ln_f.bias", "ln_f.bias", False)]
    return pairs


def nanolab_state_from_hf(
    hf_state: dict[str, torch.Tensor], config: GPTConfig, source: str | Path
) -> dict[str, torch.Tensor]:
    """GPT-2 tensors renamed, un-transposed and checked against ``config``'s shapes: a state dict
    :class:`~nanolab.model.GPT` loads. The position table keeps the first ``block_size`` rows."""
    if config.position_embedding != "learned" or not config.bias:
        raise HFFormatError("GPT-2 weights need position_embedding 'learned' and bias true")
    named = {
        (k[len("transformer.") :] if k.startswith("transformer.") else k): v
        for k, v in hf_state.items()
    }
    expected = gpt_shapes(config)
    state: dict[str, torch.Tensor] = {}
    used = set()
    for ours, theirs, transposed in _pairs(config):
        if theirs not in named:
            raise HFFormatError(
                f"model.init_from {source}: the weights have no tensor {theirs}; the file does "
                "not belong to this config.json"
            )
        tensor = named[theirs]
        used.add(theirs)
        if transposed and tensor.dim() == 2:
            tensor = tensor.t()
        if ours == "wpe.weight" and tensor.dim() == 2:
            tensor = tensor[: config.block_size]
        if tuple(tensor.shape) != expected[ours]:
            shape = tuple(named[theirs].shape)
            want = expected[ours][::-1] if transposed else expected[ours]
            raise HFFormatError(
                f"model.init_from {source}: tensor {theirs} has shape {list(shape)} but "
                f"config.json implies {list(want)}; the weights and config.json disagree"
            )
        state[ours] = tensor
    used.add("lm_head.weight")  # tied: the same matrix as wte (some files store it twice)
    state["lm_head.weight"] = state["wte.weight"]
    if not config.tie_weights:
        if "lm_head.weight" not in named:
            raise HFFormatError(
                f"model.init_from {source}: tie_word_embeddings is false but there is no "
                "lm_head.weight"
            )
        head = state["lm_head.weight"] = named["lm_head.weight"]
        if tuple(head.shape) != expected["lm_head.weight"]:
            raise HFFormatError(
                f"model.init_from {source}: lm_head.weight has shape "
                f"{list(head.shape)}, expected {list(expected['lm_head.weight'])}"
            )
    extra = sorted(k for k in named if k not in used and not _MASK_BUFFER.match(k))
    if extra:
        raise HFFormatError(
            f"model.init_from {source}: the weights hold tensors GPT-2's language model does not "
            f"have ({', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''}); give a "
            "GPT2LMHeadModel folder"
        )
    return state


def hf_state_from_nanolab(
    state: dict[str, torch.Tensor], config: GPTConfig
) -> dict[str, torch.Tensor]:
    """nanolab's GPT tensors under GPT-2's names and layout (``transformer.`` prefix, Conv1D
    weights transposed). A model trained without biases gets zero biases: the same function."""
    import torch

    hf: dict[str, torch.Tensor] = {}
    for ours, theirs, transposed in _pairs(config):
        if ours in state:
            tensor = state[ours]
            hf[f"transformer.{theirs}"] = (tensor.t() if transposed else tensor).contiguous()
        elif ours.endswith(".bias") and not config.bias:
            weight = state[ours.removesuffix("bias") + "weight"]  # (out, in) or (width,)
            hf[f"transformer.{theirs}"] = torch.zeros(weight.shape[0], dtype=weight.dtype)
        else:
            raise HFFormatError(f"the checkpoint has no tensor {ours}; it is not nanolab's GPT")
    if not config.tie_weights:
        hf["lm_head.weight"] = state["lm_head.weight"].contiguous()
    return hf


def export_refusals(config: GPTConfig) -> list[str]:
    """Options transformers' GPT-2 cannot compute, each with what to do instead."""
    refusals = []
    if config.position_embedding != "learned":
        refusals.append(
            f"model.gpt.position_embedding {config.position_embedding!r} (GPT-2 has learned "
            "positions)"
        )
    gpt2 = {"norm": "layernorm", "mlp": "gelu", "attention_variant": "causal"}
    for key, theirs in gpt2.items():
        if getattr(config, key) != theirs:
            refusals.append(f"model.gpt.{key} {getattr(config, key)!r} (GPT-2 has {theirs!r})")
    if config.attention_window is not None:
        refusals.append(
            f"model.gpt.attention_window {config.attention_window} (GPT-2 attends to the whole "
            "context)"
        )
    return refusals


def hf_config_from_nanolab(
    config: GPTConfig, eot_id: int | None, dtype: torch.dtype, record: dict[str, Any]
) -> dict[str, Any]:
    """A GPT-2 ``config.json`` for ``config``; ``record`` is kept under ``nanolab``."""
    hidden = config.mlp_ratio * config.n_embd
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.padded_vocab_size,
        "n_positions": config.block_size,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None if config.mlp_ratio == 4 else hidden,
        "activation_function": EXPORT_ACTIVATION
        if config.activation == "gelu_tanh"
        else EXACT_GELU,
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "use_cache": True,
        "tie_word_embeddings": config.tie_weights,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
        RECORD_KEY: {
            **record,
            "vocab_size": config.vocab_size,
            "vocab_multiple": config.vocab_multiple,
        },
    }


def generation_config_from_nanolab(config: GPTConfig, eot_id: int | None) -> dict[str, Any] | None:
    """``generation_config.json`` of an export whose vocabulary is padded: the padding ids
    suppressed, so transformers' ``generate`` samples from the real vocabulary only, as
    ``nanolab generate`` does (the padding rows stay in the weights: the logits, and so
    log-likelihoods, are nanolab's own over every id, and an import restores every tensor).
    None without padding (transformers' defaults from ``config.json`` then serve)."""
    if config.padded_vocab_size == config.vocab_size:
        return None
    ends = {"bos_token_id": eot_id, "eos_token_id": eot_id} if eot_id is not None else {}
    return {
        **ends,
        "suppress_tokens": list(range(config.vocab_size, config.padded_vocab_size)),
    }


def load_hf_weights(model: torch.nn.Module, init_from: str | Path) -> None:
    """Copy the GPT-2 weights in folder ``init_from`` into ``model`` (built for them)."""
    import torch

    folder = hf_folder(init_from)
    info = exported.exported_info(folder)
    if info is not None:
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        state = exported.exported_state(folder, info, expected)
    elif read_hf_config(folder).get("model_type") == "llama":
        from nanolab.model.llama import nanolab_state_from_llama

        try:
            state = nanolab_state_from_llama(read_hf_weights(folder), model.config)
        except (KeyError, RuntimeError) as err:
            raise HFFormatError(
                f"model.init_from {folder}: the weights do not fit its config.json ({err})"
            ) from None
    else:
        state = nanolab_state_from_hf(read_hf_weights(folder), model.config, folder)
    with torch.no_grad():
        model.load_state_dict(state)


def apply_init_from(model_cfg: Any) -> None:
    """Write the architecture of ``model_cfg.init_from`` into ``model_cfg.gpt`` (the parsed
    ``model`` section of ``nanolab fit``), before the data, batch and memory plans read it."""
    gpt = model_cfg.gpt
    current = {f.name: gpt.get(f.name, f.default) for f in fields(GPTConfig)}
    for key, value in resolve_architecture(current, model_cfg.init_from).items():
        setattr(gpt, key, value)
    folder = hf_folder(model_cfg.init_from)
    info = exported.exported_info(folder)
    line = exported.attention_note(folder, info, current) if info is not None else None
    if line is not None:
        from nanolab.messages import note
        from nanolab.processes import global_rank_from_env

        if global_rank_from_env() == 0:
            note("nanolab", line)
