"""How fast is ``nanolab eval``? Batched scoring against a plain loop, side by side.

Both score the same examples of a suite with the same model and get the same accuracy: the
plain loop feeds one option at a time (no padding, a full log-softmax over every position, what
a first implementation does); ``nanolab eval`` runs an example's shared context once and its
options after it from the key/value cache, sorts the rest by length, pads ``rows`` of them into
one forward pass and normalizes only the continuation's positions (the middle column turns the
context sharing off). The two run in
alternation, ``--rounds`` times each, in one process; the table gives each round's examples/s,
the median ratio and its spread::

    python benches/eval_speed.py --ckpt runs/quickstart            # the quickstart's model
    python benches/eval_speed.py --ckpt runs/quickstart --limit 200 --rows 32 --rounds 3

It also prints the accuracies of both (they must agree: the loop is the reference).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from nanolab.downstream.scoring import count_correct, evaluate_task, requests_for
from nanolab.downstream.tasks import load_suite
from nanolab.eval_tasks import checkpoint_and_run
from nanolab.model.checkpoint import (
    load_checkpoint,
    model_from_checkpoint,
    tokenizer_from_checkpoint,
)


@torch.no_grad()
def plain_loop(model, tokenizer, task, block: int, vocab: int) -> float:
    """Accuracy (the task's metric) scoring one option per forward pass."""
    requests = requests_for(task, tokenizer, block, list(range(len(task.examples))))
    scores = []
    for r in requests:
        x = torch.tensor([r.tokens[:-1]])
        logp = torch.log_softmax(model(x)[0][0, :, :vocab].float(), dim=-1)
        target = torch.tensor(r.tokens[1:])
        picked = logp[torch.arange(len(target)), target][-r.scored :]
        greedy = bool((logp[-r.scored :].argmax(-1) == target[-r.scored :]).all())
        scores.append((float(picked.sum()), greedy))
    alone = []
    if task.metric == "acc_pmi":
        from nanolab.downstream.scoring import score_requests, unconditional_requests

        alone = score_requests(
            model,
            unconditional_requests(task, tokenizer, block, requests),
            1,
            vocab,
            torch.device("cpu"),
        )
    counts = count_correct(task, requests, scores, alone or None)
    metric = ("acc", "acc_norm", "acc_token", "acc_pmi").index(task.metric)
    return counts[metric] / counts[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True, help="a run directory or a .ckpt file")
    parser.add_argument("--suite", default="builtin:shakespeare")
    parser.add_argument("--limit", type=int, default=200, help="examples per task")
    parser.add_argument("--rows", type=int, default=32, help="rows per batch for nanolab eval")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    path, _, _ = checkpoint_and_run(args.ckpt)
    ckpt = load_checkpoint(path)
    model, tokenizer = model_from_checkpoint(ckpt, path), tokenizer_from_checkpoint(ckpt)
    block, vocab = model.config.block_size, model.config.vocab_size
    (task, *_) = load_suite(args.suite, args.limit).tasks
    n = len(task.examples)
    print(f"{path}: {task.name}, {n} examples, metric {task.metric}, {args.threads} thread(s)")
    requests = requests_for(task, tokenizer, block, list(range(n)))
    cut = sum(len(r.tokens) == block + 1 for r in requests)
    print(f"{cut} of {len(requests)} options cut at the block (their context cannot be shared)")
    print(f"{'round':>5}  {'plain loop ex/s':>16}  {'batched, no sharing':>20}  "
          f"{'nanolab eval ex/s':>18}  {'ratio':>6}")  # fmt: skip
    ratios = []
    for i in range(args.rounds):
        rates = []
        for share in (None, False, True):
            t0 = time.perf_counter()
            if share is None:
                plain = plain_loop(model, tokenizer, task, block, vocab)
            else:
                batched = evaluate_task(model, tokenizer, task, block_size=block, rows=args.rows,
                                        vocab_size=vocab, device=torch.device("cpu"),
                                        share_context=share)  # fmt: skip
            rates.append(n / (time.perf_counter() - t0))
        ratios.append(rates[2] / rates[0])
        print(f"{i + 1:>5}  {rates[0]:>16.1f}  {rates[1]:>20.1f}  {rates[2]:>18.1f}  "
              f"{ratios[-1]:>5.1f}x")  # fmt: skip
        if abs(plain - batched.score) > 1e-9:
            print(
                f"accuracies differ: loop {plain:.4f}, nanolab eval {batched.score:.4f}",
                file=sys.stderr,
            )
            return 1
    print(f"median ratio {statistics.median(ratios):.1f}x (spread {min(ratios):.1f}-{max(ratios):.1f}x); "
          f"accuracy {batched.score:.4f} in both")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
