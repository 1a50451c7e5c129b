"""Count the host-device synchronisations of a training step (off unless asked for).

Every call that makes the host wait for the device's queued work, or reads a device value, is
counted while :class:`SyncCounter` is installed: ``Tensor.item``/``tolist``/``numpy``,
``bool()``/``float()``/``int()``/``index`` of a tensor, ``Tensor.cpu()``, a blocking
``Tensor.to()`` to the host (see :func:`_to_host`), ``Tensor.nonzero`` (its output size depends
on the data), ``torch.cuda.synchronize`` and the ``synchronize`` of a CUDA event or stream (or
of the step readout's stand-in for one on a CPU, which waits where the event would). A
tensor that one counted transfer brought to the host is host memory from then on:
``t.cpu().tolist()`` counts once.

On a CPU every tensor is a host tensor, so the counter counts what *would* wait on a GPU: the
same code runs there with device tensors. Two kinds of call are not counted because they never
wait on a GPU either: calls made by ``torch.optim`` (the optimizers keep their step counters on
the host by design), calls on tensors a counted transfer already brought over (above), and
reads of a host buffer marked by :func:`mark_host_buffer` (read only once its copy is done).

``nanolab fit`` counts when the environment variable :data:`ENV` names a JSON file to write:
the calls of every optimizer step from :data:`FIRST_STEP` on, of every micro-batch that did not
end a step, and where they came from. ``nanolab bench --count-syncs`` uses it, and
``tests/test_syncs.py`` asserts on it. It costs a Python frame walk per counted call, so it is
never on in a run whose speed matters.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from nanolab.callbacks.readout import StandInEvent
from nanolab.host_buffer import HOST_BUFFER, mark_host_buffer  # noqa: F401  (used here too)

#: The environment variable that turns counting on in ``nanolab fit`` (a path to write to).
ENV = "NANOLAB_COUNT_SYNCS"

#: Steps before this one are start-up (first kernels, lazy state): not counted as steady.
FIRST_STEP = 3

_TENSOR_READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__",
                 "__complex__", "nonzero")  # fmt: skip
_TORCH_DIR = os.path.dirname(torch.__file__)
_OPTIM_DIR = os.path.join(_TORCH_DIR, "optim")
_THIS_FILE = os.path.abspath(__file__)


def _is_cpu(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cpu"
    return isinstance(device, str) and device.split(":")[0] == "cpu"


def _to_host(args: tuple[Any, ...], kwargs: dict[str, Any], run_on_cpu: bool) -> bool:
    """Whether a ``Tensor.to`` call moves to the host: to the CPU on a run that is not on the
    CPU, or to the string ``"cpu"`` itself (code that means the host whatever the run's device;
    on a CPU run ``.to(device)`` is the training device and moves nothing)."""
    device = kwargs.get("device")
    if device is None and args and isinstance(args[0], (str, torch.device)):
        device = args[0]
    if device is None or kwargs.get("non_blocking"):
        return False
    return _is_cpu(device) and (not run_on_cpu or isinstance(device, str))


class SyncCounter:
    """Counts host-device synchronisations while installed (see the module docstring).

    ``count`` is the running total; ``sources`` counts them by ``file:line (function)`` of the
    nearest caller outside torch.
    """

    def __init__(self, run_on_cpu: bool = True) -> None:
        self.run_on_cpu = run_on_cpu
        self.count = 0
        self.sources: collections.Counter[str] = collections.Counter()
        self._host: dict[int, weakref.ref[torch.Tensor]] = {}  # by id (tensors' == is elementwise)
        self._saved: list[tuple[Any, str, Any]] = []
        self._local = threading.local()  # a counted call that calls another counts once

    # -- counting ----------------------------------------------------------------------------
    def _caller(self) -> str | None:
        """Where the call came from (the nearest frame outside torch), or None when it is one
        of the calls that never wait (module docstring)."""
        frame = sys._getframe(3)  # 0 this, 1 _hit, 2 the wrapper, 3 its caller
        first = True
        while frame is not None:
            path = frame.f_code.co_filename
            if first and path.startswith(_OPTIM_DIR):
                return None
            first = False
            if not path.startswith(_TORCH_DIR) and os.path.abspath(path) != _THIS_FILE:
                return f"{_short(path)}:{frame.f_lineno} ({frame.f_code.co_name})"
            frame = frame.f_back
        return "<torch>"

    def _hit(self, tensor: torch.Tensor | None) -> bool:
        if getattr(self._local, "inside", False):
            return False
        if tensor is not None and getattr(tensor, HOST_BUFFER, False):
            return False
        if tensor is not None:
            ref = self._host.get(id(tensor))
            if ref is not None and ref() is tensor:
                return False
        where = self._caller()
        if where is None:
            return False
        self.count += 1
        self.sources[where] += 1
        return True

    def _wrap_read(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        counter = self

        @functools.wraps(original)
        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            counter._hit(tensor)
            counter._local.inside = True
            try:
                return original(tensor, *args, **kwargs)
            finally:
                counter._local.inside = False

        return read

    def _wrap_transfer(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        counter = self

        @functools.wraps(original)
        def transfer(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            to_host = name == "cpu" or _to_host(args, kwargs, counter.run_on_cpu)
            counted = to_host and counter._hit(tensor)
            counter._local.inside = True
            try:
                out = original(tensor, *args, **kwargs)
            finally:
                counter._local.inside = False
            if counted and isinstance(out, torch.Tensor):
                counter._host[id(out)] = weakref.ref(out)
            return out

        return transfer

    def _wrap_wait(self, original: Callable[..., Any]) -> Callable[..., Any]:
        counter = self

        @functools.wraps(original)
        def wait(*args: Any, **kwargs: Any) -> Any:
            counter._hit(None)
            return original(*args, **kwargs)

        return wait

    # -- installing --------------------------------------------------------------------------
    def _patch(self, owner: Any, name: str, wrapper: Callable[..., Any]) -> None:
        self._saved.append((owner, name, owner.__dict__.get(name, _MISSING)))
        setattr(owner, name, wrapper)

    def install(self) -> SyncCounter:
        if self._saved:
            return self
        for name in _TENSOR_READS:
            self._patch(torch.Tensor, name, self._wrap_read(name, getattr(torch.Tensor, name)))
        for name in ("cpu", "to"):
            self._patch(torch.Tensor, name, self._wrap_transfer(name, getattr(torch.Tensor, name)))
        self._patch(torch.cuda, "synchronize", self._wrap_wait(torch.cuda.synchronize))
        # The step readout's stand-in for a CUDA event on a CPU waits where the event would.
        for cls in (torch.cuda.Event, torch.cuda.Stream, StandInEvent):
            self._patch(cls, "synchronize", self._wrap_wait(cls.synchronize))
        return self

    def uninstall(self) -> None:
        while self._saved:
            owner, name, original = self._saved.pop()
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)

    @contextmanager
    def counting(self) -> Iterator[SyncCounter]:
        self.install()
        try:
            yield self
        finally:
            self.uninstall()


_MISSING = object()


def _short(path: str) -> str:
    """A source path from its package folder on (``nanolab/...``, ``lightning/...``)."""
    parts = Path(path).parts
    for anchor in ("nanolab", "lightning", "torchmetrics", "tests"):
        if anchor in parts:
            return "/".join(parts[len(parts) - parts[::-1].index(anchor) - 1 :])
    return path


def sync_count_callback(path: str | os.PathLike[str]) -> Any:
    """A Lightning callback that counts the syncs of every training step of a fit and writes
    them to ``path`` as JSON when the fit ends (see the module docstring)."""
    from lightning.pytorch.callbacks import Callback

    class SyncCount(Callback):
        def __init__(self) -> None:
            self.counter = SyncCounter()
            self.steps: list[dict[str, Any]] = []  # one per optimizer step from FIRST_STEP on
            self.micro: list[int] = []  # syncs of each micro-batch that did not end a step
            # (left out: one with an evaluation or a save in it)
            self.sources: collections.Counter[str] = collections.Counter()  # of steady steps
            self._mark = 0  # counter.count at the previous micro-batch's end
            self._step = 0  # optimizer steps done at the previous micro-batch's end
            self._in_step = 0  # syncs of the current optimizer step so far
            self._sources_at = collections.Counter()  # counter.sources when the step began
            self._interrupted = False  # an evaluation or a save happened inside the step
            self._micro_interrupted = False  # ... inside the micro-batch

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            self.counter.run_on_cpu = trainer.strategy.root_device.type == "cpu"

        def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
            # Registered after nanolab's callbacks: their batch-end work is in this interval;
            # Lightning's own after-batch work is in the next one (intervals end to end).
            step = int(trainer.global_step)
            counting = bool(self.counter._saved)
            delta, self._mark = self.counter.count - self._mark, self.counter.count
            if counting and step == self._step:
                if not self._micro_interrupted:
                    self.micro.append(delta)
                self._in_step += delta
            elif counting:
                self.steps.append({"step": step, "syncs": self._in_step + delta,
                                   "interrupted": self._interrupted})  # fmt: skip
                if not self._interrupted:
                    self.sources.update(self.counter.sources - self._sources_at)
            if step != self._step:
                self._in_step, self._interrupted = 0, False
                self._sources_at = collections.Counter(self.counter.sources)
            self._step, self._micro_interrupted = step, False
            if step >= FIRST_STEP - 1 and not counting:
                self.counter.install()  # from the start of step FIRST_STEP

        def on_validation_start(self, *_: Any) -> None:
            self._interrupted = self._micro_interrupted = True

        def on_save_checkpoint(self, *_: Any) -> None:
            self._interrupted = self._micro_interrupted = True

        def on_train_end(self, trainer: Any, *_: Any) -> None:
            self.counter.uninstall()
            if not trainer.is_global_zero:
                return
            steady = [s["syncs"] for s in self.steps if not s["interrupted"]]
            Path(path).write_text(
                json.dumps(
                    {
                        "first_step": FIRST_STEP,
                        "steps": self.steps,
                        "steady_per_step": steady,
                        "micro_batches": self.micro,
                        "steady_sources": dict(self.sources.most_common()),
                        "all_sources": dict(self.counter.sources.most_common()),
                    },
                    indent=1,
                )
            )

    return SyncCount()


def read_counts(path: str | os.PathLike[str]) -> dict[str, Any]:
    return json.loads(Path(path).read_text())
