"""``model.compile_mode: reduce-overhead``: CUDA graphs on a GPU. A graph's outputs live in its
own buffers, which its next replay writes again, so nothing may hold one across micro-batches.
On a CPU torch compiles without graphs: a model that returns its loss in one buffer it writes
again at every call stands in for the graph here, and a fit through the compile mode itself
runs the rest of its path."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from conftest import QUICKSTART, tiny_overrides, write_config
from torch.utils.data import DataLoader

from nanolab.model import GPT, GPTConfig
from nanolab.runlog import read_records
from nanolab.training.module import TRAIN_LOSS, GPTLightningModule

TINY = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16, dropout=0.0)


class OneOutputBuffer(GPT):
    """A GPT whose loss is always the same tensor, written again at each call, as a CUDA
    graph's replay writes its static output (the previous micro-batch's loss is then gone)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.loss_buffer = torch.zeros(())

    def forward(self, idx, targets=None):
        logits, loss = super().forward(idx, targets)
        if loss is None:
            return logits, loss
        return logits, self.loss_buffer.detach().copy_(loss)  # this call's graph only


class GraphLikeModule(GPTLightningModule):
    def _build_model(self) -> GPT:
        return OneOutputBuffer(self.gpt_config)


class Windows(L.LightningDataModule):
    """16 random windows, 2 at a time; ``masked_targets`` as declared (targets hold no -1)."""

    def __init__(self, declared: bool) -> None:
        super().__init__()
        self.masked_targets = declared

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        chunk = torch.randint(0, TINY.vocab_size, (16, TINY.block_size + 1), generator=g)
        cut = [(chunk[i : i + 2, :-1], chunk[i : i + 2, 1:]) for i in range(0, 16, 2)]
        return DataLoader(cut, batch_size=None)


class StepLosses(L.Callback):
    """The loss each optimizer step published, as the run log reads it."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.losses.append(float(trainer.callback_metrics[TRAIN_LOSS]))


def step_losses(module_class: type[GPTLightningModule], declared: bool) -> list[float]:
    L.seed_everything(0)
    probe = StepLosses()
    trainer = L.Trainer(
        max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        accumulate_grad_batches=2, callbacks=[probe],
    )  # fmt: skip
    trainer.fit(module_class(gpt=TINY), datamodule=Windows(declared))
    return probe.losses


@pytest.mark.parametrize("declared", [False, True], ids=["plain", "masked-targets"])
def test_a_step_s_loss_survives_the_next_micro_batch_writing_the_model_s_output(declared):
    """The step's loss is the mean of its two micro-batches' when the model writes its loss
    into one buffer (a CUDA graph's output), as when it returns a new tensor each time.

    Mutation caught: the first micro-batch's loss kept as the model's own output (a
    ``detach()`` shares its storage): the step's loss becomes the second micro-batch's."""
    assert step_losses(GraphLikeModule, declared) == step_losses(GPTLightningModule, declared)


@pytest.mark.slow  # a cold CPU compile, ~1 min on 2 cores
def test_a_fit_compiled_for_cuda_graphs_trains_with_micro_batches(char_dataset, tmp_path):
    """``model.compile: true`` with ``compile_mode: reduce-overhead`` and 2 micro-batches a
    step fits through ``nanolab fit`` (torch compiles without graphs on a CPU: the mode's
    path in nanolab, not the graphs themselves)."""
    from nanolab.cli import main

    cfg = tiny_overrides(
        char_dataset, tmp_path / "runs", trainer__max_steps=3, run__eval_every_steps=3,
        model__compile=True, model__compile_mode="reduce-overhead", model__gpt__dropout=0.0,
        trainer__accumulate_grad_batches=2,
    )  # fmt: skip
    path = write_config(tmp_path / "c.yaml", cfg)
    assert main(["fit", "--config", str(QUICKSTART), "--config", str(path)]) == 0
    log = tmp_path / "runs" / "tiny" / "metrics.jsonl"
    config = read_records(log, "start")[-1]["config"]
    assert config["trainer"]["accumulate_grad_batches"] == 2
    assert config["model"]["compile"] is True
    assert config["model"]["compile_mode"] == "reduce-overhead"
    train = read_records(log, "train")
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(0 < r["loss"] < 10 for r in train), train
    assert read_records(log, "end")[-1]["reason"] == "completed"
