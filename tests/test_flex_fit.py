"""``model.gpt.attention: flex`` with a document mask, trained through ``nanolab fit`` on a CPU.

What a GPU run of ``attention: flex`` takes: the model under ``model.compile`` around the
compiled FlexAttention and the compiled ``create_block_mask`` (:func:`nanolab.model.gpt.
compiles_flex` says yes on CUDA), bf16 autocast, gradient checkpointing, a checkpoint and a
resume. tests/test_documents.py runs the compiled kernel alone, outside the model, and
benches/gpu_check.py's ``flex_mask`` times it alone; here it runs inside ``fit``.

The switch CUDA flips is forced through the project's own seam: ``compiles_flex`` answering yes
on this CPU (nothing of nanolab's logic replaced). What no CPU can run is FlexAttention's
backward (torch: "FlexAttention does not support backward on CPU"), so the training steps
attend through the dense mask (``attend_masked``) and the compiled FlexAttention runs in the
validations, under the compiled model; on a GPU ``gpu_check.py``'s ``flex_fit`` trains through
it. Each run is a branch (``--run.resume`` of the uninterrupted run's step-2 checkpoint) that
must equal the uninterrupted run's steps 3-4 and its last validation exactly.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import QUICKSTART, nanolab_here, tiny_overrides, write_config
from test_documents import random_documents, write_documents

import nanolab.model.gpt as gpt
from nanolab.runlog import read_records

STEPS, MIDDLE = 4, 2
WINDOW = 8


def _config(tmp_path: Path, compile_: bool, checkpointing: bool, attention: str = "flex") -> Path:
    """The tiny GPT on documents of 2-20 words, several to a 32-token window, with
    ``attention: flex``, ``document_mask: true`` (its end-of-text id from the data's meta) and
    a window of 8, bf16 autocast, a validation and a checkpoint every 2 steps."""
    data = tmp_path / "docs"
    if not data.exists():
        write_documents(data, random_documents(300, 9), random_documents(40, 10))
    cfg = tiny_overrides(
        data, tmp_path / "runs", run__name="full", run__eval_every_steps=MIDDLE,
        trainer__max_steps=STEPS, trainer__precision="bf16-mixed", model__compile=compile_,
        model__schedule={"warmup_steps": 2}, checkpoint__every_n_steps=MIDDLE,
        checkpoint__keep_last=STEPS,
    )  # fmt: skip
    cfg["model"]["gpt"].update(
        attention=attention,
        document_mask=True,
        attention_window=WINDOW,
        dropout=0.0,
        gradient_checkpointing=checkpointing,
    )
    return write_config(tmp_path / "flex.yaml", cfg)


def _fit_and_branch(tmp_path: Path, config: Path) -> dict[str, dict]:
    """``full`` (4 steps) and ``branch`` (resumed from its step 2): step -> loss of each run's
    train and val records."""
    base = ("fit", "--config", str(QUICKSTART), "--config", str(config))
    res = nanolab_here(*base, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    middle = tmp_path / "runs" / "full" / "checkpoints" / f"step-{MIDDLE:08d}.ckpt"
    res = nanolab_here(*base, "--run.name", "branch", "--run.resume", str(middle), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    losses = {}
    for name in ("full", "branch"):
        log = tmp_path / "runs" / name / "metrics.jsonl"
        losses[f"{name}/train"] = {r["step"]: r["loss"] for r in read_records(log, "train")}
        losses[f"{name}/val"] = {r["step"]: r["val_loss"] for r in read_records(log, "val")}
    return losses


def _assert_trained_and_resumed_exactly(losses: dict[str, dict]) -> None:
    train, val = losses["full/train"], losses["full/val"]
    assert sorted(train) == list(range(1, STEPS + 1)) and sorted(val) == [MIDDLE, STEPS]
    assert all(math.isfinite(v) for v in [*train.values(), *val.values()])
    assert losses["branch/train"] == {s: train[s] for s in range(MIDDLE + 1, STEPS + 1)}
    assert losses["branch/val"] == {STEPS: val[STEPS]}


class FlexCalls:
    """Counts the calls of :func:`nanolab.model.gpt.flex_attend` (then runs it), by whether
    gradients were on: which of a run's passes attended through FlexAttention."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import torch

        self.with_grad = self.without_grad = 0
        original = gpt.flex_attend

        def counted(*args, **kwargs):
            if torch.is_grad_enabled():
                self.with_grad += 1
            else:
                self.without_grad += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(gpt, "flex_attend", counted)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_flex_with_a_document_mask_trains_and_resumes_through_fit(
    tmp_path, monkeypatch, checkpointing
):
    """The fast twin, eager (``model.compile: false``, FlexAttention unfused as a CPU runs it):
    finite losses, the branch equal to the uninterrupted run, and the validations attended
    through FlexAttention (2 layers x 4 validation batches x 2 evaluations, and 1 evaluation
    again in the branch); the training steps, which need its backward, did not."""
    calls = FlexCalls(monkeypatch)
    _assert_trained_and_resumed_exactly(
        _fit_and_branch(tmp_path, _config(tmp_path, False, checkpointing))
    )
    assert calls.with_grad == 0 and calls.without_grad == 2 * 4 * 3


@pytest.mark.slow  # a cold compile of the model around FlexAttention: ~3 min on 2 loaded cores
def test_the_compiled_flex_path_a_gpu_takes_trains_and_resumes_through_fit(tmp_path, monkeypatch):
    """``model.compile: true`` with the switch CUDA flips forced (``compiles_flex`` -> yes),
    gradient checkpointing on: the compiled model around the compiled ``create_block_mask`` and
    FlexAttention trains, validates and resumes exactly; both compiled functions were built by
    this run (a fresh cache), and its losses are those of the same run eager with ``attention:
    sdpa`` and the boolean mask (train within 5e-4, val within 1e-3: bf16 autocast, other
    kernels; measured 7e-5 and 3e-5). Mutation caught: FlexAttention or the block mask failing
    under the model's compile (a crash at the first validation). Whether the compiled block mask
    keeps to the documents and the window is tests/test_documents.py's (the kernel against
    SDPA, to 1e-5): a 4-step model's loss hardly depends on it (a block mask ignoring both moved
    the validation loss here by 1.6e-4 at most)."""
    sdpa = tmp_path / "sdpa"
    reference = _fit_and_branch(sdpa, _config(sdpa, False, True, "sdpa"))
    monkeypatch.setattr(gpt, "compiles_flex", lambda device: True)
    monkeypatch.setattr(gpt, "_COMPILED_FLEX", {})
    compiled = _fit_and_branch(tmp_path / "compiled", _config(tmp_path / "compiled", True, True))
    _assert_trained_and_resumed_exactly(compiled)
    assert set(gpt._COMPILED_FLEX) == {"create_block_mask", "flex_attention"}
    for step, loss in reference["full/train"].items():
        assert compiled["full/train"][step] == pytest.approx(loss, abs=5e-4), step
    for step, loss in reference["full/val"].items():
        assert compiled["full/val"][step] == pytest.approx(loss, abs=1e-3), step
