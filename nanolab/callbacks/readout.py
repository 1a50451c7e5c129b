"""One host read per optimizer step: the step's device scalars, brought over together.

The run log's loss and gradient norm, the divergence stop's non-finite flags and the spike
guard's mean loss are device scalars of the same step. Read one by one (``.item()``,
``.tolist()``), each is a host-device synchronisation: the host waits for the whole queued
step. :class:`StepReadout` (one per :class:`~nanolab.callbacks.clock.RunClock`, ``clock.readout``)
takes them all and copies them in one transfer per device:

* before the step callbacks' ``on_step``, each puts what it wants read
  (:meth:`~nanolab.callbacks.step.StepCallback.step_values`); one that needs the value during
  this step puts it with ``now=True`` (the progress bar at the last step; the run log never:
  it writes a record when its values arrive);
* :meth:`StepReadout.transfer` then reads them all at once when one is wanted now, or on a
  device that is not a GPU (there a read waits for nothing). Otherwise, on a CUDA device, the
  copy goes to pinned host memory without blocking and the values arrive at the next step's
  transfer, always: there the host waits for that copy (``event.synchronize()``) if it has not
  finished yet. So when a step's values arrive is a function of the step only, never of how far
  the host ran ahead of its device: every rank of a multi-GPU run takes the all-reduced flags
  and losses at the same step, so all of them stop, roll back or go on together (a rank that
  took them a step later than another left the other alone in a collective until the timeout),
  and on one GPU the spike guard detects at the same step in every run. The host runs at most
  one step ahead of its device: the copy it waits for was queued before the step it has just
  queued, which the device still has to run, so it is never left idle;
* during ``on_step``, :attr:`StepReadout.values` holds this step's values when they were read,
  and :attr:`StepReadout.completed` every step whose values arrived in this transfer (this one's
  included), oldest first;
* :meth:`StepReadout.drain` waits for the copies still in flight when a value is needed outside
  a step (the run log before it writes another record, the run's end, a save). What it brings is
  handed to the ``completed`` of the next step (this one's readers may have run), so a callback
  that reads ``completed`` sees each step there once, whoever drained it, at the same step on
  every rank (only rank 0 writes the run log). Before a save, every rank drains at the same point and the step callbacks take
  what arrived (:func:`nanolab.callbacks.step.settle_step_values`), so a checkpoint holds every
  finished step's values.

So a steady step costs at most one synchronisation, whatever the callbacks; on a GPU none when
no callback wants a value now and the device has finished each step's copy by the time its host
has queued the next step (a device further behind makes the host wait for the copy there).
"""

from __future__ import annotations

import os
from collections import deque
from typing import Any

import torch

from nanolab.host_buffer import mark_host_buffer

Values = dict[str, float]

#: ``1`` forces the GPU's non-blocking path in a ``nanolab fit`` on a CPU (``0``: never defer);
#: ``N`` > 1 also plays a device running N steps behind the host: each copy is finished only N
#: transfers after its own, so the next transfer waits for it (:class:`StandInEvent`). The CPU
#: twin of the GPU path, for tests (tests/test_syncs.py); unset in real runs.
DEFER_ENV = "NANOLAB_READOUT_DEFER"


def defer_from_env() -> bool | None:
    """:data:`DEFER_ENV` as ``StepReadout``'s ``defer``: ``None`` (decide by device) if unset."""
    value = os.environ.get(DEFER_ENV, "").strip()
    return None if value == "" else value not in ("0", "false", "no")


def lag_from_env() -> int:
    """:data:`DEFER_ENV` as ``StepReadout``'s ``lag``: the whole number it holds, at least 1."""
    value = os.environ.get(DEFER_ENV, "").strip()
    return max(1, int(value)) if value.isascii() and value.isdigit() else 1


class StepReadout:
    """The device scalars of the current optimizer step (see the module docstring)."""

    def __init__(self, defer: bool | None = None, lag: int = 1) -> None:
        #: Copy without blocking when no value is wanted now: ``None`` = when the values are on
        #: a CUDA device (True on a CPU runs the same code, as tests/test_syncs.py does).
        self.defer = defer
        #: Off a GPU, the transfers after its own at which a deferred copy counts as finished
        #: (1: the next; more plays a device that runs several steps behind, for tests: the
        #: copy still arrives at the next transfer, which then waits for it).
        self.lag = lag
        #: Transfers (or drains) at which the host waited for a copy that had not finished.
        self.waits = 0
        self._transfers = 0
        self._read_at = 0  # the last transfer that waited for the device: all before it is done
        self.step: int | None = None
        self.values: Values | None = None  # this step's, when read in this step
        self.completed: list[tuple[int, Values]] = []  # arrived in this step's transfer
        self._tensors: dict[str, torch.Tensor] = {}
        self._plain: Values = {}
        self._now = False
        self._in_flight: deque[tuple[int, list[str], Values, torch.Tensor, Any]] = deque()
        self._drained: list[tuple[int, Values]] = []  # arrived by drain(), for the next step
        self._pinned: dict[int, list[torch.Tensor]] = {}  # spare host buffers by size

    # -- filling -----------------------------------------------------------------------------
    def begin(self, step: int) -> None:
        """A new step: forget the previous step's values (in-flight copies stay in flight)."""
        self.step, self.values = step, None
        self.completed, self._drained = self._drained, []
        self._tensors, self._plain, self._now = {}, {}, False

    def put(self, key: str, value: Any, now: bool = False) -> None:
        """Have ``value`` (a one-element tensor or a number) read with this step's others;
        ``now``: it is needed in this step's ``on_step`` (else it may arrive a step later)."""
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                return
            self._tensors[key] = value.detach().reshape(())
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            self._plain[key] = float(value)
        else:
            return
        self._now = self._now or now

    # -- reading -----------------------------------------------------------------------------
    def transfer(self) -> None:
        """Read what was put (see the module docstring); fills ``values`` and ``completed``."""
        assert self.step is not None, "begin() first"
        self._transfers += 1
        step, tensors = self.step, self._tensors
        on_gpu = any(t.device.type == "cuda" for t in tensors.values())
        defer = on_gpu if self.defer is None else self.defer
        if self._now or not defer or not tensors:
            values = dict(self._plain)
            for items in _by_device(tensors).values():
                keys = [k for k, _ in items]
                stacked = torch.stack([t.float() for _, t in items])
                values.update(zip(keys, stacked.tolist(), strict=True))  # the one sync
            if tensors:  # the read waited for the device: every earlier copy is done
                self._read_at = self._transfers
            self._finish_in_flight()  # the earlier steps', done by now (the read waited)
            self.values = values
            self.completed.append((step, values))
            return
        self._finish_in_flight()  # every earlier step's, queued a step ago at the latest
        keys, items = list(tensors), list(tensors.values())
        if len({t.device for t in items}) > 1:  # mixed devices (rare): read them now instead
            self._now = True
            self._transfers -= 1  # the same transfer, taken the other way
            self.transfer()
            return
        stacked = torch.stack([t.float() for t in items])
        cuda = stacked.device.type == "cuda"
        host = self._host_buffer(len(items), pin=cuda)
        host.copy_(stacked, non_blocking=cuda)
        event = torch.cuda.Event() if cuda else StandInEvent(self, self._transfers + self.lag)
        event.record()
        self._in_flight.append((step, keys, dict(self._plain), host, event))

    def drain(self) -> list[tuple[int, Values]]:
        """Wait for every copy still in flight; the values of every step drained since the last
        :meth:`begin` (by any caller), oldest first. They are not added to this step's
        ``completed`` (its readers may have run already) but to the next step's."""
        self._finish_in_flight(into=self._drained)
        return list(self._drained)

    def _finish_in_flight(self, into: list[tuple[int, Values]] | None = None) -> None:
        """Take the values of every copy in flight, oldest first (into ``completed`` unless
        ``into``). Each was queued at an earlier transfer: a finished one is read at once, and
        the host waits for one that is not (``event.synchronize()``, counted in ``waits``), so
        a step's values never arrive later than the next step's transfer."""
        arrived = self.completed if into is None else into
        while self._in_flight:
            step, keys, plain, host, event = self._in_flight.popleft()
            if not event.query():  # query() never waits: a finished copy costs no sync
                self.waits += 1
                event.synchronize()
            values = {**plain, **dict(zip(keys, host.tolist(), strict=True))}
            self._pinned.setdefault(host.numel(), []).append(host)
            arrived.append((step, values))
        arrived.sort(key=lambda item: item[0])

    def _host_buffer(self, size: int, pin: bool) -> torch.Tensor:
        spare = self._pinned.get(size)
        if spare:
            return spare.pop()
        buffer = torch.empty(size, dtype=torch.float32, pin_memory=pin)
        mark_host_buffer(buffer)  # read only once its copy is finished: never a wait
        return buffer


class StandInEvent:
    """A CUDA event's stand-in off the GPU, where a copy is finished when it returns: it plays
    a device ``lag`` steps behind its host. :meth:`query` answers "finished" from the readout's
    ``due``-th transfer on (``lag`` transfers after its own), once a later transfer has read
    the device (a read waits for everything queued before it), or once :meth:`synchronize`
    waited for it, as a device that ran that far behind would. The sync counter counts its
    :meth:`synchronize` as the wait it stands for (:mod:`nanolab.callbacks.syncs`)."""

    def __init__(self, readout: StepReadout, due: int) -> None:
        self.readout, self.due, self.queued_at = readout, due, readout._transfers
        self.waited = False

    def record(self) -> None:
        pass

    def query(self) -> bool:
        r = self.readout
        return self.waited or r._transfers >= self.due or r._read_at > self.queued_at

    def synchronize(self) -> None:
        self.waited = True


def _by_device(tensors: dict[str, torch.Tensor]) -> dict[torch.device, list[tuple[str, Any]]]:
    out: dict[torch.device, list[tuple[str, Any]]] = {}
    for key, tensor in tensors.items():
        out.setdefault(tensor.device, []).append((key, tensor))
    return out
