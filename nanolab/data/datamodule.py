"""The LightningDataModule: memory-mapped token bins, resumable window order, fixed validation.

One prepared folder (``data.dataset_dir``) is the simple case; ``data.datasets`` mixes several
folders by weight (:class:`~nanolab.data.windows.MixturePlan`). Every folder is checked against
its ``meta.json`` before training (:mod:`nanolab.data.checks`), and its fingerprint goes into
every checkpoint, so a resume on data that changed underneath the run is refused.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from torch.utils.data import DataLoader

from nanolab import messages
from nanolab.data.checks import (
    DataChangedError,
    DataCheckError,
    DataReplacedError,
    FileIdentity,
    align_change,
    allowed_change_line,
    changed_data_message,
    check_files,
    checked_tokenizer_spec,
    checkpoint_fingerprint,
    data_changes,
    data_fingerprint_of,
    file_identity,
    fingerprint,
    load_meta,
    replaced_message,
)
from nanolab.data.documents import Packing, evenly_spaced, read_rows
from nanolab.data.mixture import parse_datasets
from nanolab.data.order import sampler_jumps, unit_of
from nanolab.data.packing_cache import packing_of
from nanolab.data.prepare import FIT_KEYS, PrepareError, prepare_dataset
from nanolab.data.sizes import check_align, check_window_sizes
from nanolab.data.skips import Jump, jumps, read_ledger
from nanolab.data.tokenizers import is_tokenizer_file
from nanolab.data.windows import (
    DataTooSmallError,
    IndexPlan,
    MixturePlan,
    ResumableBatchSampler,
    WindowPlan,
    evaluation_batches,
    mixture_shares,
    validation_cut,
    validation_shortfall,
    validation_starts,
)
from nanolab.home import expand_user

#: ``data.tokenizer`` when not given: a run on prepared data that leaves it out is not warned.
DEFAULT_TOKENIZER = "chars"


class TokenFile:
    """One ``.bin`` of token ids, read through ``np.memmap`` (the page cache holds it, not the
    heap), and the identity its check found (None: not checked, e.g. a benchmark's file).

    The DataModule maps a checked file right after the check, so a DataLoader worker forked
    later inherits that very mapping: a folder prepared again meanwhile (its old files unlinked)
    is not what the run reads. The map is not pickled (a copy of the whole file); a process that
    maps the file itself (a spawn or forkserver worker) opens it, compares the opened file's
    identity with the checked one and raises :class:`DataReplacedError` if they differ.
    """

    def __init__(
        self, path: Path, dtype: str | np.dtype, identity: FileIdentity | None = None
    ) -> None:
        self.path = path
        self.dtype = np.dtype(dtype)
        self.identity = identity
        #: The identity of the file this process mapped (set when it maps it).
        self.opened: FileIdentity | None = None
        self._data: np.memmap | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_data": None}

    @property
    def data(self) -> np.memmap:
        if self._data is None:
            try:
                f = open(self.path, "rb")  # noqa: SIM115 - closed below; the map outlives it
            except FileNotFoundError:
                if self.identity is None:
                    raise
                raise DataReplacedError(replaced_message(self.path)) from None
            with f:
                # The opened file's own identity (fstat): no window between check and open.
                found = file_identity(os.fstat(f.fileno()))
                if self.identity is not None and found != self.identity:
                    raise DataReplacedError(replaced_message(self.path))
                self._data = np.memmap(f, dtype=self.dtype, mode="r")
                self.opened = found
        return self._data


class TokenWindows:
    """Batches of (input, target) windows read from a token bin with ``np.memmap``.

    Indexed by an array of window starts (a whole micro-batch per call: one gather instead of
    B Python calls). The tokens come from ``file`` (the checked :class:`TokenFile`; without
    one, ``path`` is mapped unchecked on first use).
    """

    def __init__(
        self, path: Path, dtype: str, block_size: int, file: TokenFile | None = None
    ) -> None:
        self.path = path
        self.dtype = np.dtype(dtype)
        self.block_size = block_size
        self.file = file if file is not None else TokenFile(path, self.dtype)

    @property
    def data(self) -> np.memmap:
        return self.file.data

    def __len__(self) -> int:
        return len(self.data)

    def validation_keys(self, count: int) -> np.ndarray:
        """``count`` evenly spaced, fixed window starts (the same at every evaluation)."""
        return validation_starts(len(self), self.block_size, count)

    def read(self, starts: np.ndarray) -> np.ndarray:
        """``(len(starts), block_size + 1)`` int64 tokens: each window and its next token."""
        idx = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(self.block_size + 1)
        return self.data[idx].astype(np.int64)

    def __getitem__(self, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = torch.from_numpy(self.read(starts))
        return chunk[:, :-1], chunk[:, 1:]


class DocumentWindows(TokenWindows):
    """Windows of whole documents (``data.align: document``), read through a
    :class:`~nanolab.data.documents.Packing`: indexed by row number instead of token offset.

    The packing is read on first use (in the process that trains, before any DataLoader worker
    starts) from the dataset's saved one, made and saved by the first launch
    (:mod:`nanolab.data.packing_cache`), and travels with the object to workers.
    """

    def __init__(
        self,
        path: Path,
        dtype: str,
        block_size: int,
        eot_id: int,
        file: TokenFile | None = None,
    ) -> None:
        super().__init__(path, dtype, block_size, file)
        self.eot_id = eot_id
        self._packing: Packing | None = None
        #: False when the packing came from this process's cache (made for another instance).
        self.fresh = True
        #: Why the packing could not be kept for later launches (None: it is kept).
        self.cache_note: str | None = None

    @property
    def packing(self) -> Packing:
        if self._packing is None:
            tokens = self.data  # mapped first: the identity is the mapped file's
            found = packing_of(
                self.path, tokens, self.block_size + 1, self.eot_id, self.file.opened
            )
            self._packing, self.fresh, self.cache_note = found.packing, found.fresh, found.note
        return self._packing

    def __len__(self) -> int:
        """Rows (windows) of the split."""
        return self.packing.rows

    def validation_keys(self, count: int) -> np.ndarray:
        """``count`` evenly spaced, fixed rows (the same at every evaluation)."""
        return evenly_spaced(len(self), count)

    def read(self, rows: np.ndarray) -> np.ndarray:
        """``(len(rows), block_size + 1)`` int64 tokens: each row's pieces, end to end."""
        return read_rows(self.packing, self.data, rows)


class MixtureWindows:
    """Windows from several datasets' bins.

    Training keys are ``(B, 2)`` rows of (dataset, start) from :class:`MixturePlan`; evaluation
    keys are ``(dataset, starts)``, one dataset per batch, and their batches carry the dataset
    index as a third element so the module can log each dataset's loss.
    """

    def __init__(self, parts: list[TokenWindows] | list[DocumentWindows]) -> None:
        self.parts = parts

    def __getitem__(self, key: Any) -> tuple[Any, ...]:
        if isinstance(key, tuple):
            dataset, starts = key
            x, y = self.parts[dataset][starts]
            return x, y, dataset
        rows = np.asarray(key, dtype=np.int64)
        out = np.empty((len(rows), self.parts[0].block_size + 1), dtype=np.int64)
        for dataset in np.unique(rows[:, 0]):
            mine = rows[:, 0] == dataset
            out[mine] = self.parts[int(dataset)].read(rows[mine, 1])
        chunk = torch.from_numpy(out)
        return chunk[:, :-1], chunk[:, 1:]


@dataclass(frozen=True)
class DatasetPart:
    """One prepared folder of the data (the only one, or one of a mixture), checked."""

    name: str
    path: Path
    weight: float
    meta: dict[str, Any]
    fingerprint: dict[str, Any]
    #: ``train``/``val`` token files as checked, mapped right after the check.
    files: dict[str, TokenFile] = field(default_factory=dict, compare=False, repr=False)
    #: The tokenizer of the checked ``meta`` (its file inlined): what every checkpoint stores.
    tokenizer_spec: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    def file(self, split: str) -> TokenFile:
        """The token file of ``split``: the checked one (an unchecked one if none was given)."""
        return self.files.get(split) or TokenFile(self.path / f"{split}.bin", self.meta["dtype"])

    @property
    def val_bytes_per_token(self) -> float | None:
        """UTF-8 bytes per token of the validation split (None: not recorded by prepare)."""
        tokens, text_bytes = self.meta.get("val_tokens"), self.meta.get("val_bytes")
        return text_bytes / tokens if tokens and text_bytes else None


@dataclass(frozen=True)
class EvalScale:
    """How a validation batch of one dataset enters the logged metrics.

    The module logs ``loss * loss_weight`` as ``<stage>/loss`` and ``loss * overall_bpb`` as
    ``<stage>/bpb`` for every batch; Lightning averages them over windows, so with one dataset
    they are the mean loss and ``mean loss * tokens / bytes / ln 2``. For a mixture the weights
    make the overall figures the *mixture-weighted* average over datasets (each dataset has its
    own number of validation windows), and ``<stage>/<name>/loss|bpb`` are logged besides.
    """

    name: str
    loss_weight: float
    bpb: float | None  # nats per token -> bits per byte of this dataset
    overall_bpb: float | None  # the factor of this dataset's loss in the overall bits per byte


_NOTED_NO_BYTES: set[str] = set()
_NOTED_UNUSED: set[str] = set()


class TokenDataModule(L.LightningDataModule):
    """Serves a dataset prepared by ``nanolab prepare`` (and prepares it first if asked to).

    Args:
        dataset_dir: Folder holding ``train.bin``, ``val.bin`` and ``meta.json``.
        source: Text files, folders or ``bundled:shakespeare`` to prepare into ``dataset_dir``
            when it does not exist yet; ``null`` means the dataset must already be prepared.
        tokenizer: ``bytes``, ``chars``, ``bpe``, ``gpt2`` or a ``tokenizer.json`` path (used
            only when preparing ``source``; with ``source: null`` the data's own tokenizer
            trains, and a different setting is warned about).
        bpe_vocab_size: Vocabulary size of a locally trained BPE tokenizer.
        val_fraction: Share of the documents held out for validation, a seeded draw (when
            preparing).
        micro_batch_size: Sequences per device per forward pass.
        block_size: Tokens per sequence. ``null`` (the default): the model's context,
            ``model.gpt.block_size``, which ``nanolab fit`` fills in; a different value is
            refused there rather than silently replaced.
        val_windows: Number of fixed, evenly spaced validation windows (same every evaluation),
            per dataset.
        seed: Seed of the training window order (independent of the model's seed, so changing
            one does not change the other).
        num_workers: DataLoader worker processes. 0 loads in the training process, which is
            fastest for small models on CPU; 2-4 hides disk latency on GPUs.
        pin_memory: Page-locked host batches for faster copies; ``null`` = on when the run
            trains on a CUDA/ROCm device.
        prefetch_factor: Batches each worker prepares ahead (only with workers).
        datasets: A mixture instead of one folder: prepared folders with weights, e.g.
            ``[{path: data/web, weight: 0.8}, {path: data/code, weight: 0.2}]`` (an optional
            ``name`` labels the per-dataset validation metrics; default: the folder name).
            Every folder must have been prepared with the same tokenizer. When set,
            ``dataset_dir`` is not used and ``source`` must be null (docs/data.md).
        allow_changed: Resume even though the data's fingerprint (sizes, ``meta.json``,
            sampled bytes) differs from the one in the checkpoint.
        align: ``stream``: windows cut anywhere in the token stream, at a seeded offset each
            epoch (nanoGPT's way). ``document``: every window starts at a document, documents
            packed best-fit into rows and cropped where none fits (nanochat's way; the share
            of tokens cropped is printed at start, docs/data.md). Validation windows follow
            the same rule. Needs data prepared with an end-of-text token.
    """

    #: Every target of a token stream carries a loss: no masks to average over
    #: (nanolab/training/masked_targets.py; a subclass that masks sets it True).
    masked_targets: bool = False

    def __init__(
        self,
        dataset_dir: str = "data/shakespeare_char",
        source: list[str] | None = None,
        tokenizer: str = DEFAULT_TOKENIZER,
        bpe_vocab_size: int = 4096,
        val_fraction: float = 0.1,
        micro_batch_size: int = 32,
        block_size: int | None = None,
        val_windows: int = 256,
        seed: int = 1337,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        prefetch_factor: int = 4,
        datasets: list[dict[str, Any]] | None = None,
        allow_changed: bool = False,
        align: str = "stream",
    ) -> None:
        super().__init__()
        check_window_sizes(micro_batch_size, block_size, val_windows, num_workers)
        check_align(align)
        self.align = align
        self.mixture = parse_datasets(datasets)
        if self.mixture is not None and source:
            raise PrepareError(
                "data.source prepares the single folder data.dataset_dir, but data.datasets is "
                "set; prepare each folder with `nanolab prepare` and set data.source to null"
            )
        # `~` expanded as `nanolab prepare` and data.source's preparing expand it, so the folder
        # prepared is the folder read (not a literal `./~/...` then called missing).
        self.dataset_dir = (
            expand_user(dataset_dir, field="data.dataset_dir")
            if self.mixture is None
            else self.mixture[0][1]
        )
        self.source = list(source) if source else None
        self.tokenizer = tokenizer
        self.bpe_vocab_size = bpe_vocab_size
        self.val_fraction = val_fraction
        self.micro_batch_size = micro_batch_size
        self._block_size = block_size
        self.val_windows = val_windows
        self.seed = seed
        #: Set by ``nanolab fit`` for a resume of this run: the window order goes on with the
        #: checkpoint's seed (a new run from another run's checkpoint keeps its own).
        self.keep_saved_seed = False
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.prefetch_factor = prefetch_factor
        self.allow_changed = allow_changed
        self._parts: list[DatasetPart] | None = None
        self._windows: dict[str, list[Any]] = {}
        self._changed_noted = False
        #: Whether this launch resumed on other data than its checkpoint's (``allow_changed``).
        self.data_changed = False
        #: Windows of the order served before the run began on this data (a fine-tune branch
        #: with ``allow_changed`` goes on at its parent's place in the order): its ``epoch``
        #: counts passes over this data from there (:func:`nanolab.data.order.data_passes`).
        self.pass_origin = 0
        self.train_sampler: ResumableBatchSampler | None = None
        self.eval_scales: list[EvalScale] | None = None

    @property
    def block_size(self) -> int:
        """Tokens per window: set here, or by ``nanolab fit`` from ``model.gpt.block_size``."""
        if self._block_size is None:
            raise PrepareError(
                "data.block_size is not set: `nanolab fit` sets it from model.gpt.block_size; "
                "give it when using TokenDataModule on its own"
            )
        return self._block_size

    @block_size.setter
    def block_size(self, value: int) -> None:
        self._block_size = value

    # -- dataset ---------------------------------------------------------------------------
    @property
    def pass_tokens(self) -> int:
        """Tokens one pass over the training data trains on, what a run's ``epoch`` counts in
        (:func:`nanolab.data.order.data_passes`): the windows an epoch of the order serves
        (``windows_per_pass``) x ``block_size``. The split's tokens no window holds (a stream's
        slack, what document packing crops, a last partial micro-batch) are not in it."""
        plan = self.train_sampler.plan if self.train_sampler is not None else None
        if plan is None:
            plan = self.window_plan(rank_world(self.trainer)[1])
        return int(plan.windows_per_pass) * self.block_size

    @property
    def parts(self) -> list[DatasetPart]:
        """The checked dataset folders (one, or the mixture's), preparing first if asked to."""
        if self._parts is None:
            if self.mixture is None:
                if self.source is not None:
                    prepare_dataset(
                        self.source,
                        self.dataset_dir,
                        self.tokenizer,
                        self.bpe_vocab_size,
                        self.val_fraction,
                        setting_names=FIT_KEYS,
                    )
                parts = [_checked_part(self.dataset_dir.name, self.dataset_dir, 1.0)]
            else:
                parts = [
                    _checked_part(name, path, weight, f"data.datasets[{i}].path")
                    for i, (name, path, weight) in enumerate(self.mixture)
                ]
                check_same_tokenizer(parts)
            self._parts = parts
            given = {name: getattr(self, name) for name in PREPARE_ONLY}
            for unused in (
                [] if self.source else [unused_tokenizer_setting(self.tokenizer, parts[0]),
                                        unused_prepare_settings(given, parts)]
            ):  # fmt: skip
                if unused and unused not in _NOTED_UNUSED:  # once a process: fit builds more
                    _NOTED_UNUSED.add(unused)
                    rank_zero_only(messages.warn)("nanolab", unused)
        return self._parts

    @property
    def meta(self) -> dict[str, Any]:
        """``meta.json`` of the data (the first dataset's for a mixture: they share a tokenizer),
        prepared from ``source`` first if needed, and checked."""
        return self.parts[0].meta

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def tokenizer_spec(self) -> dict[str, Any] | None:
        """The data's tokenizer as checked before training (a mixture's folders share one),
        its file inlined: checkpoints store this, so ``nanolab generate`` decodes what the run
        trained on, whatever the folder holds by then."""
        return self.parts[0].tokenizer_spec

    @property
    def eot_id(self) -> int | None:
        """The end-of-text id that ends every document (None: data prepared without one)."""
        eot = self.meta.get("eot_id")
        return None if eot is None else int(eot)

    @property
    def is_mixture(self) -> bool:
        return self.mixture is not None

    def prepare_data(self) -> None:
        # Called on one process per node before setup(): the only place that writes files.
        _ = self.parts

    def setup(self, stage: str) -> None:
        meta = self.meta
        model_vocab = _model_vocab(self)
        if model_vocab is not None and model_vocab < meta["vocab_size"]:
            raise PrepareError(
                f"the data's vocabulary ({meta['vocab_size']}) is larger than model.gpt.vocab_size "
                f"({model_vocab}); set model.gpt.vocab_size to null (read from the data) "
                f"or to >= {meta['vocab_size']}"
            )
        if stage == "fit":  # validate/test never read the training split: no scan, no packing
            self.windows("train")
        self.windows("val")
        for part in self.parts:
            if part.val_bytes_per_token is None and str(part.path) not in _NOTED_NO_BYTES:
                _NOTED_NO_BYTES.add(str(part.path))
                # a nanolab note (the logger), not a Python warning with its source line
                rank_zero_only(messages.note)(
                    "nanolab",
                    f"{part.path / 'meta.json'} has no val_bytes (prepared by an older nanolab): "
                    "val_bpb is not logged; prepare the data again to log bits per byte",
                )

    @property
    def train_parts(self) -> list[Any]:
        """Every dataset folder's training windows, made on first use: ``setup("fit")`` makes
        them before training starts, a ``validate``/``test`` never does (a document-aligned
        split of a large corpus costs a scan and a packing it would not read)."""
        return self.windows("train")

    @train_parts.setter
    def train_parts(self, parts: list[Any]) -> None:
        """A fork's own training windows (one per dataset folder), used from now on."""
        self._windows["train"] = list(parts)

    @property
    def val_parts(self) -> list[Any]:
        """Every dataset folder's validation windows, made on first use (``setup`` makes them)."""
        return self.windows("val")

    @val_parts.setter
    def val_parts(self, parts: list[Any]) -> None:
        """A fork's own validation windows (one per dataset folder), used from now on."""
        self._windows["val"] = list(parts)

    @property
    def train_tokens(self) -> Any:
        """The first folder's training windows: the single-dataset name of earlier versions
        (bench, forks)."""
        return self.train_parts[0]

    @train_tokens.setter
    def train_tokens(self, windows: Any) -> None:
        """A fork's ``self.train_tokens = ...`` (in its ``setup``, as earlier versions allowed):
        the first folder's training windows from now on, the ones training reads."""
        self._windows["train"] = self._with_first("train", windows)

    @property
    def val_tokens(self) -> Any:
        """The first folder's validation windows (the single-dataset name of earlier versions)."""
        return self.val_parts[0]

    @val_tokens.setter
    def val_tokens(self, windows: Any) -> None:
        """A fork's ``self.val_tokens = ...``: the first folder's validation windows from now on."""
        self._windows["val"] = self._with_first("val", windows)

    def _with_first(self, split: str, windows: Any) -> list[Any]:
        """``split``'s windows with the first folder's replaced by ``windows``. A single dataset
        makes none of its own for that (a fork replacing them need not pay for a packing)."""
        if split not in self._windows and len(self.parts) == 1:
            return [windows]
        return [windows, *self.windows(split)[1:]]

    def windows(self, split: str) -> list[Any]:
        """The windows of ``split`` (train or val) of every dataset folder, as ``align``
        cuts them (made once; document packing reports what it dropped)."""
        if split not in self._windows:
            self._windows[split] = [
                TokenWindows(
                    p.path / f"{split}.bin", p.meta["dtype"], self.block_size, p.file(split)
                )
                if self.align == "stream"
                else self._packed(p, split)
                for p in self.parts
            ]
        return self._windows[split]

    def _packed(self, part: DatasetPart, split: str) -> DocumentWindows:
        eot = part.meta.get("eot_id")
        if eot is None:
            raise PrepareError(
                f"data.align: document needs the end-of-text id between documents, and "
                f"{part.path / 'meta.json'} records none (prepared by an older nanolab); "
                "prepare the data again, or set data.align: stream"
            )
        packed = DocumentWindows(
            part.path / f"{split}.bin", part.meta["dtype"], self.block_size, eot, part.file(split)
        )
        if len(packed) < 1:
            raise DataTooSmallError(
                f"{part.path}: the {split} split has no document-aligned row of "
                f"{self.block_size + 1} tokens; add text, lower model.gpt.block_size or set "
                "data.align: stream"
            )
        if packed.fresh:
            packing = packed.packing
            rank_zero_info(f"data.align document, {part.name} {split}: {packing.summary()}")
            if packed.cache_note:
                rank_zero_only(messages.note)("nanolab", packed.cache_note)
            if packing.dropped_tokens > 0.5 * packing.total_tokens:
                # a nanolab warning line (the logger), not a Python warning with its source line
                rank_zero_only(messages.warn)(
                    "nanolab",
                    f"data.align document keeps only {packing.used_tokens / packing.total_tokens:.0%}"
                    f" of {part.path}'s {split} tokens: its documents are mostly longer than a "
                    "window and only their first window's worth is kept; for long documents "
                    "data.align: stream trains on every token",
                )
        return packed

    def check_fits(self, world_size: int) -> None:
        """Raise :class:`DataTooSmallError` now if a split cannot fill one step or one window,
        or its validation windows cannot give every rank a batch."""
        self.window_plan(world_size)
        self.check_validation_fits(world_size)

    def check_validation_fits(self, world_size: int) -> None:
        """What ``validate``/``test`` check before they start: the validation windows give every
        rank a batch (the training split, which they never read, is not looked at)."""
        for part, windows in zip(self.parts, self._validation_sets(), strict=True):
            try:
                evaluation_batches(windows, 0, world_size, self.micro_batch_size)
            except DataTooSmallError as err:
                raise DataTooSmallError(f"{part.path}: {err}") from None
            if short := validation_shortfall(self.val_windows, len(windows), str(part.path)):
                rank_zero_only(messages.warn)("nanolab", short)
            if cut := validation_cut(len(windows), world_size, str(part.path)):
                rank_zero_only(messages.warn)("nanolab", cut)

    def _validation_sets(self) -> list[np.ndarray]:
        """Each folder's validation windows: the first ``val_windows``, evenly spaced."""
        if self.align == "document":
            return [part.validation_keys(self.val_windows) for part in self.windows("val")]
        out = []
        for part in self.parts:
            try:
                out.append(
                    validation_starts(
                        int(part.meta["val_tokens"]), self.block_size, self.val_windows
                    )
                )
            except DataTooSmallError as err:
                raise DataTooSmallError(f"{part.path}: {err}") from None
        return out

    # -- fingerprint and resume ------------------------------------------------------------
    def data_fingerprint(self) -> dict[str, Any]:
        """What the run trains on: every folder's file sizes and meta hash, and its weight."""
        return data_fingerprint_of((p.name, p.path, p.weight, p.fingerprint) for p in self.parts)

    def state_dict(self) -> dict[str, Any]:
        return {
            "data_fingerprint": self.data_fingerprint(),
            "align": self.align,
            "seed": self.seed,
            "val_windows": self.val_windows,  # an evaluation on other windows is not the run's
            "pass_origin": self.pass_origin,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        trainer = self.trainer
        if trainer is None or trainer.state.fn != "fit":
            return  # validate/test on other data is fine: it is what they are for
        self.refuse_changed_data(state_dict.get("data_fingerprint"), trainer.ckpt_path)
        origin = state_dict.get("pass_origin")
        if not self.data_changed and isinstance(origin, int) and not isinstance(origin, bool):
            self.pass_origin = max(0, origin)  # the same data: its passes go on counting
        other_align = align_change(state_dict, self.align)  # queue add asks the same rule
        if other_align is not None:
            raise DataChangedError(other_align)
        if self.keep_saved_seed and isinstance(state_dict.get("seed"), int):
            self.seed = state_dict["seed"]  # the order the run trained in goes on

    def refuse_changed_data(self, saved: dict[str, Any] | None, ckpt: Any = None) -> None:
        """Raise :class:`DataChangedError` if ``saved`` is not this data's fingerprint (unless
        ``allow_changed``, which warns once instead). ``None`` (an older checkpoint) passes."""
        if not isinstance(saved, dict):
            return
        changes = data_changes(saved, self.data_fingerprint())
        if not changes:
            return
        if not self.allow_changed:
            raise DataChangedError(changed_data_message(changes, ckpt))
        self.data_changed = True
        if not self._changed_noted:
            self._changed_noted = True
            rank_zero_only(messages.warn)("nanolab fit", allowed_change_line(changes, ckpt))

    def changed_since(self, ckpt_path: str | Path) -> str | None:
        """When ``ckpt_path`` was trained on other data than this: one line naming the data it
        trained on, the data this run points at, and what to do (None: the same data, or a
        checkpoint that does not say)."""
        saved = checkpoint_fingerprint(ckpt_path, type(self).__qualname__)
        if not isinstance(saved, dict):
            return None
        changes = data_changes(saved, self.data_fingerprint())
        if not changes:
            return None
        before = ", ".join(str(d.get("path")) for d in saved.get("datasets") or []) or "?"
        now = ", ".join(str(p.path) for p in self.parts)
        return (
            f"{ckpt_path} was trained on the data in {before}; this run points at {now} "
            f"({'; '.join(changes[:2])}): restore data.dataset_dir (or data.datasets) to the "
            "data it trained on, or start a new run (another --run.name)"
        )

    def check_resume(self, ckpt_path: str | Path | None) -> None:
        """Before a resume (or a branch) starts: refuse it if the checkpoint was trained on
        other data (unless ``data.allow_changed``). The data's tokenizer was compared with the
        checkpoint's before (``nanolab.run.compose``: ``allow_changed`` allows other text,
        never another tokenizer, whose ids would mean other tokens)."""
        if ckpt_path is None:
            return
        saved = checkpoint_fingerprint(ckpt_path, type(self).__qualname__)
        self.refuse_changed_data(saved, ckpt_path)

    # -- loaders ---------------------------------------------------------------------------
    def window_plan(self, world_size: int = 1) -> WindowPlan | IndexPlan | MixturePlan:
        rows = None
        if self.align == "document":
            rows = [len(w) for w in self.windows("train")]
            if self.mixture is None:
                try:
                    return IndexPlan(rows[0], self.micro_batch_size, world_size, self.seed)
                except DataTooSmallError:
                    packing = self.windows("train")[0].packing
                    raise DataTooSmallError(
                        f"data.align: document packs the {packing.documents:,} document(s) of "
                        f"{self.dataset_dir}'s training split into {packing.rows:,} row(s), "
                        f"fewer than micro_batch_size x devices = "
                        f"{self.micro_batch_size * world_size}; its documents are few or long: "
                        "set data.align: stream, or lower data.micro_batch_size"
                    ) from None
        if self.mixture is None:
            return WindowPlan(
                num_tokens=int(self.meta["train_tokens"]),
                block_size=self.block_size,
                micro_batch_size=self.micro_batch_size,
                world_size=world_size,
                seed=self.seed,
            )
        parts = self.parts
        return MixturePlan(
            [int(p.meta["train_tokens"]) for p in parts],
            [p.weight for p in parts],
            self.block_size,
            self.micro_batch_size,
            world_size,
            self.seed,
            [str(p.path) for p in parts],
            rows,
        )

    def _loader(self, dataset: Any, sampler: Any) -> DataLoader:
        pin = pins_memory(self.pin_memory, self.trainer)
        workers = self.num_workers
        return DataLoader(
            dataset,
            sampler=sampler,
            batch_size=None,  # the sampler yields whole micro-batches
            num_workers=workers,
            pin_memory=pin,
            prefetch_factor=self.prefetch_factor if workers > 0 else None,
            persistent_workers=workers > 0,
            generator=loader_generator(self.seed),
        )

    def train_dataloader(self) -> DataLoader:
        self.train_sampler = resumable_sampler(self)
        dataset = self.train_parts[0] if self.mixture is None else MixtureWindows(self.train_parts)
        return self._loader(dataset, self.train_sampler)

    def val_dataloader(self) -> DataLoader:
        rank, world = rank_world(self.trainer)
        keys: list[Any] = []
        counts = []
        for d, part in enumerate(self.val_parts):
            starts = part.validation_keys(self.val_windows)
            counts.append(len(starts) // world * world)  # what the ranks score together
            for batch in evaluation_batches(starts, rank, world, self.micro_batch_size):
                keys.append(batch if self.mixture is None else (d, batch))
        self.eval_scales = eval_scales(self.parts, counts)
        dataset = self.val_parts[0] if self.mixture is None else MixtureWindows(self.val_parts)
        return self._loader(dataset, keys)

    test_dataloader = val_dataloader


def _checked_part(
    name: str, path: Path, weight: float, field: str = "data.dataset_dir"
) -> DatasetPart:
    meta = load_meta(path, field)
    checked = check_files(path, meta)
    prints = fingerprint(path)
    # Mapped now, in this process, and only if still the files the check saw: what the run reads
    # is what was checked and fingerprinted (one replaced since the check is refused here, and
    # forked DataLoader workers inherit these maps).
    files = {
        split: TokenFile(path / f"{split}.bin", meta["dtype"], identity)
        for split, identity in checked.items()
    }
    for file in files.values():
        _ = file.data
    spec = checked_tokenizer_spec(path, meta)
    return DatasetPart(name, path, weight, meta, prints, files, spec)


def unused_tokenizer_setting(setting: str, part: DatasetPart) -> str | None:
    """The warning for a ``data.tokenizer`` that differs from the prepared data's (None: it
    is the default, or names the data's own tokenizer). It applies only when fit prepares
    ``data.source``; without one the run trains on the tokenizer the data was prepared with,
    and a config that names another would say something false about the run."""
    spec = part.meta.get("tokenizer")
    used = spec.get("name") if isinstance(spec, dict) else None
    if setting in (DEFAULT_TOKENIZER, used) or used is None:
        return None
    own = part.path / "tokenizer.json"
    if (
        used == "hf"
        and is_tokenizer_file(setting)
        and same_tokenizer_json(expand_user(setting, field="data.tokenizer"), own)
    ):
        return None  # the very tokenizer.json the data was prepared with
    return (
        f"data.tokenizer {setting} is not used: it applies only when fit prepares data.source, "
        f"which is null, so this run trains on the tokenizer {part.path} was prepared with "
        f"({used}); set data.tokenizer: {used if used != 'hf' else 'its tokenizer.json'} or "
        "leave it out, or set data.source to prepare the data with it"
    )


#: Settings fit passes on only when it prepares ``data.source`` (besides ``data.tokenizer``),
#: and the ``meta.json`` field that records what the data was prepared with.
PREPARE_ONLY = {"bpe_vocab_size": "settings.bpe_vocab_size", "val_fraction": "val_fraction"}


def unused_prepare_settings(given: dict[str, Any], parts: list[DatasetPart]) -> str | None:
    """The warning for ``data.bpe_vocab_size`` / ``data.val_fraction`` set while
    ``data.source`` is null (None: none is). They only steer preparing; the run trains on the
    folder as it was prepared, and a config that says otherwise (its ``config.yaml`` records
    them) would say something false about the run. A setting at its default, or at the value
    the data was prepared with, says nothing false and is passed over."""
    import inspect

    defaults = inspect.signature(TokenDataModule.__init__).parameters
    unused = {
        name: value
        for name, value in given.items()
        if value != defaults[name].default
        and any(prepared_with(part, name) != value for part in parts)
    }
    if not unused:
        return None
    settings = " and ".join(f"data.{name} {value}" for name, value in unused.items())
    one = len(unused) == 1
    if len(parts) == 1:
        record = ", ".join(f"{n} {json.dumps(prepared_with(parts[0], n))}" for n in unused)
        prepared = f"{parts[0].path} as it was prepared (its meta.json: {record})"
    else:
        prepared = "the data.datasets folders as they were prepared (each one's meta.json)"
    return (
        f"{settings} {'is' if one else 'are'} not used: {'it applies' if one else 'they apply'}"
        f" only when fit prepares data.source, which is null, so this run trains on {prepared};"
        f" leave {'it' if one else 'them'} out, or set data.source to prepare the data with "
        f"{'it' if one else 'them'}"
    )


def prepared_with(part: DatasetPart, name: str) -> Any:
    """What ``part``'s ``meta.json`` records for the prepare setting ``name`` (None: nothing,
    e.g. no BPE vocabulary for a chars tokenizer, or data prepared by an older nanolab; said
    as ``null`` in the warning, as the file has it)."""
    node: Any = part.meta
    for key in PREPARE_ONLY[name].split("."):
        node = node.get(key) if isinstance(node, dict) else None
    return node


def same_tokenizer_json(given: Path, own: Path) -> bool:
    """Whether two tokenizer.json files hold the same tokenizer. Equal bytes say so at once;
    else each is read by the tokenizers library and written back in its own form: a file it
    did not write byte for byte (pretty-printed by hand, an older hub file) is the same
    tokenizer as its copy in a dataset. A file either side cannot read is not the same."""
    try:
        if given.read_bytes() == own.read_bytes():
            return True
        from tokenizers import Tokenizer as RustTokenizer

        return RustTokenizer.from_file(str(given)).to_str() == (
            RustTokenizer.from_file(str(own)).to_str()
        )
    except Exception:  # unreadable or not a tokenizer (any library error): not the same one
        return False


def _tokenizer_identity(part: DatasetPart) -> tuple[str, str]:
    """(description, identity) of a dataset's tokenizer: equal identity = interchangeable ids."""
    import hashlib
    import json

    spec = part.meta.get("tokenizer")
    vocab = part.meta["vocab_size"]
    name = spec.get("name", "?") if isinstance(spec, dict) else "?"
    files = sorted(part.path.glob("tokenizer*.json"))
    blob = json.dumps([spec, vocab], sort_keys=True).encode()
    for f in files:
        blob += hashlib.sha256(f.read_bytes()).digest()
    return f"{name}, vocab {vocab}", hashlib.sha256(blob).hexdigest()


def check_same_tokenizer(parts: list[DatasetPart]) -> None:
    """A mixture's token ids must mean the same text in every folder."""
    first_desc, first_id = _tokenizer_identity(parts[0])
    for part in parts[1:]:
        desc, ident = _tokenizer_identity(part)
        if ident != first_id:
            same = " (same name, other alphabet or merges)" if desc == first_desc else ""
            raise DataCheckError(
                f"data.datasets: {parts[0].path} and {part.path} were prepared with different "
                f"tokenizers ({first_desc} vs {desc}){same}; a mixture needs one tokenizer: "
                "prepare every folder with the same --tokenizer (bytes, gpt2, or one "
                "tokenizer.json file; chars and a locally trained bpe differ per corpus)"
            )


def eval_scales(parts: list[DatasetPart], window_counts: list[int]) -> list[EvalScale]:
    """Per-dataset factors of the logged validation metrics (see :class:`EvalScale`)."""
    total_windows = sum(window_counts)
    shares = mixture_shares([p.weight for p in parts])
    per_token = [p.val_bytes_per_token for p in parts]
    # Bytes per token of the mixture: each dataset's, weighted by its share of the tokens.
    mixed = None
    if all(b is not None for b in per_token):
        mixed = sum(s * b for s, b in zip(shares, per_token, strict=True))  # type: ignore[operator]
    scales = []
    for part, share, count, b in zip(parts, shares, window_counts, per_token, strict=True):
        loss_weight = 1.0 if len(parts) == 1 else share * total_windows / count
        scales.append(
            EvalScale(
                name=part.name,
                loss_weight=loss_weight,
                bpb=None if b is None else 1.0 / (b * math.log(2)),
                overall_bpb=None if mixed is None else loss_weight / (mixed * math.log(2)),
            )
        )
    return scales


def consumed_micro_batches(trainer: Any) -> int:
    """Micro-batches this run has trained on so far (restored from a checkpoint on resume)."""
    if trainer is None:
        return 0
    return int(trainer.fit_loop.epoch_loop.batch_progress.total.processed)


def pins_memory(setting: bool | None, trainer: Any) -> bool:
    """Whether the loaders page-lock their batches: ``setting`` when given; otherwise when the
    run trains on a CUDA/ROCm device (the trainer's root device), not merely when the host has
    one: a CPU run on a GPU host neither pins nor touches CUDA."""
    if setting is not None:
        return bool(setting)
    strategy = getattr(trainer, "strategy", None)
    device = getattr(strategy, "root_device", None)
    return getattr(device, "type", None) == "cuda"


def loader_generator(seed: int) -> torch.Generator:
    """A loader's own RNG. Each new iterator of a DataLoader draws its workers' base seed, from
    the global torch RNG unless the loader has a generator: a validation (or a first one after a
    resume, whose persistent workers start then) would move the RNG that dropout trains with, and
    a resumed run would part from the uninterrupted one at its first evaluation. The windows
    themselves never depend on it (they are a function of the data seed and the step)."""
    return torch.Generator().manual_seed(int(seed))


def rank_world(trainer: Any) -> tuple[int, int]:
    """(rank, world size) of ``trainer``; (0, 1) without one."""
    return (0, 1) if trainer is None else (trainer.global_rank, trainer.world_size)


def resumable_sampler(dm: Any) -> ResumableBatchSampler:
    """This rank's micro-batches of ``dm.window_plan``, from where the run's checkpoint (and
    its rollbacks) left the order, in this launch's micro-batches (:mod:`nanolab.data.order`)."""
    rank, world = rank_world(dm.trainer)
    plan = dm.window_plan(world)
    start = consumed_micro_batches(dm.trainer)
    skips, skipped = sampler_jumps(dm.trainer, plan, start)
    for line in skipped if rank == 0 else ():
        messages.warn("nanolab fit", line)
    sampler = ResumableBatchSampler(plan, rank, start, skips)
    unit = unit_of(plan)
    if getattr(dm, "data_changed", False) and unit is not None:
        dm.pass_origin = sampler.position(start) * unit  # its first pass over this data begins
    return sampler


def rollback_jumps(trainer: Any) -> list[Jump]:
    """The data a rollback skipped in this run (its ``rollbacks.json``; none without one)."""
    if trainer is None:
        return []
    return jumps(read_ledger(getattr(trainer, "default_root_dir", None)))


def _model_vocab(dm: TokenDataModule) -> int | None:
    module = getattr(dm.trainer, "lightning_module", None)
    return getattr(getattr(module, "gpt_config", None), "vocab_size", None)
