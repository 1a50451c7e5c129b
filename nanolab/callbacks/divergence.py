"""Stop a run that trains nothing: its loss or gradient norm stays non-finite, or fp16's loss
scale collapsed.

Once the loss is NaN or infinite every later step is wasted GPU time, and without a check the run
ends "completed" hours later with NaN checkpoints. :class:`DivergenceStop` counts consecutive
optimizer steps whose loss (any micro-batch of the step) or global gradient norm is not finite;
at ``patience`` of them the ``end`` record says ``diverged`` (the first bad step in
``diverged_step``), ``nanolab fit`` exits with :data:`EXIT_DIVERGED`, and the checkpoint callback
never saves non-finite weights, so the newest checkpoint on disk is the last finite one.

Cost: the flags stay on the device (all-reduced there under DDP/FSDP, so every rank stops at the
same step) and go to the host in the step's one shared read (:mod:`nanolab.callbacks.readout`):
with the run log's values on a step it records, else copied to pinned host memory without
blocking and read at the next step (on CPU at once). No host-device synchronisation is added.
The gradient norm is one fused pass over the gradients per optimizer step.

Under fp16 a GradScaler finds its scale through non-finite gradients (it skips such a step and
halves the scale), so there the gradient norm does not count; a *collapsed* loss scale does. When
every step overflows, every step is skipped, the loss stays finite and nothing is trained. A step
was skipped exactly when the scale fell across it, so the scale from before the step is kept and
compared on the device (same deferred read as the loss flag). The rule: ``patience`` skipped
steps in a row, the last leaving the scale below ``loss_scale_floor`` (1.0). Skips alone are
normal (a fresh scaler starts at 2**16 and halves its way down; after each growth it may skip
one), but never below 1: a scale >= 1 only lifts small gradients above fp16's underflow, so a
scale below 1 means the gradients overflow fp16 unscaled, or overflow whatever the scale. No
scale will make the steps count: the run stops as ``diverged``, the cause in the ``end`` record's
``detail`` (:meth:`DivergenceStop.describe`) and ``skipped_steps``/``loss_scale`` beside
``diverged_step``. From a steady scale of 2**k that takes k + 1 steps.

DeepSpeed checks the gradients in its engine and *skips* a step whose norm is not finite, in
every precision (:mod:`nanolab.training.engine_steps`): the weights and the loss stay finite, so
neither the loss nor ``.grad`` (empty under DeepSpeed) shows it. Its own count of skipped steps,
read across the step (host integers, no device read), stands in: in fp32/bf16 a skipped step is
a step with a non-finite gradient norm (it counts as under DDP); under fp16 with DeepSpeed's
dynamic loss scale it is the scaler's skip, judged as the GradScaler's above, except that
DeepSpeed's scale stops at its ``min_loss_scale`` (1): ``patience`` skipped steps that left the
scale at that lowest scale collapse it too. DeepSpeed's own rule, an exception at an overflow
at that scale, ended a run from a low ``initial_scale_power`` in a traceback before ``patience``
skipped steps (from scale 2, with its hysteresis of 2, at the third overflow). While this check
judges the scale, the scaler skips those steps too and the check stops the run
(:func:`~nanolab.training.engine_steps.raise_at_lowest_scale`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch

from nanolab.callbacks.events import (
    CallbackConfigError,
    find_callback,
    set_stop_reason,
    stop_reason,
)
from nanolab.callbacks.jsonl import read_gradient_norm, step_gradient_norm
from nanolab.callbacks.readout import StepReadout
from nanolab.callbacks.step import StepCallback, settle_step_values, validation_follows
from nanolab.training.engine_steps import (
    deepspeed_engine,
    loss_scale,
    lowest_loss_scale,
    raise_at_lowest_scale,
    scales_loss,
    skipped_steps,
)
from nanolab.training.masked_targets import held_no_target

#: Exit status of ``nanolab fit`` when this callback stopped the run. Not 2 (bad input) and not
#: 75 (preempted, rerun me): rerunning a diverged run as it is diverges again.
EXIT_DIVERGED = 3

#: The reason string of the ``end`` record.
REASON = "diverged"

#: The step's flags in the step readout: loss or gradient norm not finite, the GradScaler
#: skipped the step, its scale after the step.
FLAG_KEYS = ("divergence:bad", "divergence:skipped", "divergence:scale")
#: With declared masked targets: 1.0 when the step held no target (no loss to judge: it neither
#: continues nor ends a run of bad steps), in the step readout.
NO_TARGET_KEY = "divergence:no_target"


@dataclass
class Streak:
    """Consecutive optimizer steps with some property, and the first step of the run of them."""

    count: int = 0
    first: int | None = None

    def update(self, hit: bool, step: int) -> None:
        if not hit:
            self.count, self.first = 0, None
            return
        self.count += 1
        if self.first is None:
            self.first = step


class DivergenceStop(StepCallback):
    """Stops the run after ``patience`` consecutive optimizer steps with a non-finite loss or
    gradient norm, or (fp16) once the loss scale collapsed (see the module docstring).

    Its step hooks run after the budget's (a budget stop at the same step wins) and before the
    preemption handler's and the checkpoint's.

    Args:
        enabled: Check every optimizer step. Off = a diverged run trains on to ``max_steps``.
        patience: Consecutive non-finite optimizer steps that stop the run (1 = the first).
        check_grad_norm: Also count a non-finite global gradient norm (not under fp16's
            GradScaler, which skips such steps itself).
        loss_scale_floor: fp16 only: ``patience`` optimizer steps in a row skipped by the
            GradScaler, leaving its scale below this, stop the run. 0 turns the check off.
    """

    def __init__(
        self,
        enabled: bool = True,
        patience: int = 3,
        check_grad_norm: bool = True,
        loss_scale_floor: float = 1.0,
    ):
        super().__init__()
        if not isinstance(patience, int) or patience < 1:
            raise CallbackConfigError(f"divergence.patience must be >= 1, got {patience!r}")
        floor = loss_scale_floor
        if isinstance(floor, bool) or not isinstance(floor, int | float) or not floor >= 0:
            raise CallbackConfigError(
                f"divergence.loss_scale_floor must be a number >= 0 (0 turns the fp16 loss "
                f"scale check off), got {loss_scale_floor!r}"
            )
        if math.isinf(floor):
            raise CallbackConfigError(
                "divergence.loss_scale_floor must be finite (inf would stop every fp16 run "
                f"after {patience} skipped steps); use 1.0, or 0 to turn the check off"
            )
        self.enabled = enabled
        self.patience = patience
        self.check_grad_norm = check_grad_norm
        self.loss_scale_floor = float(floor)
        self.bad = Streak()  # optimizer steps in a row with a non-finite loss / gradient norm
        self.skipped = Streak()  # fp16: optimizer steps in a row the GradScaler skipped
        self.diverged_step: int | None = None  # first step of the streak that stopped the run
        self.collapse: tuple[int, float] | None = None  # (skipped steps, scale) if that stopped it
        self.at_end: tuple[int, bool] | None = None  # (bad last steps, val loss bad) at the end
        # This optimizer step's losses (one per micro-batch) and gradient norm, on the device:
        # checked together once the step is done (a few device ops a step, not a few each).
        self._watched: list[torch.Tensor] = []
        self._norm: Any = None  # this step's gradient norm, as step_gradient_norm answered
        self._scale_before: torch.Tensor | None = None  # the GradScaler's scale before the step
        self._engine_skips: int | None = None  # DeepSpeed's count of skipped steps before it
        self._lowest_scale: float | None = None  # DeepSpeed fp16: the scale its scaler stops at
        self._params: list[torch.nn.Parameter] | None = None

    # -- hooks -------------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._params = None
        # Here, not at the run's start: a checkpoint's runs of steps are restored after setup.
        self.bad, self.skipped = Streak(), Streak()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        # DeepSpeed fp16: its scaler raises at an overflow at its lowest scale, before this
        # check's patience; it skips those steps while this check judges them (each launch: a
        # resumed engine's scaler comes from the checkpoint, set as the launch that saved it).
        judges = self.active and self.loss_scale_floor > 0
        raise_at_lowest_scale(deepspeed_engine(trainer), raises=not judges)

    def on_run_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._watched, self._scale_before, self._norm = [], None, None
        self._engine_skips = None

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if not self.active:
            return
        engine = deepspeed_engine(trainer)
        if engine is not None:  # it checks the gradients itself: its skips are read after it
            self._engine_skips = skipped_steps(engine)
            return
        scaler = _grad_scaler(trainer)
        if scaler is not None:
            # The scaler steps (or skips) and updates its scale after this hook: keep the scale
            # it has now, on the device, to compare with in on_step.
            scale = _scale_tensor(scaler)
            if scale is not None and self.loss_scale_floor > 0:
                self._scale_before = scale.detach().clone()
            return
        if not self.check_grad_norm:
            return
        if self._params is None:
            self._params = list(pl_module.parameters())
        self._norm = step_gradient_norm(self.clock, trainer, pl_module, self._params)

    def on_micro_batch(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self._watched.append(loss.detach())

    def step_values(
        self, trainer: L.Trainer, pl_module: L.LightningModule, step: int, readout: StepReadout
    ) -> None:
        watched, self._watched = self._watched, []
        norm, self._norm = read_gradient_norm(self._norm, pl_module), None
        if norm is not None:
            watched.append(norm.detach())
        before, self._scale_before = self._scale_before, None
        engine_skips, self._engine_skips = self._engine_skips, None
        engine = deepspeed_engine(trainer) if engine_skips is not None else None
        skips_after = skipped_steps(engine) if engine is not None else None
        engine_skipped = skips_after is not None and engine_skips is not None
        engine_skipped = engine_skipped and skips_after > engine_skips
        # DeepSpeed fp16: the skip is the scaler's, judged with its scale after the step.
        fp16 = engine is not None and scales_loss(engine)
        engine_scale = loss_scale(engine) if fp16 and self.loss_scale_floor > 0 else None
        if engine_skipped and not fp16 and self.check_grad_norm:
            # fp32/bf16: the engine skipped the step because its gradient norm was not finite.
            watched.append(torch.full((), math.inf, device=pl_module.device))
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        gathered = trainer.world_size > 1 and distributed
        bad = _any_not_finite(watched)
        no_target = held_no_target(pl_module)
        if no_target is not None:  # the count is all ranks' already: no reduce of its own
            readout.put(NO_TARGET_KEY, no_target)
        # The run's last step without a validation is judged in its own on_step, before its
        # save: its flags are read now (on a GPU they would arrive after it). With one, they
        # are taken after the validation (on_validated), which waits for the device anyway.
        last = _last_step(trainer, step) and not validation_follows(trainer)
        if before is None and engine_scale is None and not gathered:  # one flag, no reduce
            readout.put(FLAG_KEYS[0], 0.0 if bad is None else bad, now=last)
            return
        bad = (
            torch.zeros((), dtype=torch.float32, device=pl_module.device)
            if bad is None
            else bad.to(torch.float32)
        )
        skipped, scale = torch.zeros_like(bad), torch.zeros_like(bad)
        after = _scale_tensor(_grad_scaler(trainer)) if before is not None else None
        if before is not None and after is not None:
            # The scaler lowers its scale on non-finite gradients only: a fall = a skipped step.
            after = after.detach().to(bad.device, torch.float32).reshape(())
            skipped = (after < before.to(bad.device, torch.float32).reshape(())).to(torch.float32)
            scale = after.clone()
        if engine_scale is not None:
            skipped = torch.full_like(bad, float(engine_skipped))
            scale = torch.full_like(bad, engine_scale)
            self._lowest_scale = lowest_loss_scale(engine)
        flags = torch.stack((bad, skipped, scale))
        if gathered:
            # Any rank's bad step stops every rank (the scale is the same on all of them).
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        for key, flag in zip(FLAG_KEYS, flags.unbind(), strict=True):
            readout.put(key, flag, now=last)

    @property
    def open_bad_streak(self) -> int | None:
        """The first step of the non-finite steps in a row so far (the last step was not
        finite), or None. Until they reach ``patience`` (the stop) or a finite step ends them,
        the state may be the one that diverges: the checkpoint callback holds its scheduled
        saves (:func:`~nanolab.callbacks.events.open_bad_streak`). None when the stop is off
        (``enabled: false``): it watches no step, so nothing would ever close a run of them."""
        return self.bad.first if self.active and self.bad.count else None

    @property
    def bad_steps_left(self) -> int | None:
        """How many more non-finite steps in a row stop the run (``patience`` less the open
        run of them), or None when none is open (:attr:`open_bad_streak`)."""
        return self.patience - self.bad.count if self.open_bad_streak is not None else None

    def on_step(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        assert self.clock is not None
        self._observe_all(trainer, self.clock.readout.completed)
        if _last_step(trainer, step) and not validation_follows(trainer):
            self._check_the_end(trainer)  # before the checkpoint's save of this step

    def on_validated(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        if _last_step(trainer, step):  # the last step's validation: before its deferred save
            settle_step_values(trainer)  # its flags, if still on their way (a GPU's)
            self._check_the_end(trainer)

    def on_values_arrived(
        self, trainer: L.Trainer, pl_module: L.LightningModule, arrived: list[tuple[int, Any]]
    ) -> None:
        """Before a save: the streaks it holds take its own step (a resume stops where an
        uninterrupted run stops)."""
        self._observe_all(trainer, arrived)

    def _observe_all(
        self, trainer: L.Trainer, completed: list[tuple[int, dict[str, float]]]
    ) -> None:
        for step, values in self.unseen(completed):  # each step once (a save took some early)
            if FLAG_KEYS[0] in values:  # the other two are absent without a GradScaler
                flags = [values.get(k, 0.0) for k in FLAG_KEYS]
                self._observe(trainer, step, flags, bool(values.get(NO_TARGET_KEY, 0.0)))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.active:
            if self.clock is not None:  # the last steps' flags, if still on their way
                self._observe_all(trainer, self.clock.readout.drain())
            self._check_the_end(trainer)

    def _check_the_end(self, trainer: L.Trainer) -> None:
        """A run that ends on non-finite steps, or with a non-finite validation loss, diverged:
        ``patience`` gives a run the chance to recover, and an ended run has none left (a 2-step
        run at ``lr 1e30`` must not read ``completed``). Judged at the last step (after its
        validation), before its save: as for a stop mid-run, the state that followed the
        divergence is not saved. NaN weights never were, but finite ones were (after a step
        whose gradient norm was infinite, after every step DeepSpeed skipped): the last step's
        save or the end's made them the run's newest checkpoint (``last.ckpt``)."""
        if self.diverged_step is not None or stop_reason(trainer)[0] is not None:
            return  # already diverged, or stopped by a budget (its reason stands)
        val = trainer.callback_metrics.get("val/loss")
        val_bad = isinstance(val, torch.Tensor) and not bool(torch.isfinite(val).all())
        if self.bad.count == 0 and not val_bad:
            return
        self.diverged_step = self.bad.first if self.bad.count else int(trainer.global_step)
        self.at_end = (self.bad.count, val_bad)
        set_stop_reason(trainer, REASON, self.describe(), save_state=False)

    # -- bookkeeping -------------------------------------------------------------------------
    def _observe(
        self, trainer: L.Trainer, step: int, flags: list[float], no_target: bool = False
    ) -> None:
        if not no_target:  # a step without a target has no loss: it is neither good nor bad
            self.bad.update(bool(flags[0]), step)
        self.skipped.update(bool(flags[1]), step)
        scale = float(flags[2])
        if self.diverged_step is not None:
            return
        if self.bad.count >= self.patience:  # a NaN loss also skips steps: that cause is named
            self.diverged_step = self.bad.first
        elif self.skipped.count >= self.patience and (
            scale < self.loss_scale_floor or self._at_lowest_scale(scale)
        ):
            self.diverged_step = self.skipped.first
            self.collapse = (self.skipped.count, scale)
        else:
            return
        # Non-finite steps: the weights are damaged (NaN), or under DeepSpeed finite but the
        # ones whose next step is not finite (it skipped those steps): none becomes a checkpoint
        # that rotates the last good ones away. A collapsed scale's weights are from before it.
        set_stop_reason(trainer, REASON, self.describe(), save_state=self.collapse is not None)

    def _at_lowest_scale(self, scale: float) -> bool:
        """DeepSpeed fp16: the scale is at the lowest its scaler goes (it cannot fall below it,
        so a floor under it would never be crossed). Off with the floor check (0)."""
        lowest = self._lowest_scale
        return self.loss_scale_floor > 0 and lowest is not None and scale <= lowest

    def describe(self) -> str:
        """One sentence for the end record and the exit message."""
        if self.collapse is not None:
            skipped, scale = self.collapse
            return (
                f"fp16 loss scale collapsed: {skipped} consecutive optimizer steps skipped "
                f"(scale {scale:.3g})"
            )
        if self.at_end is not None:
            bad_steps, val_bad = self.at_end
            what = []
            if bad_steps == 1:
                what.append(f"the last optimizer step ({self.diverged_step})")
            elif bad_steps:
                what.append(f"the last {bad_steps} optimizer steps (from {self.diverged_step})")
            if val_bad:
                what.append("the last validation")
            return (
                f"loss or gradient norm not finite (NaN/inf) at the end of the run: "
                f"{' and '.join(what)}"
            )
        steps = (
            f"step {self.diverged_step}"
            if self.patience == 1
            else f"{self.patience} consecutive optimizer steps from step {self.diverged_step}"
        )
        return f"loss or gradient norm not finite (NaN/inf) for {steps}"

    def hint(self, trainer: L.Trainer | None = None) -> str | None:
        """What to change, for the exit message: with the run's ``trainer``, the command of a
        branch that does it (:func:`divergence_fix`). A collapsed fp16 loss scale is fixed by
        resuming under bf16 where the GPU has it (fp16-only cards, V100 and T4, do not), or by
        a lower learning rate, which (a resume keeps its rate) is a
        branch from before the skipped steps, as for a non-finite loss."""
        if self.collapse is not None:
            bf16 = (
                "on a GPU with bf16 (Ampere or newer), resume with --trainer.precision "
                "bf16-mixed; to stay on fp16, "
            )
            if trainer is None:
                return f"{bf16}branch a new run with a lower model.optimizer.lr (a resume keeps it)"
            return bf16 + divergence_fix(trainer, self.diverged_step, skipped=True)
        if trainer is None:
            return "lower model.optimizer.lr or raise model.schedule.warmup_steps"
        return divergence_fix(trainer, self.diverged_step)

    def branch(self, trainer: L.Trainer) -> tuple[Path | None, str] | None:
        """The branch :meth:`hint` names, as :func:`branch_plan` gives it."""
        return branch_plan(trainer, self.diverged_step, skipped=self.collapse is not None)

    def record_fields(self, trainer: L.Trainer, event: str) -> dict[str, Any]:
        if event != "end" or self.diverged_step is None:
            return {}
        fields: dict[str, Any] = {"diverged_step": self.diverged_step}
        if self.collapse is not None:
            fields["skipped_steps"], fields["loss_scale"] = self.collapse
        return fields

    def state_dict(self) -> dict[str, Any]:
        """The runs of bad and skipped steps in progress: under fp16 the GradScaler skips a
        non-finite step and the weights stay finite, so a checkpoint can fall inside such a
        run, and the resumed run must stop at the step an uninterrupted one would."""
        return {
            "bad": [self.bad.count, self.bad.first],
            "skipped": [self.skipped.count, self.skipped.first],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the runs of steps in progress; a stop turned off (``enabled: false``)
        drops them: it watches no step, so none of them would ever end, and its own saves must
        not carry them on to a later resume that checks again."""

        def streak(key: str) -> Streak:
            count, first = state_dict.get(key, (0, None))  # older checkpoints: none in progress
            return Streak(int(count), None if first is None else int(first))

        if not self.enabled:
            self.bad, self.skipped = Streak(), Streak()
            return
        self.bad, self.skipped = streak("bad"), streak("skipped")


def branch_start(folder: Path, diverged_step: int | None) -> Path | None:
    """The checkpoint a branch with a lower learning rate starts from: the step file of the
    newest step whose next step was still finite (before ``diverged_step - 1``: the weights of
    the step before the first non-finite one are finite, but its very next forward is not, at
    any rate). None when there is none; ``diverged_step`` None: the newest step file.

    A step is a file, or under DeepSpeed and FSDP2 a sharded checkpoint folder (a branch starts
    from either); any other folder of that name is no checkpoint."""
    from nanolab.callbacks.checkpoint import step_of
    from nanolab.callbacks.checkpoint_io import branch_step
    from nanolab.model.checkpoint import sharded_kind

    def is_checkpoint(path: Path) -> bool:
        return path.is_file() or sharded_kind(path) is not None

    try:
        names = [p for p in folder.iterdir() if is_checkpoint(p)] if folder.is_dir() else []
    except OSError:
        return None
    by_step = {step: p for p in names if (step := step_of(p)) is not None}
    start = branch_step(by_step, diverged_step)
    return None if start is None else by_step[start]


def divergence_fix(
    trainer: L.Trainer,
    diverged_step: int | None,
    skipped: bool = False,
    spike_began: int | None = None,
) -> str:
    """The exit line's fix for a diverged run: a lower learning rate (or a longer warm-up) in a
    branch, with its command. A resume of the run itself would keep its learning rate and
    schedule (they are restored with the optimizer), so the command starts a new run from the
    run's newest checkpoint that a finite step followed, or without one. ``skipped``: the steps
    from ``diverged_step`` were skipped by fp16's collapsed loss scale (finite, not taken), so
    the checkpoint is the newest from before them (its scale was not yet collapsed).
    ``spike_began``: the first high step of the finite loss spike the spike guard stopped the
    run at; the checkpoint is the newest from before it, by the rule a rollback restores by
    (two steps before it): a newer one holds weights from inside the spike."""
    from nanolab.callbacks.checkpoint import step_of
    from nanolab.callbacks.rundir import CHECKPOINT_DIR

    run_dir = Path(trainer.default_root_dir)
    plan = branch_plan(trainer, diverged_step, skipped, spike_began)
    if plan is None:
        return "lower model.optimizer.lr or raise model.schedule.warmup_steps in a new run"
    start, command = plan
    lr = trainer.lightning_module.optimizer_config.lr  # type: ignore[union-attr]
    if start is None:
        followed = "saved before the skipped steps" if skipped else "followed by a finite step"
        if spike_began is not None:
            followed = f"saved before the loss spike that began at step {spike_began}"
        none = (
            f"no checkpoint of it was {followed}"
            if branch_start(run_dir / CHECKPOINT_DIR, None) is not None
            else "it saved no checkpoint"
        )
        return (
            f"{none}: start a new run with a lower model.optimizer.lr (or a higher "
            f"model.schedule.warmup_steps): {command}"
        )
    which = "" if diverged_step is None else " that a finite step followed"
    if skipped and diverged_step is not None:
        which = " from before the skipped steps"
    if spike_began is not None:
        which = f" from before the loss spike that began at step {spike_began}"
    return (
        f"a resume keeps its model.optimizer.lr {lr:g} and schedule, so branch a new run with "
        f"a lower one (or a higher model.schedule.warmup_steps) from step {step_of(start)}, "
        f"its newest checkpoint{which}: {command}"
    )


def branch_plan(
    trainer: L.Trainer,
    diverged_step: int | None,
    skipped: bool = False,
    spike_began: int | None = None,
) -> tuple[Path | None, str] | None:
    """The branch :func:`divergence_fix` names: ``(checkpoint, command)``, the checkpoint None
    for a new run from step 0. None when the run's learning rate is unknown (a fork's module
    without ``optimizer_config``). The arguments are :func:`divergence_fix`'s."""
    from nanolab.callbacks.rundir import CHECKPOINT_DIR
    from nanolab.training.branch import branch_command, lower_rate

    run_dir = Path(trainer.default_root_dir)
    config = getattr(trainer.lightning_module, "optimizer_config", None)
    lr = getattr(config, "lr", None)
    if not isinstance(lr, (int, float)) or isinstance(lr, bool):
        return None
    changes = {"model.optimizer.lr": lower_rate(lr)}
    # A skipped step changed no weight and the scale fell only at it: the checkpoint of the
    # step before the first skipped one is fine (a non-finite step's is not: its next forward
    # is not finite at any rate).
    after = diverged_step + 1 if skipped and diverged_step is not None else diverged_step
    if spike_began is not None:
        after = spike_began
    start = branch_start(run_dir / CHECKPOINT_DIR, after)
    return start, branch_command(run_dir, run_dir.name, start, changes)


def _last_step(trainer: L.Trainer, step: int) -> bool:
    """Whether ``step`` is the run's last (``trainer.max_steps``); a stop before it has its own
    reason, judged where it is set. False without a step limit."""
    max_steps = getattr(trainer, "max_steps", None)
    return isinstance(max_steps, int) and 0 < max_steps <= step


def _any_not_finite(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """True (a bool device scalar) when any element of ``tensors`` is NaN or infinite; None for
    no tensors. One stack and one check, on the tensors' device."""
    if not tensors:
        return None
    device = tensors[0].device
    if all(t.dim() == 0 and t.device == device for t in tensors):  # losses and a norm: scalars
        flat = torch.stack(tensors)  # promotes mixed dtypes (a bf16 loss, a float32 norm)
    else:
        flat = torch.cat([t.reshape(-1).to(device, torch.float32) for t in tensors])
    return torch.logical_not(torch.isfinite(flat).all())  # the readout reads it as 1.0 / 0.0


def _grad_scaler(trainer: L.Trainer) -> Any:
    """fp16's GradScaler when one is active (None for fp32/bf16)."""
    plugin = getattr(trainer, "precision_plugin", None)
    return getattr(plugin, "scaler", None)


def _scale_tensor(scaler: Any) -> torch.Tensor | None:
    """The GradScaler's current scale as the tensor it keeps on the device (no ``.item()``:
    ``get_scale()`` would synchronise). None while it has not scaled a loss yet, or disabled."""
    get = getattr(scaler, "_get_scale_async", None)
    scale = get() if callable(get) else getattr(scaler, "_scale", None)
    return scale if isinstance(scale, torch.Tensor) else None


def diverged(trainer: L.Trainer | None) -> DivergenceStop | None:
    """The run's divergence callback if it stopped the run, else None."""
    found = find_callback(trainer, DivergenceStop) if trainer is not None else None
    return found if found is not None and found.diverged_step is not None else None
