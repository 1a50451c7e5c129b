"""How much does the key/value cache buy ``nanolab generate``? Tokens/s with and without it.

The same checkpoint samples ``--new`` tokens after the same prompt, greedily, with the cache
(``GPT.stream``'s default) and without it (the whole context again for every token), the two in
alternation ``--rounds`` times in one process; the table gives each round's tokens/s and the
ratio, and the tokens of both are compared over the part where they must agree (while prompt
and sample fit in the block)::

    python benches/generate_speed.py --ckpt runs/quickstart              # 500 tokens, 3 rounds
    python benches/generate_speed.py --ckpt runs/quickstart --new 200 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from nanolab.eval_tasks import checkpoint_and_run
from nanolab.model.checkpoint import (
    load_checkpoint,
    model_from_checkpoint,
    tokenizer_from_checkpoint,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True, help="a run directory or a .ckpt file")
    parser.add_argument("--prompt", default="HIPPOLYTA:")
    parser.add_argument("--new", type=int, default=500, help="tokens to sample")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    path, _, _ = checkpoint_and_run(args.ckpt)
    ckpt = load_checkpoint(path)
    model, tok = model_from_checkpoint(ckpt, path).eval(), tokenizer_from_checkpoint(ckpt)
    idx = torch.tensor([tok.encode(args.prompt)], dtype=torch.long)
    block = model.config.block_size
    print(f"{path}: block {block}, {args.new} new tokens, {args.threads} thread(s)")
    print(f"{'round':>5}  {'no cache tok/s':>15}  {'cache tok/s':>12}  {'ratio':>6}")
    ratios = []
    for i in range(args.rounds):
        t0 = time.perf_counter()
        plain = model.generate(idx, args.new, temperature=0, use_cache=False)
        t1 = time.perf_counter()
        cached = model.generate(idx, args.new, temperature=0, use_cache=True)
        t2 = time.perf_counter()
        plain_rate, cached_rate = args.new / (t1 - t0), args.new / (t2 - t1)
        ratios.append(cached_rate / plain_rate)
        print(f"{i + 1:>5}  {plain_rate:>15.0f}  {cached_rate:>12.0f}  {ratios[-1]:>5.1f}x")
        fits = block  # tokens (prompt included) where both must be the same
        if not torch.equal(plain[:, :fits], cached[:, :fits]):
            print("greedy tokens differ within the block", file=sys.stderr)
            return 1
    same = int((plain == cached).all(dim=0).long().cumprod(0).sum())
    print(
        f"median ratio {statistics.median(ratios):.1f}x (spread {min(ratios):.1f}-"
        f"{max(ratios):.1f}x); the first {same} of {plain.size(1)} tokens are the same"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
