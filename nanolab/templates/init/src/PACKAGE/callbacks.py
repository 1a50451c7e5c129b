"""This project's Lightning callbacks.

A callback is code Lightning runs at fixed points of training (after a batch, after validation,
when a checkpoint is saved, ...) without touching the model or the training loop. Add yours
here and list it under ``trainer.callbacks`` in a config, by class path
(``{{package}}.callbacks.SampleText``), or add one for a single run with
``--trainer.callbacks+={{package}}.callbacks.SampleText``.
"""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from nanolab.data.tokenizers import Tokenizer, data_tokenizer


class SampleText(L.Callback):
    """Print a short continuation of ``prompt`` after every validation.

    Reading samples is the quickest check that a language model is learning what you meant it
    to learn, long before the loss says so.

    Sampling draws from its own seeded generator, never from the global random streams that
    dropout and the data order use, so a run with this callback trains (and resumes) exactly
    like one without it. Every rank samples, because a sharded model (FSDP, ZeRO-3) needs all
    ranks in each forward pass; rank 0 prints.

    Args:
        prompt: Text to continue.
        max_new_tokens: Tokens to sample.
        temperature: Softmax temperature; 0 picks the most likely token every time.
        top_k: Sample only among the k most likely tokens (``None``: all of them).
        seed: Seed of the sampling generator: the same checkpoint gives the same sample.
    """

    def __init__(
        self,
        prompt: str = "\n",
        max_new_tokens: int = 200,
        temperature: float = 0.8,
        top_k: int | None = 50,
        seed: int = 0,
    ) -> None:
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_k = top_k
        self.seed = seed
        self._tokenizer: Tokenizer | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # The tokenizer the run trains with, as checked with the data (checkpoints store it).
        self._tokenizer = data_tokenizer(trainer.datamodule)

    @torch.no_grad()
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or self._tokenizer is None:
            return
        model = pl_module.model
        ids = self._tokenizer.encode(self.prompt) or [0]
        idx = torch.tensor([ids], dtype=torch.long, device=pl_module.device)
        generator = torch.Generator(device=pl_module.device).manual_seed(self.seed)
        was_training = model.training
        model.eval()
        try:
            out = model.generate(
                idx, self.max_new_tokens, self.temperature, self.top_k, generator=generator
            )
        finally:
            model.train(was_training)
        text = self._tokenizer.decode(out[0].tolist())
        rank_zero_info(f"\n--- sample at step {trainer.global_step} ---\n{text}\n---")
