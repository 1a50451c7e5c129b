"""Heal a finite loss spike: roll back to a checkpoint from before it and skip its data.

A spike is a training loss far above its recent level that stays there: ``patience`` optimizer
steps in a row above ``max(factor x median, median + min_increase)`` of the last ``window``
healthy steps' losses (the median ignores single noisy batches; the absolute margin keeps a
nearly converged loss of 0.05 from "spiking" to 0.12). Nothing is checked until ``window``
steps of history exist. The losses of a spike are not added to the history.

What happens then (``action``):

* ``rollback`` (default): the newest step checkpoint at least two steps older than the spike's
  first step becomes ``last.ckpt``; every newer one is moved, not deleted, into
  ``checkpoints/rolled_back/``; the micro-batches trained since that checkpoint are skipped
  (a jump in the data order, :mod:`nanolab.data.skips`); a ``spike`` record goes to the run
  log, and the run stops with reason ``rollback``. ``nanolab fit`` then continues in the same
  process from that checkpoint (one process; with several, it exits 75 and a rerun of the same
  command continues, as after a preemption). At most ``max_rollbacks`` per run, then the run
  stops as ``diverged``. With no checkpoint old enough, it stops as ``diverged`` and says so.
* ``stop``: the run stops as ``diverged`` (exit 3), its ``last.ckpt`` untouched.
* ``warn``: only the ``spike`` record and a warning line.

The ledger ``<run_dir>/rollbacks.json`` is written first (state ``pending``), then ``last.ckpt``
is repointed and the newer checkpoints are moved, then the entry is marked ``done``: a run
killed in between finishes the rollback when it is started again (:func:`complete_rollback`,
called before the checkpoint to resume from is chosen), so it resumes exactly.

Checkpoint rotation always keeps one checkpoint old enough to roll back to (the newest one at
least ``patience + 2`` steps before the newest save), and the one that ages into that role,
besides ``checkpoint.keep_last`` (:func:`nanolab.callbacks.checkpoint_io.kept_for_rollback`).
A spike that ends the run as ``diverged`` suggests branching from the newest checkpoint from
before it (:func:`stopping_spike_began`), never from one saved during the spike.

The loss watched is the step's mean training loss, the number the run log records: Lightning
hands a callback each micro-batch's loss divided by ``trainer.accumulate_grad_batches`` (what it
back-propagates), so the guard multiplies that back (:func:`closure_loss_divisor`). A checkpoint
saved before that held the divided losses; a resume rescales them by the accumulation the
checkpoint records, or starts the window afresh with one note when it records none.

Cost: one scalar per step, averaged over ranks (so every rank decides the same) and brought to
the host in the step's one shared read (:mod:`nanolab.callbacks.readout`): no synchronisation
of its own. (It used to ``.item()`` the previous step's loss on a GPU, which waited for the
whole queued step all the same.)
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from nanolab.callbacks.checkpoint import (
    RotatingCheckpoint,
    set_aside_newer,
    step_of,
)
from nanolab.callbacks.divergence import Streak
from nanolab.callbacks.events import emit, find_callback, set_stop_reason
from nanolab.callbacks.readout import StepReadout
from nanolab.callbacks.step import StepCallback
from nanolab.data.datamodule import consumed_micro_batches
from nanolab.data.order import SavedOrder
from nanolab.data.skips import data_position, jumps, read_ledger, write_ledger
from nanolab.training.callback_settings import SPIKE_ACTIONS, check_spike
from nanolab.training.masked_targets import no_loss_as_nan

ACTIONS = SPIKE_ACTIONS
#: The step's mean training loss in the step readout (:mod:`nanolab.callbacks.readout`).
LOSS_KEY = "spike:loss"
#: What a saved history holds: the steps' mean losses (older checkpoints: divided by the
#: accumulation, :func:`undivided_history`).
HISTORY_OF = "step_loss"
#: The ``end`` record's reason of the part of a run that a rollback ended.
REASON = "rollback"
#: Where the checkpoints newer than the one rolled back to are moved (kept, never deleted).


class SpikeGuard(StepCallback):
    """Detects a finite loss spike and rolls the run back past it (module docstring).

    Args:
        enabled: Watch the training loss (on by default).
        action: ``rollback``, ``stop`` (end as diverged) or ``warn`` (record only).
        factor: A step is high when its loss exceeds ``factor`` x the window's median ...
        min_increase: ... and the median + this many nats.
        window: Healthy steps whose median is the reference; none is checked before.
        patience: High steps in a row that make a spike.
        max_rollbacks: Rollbacks per run; one more spike stops it as diverged.
        lr_scale: After a rollback, the learning rate is the schedule's times this ...
        lr_scale_steps: ... for this many steps from the restored one (0: not scaled).
    """

    def __init__(
        self,
        enabled: bool = True,
        action: str = "rollback",
        factor: float = 2.0,
        min_increase: float = 0.5,
        window: int = 50,
        patience: int = 5,
        max_rollbacks: int = 3,
        lr_scale: float = 1.0,
        lr_scale_steps: int = 0,
    ) -> None:
        super().__init__()
        check_spike(
            {"action": action, "factor": factor, "min_increase": min_increase, "window": window,
             "patience": patience, "max_rollbacks": max_rollbacks, "lr_scale": lr_scale,
             "lr_scale_steps": lr_scale_steps}
        )  # fmt: skip
        self.lr_scale = float(lr_scale)
        self.lr_scale_steps = lr_scale_steps
        self.lr_windows: list[tuple[int, int, float]] = []  # (after step, up to step, scale)
        self.enabled = enabled
        self.action = action
        self.factor = float(factor)
        self.min_increase = float(min_increase)
        self.window = window
        self.patience = patience
        self.max_rollbacks = max_rollbacks
        self.history: deque[float] = deque(maxlen=window)
        self.high = Streak()
        self.fired = False  # a warn-only spike is reported once, until the loss is back down
        self.spikes: list[dict[str, Any]] = []  # this process's spike records
        self._sum: torch.Tensor | None = None
        self._count = 0
        # The accumulation of the checkpoint being restored (its layout), for a history saved
        # before the guard watched the undivided loss; None when it records none.
        self._saved_accumulate: int | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        saver = find_callback(trainer, RotatingCheckpoint)
        if self.active and saver is not None:  # keep a checkpoint old enough to roll back to
            saver.keep_one_older_than = max(saver.keep_one_older_than, self.patience + 2)
        if self.active:
            self.lr_windows = lr_windows(read_ledger(trainer.default_root_dir))

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """In a window after a rollback, the optimizer step uses the schedule's rate x scale.
        Set from the scheduler's own value at every micro-batch, so it never compounds; the
        scheduler's next step sets the plain rate again."""
        if not self.active or not self.lr_windows:
            return
        scale = scale_at(self.lr_windows, trainer.global_step + 1)
        configs = trainer.lr_scheduler_configs
        if scale == 1.0 or not configs:
            return
        rates = configs[0].scheduler.get_last_lr()
        for group, rate in zip(trainer.optimizers[0].param_groups, rates, strict=False):
            group["lr"] = rate * scale

    # -- watching ----------------------------------------------------------------------------
    def on_micro_batch(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            loss = loss.detach().float().reshape(())
            self._sum = loss if self._sum is None else self._sum + loss
            self._count += 1

    def step_values(
        self, trainer: L.Trainer, pl_module: L.LightningModule, step: int, readout: StepReadout
    ) -> None:
        if self._sum is None:
            return
        mean = self._sum / self._count * closure_loss_divisor(trainer, pl_module)
        self._sum, self._count = None, 0
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if trainer.world_size > 1 and distributed:
            torch.distributed.all_reduce(mean, op=torch.distributed.ReduceOp.SUM)
            mean = mean / trainer.world_size
        # A step without any target (declared masked targets) has no loss: NaN, left out.
        mean = no_loss_as_nan(mean, getattr(pl_module, "step_target_count", None))
        readout.put(LOSS_KEY, mean)  # read now on CPU; on a GPU maybe the next step

    def on_step(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        assert self.clock is not None
        self.on_values_arrived(trainer, pl_module, self.clock.readout.completed)

    def on_values_arrived(
        self, trainer: L.Trainer, pl_module: L.LightningModule, arrived: list[tuple[int, Any]]
    ) -> None:
        """Each step's loss once, whether it came at its next step or before a save (a
        checkpoint's window must hold its own step, or a resume detects at another step)."""
        for done, values in self.unseen(arrived):
            if LOSS_KEY in values:
                self.observe(trainer, done, values[LOSS_KEY])

    def observe(self, trainer: L.Trainer | None, step: int, loss: float) -> str | None:
        """Take one step's loss; the action taken when it completes a spike, else None."""
        if not math.isfinite(loss):
            return None  # not finite: the divergence stop's case, or a step without a target
        if len(self.history) < self.window:
            self.history.append(loss)
            return None
        median = statistics.median(self.history)
        threshold = max(self.factor * median, median + self.min_increase)
        self.high.update(loss > threshold, step)
        if loss <= threshold:
            self.history.append(loss)
            self.fired = False
            return None
        if self.high.count < self.patience or self.fired:
            return None
        self.fired = True
        record = {
            "event": "spike",
            "step": step,
            "began": self.high.first,
            "loss": round(loss, 6),
            "median": round(median, 6),
            "threshold": round(threshold, 6),
            "action": self.action,
        }
        if trainer is None:
            return self.action
        return self._act(trainer, record)

    # -- acting ------------------------------------------------------------------------------
    def _act(self, trainer: L.Trainer, record: dict[str, Any]) -> str:
        began = int(record["began"])
        what = (
            f"loss spike: {record['loss']:.4g} from step {began} ({self.patience} steps above "
            f"{record['threshold']:.4g}, the median of the last {self.window} steps being "
            f"{record['median']:.4g})"
        )
        if self.action == "warn":
            self._record(trainer, record)
            rank_zero_warn(f"{what}; spike.action warn: training on")
            return "warn"
        if self.action == "stop":
            self._record(trainer, record)
            set_stop_reason(trainer, "diverged", f"{what}; spike.action stop", save_state=False)
            return "stop"
        run_dir = Path(trainer.default_root_dir)
        done = read_ledger(run_dir)
        saver = find_callback(trainer, RotatingCheckpoint)
        folder = saver.dirpath if saver is not None else None
        if saver is not None:
            saver.flush_records(trainer)  # an asynchronous save in flight completes first
        restore = _restore_step(folder, began)
        if len(done) >= self.max_rollbacks or restore is None:
            why = (
                f"after {len(done)} rollbacks (spike.max_rollbacks {self.max_rollbacks})"
                if restore is not None
                else f"and no checkpoint from before step {began - 1} to roll back to"
            )
            record["action"] = "stop"
            self._record(trainer, record)
            set_stop_reason(trainer, "diverged", f"{what} {why}", save_state=False)
            return "stop"
        assert folder is not None
        accumulate = int(trainer.accumulate_grad_batches or 1)
        consumed = consumed_micro_batches(trainer)
        at = restore * accumulate
        target = folder / f"step-{restore:08d}.ckpt"
        places = order_positions(trainer, consumed, at, done, target)
        entry = {
            "detected": int(trainer.global_step),
            "began": began,
            "restored": restore,
            "checkpoint": str(target),
            "skip_at": at,
            "skip_offset": places.reached - at,
            "skipped_micro_batches": places.reached - places.restored_at,
            # The windows per micro-batch the positions count, and where the order stood at
            # the restored checkpoint (nanolab.data.order): a resume on another layout, or from
            # an older checkpoint, carries the jump into its own micro-batches at that window.
            "unit": places.unit,
            "restored_position": places.restored[0],
            "restored_unit": places.restored[1],
            "loss": record["loss"],
            "median": record["median"],
            "state": "pending",
        }
        if self.lr_scale != 1.0 and self.lr_scale_steps > 0:
            entry.update(lr_scale=self.lr_scale, lr_scale_steps=self.lr_scale_steps)
            record.update(lr_scale=self.lr_scale, lr_scale_steps=self.lr_scale_steps)
        record.update(restored=restore, skipped_micro_batches=entry["skipped_micro_batches"])
        self._record(trainer, record)
        if trainer.is_global_zero:
            write_ledger(run_dir, [*done, entry])
            complete_rollback(run_dir, folder)
        trainer.strategy.barrier("nanolab-rollback")
        set_stop_reason(
            trainer,
            REASON,
            f"{what}; rolled back to step {restore}, skipping "
            f"{entry['skipped_micro_batches']} micro-batches",
            save_state=False,
        )
        return "rollback"

    def _record(self, trainer: L.Trainer, record: dict[str, Any]) -> None:
        self.spikes.append(record)
        emit(trainer, dict(record))

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The window of healthy losses and the run of high steps in progress: a run resumed in
        the middle of a spike sees it complete at the same step as one never interrupted (and
        so rolls back to the same checkpoint and skips the same data)."""
        return {
            "history": list(self.history),
            "history_of": HISTORY_OF,
            "high": [self.high.count, self.high.first],
            "fired": self.fired,
        }

    def on_load_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Lightning calls this before :meth:`load_state_dict`: keep the accumulation the
        checkpoint was trained with, which an older history has to be rescaled by."""
        self._saved_accumulate = saved_accumulation(checkpoint)
        if not getattr(pl_module, "automatic_optimization", True):
            self._saved_accumulate = 1  # manual optimization: Lightning divides nothing

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        history = [float(x) for x in state_dict.get("history", [])]
        saved_accumulate, self._saved_accumulate = self._saved_accumulate, None
        if history and state_dict.get("history_of") != HISTORY_OF:
            history = undivided_history(history, saved_accumulate, self.window)
        self.history = deque(history, maxlen=self.window)
        count, first = state_dict.get("high", (0, None))  # checkpoints before it: none in progress
        self.high = Streak(int(count), None if first is None else int(first))
        self.fired = bool(state_dict.get("fired", False))


def stopping_spike_began(trainer: L.Trainer) -> int | None:
    """The first high step of the loss spike the guard ended this run at as ``diverged``
    (``spike.action stop``, ``max_rollbacks`` spent, or no checkpoint old enough); None when it
    stopped none. A branch must start from a checkpoint from before it, not the newest."""
    guard = find_callback(trainer, SpikeGuard)
    stops = [r for r in guard.spikes if r.get("action") == "stop"] if guard is not None else []
    return int(stops[-1]["began"]) if stops else None


def closure_loss_divisor(trainer: L.Trainer, pl_module: L.LightningModule) -> int:
    """What Lightning divided the loss it hands callbacks by: ``accumulate_grad_batches`` in
    automatic optimization (the micro-batches' losses then sum to the step's), 1 in manual."""
    if not getattr(pl_module, "automatic_optimization", True):
        return 1
    return max(1, int(trainer.accumulate_grad_batches or 1))


def saved_accumulation(checkpoint: dict[str, Any]) -> int | None:
    """The gradient accumulation a checkpoint was trained with (its layout); None if unrecorded."""
    from nanolab.training.module import CHECKPOINT_KEY

    layout = (checkpoint.get(CHECKPOINT_KEY) or {}).get("layout") or {}
    value = layout.get("accumulate") if isinstance(layout, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return None
    return value


def undivided_history(history: list[float], accumulate: int | None, window: int) -> list[float]:
    """A history saved before the guard watched the step's loss: each value was the step's loss
    divided by the run's accumulation. Rescaled by it when the checkpoint records it; else
    dropped (the window refills over the next ``window`` steps), which a note says: compared
    with a divided history, every step of a run that accumulates would look like a spike."""
    if accumulate is not None:
        return [x * accumulate for x in history]
    rank_zero_info(
        f"spike guard: the checkpoint's loss history predates the step-loss record and its "
        f"accumulation is unknown, so it starts afresh (no spike check for {window} steps)"
    )
    return []


def lr_windows(rollbacks: list[dict[str, Any]]) -> list[tuple[int, int, float]]:
    """(restored step, last scaled step, scale) of the rollbacks that scale the rate."""
    out = []
    for r in rollbacks:
        scale, steps = r.get("lr_scale"), r.get("lr_scale_steps")
        if isinstance(scale, int | float) and isinstance(steps, int) and steps > 0:
            out.append((int(r["restored"]), int(r["restored"]) + steps, float(scale)))
    return out


def scale_at(windows: list[tuple[int, int, float]], step: int) -> float:
    """The scale of optimizer step ``step`` (1-based): the newest window holding it, else 1."""
    for after, until, scale in reversed(windows):
        if after < step <= until:
            return scale
    return 1.0


def _restore_step(folder: Path | None, began: int) -> int | None:
    """The newest step checkpoint at least two steps before the spike's first high step (the
    update just before it may be what went wrong)."""
    if folder is None or not folder.is_dir():
        return None
    steps = [s for p in folder.iterdir() if (s := step_of(p)) is not None and s <= began - 2]
    return max(steps, default=None)


@dataclass(frozen=True)
class OrderPlaces:
    """Where a rollback leaves the data order, as this launch's sampler counts it.

    ``reached``: the position the order had got to (this launch's micro-batches of ``unit``
    windows); ``restored_at``: the position a resume from the restored checkpoint goes on from
    in the same micro-batches, so ``reached - restored_at`` micro-batches are skipped;
    ``restored``: (position, unit) of the order at that checkpoint, as it counted it."""

    reached: int
    restored_at: int
    unit: int | None
    restored: tuple[int, int | None]


def order_positions(
    trainer: L.Trainer, consumed: int, at: int, done: list[dict[str, Any]], target: Path
) -> OrderPlaces:
    """The :class:`OrderPlaces` of a rollback after ``consumed`` micro-batches to checkpoint
    ``target`` (micro-batch ``at`` of this launch's count), the run's earlier rollbacks being
    ``done``. A checkpoint this launch saved is at its own sampler's position; an older one
    (saved before this launch resumed, maybe on another layout) is where its own record says,
    carried into this launch's micro-batches as a resume from it would (counting this launch's
    micro-batches back from its start would name windows it never trained). Without nanolab's
    sampler, the ledger's count."""
    from nanolab.data.order import carry, place_of, unit_of
    from nanolab.data.windows import ResumableBatchSampler

    sampler = getattr(getattr(trainer, "datamodule", None), "train_sampler", None)
    if not isinstance(sampler, ResumableBatchSampler):
        reached, restored = data_position(consumed, jumps(done)), data_position(at, jumps(done))
        return OrderPlaces(reached, restored, None, (restored, None))
    unit = unit_of(sampler.plan)
    reached = sampler.position(consumed)
    saved = checkpoint_order(target) if at < sampler.start else None
    if saved is None:  # saved by this launch (or unreadable: its resume will say so)
        restored = sampler.position(at) if at >= sampler.start else data_position(at, jumps(done))
        return OrderPlaces(reached, restored, unit, (restored, unit))
    accumulate = saved.accumulate or int(trainer.accumulate_grad_batches or 1)
    place = place_of(saved, accumulate, done, unit)
    return OrderPlaces(reached, carry(sampler.plan, *place).position, unit, place)


def checkpoint_order(path: Path) -> SavedOrder | None:
    """The place in the data order a checkpoint file records (its ``nanolab`` section, read
    without its tensors' data); ``None`` for a folder (a sharded checkpoint) or a file that
    cannot be read."""
    from nanolab.data.order import saved_order
    from nanolab.model.checkpoint import read_path

    if not path.is_file():
        return None
    try:
        ckpt = torch.load(read_path(path), map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # unreadable: the resume from it refuses it in its own words
        return None
    return saved_order(ckpt) if isinstance(ckpt, dict) else None


def complete_rollback(run_dir: str | Path, folder: str | Path | None = None) -> None:
    """Finish the newest rollback of ``run_dir`` if it is still ``pending``: point
    ``last.ckpt`` at its checkpoint and move the newer step checkpoints into
    ``rolled_back/`` (idempotent; a no-op without a pending rollback)."""
    run_dir = Path(run_dir)
    ledger = read_ledger(run_dir)
    if not ledger or ledger[-1].get("state") != "pending":
        return
    entry = ledger[-1]
    target = Path(entry["checkpoint"])
    folder = Path(folder) if folder is not None else target.parent
    restore = int(entry["restored"])
    set_aside_newer(folder, target, restore)
    entry["state"] = "done"
    write_ledger(run_dir, ledger)


def check_ledger(run_dir: str | Path) -> None:
    """Before a resume: the ledger reads, and it holds every rollback the run log records (a
    deleted or older ledger would silently change the data order)."""
    from nanolab.data.skips import LEDGER, LedgerError
    from nanolab.runlog import RUN_LOG_NAME

    run_dir = Path(run_dir)
    ledger = read_ledger(run_dir)
    logged = logged_rollbacks(run_dir / RUN_LOG_NAME)
    if logged > len(ledger):
        raise LedgerError(
            f"{run_dir / LEDGER} holds {len(ledger)} rollback(s) but the run log records "
            f"{logged}: the data this run skipped is missing from it, so resuming would change "
            "its data order; restore the file (from a backup of the run), or start a new run "
            "(another --run.name)"
        )


def logged_rollbacks(log: Path) -> int:
    """The rollbacks a run log records (its ``spike`` records that name a ``restored`` step).

    Searched for in blocks of bytes (:func:`~nanolab.runlog.iter_backwards`), not read line by
    line: spike records are a handful among a record per step, and a line reader's Python step
    per line made every resume of a 10^6-step run (a 217 MB log) spend 2-5 s here; the block
    search passes over a block without a spike in one byte search. The lines are those the line
    reader sees (``split_cr``: a carriage return ends one too), a torn last line none."""
    from nanolab.runlog import iter_backwards

    records = iter_backwards(
        log, "spike", where=lambda r: r.get("restored") is not None, split_cr=True
    )
    with contextlib.closing(records):
        return sum(1 for _ in records)


def rolled_back(trainer: L.Trainer | None) -> bool:
    """Whether this fit ended in a rollback (``nanolab fit`` then continues from it)."""
    from nanolab.callbacks.events import stop_reason

    return trainer is not None and stop_reason(trainer)[0] == REASON
