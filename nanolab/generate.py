"""``nanolab generate``: sample text from a training checkpoint.

The checkpoint carries the architecture and the tokenizer as plain data, so nothing else is
needed, and it is read with ``torch.load(weights_only=True)``: a checkpoint is data, never code.
``--ckpt`` may also name a run directory (its ``checkpoints/last.ckpt`` is used). Every bad
input (an option out of range, a device this machine lacks, a checkpoint that is not one or whose
weights are NaN) ends in one ``error:`` line and exit code 2.
"""

from __future__ import annotations

import argparse
import math
import pickle
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from nanolab.data.tokenizers import Tokenizer, TokenizerError, tokenizer_from_spec
from nanolab.model import GPT, GPTConfig


class CheckpointError(ValueError):
    """A checkpoint that cannot be used for generation."""


class GenerateArgumentError(ValueError):
    """An option value that cannot work; the message names the option and the fix."""


def resolve_checkpoint(path: str | Path) -> Path:
    """``path`` itself, or for a run directory (or its ``checkpoints/``) its ``last.ckpt``."""
    path = Path(path)
    if not path.is_dir():
        if not path.exists():
            raise CheckpointError(f"--ckpt {path} does not exist; pass a .ckpt file or a run dir")
        return path
    for candidate in (path / "checkpoints" / "last.ckpt", path / "last.ckpt"):
        if candidate.is_file():
            return candidate
    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    steps = sorted(folder.glob("step-*.ckpt"))
    hint = f"pass one of its checkpoints, e.g. --ckpt {steps[-1]}" if steps else "pass a .ckpt file"
    raise CheckpointError(f"--ckpt {path} is a folder without checkpoints/last.ckpt; {hint}")


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not zipfile.is_zipfile(path):  # what torch.save writes; anything else is not ours
        raise CheckpointError(
            f"{path} is not a checkpoint (not a torch zip archive: empty, truncated or another "
            "kind of file); pass a .ckpt written by nanolab fit"
        )
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:
        raise CheckpointError(
            f"{path} holds Python objects besides tensors, which weights_only loading refuses "
            "(a checkpoint is data, never code); pass a .ckpt written by nanolab fit"
        ) from None
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise CheckpointError(
            f"{path} is not a readable checkpoint ({type(err).__name__}: {first[:200]})"
        ) from None
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict):
        raise CheckpointError(f"{path} holds no state_dict; pass a checkpoint saved by nanolab fit")
    return ckpt


def model_from_checkpoint(ckpt: dict[str, Any], source: str | Path = "the checkpoint") -> GPT:
    """Rebuild the GPT from ``ckpt["nanolab"]["gpt"]`` and load its weights (``source`` names
    the file in error messages)."""
    meta = ckpt.get("nanolab")
    if not isinstance(meta, dict) or not isinstance(meta.get("gpt"), dict):
        raise CheckpointError(
            f"{source} has no nanolab model config (was it written by nanolab fit?)"
        )
    prefix = "model."
    state = {k[len(prefix) :]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}
    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(v.isfinite().all())]
    if bad:
        raise CheckpointError(
            f"{source} has non-finite weights (NaN/inf in {len(bad)} of {len(state)} "
            f"tensors, e.g. {bad[0]}): the run diverged before this save; pass an earlier "
            "checkpoint from its checkpoints/ folder"
        )
    try:
        model = GPT(GPTConfig(**{**meta["gpt"], "gradient_checkpointing": False}))
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{source}: its model config is not valid ({err})") from None
    mismatch = state_mismatch(model.state_dict(), state)
    if mismatch:
        raise CheckpointError(f"{source}: the weights do not fit its model config ({mismatch})")
    model.load_state_dict(state)
    return model.eval()


def state_mismatch(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor]) -> str:
    """The first difference between two state dicts, in words ("" when they match)."""
    missing = [k for k in expected if k not in found]
    if missing:
        return f"{len(missing)} tensor(s) missing, e.g. {missing[0]}"
    extra = [k for k in found if k not in expected]
    if extra:
        return f"{len(extra)} unexpected tensor(s), e.g. {extra[0]}"
    for key, tensor in expected.items():
        if tuple(found[key].shape) != tuple(tensor.shape):
            return f"{key} is {tuple(found[key].shape)}, the config makes it {tuple(tensor.shape)}"
    return ""


def tokenizer_from_checkpoint(ckpt: dict[str, Any]) -> Tokenizer:
    spec = (ckpt.get("nanolab") or {}).get("tokenizer")
    if spec is None:
        raise CheckpointError(
            "the checkpoint stores no tokenizer; it was saved without a datamodule"
        )
    return tokenizer_from_spec(spec)


def check_device(text: str) -> torch.device:
    """The device ``--device`` names, if this machine has it (tried with a one-element tensor)."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise GenerateArgumentError(
            f"--device {text!r} is not a device name; use cpu, cuda, cuda:N or mps"
        ) from None
    if device.type == "meta":
        raise GenerateArgumentError("--device meta holds no data; use cpu, cuda, cuda:N or mps")
    try:
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError) as err:
        usable = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        if torch.backends.mps.is_available():
            usable.append("mps")
        why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise GenerateArgumentError(
            f"--device {text}: not usable here ({why[:120]}); use --device {' or '.join(usable)}"
        ) from None
    return device


def check_sampling(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise GenerateArgumentError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.num_samples < 1:
        raise GenerateArgumentError(f"--num-samples must be >= 1, got {args.num_samples}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise GenerateArgumentError(
            f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}"
        )
    if not -(2**63) <= args.seed < 2**64:
        raise GenerateArgumentError(f"--seed must fit in 64 bits, got {args.seed}")
    if args.top_k < 1:
        raise GenerateArgumentError(
            f"--top-k must be >= 1, got {args.top_k}; a value at least the vocabulary size "
            "samples from every token"
        )


def main(argv: Sequence[str] | None = None) -> int:
    from nanolab.helpfmt import DefaultsHelpFormatter, OneLineParser

    parser = OneLineParser(
        prog="nanolab generate",
        description="Sample text from a nanolab checkpoint.",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument(
        "--ckpt",
        required=True,
        help="checkpoint file (runs/quickstart/checkpoints/last.ckpt) or a run directory",
    )
    parser.add_argument(
        "--prompt", default="\n", help="text to continue (default: a newline, i.e. from scratch)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=300, help="tokens to sample")
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="divides the logits: below 1 is more conservative, 0 = greedy (always the likeliest)",
    )
    parser.add_argument(
        "--top-k", type=int, default=200, help="sample among the k likeliest tokens only"
    )
    parser.add_argument("--num-samples", type=int, default=1, help="independent samples")
    parser.add_argument(
        "--seed", type=int, default=1337, help="sampling seed: the same seed, the same text"
    )
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu, cuda, cuda:1, mps (default here: %(default)s)",
    )
    args = parser.parse_args(argv)
    try:
        check_sampling(args)
        device = check_device(args.device)
        path = resolve_checkpoint(args.ckpt)
        if path != Path(args.ckpt):
            print(f"nanolab generate: using {path}", file=sys.stderr)
        ckpt = load_checkpoint(path)
        model = model_from_checkpoint(ckpt, path).to(device)
        tok = tokenizer_from_checkpoint(ckpt)
        prompt_ids = tok.encode(args.prompt)
    except (CheckpointError, TokenizerError, GenerateArgumentError) as err:
        print(f"nanolab generate: error: {err}", file=sys.stderr)
        return 2
    if not prompt_ids:
        print(
            "nanolab generate: error: --prompt encodes to no tokens; give some text",
            file=sys.stderr,
        )
        return 2
    generator = torch.Generator(device=device).manual_seed(args.seed)
    idx = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    for i in range(args.num_samples):
        out = model.generate(idx, args.max_new_tokens, args.temperature, args.top_k, generator)
        if i:
            print("\n" + "-" * 40)
        print(tok.decode(out[0].tolist()))
    return 0
