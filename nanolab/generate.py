"""``nanolab generate``: sample text from a training checkpoint.

The checkpoint carries the architecture and the tokenizer as plain data, so nothing else is
needed, and it is read with ``torch.load(weights_only=True)``: a checkpoint is data, never code.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from nanolab.data.tokenizers import Tokenizer, TokenizerError, tokenizer_from_spec
from nanolab.model import GPT, GPTConfig


class CheckpointError(ValueError):
    """A checkpoint that cannot be used for generation."""


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:
        raise CheckpointError(
            f"{path} is not a readable checkpoint ({type(err).__name__}: {err})"
        ) from None


def model_from_checkpoint(ckpt: dict[str, Any]) -> GPT:
    """Rebuild the GPT from ``ckpt["nanolab"]["gpt"]`` and load its weights."""
    meta = ckpt.get("nanolab")
    if not meta or "gpt" not in meta:
        raise CheckpointError(
            "the checkpoint has no nanolab model config (was it written by nanolab?)"
        )
    config = GPTConfig(**{**meta["gpt"], "gradient_checkpointing": False})
    model = GPT(config)
    prefix = "model."
    state = {k[len(prefix) :]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}
    model.load_state_dict(state)
    return model.eval()


def tokenizer_from_checkpoint(ckpt: dict[str, Any]) -> Tokenizer:
    spec = (ckpt.get("nanolab") or {}).get("tokenizer")
    if spec is None:
        raise CheckpointError(
            "the checkpoint stores no tokenizer; it was saved without a datamodule"
        )
    return tokenizer_from_spec(spec)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="nanolab generate", description="Sample text from a nanolab checkpoint."
    )
    parser.add_argument(
        "--ckpt", required=True, help="checkpoint file, e.g. runs/quickstart/checkpoints/last.ckpt"
    )
    parser.add_argument("--prompt", default="\n", help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=300)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=200)
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or args.num_samples < 1:
        parser.error("--max-new-tokens and --num-samples must be >= 1")
    if args.temperature < 0:
        parser.error("--temperature must be >= 0")
    try:
        ckpt = load_checkpoint(args.ckpt)
        model = model_from_checkpoint(ckpt).to(args.device)
        tok = tokenizer_from_checkpoint(ckpt)
        prompt_ids = tok.encode(args.prompt)
    except (CheckpointError, TokenizerError) as err:
        print(f"nanolab generate: error: {err}", file=sys.stderr)
        return 2
    if not prompt_ids:
        print(
            "nanolab generate: error: --prompt encodes to no tokens; give some text",
            file=sys.stderr,
        )
        return 2
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    idx = torch.tensor([prompt_ids], dtype=torch.long, device=args.device)
    for i in range(args.num_samples):
        out = model.generate(idx, args.max_new_tokens, args.temperature, args.top_k, generator)
        if i:
            print("\n" + "-" * 40)
        print(tok.decode(out[0].tolist()))
    return 0
