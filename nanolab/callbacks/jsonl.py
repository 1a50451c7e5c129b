"""The run log callback: ``<run_dir>/metrics.jsonl``, one flushed JSON line per record.

``tail -1 runs/x/metrics.jsonl | jq .loss`` is current to the last logged step; ``nanolab report``
and the queue read the same file with :func:`nanolab.runlog.read_records`. The schema (docs/callbacks.md,
"Callbacks") is the contract; this module only assembles records:

* ``start`` once per process (after the checkpoint, if any, is restored);
* ``train`` every ``every_n_steps`` optimizer steps — the values logged since the previous one,
  the newest of each name (``self.log`` in the module's ``training_step``, in a step callback's
  ``step_values``; never one an earlier record holds) plus what the clock, the throughput meter
  and the budget contribute (:class:`~.events.RecordSource`);
* ``val`` after every validation; ``end`` when the run ends, for whatever reason.

Cost: no host-device sync of its own. A ``train`` record's device scalars (loss, gradient norm)
go into the step callbacks' one transfer (:mod:`nanolab.callbacks.readout`); on a GPU that copy
does not block, and the record is written when its values arrive, at the next step, so the host
queues the next step while the device finishes this one (the loop never waits for the device
to log). Its host fields (time, tokens, throughput, memory) are taken at its own step. Before any
other record (``val``, a checkpoint's, ``end``) the pending one is written, so the file stays in
step order; and before a save, so a process killed during an async save leaves its step's record. A JSON line is written with a flush per record. Rank 0 writes; the other ranks take part
only in the collective parts (the gradient norm of sharded parameters, broadcasting decisions).
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

import nanolab
from nanolab.callbacks.banner import expected_end, launch_schedule_note
from nanolab.callbacks.clock import RunClock
from nanolab.callbacks.devices import device_names
from nanolab.callbacks.events import (
    END_REASONS,
    CallbackConfigError,
    collect_fields,
    find_callback,
    stop_reason,
)
from nanolab.callbacks.loggers import (
    RunConfigWriter,
    as_recorded,
    forward_record,
    mute_lightning_metrics,
)
from nanolab.callbacks.lost_rank import lost_rank
from nanolab.callbacks.peak_flops import tf32_switch
from nanolab.callbacks.readout import StepReadout, Values
from nanolab.callbacks.rundir import (
    RESERVED_NAMES,
    RunDirError,
    claim_run_dir,
    config_hash,
    new_run_id,
)
from nanolab.callbacks.step import StepCallback
from nanolab.callbacks.throughput import METER_FIELDS
from nanolab.claimed import LeftClaimedDir
from nanolab.data.order import data_passes, dataset_passes
from nanolab.errors import NanolabError, disk_full, room_left
from nanolab.messages import warn
from nanolab.model.param_sizes import parameter_numel
from nanolab.runlog import (
    RUN_LOG_NAME,
    RunLogWriteError,
    RunLogWriter,
    last_record,
    read_records,
)
from nanolab.training import grad_norm
from nanolab.training.module import TRAIN_LOSS, GPTLightningModule
from nanolab.training.optim import planned_steps

__all__ = ["MetricsLog", "read_records"]

#: The run log's keys in the step readout (the logged names follow it).
LOG_KEY = "log:"

#: The keys every ``train`` record holds (null until their callback fills them, or without it):
#: the throughput meter's, from its own list, and the cost budget's ``cost``.
TRAIN_FIELDS: tuple[str, ...] = (*METER_FIELDS, "cost")


def data_identity(trainer: L.Trainer) -> str | None:
    """The content identity of the data this run trains on
    (:func:`nanolab.data.checks.content_identity`); None for a data module of one's own
    without a fingerprint."""
    from nanolab.data.checks import content_identity

    fingerprint = getattr(getattr(trainer, "datamodule", None), "data_fingerprint", None)
    if not callable(fingerprint):
        return None
    try:
        return content_identity(fingerprint())
    except (AttributeError, OSError, TypeError, ValueError):  # not set up: unknown, not guessed
        return None


def _dataset_passes(trainer: L.Trainer) -> dict[str, float] | None:
    """The end record's ``dataset_passes``: each dataset of a mixture and its own passes by
    now (:func:`nanolab.data.order.dataset_passes`); None for one dataset."""
    passes = dataset_passes(trainer)
    return {d.name: d.passes for d in passes} if passes else None


class MetricsLog(StepCallback):
    """Writes the run log ``<run_dir>/metrics.jsonl`` (schema in docs/callbacks.md).

    Its step hooks run first among the step callbacks, so a step's ``train`` record precedes
    whatever another callback records or decides at that step; but it takes the step's logged
    metrics after every callback's ``step_values`` (:attr:`reads_logged_metrics`), where a
    callback logs a metric for its step.

    Args:
        every_n_steps: Optimizer steps between ``train`` records (1 = every step).
        filename: Log file name inside the run directory (``trainer.default_root_dir``); not
            a name the run keeps for itself (``config.yaml``, ``rollbacks.json``,
            ``queue.log``, ``checkpoints``, ``previous``, ``.nanolab*``).
        monitor: The validation loss metric (``val_loss``/``val_ppl`` in ``val`` records).
        fresh: Start a new run even if the run directory holds another one; the old one is
            moved to ``<run_dir>/previous/``. Linked from ``run.fresh`` by ``nanolab fit``.
    """

    #: The one callback that writes the run log: :func:`nanolab.callbacks.events.emit` finds it.
    owns_run_log = True

    reads_logged_metrics = True

    def __init__(
        self,
        every_n_steps: int = 1,
        filename: str = RUN_LOG_NAME,
        monitor: str = "val/loss",
        fresh: bool = False,
    ) -> None:
        super().__init__()
        if not filename or Path(filename).name != filename:
            raise CallbackConfigError(
                f"log.filename must be a file name without folders, got {filename!r}"
            )
        if filename in RESERVED_NAMES or filename.startswith(".nanolab"):
            raise CallbackConfigError(
                f"log.filename {filename!r} is a file the run directory keeps for itself; "
                f"give another name (default {RUN_LOG_NAME})"
            )
        if every_n_steps < 1:
            raise CallbackConfigError(f"log.every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.filename = filename
        self.monitor = monitor
        self.fresh = fresh
        self.run_id: str | None = None
        #: The id ``nanolab fit`` settled for this run when it claimed the directory (the one
        #: its ``--logger`` was given): a new run takes it instead of drawing another.
        self.planned_run_id: str | None = None
        self.run_dir: str | None = None  # where this run is, saved in its checkpoints
        self.checkpoint_run_dir: str | None = None  # where the restored checkpoint was saved
        self.best_val_loss: float | None = None
        self._writer: RunLogWriter | None = None
        self._grad_norm: torch.Tensor | None = None
        self._lr: float | None = None  # the rate the step about to run trains with
        self._params: list[torch.nn.Parameter] | None = None
        self._pending: dict[int, dict[str, Any]] = {}  # train records waiting for their values
        self._taken: dict[str, Any] = {}  # the logged values as last taken (see _logged_since)
        self._unrecorded: dict[str, Any] = {}  # logged since the last train record, newest
        self._taken_at: int | None = None  # the step they were taken at, until the next starts
        self._warned_late = False
        self._ended = False

    # -- writing -----------------------------------------------------------------------------
    @property
    def path(self) -> Path | None:
        return self._writer.path if self._writer is not None else None

    def write(self, trainer: L.Trainer, record: dict[str, Any]) -> None:
        """Append one record (rank 0; a no-op elsewhere and before the log is open), after the
        train records still waiting for their values (the file stays in step order)."""
        if self._writer is None or self._writer.closed:
            return
        self.flush_train_records(trainer)
        record.setdefault("time", time.time())
        record.setdefault("step", int(trainer.global_step))
        with self.clock.pause("log") if self.clock else contextlib.nullcontext():
            self._writer.write(record)
            forward_record(trainer, record)  # --logger: the same record, at the same step

    # -- lifecycle ---------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.active:
            self._ended = False
            mute_lightning_metrics(trainer)  # loggers get the run log's records instead
            self._params = None  # listed at the first logged step, after configure_model
            self._taken, self._taken_at, self._unrecorded = {}, None, {}

    def on_run_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        assert self.clock is not None
        run_dir = Path(trainer.default_root_dir)
        path = run_dir / self.filename
        config = run_config(trainer, pl_module)
        resuming = trainer.ckpt_path is not None
        error, run_id, earlier, adopted = None, None, None, False
        if trainer.is_global_zero:
            try:
                run_id = claim_run_dir(
                    run_dir,
                    config,
                    resuming,
                    self.fresh,
                    self.filename,
                    checkpoint=trainer.ckpt_path,
                    checkpoint_run_id=self.run_id,  # restored from that checkpoint
                    checkpoint_run_dir=self.checkpoint_run_dir,
                    new_id=self.planned_run_id,
                ).run_id
            except RunDirError as err:
                error = (str(err), err.errno)  # a full disk keeps its exit code (74)
        error = trainer.strategy.broadcast(error, src=0)
        if error:
            refused = RunDirError(error[0])
            refused.errno = error[1]
            raise refused
        self.run_dir = os.path.realpath(run_dir)
        if trainer.is_global_zero:
            if resuming:
                # Time after the last checkpoint of the previous process was paid for too.
                prev = last_record(path, where=lambda r: r.get("elapsed_s") is not None)
                if prev is not None:
                    elapsed = float(prev["elapsed_s"])
                    step_s = float(prev.get("goodput") or 0.0) * elapsed
                    earlier = (elapsed, float(prev.get("gpu_hours") or 0.0), step_s)
                if self.run_id is None:  # checkpoint without our state: take the log's id
                    start = last_record(path, "start")
                    self.run_id = str(start["run_id"]) if start and start.get("run_id") else None
            # A claimed id: a new run (also one that starts from another's checkpoint).
            adopted = resuming and run_id is not None
            self.run_id = run_id or self.run_id or self.planned_run_id or new_run_id()
            try:
                self._writer = RunLogWriter(path, run_id=self.run_id)
            except OSError as err:
                if disk_full(err):
                    left, fix = room_left(run_dir, err)
                    full = RunDirError(f"cannot write the run log {path} ({left}); {fix}")
                    full.errno = err.errno
                    raise full from None
                raise RunDirError(
                    f"cannot write the run log {path} ({err.strerror or err}); set run.root to a "
                    "writable folder"
                ) from None
        earlier = trainer.strategy.broadcast(earlier, src=0)
        branched = bool(trainer.strategy.broadcast(adopted, src=0))
        if branched:
            self.clock.start_new_run()  # another run's checkpoint: its hours are not this run's
        if earlier is not None:
            self.clock.account_earlier(*earlier)
        if resuming and trainer.is_global_zero and not adopted:
            self._write_unrecorded(trainer, path)
        self.write(trainer, self._start_record(trainer, pl_module, config, resuming, branched))
        if trainer.is_global_zero:
            note = launch_schedule_note(trainer, pl_module, resuming)
            if note:  # every launch says it, with or without a progress bar
                warn("nanolab fit", note)

    def _write_unrecorded(self, trainer: L.Trainer, path: Path) -> None:
        """On a resume, before its ``start`` record: the records an earlier process of this run
        owed the log and never wrote, from each callback that keeps such a list
        (``unrecorded_records(trainer, log)``: the checkpoint rotation's saves completed after
        the process's last step, when a kill came before it could write them)."""
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            unrecorded = getattr(callback, "unrecorded_records", None)
            if callable(unrecorded):
                for record in unrecorded(trainer, path):
                    self.write(trainer, record)

    def _start_record(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        config: dict[str, Any] | None,
        resuming: bool,
        branched: bool = False,
    ) -> dict[str, Any]:
        run_dir = Path(trainer.default_root_dir)
        seed = os.environ.get("PL_GLOBAL_SEED")
        names = device_names(trainer)
        planned = planned_steps(trainer, pl_module)
        record: dict[str, Any] = {
            "event": "start",
            "time": time.time(),
            "step": int(trainer.global_step),
            "run_id": self.run_id,
            "run_name": run_dir.resolve().name,
            "run_dir": str(run_dir),
            "resumed_from_step": int(trainer.global_step) if resuming else None,
            "resumed_from": str(trainer.ckpt_path) if resuming else None,
            # A new run from another run's checkpoint: it plans its own LR schedule and counts
            # its GPU-hours from zero; its tokens go on from its parent's (report reads it).
            "branched": branched,
            "config": config,
            "config_hash": config_hash(config),
            "seed": int(seed) if seed is not None and seed.lstrip("-").isdigit() else None,
            **git_state(),
            "versions": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "lightning": L.__version__,
                "nanolab": nanolab.__version__,
            },
            "devices": names,
            "device_count": len(names),
            "world_size": int(trainer.world_size),
            "num_nodes": int(trainer.num_nodes),
            "precision": str(trainer.precision),
            # On ROCm, whether its 32-true matmuls were TF32: estimate compares past runs by it.
            **tf32_switch(str(trainer.precision)),
            "strategy": type(trainer.strategy).__name__,
            "accelerator": type(trainer.accelerator).__name__,
            "num_params": num_params(pl_module),
            "global_batch_tokens": global_batch_tokens(trainer),
            # The end a new run's LR cosine is planned for (trainer.max_steps, or where
            # budget.max_tokens stops a run of max_steps -1; None: neither): the forecast reads
            # it, so a run of max_steps -1 is forecast on the schedule it trains with.
            "planned_steps": planned if planned > 0 else None,
            # Where this launch ends: the first of max_steps and every budget's stop (an hours
            # or cost limit's an estimate); what progress and status count to. None: unbounded.
            "expected_end": end.record() if (end := expected_end(trainer, pl_module)) else None,
            "flops_per_token": None,
            "peak_flops": None,
            "price_per_gpu_hour": None,
            "pid": os.getpid(),
            # The queue job that started this process (None: started by hand): `queue add`
            # continues only runs the queue started unless told to.
            "queue_job": os.environ.get("NANOLAB_QUEUE_JOB"),
            "argv": sys.argv,
            # What the data holds, not where: report compares runs' losses by it.
            "data_identity": data_identity(trainer),
        }
        record.update(collect_fields(trainer, "start"))
        return record

    # -- train records -----------------------------------------------------------------------
    def _logs_step(self, step: int) -> bool:
        return step % self.every_n_steps == 0

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # Only on steps that will be logged; kept as a tensor (no sync) until the record is built.
        if self.active and self._logs_step(trainer.global_step + 1):
            self._lr = trained_rate(optimizer)
            if self._params is None:
                self._params = list(pl_module.parameters())
            self._grad_norm = step_gradient_norm(self.clock, trainer, pl_module, self._params)

    def step_values(
        self, trainer: L.Trainer, pl_module: L.LightningModule, step: int, readout: StepReadout
    ) -> None:
        # Taken at every step, recorded or not, so a value logged at a step without a record
        # is told from the one taken before it; it waits for the next record (the newest value).
        self._unrecorded.update(self._logged_since(trainer))
        self._taken_at = step
        if not self._logs_step(step):
            return
        metrics, self._unrecorded = self._unrecorded, {}
        grad_norm, self._grad_norm = self._grad_norm, None
        if self._writer is None:
            return
        grad_norm = read_gradient_norm(grad_norm, pl_module)
        if grad_norm is None:
            grad_norm = engine_gradient_norm(trainer)
        if grad_norm is not None:
            metrics["grad_norm"] = grad_norm
        for key, value in metrics.items():
            readout.put(LOG_KEY + key, value)  # with the others; on a GPU it may come next step

    def _logged_since(self, trainer: L.Trainer) -> dict[str, Any]:
        """What the module and the callbacks logged in training since this was last asked.

        Lightning keeps the last value of a name until the epoch ends, so a value logged every
        k steps is still in its results at the steps between; each ``self.log`` stores a new
        tensor, so a name whose tensor is the one taken last time was not logged since. The
        taken values are held until the next call, so a new one cannot reuse their memory.
        """
        metrics = fresh_metrics(trainer, training=True)
        taken, self._taken = self._taken, metrics
        return {k: v for k, v in metrics.items() if not same_value(v, taken.get(k))}

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._took_late(trainer)

    def _took_late(self, trainer: L.Trainer) -> None:
        """Between a step's read and the next step (or the end): a value logged there (in a
        callback's ``on_step``, the module's ``on_train_batch_end``) came after its step's record
        took its values, and belongs in no later one; say so, once, with where to log it. Under
        accumulation the same hook also logs after the next step's earlier micro-batches, before
        that step's read: those values are recorded with that step, hence "or not at all"."""
        step, self._taken_at = self._taken_at, None
        if step is None or not self.active:
            return
        late = sorted(self._logged_since(trainer))
        if late and not self._warned_late and trainer.is_global_zero:
            self._warned_late = True
            warn(
                "nanolab fit",
                f"{', '.join(late)} was logged at step {step} after the run log took step "
                f"{step}'s values (in on_step or on_train_batch_end): a value logged there is "
                "recorded with a later step or not at all; log it in the module's training_step "
                "or in a step callback's step_values (docs/callbacks.md)",
            )

    def on_step(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        if self._writer is None:
            return
        clock = self.clock
        assert clock is not None
        if self._logs_step(step):
            with clock.pause("log"), clock.frozen():
                self._pending[step] = self._train_record(trainer, step)
        self._write_arrived(trainer, clock.readout.completed)

    def _train_record(self, trainer: L.Trainer, step: int) -> dict[str, Any]:
        """A train record's host fields, taken now; its device values come later."""
        clock = self.clock
        assert clock is not None
        lr, self._lr = self._lr, None
        record: dict[str, Any] = {
            "event": "train",
            "time": time.time(),
            "step": int(step),
            # Where the data order stands after this step (a branch's goes on from its parent's).
            "epoch": data_passes(trainer, int(step) - int(trainer.global_step), clock.run_tokens),
            "tokens": clock.tokens,
            # This run's own (a branch's without its parent's): what its GPU-hours were paid for.
            "run_tokens": clock.run_tokens,
            "loss": None,
            "lr": lr,
            "grad_norm": None,
            **dict.fromkeys(TRAIN_FIELDS),
            "elapsed_s": round(clock.elapsed_s(), 3),
            "gpu_hours": clock.gpu_hours(),
            "goodput": round(clock.goodput(), 4),
        }
        record.update(collect_fields(trainer, "train"))
        return record

    def _write_arrived(
        self, trainer: L.Trainer, arrived: list[tuple[int, dict[str, float]]]
    ) -> None:
        """Write the pending train records whose values are in ``arrived``, oldest first."""
        if not self._pending or self._writer is None:
            return
        clock = self.clock
        assert clock is not None
        with clock.pause("log"), clock.frozen():
            for step, read in arrived:
                record = self._pending.pop(step, None)
                if record is None:
                    continue
                values = {
                    key[len(LOG_KEY) :]: (v if math.isfinite(v) else None)
                    for key, v in read.items()
                    if key.startswith(LOG_KEY)
                }
                record["loss"] = values.pop("train/loss", None)
                record["grad_norm"] = values.pop("grad_norm", None)
                for key, value in values.items():
                    record.setdefault(key, value)
                self._writer.write(record)
                forward_record(trainer, record)

    def on_values_arrived(
        self, trainer: L.Trainer, pl_module: L.LightningModule, arrived: list[tuple[int, Values]]
    ) -> None:
        # Before a save: the records whose values just came are written now. Left pending until
        # the next step, they were lost with the process when it was killed while an async save
        # ran (a SIGKILL, an out-of-memory kill), though the checkpoint a resume goes on from
        # was complete: the resumed log had no train record of the saved step.
        self._write_arrived(trainer, arrived)

    def flush_train_records(self, trainer: L.Trainer) -> None:
        """Write the train records still waiting for their values (waits for their copies)."""
        if not self._pending or self.clock is None:
            return
        self._write_arrived(trainer, self.clock.readout.drain())
        # A step whose values never came (none were put): its record as it is.
        for step in sorted(self._pending):
            self._write_arrived(trainer, [(step, {})])

    # -- validation --------------------------------------------------------------------------
    def on_validated(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        if self._writer is None:
            return
        assert self.clock is not None
        values = to_floats(fresh_metrics(trainer, training=False))
        val_loss = values.get(self.monitor)
        if val_loss is not None and (self.best_val_loss is None or val_loss < self.best_val_loss):
            self.best_val_loss = val_loss
        record: dict[str, Any] = {
            "event": "val",
            "time": time.time(),
            "step": step,
            "tokens": self.clock.tokens,
            "val_loss": val_loss,
            "val_ppl": math.exp(val_loss) if val_loss is not None and val_loss < 700 else None,
            # Bits per byte: comparable across tokenizers; null when the data lacks byte counts.
            "val_bpb": values.get(self.monitor.rsplit("/", 1)[0] + "/bpb"),
        }
        for key, value in values.items():
            record.setdefault(key, value)
        self.write(trainer, record)

    # -- end ---------------------------------------------------------------------------------
    @staticmethod
    def _flush_saves(trainer: L.Trainer) -> None:
        """Let the checkpoint saves in flight finish and be recorded (every callback's
        ``flush_records``): before the ``end`` record, and before a line naming the step a
        rerun resumes from."""
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            flush = getattr(callback, "flush_records", None)
            if callable(flush):
                # The end record matters more than a late checkpoint record.
                with contextlib.suppress(Exception):
                    flush(trainer)

    def _end(self, trainer: L.Trainer, reason: str, error: str | None, detail: str | None) -> None:
        if self._ended or not self.active:
            return
        self._ended = True
        with contextlib.suppress(Exception):  # a note, never in the way of the end record
            self._took_late(trainer)
        self._flush_saves(trainer)
        if self._writer is None:
            return
        with contextlib.suppress(Exception):  # a failed device read loses the values, not the end
            self.flush_train_records(trainer)
        self._pending.clear()
        clock = self.clock
        assert clock is not None
        with clock.frozen():
            record: dict[str, Any] = {
                "event": "end",
                "time": time.time(),
                "step": int(trainer.global_step),
                "reason": reason,
                "error": error,
                "detail": detail,
                "elapsed_s": round(clock.elapsed_s(), 3),
                "gpu_hours": clock.gpu_hours(),
                "cost": None,
                "tokens": clock.tokens,
                "run_tokens": clock.run_tokens,
                "goodput": round(clock.goodput(), 4),
                "best_val_loss": self.best_val_loss,
                # A mixture's own passes over each dataset (its epoch counts them together).
                "dataset_passes": _dataset_passes(trainer),
                **clock.end_totals(),
            }
            record.update(collect_fields(trainer, "end"))
        # A full disk, or the log's path now leading elsewhere: the error already says so.
        with contextlib.suppress(RunLogWriteError, LeftClaimedDir):
            self._writer.write(record)
        self._writer.close()

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        reason, detail = stop_reason(trainer)
        reached_max_steps = 0 < trainer.max_steps <= trainer.global_step
        if reason is None and trainer.should_stop and not reached_max_steps:
            detail = "stopped early by trainer.should_stop"
        self._end(trainer, reason or "completed", None, detail)

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        given = getattr(exception, "reason", None)
        if given in END_REASONS and given != "error":
            self._end(trainer, given, None, str(exception))
        elif isinstance(exception, SIGTERMException):
            self._end(trainer, "preempted", None, f"{type(exception).__name__}: {exception}")
        else:
            reason, _ = stop_reason(trainer)
            # nanolab's own errors are one line for the user, the class name is noise there.
            own = isinstance(exception, NanolabError)
            text = (str(exception) if own else f"{type(exception).__name__}: {exception}").strip()
            if self.active and not self._ended:
                self._flush_saves(trainer)  # the step a rerun resumes from is then on disk
                lost = lost_rank(trainer, exception)
                if lost is not None:  # a rank died: the line `fit` prints, not gloo's words
                    text = str(lost)
            self._end(trainer, "preempted" if reason == "preempted" else "error", text, None)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "best_val_loss": self.best_val_loss, "run_dir": self.run_dir}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.run_id = state_dict.get("run_id")
        self.checkpoint_run_dir = state_dict.get("run_dir")
        self.best_val_loss = state_dict.get("best_val_loss")


# -- helpers (also used by the other callbacks) --------------------------------------------------
def fresh_metrics(trainer: L.Trainer, training: bool) -> dict[str, Any]:
    """What the module logged in the current loop (train steps or validation epoch).

    ``trainer.callback_metrics`` also holds the other loop's values (the last ``val/loss``
    during training); the active loop's results hold only its own. They still hold a train
    value logged only now and then at the steps between (Lightning keeps it until the epoch
    ends): :meth:`MetricsLog._logged_since` keeps only those logged since it last looked.
    Lightning has no public accessor for the results, hence the logger connector and the fit
    loop's results (private); if a Lightning upgrade moves them, the public dict is filtered by
    name.
    """
    try:
        if training and not trainer.training:
            # A validation is running (a stop right after one ends the run inside it): the
            # trainer's results are the validation's, and the train values are the fit loop's.
            results = trainer.fit_loop.epoch_loop._results
            metrics = dict(results.metrics(on_step=True)["callback"])
        else:
            metrics = dict(trainer._logger_connector.metrics["callback"])
    except Exception:  # private API moved: filter the public dict instead
        return {
            k: v for k, v in trainer.callback_metrics.items() if k.startswith("val") != training
        }
    if training and TRAIN_LOSS not in metrics:
        # nanolab's module puts each step's loss straight into callback_metrics, not through
        # self.log (GPTLightningModule.publish_train_loss says why).
        module = getattr(trainer, "lightning_module", None)
        loss = trainer.callback_metrics.get(TRAIN_LOSS)
        if loss is not None and isinstance(module, GPTLightningModule):
            metrics[TRAIN_LOSS] = loss
    return metrics


def same_value(a: Any, b: Any) -> bool:
    """Whether two logged values are one: the same tensor memory (Lightning hands out a new
    view of its stored tensor at each look, and stores a new tensor at each ``self.log``)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.device == b.device and a.data_ptr() == b.data_ptr()
    return a is b


def to_floats(metrics: dict[str, Any]) -> dict[str, float | None]:
    """Scalars as Python floats, with one device-to-host copy per device (one sync)."""
    out: dict[str, float | None] = {}
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor):
            if value.numel() == 1:
                by_device.setdefault(value.device, []).append((key, value))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
    for items in by_device.values():
        stacked = torch.stack([t.detach().reshape(()).float() for _, t in items]).cpu().tolist()
        for (key, _), number in zip(items, stacked, strict=True):
            out[key] = number if math.isfinite(number) else None
    return out


def engine_gradient_norm(trainer: L.Trainer) -> Any:
    """DeepSpeed keeps its (partitioned) gradients outside ``.grad``; its engine reports the
    global norm, before clipping, of the step it has just taken. ``None`` for other strategies."""
    engine = getattr(trainer.strategy, "deepspeed_engine", None)
    norm = getattr(engine, "get_global_grad_norm", None)
    return norm() if callable(norm) else None


def step_gradient_norm(
    clock: RunClock | None,
    trainer: L.Trainer,
    pl_module: L.LightningModule,
    params: list[torch.nn.Parameter] | None = None,
) -> Any:
    """This optimizer step's gradient norm for a reader, asked in ``on_before_optimizer_step``
    and turned into a tensor by :func:`read_gradient_norm` after the step: taken once for every
    reader (the clip, the run log, the divergence stop), as each pass over the gradients costs.

    nanolab's module takes it in its clip, after every hook (:data:`FROM_MODULE` is returned
    and the module is asked for it); for another module, :func:`gradient_norm` now, shared
    through the run's clock."""
    if module_takes_gradient_norm(pl_module):
        pl_module.request_gradient_norm()
        return FROM_MODULE
    if clock is None:
        return gradient_norm(pl_module, params)
    step = int(trainer.global_step)
    return clock.once_per_step("grad_norm", step, lambda: gradient_norm(pl_module, params))


def gradient_norm(
    pl_module: L.LightningModule, params: list[torch.nn.Parameter] | None = None
) -> torch.Tensor | None:
    """Global L2 norm of the gradients, as a tensor (no host sync); ``None`` if none are visible
    (:func:`nanolab.training.grad_norm.gradient_norm`). ``params`` (the module's parameters,
    listed once per fit) saves walking the module tree each step."""
    return grad_norm.gradient_norm(params if params is not None else pl_module.parameters())


#: :func:`step_gradient_norm` on a step whose norm the module takes (read after the step).
FROM_MODULE = object()


def read_gradient_norm(asked: Any, pl_module: L.LightningModule) -> torch.Tensor | None:
    """After the step: what :func:`step_gradient_norm` returned, as the norm tensor (or None)."""
    return getattr(pl_module, "step_gradient_norm", None) if asked is FROM_MODULE else asked


def module_takes_gradient_norm(pl_module: L.LightningModule) -> bool:
    """Whether ``pl_module`` takes each step's gradient norm itself, after every hook, for its
    clip and the readers (:meth:`GPTLightningModule.takes_gradient_norm`): then a reader asks
    for it with ``request_gradient_norm()`` before the step and reads ``step_gradient_norm``
    after it, instead of taking its own."""
    return isinstance(pl_module, GPTLightningModule) and pl_module.takes_gradient_norm()


def run_config(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any] | None:
    """The merged config ``nanolab fit`` saves, or the module's dataclass settings without it."""
    writer = find_callback(trainer, RunConfigWriter)
    if writer is not None:
        from nanolab.training.resolve import plain_config

        return as_recorded(plain_config(writer.config))  # the short form, as config.yaml
    model: dict[str, Any] = {}
    for name in ("gpt_config", "optimizer_config", "schedule_config"):
        value = getattr(pl_module, name, None)
        if is_dataclass(value) and not isinstance(value, type):
            model[name.removesuffix("_config")] = asdict(value)
    return {"model": model} if model else None


def git_state() -> dict[str, Any]:
    """Commit and dirtiness of the working directory's repository (else nanolab's), or nulls.

    Read-only: ``--no-optional-locks`` keeps ``git status`` from taking the index lock to
    refresh it, which would make a git command the user runs at that moment in the checkout
    fail ("index.lock exists")."""
    for folder in (Path.cwd(), Path(nanolab.__file__).resolve().parent):

        def git(*args: str, folder: Path = folder) -> subprocess.CompletedProcess[str]:
            cmd = ["git", "--no-optional-locks", "-C", str(folder), *args]
            return subprocess.run(cmd, capture_output=True, text=True, timeout=5)

        try:
            commit = git("rev-parse", "HEAD")
            if commit.returncode != 0:
                continue
            status = git("status", "--porcelain", "--untracked-files=no")
            dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
            return {"git_commit": commit.stdout.strip(), "git_dirty": dirty}
        except (OSError, subprocess.SubprocessError):
            break
    return {"git_commit": None, "git_dirty": None}


def num_params(pl_module: L.LightningModule) -> int:
    counter = getattr(getattr(pl_module, "model", None), "num_params", None)
    if callable(counter):
        return int(counter())
    return int(sum(parameter_numel(p) for p in pl_module.parameters()))


def global_batch_tokens(trainer: L.Trainer) -> int | None:
    """Tokens per optimizer step over all ranks, from the datamodule's batch shape."""
    dm = trainer.datamodule
    micro, block = getattr(dm, "micro_batch_size", None), getattr(dm, "block_size", None)
    if not isinstance(micro, int) or not isinstance(block, int):
        return None
    return micro * block * int(trainer.accumulate_grad_batches) * int(trainer.world_size)


def trained_rate(optimizer: Any) -> float | None:
    """The learning rate a step trains with, read just before its optimizer step (the scheduler
    steps after it, so a rate read later is the next step's): that of the first parameter group
    following ``model.optimizer.lr``. Muon's own groups (``muon_lr``) are passed over, so the
    logged rate means the same with every optimizer; after a spike rollback it includes the
    guard's ``lr_scale``."""
    from nanolab.training.muon import KIND

    groups = getattr(optimizer, "param_groups", None) or []
    for group in groups:
        if group.get(KIND) != "muon" and group.get("lr") is not None:
            return float(group["lr"])
    return None
