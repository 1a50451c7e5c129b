"""``model.init_from`` a ``nanolab export --format safetensors`` folder: any nanolab model.

The Hugging Face formats (:mod:`nanolab.model.hf`) express GPT-2 and Llama shapes only; a model
with parts of its own (a registered attention, MLP or norm), RoPE with LayerNorm, a window, ...
exports as safetensors under nanolab's own tensor names plus ``nanolab.json`` (its ``GPTConfig``
and tokenizer). Starting a new run from that folder is how its weights move on: a fine-tune on
other data, a DeepSpeed run continued on another device count (converted to one file and
exported first), a model handed from one project to another.

The architecture comes from ``nanolab.json`` as from a Hugging Face ``config.json``: a key the
user left at its default takes the export's value, one set to another value is refused naming
both. What does not change the weights (the context length, dropout, the attention kernel,
document masking, a window, checkpointing) stays the user's; a learned position table is cut to
``block_size`` rows, never extended. A window or document mask the export was trained with and
the new run leaves out (or sets otherwise) is said in one note (:func:`attention_note`): the
weights load either way, but each token then attends to other tokens than it learned with.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanolab.model.config import ConfigError, GPTConfig

if TYPE_CHECKING:
    import torch

INFO_NAME = "nanolab.json"

#: ``GPTConfig`` keys an export fixes: the ones that shape the weights or what they compute.
ARCHITECTURE_KEYS = (
    "n_layer",
    "n_head",
    "n_embd",
    "vocab_size",
    "vocab_multiple",
    "bias",
    "position_embedding",
    "rope_base",
    "tie_weights",
    "mlp_ratio",
    "activation",
    "norm",
    "mlp",
    "attention_variant",
)


#: ``GPTConfig`` keys an export records that stay the new run's choice although they change
#: what attention sees (so what the weights compute): named when they differ.
ATTENTION_KEYS = ("attention_window", "document_mask")


class ExportedFormatError(ConfigError):
    """A ``nanolab.json`` folder that cannot be read or does not fit the config."""


def exported_info(folder: Path) -> dict[str, Any] | None:
    """``nanolab.json`` of a safetensors export (None for any other folder), checked: its
    ``gpt`` is a ``GPTConfig`` this nanolab builds."""
    path = folder / INFO_NAME
    if not path.is_file() or (folder / "config.json").is_file():
        return None
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ExportedFormatError(f"model.init_from {path}: is not readable JSON ({err})") from None
    gpt = info.get("gpt") if isinstance(info, dict) else None
    known = set(GPTConfig.__dataclass_fields__)
    if not isinstance(gpt, dict) or not set(gpt) <= known or "n_layer" not in gpt:
        raise ExportedFormatError(
            f"model.init_from {path}: has no model architecture nanolab reads (its 'gpt' "
            "object); export the checkpoint again with this nanolab"
        )
    return info


def exported_architecture(info: dict[str, Any]) -> dict[str, Any]:
    """The export's ``GPTConfig`` as a dict (every field, defaults filled in)."""
    from dataclasses import asdict

    return asdict(GPTConfig(**info["gpt"]))


def exported_state(
    folder: Path, info: dict[str, Any], expected: dict[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """The export's tensors as the state dict of a model whose tensors have the ``expected``
    shapes: the tied head restored, the learned position table cut to the run's context, and
    any other difference refused naming the tensor."""
    import safetensors.torch as st

    path = folder / "model.safetensors"
    try:
        state = st.load_file(str(path), device="cpu")
    except Exception as err:  # a missing file, or safetensors' own error types
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ExportedFormatError(
            f"model.init_from {path}: not a readable safetensors file ({first[:160]}); export "
            "the checkpoint again"
        ) from None
    tied = info.get("tied") or []  # [head, embedding]: the head is stored once, as the other
    if len(tied) == 2 and tied[0] not in state and tied[1] in state:
        state[tied[0]] = state[tied[1]]
    wpe = "wpe.weight"
    if wpe in state and wpe in expected and state[wpe].dim() == 2:
        state[wpe] = state[wpe][: expected[wpe][0]]
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        what = "; ".join(
            part
            for part in (
                f"missing {', '.join(missing[:3])}" if missing else "",
                f"not in this model {', '.join(extra[:3])}" if extra else "",
            )
            if part
        )
        raise ExportedFormatError(
            f"model.init_from {folder}: its tensors do not match the model {INFO_NAME} "
            f"describes ({what}); export the checkpoint again"
        )
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ExportedFormatError(
                f"model.init_from {folder}: tensor {name} is {list(state[name].shape)}, the model "
                f"makes it {list(shape)}"
            )
    return state


def attention_note(folder: Path, info: dict[str, Any], gpt: dict[str, Any]) -> str | None:
    """One line when the run (``gpt``, its ``model.gpt``) attends otherwise than the export in
    ``folder`` was trained to (a window, document masking), or None: the same."""
    trained = exported_architecture(info)
    differ = [k for k in ATTENTION_KEYS if gpt.get(k, trained[k]) != trained[k]]
    if not differ:
        return None

    def said(keys: list[str], values: dict[str, Any]) -> str:
        return " and ".join(f"{k} {json.dumps(values.get(k))}" for k in keys)

    keep = " ".join(f"--model.gpt.{k} {json.dumps(trained[k])}" for k in differ)
    return (
        f"model.init_from {folder} was trained with {said(differ, trained)}, this run has "
        f"{said(differ, gpt)}: the weights load, but each token attends to other tokens than "
        f"it learned with; set {keep} to keep what it was trained with"
    )
