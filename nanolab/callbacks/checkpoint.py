"""Checkpoint rotation: by steps and by wall time, keep the last K + best J + ``last.ckpt``.

Files (the resume and queue code rely on these names), in ``<run_dir>/checkpoints/``:

* ``step-{step:08d}.ckpt`` — one per save, ``step`` = optimizer steps done;
* ``last.ckpt`` — the newest complete save (a hard link to its step file: no second write).

Every save is atomic (see :mod:`nanolab.callbacks.checkpoint_io`), and rotation runs only after
the newer checkpoint is complete on disk — on the writer thread, behind the write, when saving
asynchronously — so at every instant there is a complete checkpoint to resume from.

A save whose parameters are not all finite (a diverged run) is skipped with a warning: rotation
never replaces a finite checkpoint with a NaN one, so ``last.ckpt`` stays the newest usable state.
Finite weights can still be a diverging state (after a step whose gradient norm was infinite, a
step DeepSpeed skipped): while the divergence stop counts such steps in a row, a scheduled save
waits for the first finite step (the run may yet stop as diverged, and with ``keep_last`` small
such saves rotated away the checkpoint its branch starts from). A stop's save (preemption, a
budget) is written, progress kept, and rotation keeps that branch checkpoint beside it.

When a save falls on a step that is followed by a validation, it is taken after the validation
instead, so the checkpoint carries the state the callbacks derive from it (best val loss, the
budget's history) and a resumed run makes the same decisions an uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import stat
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from nanolab.atomic import is_temp_name, temp_name
from nanolab.callbacks.checkpoint_io import (  # noqa: F401  (STEP_FILE, step_of: public here too)
    STEP_FILE,
    AsyncAtomicCheckpointIO,
    AtomicCheckpointIO,
    Retention,
    atomic_link,
    branch_step,
    kept_for_rollback,
    step_of,
)
from nanolab.callbacks.events import bad_steps_left, emit, open_bad_streak, stop_saves_state
from nanolab.callbacks.files import publish, remove
from nanolab.callbacks.rundir import CHECKPOINT_DIR
from nanolab.callbacks.step import (
    StepCallback,
    announce_save,
    settle_step_values,
    validation_follows,
)
from nanolab.claimed import ClaimedDir, LeftClaimedDir
from nanolab.errors import RunConfigError, size_text
from nanolab.messages import warn
from nanolab.model.param_sizes import local_values
from nanolab.runlog import iter_backwards
from nanolab.training.callback_settings import check_checkpoint

LAST_NAME = "last.ckpt"
ROLLED_BACK_DIR = "rolled_back"  # checkpoints a rollback (or a resume from an older one) set aside


def step_checkpoint_name(step: int) -> str:
    return f"step-{step:08d}.ckpt"


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _writes_directories(strategy: Any) -> bool:
    """Strategies that save a folder of shards instead of going through ``checkpoint_io``.

    Lightning exposes neither choice publicly: FSDP keeps ``state_dict_type`` and
    ModelParallelStrategy ``save_distributed_checkpoint`` as the private attributes read here
    (absent attributes read as "one file", the safe default: the save is then renamed into place).
    """
    from lightning.pytorch.strategies import DeepSpeedStrategy

    if isinstance(strategy, DeepSpeedStrategy):
        return True
    if getattr(strategy, "_save_distributed_checkpoint", False):
        return True
    return getattr(strategy, "_state_dict_type", None) == "sharded"


class RotatingCheckpoint(StepCallback, Checkpoint):
    """Saves by step and/or wall time, keeps the last K + best J + ``last.ckpt``, atomically.

    Its step hooks run last among the step callbacks, so a save holds every decision taken at
    that step (a budget stop defers it to after the final evaluation).

    Args:
        dirpath: Must stay ``null``: checkpoints live in ``<run_dir>/checkpoints``, the one
            folder the resume, the run lock, the rollback and the rotation read. To keep them on
            another disk, set ``run.root`` there or make ``<run_dir>/checkpoints`` a link to a
            folder on it (kept for configs that spell out ``dirpath: null``).
        every_n_steps: Save every N optimizer steps (``null``: not by steps).
        every_n_minutes: Save when this many minutes of wall time passed since the last save
            (``null``: not by time). On preemptible machines this bounds the work a preemption
            can destroy, whatever the step time.
        keep_last: Step checkpoints kept, newest first (the newest one is always kept).
        keep_best: Checkpoints with the lowest ``monitor`` value kept besides those.
        monitor: Validation metric that ranks checkpoints (lower is better).
        save_on_best: Also save at a validation whose ``monitor`` enters the best ``keep_best``
            when that step is not a save step anyway (costs a save per improving evaluation).
        save_last: Keep ``last.ckpt`` pointing at the newest complete checkpoint.
        save_on_train_end: Save when training ends (completed, budget, plateau, preempted), so
            the final state is never lost.
        max_disk_gb: Cap on the checkpoint folder; oldest non-best checkpoints are deleted first
            (never the newest). ``null``: no cap.
        async_save: Write in a background thread; the training thread only copies the state to
            CPU memory. Deletions wait until the newer file is complete.
    """

    def __init__(
        self,
        dirpath: str | None = None,
        every_n_steps: int | None = 250,
        every_n_minutes: float | None = None,
        keep_last: int = 2,
        keep_best: int = 1,
        monitor: str = "val/loss",
        save_on_best: bool = False,
        save_last: bool = True,
        save_on_train_end: bool = True,
        max_disk_gb: float | None = None,
        async_save: bool = False,
    ) -> None:
        super().__init__()
        check_checkpoint(
            {"dirpath": dirpath, "every_n_steps": every_n_steps, "every_n_minutes": every_n_minutes,
             "keep_last": keep_last, "keep_best": keep_best, "max_disk_gb": max_disk_gb}
        )  # fmt: skip
        self.dirpath: Path | None = None  # <run_dir>/checkpoints, set at setup
        self.every_n_steps = every_n_steps
        self.every_n_minutes = every_n_minutes
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.monitor = monitor
        self.save_on_best = save_on_best
        self.save_last = save_last
        self.save_on_train_end = save_on_train_end
        self.max_disk_gb = max_disk_gb
        self.async_save = async_save

        self.val_by_step: dict[int, float] = {}
        self.last_saved_step: int | None = None
        self._io: AtomicCheckpointIO | AsyncAtomicCheckpointIO | None = None
        self._rename_after_save = False
        self._last_save_time = time.monotonic()
        self._pending_save = False
        self._held_for: int | None = None  # the open non-finite run a held save was told for
        self._done_records: list[dict[str, Any]] = []
        self._warned_cap = False
        self._folder: ClaimedDir | None = None  # the claimed checkpoint folder (rank 0)
        self._written: dict[str, tuple[int, int]] = {}  # its files this run wrote: (dev, inode)
        #: Rotation also keeps the newest checkpoint at least this many steps older than the
        #: newest save, and the one ageing into that role (set by the spike guard: a checkpoint
        #: from before a spike in progress; :func:`kept_for_rollback`).
        self.keep_one_older_than = 0
        #: (checkpoint, step) of a resume from an older checkpoint of this run than its newest
        #: (set by ``nanolab fit``): the later step checkpoints move to ``rolled_back/`` once the
        #: resume has restored, before the first save could overwrite one of them.
        #: The third item: unreadable files of the folder the resume skipped (a ``last.ckpt``
        #: with bytes of its own among them), set aside with the later step checkpoints.
        self.set_aside_after: tuple[Path, int, tuple[Path, ...]] | None = None

    @property
    def best_model_path(self) -> str:
        best = self._best_steps(self.val_by_step, self._existing_steps())
        return str(self.dirpath / step_checkpoint_name(best[0])) if best and self.dirpath else ""

    # -- setup -------------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if not self.active:
            return
        if self.dirpath is None:
            self.dirpath = Path(trainer.default_root_dir) / CHECKPOINT_DIR
        strategy = trainer.strategy
        if _writes_directories(strategy):
            self._rename_after_save = True
        else:
            current = strategy.checkpoint_io
            if isinstance(current, (AtomicCheckpointIO, AsyncAtomicCheckpointIO)):
                self._io = current
            elif type(current) is TorchCheckpointIO:
                self._io = AsyncAtomicCheckpointIO() if self.async_save else AtomicCheckpointIO()
                strategy.checkpoint_io = self._io
            else:
                self._rename_after_save = True  # someone else's CheckpointIO: make ours atomic
        if self._rename_after_save and self.async_save and trainer.is_global_zero:
            warn(
                "nanolab",
                f"checkpoint.async_save is ignored with {type(strategy).__name__} / "
                f"{type(strategy.checkpoint_io).__name__}: saves are synchronous "
                "(set checkpoint.async_save false to silence this)",
            )

    def on_run_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last_save_time = time.monotonic()
        assert self.dirpath is not None
        if trainer.is_global_zero and self.set_aside_after is not None:
            self._set_aside_later(*self.set_aside_after)
        if trainer.is_global_zero and (self.dirpath.exists() or self.dirpath.is_symlink()):
            self._claim_folder(at_start=True)
            self._rotate_existing(trainer.global_step, open_bad_streak(trainer))

    def _rotate_existing(self, step: int, bad_from: int | None = None) -> None:
        """Apply ``keep_last``/``keep_best``/``max_disk_gb`` to the step files already here,
        before the first save: a rerun that lowered them (after a full disk) frees the room
        there and then, not after a save that would fail again for want of it. With the
        settings unchanged this deletes nothing (a save rotated to them already). The newest
        step file up to ``step`` (the one resumed from) is never deleted; neither is anything
        rotation would keep, nor a file this run has no record of (:meth:`_delete`). A resume
        from a save inside a run of non-finite steps (from ``bad_from``) keeps its branch
        checkpoint, as that save's rotation did."""
        assert self.dirpath is not None
        if self._folder is None:
            return
        steps = [s for n in os.listdir(self._folder.fd) if (s := step_of(n)) is not None]
        timeline = [s for s in steps if s <= step]
        if not timeline:
            return
        newest = max(timeline)
        deleted = self._rotate(
            self.dirpath / step_checkpoint_name(newest), newest, self.val_by_step, bad_from
        )
        if deleted:
            print(
                f"nanolab: checkpoint.keep_last {self.keep_last}, keep_best {self.keep_best}, "
                f"max_disk_gb {self.max_disk_gb}: deleted {', '.join(p.name for p in deleted)} "
                f"before the first save (kept {step_checkpoint_name(newest)}, the newest)",
                file=sys.stderr,
                flush=True,
            )

    def _claim_folder(self, at_start: bool) -> None:
        """Hold the checkpoint folder from now on (the run log has claimed the run directory);
        a run without one yet claims it at its first save, when it creates it.

        Saves, ``last.ckpt`` and rotation go through its descriptor, so a link swapped in for
        it later cannot redirect them into another run's folder (:mod:`nanolab.claimed`). The
        step files already there are this run's (the claim checked that), so rotation may
        delete them; any other file is only ever deleted if this process wrote it.
        """
        assert self.dirpath is not None
        if not self.dirpath.exists() and self.dirpath.is_symlink():
            raise LeftClaimedDir(
                f"{self.dirpath} is a link to a folder that does not exist; the run keeps its "
                "checkpoints in a folder of its own: remove the link and rerun the same command"
            )
        if not self.dirpath.exists():
            self.dirpath.mkdir(parents=True)
        elif not at_start and self.dirpath.is_symlink():
            # It did not exist at start-up; a link appeared since: not a folder this run chose.
            raise LeftClaimedDir(
                f"{self.dirpath} became a link after this run started; it stopped without "
                "writing through it: remove the link and rerun the same command to resume"
            )
        self._close_folder()
        self._folder = folder = ClaimedDir(self.dirpath)
        self._written = {}
        for name in os.listdir(folder.fd) if at_start else ():  # later: none of them ours
            if name.endswith((".tmp", DELETING)):  # a crash mid-save (or mid-delete) left it
                _clear_leftover(folder, name)
            elif step_of(name) is not None or name == LAST_NAME:
                self._remember(name)
        inner = (
            self._io.checkpoint_io if isinstance(self._io, AsyncAtomicCheckpointIO) else self._io
        )
        if isinstance(inner, AtomicCheckpointIO):
            inner.folder = folder
            inner.retention = self.retention()

    def retention(self) -> Retention:
        """What rotation keeps, for the advice of a full disk's error line."""
        return Retention(self.keep_last, self.keep_best, self.max_disk_gb, self.keep_one_older_than)

    def _remember(self, name: str) -> None:
        """Record that ``name`` in the claimed folder is this run's file (as it is now)."""
        ident = self._ident(name)
        if ident is not None:
            self._written[name] = ident

    def _ident(self, name: str) -> tuple[int, int] | None:
        """(device, inode) of a regular file or a folder (a sharded checkpoint: DeepSpeed,
        FSDP2's distributed save) ``name`` in the claimed folder; None otherwise (a link)."""
        assert self._folder is not None
        try:
            st = os.stat(name, dir_fd=self._folder.fd, follow_symlinks=False)
        except OSError:
            return None
        kept = stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)
        return (st.st_dev, st.st_ino) if kept else None

    def _close_folder(self) -> None:
        if self._folder is not None:
            self._folder.close()
            self._folder = None

    def _set_aside_later(self, resumed: Path, step: int, skipped: tuple[Path, ...] = ()) -> None:
        assert self.dirpath is not None
        moved = set_aside_newer(self.dirpath, resumed, step, skipped)
        if moved:
            print(
                f"nanolab fit: resumed from step {step}: the {len(moved)} later checkpoint(s) "
                f"({', '.join(moved)}) moved to {self.dirpath / ROLLED_BACK_DIR} (kept, not "
                "overwritten)",
                file=sys.stderr,
                flush=True,
            )
        self.set_aside_after = None

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._close_folder()

    # -- deciding when -----------------------------------------------------------------------
    def on_step(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        self._emit_done(trainer)
        due = self._pending_save or (
            self.every_n_steps is not None and step % self.every_n_steps == 0
        )
        if self.every_n_minutes is not None and not due:
            late = time.monotonic() - self._last_save_time >= self.every_n_minutes * 60
            # Ranks must agree (a save is collective); wall clocks differ slightly between them.
            due = bool(trainer.strategy.reduce_boolean_decision(late, all=False))
        if not due:
            return
        if validation_follows(trainer):
            self._pending_save = True
            return
        # Taken now: a save held inside non-finite steps is owed once, not at every later step
        # (the hold owes it again while they stay open).
        self._pending_save = False
        self._scheduled_save(trainer, step)

    def on_validated(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        value = trainer.callback_metrics.get(self.monitor)
        if value is not None and not math.isfinite(float(value)):
            value = None  # a NaN loss ranks nowhere (and would break the ordering)
        if value is not None:
            self.val_by_step[step] = float(value)
        should = self._pending_save
        if not should and self.save_on_best and value is not None and self.keep_best > 0:
            steps = self._existing_steps() | {step}
            should = step in self._best_steps(self.val_by_step, steps)
        self._pending_save = False
        if should and self.last_saved_step != step:
            self._scheduled_save(trainer, step)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.active:
            return
        step = trainer.global_step
        if (self.save_on_train_end or self._pending_save) and 0 < step != self.last_saved_step:
            self._save(trainer, step)
        self._pending_save = False
        if self._io is not None and trainer.is_global_zero:
            assert self.clock is not None
            with self.clock.pause("checkpoint"):
                self._io.wait()  # the end record must come after the last checkpoint is complete
        self._emit_done(trainer)

    def flush_records(self, trainer: L.Trainer) -> None:
        """Let queued saves finish (they are consistent snapshots) and report them.

        The run log calls this before writing its ``end`` record, also after an exception.
        """
        if not self.active:
            return
        if isinstance(self._io, AsyncAtomicCheckpointIO):
            with contextlib.suppress(BaseException):
                self._io.wait()
        self._emit_done(trainer)

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self.flush_records(trainer)

    # -- saving ------------------------------------------------------------------------------
    def _scheduled_save(self, trainer: L.Trainer, step: int) -> None:
        """A save on this callback's own schedule (steps, minutes, best), then told to the step
        callbacks: a signal that landed during the write stops the run on this checkpoint
        rather than after one more step (and one more save) of training.

        Held while non-finite steps are open (:meth:`_hold_for_bad_steps`)."""
        settle_step_values(trainer)  # the divergence stop's streak holds this step
        if self._hold_for_bad_steps(trainer, step):
            return
        path = self._save(trainer, step)
        if path is not None:
            announce_save(trainer, step, str(path))

    def _hold_for_bad_steps(self, trainer: L.Trainer, step: int) -> bool:
        """Whether the save of ``step`` waits: its state follows non-finite steps (the loss or
        gradient norm; their weights can be finite: a clipped infinite norm, a step DeepSpeed
        skipped) that the divergence stop counts towards ``patience``. Saved, it became
        ``last.ckpt`` and rotation could delete the checkpoint a branch would start from; the
        save is taken at the first finite step instead (none if the run stops as diverged),
        said once per run of such steps; not when the run stops at this step (the stop's own
        save follows, with its line, or the stop says why it saves nothing)."""
        bad_from = open_bad_streak(trainer)
        if bad_from is None:
            self._held_for = None
            return False
        self._pending_save = True  # the next step that closes the run of bad steps saves
        if trainer.should_stop or self.last_saved_step == step:
            return True
        if trainer.is_global_zero and self._held_for != bad_from:
            newest = self.newest_saved()
            kept = f"{newest} (step {self.last_saved_step})" if newest else "none yet"
            warn(
                "nanolab",
                f"not saving {step_checkpoint_name(step)} yet: the loss or gradient norm has "
                f"not been finite since step {bad_from}; the save waits for a finite step "
                f"(the newest checkpoint stays {kept})",
            )
        self._held_for = bad_from
        return True

    def save_now(self, trainer: L.Trainer) -> Path | None:
        """Save the current state as ``step-N.ckpt`` (+ ``last.ckpt``) now; returns its path.

        None when the parameters are not finite (nothing is written; see :meth:`_save`).
        """
        return self._save(trainer, trainer.global_step)

    def _save(self, trainer: L.Trainer, step: int) -> Path | None:
        clock = self.clock
        assert self.dirpath is not None and clock is not None
        path = self.dirpath / step_checkpoint_name(step)
        # The values still in flight first: the spike guard's window and the divergence stop's
        # streaks must hold this step, and what they decide on it can forbid the save.
        settle_step_values(trainer)
        if not stop_saves_state(trainer):
            return None  # a loss spike's state: rolled back from, or stopped without saving
        if not parameters_finite(trainer):
            # A diverged state must not rotate the last finite checkpoints away.
            if trainer.is_global_zero:
                newest = self.newest_saved()
                kept = f"{newest} (step {self.last_saved_step})" if newest else "none yet"
                print(
                    f"nanolab: warning: not saving {path.name}: the parameters are not finite "
                    f"(NaN/inf); the newest checkpoint stays {kept}",
                    file=sys.stderr,
                    flush=True,
                )
            return None
        # A stop's save (a preemption, a budget) inside non-finite steps keeps the progress:
        # the streak travels in the file, so a resume stops where this run would. Rotation
        # keeps the checkpoint a branch from before them starts from (the exit line's).
        bad_from = open_bad_streak(trainer)
        if self._folder is None and trainer.is_global_zero:
            self._claim_folder(at_start=False)  # the first save of a run without the folder
        is_async = isinstance(self._io, AsyncAtomicCheckpointIO)
        clock.sync_device(trainer)
        previous, self.last_saved_step = self.last_saved_step, step  # stored inside the file
        try:
            with clock.pause("checkpoint"):
                start = time.monotonic()
                if self._rename_after_save:
                    # A fresh name, rank 0's on every rank: the shards of one save meet there.
                    tmp = Path(trainer.strategy.broadcast(str(temp_name(path))))
                    trainer.save_checkpoint(tmp, weights_only=False)
                    if trainer.is_global_zero:
                        if self._folder is not None:
                            self._folder.check(path.name)
                        publish(tmp, path)
                else:
                    trainer.save_checkpoint(path, weights_only=False)
                stall = time.monotonic() - start
        except BaseException:
            self.last_saved_step = previous
            raise
        self._last_save_time = time.monotonic()
        if not trainer.is_global_zero:
            return path
        vals = dict(self.val_by_step)

        def done() -> None:
            """Once ``path`` is complete: point last.ckpt at it, rotate, report."""
            if self._folder is not None:
                self._remember(path.name)
            if self.save_last:
                atomic_link(path, path.parent / LAST_NAME, self._folder, self.retention())
                if self._folder is not None:
                    self._remember(LAST_NAME)
            deleted = self._rotate(path, step, vals, bad_from)
            self._done_records.append(
                {
                    "event": "checkpoint",
                    "step": step,
                    "path": str(path),
                    "seconds": round(stall, 4),
                    "write_seconds": round(time.monotonic() - start, 4),
                    "bytes": _size(path),
                    "async": is_async,
                    "deleted": [p.name for p in deleted],
                }
            )

        if self._io is not None:
            self._io.then(done)
        else:
            done()
        if bad_from is not None:
            self._say_kept_for_branch(path, bad_from, bad_steps_left(trainer))
        self._emit_done(trainer)
        return path

    def _say_kept_for_branch(self, path: Path, bad_from: int, left: int | None) -> None:
        """One line on a save inside non-finite steps: what it holds, what its resume does
        (stops as diverged only if the ``left`` steps after it are not finite either: it may
        recover, as this run might have), and which checkpoint rotation keeps for a branch
        from before them."""
        branch = branch_step(self._existing_steps(), bad_from)
        kept = (
            f"; {step_checkpoint_name(branch)}, the newest checkpoint a finite step followed, "
            "is kept for a branch"
            if branch is not None
            else ""
        )
        after = "the next step is" if left == 1 else f"the next {left} steps are"
        diverges = (
            f"stops as diverged if {after} not finite either"
            if left is not None
            else "stops as diverged where this run would"
        )
        warn(
            "nanolab",
            f"{path.name} holds a state after non-finite steps (from step {bad_from}): a "
            f"resume goes on from it and {diverges}{kept}",
        )

    def unrecorded_records(self, trainer: L.Trainer, log: Path) -> list[dict[str, Any]]:
        """The ``checkpoint`` records the run log ``log`` lacks for step checkpoints of this
        run, up to the step resumed from (:func:`unrecorded_checkpoints`); rank 0, on a resume.

        The run log writes them before its ``start`` record: the saves were an earlier
        process's. An async save is recorded by the training thread at the step after it is
        complete, so a process killed in between left a complete checkpoint (the one the resume
        takes) that its log never mentioned.
        """
        if self.dirpath is None or not self.active:
            return []
        return unrecorded_checkpoints(self.dirpath, log, int(trainer.global_step))

    def _emit_done(self, trainer: L.Trainer) -> None:
        while self._done_records:
            record = self._done_records.pop(0)
            emit(trainer, {"event": record.pop("event"), "time": time.time(), **record})

    # -- rotation ----------------------------------------------------------------------------
    def _existing_steps(self) -> set[int]:
        if self.dirpath is None or not self.dirpath.is_dir():
            return set()
        return {s for p in self.dirpath.iterdir() if (s := step_of(p)) is not None}

    def _best_steps(self, vals: dict[int, float], steps: set[int]) -> list[int]:
        ranked = sorted((v, s) for s, v in vals.items() if s in steps)
        return [s for _, s in ranked[: self.keep_best]]

    def _rotate(
        self, newest: Path, newest_step: int, vals: dict[int, float], bad_from: int | None = None
    ) -> list[Path]:
        """Delete step checkpoints beyond last K + best J (then beyond the disk cap). With the
        newest saved inside non-finite steps from ``bad_from``, the newest checkpoint a finite
        step followed (a branch's start, :func:`branch_step`) is kept too, also by the cap."""
        folder = newest.parent
        if self._folder is not None:
            self._folder.check("rotation")
            names = os.listdir(self._folder.fd)
        else:
            names = os.listdir(folder)
        files = {s: folder / n for n in names if (s := step_of(n)) is not None}
        # Files from steps after this one belong to a timeline abandoned by resuming from an
        # older checkpoint: leave them (they are overwritten when the run gets there again).
        timeline = sorted(s for s in files if s <= newest_step)
        keep = set(timeline[-self.keep_last :]) if self.keep_last else set()
        keep.add(newest_step)
        if self.keep_one_older_than:  # one to roll back to, from before any spike in progress
            keep.update(kept_for_rollback(timeline, newest_step, self.keep_one_older_than))
        branch = branch_step(timeline, bad_from) if bad_from is not None else None
        if branch is not None:
            keep.add(branch)
        best = self._best_steps(vals, set(timeline))
        keep.update(best)
        deleted = [files[s] for s in timeline if s not in keep and self._delete(files[s])]
        if self.max_disk_gb is not None:
            spared = {newest_step} if branch is None else {newest_step, branch}
            deleted += self._enforce_cap(folder, files, keep, spared, best)
        return deleted

    def _enforce_cap(
        self,
        folder: Path,
        files: dict[int, Path],
        keep: set[int],
        spared: set[int],
        best: list[int],
    ) -> list[Path]:
        """Delete kept files, oldest non-best first, until the folder fits the cap; never
        those of ``spared`` (the newest, and a branch's start inside non-finite steps)."""
        assert self.max_disk_gb is not None
        cap = self.max_disk_gb * 1e9
        kept = {s: files[s] for s in keep if s in files}
        inodes = {p.stat().st_ino for p in kept.values() if p.exists() and not p.is_dir()}
        last = folder / LAST_NAME
        extra = 0
        if last.exists() and not last.is_symlink() and last.stat().st_ino not in inodes:
            extra = _size(last)
        total = extra + sum(_size(p) for p in kept.values())
        # Oldest non-best first, then the worse best ones; never the newest.
        order = [s for s in sorted(kept) if s not in best and s not in spared]
        order += [s for s in reversed(best) if s not in spared and s in kept]
        removed: list[Path] = []
        for s in order:
            if total <= cap:
                break
            size = _size(kept[s])
            if self._delete(kept[s]):
                total -= size
                removed.append(kept[s])
        if total > cap and not self._warned_cap:
            self._warned_cap = True
            warn(
                "nanolab",
                f"checkpoint.max_disk_gb {self.max_disk_gb} is smaller than one checkpoint "
                f"({size_text(total)} on disk); keeping the newest anyway",
            )
        return removed

    def _delete(self, path: Path) -> bool:
        """Delete a step checkpoint this run wrote; leave anything else (False).

        In the claimed folder, only a name this run recorded, still the same file (a copy of
        another run's checkpoint put under that name is a different inode), is deleted, through
        the folder's descriptor.
        """
        folder = self._folder
        if folder is None:
            remove(path)
            return True
        ident = self._ident(path.name)
        if ident is None or self._written.get(path.name) != ident:
            return False
        folder.check(f"a deletion of {path.name}")
        unlink_in(folder, path)
        self._written.pop(path.name, None)
        return True

    def newest_saved(self) -> Path | None:
        """The file of the newest complete save of this run (None: none yet, or gone): its
        ``last.ckpt`` where that is kept and is the same file, else its step file. What a
        summary names: a ``last.ckpt`` left by an earlier launch (``save_last false`` now)
        or by a resume from an older checkpoint would name an older model."""
        if self.dirpath is None or self.last_saved_step is None:
            return None
        newest = self.dirpath / step_checkpoint_name(self.last_saved_step)
        if not newest.exists():
            return None
        last = self.dirpath / LAST_NAME
        with contextlib.suppress(OSError):
            if self.save_last and last.exists() and os.path.samefile(last, newest):
                return last
        return newest

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "val_by_step": {str(k): v for k, v in self.val_by_step.items()},
            "last_saved_step": self.last_saved_step,
            # What val_by_step holds: an export's model card reads it as the validation loss
            # only when it is ``val/loss``.
            "monitor": self.monitor,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.val_by_step = {int(k): float(v) for k, v in state_dict.get("val_by_step", {}).items()}
        self.last_saved_step = state_dict.get("last_saved_step")


#: Seconds a ``checkpoint`` record's time may lie before its file's modification time and still
#: be that file's record: the clocks of a network file system's server and of this host differ.
RECORD_CLOCK_SLACK_S = 60.0


def unrecorded_checkpoints(folder: Path, log: Path, upto: int) -> list[dict[str, Any]]:
    """``checkpoint`` records for the step checkpoints in ``folder`` (steps up to ``upto``) that
    the run log ``log`` has none for, oldest first, each marked ``recovered``.

    Only a save after the newest recorded one can lack its record: an async save is recorded
    at the step after it completes, so a process killed in between leaves only that one save
    unrecorded. So only files of a later step than the log's newest ``checkpoint`` record are
    looked at, and the file times of the others never matter (a copy with ``cp -r`` or
    ``rsync -r``, a cloud sync or a network file system's clock gives every file a new one). A
    file of such a step is recorded when a record names its step and file name (and its size,
    where the record says it) from no earlier than the file was complete, give or take
    :data:`RECORD_CLOCK_SLACK_S`: after a resume from an earlier checkpoint, a record of the
    same step from before it is another file's (a rollback moves the newer files away).

    The log is read backwards, only its ``checkpoint`` lines parsed, and no further back than
    the oldest such file. A recovered record says what the file says: its ``time`` is the
    file's modification time (when the save was complete), ``bytes`` its size; what only the
    saving process knew (``seconds``, ``write_seconds``, ``async``, ``deleted``) is null.
    """
    files: dict[int, tuple[Path, float]] = {}
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                step = step_of(entry.name)
                if step is None or step > upto:
                    continue
                with contextlib.suppress(OSError):
                    st = entry.stat(follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
                        files[step] = (Path(folder) / entry.name, st.st_mtime)
    except OSError:
        return []
    unseen: dict[int, tuple[Path, float]] | None = None  # known at the newest record
    with contextlib.closing(iter_backwards(log, "checkpoint")) as newest_first:
        for record in newest_first:
            step = record.get("step")
            if not isinstance(step, int) or isinstance(step, bool):
                continue
            if unseen is None:  # the newest recorded save: only later ones can be unrecorded
                unseen = {s: f for s, f in files.items() if s > step}
                if not unseen:
                    return []
                oldest = min(mtime for _, mtime in unseen.values()) - RECORD_CLOCK_SLACK_S
            when = record.get("time")
            if isinstance(when, (int, float)) and not isinstance(when, bool) and when < oldest:
                break  # older than every such file: no record of one of them lies further back
            if step in unseen and _records_file(record, *unseen[step]):
                del unseen[step]
                if not unseen:
                    break
    if unseen is None:  # the log records no save: every file is one
        unseen = files
    return [
        {
            "event": "checkpoint",
            "time": mtime,
            "step": step,
            "path": str(path),
            "seconds": None,
            "write_seconds": None,
            "bytes": _size(path),
            "async": None,
            "deleted": None,
            "recovered": True,
        }
        for step, (path, mtime) in sorted(unseen.items())
    ]


def _records_file(record: dict[str, Any], path: Path, mtime: float) -> bool:
    """Whether the ``checkpoint`` record ``record`` (of ``path``'s step) is the record of the
    file ``path``: the same file name, the same size where the record says it, written no
    earlier than the file was complete (give or take :data:`RECORD_CLOCK_SLACK_S`)."""
    named = record.get("path")
    if isinstance(named, str) and Path(named).name != path.name:
        return False
    size = record.get("bytes")
    if isinstance(size, int) and not isinstance(size, bool) and size != _size(path):
        return False
    when = record.get("time")
    if not isinstance(when, (int, float)) or isinstance(when, bool):
        return False
    return when >= mtime - RECORD_CLOCK_SLACK_S


def unlink_in(folder: ClaimedDir, path: Path) -> None:
    """Delete the entry ``path.name`` of ``folder`` through its descriptor (gone already: fine).

    A sharded checkpoint (a folder) is first renamed to a hidden name, then its tree removed:
    a crash in between leaves ``.<name>.deleting``, never half a checkpoint under its name
    (which a resume would try to load)."""
    with contextlib.suppress(FileNotFoundError):
        st = os.stat(path.name, dir_fd=folder.fd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(path.name, dir_fd=folder.fd)
            return
        doomed = f".{path.name}{DELETING}"
        _rmtree_in(folder, doomed)  # a crash's leftover of the same name
        os.rename(path.name, doomed, src_dir_fd=folder.fd, dst_dir_fd=folder.fd)
        _rmtree_in(folder, doomed)


#: The ending :func:`unlink_in` gives a sharded checkpoint (a folder) it is about to remove.
DELETING = ".deleting"


def _checkpoint_name(name: str) -> bool:
    """Whether ``name`` is one of the run's checkpoint names (``step-N.ckpt``, ``last.ckpt``)."""
    return step_of(name) is not None or name == LAST_NAME


def _save_temp_name(name: str) -> bool:
    """Whether ``name`` is a temp name a save of a checkpoint makes (``.step-N.ckpt.<16 hex>.tmp``
    or ``.last.ckpt.<16 hex>.tmp``), not any hidden ``.<x>.<16 hex>.tmp`` a user keeps there."""
    return is_temp_name(name) and _checkpoint_name(name[1:].rsplit(".", 2)[0])


def _leftover_file(name: str) -> bool:
    """Whether a file named ``name`` is nanolab's to clear at claim time: a save's temp file,
    or the fixed ``step-N.ckpt.tmp`` / ``last.ckpt.tmp`` an older nanolab saved through. Any
    other ``.tmp`` file (a user's ``notes.tmp``, another tool's) is not the run's to delete."""
    old = name.endswith(".tmp") and _checkpoint_name(name[: -len(".tmp")])
    return old or _save_temp_name(name)


def _leftover_folder(name: str) -> bool:
    """Whether a folder named ``name`` is nanolab's to clear at claim time: a sharded save's
    temp folder, or one :func:`unlink_in` renamed to ``.<name>.deleting`` (a checkpoint's or
    such a temp folder's) whose removal was cut short (each would be kept for good)."""
    if name.startswith(".") and name.endswith(DELETING):
        inner = name[1 : -len(DELETING)]
        return _checkpoint_name(inner) or _save_temp_name(inner)
    return _save_temp_name(name)


def _clear_leftover(folder: ClaimedDir, name: str) -> None:
    """Delete ``name``, a ``.tmp`` or ``.deleting`` entry of the claimed ``folder`` that a save
    or a removal cut short left.

    A file goes where :func:`_leftover_file` says nanolab made its name; a folder (a sharded save: DeepSpeed, FSDP2, or a sharded checkpoint
    on its way out) only where :func:`_leftover_folder` says nanolab made its name, removed as
    :func:`unlink_in` removes a sharded checkpoint, never through a link. Each such name is new
    at every save, so a leftover folder not cleared here is a whole set of shards kept for
    good, one more per crash. An entry that cannot be removed stays: the run goes on without
    that space, as before."""
    with contextlib.suppress(OSError):
        st = os.stat(name, dir_fd=folder.fd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):  # a link too: removed, never followed
            if _leftover_file(name):
                os.unlink(name, dir_fd=folder.fd)
        elif _leftover_folder(name):
            if name.endswith(DELETING):
                _rmtree_in(folder, name)
            else:
                unlink_in(folder, folder.path / name)


def _rmtree_in(folder: ClaimedDir, name: str) -> None:
    """Remove the tree ``name`` of ``folder`` (through its descriptor where Python can)."""
    with contextlib.suppress(FileNotFoundError):
        if sys.version_info >= (3, 11):
            shutil.rmtree(name, dir_fd=folder.fd)
        else:
            shutil.rmtree(folder.path / name)


def parameters_finite(trainer: L.Trainer) -> bool:
    """Whether every parameter of the model is finite on every rank (called on all ranks):
    each rank checks the values it holds (its shard under FSDP2 and ZeRO-3)."""
    module = trainer.lightning_module
    flags = []
    for p in module.parameters():
        local = local_values(p)
        if local.numel():
            flags.append(torch.isfinite(local.detach()).all())
    finite = bool(torch.stack(flags).all()) if flags else True
    if trainer.world_size > 1:
        finite = bool(trainer.strategy.reduce_boolean_decision(finite, all=True))
    return finite


def newest_saved(trainer: Any) -> Path | None:
    """The newest complete checkpoint the run of ``trainer`` saved (None: it saved none, or
    it has no :class:`RotatingCheckpoint`): :meth:`RotatingCheckpoint.newest_saved`."""
    for callback in getattr(trainer, "callbacks", None) or ():
        if isinstance(callback, RotatingCheckpoint):
            return callback.newest_saved()
    return None


__all__ = [
    "LAST_NAME",
    "RotatingCheckpoint",
    "step_checkpoint_name",
    "step_of",
]


def set_aside_newer(
    folder: Path, target: Path, step: int, skipped: tuple[Path, ...] | list[Path] = ()
) -> list[str]:
    """Make ``target`` (step ``step``) the newest checkpoint of ``folder``: a ``last.ckpt``
    there points at it and the step checkpoints after it move into ``rolled_back/`` (never
    deleted; a name taken by an earlier move gets a suffix). Returns the names moved. A rollback
    does this, and so does a resume from an older checkpoint of the run: its saves would
    otherwise overwrite the newer files, and ``last.ckpt`` would name one of them.

    ``skipped``: files a resume passed over as unreadable; those of ``folder`` move too (a
    ``last.ckpt`` with bytes of its own would be replaced by the first save, and a damaged file
    may be all that is left of those steps). A link to a file that moves, or to ``target``, has
    no bytes of its own and stays (``last.ckpt`` is pointed at ``target``).

    No ``last.ckpt`` is made where there is none (a run with ``checkpoint.save_last false``):
    nothing would update it after the saves that follow, and it would stay behind as an old
    "newest" checkpoint."""
    last = folder / LAST_NAME
    had_last = last.exists() or last.is_symlink()
    newer = sorted(p for p in folder.iterdir() if (s := step_of(p)) is not None and s > step)
    kept_elsewhere = {_inode(p) for p in [target, *newer]} - {None}
    own_bytes = [
        p
        for p in skipped
        if p.parent.resolve() == folder.resolve()
        and not p.is_symlink()
        and (ident := _inode(p)) is not None
        and ident not in kept_elsewhere
    ]
    moving = newer + sorted(own_bytes)
    if moving:
        aside = rolled_back_folder(folder)
        for path in moving:
            kept = aside / path.name
            n = 1
            while kept.exists():  # an earlier rollback moved one of that name: keep both
                kept, n = aside / f"{path.stem}.{n}{path.suffix}", n + 1
            try:
                path.rename(kept)
            except OSError as err:
                raise RunConfigError(
                    f"cannot move {path} to {aside} ({err.strerror or err}): the run's saves "
                    f"would overwrite it; move it out of {folder} yourself (or make {aside} "
                    "writable) and launch again"
                ) from None
    if target.exists() and had_last:
        atomic_link(target, last)
    return [p.name for p in moving]


def rolled_back_folder(folder: Path) -> Path:
    """``folder``'s ``rolled_back/`` (made where missing), where a rollback or a resume from an
    older checkpoint moves the newer files; :class:`RunConfigError` (one line naming it and the
    fix, :func:`rolled_back_problem`) where it cannot be made."""
    aside = folder / ROLLED_BACK_DIR
    try:
        aside.mkdir(exist_ok=True)  # another rank may make it first
    except OSError as err:
        raise RunConfigError(rolled_back_problem(folder) or _cannot_create(aside, err)) from None
    return aside


def rolled_back_problem(folder: Path) -> str | None:
    """Why ``folder``'s ``rolled_back/`` could not take the files a resume from an older
    checkpoint sets aside (a file of that name, a folder nanolab may not write), without
    writing anything: a fit asks before it trains, so a launch that could not move them is one
    line, exit 2, not a traceback after the restore (and nothing moved half-way)."""
    aside = folder / ROLLED_BACK_DIR
    if aside.is_dir():
        ok = os.access(aside, os.W_OK | os.X_OK)
        return None if ok else _cannot_create(aside, PermissionError(13, "not writable"))
    if aside.exists() or aside.is_symlink():
        return (
            f"{aside} is a file, not a folder: nanolab sets checkpoints newer than the one a "
            "run resumes from aside there; rename or remove that file and launch again"
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        return _cannot_create(aside, PermissionError(13, "permission denied"))
    return None


def _cannot_create(aside: Path, err: OSError) -> str:
    return (
        f"cannot write {aside} ({err.strerror or err}), where nanolab sets checkpoints newer "
        f"than the one a run resumes from aside; make {aside.parent} writable and launch again"
    )


def _inode(path: Path) -> tuple[int, int] | None:
    """(device, inode) of ``path`` (None: gone); hard links to one file share it."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino)
