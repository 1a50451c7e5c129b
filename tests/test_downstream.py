"""Downstream evaluation: task files in three layouts, batched scoring against one-at-a-time
scoring, prompts and tokenization, CORE, ``nanolab eval`` and the in-loop callback."""

from __future__ import annotations

import json
import math
import os
import random
import re
from pathlib import Path

import pytest
import torch
import yaml
from conftest import QUICKSTART, nanolab_here, run_nanolab, tiny_overrides, write_config

from nanolab.data.tokenizers import CharTokenizer, load_tokenizer
from nanolab.downstream import cloze
from nanolab.downstream.scoring import (
    encode_pair,
    evaluate_suite,
    evaluate_task,
    fewshot_indices,
    prompts,
    requests_for,
    score_requests,
)
from nanolab.downstream.tasks import Example, Task, TaskFileError, load_suite, read_task_file
from nanolab.model import GPT, GPTConfig
from nanolab.runlog import read_records


def write_lines(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# -- the layouts, as published ------------------------------------------------------------------
HELLASWAG_ROW = {  # the field layout of HellaSwag's hellaswag_val.jsonl
    "ind": 24,
    "activity_label": "Roof shingle removal",
    "ctx_a": "A man is sitting on a roof.",
    "ctx_b": "he",
    "ctx": "A man is sitting on a roof. he",
    "split": "val",
    "split_type": "indomain",
    "label": 3,
    "endings": [
        "is using wrap to wrap a pair of skis.",
        "is ripping level tiles off.",
        "is holding a rubik's cube.",
        "starts pulling up roofing on a roof [title] Remove the nails.",
    ],
    "source_id": "activitynet~v_-JhWjGDPHMY",
}


def test_hellaswag_layout_builds_lm_eval_context(tmp_path: Path) -> None:
    (ex,), fmt = read_task_file(
        write_lines(tmp_path / "h.jsonl", [HELLASWAG_ROW]), "multiple_choice"
    )
    assert fmt == "hellaswag"
    assert ex.contexts == ("Roof shingle removal: A man is sitting on a roof. He",)
    assert ex.label == 3 and len(ex.continuations) == 4
    assert ex.continuations[3] == "starts pulling up roofing on a roof. Remove the nails."


def test_dclm_layouts(tmp_path: Path) -> None:
    mc = {"query": "Question: 2+2?\nAnswer:", "choices": ["3", "4"], "gold": 1}
    schema = {"context_options": ["The cat", "The dog"], "continuation": "barked.", "gold": 1}
    lm = {"context": "The capital of France is", "continuation": "Paris"}
    (a,), fa = read_task_file(write_lines(tmp_path / "mc.jsonl", [mc]), "multiple_choice")
    (b,), fb = read_task_file(write_lines(tmp_path / "s.jsonl", [schema]), "schema")
    (c,), _ = read_task_file(write_lines(tmp_path / "lm.jsonl", [lm]), "language_modeling")
    assert fa == fb == "dclm"
    assert (a.contexts, a.continuations, a.label) == (("Question: 2+2?\nAnswer:",), ("3", "4"), 1)
    assert (b.contexts, b.continuations, b.label) == (("The cat", "The dog"), ("barked.",), 1)
    assert b.right() == ("The dog", "barked.")
    assert (c.contexts, c.continuations) == (("The capital of France is",), ("Paris",))


def test_nanolab_layouts(tmp_path: Path) -> None:
    (a,), fmt = read_task_file(
        write_lines(
            tmp_path / "a.jsonl", [{"context": "x", "choices": ["a", "b", "c"], "label": 2}]
        ),
        "multiple_choice",
    )
    (b,), _ = read_task_file(
        write_lines(
            tmp_path / "b.jsonl", [{"contexts": ["p", "q"], "continuation": "r", "label": 0}]
        ),
        "schema",
    )
    assert fmt == "nanolab" and a.right() == ("x", "c") and b.right() == ("p", "r")


@pytest.mark.parametrize(
    "rows,kind,problem",
    [
        ([{"context": "x", "label": 0}], "multiple_choice", "line 1: field 'choices' is missing"),
        (
            [{"context": "x", "choices": ["a"], "label": 0}],
            "multiple_choice",
            "1 entries; it needs 2",
        ),
        ([{"context": "x", "choices": ["a", "b"], "label": 2}], "multiple_choice", "out of range"),
        (
            [{"context": "x", "choices": ["a", "b"], "label": 0}, "{not json"],
            "multiple_choice",
            "line 2: not JSON",
        ),
        ([], "multiple_choice", "is empty"),
        ([{"contexts": ["a", "b"], "continuation": "c", "label": -1}], "schema", "out of range"),
        ([{"context": "x", "continuation": 3}], "language_modeling", "'continuation' is a int"),
        (["[1, 2]"], "multiple_choice", "line 1: a JSON list, not an object"),
        # an empty option is scored as the bare delimiter: an accuracy for nothing
        (
            [{"context": "x", "choices": ["a", ""], "label": 1}],
            "multiple_choice",
            "entry 1 is empty",
        ),
        (["[" * 5000], "multiple_choice", "line 1: JSON nested too deeply to read"),
    ],
)
def test_bad_task_files_name_file_and_line(tmp_path: Path, rows, kind, problem) -> None:
    path = write_lines(tmp_path / "bad.jsonl", rows) if rows else tmp_path / "bad.jsonl"
    if not rows:
        path.write_text("")
    with pytest.raises(TaskFileError) as err:
        read_task_file(path, kind)
    assert str(path) in str(err.value) and problem in str(err.value)


def _mc(i: int) -> str:
    return json.dumps({"context": f"c{i}", "choices": [f"a{i}", f"b{i}", "é"], "label": i % 3})


def _core_order_of_a_full_read(path: Path, kind: str) -> list[Example]:
    """What a suite gave before a limit was applied while reading: every line parsed, then
    shuffled as CORE does."""
    examples, _ = read_task_file(path, kind)
    random.Random(1337).shuffle(examples)
    return examples


def test_a_limit_gives_the_examples_and_order_of_a_full_read(tmp_path: Path) -> None:
    """A limit reads only the lines it chooses, yet chooses the ones a full read then CORE's
    shuffle chose, in that order: with blank and whitespace-only lines, and a line break as
    \\n, \\r\\n or a lone \\r (each counted as text reading counts it, for line numbers)."""
    breaks = ["\n", "\r\n", "\r", "\n", "\n  \n", "\n\u00a0\n", "\r\n\r\n"]
    text = "".join(_mc(i) + breaks[i % len(breaks)] for i in range(300))
    path = tmp_path / "mc.jsonl"
    path.write_bytes(text.encode("utf-8"))
    full = _core_order_of_a_full_read(path, "multiple_choice")
    assert len(full) == 300 and full[0].line != 1
    suite = tmp_path / "suite.yaml"
    suite.write_text(yaml.safe_dump([{"file": "mc.jsonl", "kind": "multiple_choice"}]))
    for limit in (1, 2, 7, 50, 299, 300, 1000):
        (task,) = load_suite(suite, limit=limit).tasks
        assert task.examples == full[:limit], limit
    (task,) = load_suite(suite).tasks
    assert task.examples == full


def test_a_limit_leaves_lines_it_does_not_choose_unread(tmp_path: Path) -> None:
    """A malformed line the limit leaves out is not read; one it chooses is the error a full
    read gives. The layout still comes from the first line, chosen or not."""
    rows = [{"query": f"q{i}", "choices": ["a", "b"], "gold": i % 2} for i in range(200)]
    order = list(range(200))
    random.Random(1337).shuffle(order)
    left_out, chosen = order[-1], order[2]
    assert 0 not in order[:5]  # the first line is not among the five chosen
    suite = tmp_path / "suite.yaml"
    suite.write_text(yaml.safe_dump([{"file": "t.jsonl", "kind": "multiple_choice"}]))
    write_lines(tmp_path / "t.jsonl", [*rows[:left_out], "{not json", *rows[left_out + 1 :]])
    (task,) = load_suite(suite, limit=5).tasks
    assert task.metric == "acc_token"  # the dclm layout, detected from line 1
    assert [e.contexts[0] for e in task.examples] == [f"q{i}" for i in order[:5]]
    with pytest.raises(TaskFileError, match=f"line {left_out + 1}: not JSON"):
        load_suite(suite)
    write_lines(tmp_path / "t.jsonl", [*rows[:chosen], {"query": "q"}, *rows[chosen + 1 :]])
    with pytest.raises(TaskFileError) as limited:
        load_suite(suite, limit=5)
    with pytest.raises(TaskFileError) as full:
        load_suite(suite)
    assert str(limited.value) == str(full.value)
    assert f"line {chosen + 1}: field 'choices' is missing" in str(full.value)


def test_bad_task_file_is_one_line_and_exit_2_before_the_model_loads(tmp_path: Path) -> None:
    bad = write_lines(tmp_path / "bad.jsonl", [{"context": "x", "choices": ["a", "b"], "label": 5}])
    suite = tmp_path / "suite.yaml"
    suite.write_text(yaml.safe_dump([{"file": "bad.jsonl", "kind": "multiple_choice"}]))
    res = run_nanolab("eval", str(tmp_path / "no-such-run"), "--suite", str(suite), cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "Traceback" not in res.stderr
    assert f"{bad} line 1: field 'label' is 5, out of range" in res.stderr


def test_suite_entries_are_checked(tmp_path: Path) -> None:
    write_lines(tmp_path / "t.jsonl", [{"context": "x", "choices": ["a", "b"], "label": 0}] * 3)
    for entry, problem in [
        ({"file": "t.jsonl", "kind": "mc"}, r"kind 'mc' \(as its suite gives it\) is not one of"),
        ({"file": "t.jsonl", "kind": "multiple_choice", "shots": -1}, "shots must be"),
        ({"file": "t.jsonl", "kind": "multiple_choice", "shots": 3}, "3 shots need more than 3"),
        (
            {"file": "t.jsonl", "kind": "multiple_choice", "baseline": 25},
            "baseline must be a fraction",
        ),
        ({"file": "t.jsonl", "kind": "multiple_choice", "metrc": "acc"}, "unknown key 'metrc'"),
    ]:
        (tmp_path / "s.yaml").write_text(yaml.safe_dump([entry]))
        with pytest.raises(TaskFileError, match=problem):
            load_suite(tmp_path / "s.yaml")


def test_dclm_bundle_folder_is_core(tmp_path: Path) -> None:
    """The bundle's layout: core.yaml's icl_tasks, eval_meta_data.csv's baselines in percent."""
    data = tmp_path / "eval_bundle" / "eval_data" / "commonsense"
    data.mkdir(parents=True)
    write_lines(
        data / "copa.jsonl",
        [{"query": f"q{i}", "choices": ["a", "b"], "gold": i % 2} for i in range(4)],
    )
    write_lines(
        tmp_path / "eval_bundle" / "eval_data" / "lambada.jsonl",
        [{"context": "a b", "continuation": "c"}] * 2,
    )
    (tmp_path / "eval_bundle" / "core.yaml").write_text(
        "icl_tasks:\n"
        "- label: copa\n  dataset_uri: commonsense/copa.jsonl\n  num_fewshot: [2]\n"
        "  icl_task_type: multiple_choice\n"
        "- label: lambada_openai\n  dataset_uri: lambada.jsonl\n  num_fewshot: [0]\n"
        "  icl_task_type: language_modeling\n  continuation_delimiter: ''\n"
    )
    (tmp_path / "eval_bundle" / "eval_meta_data.csv").write_text(
        "Eval Task,Task Category,Task Type,#shots,#datapoints,Random baseline,Centered Metric?,Description\n"
        "copa,commonsense reasoning,multiple choice,0,100,50,,x\n"
        "lambada_openai,language understanding,language modeling,0,5153,0,,y\n"
    )
    suite = load_suite(tmp_path / "eval_bundle")
    copa, lambada = suite.tasks
    assert (copa.name, copa.shots, copa.baseline, copa.metric) == ("copa", 2, 0.5, "acc_token")
    assert (lambada.kind, lambada.delimiter, lambada.baseline) == ("language_modeling", "", 0.0)


# -- prompts and tokens -------------------------------------------------------------------------
CHARS = CharTokenizer(sorted(set("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ:.,'\n")))


def test_continuation_takes_the_context_trailing_space_and_follows_eot() -> None:
    tokens, scored = encode_pair(CHARS, "the cat ", "sat", block_size=64)
    assert tokens[0] == CHARS.eot_id
    assert CHARS.decode(list(tokens[-scored:])) == " sat"  # the space moved to the continuation
    tokens, scored = encode_pair(CHARS, "x" * 100, " sat", block_size=16)
    assert len(tokens) == 17 and scored == 4  # cut from the left to block + 1


def test_fewshot_prompts_are_seeded_and_never_show_the_example_itself() -> None:
    examples = [Example((f"q{i}",), ("a", "b"), i % 2, i) for i in range(6)]
    task = Task("t", "multiple_choice", examples, Path("t"), shots=3)
    for i in range(6):
        assert i not in fewshot_indices(task, i) and len(set(fewshot_indices(task, i))) == 3
    assert fewshot_indices(task, 2) == fewshot_indices(task, 2)
    (first, cont), _ = prompts(task, 0)
    shots = first.split("\n\n")
    assert len(shots) == 4 and shots[-1] == "q0" and cont == " a"
    j = fewshot_indices(task, 0)[0]
    assert shots[0] == f"q{j} {'ab'[j % 2]}"


# -- scoring ------------------------------------------------------------------------------------
def tiny_model(block: int = 32, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=block, vocab_size=CHARS.vocab_size)
    return GPT(cfg).eval()


def score(task: Task, model: torch.nn.Module, block: int, rows: int):
    """``evaluate_task`` with the character tokenizer of these tests, on the CPU."""
    return evaluate_task(
        model, task=task, tokenizer=CHARS, block_size=block, rows=rows,
        vocab_size=CHARS.vocab_size, device=torch.device("cpu"),
    )  # fmt: skip


def one_at_a_time(model: GPT, tokens: tuple[int, ...], scored: int) -> tuple[float, bool]:
    """A plain loop: one unpadded sequence, full log-softmax."""
    x = torch.tensor([tokens[:-1]])
    with torch.no_grad():
        logp = torch.log_softmax(model(x)[0][0, :, : CHARS.vocab_size].float(), -1)
    target = torch.tensor(tokens[1:])
    rows = range(len(tokens) - 1 - scored, len(tokens) - 1)
    ll = sum(float(logp[r, target[r]]) for r in rows)
    greedy = all(int(logp[r].argmax()) == int(target[r]) for r in rows)
    return ll, greedy


def test_batched_scores_equal_one_sequence_at_a_time() -> None:
    """Padding, sorting and the continuation positions change nothing: with rows of different
    lengths (and contexts cut to the block), each option scores as it does alone."""
    model = tiny_model(block=24)
    examples = [
        Example(
            ("to be or not " * (i % 4 + 1),), ("to be", "that is", "the question", "x"), i % 4, i
        )
        for i in range(7)
    ]
    task = Task("t", "multiple_choice", examples, Path("t"))
    requests = requests_for(task, CHARS, 24, list(range(7)))
    batched = score_requests(
        model, requests, rows=5, vocab_size=CHARS.vocab_size, device=torch.device("cpu")
    )
    for r, (ll, greedy) in zip(requests, batched, strict=True):
        ref_ll, ref_greedy = one_at_a_time(model, r.tokens, r.scored)
        assert ll == pytest.approx(ref_ll, abs=1e-4) and greedy == ref_greedy


def test_batches_never_exceed_rows_by_block_size() -> None:
    model, calls = tiny_model(block=16), []
    model.register_forward_pre_hook(
        lambda m, args, kw: calls.append((*args[0].shape, kw.get("head", True))), with_kwargs=True
    )
    examples = [Example(("a" * (3 * i + 1),), ("bc", "d"), 0, i) for i in range(9)]
    task = Task("t", "multiple_choice", examples, Path("t"))
    score(task, model, block=16, rows=4)
    assert calls and all(b <= 4 and t <= 16 for b, t, _ in calls)
    assert sum(b for b, _, head in calls if head) == 18  # every option once
    # A context runs once for its options when it is MIN_SHARED tokens or more: end-of-text +
    # 3i + 1 characters (the last one goes with each option), so examples 3..8.
    assert sum(b for b, _, head in calls if not head) == 6


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"position_embedding": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False},
        {"attention_variant": "qk_norm", "position_embedding": "rope", "attention": "math"},
    ],
)
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_shared_contexts_score_as_full_passes(variant: dict, rows: int) -> None:
    """Running an example's context once and its options from the key/value cache gives each
    option the log-likelihood and greedy match of its own full pass, for every position
    scheme, with groups split over passes (rows 1, 3) or packed several to a pass (16)."""
    torch.manual_seed(0)
    cfg = GPTConfig(
        n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=CHARS.vocab_size, **variant
    )
    model = GPT(cfg).eval()
    assert model.supports_kv_cache
    examples = [
        Example(("to be or not " * (i % 3 + 1) + "a" * i,), ("to be", "that", "the question"), 0, i)
        for i in range(6)
    ]
    task = Task("t", "multiple_choice", examples, Path("t"), shots=1)
    requests = requests_for(task, CHARS, 64, list(range(6)))
    calls = []
    model.register_forward_pre_hook(lambda m, a, kw: calls.append(kw.get("head")), with_kwargs=True)
    scored = score_requests(model, requests, rows, CHARS.vocab_size, torch.device("cpu"))
    assert False in calls  # contexts did run on their own
    for r, (ll, greedy) in zip(requests, scored, strict=True):
        ref_ll, ref_greedy = one_at_a_time(model, r.tokens, r.scored)
        assert ll == pytest.approx(ref_ll, abs=1e-4) and greedy == ref_greedy


def test_a_model_without_cache_support_scores_full_passes() -> None:
    """An attention class of a fork that does not declare ``supports_kv_cache`` (its
    overrides may not take the cache's arguments) is scored with whole sequences."""
    from nanolab.model.gpt import CausalSelfAttention

    class Plain(CausalSelfAttention):
        def attend(self, q, k, v):  # the old contract: no mask argument
            return super().attend(q, k, v)

    model = tiny_model(block=32)
    for block in model.blocks:
        block.attn.__class__ = Plain
    assert not model.supports_kv_cache

    assert model.no_cache_reason().startswith(f"{Plain.__module__}.{Plain.__qualname__} does not")
    examples = [Example(("to be or not to be",), ("x", "yz"), 0, i) for i in range(3)]
    task = Task("t", "multiple_choice", examples, Path("t"))
    requests = requests_for(task, CHARS, 32, [0, 1, 2])
    scored = score_requests(model, requests, 4, CHARS.vocab_size, torch.device("cpu"))
    for r, (ll, _) in zip(requests, scored, strict=True):
        assert ll == pytest.approx(one_at_a_time(model, r.tokens, r.scored)[0], abs=1e-4)


def test_language_modeling_is_greedy_exact_match() -> None:
    """The continuation counts as right exactly when greedy decoding produces it."""
    context = "the cat sat"
    ids = [CHARS.eot_id, *CHARS.encode(context)]
    for seed in range(20):  # a model whose greedy continuation is text (no end-of-text id)
        model = tiny_model(block=32, seed=seed)
        new = model.generate(torch.tensor([ids]), max_new_tokens=3, temperature=0.0)[0, len(ids) :]
        greedy_text = CHARS.decode(new.tolist())
        if CHARS.encode(greedy_text) == new.tolist():
            break
    right = Example((context,), (greedy_text,), 0, 1)
    wrong = Example((context,), ("zzq" if greedy_text != "zzq" else "qqz",), 0, 2)
    task = Task("lm", "language_modeling", [right, wrong], Path("t"), delimiter="")
    result = score(task, model, block=32, rows=2)
    assert result.n == 2 and result.acc == 0.5


def test_metrics_and_centered_on_a_model_that_knows_the_answer() -> None:
    """A model whose logits favour 'a' whatever the context: every likelihood rule picks the
    option made of 'a's; PMI sees no effect of the context (all options tie, the first wins);
    the centered score follows the task's baseline."""

    class Favours(torch.nn.Module):
        def forward(self, idx):
            logits = torch.zeros(*idx.shape, CHARS.vocab_size)
            logits[..., CHARS.encode("a")[0]] = 5.0
            return logits, None

    examples = [Example(("q",), ("bbb", "aaa", "b"), 1, 1), Example(("q",), ("aaa", "bb"), 0, 2)]
    task = Task(
        "t", "multiple_choice", examples, Path("t"), delimiter="", metric="acc_pmi", baseline=0.4
    )
    r = score(task, Favours(), block=8, rows=3)
    assert (r.acc, r.acc_norm, r.acc_token, r.n) == (1.0, 1.0, 1.0, 2)
    assert r.acc_pmi == 0.5  # example 2's right option is its first
    assert r.centered == pytest.approx((r.acc_pmi - 0.4) / 0.6)


def test_untrained_model_is_at_chance_on_the_shakespeare_cloze() -> None:
    """Random weights: acc_pmi within 3 standard errors of 1/4 on 300 examples."""
    tokenizer = CharTokenizer(sorted(set(cloze.CLOZE_FILE.read_text(encoding="utf-8"))))
    suite = load_suite("builtin:shakespeare", limit=300)
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=128, vocab_size=tokenizer.vocab_size)
    ).eval()
    (t,) = evaluate_suite(
        model, tokenizer, suite, block_size=128, rows=32, vocab_size=tokenizer.vocab_size,
        device=torch.device("cpu"),
    ).tasks  # fmt: skip
    assert t.n == 300 and abs(t.score - 0.25) < 3 * math.sqrt(0.25 * 0.75 / 300)


def test_shipped_cloze_is_what_the_generator_builds() -> None:
    assert cloze.render(
        cloze.build_examples(cloze.validation_text())
    ) == cloze.CLOZE_FILE.read_text(encoding="utf-8")
    rows = [json.loads(line) for line in cloze.CLOZE_FILE.read_text(encoding="utf-8").splitlines()]
    assert len(rows) >= 600 and all(len(r["choices"]) == 4 for r in rows)
    assert {r["label"] for r in rows} == {0, 1, 2, 3}


# -- in fit and on a checkpoint -----------------------------------------------------------------
def test_in_loop_numbers_equal_nanolab_eval_on_the_checkpoint(
    tmp_path: Path, char_dataset: Path
) -> None:
    """The callback's record at the last step and `nanolab eval` of that step's checkpoint are
    the same numbers, and the time is its own pause in the breakdown."""
    cfg = tiny_overrides(
        char_dataset, tmp_path / "runs", trainer__max_steps=4, run__eval_every_steps=2,
        downstream__suite="builtin:shakespeare", downstream__limit=40, downstream__every_n_evals=1,
    )  # fmt: skip
    path = write_config(tmp_path / "c.yaml", cfg)
    res = nanolab_here("fit", "--config", str(QUICKSTART), "--config", str(path), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "runs" / "tiny"
    in_loop = list(read_records(run / "metrics.jsonl", "tasks"))
    assert [r["step"] for r in in_loop] == [2, 4]
    assert "tasks      builtin:shakespeare: 1 task(s), 40 examples" in res.stdout
    # The centered mean beside the accuracy is named for what it is, not "mean" (0.280 beside
    # "mean +0.040" read as a contradiction).
    said = res.stdout + res.stderr
    assert "(shakespeare centered " in said and ", 0 = chance; " in said, said[-3000:]
    end = list(read_records(run / "metrics.jsonl", "end"))[-1]
    assert end["time_breakdown"]["tasks_s"] > 0
    res = nanolab_here(
        "eval", str(run), "--limit", "40", "--json", str(tmp_path / "e.json"), cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr[-3000:]
    again = json.loads((tmp_path / "e.json").read_text())
    keys = [k for k in in_loop[-1] if k.startswith("tasks/") and k != "tasks/seconds"]
    assert keys and {k: again[k] for k in keys} == {k: in_loop[-1][k] for k in keys}
    logged = list(read_records(run / "metrics.jsonl", "tasks"))[-1]
    assert logged["evaluated_by"] == "nanolab eval" and logged["step"] == 4


@pytest.mark.slow  # two processes: ~40 s on 2 cores
def test_two_devices_give_the_numbers_of_one(tmp_path: Path, char_dataset: Path) -> None:
    """DDP on 2 CPU processes: the examples are sharded, the counts summed; the record equals
    `nanolab eval` (one process) on the same checkpoint. 41 examples: the ranks hold 21 and 20."""
    cfg = tiny_overrides(
        char_dataset, tmp_path / "runs", trainer__max_steps=2, run__eval_every_steps=2,
        trainer__devices=2, downstream__suite="builtin:shakespeare", downstream__limit=41,
        downstream__every_n_evals=1,
    )  # fmt: skip
    path = write_config(tmp_path / "c.yaml", cfg)
    ddp = str(QUICKSTART.parent / "strategy" / "ddp.yaml")
    res = run_nanolab(
        "fit",
        "--config",
        str(QUICKSTART),
        "--config",
        ddp,
        "--config",
        str(path),
        cwd=tmp_path,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "runs" / "tiny"
    (record,) = read_records(run / "metrics.jsonl", "tasks")
    assert record["tasks/shakespeare-cloze/n"] == 41
    res = run_nanolab(
        "eval",
        str(run),
        "--limit",
        "41",
        "--no-log",
        "--json",
        str(tmp_path / "e.json"),
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    again = json.loads((tmp_path / "e.json").read_text())
    keys = [k for k in record if k.startswith("tasks/") and k != "tasks/seconds"]
    assert {k: again[k] for k in keys} == {k: record[k] for k in keys}


@pytest.mark.slow
def test_a_suite_the_vocabulary_cannot_spell_is_turned_off_with_one_warning(
    tmp_path: Path, char_dataset: Path
) -> None:
    """A character the data's vocabulary lacks: the run trains, without the tasks, and says so
    once, naming the file and line; a malformed file instead stops it before its first step."""
    write_lines(tmp_path / "t.jsonl", [{"context": "Hello", "choices": ["€1", "€2"], "label": 0}])
    (tmp_path / "s.yaml").write_text(
        yaml.safe_dump([{"file": "t.jsonl", "kind": "multiple_choice"}])
    )
    assert "€" not in load_tokenizer(char_dataset).chars
    cfg = tiny_overrides(
        char_dataset, tmp_path / "runs", downstream__suite=str(tmp_path / "s.yaml")
    )
    path = write_config(tmp_path / "c.yaml", cfg)
    res = run_nanolab("fit", "--config", str(QUICKSTART), "--config", str(path), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stderr.count("is off for this run") == 1
    assert f"task file {tmp_path / 't.jsonl'} line 1: cannot be tokenized" in res.stderr
    log = tmp_path / "runs" / "tiny" / "metrics.jsonl"
    assert list(read_records(log, "train")) and not list(read_records(log, "tasks"))
    write_lines(tmp_path / "t.jsonl", [{"context": "Hello", "choices": ["a"], "label": 0}])
    cfg["run"]["name"] = "bad-file"
    path = write_config(tmp_path / "c.yaml", cfg)
    res = nanolab_here("fit", "--config", str(QUICKSTART), "--config", str(path), cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert f"task file {tmp_path / 't.jsonl'} line 1: field 'choices' has 1 entries" in res.stderr
    assert not (tmp_path / "runs" / "bad-file" / "metrics.jsonl").exists() or not list(
        read_records(tmp_path / "runs" / "bad-file" / "metrics.jsonl", "train")
    )


def test_an_evaluation_needs_less_memory_than_a_training_step() -> None:
    """Measured as the estimator's CPU benches measure a training step (the profiler's
    allocation events): scoring full-block rows at the micro-batch, with the PMI pass, peaks
    below one training step at the same micro-batch, which `nanolab estimate` predicts."""
    from torch.profiler import ProfilerActivity, profile

    from nanolab.estimator.measure import measure_peak_cpu, storage_bytes

    micro, block = 4, 64
    gpt = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=block, vocab_size=512)
    train_peak = measure_peak_cpu(gpt, micro)
    torch.manual_seed(0)
    model = GPT(gpt).eval()
    tok = CharTokenizer([chr(0x100 + i) for i in range(511)])  # 512 ids with end-of-text
    text = "".join(tok.chars[i % 511] for i in range(3 * block))
    examples = [Example((text[i:],), (text[:20], text[5:30], text[9:40]), 0, i) for i in range(8)]
    task = Task("t", "multiple_choice", examples, Path("t"), delimiter="", metric="acc_pmi")
    resident = storage_bytes(list(model.parameters()) + list(model.buffers()))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        evaluate_task(
            model,
            tok,
            task,
            block_size=block,
            rows=micro,
            vocab_size=512,
            device=torch.device("cpu"),
        )
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda e: e.start_ns(),
    )
    current = peak = 0
    for e in events:
        current += e.nbytes()
        peak = max(peak, current)
    assert resident + peak < train_peak, (resident + peak, train_peak)


# -- what an adversarial review found --------------------------------------------------------------
@pytest.mark.parametrize(
    "entry,rows,problem",
    [
        ({"kind": "multiple_choice"}, [{"context": "x", "choices": ["a", "b"], "label": "²"}],
         "field 'label' is '²', not an integer"),
        ({"kind": "multiple_choice", "shots": 3, "limit": 2},
         [{"context": "x", "choices": ["a", "b"], "label": 0}] * 6,
         "3 shots need more than 3 examples; "),
        ({"kind": "multiple_choice", "delimiter": None},
         [{"context": "x", "choices": ["a", "b"], "label": 0}], "delimiter must be a string"),
        ({"kind": "multiple_choice", "name": "a/b"},
         [{"context": "x", "choices": ["a", "b"], "label": 0}], "without '/'"),
    ],
)  # fmt: skip
def test_suite_entries_that_cannot_work(tmp_path: Path, entry, rows, problem) -> None:
    write_lines(tmp_path / "t.jsonl", rows)
    (tmp_path / "s.yaml").write_text(yaml.safe_dump([{"file": "t.jsonl", **entry}]))
    with pytest.raises(TaskFileError, match=re.escape(problem)):
        load_suite(tmp_path / "s.yaml")


@pytest.mark.parametrize(
    "tasks,problem",
    [
        ("icl_tasks: [1]\n", "task 1: a mapping"),
        ("icl_tasks:\n- {label: mc, dataset_uri: mc.jsonl, num_fewshot: [], icl_task_type: multiple_choice}\n",
         "num_fewshot must be [N]"),
        ("icl_tasks:\n- {label: mc, dataset_uri: mc.jsonl, num_fewshot: [abc], icl_task_type: multiple_choice}\n",
         "num_fewshot must be [N]"),
        ("icl_tasks:\n- {label: mc, num_fewshot: [0], icl_task_type: multiple_choice}\n",
         "dataset_uri (a file under eval_data/) is missing"),
    ],
)  # fmt: skip
def test_a_malformed_dclm_bundle_is_one_line(tmp_path: Path, tasks: str, problem: str) -> None:
    (tmp_path / "eval_data").mkdir()
    write_lines(
        tmp_path / "eval_data" / "mc.jsonl", [{"query": "q", "choices": ["a", "b"], "gold": 0}]
    )
    (tmp_path / "core.yaml").write_text(tasks)
    (tmp_path / "eval_meta_data.csv").write_text("Eval Task,Random baseline\nmc,50\n")
    with pytest.raises(TaskFileError, match=re.escape(problem)):
        load_suite(tmp_path)


def test_eval_json_targets_and_a_checkpoint_file_is_printed_only(
    tmp_path: Path, char_dataset: Path
) -> None:
    """--json into a missing folder, onto a folder or into the run is refused before anything
    is scored; a .ckpt path (not the run directory) prints and leaves the run's log alone."""
    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=2)
    path = write_config(tmp_path / "c.yaml", cfg)
    fit = nanolab_here("fit", "--config", str(QUICKSTART), "--config", str(path), cwd=tmp_path)
    assert fit.returncode == 0, fit.stderr[-3000:]
    run = tmp_path / "runs" / "tiny"
    before = (run / "metrics.jsonl").read_bytes()
    for target, problem in [
        (tmp_path / "nodir" / "x.json", "does not exist; create it first"),
        (tmp_path, "is a folder; give a file name"),
        (run / "metrics.jsonl", "is inside the run directory"),
    ]:
        res = nanolab_here("eval", str(run), "--limit", "3", "--json", str(target), cwd=tmp_path)
        assert res.returncode == 2 and problem in res.stderr and "Traceback" not in res.stderr
    ckpt = next((run / "checkpoints").glob("step-*.ckpt"))
    res = nanolab_here("eval", str(ckpt), "--limit", "3", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert (run / "metrics.jsonl").read_bytes() == before


def test_mixed_precision_eval_equals_the_in_loop_numbers(
    tmp_path: Path, char_dataset: Path
) -> None:
    """bf16-mixed on CPU: `nanolab eval` scores under the run's precision, as the loop does."""
    cfg = tiny_overrides(
        char_dataset, tmp_path / "runs", trainer__max_steps=2, run__eval_every_steps=2,
        trainer__precision="bf16-mixed", downstream__suite="builtin:shakespeare",
        downstream__limit=40, downstream__every_n_evals=1,
    )  # fmt: skip
    path = write_config(tmp_path / "c.yaml", cfg)
    res = nanolab_here("fit", "--config", str(QUICKSTART), "--config", str(path), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "runs" / "tiny"
    (record,) = read_records(run / "metrics.jsonl", "tasks")
    res = nanolab_here(
        "eval",
        str(run),
        "--limit",
        "40",
        "--no-log",
        "--json",
        str(tmp_path / "e.json"),
        cwd=tmp_path,
    )
    assert res.returncode == 0 and "precision bf16-mixed" in res.stderr, res.stderr[-2000:]
    again = json.loads((tmp_path / "e.json").read_text())
    keys = [k for k in record if k.startswith("tasks/") and k != "tasks/seconds"]
    assert {k: again[k] for k in keys} == {k: record[k] for k in keys}


def test_cadence_without_max_steps(tmp_path: Path, char_dataset: Path) -> None:
    """trainer.max_steps -1 (a budget ends the run): every 3rd validation, and the last step."""
    cfg = tiny_overrides(
        char_dataset, tmp_path / "runs", trainer__max_steps=-1, run__eval_every_steps=2,
        budget__max_tokens=4 * 32 * 13, downstream__suite="builtin:shakespeare",
        downstream__limit=5, downstream__every_n_evals=3,
    )  # fmt: skip
    path = write_config(tmp_path / "c.yaml", cfg)
    res = nanolab_here("fit", "--config", str(QUICKSTART), "--config", str(path), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    steps = [r["step"] for r in read_records(tmp_path / "runs" / "tiny" / "metrics.jsonl", "tasks")]
    end = list(read_records(tmp_path / "runs" / "tiny" / "metrics.jsonl", "end"))[-1]["step"]
    assert steps[:2] == [6, 12] and steps[-1] == end, (steps, end)  # not 2, 4, 8, 10
    assert len(steps) == (2 if end == 12 else 3), (steps, end)


def test_the_shipped_cloze_file_is_what_its_builder_writes(tmp_path: Path) -> None:
    """The bundled cloze task is rebuilt by ``python -m nanolab.downstream.cloze``: the shipped
    file is byte for byte its output, and the rebuild leaves no temporary file behind."""
    from nanolab.downstream.cloze import CLOZE_FILE, main

    out = tmp_path / "cloze.jsonl"
    assert main([str(out)]) == 0
    assert out.read_bytes() == CLOZE_FILE.read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == ["cloze.jsonl"]


def test_eval_json_writes_through_no_planted_temp_name(
    tmp_path: Path, char_dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--json replaces its file through a temporary name of its own: a hard link into another
    run's log, a symlink to another run's config or a folder at the old fixed name beside it
    (``.<name>.tmp``) is left alone, and so are the files they point at; a write the file system
    refuses is one line naming --json (74 for a full disk, 2 otherwise), no traceback."""
    import errno

    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=2)
    fit = nanolab_here("fit", "--config", str(write_config(tmp_path / "c.yaml", cfg)), cwd=tmp_path)
    assert fit.returncode == 0, fit.stderr[-3000:]
    run = tmp_path / "runs" / "tiny"
    before = {name: (run / name).read_bytes() for name in ("metrics.jsonl", "config.yaml")}
    out = tmp_path / "out"
    out.mkdir()
    os.link(run / "metrics.jsonl", out / ".a.json.tmp")
    (out / ".b.json.tmp").symlink_to(run / "config.yaml")
    (out / ".c.json.tmp").mkdir()
    for name in ("a", "b", "c"):
        res = nanolab_here(
            "eval", str(run), "--limit", "3", "--no-log", "--json", str(out / f"{name}.json"),
            cwd=tmp_path,
        )  # fmt: skip
        assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-2000:]
        assert json.loads((out / f"{name}.json").read_text())["evaluated_by"] == "nanolab eval"
    assert {name: (run / name).read_bytes() for name in before} == before
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [".a.json.tmp", ".b.json.tmp", ".c.json.tmp", "a.json", "b.json", "c.json"]
    )
    replace = os.replace
    for code, exit_code in [(errno.ENOSPC, 74), (errno.ENOENT, 2)]:

        def refused(src: object, dst: object, *, code: int = code, **kw: object) -> None:
            if str(dst).endswith("d.json"):
                raise OSError(code, os.strerror(code), str(src))
            replace(src, dst, **kw)

        monkeypatch.setattr(os, "replace", refused)
        res = nanolab_here(
            "eval", str(run), "--limit", "3", "--json", str(out / "d.json"), cwd=tmp_path
        )
        monkeypatch.setattr(os, "replace", replace)
        lines = [line for line in res.stderr.splitlines() if "error" in line]
        assert res.returncode == exit_code and "Traceback" not in res.stderr, res.stderr[-2000:]
        assert lines == [lines[-1]] and f"--json {out / 'd.json'}: cannot" in lines[-1], lines
        assert not (out / "d.json").exists() and len(list(out.iterdir())) == 6
    assert (run / "metrics.jsonl").read_bytes() == before["metrics.jsonl"]  # its log as it was
