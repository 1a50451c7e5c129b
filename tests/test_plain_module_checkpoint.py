"""A fork's plain LightningModule (no ``model.gpt``): fit does not offer ``nanolab generate``
for its checkpoint, and generate, eval and export say why they cannot build it (they rebuild
nanolab's GPT only), not that fit did not write the file."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import nanolab_here

from nanolab.callbacks.checkpoint import RotatingCheckpoint
from nanolab.model.config import GPTConfig
from nanolab.run.cli import end_block


def _trainer(tmp_path: Path, module: object) -> tuple[SimpleNamespace, Path]:
    run = tmp_path / "runs" / "bigram"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step-00000004.ckpt").write_bytes(b"")
    os.link(run / "checkpoints" / "step-00000004.ckpt", run / "checkpoints" / "last.ckpt")
    saver = RotatingCheckpoint()
    saver.dirpath, saver.last_saved_step = run / "checkpoints", 4
    trainer = SimpleNamespace(default_root_dir=str(run), callbacks=[saver], lightning_module=module)
    return trainer, run


def test_the_end_block_offers_generate_only_for_a_gpt(tmp_path: Path) -> None:
    """Mutation caught: ``next: nanolab generate --ckpt ...`` for a module without a GPT
    config, a command that then failed."""
    trainer, run = _trainer(tmp_path, SimpleNamespace())  # a plain LightningModule's attributes
    block = end_block(trainer)
    assert "generate" not in block
    assert block.splitlines()[-1] == f"  next: nanolab report {run.parent}"
    trainer.lightning_module = SimpleNamespace(gpt_config=GPTConfig(n_layer=1, n_head=2, n_embd=16))
    assert "next: nanolab generate --ckpt " in end_block(trainer)


@pytest.fixture
def bigram_checkpoint(tmp_path: Path) -> Path:
    """What fit saves for a bigram LightningModule of a fork's own: its weights, no GPT config."""
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"model.table.weight": torch.zeros(71, 71)}, "global_step": 4}, path)
    return path


@pytest.mark.parametrize(
    "verb",
    [["generate", "--prompt", "hi", "--ckpt"], ["export", "-o", "out", "--ckpt"], ["eval"]],
)
def test_the_tools_say_the_model_class_has_no_gpt(
    tmp_path: Path, bigram_checkpoint: Path, verb: list[str]
) -> None:
    """Mutation caught: "has no nanolab model config (was it written by nanolab fit?)" for a
    checkpoint fit wrote."""
    result = nanolab_here(*verb, str(bigram_checkpoint), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"nanolab {verb[0]}: error: {bigram_checkpoint} was trained by a model class without "
        "model.gpt (it holds no nanolab GPT config): nanolab generate, eval and export build "
        "nanolab's GPT only; use your model class's own code on it (nanolab validate and test "
        "run it)"
    )
    assert not (tmp_path / "out").exists()
