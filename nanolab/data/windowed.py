"""The data seam: any dataset that can hand out windows of token ids trains like nanolab's own.

A dataset of your own does not have to be text that ``nanolab prepare`` tokenizes. It is a
:class:`WindowSource` per split, the whole protocol:

* ``len(source)``: how many windows the split holds;
* ``source[indices]`` (a 1-D int64 ``numpy`` array of window numbers): ``(x, y)``, two int64
  tensors of shape ``(len(indices), block_size)``: the input ids and the target ids, ``y = -1``
  where a position has no loss (a prompt, padding: a loss mask; the DataModule then sets
  :attr:`WindowDataModule.masked_targets`);
* ``bytes_per_token`` (optional): UTF-8 bytes per *target* token of the split, so validation
  also logs bits per byte (``val/bpb``), comparable across tokenizers.

A DataModule subclasses :class:`WindowDataModule` and returns its two splits from
:meth:`~WindowDataModule.train_split` and :meth:`~WindowDataModule.val_split`; nanolab does the
rest, with the guarantees of its token datasets:

* **exact resume**: micro-batch ``g`` of rank ``r`` is a pure function of ``(seed, g, r)``: every
  epoch visits every training window once, in a seeded order, split across ranks; a run resumed
  after ``g`` micro-batches starts at ``g``;
* **N devices = N accumulated micro-batches**: the windows of one optimizer step are the same
  set whether the step is spread over devices or accumulated on one;
* **validation** on the first ``val_windows`` windows of the validation split, the same at every
  evaluation, sharded evenly over ranks.

nanolab's own :class:`~nanolab.data.datamodule.TokenDataModule` is the same contract over a
prepared token stream, with windows cut at a seeded offset each epoch and mixtures on top.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.data import DataLoader

from nanolab import messages
from nanolab.data.checks import DataChangedError
from nanolab.data.datamodule import (
    EvalScale,
    pins_memory,
    rank_world,
    resumable_sampler,
)
from nanolab.data.prepare import PrepareError
from nanolab.data.sizes import check_window_sizes
from nanolab.data.windows import (
    DataTooSmallError,
    IndexPlan,
    ResumableBatchSampler,
    evaluation_batches,
    validation_cut,
    validation_shortfall,
)


@runtime_checkable
class WindowSource(Protocol):
    """One split of a dataset of windows (see the module docstring)."""

    def __len__(self) -> int: ...

    def __getitem__(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]: ...


class WindowDataModule(L.LightningDataModule):
    """Base of a DataModule whose data is windows of ids (the protocol above).

    Args:
        micro_batch_size: Windows per device per forward pass.
        block_size: Tokens per window; ``null``: the model's ``model.gpt.block_size``, which
            ``nanolab fit`` fills in. Every window of both splits must have this length.
        val_windows: How many windows of the validation split each evaluation uses (from the
            start of the split; all of them when it holds fewer).
        seed: Seed of the training order (independent of the model's seed).
        num_workers: DataLoader worker processes (0: load in the training process).
        pin_memory: Page-locked host batches for faster copies to the GPU; ``null`` = on when
            the run trains on a CUDA/ROCm device (as ``TokenDataModule``'s).

    Subclasses implement :meth:`train_split` and :meth:`val_split`, and may set
    :attr:`vocab_size` (else the config's ``model.gpt.vocab_size`` must give it) and
    :attr:`masked_targets`.
    """

    #: The vocabulary of the ids, when the dataset knows it (``None``: the model config's).
    vocab_size: int | None = None
    #: Set True where a split's ``y`` may hold ``-1``: each optimizer step then averages its loss
    #: and gradient over the targets it holds, at a count per micro-batch and a rescale of the
    #: gradients per step that data without masks is spared (nanolab/training/masked_targets.py).
    #: Left False, masks still carry no loss, but each micro-batch's mean counts the same.
    masked_targets: bool = False

    def __init__(
        self,
        micro_batch_size: int = 32,
        block_size: int | None = None,
        val_windows: int = 256,
        seed: int = 1337,
        num_workers: int = 0,
        pin_memory: bool | None = None,
    ) -> None:
        super().__init__()
        check_window_sizes(micro_batch_size, block_size, val_windows, num_workers)
        self.micro_batch_size = micro_batch_size
        self.block_size = block_size
        self.val_windows = val_windows
        self.seed = seed
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.train_source: WindowSource | None = None
        self.val_source: WindowSource | None = None
        self.train_sampler: ResumableBatchSampler | None = None
        self.eval_scales: list[EvalScale] | None = None

    # -- what a subclass gives -------------------------------------------------------------
    def train_split(self) -> WindowSource:
        """The training windows."""
        raise NotImplementedError(f"{type(self).__name__} must implement train_split()")

    def val_split(self) -> WindowSource:
        """The validation windows."""
        raise NotImplementedError(f"{type(self).__name__} must implement val_split()")

    # -- what nanolab does with it ----------------------------------------------------------
    def _sources(self) -> tuple[WindowSource, WindowSource]:
        if self.train_source is None or self.val_source is None:
            self.train_source, self.val_source = self.train_split(), self.val_split()
            for name, source in (("train", self.train_source), ("val", self.val_source)):
                self._check_split(name, source)
        return self.train_source, self.val_source

    def _check_split(self, name: str, source: Any) -> None:
        where = f"{type(self).__name__}.{name}_split()"
        if not isinstance(source, WindowSource):
            raise PrepareError(f"{where} must return a window source (len() and [indices])")
        if len(source) < 1:
            raise DataTooSmallError(f"{where} holds no windows; add data")
        x, y = source[np.array([0], dtype=np.int64)]
        if tuple(x.shape) != tuple(y.shape) or x.dim() != 2 or x.size(0) != 1:
            raise PrepareError(
                f"{where}[[0]] gave x {tuple(x.shape)} and y {tuple(y.shape)}; both must be "
                "(windows, block_size)"
            )
        if self.block_size is not None and x.size(1) != self.block_size:
            raise PrepareError(
                f"{where} has windows of {x.size(1)} tokens but block_size is "
                f"{self.block_size}; set model.gpt.block_size to {x.size(1)}"
            )

    def setup(self, stage: str) -> None:
        self._sources()

    def window_plan(self, world_size: int = 1) -> IndexPlan:
        train, _ = self._sources()
        return IndexPlan(len(train), self.micro_batch_size, world_size, self.seed)

    def check_fits(self, world_size: int) -> None:
        """Raise :class:`DataTooSmallError` now if the split cannot fill one step of all ranks,
        or the validation windows cannot give every rank a batch."""
        self.window_plan(world_size)
        val = self._sources()[1]
        windows = np.arange(min(len(val), self.val_windows), dtype=np.int64)
        evaluation_batches(windows, 0, world_size, self.micro_batch_size)
        where = type(self).__name__
        if short := validation_shortfall(self.val_windows, len(windows), where):
            rank_zero_only(messages.warn)("nanolab", short)
        if cut := validation_cut(len(windows), world_size, where):
            rank_zero_only(messages.warn)("nanolab", cut)

    def _loader(self, dataset: Any, sampler: Any) -> DataLoader:
        return DataLoader(
            dataset,
            sampler=sampler,
            batch_size=None,  # the sampler yields whole micro-batches of window numbers
            num_workers=self.num_workers,
            pin_memory=pins_memory(self.pin_memory, self.trainer),
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        self.train_sampler = resumable_sampler(self)
        return self._loader(self._sources()[0], self.train_sampler)

    def val_dataloader(self) -> DataLoader:
        rank, world = rank_world(self.trainer)
        val = self._sources()[1]
        windows = np.arange(min(len(val), self.val_windows), dtype=np.int64)
        batches = evaluation_batches(windows, rank, world, self.micro_batch_size)
        per_token = getattr(val, "bytes_per_token", None)
        bpb = None if not per_token else 1.0 / (float(per_token) * float(np.log(2)))
        self.eval_scales = [EvalScale(name="val", loss_weight=1.0, bpb=bpb, overall_bpb=bpb)]
        return self._loader(val, batches)

    test_dataloader = val_dataloader

    # -- resume ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"windows_seed": self.seed, "train_windows": len(self._sources()[0])}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Refuse to resume on other data: the order of windows would not be the run's."""
        saved = state_dict.get("train_windows")
        now = len(self._sources()[0])
        if saved is not None and int(saved) != now:
            raise DataChangedError(
                f"the training split now holds {now} windows, the checkpoint's run trained on "
                f"{saved}: resuming would not continue the same window order; restore the data "
                "or start a new run (--run.name)"
            )
        if state_dict.get("windows_seed", self.seed) != self.seed:
            raise DataChangedError(
                f"data.seed is {self.seed}, the checkpoint's run used "
                f"{state_dict['windows_seed']}; set data.seed back to resume it"
            )
