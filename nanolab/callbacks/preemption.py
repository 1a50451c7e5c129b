"""Preemption: on SIGTERM/SIGINT/SIGUSR1, finish the optimizer step, checkpoint, exit 75.

Spot instances, SLURM preemption and a lab's "give the GPUs back at 8" all announce themselves
with a signal and a grace period. Lightning's own SIGTERM handling stops after the current
*micro*-batch, which under gradient accumulation is the middle of an optimizer step, and saves
nothing. This callback instead:

1. on the first signal, only records it (a signal handler must not do real work: it runs between
   two bytecodes of whatever the main thread was doing);
2. at the end of the optimizer step in progress (never mid-accumulation; after its evaluation
   when it is an evaluation step, or right after an evaluation the signal interrupted; with
   ``finish_validation: false`` before that evaluation, which the resumed run then runs first),
   all ranks agree to stop, a checkpoint is saved through the Trainer (the same atomic path as every other checkpoint),
   and :class:`Preempted` is raised (a signal that lands during the step's periodic save stops
   right after that save, on its checkpoint: not one more step of training and another save): other callbacks see it in ``on_exception`` (the JSONL log
   writes its ``end`` record with reason ``preempted``) and the process exits with
   :data:`EXIT_PREEMPTED` (75, ``EX_TEMPFAIL``: "try again later");
   A loss spike or divergence found at that step (its values settled first) stands instead: the
   run ends on that verdict, with its own save rule, ``end`` record and exit;
3. on a second signal, exits at once (the previous complete checkpoint is still there: writes
   are atomic).

Several processes: every rank decides at each step end whether any rank was signalled, so a
signal needs no forwarding to stop them all. Rank 0 does not pass its first signal on to the
ranks Lightning's launcher started from it: when the whole process group was signalled (GNU
``timeout``, ``kill -- -PGID``, SLURM), a forwarded copy would reach them as a *second* signal
and end them without a checkpoint. On its own second signal rank 0 ends those ranks with
SIGKILL (they may be waiting in a collective that a catchable signal does not interrupt, as
Lightning's launcher also knows), then itself.

A signal that arrives during start-up, before this callback's handlers exist, is held by
:mod:`nanolab.training.early_signals` (installed first thing by ``nanolab fit``) and ends the run
at ``on_train_start``, before its first step: an ``end`` record with reason ``preempted``, exit 75.

A run restarted with the same ``run.name`` (``run.resume auto``) continues bit-exactly from that
checkpoint. Exit code 75 lets a wrapper tell "preempted, rerun me" from "done" (0) and "broken"
(anything else): ``until nanolab fit ...; [ $? -ne 75 ]; do :; done``.

SLURM: with Lightning's auto-requeue active (``SLURMEnvironment(auto_requeue=True)``, the default
when SLURM launched the job), Lightning owns the requeue signal (SIGUSR1 unless configured): it
saves ``hpc_ckpt_<n>.ckpt`` and runs ``scontrol requeue``. This callback leaves that signal
alone, so requeueing keeps working, and still handles SIGTERM (what SLURM sends at the time
limit and on preemption) and SIGINT. ``run.resume auto`` also considers ``hpc_ckpt_*.ckpt``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.exceptions import SIGTERMException

from nanolab.atomic import temp_name
from nanolab.callbacks.events import set_stop_reason, stop_reason, stop_saves_state
from nanolab.callbacks.files import publish
from nanolab.callbacks.step import (
    StepCallback,
    scheduled_validation,
    settle_step_values,
    validate_now,
    validation_follows,
)
from nanolab.model.config import ConfigError

#: Exit status of a preempted run (sysexits.h EX_TEMPFAIL: a temporary failure, retry later).
EXIT_PREEMPTED = 75

#: The reason string the ``end`` record carries for a preempted run.
REASON = "preempted"

#: Stop reasons after which a signal does not preempt: the run is ending by itself (a final
#: validation and save, exit 0), and a rerun must not train on past the rule's decision.
ENDS_ON_ITS_OWN = ("budget", "plateau")


class PreemptionConfigError(ConfigError):
    """A ``preemption`` setting that cannot work (e.g. an unknown signal name)."""


class Preempted(SIGTERMException):
    """The run stopped on a signal after saving a checkpoint; exits the process with ``code``.

    A subclass of Lightning's ``SIGTERMException`` (itself a ``SystemExit``), so code that already
    treats Lightning's SIGTERM stop as "interrupted, not failed" treats this one the same way.
    """

    def __init__(
        self,
        signal_name: str,
        step: int,
        checkpoint: str | None,
        code: int,
        before_first_step: bool = False,
    ) -> None:
        super().__init__(code)
        self.signal_name = signal_name
        self.step = step
        self.checkpoint = checkpoint
        self.before_first_step = before_first_step
        self.reason = REASON

    def __str__(self) -> str:
        if self.before_first_step:
            return f"preempted by {self.signal_name} before the first step (at step {self.step})"
        return (
            f"preempted by {self.signal_name} after step {self.step}; checkpoint {self.checkpoint}"
        )


def parse_signals(names: list[str]) -> list[signal.Signals]:
    """``["SIGTERM", "usr1", "INT"]`` -> signals; an unknown name is one clear error."""
    out: list[signal.Signals] = []
    for raw in names:
        name = "SIG" + str(raw).strip().upper().removeprefix("SIG")
        sig = getattr(signal, name, None)
        if not isinstance(sig, signal.Signals) or name in ("SIGKILL", "SIGSTOP"):
            raise PreemptionConfigError(
                f"preemption.signals: {raw!r} is not a signal that can be caught; "
                "use names such as SIGTERM, SIGINT, SIGUSR1, SIGUSR2"
            )
        if sig not in out:
            out.append(sig)
    return out


def slurm_requeue_signal(trainer: pl.Trainer) -> signal.Signals | None:
    """The signal Lightning's SLURM auto-requeue listens to, or None when it is not active."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    # Where Lightning's own signal connector looks: single-device strategies carry no
    # cluster_environment, but the accelerator connector always resolves one. Lightning has no
    # public accessor for the resolved environment (the connector is private); if it moves, only
    # a strategy's own environment is seen, and on one device SIGUSR1 is then handled here.
    connector = getattr(trainer, "_accelerator_connector", None)
    env = getattr(connector, "cluster_environment", None) or getattr(
        trainer.strategy, "cluster_environment", None
    )
    if isinstance(env, SLURMEnvironment) and env.auto_requeue:
        return signal.Signals(env.requeue_signal or signal.SIGUSR1)
    return None


class PreemptionHandler(StepCallback):
    """Turns a termination signal into "finish this step, checkpoint, exit 75".

    Its hooks run after the other step callbacks' except the checkpoint's (whatever the order
    of registration), so the step's record is written and every stop decision taken before it
    saves and raises.

    Args:
        enabled: Install the handlers. Off = Lightning's default behaviour.
        signals: Signals that mean "preempted" (names, ``SIG`` optional). SIGKILL cannot be
            caught; that case is what atomic checkpoints and ``run.resume auto`` are for.
        exit_code: Process exit status after a preemption checkpoint (75 = EX_TEMPFAIL).
        finish_validation: When the step in progress is an evaluation step, evaluate before
            saving, so the evaluation is in the log and in the checkpoint. ``false`` on machines
            with a grace period shorter than an evaluation: the checkpoint comes first and
            records that its step is unevaluated; the resumed run evaluates it before its first
            training step (Lightning itself would skip it), so its log, plateau rule and
            in-loop tasks are those of a run never stopped.
    """

    def __init__(
        self,
        enabled: bool = True,
        signals: list[str] = ["SIGTERM", "SIGINT", "SIGUSR1"],  # noqa: B006 (copied below)
        exit_code: int = EXIT_PREEMPTED,
        finish_validation: bool = True,
    ) -> None:
        super().__init__()
        self.enabled = enabled
        self.signals = parse_signals(list(signals))
        if not 0 <= exit_code <= 255:
            raise PreemptionConfigError(
                f"preemption.exit_code must be in 0..255, got {exit_code}; 75 is the default"
            )
        self.exit_code = exit_code
        self.finish_validation = finish_validation
        self._after_validation = False
        self.received: signal.Signals | None = None
        self.received_at: float | None = None
        self._previous: dict[signal.Signals, Any] = {}
        self._trainer: pl.Trainer | None = None
        self._stepped = False  # an optimizer step ended in this process
        # Between a step's end (on_step) and the next micro-batch: its evaluation and save.
        self._step_ended = False
        self._yielded = False  # a spike or divergence verdict on the signalled step ended the run
        # The step of the checkpoint saved before its evaluation (finish_validation: false);
        # carried in the checkpoint so that the resumed run evaluates it first.
        self._unevaluated: int | None = None

    def _run_dir(self) -> Path | None:
        """Where a checkpoint to resume from would be (for the watchdog's exit code)."""
        return Path(self._trainer.default_root_dir) if self._trainer is not None else None

    # -- signal plumbing -------------------------------------------------------------------
    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self.received is not None:
            # Second signal: the user (or the scheduler) means it. Die by that signal now.
            _write_stderr(f"nanolab: second {sig.name}: exiting now without a checkpoint\n")
            self._end_launched_ranks()
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
            return
        self.received = sig
        self.received_at = time.time()
        if not self._stepped:  # the first step may never end (a compile, a hung collective)
            from nanolab.training import early_signals

            early_signals.arm_watchdog(sig, self._run_dir, self._end_launched_ranks)
        if getattr(self._trainer, "global_rank", 0) == 0:  # one line per launch, not per rank
            _write_stderr(self._notice(sig) + " (send it again to exit at once)\n")
        # Not passed on to the ranks launched from here: they learn it at the step's end (see
        # the module docstring), and a group signal has reached them already.

    def _notice(self, sig: signal.Signals) -> str:
        """What a first signal will do, in words that come true: a preemption (checkpoint, exit
        ``exit_code``), or, when the run ends at the step the signal applies to anyway (its
        last step, or one a budget or plateau rule ends it at; :meth:`_agreed` does not preempt
        then), the usual end, exit 0 (docs/resume.md)."""
        trainer = self._trainer
        done = int(trainer.global_step) if trainer is not None else None
        said = f"nanolab: received {sig.name} at step {'?' if done is None else done}"
        if trainer is not None and done is not None:
            # The signal applies to the step in progress, or to the one just ended while its
            # evaluation and save run (on_step has fired, the next micro-batch not yet begun).
            step = done if self._step_ended else done + 1
            reason = stop_reason(trainer)[0]
            if reason in ENDS_ON_ITS_OWN:
                return (
                    f"{said}: the {reason} rule ends the run at step {step}: completing it (exit 0)"
                )
            if 0 < getattr(trainer, "max_steps", -1) <= step:
                return f"{said}: step {trainer.max_steps} is the run's last: completing it (exit 0)"
        return (
            f"{said}: finishing the optimizer step, saving a checkpoint, then exiting with code "
            f"{self.exit_code}"
        )

    def _end_launched_ranks(self) -> None:
        """SIGKILL the ranks this process launched itself (Lightning's DDP launcher), before
        it exits without a checkpoint: left alone they would wait for it in a collective."""
        launcher = getattr(self._trainer.strategy, "launcher", None) if self._trainer else None
        kill = getattr(launcher, "kill", None)
        if callable(kill):
            # a launcher without children has nothing to end
            with contextlib.suppress(Exception):
                kill(signal.SIGKILL)

    def _install(self, trainer: pl.Trainer) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        requeue = slurm_requeue_signal(trainer)
        for sig in self.signals:
            if sig == requeue:
                continue  # Lightning's SLURM auto-requeue owns this one
            if signal.getsignal(sig) is signal.SIG_IGN:
                # Ignored by whoever started us (SIGINT for `cmd &` in a script, as Python and
                # the shells do): the same rule as during start-up (early_signals.install).
                continue
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)

    def _uninstall(self) -> None:
        from nanolab.training import early_signals

        early_signals.disarm_watchdog()
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    # -- hooks -----------------------------------------------------------------------------
    def on_run_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Installed here, after Lightning registered its own handlers (Trainer._run), so ours
        # replace its SIGTERM handler, which would stop in the middle of an accumulation.
        self._trainer, self._stepped, self._yielded = trainer, False, False
        from nanolab.training import early_signals

        held = early_signals.received()  # a signal that arrived during start-up
        early_signals.uninstall(deliver=False)  # these handlers take over from here
        self._install(trainer)
        if held is not None and self.received is None:
            self.received, self.received_at = held, early_signals.received_at()
        requested = self.received is not None
        # Collective when there are several ranks (all take part, whichever was signalled).
        if (requested or getattr(trainer, "world_size", 1) > 1) and self._agreed(
            trainer, requested
        ):
            self._stop(trainer, before_first_step=True)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self._step_ended = False  # a signal from here on applies to the step now training

    def on_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        self._step_ended = True
        if not self._stepped:
            from nanolab.training import early_signals

            self._stepped = True
            early_signals.disarm_watchdog()  # a step boundary: the usual stop takes over
        if not self._agreed(trainer, self.received is not None):
            return
        if validation_follows(trainer):
            if self.finish_validation:
                # This step is an evaluation step: evaluate first, so that the evaluation is in
                # the log and the checkpoint (a resume would not repeat it).
                self._after_validation = True
                return
            self._unevaluated = step  # saved with the checkpoint: the resume evaluates it
        self._stop(trainer)

    def on_validated(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        # A signal that arrived during an evaluation (or was held for one) stops right after it.
        if self._agreed(trainer, self._after_validation or self.received is not None):
            self._stop(trainer)

    def on_saved(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, path: str
    ) -> None:
        # The decision in on_step came before the checkpoint callback's save: a signal that
        # arrived during that save (a write of seconds to minutes) stops here, on its file.
        if self._agreed(trainer, self.received is not None):
            self._stop(trainer, saved=path)

    def _agreed(self, trainer: pl.Trainer, requested: bool) -> bool:
        """Whether to stop here: every rank stops at the same step, whichever was signalled;
        not after the last step, nor once a budget or plateau rule has stopped the run (it
        ends normally then, saves, and its ``end`` record keeps the rule's reason)."""
        if trainer.world_size > 1:
            requested = bool(trainer.strategy.reduce_boolean_decision(requested, all=False))
        ending = self._yielded or stop_reason(trainer)[0] in ENDS_ON_ITS_OWN
        return requested and not ending and not 0 < trainer.max_steps <= trainer.global_step

    def _stop(
        self, trainer: pl.Trainer, before_first_step: bool = False, saved: str | None = None
    ) -> None:
        """Stop the run at this step with a checkpoint of it: ``saved`` when the run's
        checkpoint callback has just written one, else one saved here."""
        if self.received is None:
            self.received = signal.SIGTERM  # another rank was signalled
        name, step = self.received.name, trainer.global_step
        self._after_validation = False
        if before_first_step:  # nothing was trained in this process: nothing to save
            set_stop_reason(trainer, REASON, f"{name} before the first step")
            path, what = None, f"before the first step (step {step}); nothing to save"
        else:
            # The step's values still in flight first (on a GPU they arrive at the next step):
            # the spike guard and the divergence stop judge this step before the signal does.
            settle_step_values(trainer)
            if self._yield_to_verdict(trainer, name):
                return
            set_stop_reason(trainer, REASON, name)  # the end record's reason
            path = saved if saved is not None else save_checkpoint_now(trainer)
            waited = max(0.0, time.time() - (self.received_at or time.time()))
            what = f"after step {step}: saved {path} ({waited:.1f}s after the signal)"
        if trainer.is_global_zero:
            _write_stderr(
                f"nanolab: preempted by {name} {what}; exiting with code {self.exit_code}, "
                "rerun the same command to resume\n"
            )
        raise Preempted(name, step, path, self.exit_code, before_first_step)

    def _yield_to_verdict(self, trainer: pl.Trainer, name: str) -> bool:
        """Whether a stop another callback decided at this step (a loss spike's rollback or
        stop, a divergence) ends the run instead of the signal, and if so say so.

        Such a verdict forbids saving the step (its weights are the spike's, or not finite):
        preempting over it saved them anyway, or saved nothing and said the parameters were
        not finite, and exited 75, so the rerun resumed from the weights the guard rejected
        (or diverged again). The verdict keeps its own save rule, end record and exit; a
        rollback a signal came with exits 75 after rolling back (``nanolab fit``)."""
        reason, detail = stop_reason(trainer)
        if reason is None or reason == REASON:
            return False
        self._yielded = True
        if trainer.is_global_zero:
            _write_stderr(
                f"nanolab: {name} after step {trainer.global_step}: the run stops on its own "
                f"verdict at this step instead ({reason}: {detail}), with no preemption "
                "checkpoint\n"
            )
        return True

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)  # every step callback's on_run_start, once
        self._evaluate_skipped(trainer)

    def _evaluate_skipped(self, trainer: pl.Trainer) -> None:
        """Run the evaluation the restored checkpoint was saved before, ahead of the first
        training step. Lightning does not repeat the evaluation of a step it resumes after; a
        run never stopped had this one (in its log, the plateau rule's patience and
        ``downstream.every_n_evals``). Here, after the other callbacks have started, on the
        restored weights: its numbers are the uninterrupted run's."""
        step, self._unevaluated = self._unevaluated, None  # a later save must not ask again
        if not self.active or step is None or step != trainer.global_step:
            return
        if not scheduled_validation(trainer):
            return  # not an evaluation step at this launch's settings
        if validate_now(trainer) and stop_reason(trainer)[0] in ENDS_ON_ITS_OWN:
            # It ended the run (a plateau): the step's checkpoint must hold that, as a run
            # never stopped saves it, or the same command would evaluate the step again.
            save_checkpoint_now(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._uninstall()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._uninstall()

    def state_dict(self) -> dict[str, Any]:
        # A new process starts unsignalled; only an evaluation saved before is carried over.
        return {} if self._unevaluated is None else {"unevaluated_step": self._unevaluated}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        step = state_dict.get("unevaluated_step")
        self._unevaluated = int(step) if step is not None else None


def save_checkpoint_now(trainer: pl.Trainer) -> str:
    """Save a checkpoint of the state right after this optimizer step, the run's usual way.

    The run's checkpoint callback, when it offers ``save_now(trainer)``, writes it (same name
    pattern, rotation and atomic write as its periodic saves). Otherwise the checkpoint is written
    here atomically: ``Trainer.save_checkpoint`` to a fresh ``.tmp`` name, fsync, then rename to
    ``<run_dir>/checkpoints/step-XXXXXXXX.ckpt``. Called on every rank (saving is collective for
    sharded strategies); only rank 0 renames.
    """
    for cb in trainer.checkpoint_callbacks:
        save_now = getattr(cb, "save_now", None)
        if callable(save_now):
            path = save_now(trainer)
            return str(path) if path is not None else f"none ({unsaved_because(trainer)})"
    settle_step_values(trainer)  # the callbacks' state holds this step (see RotatingCheckpoint)
    ckpt_dir = Path(trainer.default_root_dir) / "checkpoints"
    final = ckpt_dir / f"step-{trainer.global_step:08d}.ckpt"
    tmp = Path(trainer.strategy.broadcast(str(temp_name(final))))  # rank 0's, on every rank
    if trainer.is_global_zero:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    trainer.strategy.barrier("nanolab_preempt_mkdir")
    trainer.save_checkpoint(tmp, weights_only=False)
    if trainer.is_global_zero:
        publish(tmp, final)
    trainer.strategy.barrier("nanolab_preempt_saved")
    return str(final)


def unsaved_because(trainer: pl.Trainer) -> str:
    """Why the checkpoint callback's ``save_now`` saved nothing: the run's stop forbids saving
    the state (a loss spike's), or else the parameters are not finite."""
    if not stop_saves_state(trainer):
        reason, _ = stop_reason(trainer)
        return f"the {reason} stop forbids saving this state"
    return "parameters not finite"


def signalled(trainer: pl.Trainer) -> bool:
    """Whether this fit's preemption handler received a signal (one that a spike's rollback
    at that step took over: ``nanolab fit`` then exits 75 instead of continuing)."""
    callbacks = getattr(trainer, "callbacks", None) or []
    return any(isinstance(c, PreemptionHandler) and c.received is not None for c in callbacks)


def _write_stderr(text: str) -> None:
    """Write from a signal handler: ``os.write`` is reentrant, ``print`` is not."""
    with contextlib.suppress(OSError, ValueError):
        os.write(sys.stderr.fileno(), text.encode())
