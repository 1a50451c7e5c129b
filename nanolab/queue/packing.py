"""Which waiting jobs share which device: the scheduling decisions of ``queue run --pack``.

A 124M model at a typical micro-batch peaks at 15-20 GB; an H200 has 141 GB. Running seeds one
after another leaves most of the device idle, so ``--pack`` starts as many jobs on one device as
their predicted memory allows. Each job on a shared device reserves::

    reserved = cap + overhead,   cap = predicted peak x (1 + margin)

``cap`` is what its allocator may hold (``torch.cuda.set_per_process_memory_fraction``, set by
:mod:`nanolab.queue.launch`), so one job's growth cannot take its neighbours' memory: it hits its
own cap, and the runner then re-queues it to run alone. ``overhead`` is memory outside the
allocator (CUDA context and kernels; on a CPU, the process itself). A device takes a job while
the sum of its jobs' reservations stays within its capacity.

The rules, in the order of the queue (``fifo`` or ``longest-first``):

* first fit: a job goes to the first device with room for its reservation;
* a job that cannot share runs alone on an empty device: no memory prediction (micro-batch
  ``auto`` sizes itself to the whole device), several devices, a reservation larger than a
  device, or an earlier out-of-memory error while packed;
* no starvation: the first job that finds no room (the head of the waiting line) has a device
  set aside for it; nothing new starts there until the head fits (for a job that must run alone:
  until the device is empty), while later jobs keep filling the other devices;
* backfill jobs (``queue add --backfill``) go last and only onto room no other job wants; a
  normal job that needs the room a backfill job holds asks it to stop (checkpoint, exit 75):
  see :class:`PackPlan`.

Everything here is pure (no processes, no database, no device), so the decisions are tested
against simulated device sizes and job peaks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from nanolab.queue.db import Job

GiB = 1024**3


@dataclass
class Rules:
    """How much each packed job reserves beyond its predicted peak.

    Attributes:
        margin: Share of the predicted peak added to its cap (estimator error, allocator
            fragmentation).
        overhead: Bytes per process outside the allocator (context, kernels; a CPU process's
            own resident set).
    """

    margin: float = 0.10
    overhead: int = 0

    def cap(self, peak: int) -> int:
        """Bytes the job's allocator may hold."""
        return math.ceil(peak * (1.0 + self.margin))

    def reserved(self, peak: int) -> int:
        """Bytes of the device the job takes: its cap plus the per-process overhead."""
        return self.cap(peak) + self.overhead


@dataclass
class Resident:
    """A job already running on a device, as the planner sees it."""

    job_id: int
    reserved: int  # bytes; the whole device for a job running alone
    alone: bool = False
    backfill: bool = False


@dataclass
class Device:
    """One device (a GPU id, or the CPU) with its capacity and the jobs on it."""

    unit: int
    label: str
    capacity: int
    residents: list[Resident] = field(default_factory=list)

    def used(self, include_backfill: bool = True) -> int:
        return sum(r.reserved for r in self.residents if include_backfill or not r.backfill)

    def has_alone(self, include_backfill: bool = True) -> bool:
        return any(r.alone for r in self.residents if include_backfill or not r.backfill)

    def normal_jobs(self) -> int:
        return sum(1 for r in self.residents if not r.backfill)


@dataclass
class Candidate:
    """A waiting job with what the planner needs to know about it."""

    job: Job
    remaining: float | None  # seconds (for --until)
    peak: int | None  # predicted peak allocated bytes; None: unknown


@dataclass
class Start:
    """Start ``job`` on ``units``; ``cap`` is its allocator cap (None: it runs alone)."""

    job: Job
    units: list[int]
    cap: int | None
    reserved: int
    remaining: float | None


@dataclass
class PackPlan:
    """The decisions of one scheduling round.

    Attributes:
        start: Jobs to start now.
        preempt: ``(backfill job id, job id it makes room for)``: backfill jobs to stop so a
            normal job can start in a later round (once they have checkpointed and exited).
        drained: ``(unit, job id)``: a device set aside for the head of the waiting line.
        deferred: Jobs that would end after ``--until``.
        impossible: Jobs needing more devices than the runner has.
        alone: Ids of started/waiting jobs that cannot share a device, with the reason.
    """

    start: list[Start] = field(default_factory=list)
    preempt: list[tuple[int, int]] = field(default_factory=list)
    drained: list[tuple[int, int]] = field(default_factory=list)
    deferred: list[tuple[Job, float | None]] = field(default_factory=list)
    impossible: list[tuple[Job, int]] = field(default_factory=list)
    alone: dict[int, str] = field(default_factory=dict)


def alone_reason(job: Job, peak: int | None, rules: Rules, largest: int) -> str | None:
    """Why ``job`` cannot share a device (None: it can)."""
    if job.alone:
        return "ran out of memory while sharing a device"
    if job.devices > 1:
        return f"uses {job.devices} devices"
    if peak is None:
        return "no memory prediction" + (f" ({job.mem_source})" if job.mem_source else "")
    if rules.reserved(peak) > largest:
        return "its reservation exceeds the device"
    return None


def held_by_deadline(until: float | None, now: float, remaining: float | None) -> bool:
    """Whether ``queue run --until`` holds a waiting job back: the deadline has passed, the
    job would end after it, or it has no time estimate to judge it by (the deadline is a
    promise: a job that cannot be timed could run through it). The one rule of both planners
    (:func:`plan_pack` and the runner's ``plan_starts``)."""
    if until is None:
        return False
    return now >= until or remaining is None or now + remaining > until


def plan_pack(
    candidates: list[Candidate],
    devices: list[Device],
    rules: Rules,
    until: float | None,
    now: float,
    preempting: set[int] | None = None,
) -> PackPlan:
    """Decide which ``candidates`` (in queue order) start where, and which backfill jobs to stop.

    ``devices`` describe what runs now; they are not modified. ``preempting``: backfill jobs
    already asked to stop (their room counts as taken until they exit).
    """
    plan = PackPlan()
    preempting = preempting or set()
    devs = [
        Device(d.unit, d.label, d.capacity, [Resident(**vars(r)) for r in d.residents])
        for d in devices
    ]
    largest = max((d.capacity for d in devs), default=0)
    drained: dict[int, int] = {}  # unit -> job id waiting for it
    head_seen = False
    normal = [c for c in candidates if not c.job.backfill]
    backfill = [c for c in candidates if c.job.backfill]

    for c in normal:
        job = c.job
        if job.devices > len(devs):
            plan.impossible.append((job, job.devices))
            continue
        if held_by_deadline(until, now, c.remaining):
            plan.deferred.append((job, c.remaining))
            continue
        why = alone_reason(job, c.peak, rules, largest)
        if why:
            plan.alone[job.id] = why
        placed = _place(c, devs, rules, why is not None, drained, plan, preempting)
        if placed or head_seen:
            continue
        # The head of the waiting line: set devices aside so that it cannot starve.
        head_seen = True
        for d in _drain_targets(c, devs, rules, why is not None):
            drained[d.unit] = job.id
            plan.drained.append((d.unit, job.id))

    if until is not None and now >= until:
        return plan  # backfill fills idle time before the deadline only
    for c in backfill:
        why = alone_reason(c.job, c.peak, rules, largest)
        if why:
            plan.alone[c.job.id] = why
        open_devs = [d for d in devs if d.unit not in drained]
        if why is not None:
            free = [d for d in open_devs if not d.residents][: c.job.devices]
            if len(free) == c.job.devices:
                _start(plan, c, free, None, rules)
            continue
        reserved = rules.reserved(c.peak or 0)
        for d in open_devs:
            if not d.has_alone() and d.used() + reserved <= d.capacity:
                _start(plan, c, [d], rules.cap(c.peak or 0), rules)
                break
    return plan


def _place(
    c: Candidate,
    devs: list[Device],
    rules: Rules,
    alone: bool,
    drained: dict[int, int],
    plan: PackPlan,
    preempting: set[int],
) -> bool:
    """Start ``c`` now, or make room for it by stopping backfill jobs; False: no room."""
    open_devs = [d for d in devs if drained.get(d.unit, c.job.id) == c.job.id]
    if alone:
        empty = [d for d in open_devs if d.normal_jobs() == 0][: c.job.devices]
        if len(empty) < c.job.devices:
            return False
        if any(d.residents for d in empty):  # backfill jobs hold them: stop those first
            for d in empty:
                _preempt_backfill(d, c.job.id, None, plan, preempting)
            _hold(empty, c, None)
            return True
        _start(plan, c, empty, None, rules)
        return True
    assert c.peak is not None
    reserved = rules.reserved(c.peak)
    for d in open_devs:
        if d.has_alone(include_backfill=False):
            continue
        if d.used(include_backfill=False) + reserved > d.capacity:
            continue
        if d.has_alone() or d.used() + reserved > d.capacity:
            _preempt_backfill(d, c.job.id, reserved, plan, preempting)
            _hold([d], c, reserved)
            return True
        _start(plan, c, [d], rules.cap(c.peak), rules)
        return True
    return False


def _start(plan: PackPlan, c: Candidate, devs: list[Device], cap: int | None, rules: Rules) -> None:
    alone = cap is None
    reserved = [d.capacity if alone else rules.reserved(c.peak or 0) for d in devs]
    for d, r in zip(devs, reserved, strict=True):
        d.residents.append(Resident(c.job.id, r, alone, bool(c.job.backfill)))
    plan.start.append(Start(c.job, [d.unit for d in devs], cap, reserved[0], c.remaining))


def _hold(devs: list[Device], c: Candidate, reserved: int | None) -> None:
    """Count the room a job waits for as taken, so later jobs in this round leave it alone."""
    for d in devs:
        d.residents.append(Resident(c.job.id, reserved or d.capacity, reserved is None, False))


def _preempt_backfill(
    d: Device, for_job: int, need: int | None, plan: PackPlan, preempting: set[int]
) -> None:
    """Stop backfill jobs on ``d``, newest first, until ``need`` bytes are free (all of them when
    ``need`` is None). Jobs already stopping count as gone."""
    stopping = [r for r in d.residents if r.backfill and r.job_id in preempting]
    for r in stopping:
        d.residents.remove(r)
    for r in sorted((r for r in d.residents if r.backfill), key=lambda r: -r.job_id):
        if need is not None and not d.has_alone() and d.used() + need <= d.capacity:
            break
        d.residents.remove(r)
        plan.preempt.append((r.job_id, for_job))
    d.residents.extend(stopping)  # still on the device until they exit


def _drain_targets(c: Candidate, devs: list[Device], rules: Rules, alone: bool) -> list[Device]:
    """Devices to set aside for a waiting head job: those with the fewest normal jobs, then
    the least reserved memory (they free up first, as far as the planner can tell). Backfill
    jobs on them run on until the head can start (then :func:`_place` stops them)."""
    order = sorted(devs, key=lambda d: (d.normal_jobs(), d.used(include_backfill=False), d.unit))
    if alone:
        return order[: max(1, c.job.devices)]
    return [d for d in order if d.capacity >= rules.reserved(c.peak or 0)][:1]


def describe_start(s: Start, device: Device, rules: Rules, peak: int | None) -> str:
    """One line of the memory sum of a packed start: peak + margin + overhead = reserved."""
    if s.cap is None or peak is None:
        return f"job {s.job.id} {s.job.name}: alone on {device.label}"
    cap = (
        " (a CPU allocator has no cap)"
        if device.label == "cpu"
        else f"; allocator cap {gib(s.cap)} ({s.cap / device.capacity:.3f} of "
        f"{gib(device.capacity)})"
    )
    return (
        f"job {s.job.id} {s.job.name}: predicted peak {gib(peak)} + margin "
        f"{rules.margin:.0%} {gib(s.cap - peak)} + overhead {gib(rules.overhead)} = "
        f"{gib(s.reserved)} reserved on {device.label}{cap}"
    )


def gib(n: float) -> str:
    """Bytes as GiB with two decimals (``"16.25 GiB"``); small values in MiB."""
    if abs(n) < GiB:
        return f"{n / 1024**2:.1f} MiB"
    return f"{n / GiB:.2f} GiB"
