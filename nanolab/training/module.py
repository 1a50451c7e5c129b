"""The LightningModule: a GPT, its optimizer and schedule, and what an exact resume needs."""

from __future__ import annotations

import os
import random
from dataclasses import asdict, replace
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info

from nanolab.data.order import ORDER_KEY, SavedOrder, order_record, saved_order
from nanolab.messages import warn
from nanolab.model import GPT, GPTConfig
from nanolab.model.config import ConfigError
from nanolab.model.gpt import check_parts
from nanolab.model.registry import part_modules
from nanolab.training.branch import BRANCH_KEEPS, BranchLR
from nanolab.training.class_settings import CLASSES_KEY, classes_record
from nanolab.training.freeze import FreezeConfig, apply_freeze
from nanolab.training.fused_amp import clip_gradients, handles_unscaling, step_closure
from nanolab.training.grad_norm import (
    clip_with_norm,
    norm_of,
    plain_on_one_device,
    scale_gradients,
)
from nanolab.training.masked_targets import (
    declares_masked_targets,
    holds_masked_targets,
    loss_or_zero,
    no_loss_as_nan,
    target_count,
    undeclared_masks_line,
    worth_a_look,
)
from nanolab.training.optim import (
    OptimizerConfig,
    ScheduleConfig,
    build_optimizer,
    lr_schedule,
    planned_steps,
)

CHECKPOINT_KEY = "nanolab"
#: Each optimizer step's training loss, in ``trainer.callback_metrics``: the mean over all its
#: micro-batches on all ranks, and over all their targets where the data module declares masked
#: ones (the same number whatever the layout of one global batch: see
#: :meth:`GPTLightningModule.training_step`).
TRAIN_LOSS = "train/loss"


class GPTLightningModule(L.LightningModule):
    """Trains a :class:`~nanolab.model.GPT` with next-token cross-entropy.

    Args:
        gpt: The architecture (``model.gpt`` in YAML).
        optimizer: Optimizer settings (``model.optimizer``; a registered name, docs/optimizers.md).
        schedule: Warmup + cosine LR schedule, stepped every optimizer step (``model.schedule``).
        compile: ``torch.compile`` the model (in place, so checkpoint keys do not change).
            Costs a minute of start-up; pays off on GPUs for runs longer than a few minutes.
        compile_mode: ``torch.compile`` mode (``null``, ``"max-autotune"``, ...).
        init_from: A local Hugging Face GPT-2 or Llama folder, or a ``nanolab export --format
            safetensors`` folder (any nanolab model), to start from (docs/hf.md): the architecture
            and the weights come from it (``model.gpt`` keys left at their defaults take its
            values), ``block_size`` may cut its positions. ``null`` = random initialisation.
        freeze: Parts that fine-tuning leaves unchanged (``model.freeze.embeddings``,
            ``model.freeze.blocks``: the first N blocks).
    """

    def __init__(
        self,
        gpt: GPTConfig = GPTConfig(),
        optimizer: OptimizerConfig = OptimizerConfig(),
        schedule: ScheduleConfig = ScheduleConfig(),
        compile: bool = False,
        compile_mode: str | None = None,
        init_from: str | None = None,
        freeze: FreezeConfig = FreezeConfig(),
    ) -> None:
        super().__init__()
        # Copies: the defaults are shared instances, and vocab_size may be filled in later.
        self.gpt_config = replace(gpt)
        self.optimizer_config = replace(optimizer)
        self.schedule_config = replace(schedule)
        self.compile = compile
        self.compile_mode = compile_mode
        self.init_from = init_from
        self.freeze_config = replace(freeze)  # not `freeze`: LightningModule.freeze() exists
        if init_from is not None:
            from nanolab.model.hf import resolve_architecture

            arch = resolve_architecture(asdict(self.gpt_config), init_from)
            self.gpt_config = GPTConfig(**arch)
        self.model: GPT | None = None
        self._pending_rng: dict[str, Any] | None = None
        self._live_callback_metrics: bool | None = None  # per fit: publish_train_loss's route
        # This optimizer step's micro-batch losses so far: their sum (on the device) and count.
        self._step_loss: torch.Tensor | None = None
        self._step_micro_batches = 0
        # Per fit: the data module declares masked targets (nanolab/training/masked_targets.py),
        # so the steps average over targets; else whether its batches are still to be checked
        # for masks it did not declare (rank 0, until found).
        self._masked_targets = False
        self._mask_check_pending = False
        # With masked targets only: the step's targets that carry a loss (on the device), and
        # its target slots, masked or not (on the host), while its micro-batches run.
        self._step_targets: torch.Tensor | None = None
        self._step_slots = 0
        #: With masked targets only: what this optimizer step's gradients are multiplied by
        #: before the clip, its target slots over its targets (all ranks; a float32 device
        #: scalar, exactly 1.0 without masks); None on every other step.
        self._gradient_scale: torch.Tensor | None = None
        #: With masked targets only: the targets that carried a loss in the optimizer step that
        #: ended last, over all ranks (an int64 device scalar); None on every other path. A step
        #: of 0 has no loss: ``train/loss`` is NaN (the run log writes null), and the spike
        #: guard and the divergence stop leave it out (:func:`~nanolab.training.masked_targets.
        #: no_loss_as_nan`).
        self.step_target_count: torch.Tensor | None = None
        #: This optimizer step's global gradient norm (before clipping; float32, on the device)
        #: when the clip or a reader needed it; None otherwise. See configure_gradient_clipping.
        self.step_gradient_norm: torch.Tensor | None = None
        self._norm_requested = False
        self._whole_gradients: bool | None = None  # per fit: no strategy shards the gradients
        self._param_list: list[torch.nn.Parameter] | None = None  # per fit, listed once
        #: Where the checkpoint a fit resumes from left the data order (None: a new run).
        self.restored_order: SavedOrder | None = None
        #: The other run's checkpoint this fit branches from (set by ``nanolab fit``): the
        #: optimizer's state comes from it, its settings and schedule from this run's config
        #: (:mod:`nanolab.training.branch`). None: a new run, or a resume of the run itself.
        self.branched_from: str | None = None
        #: The model and data classes of the run and their own settings (set by ``nanolab
        #: fit``, :func:`~nanolab.training.class_settings.classes_record`): every checkpoint
        #: records them, so a resume that changes one is refused and ``generate``/``export``
        #: can name the class that trained. None: the class paths alone, read at each save.
        self.class_record: dict[str, Any] | None = None
        check_parts(self.gpt_config)  # parts of one's own: one line now, not at step 1
        if self.gpt_config.vocab_size is not None:
            self.model = self._build_model()

    # -- model construction ----------------------------------------------------------------
    def configure_model(self) -> None:
        """Build (if the vocabulary was only known from the data), shard under FSDP2, compile."""
        if self.model is None:
            if self.gpt_config.vocab_size is None:
                dm = getattr(self.trainer, "datamodule", None)
                if dm is None or not hasattr(dm, "vocab_size"):
                    raise ValueError(
                        "model.gpt.vocab_size is null and no datamodule provides it; set it"
                    )
                self.gpt_config.vocab_size = int(dm.vocab_size)
            self.model = self._build_model()
        if getattr(self, "_device_mesh", None) is not None and not getattr(self, "_sharded", False):
            from nanolab.training.strategies import apply_fsdp2

            apply_fsdp2(self.model, self.device_mesh)
            self._sharded = True
        if self.compile and not getattr(self, "_compiled", False):
            self.model.compile(mode=self.compile_mode)
            self._compiled = True

    def _build_model(self) -> GPT:
        """The GPT, with the ``init_from`` weights (a resume then overwrites them) and the
        ``freeze`` settings applied before any sharding or compiling."""
        model = GPT(self.gpt_config)
        if self.init_from is not None:
            from nanolab.model.hf import load_hf_weights

            load_hf_weights(model, self.init_from)
        apply_freeze(model, self.freeze_config)
        return model

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        assert self.model is not None, "call configure_model() first"
        return self.model(idx, targets)

    # -- steps -----------------------------------------------------------------------------
    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        """One micro-batch: its loss. The optimizer step's loss is the mean of its micro-batches'
        (:meth:`_step_mean_loss`); with a data module that declares masked targets, the mean
        over all its targets instead (:meth:`_masked_training_step`)."""
        if self._masked_targets:
            return self._masked_training_step(batch)
        x, y = batch
        _, loss = self(x, y)
        # Summed on the device (no host sync); published on the micro-batch that ends the
        # optimizer step only, for less host time per micro-batch. The first is kept as a copy:
        # under CUDA graphs (``compile_mode: reduce-overhead``) ``loss`` is the graph's output
        # buffer, which the next micro-batch's replay overwrites (a sum is a new tensor).
        done = loss.detach()
        self._step_loss = done.clone() if self._step_loss is None else self._step_loss + done
        self._step_micro_batches += 1
        if self._ends_optimizer_step():
            self.publish_train_loss(self._step_mean_loss())
        return loss

    def _step_mean_loss(self) -> torch.Tensor:
        """The loss of the optimizer step that ends now: the mean over its micro-batches and,
        with several ranks, over the ranks (each holds as many). One all-reduce of a device
        scalar: it queues on the device like the gradients' and adds no host sync. Rank 0's last
        micro-batch alone would be a quarter of a step's batch on 2 ranks with accumulation 2,
        and a number that changes with the layout of one global batch."""
        assert self._step_loss is not None
        mean = self._step_loss / self._step_micro_batches
        self._step_loss, self._step_micro_batches = None, 0
        if self._sum_over_ranks(mean):
            mean = mean / self.trainer.world_size
        return mean

    def _masked_training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """One micro-batch of data with masked targets: its loss, weighted so the optimizer step
        averages over targets.

        The step's loss is one mean over every target of all its micro-batches on all ranks
        that carries a loss (``y != -1``), whatever the layout of the global batch: with masked
        targets, micro-batches hold different numbers of them, and a mean of micro-batch means
        would weigh a target by how few shared its micro-batch. The count of the whole step is
        known only at its end, so each micro-batch's mean is weighted by its targets over its
        slots (exactly 1.0 for a batch without masks) and the step's gradients are multiplied
        by its slots over its targets before the clip (:meth:`configure_gradient_clipping`). A
        micro-batch without any target adds 0 (``loss_or_zero``). The counts stay on the device:
        no host sync. Only for a data module that declares masks
        (nanolab/training/masked_targets.py): it costs every step.
        """
        x, y = batch
        _, loss = self(x, y)
        targets = target_count(y)
        weighted = loss_or_zero(loss, targets) * (targets / y.numel())
        done = weighted.detach()
        first = self._step_loss is None
        self._step_loss = done if first else self._step_loss + done
        self._step_targets = targets if first else self._step_targets + targets
        self._step_slots += y.numel()
        self._step_micro_batches += 1
        if self._ends_optimizer_step():
            self.publish_train_loss(self._masked_step_mean_loss())
        return weighted

    def _masked_step_mean_loss(self) -> torch.Tensor:
        """The loss of the optimizer step that ends now, the mean over all its targets on all
        ranks, and the step's gradient scale (:attr:`_gradient_scale`) with it.

        The micro-batch losses come weighted by their share of targets: their mean over the
        micro-batches and ranks, times the step's slots over its targets, is the mean over the
        targets. Two all-reduces of device scalars with several ranks: they queue on the device
        like the gradients' and add no host sync. A step without any target has gradients 0
        and no loss: NaN, which the run log writes as null (0 would read as a perfect step),
        with :attr:`step_target_count` 0 for the readers that must tell it from a NaN of the
        model's (:func:`~nanolab.training.masked_targets.no_loss_as_nan`)."""
        assert self._step_loss is not None and self._step_targets is not None
        mean = self._step_loss / self._step_micro_batches
        targets = self._step_targets
        counts = torch.stack((targets, targets.new_full((), self._step_slots)))
        self._step_loss, self._step_micro_batches = None, 0
        self._step_targets, self._step_slots = None, 0
        if self._sum_over_ranks(mean):
            mean = mean / self.trainer.world_size
            self._sum_over_ranks(counts)
        self._gradient_scale = counts[1] / counts[0].clamp(min=1)
        self.step_target_count = counts[0]
        return no_loss_as_nan(mean * self._gradient_scale, counts[0])

    def _sum_over_ranks(self, tensor: torch.Tensor) -> bool:
        """All-reduce (sum) the device ``tensor`` in place over the ranks, if there are several
        (True); False, and nothing done, in a single process."""
        world = self.trainer.world_size if self._trainer is not None else 1
        if world > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
            return True
        return False

    def publish_train_loss(self, loss: torch.Tensor) -> None:
        """Put ``loss`` in ``trainer.callback_metrics["train/loss"]``, where the run log, the
        progress bar and a fork's callbacks read it (no host-device sync: it stays a tensor).

        ``self.log("train/loss", loss)`` would put it there too, at ~0.35 ms of host time a
        call (Lightning re-applies its result object's ``.to(device)``, a walk that deep-copies
        its metadata), a third of what nanolab adds to a step (docs/performance.md). So the
        value goes straight into the dict Lightning hands its callbacks, when that dict is the
        one it keeps (checked once per fit); else, through ``self.log``. Not a progress-bar
        value either way: Lightning ``.item()``s those at every micro-batch.
        """
        if self._trainer is None:
            return
        if self._live_callback_metrics is None:
            self._live_callback_metrics = callback_metrics_are_live(self.trainer)
        if self._live_callback_metrics:
            self.trainer.callback_metrics[TRAIN_LOSS] = loss.detach()
        else:
            self.log(TRAIN_LOSS, loss)

    def _ends_optimizer_step(self) -> bool:
        """Whether the current micro-batch ends an optimizer step: Lightning's own test (its
        accumulation counter, the epoch's last batch); True where that cannot be asked (no fit
        loop running, or a Lightning that moved it), which logs every micro-batch as before."""
        try:
            return not self.trainer.fit_loop.epoch_loop._should_accumulate()
        except Exception:
            return True

    def validation_step(self, batch: tuple[Any, ...], batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch: tuple[Any, ...], batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def _eval_step(self, batch: tuple[Any, ...], stage: str) -> None:
        """Log ``<stage>/loss`` and, when the data records its bytes, ``<stage>/bpb``.

        Bits per byte (loss in nats/token x tokens/bytes / ln 2) compare runs across tokenizers.
        Both are linear in the loss, so Lightning's average over batches gives the epoch value.
        Each batch weighs its targets that carry a loss, counted in windows (a float32 device
        scalar, exactly the window count without masks, as before; Lightning sums it on the
        device): the value is one mean over all validation targets, whatever the micro-batch
        size, and a batch without any target adds nothing. For every data module, declared
        masks or not: validation is not the hot path, and a count costs no host sync.
        A mixture's batches carry their dataset index third: each dataset's loss and bpb are
        logged as ``<stage>/<name>/...`` and the overall values are mixture-weighted
        (:class:`~nanolab.data.datamodule.EvalScale` says how).
        """
        x, y = batch[0], batch[1]
        part = int(batch[2]) if len(batch) > 2 else 0
        _, loss = self(x, y)
        count = target_count(y)
        loss = loss_or_zero(loss, count)
        n = count / y.size(-1)  # Lightning weighs by it; may be a tensor (no sync)
        scales = getattr(getattr(self._trainer, "datamodule", None), "eval_scales", None)
        if not scales:
            self.log(f"{stage}/loss", loss, prog_bar=stage == "val", sync_dist=True, batch_size=n)
            return
        scale = scales[part]
        weighted = loss if scale.loss_weight == 1.0 else loss * scale.loss_weight
        self.log(f"{stage}/loss", weighted, prog_bar=stage == "val", sync_dist=True, batch_size=n)
        if scale.overall_bpb is not None:
            self.log(f"{stage}/bpb", loss * scale.overall_bpb, sync_dist=True, batch_size=n)
        if len(scales) > 1:
            self.log(f"{stage}/{scale.name}/loss", loss, sync_dist=True, batch_size=n)
            if scale.bpb is not None:
                self.log(
                    f"{stage}/{scale.name}/bpb", loss * scale.bpb, sync_dist=True, batch_size=n
                )

    # -- optimization ----------------------------------------------------------------------
    def configure_optimizers(self) -> dict[str, Any]:
        assert self.model is not None
        from nanolab.training.strategies import offloads_optimizer

        strategy = self.trainer.strategy if self._trainer is not None else None
        offload = strategy is not None and offloads_optimizer(strategy)
        opt = build_optimizer(
            self.model,
            self.optimizer_config,
            self.device,
            cpu_offload=offload,
            sharded=shards_parameters(strategy),
        )
        planned = planned_steps(self.trainer, self) if self._trainer is not None else -1
        plan = lr_schedule(self.schedule_config, planned)
        if self.branched_from is None or self._trainer is None:
            schedule = torch.optim.lr_scheduler.LambdaLR(opt, plan)
        else:
            # A branch's scheduler gives the optimizer this run's settings back once the
            # parent's state is restored into both, and plans its cosine from the parent's
            # step, known only then (nanolab.training.branch).
            schedule = BranchLR(opt, plan, replan=self._branch_schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def _branch_schedule(self) -> Any:
        """The branch's LR multiplier planned from the step the parent's state restored: its
        own ``model.schedule``, to where ``trainer.max_steps`` or its budget stops it."""
        return lr_schedule(self.schedule_config, planned_steps(self.trainer, self))

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        """Step, then free the gradients at once (``set_to_none``).

        Under fp16 with an optimizer that unscales inside its step (fused AdamW), the gradients
        are unscaled right after the backward instead (:mod:`nanolab.training.fused_amp`), so
        the logged gradient norm and the clip see true gradients.

        Lightning's own ``zero_grad`` runs inside the next step's closure, *after* its forward,
        so the previous gradients would sit in memory through the whole forward: one
        gradient-sized buffer on top of the activations at the peak (3-15% measured on small
        GPTs, see docs/estimator.md). Nothing reads them after the step (the gradient norm is
        taken before it), and the estimator models exactly this order.
        """
        closure = step_closure(self.trainer, optimizer, optimizer_closure)
        super().optimizer_step(epoch, batch_idx, optimizer, closure)
        optimizer.zero_grad(set_to_none=True)

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Take the step's gradient norm once (:mod:`nanolab.training.grad_norm`) and clip.

        Lightning calls this after every ``on_before_optimizer_step`` hook and before the step,
        with the gradients unscaled under fp16: the norm the run log and the divergence stop
        read (:attr:`step_gradient_norm`) is the one the clip used. Clipping by norm reuses it
        where every rank holds whole gradients as plain tensors on one device (one device, DDP);
        sharded gradients (FSDP2, FSDP) take Lightning's clip, DeepSpeed's engine clips itself.
        A fused optimizer is clipped here too (Lightning's AMP plugin refuses to,
        nanolab/training/fused_amp.py says why).

        With a data module that declares masked targets, the step's gradients are first made
        the mean over its targets (times :attr:`_gradient_scale`, :meth:`_masked_training_step`
        says why); where the clip by norm runs on whole gradients, that factor rides on the
        clip's own multiply (no second pass over the gradients), and the norm taken is the
        scaled gradients'. Without the declaration there is no scale, and nothing of this runs.
        """
        requested, self._norm_requested = self._norm_requested, False
        scale, self._gradient_scale = self._gradient_scale, None
        self.step_gradient_norm = None
        if self._engine_clips():  # its gradients are not in .grad; it reports its own norm
            super().configure_gradient_clipping(
                optimizer, gradient_clip_val, gradient_clip_algorithm
            )
            return
        clip_val = float(gradient_clip_val or 0.0)
        algorithm = str(gradient_clip_algorithm or "norm").lower()
        by_norm = clip_val > 0 and not algorithm.endswith("value")
        if by_norm or requested or scale is not None:
            params = self._params_with_grads()
            grads = [p.grad for p in params]
            folds = (
                by_norm and bool(grads) and self._gradients_whole() and plain_on_one_device(grads)
            )
            if scale is not None and grads and not folds:
                scale_gradients(grads, scale)
            if by_norm or requested:
                norm = norm_of(grads)
                if folds and scale is not None and norm is not None:
                    norm = norm * scale
                self.step_gradient_norm = norm
                if folds and norm is not None:
                    clip_with_norm(params, clip_val, norm, scale)
                    return
        if clip_val <= 0:
            return
        if handles_unscaling(optimizer):
            clip_gradients(optimizer, clip_val, gradient_clip_algorithm or "norm")
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def request_gradient_norm(self) -> None:
        """Have this optimizer step's gradient norm taken into :attr:`step_gradient_norm` even
        if the clip does not need it (the run log and the divergence stop ask in their
        ``on_before_optimizer_step``, and read it once the step is done)."""
        self._norm_requested = True

    def takes_gradient_norm(self) -> bool:
        """Whether :meth:`configure_gradient_clipping` (this class's, not overridden) runs every
        optimizer step (automatic optimization): then readers request the norm and read
        :attr:`step_gradient_norm`, else they take their own in ``on_before_optimizer_step``."""
        hook = type(self).configure_gradient_clipping
        return (
            self.automatic_optimization and hook is GPTLightningModule.configure_gradient_clipping
        )

    def _params_with_grads(self) -> list[torch.nn.Parameter]:
        if self._param_list is None:
            self._param_list = list(self.parameters())
        return [p for p in self._param_list if p.grad is not None]

    def _gradients_whole(self) -> bool:
        """Whether each rank holds whole gradients (no FSDP / DeepSpeed sharding), per fit."""
        if self._whole_gradients is None:
            strategy = self.trainer.strategy if self._trainer is not None else None
            self._whole_gradients = not shards_parameters(strategy)
        return self._whole_gradients

    def _engine_clips(self) -> bool:
        """DeepSpeed clips inside its engine (``gradient_clipping`` in its config)."""
        from lightning.pytorch.strategies import DeepSpeedStrategy

        return isinstance(self.trainer.strategy, DeepSpeedStrategy)

    # -- checkpoint contents ---------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Store the architecture as plain data and every RNG stream an exact resume needs.

        Plain data only (no pickled classes), so checkpoints load with ``weights_only=True``.
        """
        checkpoint[CHECKPOINT_KEY] = {
            "gpt": asdict(self.gpt_config),
            "optimizer": {
                **asdict(self.optimizer_config),
                "betas": list(self.optimizer_config.betas),
            },
            "schedule": asdict(self.schedule_config),
            # Which parameters train (and so which the optimizer state is for): a resume with
            # another model.freeze is refused naming these (nanolab.run.compose).
            "freeze": asdict(self.freeze_config),
            "rng": capture_rng_state(),
            # Each rank's own streams (dropout draws differ per rank): one list, gathered here
            # on every rank, in whichever file the strategy's rank 0 writes.
            "rng_by_rank": self._rng_by_rank(),
            # The run's seed (Lightning's seed_everything records it here): a resume keeps it.
            "seed_everything": _global_seed(),
            "tokenizer": self._tokenizer_spec(),
            "layout": self._layout(),
            # Where the next micro-batch starts in the data order, and in which layout's
            # micro-batches: a resume on another layout goes on at the same window.
            ORDER_KEY: order_record(self._trainer) if self._trainer is not None else None,
            # The precision it trains in: a resume under another one says so.
            "precision": str(self._trainer.precision) if self._trainer is not None else None,
            # The modules that registered this model's own parts (none for built-ins): a
            # command that loads the checkpoint names them in its --import hint.
            "part_modules": part_modules(self.gpt_config),
            # Which classes trained (a fork's own, with its own settings): a resume that
            # changes such a setting is refused; generate/export name a class that builds
            # another network than nanolab's GPT.
            CLASSES_KEY: self.class_record or self._classes_now(),
        }

    def _classes_now(self) -> dict[str, Any]:
        """The class paths of this module and its data, without their settings (a fit that
        ``nanolab fit`` did not launch)."""
        dm = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        return classes_record(self, None, dm, None)

    def _rng_by_rank(self) -> list[dict[str, Any]] | None:
        """Every rank's RNG streams, in rank order; None with one process. Collective: the
        strategies save on every rank (``Trainer.save_checkpoint`` must be called on all)."""
        if self._trainer is None or self.trainer.world_size < 2:
            return None
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return None
        gathered: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, capture_rng_state())
        return gathered

    def _layout(self) -> dict[str, int] | None:
        """Devices x accumulation x micro-batch of this run, so a resume on another number of
        devices can say what changed (and keep the data order: see ``realign_progress``)."""
        if self._trainer is None:
            return None
        from lightning.pytorch.strategies import ModelParallelStrategy

        dm = getattr(self.trainer, "datamodule", None)
        return {
            "world_size": int(self.trainer.world_size),
            "accumulate": int(self.trainer.accumulate_grad_batches or 1),
            "micro_batch_size": int(getattr(dm, "micro_batch_size", 0) or 0),
            # Which strategy wrote the optimizer state: FSDP2's loads back onto FSDP2 shards.
            "fsdp2": isinstance(self.trainer.strategy, ModelParallelStrategy),
        }

    def _tokenizer_spec(self) -> dict[str, Any] | None:
        """The data's tokenizer, so ``nanolab generate`` needs nothing but the checkpoint: the
        one the DataModule checked before training (``tokenizer_spec``), not what the dataset
        folder holds at save time (prepared again, or its tokenizer.json lost, meanwhile). A
        DataModule of a fork without ``tokenizer_spec`` gives its folder's, read at first save."""
        dm = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        if hasattr(dm, "tokenizer_spec"):
            return dm.tokenizer_spec
        dataset_dir = getattr(dm, "dataset_dir", None)
        if dataset_dir is None:
            return None
        if getattr(self, "_cached_tokenizer_spec", None) is None:
            from nanolab.data.tokenizers import portable_spec

            self._cached_tokenizer_spec = portable_spec(dataset_dir)
        return self._cached_tokenizer_spec

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get(CHECKPOINT_KEY, {})
        self._pending_rng = own_rng_state(saved, self.global_rank)
        fitting = self._trainer is not None and self.trainer.state.fn == "fit"
        if fitting and checkpoint.get("optimizer_states"):
            # Another optimizer's state, or one for other trainable parameters, cannot be
            # loaded (torch: "different number of parameter groups", or worse, a silent
            # mismatch). `nanolab fit` refused it before anything was written; a Trainer.fit
            # of one's own meets the same rule here.
            from nanolab.training.resume import optimizer_state_problem

            problem = optimizer_state_problem(
                checkpoint.get(CHECKPOINT_KEY),  # no section (another program's): not compared
                self.optimizer_config.name,
                asdict(self.freeze_config),
                self.trainer.ckpt_path or "the checkpoint",
            )
            if problem is not None:
                raise ConfigError(problem)
        if fitting:
            from nanolab.training.resume import (
                describe_layout_change,
                describe_precision_change,
                realign_progress,
            )

            realign_progress(checkpoint, int(self.trainer.accumulate_grad_batches or 1))
            # Read by the training sampler (nanolab.data.order.sampler_jumps) when it starts.
            self.restored_order = saved_order(checkpoint)
            note = describe_layout_change(saved.get("layout"), self._layout())
            if note:
                rank_zero_info(note)
            note = describe_precision_change(
                saved.get("precision"), str(self.trainer.precision), checkpoint.get("global_step")
            )
            if note:
                rank_zero_info(note)
            # The launch said so and wrote the checkpoint's values into config.yaml
            # (nanolab.run.compose.keep_checkpoint_settings); the module follows them too. A
            # branch trains with its own (its scheduler, BranchLR), but for the kernel's.
            self._kept_on_resume(saved, only=BRANCH_KEEPS if self.branched_from else None)

    def _kept_on_resume(
        self, saved: dict[str, Any], only: tuple[str, ...] | None = None
    ) -> str | None:
        """The optimizer/schedule settings this launch changed, as 'key old (not new)', each
        set back to the checkpoint's value (``only``: just these keys)."""
        now = {
            "optimizer": {
                **asdict(self.optimizer_config),
                "betas": list(self.optimizer_config.betas),
            },
            "schedule": asdict(self.schedule_config),
        }
        changed = []
        for part in ("optimizer", "schedule"):
            before = saved.get(part)
            if not isinstance(before, dict):
                continue
            diff = {k: before[k] for k, v in now[part].items() if k in before and before[k] != v}
            diff.pop("name", None)  # another optimizer is refused above
            if only is not None:
                diff = {k: v for k, v in diff.items() if k in only}
            changed += [f"model.{part}.{k} {v} (not {now[part][k]})" for k, v in diff.items()]
            if diff:  # this run goes on with the checkpoint's values, and later saves say so
                config = self.optimizer_config if part == "optimizer" else self.schedule_config
                values = {**now[part], **diff}
                if "betas" in values:
                    values["betas"] = tuple(values["betas"])
                setattr(self, f"{part}_config", type(config)(**values))
        return ", ".join(changed) or None

    def on_fit_start(self) -> None:
        # Another Trainer, maybe: ask again. The parameters may have been replaced since
        # __init__ (FSDP2 shards them in configure_model).
        self._live_callback_metrics = self._whole_gradients = self._param_list = None
        self._step_loss, self._step_micro_batches = None, 0
        self._step_targets, self._step_slots, self._gradient_scale = None, 0, None
        self.step_target_count = None
        datamodule = getattr(self.trainer, "datamodule", None)
        self._masked_targets = declares_masked_targets(datamodule)
        self._mask_check_pending = (
            not self._masked_targets and self.global_rank == 0 and worth_a_look(datamodule)
        )
        # CPU: keep freed activations' memory in the process (nanolab/training/cpu_memory.py);
        # otherwise every step re-faults it from the OS (~2.5% of a CPU step, measured).
        if self.device.type == "cpu":
            from nanolab.training.cpu_memory import keep_freed_memory

            keep_freed_memory()

    def _on_before_batch_transfer(self, batch: Any, dataloader_idx: int = 0) -> Any:
        """Lightning's ``on_before_batch_transfer`` (the data module's or this class's), then,
        in a fit whose data module does not declare masked targets, a look for them in the
        training batch while it is still in host memory: found, one warning, and no more looks.

        This is Lightning's own call of the hook, not the hook: a LightningModule that overrides
        the public hook makes Lightning warn at every fit with a data module, and a data module
        overriding it too would replace this check."""
        batch = super()._on_before_batch_transfer(batch, dataloader_idx)
        trainer = self._trainer
        looking = self._mask_check_pending and trainer is not None and trainer.training
        if looking and holds_masked_targets(batch):
            self._mask_check_pending = False
            warn("nanolab fit", undeclared_masks_line(trainer.datamodule))
        return batch

    def on_train_start(self) -> None:
        # Restored here, not at load time, so nothing that runs between loading and the first
        # step (sanity validation, loader start-up) can consume the streams first.
        if self._pending_rng is not None:
            restore_rng_state(self._pending_rng)
            self._pending_rng = None


def capture_rng_state(cuda: Any = torch.cuda) -> dict[str, Any]:
    """Torch (CPU and every CUDA device), Python and NumPy RNG states, as plain data.

    ``cuda`` is the device module, as for :func:`restore_rng_state` (a test passes a stand-in
    with ``is_available`` and ``get_rng_state_all``).
    """
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
    }
    if cuda.is_available():
        state["cuda"] = cuda.get_rng_state_all()
    return state


def own_rng_state(saved: dict[str, Any], rank: int) -> dict[str, Any] | None:
    """The RNG streams ``rank`` continues from: its own where the checkpoint has them (saved on
    as many ranks or more); else rank 0's, as every rank of a new launch starts from one seed
    (a checkpoint saved on fewer ranks, or by a version that kept rank 0's only)."""
    by_rank = saved.get("rng_by_rank") or []
    return by_rank[rank] if rank < len(by_rank) else saved.get("rng")


def restore_rng_state(state: dict[str, Any], cuda: Any = torch.cuda) -> None:
    """Put back what :func:`capture_rng_state` saved.

    The CUDA states are one per GPU the saving process saw; a resume may see fewer (an 8-GPU
    run resumed on 1, a queue job given other GPUs) or more. Device ``i`` takes saved state
    ``i`` where both exist; devices without a saved state keep their seeded state.
    ``cuda`` is the device module (``torch.cuda``; a test passes a stand-in with
    ``is_available``, ``device_count`` and ``set_rng_state``).
    """
    torch.set_rng_state(state["torch"])
    version, *rest = state["python"]
    random.setstate((version, tuple(rest[0]), rest[1]))
    kind, keys, *tail = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), *tail))
    saved = state.get("cuda") or []
    if saved and cuda.is_available():
        for index in range(min(len(saved), cuda.device_count())):
            cuda.set_rng_state(saved[index], index)


def callback_metrics_are_live(trainer: Any) -> bool:
    """Whether ``trainer.callback_metrics`` is the dict Lightning keeps (an entry put in it stays
    for the callbacks), not a copy made per read. Lightning 2.x returns its own dict; a version
    that copies would drop the entry, so :meth:`GPTLightningModule.publish_train_loss` then takes
    ``self.log``."""
    try:
        return trainer.callback_metrics is trainer.callback_metrics
    except Exception:
        return False


def shards_parameters(strategy: Any) -> bool:
    """Whether ``strategy`` hands the optimizer shards of parameters (FSDP's DTensors,
    DeepSpeed's flat partitions) rather than whole ones."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    return isinstance(strategy, (DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy))


def _global_seed() -> int | None:
    """The seed ``seed_everything`` gave this process (None: the run was not seeded)."""
    value = os.environ.get("PL_GLOBAL_SEED")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
