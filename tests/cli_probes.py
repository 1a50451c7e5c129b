"""Callbacks that CLI tests plug into real ``nanolab fit`` processes.

A test lists them under ``trainer.callbacks`` in its config and puts ``tests/`` on the
subprocess's ``PYTHONPATH``. They observe a run or nudge it the way the outside world would (a
real signal, a slow step, a process paused mid-write); they never stand in for nanolab's code.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch


class SignalAt(L.Callback):
    """Sends ``signal`` to this process when optimizer step ``step + 1`` begins (once).

    The kernel delivers it like a signal from outside; the handler under test runs at once.
    """

    def __init__(self, step: int, signal: str = "SIGTERM") -> None:
        self.step = step
        self.signal = signal
        self._sent = False

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if not self._sent and trainer.global_step == self.step:
            self._sent = True
            os.kill(os.getpid(), getattr(signal, self.signal))


class SignalInSave(L.Callback):
    """Sends ``signal`` to this process from inside the checkpoint write of step ``step``
    (once): the file's bytes are written, its rename and rotation are still to come, and the
    step's own stop decisions are taken already. ``torch.save`` is put back at teardown (the
    probe also runs inside a test's own process)."""

    def __init__(self, step: int, signal: str = "SIGTERM") -> None:
        self.step = step
        self.signal = signal
        self._real_save: Any = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        real_save, sent = torch.save, [False]
        self._real_save = real_save

        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            real_save(obj, f, *args, **kwargs)
            if not sent[0] and isinstance(obj, dict) and obj.get("global_step") == self.step:
                sent[0] = True
                os.kill(os.getpid(), getattr(signal, self.signal))

        torch.save = save

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._real_save is not None:
            torch.save, self._real_save = self._real_save, None


class SlowSteps(L.Callback):
    """Sleeps before every micro-batch: steps long enough for a test to act in the middle."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_start(self, *args: Any) -> None:
        time.sleep(self.seconds)


class LingerAfterSignal(L.Callback):
    """Once the run's preemption handler has a signal, holds the step's end for ``seconds``
    (once): a step that ends slowly, so a second signal surely arrives before the checkpoint."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._done = False

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self._done:
            return
        if any(getattr(cb, "received", None) is not None for cb in trainer.callbacks):
            self._done = True
            time.sleep(self.seconds)


class EnvProbe(L.Callback):
    """Writes the named environment variables to ``<run_dir>/env-<pid>.json`` (every rank)."""

    def __init__(self, names: list[str]) -> None:
        self.names = names

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        values = {name: os.environ.get(name) for name in self.names}
        values["global_rank"] = trainer.global_rank
        run_dir = Path(trainer.default_root_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / f"env-{os.getpid()}.json").write_text(json.dumps(values))


class DrawsFromEveryRng(L.Callback):
    """Draws from Python's and NumPy's global RNGs every micro-batch, as augmentation or
    sampling code in a fork would, so an exact resume must restore those streams too."""

    def on_train_batch_start(self, *args: Any) -> None:
        random.random()
        np.random.rand()


class PauseInSave(L.Callback):
    """Freezes the process inside the checkpoint write of one step, for a test to SIGKILL.

    Inert unless ``NANOLAB_PROBE_PAUSE_SAVE`` is ``<step>:<marker file>``. Then the save of that
    step writes its bytes, writes the name of the file it wrote them to into the marker, and
    sleeps before the writer can fsync and rename: a kill now is a kill mid-save, every time.
    """

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        spec = os.environ.get("NANOLAB_PROBE_PAUSE_SAVE")
        if not spec:
            return
        step_text, marker = spec.split(":", 1)
        step, real_save = int(step_text), torch.save

        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            real_save(obj, f, *args, **kwargs)
            if isinstance(obj, dict) and obj.get("global_step") == step:
                if hasattr(f, "flush"):
                    f.flush()
                name = getattr(f, "name", f)
                if isinstance(name, int):  # written through a descriptor (nanolab.claimed)
                    name = os.readlink(f"/proc/self/fd/{name}")
                Path(marker).write_text(str(name))  # the file being written
                time.sleep(3600)

        torch.save = save


class PoisonedData(L.Callback):
    """A poisoned region of the data: the micro-batches at positions ``first`` .. ``last`` of
    the training order (counted as the data order counts them, rollback jumps included) are
    trained with the learning rate times ``lr_factor``, as a batch of garbage with huge
    gradients would (Adam's step size is the learning rate, whatever the gradient's scale).
    The next scheduler step sets the learning rate back."""

    def __init__(self, first: int, last: int, lr_factor: float = 300.0) -> None:
        self.first, self.last, self.lr_factor = first, last, lr_factor
        self.hits: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        from nanolab.data.datamodule import consumed_micro_batches, rollback_jumps
        from nanolab.data.skips import data_position

        at = data_position(consumed_micro_batches(trainer), rollback_jumps(trainer))
        if self.first <= at <= self.last:
            self.hits.append(at)
            for group in trainer.optimizers[0].param_groups:
                group["lr"] *= self.lr_factor


class HugeGradientsAt(L.Callback):
    """At the optimizer steps ``steps`` (1 = the first), every gradient times 1e30, as a batch of
    garbage would make them: each stays finite but their squares overflow float32, so the
    step's gradient norm is infinite while the clip leaves its weights finite (and the steps
    around them are untouched). Counted in ``global_step``, so a resumed run meets them too."""

    def __init__(self, steps: list[int]) -> None:
        self.steps = set(steps)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step + 1 in self.steps:
            for p in pl_module.parameters():
                if p.grad is not None:
                    p.grad.mul_(1e30)


class PoisonedWindows(L.Callback):
    """:class:`PoisonedData` counted in windows of the order, whatever the launch's micro-batch:
    the micro-batches the training sampler starts at windows ``first`` .. ``last`` of the order
    train at the learning rate times ``lr_factor``. A rollback's jump carries the run past them,
    so they are poisoned once, on every layout."""

    def __init__(self, first: int, last: int, lr_factor: float = 300.0) -> None:
        self.first, self.last, self.lr_factor = first, last, lr_factor

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        from nanolab.data.datamodule import consumed_micro_batches
        from nanolab.data.order import unit_of

        sampler = trainer.datamodule.train_sampler
        window = sampler.position(consumed_micro_batches(trainer)) * unit_of(sampler.plan)
        if self.first <= window <= self.last:
            for group in trainer.optimizers[0].param_groups:
                group["lr"] *= self.lr_factor


class DiskFullFrom(L.Callback):
    """From optimizer step ``step`` on, every checkpoint write fails with ENOSPC after writing
    part of its bytes, as a disk that fills up during the night would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        import errno

        from nanolab.callbacks import checkpoint_io

        if trainer.global_step + 1 < self.step or getattr(self, "armed", False):
            return
        self.armed = True
        real = checkpoint_io.torch.save

        def full(obj, f, *args, **kwargs):
            if hasattr(f, "write"):
                f.write(b"\0" * 1024)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        checkpoint_io.torch.save = full
        self.real = real


class KillOnRollback(L.Callback):
    """SIGKILL this process when a fit ends in a rollback, before ``nanolab fit`` continues it:
    a machine lost in the middle of healing a spike."""

    def on_train_end(self, trainer, pl_module) -> None:
        from nanolab.callbacks.events import stop_reason

        if stop_reason(trainer)[0] == "rollback":
            os.kill(os.getpid(), signal.SIGKILL)


class LrAtSteps(L.Callback):
    """Appends ``{"step": s, "lr": r}`` to ``path`` for every optimizer step, with the rate the
    optimizer is about to use (what the run trains with, whatever a log says)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        with open(self.path, "a") as f:
            step = trainer.global_step + 1
            f.write(json.dumps({"step": step, "lr": optimizer.param_groups[0]["lr"]}) + "\n")


class RunLogFullFrom(L.Callback):
    """From optimizer step ``step`` on, every append to the run log fails with ENOSPC, as a
    disk that fills up under ``metrics.jsonl`` would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        import errno

        from nanolab import runlog

        if trainer.global_step + 1 < self.step:
            return

        def full(self) -> bool:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        runlog.RunLogWriter._still_there = full


class DiskHoldsSteps(L.Callback):
    """A disk with room for ``room`` step checkpoints of this run: a checkpoint write fails
    with ENOSPC when the checkpoint folder already holds that many (what a full disk does to
    a run that keeps more, whatever it deletes afterwards)."""

    def __init__(self, room: int) -> None:
        self.room = room

    def setup(self, trainer, pl_module, stage) -> None:
        import errno

        from nanolab.callbacks import checkpoint_io
        from nanolab.callbacks.checkpoint import step_of

        folder = Path(trainer.default_root_dir) / "checkpoints"
        real = checkpoint_io.torch.save

        def save(obj, f, *args, **kwargs):
            if sum(step_of(p) is not None for p in folder.iterdir()) >= self.room:
                if hasattr(f, "write"):
                    f.write(b"\0" * 1024)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(obj, f, *args, **kwargs)

        checkpoint_io.torch.save = save


class WindowsSeen(L.Callback):
    """Appends ``{"step": s, "windows": [...]}`` to ``path`` for every training micro-batch:
    each window as the CRC-32 of its input ids, so a test compares what a run trained on by
    content, whatever nanolab's own count of the order says."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        import zlib

        x = batch[0].cpu().numpy().astype(np.int64)
        windows = [zlib.crc32(row.tobytes()) for row in x]
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": trainer.global_step, "windows": windows}) + "\n")


class DeepSpeedFp16OnThisCpu(L.Callback):
    """Lets DeepSpeed train in fp16 on a CPU whose oneDNN reports no fp16 kernels: DeepSpeed's
    CPU accelerator refuses fp16 there ("Type fp16 is not supported on your device"), though
    torch's CPU ops compute it. Only that capability answer changes (before the engine is built:
    ``setup`` runs first); the engine, its ZeRO optimizer and its loss scaler are DeepSpeed's."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        CPU_Accelerator.is_fp16_supported = lambda accelerator: True
