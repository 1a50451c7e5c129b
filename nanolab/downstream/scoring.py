"""Scoring in-context tasks with a causal LM, batched, the way the literature scores them.

Every example becomes one request per option: a context (few-shot examples, then the example's
own context) and a continuation. Each request is tokenized as lm-evaluation-harness does: the
context and the continuation separately, any whitespace at the end of the context moved to the
front of the continuation (so the continuation's leading space is the continuation's), the
tokenizer's end-of-text id first (what a document follows in training), and the sequence cut
from the left to the model's block size. One forward pass then gives every option's
log-likelihood and whether greedy decoding would produce it exactly:

* multiple choice: the option with the highest summed log-likelihood (``acc``), per character
  of the continuation (``acc_norm``), per token (``acc_token``, the DCLM/CORE rule) and, when a
  task asks for it, above its likelihood without the context (``acc_pmi``);
* schema: the context under which the shared continuation is most likely;
* language modeling: the continuation is the greedy one, token for token.

``centered`` is CORE's ``(score - baseline) / (1 - baseline)`` and ``core`` its mean over a
suite. Requests are sorted by length and batched ``rows`` at a time, so a batch is never more
than ``rows x block_size`` tokens: with ``rows`` = the training micro-batch, an evaluation never
needs more memory than a training step (no gradients, no kept activations). Across ranks the
examples are sharded round-robin and the counts summed: 1 and N devices give the same numbers.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from nanolab.downstream.tasks import Suite, Task, mean_label

#: Few-shot examples of example ``i`` are drawn with ``random.Random(FEWSHOT_SEED + i)`` from
#: the task's other examples (the DCLM/nanochat rule), so every run sees the same prompts.
FEWSHOT_SEED = 1234
METRIC_FIELDS = ("acc", "acc_norm", "acc_token", "acc_pmi")


@dataclass(frozen=True)
class Request:
    """One option of one example, tokenized: what one row of a batch scores."""

    example: int
    option: int
    tokens: tuple[int, ...]  # context + continuation, already cut to block_size + 1
    scored: int  # how many trailing tokens are the continuation
    chars: int  # characters of the option's continuation (for acc_norm)


@dataclass
class TaskResult:
    """A task's numbers: its accuracies, the centered score and the example count."""

    name: str
    kind: str
    n: int
    acc: float
    acc_norm: float
    acc_token: float
    acc_pmi: float | None = None
    metric: str = "acc"
    baseline: float = 0.0
    seconds: float = 0.0

    @property
    def score(self) -> float:
        return float(getattr(self, self.metric))

    @property
    def centered(self) -> float:
        return (self.score - self.baseline) / (1.0 - self.baseline)

    def stderr(self) -> float:
        """Standard error of the task's score (binomial), for the ± a report prints."""
        p = self.score
        return math.sqrt(max(p * (1 - p), 0.0) / self.n) if self.n else float("nan")


@dataclass
class SuiteResult:
    tasks: list[TaskResult] = field(default_factory=list)
    seconds: float = 0.0
    suite: str = ""  # the suite's name: ``core`` is CORE (see mean_label)

    @property
    def core(self) -> float:
        """The mean centered accuracy over the suite's tasks (CORE for the CORE suite; the
        ``tasks/core`` field of every suite's record)."""
        return sum(t.centered for t in self.tasks) / max(1, len(self.tasks))

    @property
    def label(self) -> str:
        return mean_label(self.suite)

    def record(self) -> dict[str, Any]:
        """The run-log fields: ``tasks/<name>/{score,acc,acc_norm,[acc_pmi],centered,n}``,
        ``tasks/core`` (the mean centered score, whatever the suite), ``tasks/seconds`` and
        ``suite_name``."""
        out: dict[str, Any] = {"suite_name": self.suite}
        for t in self.tasks:
            out[f"tasks/{t.name}/score"] = t.score  # the accuracy ``centered`` is made of
            out[f"tasks/{t.name}/acc"] = t.acc
            out[f"tasks/{t.name}/acc_norm"] = t.acc_norm
            if t.acc_pmi is not None:
                out[f"tasks/{t.name}/acc_pmi"] = t.acc_pmi
            out[f"tasks/{t.name}/centered"] = t.centered
            out[f"tasks/{t.name}/n"] = t.n
        out["tasks/core"] = self.core
        out["tasks/seconds"] = self.seconds
        return out


# -- prompts and tokens ------------------------------------------------------------------------
def fewshot_indices(task: Task, index: int) -> list[int]:
    """The examples shown before example ``index``: seeded by the index, never itself."""
    if task.shots == 0:
        return []
    # The same draw as sampling the list of the other indices (``random.sample`` picks
    # positions, and position j of that list is j, or j + 1 from ``index`` on), without
    # building that list for every example: O(shots), not O(examples), per example.
    picked = random.Random(FEWSHOT_SEED + index).sample(range(len(task.examples) - 1), task.shots)
    return [j + (j >= index) for j in picked]


def prompts(task: Task, index: int) -> list[tuple[str, str]]:
    """(context, continuation) texts of every option of example ``index``."""
    trim = task.kind == "language_modeling"  # CORE trims LM contexts (LAMBADA's trailing space)
    prefix = ""
    for j in fewshot_indices(task, index):
        context, continuation = task.examples[j].right()
        prefix += f"{context.strip() if trim else context}{task.delimiter}{continuation}\n\n"
    example = task.examples[index]
    return [
        (prefix + (c.strip() if trim else c), task.delimiter + k)
        for c in example.contexts
        for k in example.continuations
    ]


def encode_pair(
    tokenizer: Any, context: str, continuation: str, block_size: int
) -> tuple[tuple[int, ...], int]:
    """Tokens of one request and the number of continuation tokens scored."""
    spaces = len(context) - len(context.rstrip())
    if spaces:  # the context's trailing whitespace belongs to the continuation
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    head = [tokenizer.eot_id] if tokenizer.eot_id is not None else []
    ctx = head + list(tokenizer.encode(context))
    cont = list(tokenizer.encode(continuation))
    if not cont:
        raise ValueError(f"continuation {continuation!r} encodes to no tokens")
    tokens = (ctx + cont)[-(block_size + 1) :]
    return tuple(tokens), min(len(cont), len(tokens) - 1)


def requests_for(task: Task, tokenizer: Any, block_size: int, indices: list[int]) -> list[Request]:
    """The requests of the given examples, tokenized (a tokenizer error names the example)."""
    from nanolab.downstream.tasks import TaskFileError

    out = []
    for i in indices:
        for option, (context, continuation) in enumerate(prompts(task, i)):
            try:
                tokens, scored = encode_pair(tokenizer, context, continuation, block_size)
            except ValueError as err:
                line = task.examples[i].line
                raise TaskFileError(
                    f"task file {task.path} line {line}: cannot be tokenized with the model's "
                    f"tokenizer ({err}); drop the example or use a model with a wider vocabulary"
                ) from None
            chars = max(1, len(continuation) - len(task.delimiter))
            out.append(Request(i, option, tokens, scored, chars))
    return out


# -- the forward passes ------------------------------------------------------------------------
def _logits(model: Any, idx: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    out = model(idx, **kwargs)
    return out[0] if isinstance(out, tuple) else out


#: Options share a context when it is at least this many tokens: below it, running the
#: context once saves less than the extra forward pass costs.
MIN_SHARED = 8


def shared_prefix(requests: list[Request]) -> int:
    """Tokens every request of a group begins with and none of them scores: what can run
    once for all of them (one less, so each option's first scored logit comes from its
    own pass)."""
    first = min(len(r.tokens) - 1 - r.scored for r in requests)  # the earliest scored input
    common = 0
    for column in zip(*(r.tokens for r in requests), strict=False):  # the shortest
        if common > first or any(t != column[0] for t in column):
            break
        common += 1
    return max(0, min(common, first + 1) - 1)


@dataclass
class _Batch:
    """One forward pass: the requests it scores and, for a shared group, the prefix it
    continues (the request rows start after ``skip[j]`` tokens, cached in the prefix pass)."""

    rows: list[int]
    skip: list[int]
    prefix: list[tuple[int, ...]] | None = None  # the distinct contexts (shared passes)
    owner: list[int] | None = None  # which context each row continues


def _plan(requests: list[Request], rows: int, share: bool) -> list[_Batch]:
    """The forward passes that score ``requests``, at most ``rows`` sequences each.

    Requests are grouped by example (consecutive, as :func:`requests_for` makes them); a group
    whose options share a context of :data:`MIN_SHARED` tokens or more runs that context once
    and its options after it from the cache; everything else is sorted by length and padded
    ``rows`` at a time.
    """
    by_example = itertools.groupby(range(len(requests)), key=lambda i: requests[i].example)
    groups = [list(group) for _, group in by_example]
    plain: list[int] = []
    shared: list[tuple[int, list[int]]] = []
    for group in groups:
        skip = shared_prefix([requests[i] for i in group]) if share and len(group) > 1 else 0
        if skip >= MIN_SHARED:
            shared.append((skip, group))
        else:
            plain += group
    plain.sort(key=lambda i: -len(requests[i].tokens))
    batches = [_Batch(plain[s : s + rows], [0] * len(plain[s : s + rows]))
               for s in range(0, len(plain), rows)]  # fmt: skip
    shared.sort(key=lambda g: -g[0])
    at = 0
    while at < len(shared):  # as many whole groups as fit in ``rows`` option rows (at least one)
        take, width = [shared[at]], len(shared[at][1])
        while at + len(take) < len(shared) and width + len(shared[at + len(take)][1]) <= rows:
            width += len(shared[at + len(take)][1])
            take.append(shared[at + len(take)])
        at += len(take)
        prefix = [requests[g[0]].tokens[:skip] for skip, g in take]
        members = [(c, i, skip) for c, (skip, g) in enumerate(take) for i in g]
        for s in range(0, len(members), rows):
            owner, part, skip = map(list, zip(*members[s : s + rows], strict=True))
            batches.append(_Batch(part, skip, prefix, owner))
    return batches


def _run_prefix(model: Any, prefix: list[tuple[int, ...]], device: torch.device) -> Any:
    """Run the contexts once (right-padded) and return their cache."""
    from nanolab.model.gpt import KVCache

    width = max(len(p) for p in prefix)
    idx = torch.zeros(len(prefix), width, dtype=torch.long)
    for b, p in enumerate(prefix):
        idx[b, : len(p)] = torch.tensor(p, dtype=torch.long)
    cache = KVCache.empty(len(model.blocks))
    model(idx.to(device), cache=cache, head=False)
    cache.keep(torch.tensor([len(p) for p in prefix], device=device))
    return cache


@torch.no_grad()
def score_requests(
    model: Any,
    requests: list[Request],
    rows: int,
    vocab_size: int,
    device: torch.device,
    equal_batches: Callable[[int], int] | None = None,
    share_context: bool = True,
) -> list[tuple[float, bool]]:
    """(log-likelihood, greedy match) of every request, ``rows`` requests per forward pass.

    The options of one example usually share their context (few-shot examples and the
    question): when the model can keep a key/value cache (``GPT.supports_kv_cache``), that
    context runs once and each option runs after it from the cache, which is the same
    arithmetic on fewer tokens (the log-likelihoods agree with a full pass to float rounding;
    ``share_context=False`` turns it off, for comparison). Options whose context was cut at
    the block by different amounts (the longer option loses more of it) share nothing.

    ``equal_batches(n)`` returns how many forward passes every rank runs (the most any rank
    needs); the difference is made up with one-token passes whose results are dropped, since a
    sharded model (FSDP, DeepSpeed ZeRO-3) hangs when one rank stops calling forward early.
    """
    rows = max(1, rows)
    share = share_context and bool(getattr(model, "supports_kv_cache", False))
    plan = _plan(requests, rows, share)
    results: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
    passes = len(plan) + len({id(b.prefix) for b in plan if b.prefix is not None})
    for _ in range(passes, equal_batches(passes) if equal_batches else passes):
        _logits(model, torch.zeros(1, 1, dtype=torch.long, device=device))
    caches: dict[int, Any] = {}
    for batch in plan:
        cache = None
        if batch.prefix is not None and batch.owner is not None:
            if id(batch.prefix) not in caches:  # a group split over passes reuses it
                caches = {id(batch.prefix): _run_prefix(model, batch.prefix, device)}
            cache = caches[id(batch.prefix)].select(torch.tensor(batch.owner))
        seqs = [requests[i].tokens[k:] for i, k in zip(batch.rows, batch.skip, strict=True)]
        width = max(len(q) for q in seqs) - 1
        idx = torch.zeros(len(seqs), width, dtype=torch.long)
        rows_at, cols_at, targets = [], [], []
        for b, (i, q) in enumerate(zip(batch.rows, seqs, strict=True)):
            seq, scored = torch.tensor(q, dtype=torch.long), requests[i].scored
            idx[b, : len(seq) - 1] = seq[:-1]  # right padding: causal rows never see it
            first = len(seq) - 1 - scored
            rows_at += [b] * scored
            cols_at += range(first, len(seq) - 1)
            targets.append(seq[first + 1 :])
        extra = {} if cache is None else {"cache": cache}
        logits = _logits(model, idx.to(device), **extra)
        at_rows = torch.tensor(rows_at, device=logits.device)
        at_cols = torch.tensor(cols_at, device=logits.device)
        picked = logits[at_rows, at_cols, :vocab_size].float()
        target = torch.cat(targets).to(picked.device)
        logp = F.log_softmax(picked, dim=-1).gather(1, target[:, None]).squeeze(1)
        greedy = picked.argmax(dim=-1) == target
        at = 0
        for i in batch.rows:
            part = slice(at, at + requests[i].scored)
            results[i] = (float(logp[part].sum()), bool(greedy[part].all()))
            at += requests[i].scored
    return results


def count_correct(
    task: Task,
    requests: list[Request],
    scores: list[tuple[float, bool]],
    unconditional: list[tuple[float, bool]] | None = None,
) -> list[int]:
    """Examples right under each of :data:`METRIC_FIELDS`, then the example count.

    ``unconditional`` (same order as ``requests``) is each option's log-likelihood after the
    end-of-text id alone; without it ``acc_pmi`` counts 0.
    """
    by_example: dict[int, list[int]] = {}
    for at, r in enumerate(requests):
        by_example.setdefault(r.example, []).append(at)
    rules: list[Callable[[int], float]] = [
        lambda at: scores[at][0],
        lambda at: scores[at][0] / requests[at].chars,
        lambda at: scores[at][0] / requests[at].scored,
        lambda at: scores[at][0] - (unconditional[at][0] if unconditional else 0.0),
    ]
    correct = [0] * len(METRIC_FIELDS)
    for index, options in by_example.items():
        if task.kind == "language_modeling":
            hit = int(scores[options[0]][1])
            correct = [c + hit for c in correct]
            continue
        label = task.examples[index].label
        for m, rule in enumerate(rules):
            if m == 3 and unconditional is None:
                continue
            best = max(options, key=rule)
            correct[m] += int(requests[best].option == label)
    return [*correct, len(by_example)]


def unconditional_requests(
    task: Task, tokenizer: Any, block_size: int, requests: list[Request]
) -> list[Request]:
    """Each multiple-choice option after the end-of-text id alone, for ``acc_pmi``: how much
    more likely the context makes it than it is on its own (lm-evaluation-harness's
    ``acc_mutual_info``), which removes the options' own frequency from the choice."""
    out = []
    for r in requests:
        continuation = task.delimiter + task.examples[r.example].continuations[r.option]
        tokens, scored = encode_pair(tokenizer, "", continuation, block_size)
        out.append(Request(r.example, r.option, tokens, scored, r.chars))
    return out


def evaluate_task(
    model: Any,
    tokenizer: Any,
    task: Task,
    *,
    block_size: int,
    rows: int,
    vocab_size: int,
    device: torch.device,
    rank: int = 0,
    world_size: int = 1,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    equal_batches: Callable[[int], int] | None = None,
    share_context: bool = True,
) -> TaskResult:
    """One task on this rank's share of its examples; counts summed over ranks."""
    started = time.perf_counter()
    mine = list(range(rank, len(task.examples), world_size))
    requests = requests_for(task, tokenizer, block_size, mine)
    pmi = task.kind == "multiple_choice" and task.metric == "acc_pmi"
    alone = unconditional_requests(task, tokenizer, block_size, requests) if pmi else []
    scored = score_requests(
        model, requests + alone, rows, vocab_size, device, equal_batches, share_context
    )
    conditional, unconditional = scored[: len(requests)], scored[len(requests) :]
    counts = torch.tensor(
        count_correct(task, requests, conditional, unconditional if pmi else None),
        dtype=torch.float64,
    )
    if all_reduce is not None and world_size > 1:
        counts = all_reduce(counts.to(device)).cpu()
    n = int(counts[-1].item())
    rates = [float(c.item()) / max(1, n) for c in counts[:-1]]
    return TaskResult(
        task.name,
        task.kind,
        n,
        *rates[:3],
        acc_pmi=rates[3] if pmi else None,
        metric=task.metric if task.kind == "multiple_choice" else "acc",
        baseline=task.random_baseline(),
        seconds=time.perf_counter() - started,
    )


def evaluate_suite(model: Any, tokenizer: Any, suite: Suite, **kwargs: Any) -> SuiteResult:
    """Every task of ``suite`` (keyword arguments as :func:`evaluate_task`)."""
    started = time.perf_counter()
    was_training = bool(getattr(model, "training", False))
    model.eval()
    try:
        tasks = [evaluate_task(model, tokenizer, task, **kwargs) for task in suite.tasks]
    finally:
        model.train(was_training)
    return SuiteResult(tasks, time.perf_counter() - started, suite.name)


def suite_tokens(suite: Suite, tokenizer: Any, block_size: int) -> int:
    """Tokens one evaluation of the suite feeds the model (for its time estimate)."""
    return sum(
        len(r.tokens) - 1
        for task in suite.tasks
        for r in requests_for(task, tokenizer, block_size, list(range(len(task.examples))))
    )
