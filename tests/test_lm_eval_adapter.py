"""lm-evaluation-harness on a nanolab checkpoint: the ``LM`` interface on requests built by hand,
against plain computations, and a local task file through ``lm_eval.simple_evaluate`` (offline),
whose accuracies equal ``nanolab eval``'s on the same file."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch

# Nothing is fetched: the task's data is a local file (set before datasets is imported).
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from nanolab.data.tokenizers import CharTokenizer  # noqa: E402
from nanolab.downstream.harness import NanolabLM  # noqa: E402
from nanolab.downstream.scoring import evaluate_task  # noqa: E402
from nanolab.downstream.tasks import Task, read_task_file  # noqa: E402
from nanolab.model import GPT, GPTConfig  # noqa: E402

TEXT = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,:'\n"
TOK = CharTokenizer(sorted(set(TEXT)))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A nanolab checkpoint as ``fit`` writes one (weights, model config, tokenizer spec)."""
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=TOK.vocab_size)
    model = GPT(cfg)
    path = tmp_path_factory.mktemp("ckpt") / "tiny.ckpt"
    torch.save(
        {
            "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
            "global_step": 0,
            "nanolab": {"gpt": asdict(cfg), "tokenizer": TOK.to_meta()},
        },
        path,
    )
    return path


def instance(kind: str, args: tuple) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def plain_logprobs(model: GPT, ids: list[int]) -> torch.Tensor:
    """log P(ids[t] | ids[:t]) for t >= 1, one unpadded forward (len(ids) <= block + 1)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]]))[0][0, :, : TOK.vocab_size].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


def test_loglikelihood_equals_a_plain_forward(checkpoint: Path) -> None:
    lm = NanolabLM(checkpoint=str(checkpoint), device="cpu", batch_size=3)
    pairs = [("the cat", " sat"), ("a", "b c"), ("", "Hello."), ("long context " * 3, " end")]
    got = lm.loglikelihood([instance("loglikelihood", p) for p in pairs])
    for (context, continuation), (ll, greedy) in zip(pairs, got, strict=True):
        ids = [TOK.eot_id, *TOK.encode(context), *TOK.encode(continuation)][-(16 + 1) :]
        # lm-eval's rule (its HFLM's too): the context's trailing space is the continuation's.
        n = len(TOK.encode(context[len(context.rstrip()) :] + continuation))
        logp = plain_logprobs(lm.model, ids)[-n:]
        assert ll == pytest.approx(float(logp.sum()), abs=1e-4)
        with torch.no_grad():
            logits = lm.model(torch.tensor([ids[:-1]]))[0][0, -n:, : TOK.vocab_size]
        assert greedy == bool((logits.argmax(-1) == torch.tensor(ids[-n:])).all())


def test_loglikelihood_rolling_scores_every_token_once(checkpoint: Path) -> None:
    """A text longer than the block: disjoint windows of 16, each token predicted once."""
    lm = NanolabLM(checkpoint=str(checkpoint), device="cpu", batch_size=2)
    text = "To be, or not to be: that is the question."
    (total,) = lm.loglikelihood_rolling([instance("loglikelihood_rolling", (text,))])
    ids = [TOK.eot_id, *TOK.encode(text)]
    expected = 0.0
    for a in range(1, len(ids), 16):  # predict ids[a:b], each after the 16 tokens before it
        b = min(a + 16, len(ids))
        expected += float(plain_logprobs(lm.model, ids[max(0, b - 17) : b])[-(b - a) :].sum())
    assert total == pytest.approx(expected, abs=1e-3)


def test_generate_until_is_greedy_and_stops(checkpoint: Path) -> None:
    lm = NanolabLM(checkpoint=str(checkpoint), device="cpu", max_gen_toks=12)
    (text,) = lm.generate_until([instance("generate_until", ("the cat", {"until": ["q"]}))])
    ids = [TOK.eot_id, *TOK.encode("the cat")]
    new = lm.model.generate(torch.tensor([ids]), 12, temperature=0.0)[0, len(ids) :].tolist()
    if TOK.eot_id in new:
        new = new[: new.index(TOK.eot_id)]
    expected = TOK.decode(new)
    assert text == expected.split("q")[0] and "q" not in text


def test_simple_evaluate_on_a_local_task_matches_nanolab_eval(
    checkpoint: Path, tmp_path: Path, lm_eval_local_only: None
) -> None:
    """lm-eval reads a local JSON-lines file (nothing downloaded) and scores it through the
    adapter; its acc and acc_norm are nanolab eval's on the same examples."""
    rows = [
        {
            "context": f"Line {'abcdefghijkl'[i]}:",
            "choices": ["a cat sat.", "the dog ran far.", "Yes."],
            "label": i % 3,
        }
        for i in range(12)
    ]
    data = tmp_path / "toy.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "toy.yaml").write_text(
        "task: nanolab_toy\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    from lm_eval.tasks import TaskManager

    lm = NanolabLM(checkpoint=str(checkpoint), device="cpu", batch_size=4)
    tasks = TaskManager(include_path=str(tmp_path), include_defaults=False)  # not lm-eval's ~14k
    out = lm_eval.simple_evaluate(
        model=lm, tasks=["nanolab_toy"], task_manager=tasks, bootstrap_iters=0
    )
    res = out["results"]["nanolab_toy"]
    examples, _ = read_task_file(data, "multiple_choice")
    ours = evaluate_task(
        lm.model, TOK, Task("toy", "multiple_choice", examples, data), block_size=16, rows=4,
        vocab_size=TOK.vocab_size, device=torch.device("cpu"),
    )  # fmt: skip
    assert (res["acc,none"], res["acc_norm,none"]) == (ours.acc, ours.acc_norm)


def test_model_args_win_over_lm_evals_own_defaults(checkpoint: Path) -> None:
    """`--model_args checkpoint=...,device=cpu` with lm-eval's own --device/--batch_size given
    too: no clash, the model's arguments first."""
    lm = NanolabLM.create_from_arg_string(
        f"checkpoint={checkpoint},device=cpu,batch_size=3", {"device": "cuda:7", "batch_size": 16}
    )
    assert lm.device.type == "cpu" and lm.rows == 3
    # lm-eval 0.4.13 parses --model_args itself and passes a dict: the same rule (it raised
    # "got multiple values for keyword argument 'batch_size'")
    lm = NanolabLM.create_from_arg_obj(
        {"checkpoint": str(checkpoint), "device": "cpu", "batch_size": 3},
        {"device": "cuda:7", "batch_size": 16},
    )
    assert lm.device.type == "cpu" and lm.rows == 3


def test_a_bad_checkpoint_is_one_line(tmp_path: Path, lm_eval_local_only: None) -> None:
    """`nanolab lm-eval` as a user runs it (through the entry point, in this process): a
    checkpoint that does not exist is one error line (the NanolabError the adapter raises),
    exit 2, no traceback."""
    res = run_toy_task(tmp_path, f"checkpoint={tmp_path}/nowhere")
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert (
        last.startswith("nanolab lm-eval: error: checkpoint=") and "nowhere does not exist" in last
    )


def run_toy_task(tmp_path: Path, model_args: str, *more: str) -> Any:
    """`nanolab lm-eval run` of a one-question local task, in this process, with those
    --model_args (and lm-eval's own --device cpu, or ``more`` options after it)."""
    from conftest import nanolab_here

    data = tmp_path / "toy.jsonl"
    data.write_text(json.dumps({"context": "a", "choices": ["b", "c"], "label": 0}) + "\n")
    (tmp_path / "toy.yaml").write_text(
        f"task: nanolab_toy\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{context}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{label}}'\n"
    )
    return nanolab_here(
        "lm-eval", "run", "--model", "nanolab", "--model_args", model_args,
        "--tasks", "nanolab_toy", "--include_path", str(tmp_path), "--device", "cpu", *more,
        cwd=tmp_path, env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip


@pytest.mark.parametrize(
    ("model_args", "more", "says"),
    [
        (",device=nope", (), "device 'nope' is not a device name; use cpu, cuda, cuda:N or mps"),
        (",device=meta", (), "device meta holds no data"),
        (",batch_size=0", (), "batch_size 0 is not a positive whole number"),
        ("", ("--batch_size", "-3"), "batch_size '-3' is not a positive whole number"),
        (",batch_size=2.5", (), "batch_size 2.5 is not a positive whole number"),
    ],
)
def test_a_device_or_batch_size_that_cannot_work_is_one_line(
    tmp_path: Path, checkpoint: Path, lm_eval_local_only: None, model_args: str, more: tuple,
    says: str,
) -> None:  # fmt: skip
    """``device=nope`` raised torch's RuntimeError through lm-eval (a traceback); it is checked
    as ``generate --device`` is. ``batch_size=0`` scored nothing and still printed a table."""
    res = run_toy_task(tmp_path, f"checkpoint={checkpoint}{model_args}", *more)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("nanolab lm-eval: error: ") and says in last, last


def test_an_empty_checkpoint_is_one_line(tmp_path: Path, lm_eval_local_only: None) -> None:
    """``checkpoint=`` looked in the current folder: "checkpoint=: no complete checkpoint"."""
    res = run_toy_task(tmp_path, "checkpoint=")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last == "nanolab lm-eval: error: checkpoint= is empty; give a run directory or a .ckpt"


def test_help_says_how_to_name_nanolabs_model(capsys: pytest.CaptureFixture) -> None:
    """lm-eval's own help knows only its models: ``nanolab lm-eval --help`` first says how to
    ask for nanolab's (what docs/evaluate.md shows), then prints lm-eval's."""
    from nanolab.downstream.harness import main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.index("--model nanolab --model_args checkpoint=") < out.index("usage: lm-eval")
