"""The LightningDataModule: memory-mapped token bins, resumable window order, fixed validation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader

from nanolab.data.prepare import PrepareError, prepare_dataset, read_meta
from nanolab.data.windows import ResumableBatchSampler, WindowPlan, validation_starts


class TokenWindows:
    """Batches of (input, target) windows read from a token bin with ``np.memmap``.

    Indexed by an array of window starts (a whole micro-batch per call: one gather instead of
    B Python calls). The memmap is opened lazily in each process, so DataLoader workers do not
    inherit a handle and the page cache, not the heap, holds the data.
    """

    def __init__(self, path: Path, dtype: str, block_size: int) -> None:
        self.path = path
        self.dtype = np.dtype(dtype)
        self.block_size = block_size
        self._data: np.memmap | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_data": None}

    @property
    def data(self) -> np.memmap:
        if self._data is None:
            self._data = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self._data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        idx = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(self.block_size + 1)
        chunk = torch.from_numpy(self.data[idx].astype(np.int64))
        return chunk[:, :-1], chunk[:, 1:]


class TokenDataModule(L.LightningDataModule):
    """Serves a dataset prepared by ``nanolab prepare`` (and prepares it first if asked to).

    Args:
        dataset_dir: Folder holding ``train.bin``, ``val.bin`` and ``meta.json``.
        source: Text files, folders or ``bundled:shakespeare`` to prepare into ``dataset_dir``
            when it does not exist yet; ``null`` means the dataset must already be prepared.
        tokenizer: ``bytes``, ``chars``, ``bpe`` or ``gpt2`` (used only when preparing).
        bpe_vocab_size: Vocabulary size of a locally trained BPE tokenizer.
        val_fraction: Share of the token stream (its tail) held out for validation.
        micro_batch_size: Sequences per device per forward pass.
        block_size: Tokens per sequence; ``nanolab fit`` links it to ``model.gpt.block_size``.
        val_windows: Number of fixed, evenly spaced validation windows (same every evaluation).
        seed: Seed of the training window order (independent of the model's seed, so changing
            one does not change the other).
        num_workers: DataLoader worker processes. 0 loads in the training process, which is
            fastest for small models on CPU; 2-4 hides disk latency on GPUs.
        pin_memory: Page-locked host batches for faster copies; ``null`` = on when CUDA is.
        prefetch_factor: Batches each worker prepares ahead (only with workers).
    """

    def __init__(
        self,
        dataset_dir: str = "data/shakespeare_char",
        source: list[str] | None = None,
        tokenizer: str = "chars",
        bpe_vocab_size: int = 4096,
        val_fraction: float = 0.1,
        micro_batch_size: int = 32,
        block_size: int = 256,
        val_windows: int = 256,
        seed: int = 1337,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        prefetch_factor: int = 4,
    ) -> None:
        super().__init__()
        for name, value in (
            ("micro_batch_size", micro_batch_size),
            ("block_size", block_size),
            ("val_windows", val_windows),
        ):
            if value < 1:
                raise PrepareError(f"data.{name} must be >= 1, got {value}")
        if num_workers < 0:
            raise PrepareError(f"data.num_workers must be >= 0, got {num_workers}")
        self.dataset_dir = Path(dataset_dir)
        self.source = list(source) if source else None
        self.tokenizer = tokenizer
        self.bpe_vocab_size = bpe_vocab_size
        self.val_fraction = val_fraction
        self.micro_batch_size = micro_batch_size
        self.block_size = block_size
        self.val_windows = val_windows
        self.seed = seed
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.prefetch_factor = prefetch_factor
        self._meta: dict[str, Any] | None = None
        self.train_sampler: ResumableBatchSampler | None = None

    # -- dataset ---------------------------------------------------------------------------
    def ensure_prepared(self) -> dict[str, Any]:
        """Prepare the dataset from ``source`` if needed; return its meta."""
        if self._meta is None:
            meta = read_meta(self.dataset_dir)
            if self.source is not None:
                meta = prepare_dataset(
                    self.source,
                    self.dataset_dir,
                    self.tokenizer,
                    self.bpe_vocab_size,
                    self.val_fraction,
                )
            elif meta is None:
                raise PrepareError(
                    f"data.dataset_dir {self.dataset_dir} holds no prepared dataset (meta.json); "
                    "run `nanolab prepare` or set data.source"
                )
            for split in ("train", "val"):
                if not (self.dataset_dir / f"{split}.bin").is_file():
                    raise PrepareError(
                        f"{self.dataset_dir / (split + '.bin')} is missing; prepare the dataset again"
                    )
            self._meta = meta
        return self._meta

    @property
    def vocab_size(self) -> int:
        return int(self.ensure_prepared()["vocab_size"])

    @property
    def meta(self) -> dict[str, Any]:
        return self.ensure_prepared()

    def prepare_data(self) -> None:
        # Called on one process per node before setup(): the only place that writes files.
        self.ensure_prepared()

    def setup(self, stage: str) -> None:
        meta = self.ensure_prepared()
        model_vocab = _model_vocab(self)
        if model_vocab is not None and model_vocab < meta["vocab_size"]:
            raise PrepareError(
                f"the data's vocabulary ({meta['vocab_size']}) is larger than model.gpt.vocab_size "
                f"({model_vocab}); set model.gpt.vocab_size to null (read from the data) "
                f"or to >= {meta['vocab_size']}"
            )
        self.train_tokens = TokenWindows(
            self.dataset_dir / "train.bin", meta["dtype"], self.block_size
        )
        self.val_tokens = TokenWindows(self.dataset_dir / "val.bin", meta["dtype"], self.block_size)

    # -- loaders ---------------------------------------------------------------------------
    def _rank_world(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        return trainer.global_rank, trainer.world_size

    def window_plan(self, world_size: int = 1) -> WindowPlan:
        return WindowPlan(
            num_tokens=int(self.meta["train_tokens"]),
            block_size=self.block_size,
            micro_batch_size=self.micro_batch_size,
            world_size=world_size,
            seed=self.seed,
        )

    def _loader(self, dataset: TokenWindows, sampler: Any) -> DataLoader:
        pin = torch.cuda.is_available() if self.pin_memory is None else self.pin_memory
        workers = self.num_workers
        return DataLoader(
            dataset,
            sampler=sampler,
            batch_size=None,  # the sampler yields whole micro-batches
            num_workers=workers,
            pin_memory=pin,
            prefetch_factor=self.prefetch_factor if workers > 0 else None,
            persistent_workers=workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        rank, world = self._rank_world()
        start = consumed_micro_batches(self.trainer)
        self.train_sampler = ResumableBatchSampler(self.window_plan(world), rank, start)
        return self._loader(self.train_tokens, self.train_sampler)

    def _eval_loader(self) -> DataLoader:
        rank, world = self._rank_world()
        starts = validation_starts(len(self.val_tokens), self.block_size, self.val_windows)
        starts = starts[: max(world, len(starts) // world * world)][rank::world]
        batches = [
            starts[i : i + self.micro_batch_size]
            for i in range(0, len(starts), self.micro_batch_size)
        ]
        return self._loader(self.val_tokens, batches)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader()

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader()


def consumed_micro_batches(trainer: Any) -> int:
    """Micro-batches this run has trained on so far (restored from a checkpoint on resume)."""
    if trainer is None:
        return 0
    return int(trainer.fit_loop.epoch_loop.batch_progress.total.processed)


def _model_vocab(dm: TokenDataModule) -> int | None:
    trainer = dm.trainer
    module = getattr(trainer, "lightning_module", None) if trainer is not None else None
    gpt_config = getattr(module, "gpt_config", None)
    return getattr(gpt_config, "vocab_size", None)
