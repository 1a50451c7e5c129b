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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from nanolab.errors import NanolabError, one_line_errors
from nanolab.messages import note, say
from nanolab.model.checkpoint import (  # noqa: F401  (public here too)
    CheckpointError,
    load_checkpoint,
    model_from_checkpoint,
    state_mismatch,
    tokenizer_from_checkpoint,
)
from nanolab.model.device import check_device
from nanolab.model.registry import add_import_option, import_modules
from nanolab.training.resume import resolve_checkpoint

#: The longest sample one call makes: each token is a forward pass over the whole context.
MAX_NEW_TOKENS = 100_000


class GenerateArgumentError(NanolabError):
    """An option value that cannot work; the message names the option and the fix."""


def check_sampling(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise GenerateArgumentError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.max_new_tokens > MAX_NEW_TOKENS:
        raise GenerateArgumentError(
            f"--max-new-tokens {args.max_new_tokens:,} is more than {MAX_NEW_TOKENS:,} (a sample "
            "that would run for hours); sample in pieces, each continuing the last as --prompt"
        )
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
    if not 0 < args.top_p <= 1:
        raise GenerateArgumentError(
            f"--top-p must be in (0, 1], got {args.top_p}; 1 samples from every token top-k keeps"
        )


@one_line_errors("nanolab generate")
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
    parser.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="then among the likeliest tokens whose probabilities sum to p only (nucleus "
        "sampling; 1 = off)",
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
    add_import_option(parser)
    args = parser.parse_args(argv)
    check_sampling(args)
    device = check_device(args.device)
    import_modules(args.imports)
    path = resolve_checkpoint(args.ckpt)
    if path != Path(args.ckpt):
        say("nanolab generate", f"using {path}")
    ckpt = load_checkpoint(path)
    model = model_from_checkpoint(ckpt, path).to(device)
    tok = tokenizer_from_checkpoint(ckpt, path)
    prompt_ids = tok.encode(args.prompt)
    if not prompt_ids:
        raise GenerateArgumentError("--prompt encodes to no tokens; give some text")
    if not model.supports_kv_cache:
        note("nanolab generate", model.no_cache_reason())
    generator = torch.Generator(device=device).manual_seed(args.seed)
    idx = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    for i in range(args.num_samples):
        if i:
            print("\n" + "-" * 40)
        stream_sample(model, tok, idx, args, generator)
    return 0


def stream_sample(
    model: Any, tok: Any, idx: torch.Tensor, args: argparse.Namespace, generator: Any
) -> None:
    """Print the prompt, then each token as it is sampled (a long sample shows from its first
    token, not after minutes), drawn with the key/value cache where the model has one
    (``GPT.stream``). Ids are printed once they decode to whole characters (a byte-level
    token can hold half of one)."""
    print(tok.decode(idx[0].tolist()), end="", flush=True)
    pending: list[int] = []
    nucleus = {"top_p": args.top_p} if args.top_p < 1 else {}  # a fork's stream may lack it
    for new in model.stream(
        idx, args.max_new_tokens, args.temperature, args.top_k, generator, **nucleus
    ):
        pending.append(int(new[0, -1]))
        text = tok.decode(pending)
        if text and not text.endswith("\ufffd"):
            print(text, end="", flush=True)
            pending = []
    print(tok.decode(pending) if pending else "", flush=True)
