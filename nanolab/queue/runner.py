"""``nanolab queue run``: one job per GPU (or CPU slot), back to back, through the night.

Each job is a ``nanolab fit`` subprocess with a fixed run name and ``run.resume auto``, so whatever
stops it (a crash, a kill, a lost machine, this runner dying) costs only the steps since its last
checkpoint: the next attempt continues the same run directory. Jobs are claimed in a database
transaction, so two runners never start the same job.

Robustness, case by case:

* a job crashes: it is marked ``failed`` with its error line and the queue goes on;
* the runner gets SIGTERM/SIGINT: it forwards SIGTERM to its jobs (each finishes its optimizer
  step, checkpoints and exits 75), marks them ``preempted`` and exits; a second signal makes the
  jobs exit at once;
* another process holds the queue database's write lock for long (a shell's ``sqlite3``, a
  backup): the runner's writes (heartbeat, claims, outcomes) wait for it, retried with backoff
  and said once in its log, while its jobs train on;
* the runner is SIGKILLed or its machine dies: on Linux every job was started with a parent-death
  signal (SIGTERM), so it checkpoints and exits by itself. The next runner finds jobs marked
  ``running`` whose runner is gone (its process no longer runs on this machine; a runner of
  another machine: no heartbeat for ``stale_s``), takes each
  over, stops any job process still alive (SIGTERM, SIGKILL after ``grace_s``) while it goes on
  heartbeating and running its own jobs, and resumes those jobs from their checkpoints. A job is
  never started twice at once and never restarted from scratch.

Exit detection uses a pidfd per job where the OS has them (Linux >= 5.3), so the next job starts
as soon as the previous one exits; :attr:`Runner.gaps` records that gap.

Beyond one job per device (docs/queue.md):

* ``pack``: several jobs share a device as far as their predicted memory allows
  (:mod:`nanolab.queue.packing` decides; each packed job's allocator is capped through
  :mod:`nanolab.queue.launch`); a packed job that runs out of memory goes back to the queue
  marked to run alone, and resumes from its checkpoint;
* backfill jobs (``queue add --backfill``) start only on devices no other job wants; when one is
  wanted, or at ``until``, the backfill job gets SIGTERM (checkpoint at its step boundary,
  exit 75, status ``preempted``) and resumes later from exactly there;
* every job gets the queue's compile caches (``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``
  under ``nanolab_queue_cache/`` beside the database, unless set already), so the second job of
  a ``model.compile: true`` config loads its kernels instead of compiling them again.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import select
import signal
import socket
import stat
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from nanolab.errors import EXIT_DISK_FULL
from nanolab.estimator.runtime import GPU_HINT
from nanolab.processes import how_it_ended
from nanolab.queue.db import (
    BUSY_SLICE_S,
    CLAIMABLE,
    HEARTBEAT_S,
    RUNNER_STALE_S,
    Job,
    QueueDB,
    QueueError,
    pid_alive,
    runner_alive,
    runner_process,
)
from nanolab.queue.jobs import (
    changed_config,
    complete_abbreviations,
    fit_settings,
    foreign_run_at_start,
)
from nanolab.queue.launch import CAP_ENV
from nanolab.queue.packing import (
    Candidate,
    Device,
    Resident,
    Rules,
    describe_start,
    gib,
    held_by_deadline,
    plan_pack,
)
from nanolab.queue.predict import (
    describe,
    job_peak,
    logged_time,
    process_overhead,
    remaining_seconds,
)
from nanolab.runs import duration

#: Exit status of a preempted ``nanolab fit`` (see nanolab.callbacks.preemption).
EXIT_PREEMPTED = 75
#: ``nanolab fit``'s exit code for a run its divergence check stopped (the job failed: rerunning
#: it as it is diverges again). Same value as ``nanolab.callbacks.divergence.EXIT_DIVERGED``.
EXIT_DIVERGED = 3
#: ``queue run``'s exit status when a job it ran ended ``failed`` (by its last outcome under
#: this runner): ``queue run && notify-send done`` must not say done over a failed night.
EXIT_JOB_FAILED = 1
ORDERS = ("fifo", "longest-first")
#: Longest wait between two tries to start a job after the machine refused a process.
START_RETRY_MAX_S = 60.0
#: Folder beside the queue database that holds the compile caches all its jobs share.
CACHE_DIR_NAME = "nanolab_queue_cache"
#: Environment variables pointing PyTorch's compilers at a cache, and their folders in it.
CACHE_ENV = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}


@dataclass
class Active:
    """A job this runner started and has not yet seen exit."""

    job: Job
    proc: subprocess.Popen
    units: list[int]
    started: float  # wall clock, for run_seconds and matching its log records
    log: IO[bytes]
    pidfd: int | None = None
    cap: int | None = None  # allocator cap in bytes when it shares a device (None: alone)
    reserved: int = 0  # bytes of the device it takes when packed
    preempted_for: int | None = None  # the job a backfill job was asked to stop for
    removed: bool = False  # its row left the queue while it ran; asked to stop
    # Wall clock when its exit was first seen (:meth:`Runner._note_exits`); run_seconds is the
    # process's time, start to exit, not until the runner could write (it may wait for the lock).
    exited: float | None = None


@dataclass
class Orphan:
    """A job of a runner that is gone, taken over by this runner while its leftover process
    checkpoints and exits; watched each loop turn (never waited for in one call), so the runner
    heartbeats, reaps its own jobs and answers signals meanwhile."""

    job: Job  # its row as taken over (runner_id: this runner)
    pid: int
    deadline: float  # monotonic: SIGKILL then (after SIGKILL: when to stop waiting)
    pidfd: int | None = None  # readable once the process has exited (wakes the loop)
    killed: bool = False


@dataclass
class Runner:
    """Runs claimable jobs from ``db`` until none is left (or the deadline / a signal).

    Args:
        db: The queue database.
        gpus: Device ids (``CUDA_VISIBLE_DEVICES``/``HIP_VISIBLE_DEVICES`` values), one job per
            id at a time (a job asking ``trainer.devices: N`` gets N of them); None = CPU slots.
        slots: Jobs at once without GPUs.
        until: Unix time by which started jobs should finish; jobs estimated to end later wait.
        order: ``fifo`` (added first, started first) or ``longest-first`` (by remaining estimate).
        wait: Keep running and pick up jobs added later, until ``until`` or a signal.
        grace_s: How long an orphaned job may take to checkpoint and exit before SIGKILL.
        pack: Start several jobs per device as their predicted memory allows (one device: the
            CPU, without ``gpus``; ``slots`` is then unused).
        device_mem: Bytes of each device for ``pack`` (None: what the device reports; on CPU,
            the physical memory).
        pack_margin: Share of a packed job's predicted peak added to its allocator cap.
        compile_cache: Share compile caches between jobs (see the module docstring).
    """

    db: QueueDB
    gpus: list[str] | None = None
    slots: int = 1
    until: float | None = None
    order: str = "fifo"
    wait: bool = False
    poll_s: float = 1.0
    heartbeat_s: float = HEARTBEAT_S
    stale_s: float = RUNNER_STALE_S
    grace_s: float = 120.0
    pack: bool = False
    device_mem: int | None = None
    pack_margin: float = 0.10
    compile_cache: bool = True
    # Bytes of one GPU id for ``pack`` without ``device_mem`` (None: :func:`gpu_total_memory`);
    # the seam a CPU test drives the GPU path through, with that reader asking its own child.
    read_gpu_memory: Callable[[str], int] | None = None
    # The driver's name of one GPU id (None: :func:`gpu_device_name`), to time a job that
    # ``queue add`` could not (no GPU there) for the device this runner gives it; the seam a
    # CPU test drives that path through.
    read_gpu_name: Callable[[str], str | None] | None = None
    out: Any = None
    runner_id: int = 0
    gaps: list[float] = field(default_factory=list)
    _active: dict[int, Active] = field(default_factory=dict)
    _orphans: dict[int, Orphan] = field(default_factory=dict)
    _freed_at: dict[int, float] = field(default_factory=dict)
    _deferred: set[int] = field(default_factory=set)
    # Jobs added without a time, timed again here for this runner's device: id -> (s, how).
    _timed_here: dict[int, tuple[float | None, str]] = field(default_factory=dict)
    _gpu_names: dict[str, str | None] = field(default_factory=dict)  # by id, read once
    _signals: int = 0
    _wake_r: int | None = None
    # Each job's last outcome under this runner: the end summary and --notify count jobs, not
    # attempts (a job that failed, was retried and failed again is one failed job).
    _outcomes: dict[int, str] = field(default_factory=dict)
    # A slot this round meant to fill is still free: a claimed job was not started (config
    # changed, no log), or another runner's claim won the job. Fill again before deciding the
    # queue is done: with nothing of its own running, the runner would otherwise quit.
    _fill_again: bool = False
    notify: list[str] = field(default_factory=list)  # targets told when the runner ends
    _capacity: list[int] = field(default_factory=list)
    _rules: Rules = field(default_factory=Rules)
    _drained_said: set[tuple[int, int]] = field(default_factory=set)
    _plan_key: tuple | None = None
    preemptions: list[tuple[int, int, float]] = field(default_factory=list)
    busy_try_s: float = 5.0  # how long one write waits for another process's write lock
    _busy_since: float | None = None
    # The machine refused to start a job's process (EAGAIN: its process table is full, ENOMEM,
    # the Python it runs gone): no fault of the job, which waits again, its attempt not counted.
    # The runner tries again after start_retry_s, doubling up to START_RETRY_MAX_S, and stops
    # starting jobs once the refusals have lasted start_patience_s.
    start_retry_s: float = 2.0
    start_patience_s: float = 600.0
    _start_refusals: int = 0
    _refused_since: float | None = None  # time.monotonic() of the first refusal in a row
    _start_retry_at: float = 0.0  # time.monotonic() before which no job is started
    _retry_due: bool = False  # a job went back to the queue: stay to try it again
    _cannot_start: str | None = None  # why the runner stopped starting jobs
    _fit_settings: frozenset[str] | None = None  # fit's setting keys, read at the first need

    # -- public ----------------------------------------------------------------------------
    @property
    def units(self) -> list[str | None]:
        if self.gpus:
            return list(self.gpus)
        return [None] if self.pack else [None] * self.slots

    def label(self, unit: int) -> str:
        return f"GPU {self.units[unit]}" if self.gpus else "cpu"

    def run(self) -> int:
        """Work through the queue. Exit status: 75 when stopped by a signal (its jobs were asked
        to checkpoint: run it again to resume them), else 1 when a job it ran ended failed
        (:data:`EXIT_JOB_FAILED`), else 0 (every job it ran done, or stopped by its budget or
        plateau rule; or nothing to run)."""
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {self.order!r}")
        # Short tries, retried: a signal is handled between them, not after SQLite's 30 s wait.
        self.db.wait_for_lock(self.busy_try_s)
        self.db.patience = self._wait_for_the_queue
        self.db.conn.between_tries = self._note_exits
        # The device sizes are read before the runner's row exists: a device that cannot be
        # read refuses the run with no row left open (no stop time) behind it.
        pack_lines = self._setup_pack() if self.pack else []
        self.runner_id = self.db.register_runner()
        where = f"GPUs {','.join(self.gpus)}" if self.gpus else f"{self.slots} CPU slot(s)"
        if self.pack:
            where = f"GPUs {','.join(self.gpus)}" if self.gpus else "the CPU"
            where += ", packed by memory"
        self.say(f"runner {self.runner_id} (pid {os.getpid()}) on {where}, order {self.order}"
                 + (f", until {time.strftime('%a %H:%M', time.localtime(self.until))}" if self.until else ""))  # fmt: skip
        for line in pack_lines:
            self.say(line)
        previous = self._install_signals()
        last_beat = last_recover = time.monotonic()
        try:
            self.recover()
            while True:
                self.reap()
                self._watch_orphans()
                if not self._signals:
                    self.fill()
                    self._stop_backfill_at_deadline()
                if self._fill_again and not self._signals:
                    self._fill_again = False
                    continue
                # An orphan still exiting becomes claimable (this runner then resumes it).
                waiting = bool(self._orphans) or self._keep_waiting() or self._retry_due
                if not self._active and (self._signals or not waiting):
                    break
                now = time.monotonic()
                if now - last_beat >= self.heartbeat_s:
                    self.db.heartbeat(self.runner_id)
                    last_beat = now
                if now - last_recover >= self.stale_s:
                    self.recover()  # another runner may have died meanwhile
                    last_recover = now
                # A running backfill job must give way quickly when a job arrives.
                backfilling = any(a.job.backfill for a in self._active.values())
                retry_in = self._start_retry_at - time.monotonic() if self._retry_due else 1e9
                self._wait(
                    min(self.poll_s, self.heartbeat_s, 0.25 if backfilling else 1e9,
                        max(retry_in, 0.01))
                )  # fmt: skip
        finally:
            self._restore_signals(previous)
            self._leave_orphans()
            self.db.stop_runner(self.runner_id)
        self._summary()
        if self._signals or self._cannot_start:
            return EXIT_PREEMPTED
        return EXIT_JOB_FAILED if "failed" in self._outcomes.values() else 0

    def say(self, text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", file=self.out or sys.stdout, flush=True)

    # -- recovering jobs of runners that died --------------------------------------------
    def recover(self) -> None:
        """Take over the ``running`` jobs of runners that are gone: one whose process still runs
        here is asked to checkpoint and exit, and watched (:meth:`_watch_orphans`); the others
        are claimable again at once."""
        for job in self.db.jobs(("running",)):
            if job.runner_id == self.runner_id:
                continue  # its own, or an orphan it took over already
            owner = self.db.runner(job.runner_id)
            if runner_alive(owner, self.stale_s):
                continue
            here = owner is None or owner["host"] == socket.gethostname()
            if here and job.job_pid and _is_job_process(job.job_pid, job.name):
                self._adopt(job, job.job_pid, owner)
            else:
                self._recovered(job)

    def _adopt(self, job: Job, pid: int, owner: dict[str, Any] | None) -> None:
        """Take over a gone runner's job whose process is alive, and ask that process to stop."""
        detail = f"its runner is gone; runner {self.runner_id} is stopping its process {pid}"
        if not self.db.adopt_orphan(job, self.runner_id, detail):
            return  # another runner took it over, or it changed, since it was read
        self.say(f"job {job.id} {job.name}: its runner is gone; waiting for its process "
                 f"{pid} to checkpoint and exit")  # fmt: skip
        # A dead runner's jobs got SIGTERM from the kernel (parent-death signal); a hung
        # runner's did not. A second SIGTERM would end it at once, without its checkpoint.
        owner_gone = owner is None or not _owner_runs(owner)
        if not (_HAS_PDEATHSIG and owner_gone):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        pidfd = None
        with contextlib.suppress(AttributeError, OSError):
            pidfd = os.pidfd_open(pid)
        adopted = replace(job, runner_id=self.runner_id, detail=detail)
        self._orphans[job.id] = Orphan(adopted, pid, time.monotonic() + self.grace_s, pidfd)

    def _watch_orphans(self) -> None:
        """Recover each orphan whose process has exited; SIGKILL one still there at its
        deadline (``grace_s``), and recover it once gone or 10 s after that."""
        for job_id, orphan in list(self._orphans.items()):
            now = time.monotonic()
            if pid_alive(orphan.pid):
                if now < orphan.deadline:
                    continue
                if not orphan.killed:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(orphan.pid, signal.SIGKILL)
                    orphan.killed, orphan.deadline = True, now + 10.0
                    within = describe(self.grace_s)
                    self.say(f"job {job_id} {orphan.job.name}: its process {orphan.pid} did not "
                             f"exit within {within}; killed it (SIGKILL)")  # fmt: skip
                    continue
            del self._orphans[job_id]
            if orphan.pidfd is not None:
                os.close(orphan.pidfd)
            self._recovered(orphan.job)

    def _recovered(self, job: Job) -> None:
        """Make a gone runner's job claimable again, if its row is still as it was seen."""
        if self.db.recover_as_seen(job, "its runner died; resumes from its last checkpoint"):
            self.db.event("recover", self.runner_id, job.id)
            self.say(f"job {job.id} {job.name}: recovered (will resume from its checkpoint)")

    def _leave_orphans(self) -> None:
        """Stopping with orphans still exiting: they stay taken over by this runner, which is
        about to be marked stopped, so the next runner takes them over and recovers them."""
        for job_id, orphan in self._orphans.items():
            if orphan.pidfd is not None:
                os.close(orphan.pidfd)
            self.say(f"job {job_id} {orphan.job.name}: its process {orphan.pid} is still "
                     "exiting; the next `nanolab queue run` recovers it")  # fmt: skip
        self._orphans.clear()

    # -- starting jobs ---------------------------------------------------------------------
    def _free_units(self) -> list[int]:
        used = {u for a in self._active.values() for u in a.units}
        return [i for i in range(len(self.units)) if i not in used]

    def fill(self) -> None:
        """Start what can start now; ask backfill jobs to give way where others need room."""
        if self._starts_held():
            return
        self._retry_due = False
        if self.pack:
            self._fill_packed()
            return
        free = self._free_units()
        held = {u: a for a in self._active.values() if a.job.backfill for u in a.units}
        if not free and not held:
            return
        now = time.time()
        waiting = self._ordered(self.db.jobs(CLAIMABLE))
        normal = [(j, r) for j, r in waiting if not j.backfill]
        # Units a backfill job holds count as free for the others: it gives them back.
        plan = plan_starts(
            normal, sorted(free + list(held)), len(self.units), self.until, now,
            gpus=bool(self.gpus),
        )  # fmt: skip
        self._report(plan.impossible, plan.deferred, now)
        taken: set[int] = set()
        for job, units, remaining in plan.start:
            taken.update(units)
            blockers = {held[u].job.id: held[u] for u in units if u in held}
            if blockers:
                for active in blockers.values():
                    self._preempt(active, job)
                continue  # starts once they have checkpointed and exited
            self._claim_and_spawn(job, units, remaining)
        backfill = [(j, r) for j, r in waiting if j.backfill]
        left = [u for u in free if u not in taken]
        if backfill and left and not (self.until is not None and now >= self.until):
            bplan = plan_starts(backfill, left, len(self.units), None, now, gpus=bool(self.gpus))
            self._report(bplan.impossible, [], now)
            for job, units, remaining in bplan.start:
                self._claim_and_spawn(job, units, remaining)

    def _ordered(self, jobs: list[Job]) -> list[tuple[Job, float | None]]:
        return order_jobs([(j, self._remaining(j)) for j in jobs], self.order)

    def _remaining(self, job: Job) -> float | None:
        """The job's time left (:func:`remaining_seconds`); under ``--until``, a job that
        ``queue add`` could not time (no GPU visible there) is timed again for this runner's
        own device, as ``queue add --gpu`` would have, before it is held back."""
        seconds = remaining_seconds(self.db, job)[0]
        if seconds is not None or self.until is None:
            return seconds
        if job.id not in self._timed_here:
            self._timed_here[job.id] = self._estimate_here(job)
        total, how = self._timed_here[job.id]
        if total is None:
            return None
        return remaining_seconds(self.db, replace(job, estimate_s=total, estimate_source=how))[0]

    def _estimate_here(self, job: Job) -> tuple[float | None, str]:
        """(seconds, how) for the whole job on the device this runner runs it on (its first GPU,
        by the driver's name; else this CPU); (None, why not)."""
        from nanolab.errors import NanolabError
        from nanolab.queue.jobs import parse_config
        from nanolab.queue.predict import estimator_gpu, flops_estimate

        gpu = None
        if self.gpus:
            if self.gpus[0] not in self._gpu_names:  # one child per runner, not per job
                read = self.read_gpu_name or gpu_device_name
                self._gpu_names[self.gpus[0]] = read(str(self.gpus[0]))
            name = self._gpu_names[self.gpus[0]]
            if name is None:
                return None, f"GPU {self.gpus[0]}'s name could not be read"
            gpu = estimator_gpu(name)
            if gpu is None:  # queue add --gpu takes a table name: the fix the line gives
                return None, f"no estimate: GPU {self.gpus[0]} is a {name}, not in the table"
        try:
            parsed = parse_config(Path(job.cwd) / job.config, job.args, job.name, Path(job.cwd))
            seconds, how = flops_estimate(parsed, gpu)
        except NanolabError as err:  # its start says why; here it only stays untimed
            return None, str(err)
        return seconds, how or ""

    def _report(self, impossible, deferred, now: float) -> None:
        for job, need in impossible:
            if self.db.set_status(
                job.id, "failed", expect=CLAIMABLE, ended=now,
                detail=f"needs {need} GPUs (trainer.devices); this runner has {len(self.units)}",
            ):  # fmt: skip
                self._outcomes[job.id] = "failed"  # a job this runner ended: it counts
            self.say(f"job {job.id} {job.name}: failed, needs {need} GPUs")
        for job, remaining in deferred:
            if job.id not in self._deferred and self.until is not None:
                self._deferred.add(job.id)
                left = describe(max(0.0, self.until - now))
                if remaining is None:  # the deadline is a promise: an untimed job may break it
                    why = self._timed_here.get(job.id, (None, job.estimate_source))[1]
                    why = (why or "no estimate").removesuffix(GPU_HINT)  # queue add's option
                    self.say(f"job {job.id} {job.name}: deferred, its time is unknown ({why}) "
                             f"and {left} are left; run it without --until, or add it again "
                             "with `nanolab queue add --gpu NAME ...`")  # fmt: skip
                else:
                    self.say(f"job {job.id} {job.name}: deferred, needs ~{describe(remaining)} "
                             f"and {left} are left")  # fmt: skip

    def _claim_and_spawn(
        self,
        job: Job,
        units: list[int],
        remaining: float | None,
        cap: int | None = None,
        reserved: int = 0,
        sharing: int = 1,
    ) -> bool:
        if self._signals or self._starts_held():  # a signal or a refused start this round
            return False
        gpus = ",".join(str(self.units[u]) for u in units) if self.gpus else None
        packed_on = self.label(units[0]) if cap is not None else None
        if not self.db.claim(job.id, self.runner_id, gpus, time.time(), packed_on, cap):
            self._fill_again = True  # another runner took it first: its units go to the next job
            return False
        self._spawn(self.db.get(job.id), units, remaining, cap, reserved, sharing, before=job)
        return True

    # -- packing ---------------------------------------------------------------------------
    def _setup_pack(self) -> list[str]:
        """Read the device sizes and the per-process overhead (part of every sum); the lines
        that say them, once the runner has said itself."""
        if self.gpus:
            import torch

            backend = "rocm" if getattr(torch.version, "hip", None) else "cuda"
        else:
            backend = "cpu"
        self._rules = Rules(margin=self.pack_margin, overhead=process_overhead(backend))
        sizes = []
        for unit in range(len(self.units)):
            if self.device_mem is not None:
                sizes.append((self.device_mem, "--device-mem"))
            elif self.gpus:
                read = self.read_gpu_memory or gpu_total_memory
                sizes.append((read(str(self.units[unit])), "reported by the device"))
            else:
                from nanolab.estimator.cpu import physical_memory

                sizes.append((physical_memory(), "physical RAM"))
        self._capacity = [n for n, _ in sizes]
        return [
            f"{self.label(unit)}: {gib(n)} ({source}); each packed job reserves its predicted "
            f"peak + {self._rules.margin:.0%} margin + {gib(self._rules.overhead)} per-process "
            f"overhead ({backend})"
            for unit, (n, source) in enumerate(sizes)
        ]

    def _devices(self) -> list[Device]:
        devices = [Device(u, self.label(u), self._capacity[u]) for u in range(len(self.units))]
        for a in self._active.values():
            for u in a.units:
                reserved = a.reserved if a.cap is not None else devices[u].capacity
                devices[u].residents.append(
                    Resident(a.job.id, reserved, a.cap is None, bool(a.job.backfill))
                )
        return devices

    def _fill_packed(self) -> None:
        now = time.time()
        key = (
            self.db.conn.execute("PRAGMA data_version").fetchone()[0],
            frozenset(self._active),
            frozenset(a.job.id for a in self._active.values() if a.preempted_for is not None),
            self.until is not None and now >= self.until,
            self._start_retry_at,  # a job given back after a refused start is planned again
        )
        if key == self._plan_key:
            return  # nothing changed since the last round decided
        waiting = self._ordered(self.db.jobs(CLAIMABLE))
        peaks = {j.id: job_peak(self.db, j) for j, _ in waiting}
        candidates = [Candidate(j, r, peaks[j.id][0]) for j, r in waiting]
        devices = self._devices()
        stopping = {a.job.id for a in self._active.values() if a.preempted_for is not None}
        plan = plan_pack(candidates, devices, self._rules, self.until, now, stopping)
        self._report(plan.impossible, plan.deferred, now)
        for backfill_id, for_job in plan.preempt:
            if backfill_id in self._active:
                self._preempt(self._active[backfill_id], self.db.get(for_job))
        for unit, job_id in plan.drained:
            if (unit, job_id) not in self._drained_said:
                self._drained_said.add((unit, job_id))
                self.say(f"{self.label(unit)}: set aside for job {job_id} (next in line; "
                         "no other job starts there until it fits)")  # fmt: skip
        started = False
        # Jobs per device once this round's starts are in (CPU threads are split between them).
        sharing = {d.unit: len(d.residents) for d in devices}
        for st in plan.start:
            sharing[st.units[0]] += 1
        for st in plan.start:
            peak = peaks[st.job.id][0]
            if st.cap is None and st.job.id in plan.alone:
                self.say(f"job {st.job.id} {st.job.name}: runs alone ({plan.alone[st.job.id]})")
            n = sharing[st.units[0]]
            if self._claim_and_spawn(st.job, st.units, st.remaining, st.cap, st.reserved, n):
                started = True
                if st.cap is not None:
                    device = devices[st.units[0]]
                    self.say(describe_start(st, device, self._rules, peak)
                             + f" [{peaks[st.job.id][1]}]")  # fmt: skip
        if started:
            for d in self._devices():
                if len(d.residents) > 1:
                    ids = ", ".join(str(r.job_id) for r in d.residents)
                    self.say(f"{d.label}: shared by jobs {ids}; {gib(d.used())} of "
                             f"{gib(d.capacity)} reserved")  # fmt: skip
        # Decided: plan again when another process changes the queue, a job starts or exits,
        # a backfill job is asked to stop, or the deadline passes (data_version ignores this
        # connection's own writes).
        self._plan_key = key

    def _stop_removed(self, job_id: int) -> None:
        """Ask a job ``queue rm`` removed before its pid was recorded (rm had nothing to
        signal) to checkpoint and stop, as rm does with a pid: a removed job must not train on,
        unseen, to its end. Once the pid is recorded, rm signals the job itself (it deletes
        the row only as it saw it: :meth:`QueueDB.remove_as_seen`), so a job is asked once; a
        second SIGTERM would end it at once, without its checkpoint."""
        active = self._active[job_id]
        if active.removed:
            return
        active.removed = True
        active.proc.terminate()  # checkpoints at its step boundary, exits 75
        self.say(f"job {job_id} {active.job.name}: removed from the queue as it started; "
                 "asked it to checkpoint and stop")  # fmt: skip

    # -- backfill --------------------------------------------------------------------------
    def _preempt(self, active: Active, for_job: Job) -> None:
        """Ask a backfill job to checkpoint and stop (once) so ``for_job`` can have its room."""
        if active.preempted_for is not None:
            return
        active.preempted_for = for_job.id
        self.preemptions.append((active.job.id, for_job.id, time.time()))
        active.proc.terminate()  # Popen ignores a process already gone
        self.db.event("preempt", self.runner_id, active.job.id, float(for_job.id))
        self.say(f"job {active.job.id} {active.job.name} (backfill): asked to checkpoint and "
                 f"stop, job {for_job.id} {for_job.name} needs its room")  # fmt: skip

    def _stop_backfill_at_deadline(self) -> None:
        if self.until is None or time.time() < self.until:
            return
        for active in self._active.values():
            if active.job.backfill and active.preempted_for is None:
                active.preempted_for = 0
                active.proc.terminate()
                self.say(f"job {active.job.id} {active.job.name} (backfill): the deadline has "
                         "come; asked to checkpoint and stop")  # fmt: skip

    def _keep_waiting(self) -> bool:
        """With nothing running: is there any reason to stay?"""
        if self._cannot_start:
            return False
        return self.wait and not (self.until is not None and time.time() >= self.until)

    def _not_started(self, job: Job, detail: str) -> None:
        """A claimed job that cannot start: failed with ``detail``; its slot is filled again."""
        self.db.finish(job.id, self.runner_id, "failed", detail, None, 0.0)
        self.say(f"job {job.id} {job.name}: not started: {detail}")
        self._fill_again = True
        self._outcomes[job.id] = "failed"

    def _spawn(
        self,
        job: Job,
        units: list[int],
        remaining: float | None,
        cap: int | None = None,
        reserved: int = 0,
        sharing: int = 1,
        before: Job | None = None,
    ) -> None:
        """Start claimed ``job``; ``before`` is its row as read before the claim (what it goes
        back to when the machine refuses to start its process)."""
        job = self._options_whole(job)
        changed = changed_config(
            Path(job.cwd) / job.config, job.args, job.config_sha, Path(job.cwd)
        )
        if changed is not None:  # run what was checked, or nothing: never an unchecked edit
            self._not_started(
                job,
                f"config changed since queue add: {changed} (the job was checked as it was "
                "then); `nanolab queue rm` it and add it again",
            )
            return
        if (foreign := foreign_run_at_start(job)) is not None:  # a run begun after the add
            self._not_started(job, foreign)
            return
        log_path = job_log_path(job, self.db.path)
        cmd = [
            sys.executable, "-m", "nanolab", "fit", "--config", job.config, *job.args,
            f"--run.name={job.name}", "--run.resume=auto",
        ]  # fmt: skip
        env = dict(os.environ, PYTHONUNBUFFERED="1", NANOLAB_QUEUE_JOB=str(job.id))
        if self.compile_cache:
            cache = self.db.path.resolve().parent / CACHE_DIR_NAME
            for name, sub in CACHE_ENV.items():
                env.setdefault(name, str(cache / sub))
        if self.gpus:
            ids = ",".join(str(self.units[u]) for u in units)
            env["CUDA_VISIBLE_DEVICES"] = env["HIP_VISIBLE_DEVICES"] = ids
        elif "OMP_NUM_THREADS" not in env:
            jobs_here = max(sharing, 1) if self.pack else self.slots
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs_here))
        if cap is not None:
            # Packed: cap the allocator before anything is allocated (nanolab.queue.launch).
            cmd[1:3] = ["-m", "nanolab.queue.launch"]
            env[CAP_ENV] = f"{cap / self._capacity[units[0]]:.6f}"
            env["NANOLAB_QUEUE_PACKED"] = self.label(units[0])
        try:
            log, log_path, moved = open_job_log(job, log_path, self.db.path)
        except OSError as err:  # a folder or a fifo in its place, no permission: it cannot log
            self._not_started(
                job,
                f"cannot open its log {err.filename or log_path} ({err.strerror or err}); move "
                "what is there out of the way, then `nanolab queue retry` it",
            )
            return
        if moved is not None:
            self.say(moved)
        where = f"GPU {job.gpus}" if job.gpus else ("cpu" if self.pack else f"slot {units[0]}")
        if cap is not None:
            where += ", shared" + (f" (allocator cap {gib(cap)})" if self.gpus else "")
        log_start = run_log_size(job)  # before its process starts: its launch begins there
        header = f"\n{ATTEMPT_HEADER}{job.attempts} at {time.ctime()} on {where}: {' '.join(cmd)}\n"
        log.write(header.encode())
        log.flush()
        try:
            proc = subprocess.Popen(
                cmd,
                cwd=job.cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C in the runner's terminal goes to the runner
                preexec_fn=_die_with_parent(os.getpid()) if _HAS_PDEATHSIG else None,
            )
        except OSError as err:
            with log:
                log.write(f"not started: {err}\n".encode())
            if before is not None and not is_the_jobs_own(err, job):
                self._start_refused(before, job, err)
                return
            self._failed_to_start(job, str(err))
            return
        except subprocess.SubprocessError as err:  # the child failed before exec: preexec_fn
            why = (
                f"its process failed before fit could run ({str(err).rstrip('.')}; that set-up "
                "arranges the job's stop if the runner dies); `nanolab queue retry` it"
            )
            with log:
                log.write(f"not started: {why}\n".encode())
            self._failed_to_start(job, why)
            return
        self._start_refusals, self._refused_since = 0, None
        started = time.time()
        freed = [self._freed_at.pop(u) for u in units if u in self._freed_at]
        if freed:
            gap = time.monotonic() - max(freed)
            self.gaps.append(gap)
            self.db.event("gap", self.runner_id, job.id, gap)
        recorded = self.db.set_job_pid(job.id, proc.pid, str(log_path), log_start)
        job.job_pid, job.log = proc.pid, str(log_path)
        self.db.event("start", self.runner_id, job.id, detail=where)
        pidfd = None
        with contextlib.suppress(AttributeError, OSError):
            pidfd = os.pidfd_open(proc.pid)
        self._active[job.id] = Active(job, proc, units, started, log, pidfd, cap, reserved)
        if not recorded:  # queue rm deleted the row before its pid was there to signal
            self._stop_removed(job.id)
        what = "resuming" if job.attempts > 1 else "starting"
        self.say(f"job {job.id} {job.name}: {what} on {where} (attempt {job.attempts}, "
                 f"~{describe(remaining)}; log {log_path})")  # fmt: skip

    def _failed_to_start(self, job: Job, why: str) -> None:
        """A claimed job whose process could not be started, for a cause that would stop it
        again: failed with ``why`` in one line; the runner goes on with the next job."""
        self.db.finish(job.id, self.runner_id, "failed", f"could not start: {why}", None, 0.0)
        self.say(f"job {job.id} {job.name}: failed to start: {why}")
        self._outcomes[job.id] = "failed"
        self._fill_again = True  # its slot is free: the next job, before the queue is done

    def _options_whole(self, job: Job) -> Job:
        """``job`` with the abbreviated options an earlier nanolab queued (``--seed=7``, which
        its fit completed to ``--seed_everything=7``) written whole, as fit now matches them;
        said once, and kept in the queue so that later attempts run them as written."""
        if not any(arg.startswith("--") for arg in job.args):
            return job
        if self._fit_settings is None:
            self._fit_settings = fit_settings()
        args, notes = complete_abbreviations(job.args, self._fit_settings)
        if not notes:
            return job
        self.db.set_args(job.id, self.runner_id, args)
        self.say(f"job {job.id} {job.name}: queued by an earlier nanolab, whose fit completed "
                 f"abbreviated options; runs {', '.join(notes)}")  # fmt: skip
        return replace(job, args=args)

    def _starts_held(self) -> bool:
        """No job starts now: the machine refused a process a moment ago (retried later), or
        for so long that the runner gave up starting jobs."""
        return self._cannot_start is not None or time.monotonic() < self._start_retry_at

    def _start_refused(self, before: Job, job: Job, err: OSError) -> None:
        """The machine refused ``job``'s process for a cause not the job's own (see
        :func:`is_the_jobs_own`): it waits again as ``before`` was, and the runner retries with
        backoff, then stops starting jobs (its running ones finish) with one line."""
        now = time.monotonic()
        self._refused_since = self._refused_since if self._start_refusals else now
        self._start_refusals += 1
        refused_for = now - self._refused_since
        detail = (
            f"not started: this machine could not start a process ({err}); waiting to try again"
        )
        if not self.db.unclaim(before, self.runner_id, detail):
            # The row changed since it was read (another process wrote it): claimable again all
            # the same, never left running under a runner with no process for it.
            self.db.finish(job.id, self.runner_id, "preempted", detail, None, 0.0)
        if refused_for >= self.start_patience_s:
            self._cannot_start = str(err)
            self.say(f"cannot start job processes on this machine: {err} ({self._start_refusals} "
                     f"tries over {duration(refused_for)}); no new job starts, the waiting jobs "
                     "stay in the queue: run `nanolab queue run` again once processes can be "
                     "started (ulimit -u, free memory)")  # fmt: skip
            return
        wait = min(
            self.start_retry_s * 2 ** (self._start_refusals - 1),
            START_RETRY_MAX_S,
            self.start_patience_s - refused_for,
        )
        self._start_retry_at, self._retry_due = now + wait, True
        self.say(f"job {job.id} {job.name}: not started, this machine could not start a process "
                 f"({err}); back in the queue, trying again in {describe(wait)}")  # fmt: skip

    # -- finished jobs ---------------------------------------------------------------------
    def _note_exits(self) -> None:
        """Note when each job's process exited, as soon as it is seen: also between the tries of
        a write that waits for another process's lock, so a job's run time ends at its exit, not
        when the runner could write its outcome."""
        now = time.time()
        for active in self._active.values():
            if active.exited is None and active.proc.poll() is not None:
                active.exited = now

    def reap(self) -> None:
        self._note_exits()
        for job_id, active in list(self._active.items()):
            if active.exited is None:
                continue
            code = int(active.proc.returncode)
            del self._active[job_id]
            self._freed_at.update(dict.fromkeys(active.units, time.monotonic()))
            if active.pidfd is not None:
                os.close(active.pidfd)
            with active.log:  # its error line is read through the runner's own handle
                status, detail = outcome(
                    active.job, code, active.started, bool(self._signals), active.log
                )
            ran = active.exited - active.started
            columns: dict[str, Any] = {}
            if status == "failed" and active.cap is not None and is_out_of_memory(detail):
                # Its prediction was too low for the room it had: run it alone next time.
                status, columns["alone"] = "pending", 1
                detail = (f"out of memory sharing {self.label(active.units[0])} (cap "
                          f"{gib(active.cap)}); will run alone, resuming from its checkpoint")  # fmt: skip
            elif status == "preempted" and active.preempted_for:
                detail = f"backfill: made room for job {active.preempted_for}; {detail}"
            elif status == "preempted" and active.preempted_for == 0:
                detail = f"backfill: stopped at the deadline; {detail}"
            columns.update(log_columns(active.job, status))
            if self.db.finish(job_id, self.runner_id, status, detail, code, ran, **columns):
                self._outcomes[job_id] = status
                self.db.event("exit", self.runner_id, job_id, float(code), status)
                tail = f": {detail}" if detail else ""
                # The job's time as `queue ls`, status and report give it: its run log's.
                # (None when this attempt logged nothing, or another launch wrote the log's
                # newest time: then its own time.)
                took = logged_time(active.job, active.started)
                took = ran if took is None else took
                self.say(f"job {job_id} {active.job.name}: {status} after {duration(took)} "
                         f"(exit {code}){tail}")  # fmt: skip
            else:
                self.say(f"job {job_id} {active.job.name}: exited ({code}); it was removed from "
                         "the queue meanwhile")  # fmt: skip

    # -- waiting and signals ---------------------------------------------------------------
    def _wait_for_the_queue(self, tries: int) -> None:
        """:attr:`QueueDB.patience`: another process holds the queue's write lock. A runner
        that gave up would leave its jobs ``running`` under a runner that is gone; it waits
        instead (retrying with backoff, its jobs training on), and says so once each time."""
        if tries == 0:
            waited = time.monotonic() - (self._busy_since or time.monotonic())
            self._busy_since = None
            self.say(f"the queue database can be written again (waited {describe(waited)})")
            return
        if tries == 1:
            self._busy_since = time.monotonic() - self.busy_try_s
            self.say(f"the queue database {self.db.path} is busy: another process has held its "
                     f"write lock for over {self.busy_try_s:.0f} s; the queue is healthy; "
                     "retrying until it is free (jobs train on; `fuser "
                     f"{self.db.path}` names the processes that have it open)")  # fmt: skip
        until = time.monotonic() + min(2.0 ** (tries - 1), 30.0)
        while (left := until - time.monotonic()) > 0:
            self._note_exits()  # a job's exit is timed while the runner waits
            time.sleep(min(left, BUSY_SLICE_S))

    def _wait(self, timeout: float) -> None:
        watched = [*self._active.values(), *self._orphans.values()]
        fds = [w.pidfd for w in watched if w.pidfd is not None]
        if len(fds) < len(watched):
            timeout = min(timeout, 0.05)  # some process without a pidfd: poll it
        if self._orphans:  # an orphan's deadline (SIGKILL) is kept to the second
            timeout = min(timeout, 1.0)
        if self._wake_r is not None:
            fds.append(self._wake_r)
        if fds:
            select.select(fds, [], [], timeout)
        else:
            time.sleep(timeout)
        if self._wake_r is not None:
            with contextlib.suppress(BlockingIOError, OSError):
                while os.read(self._wake_r, 512):
                    pass

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signals += 1
        sig = signal.Signals(signum).name
        if self._signals == 1:
            self.say(f"{sig}: asking {len(self._active)} job(s) to checkpoint and stop; "
                     "no new jobs start (send it again to stop them at once)")  # fmt: skip
        else:
            self.say(f"{sig} again: stopping jobs now")
        for active in self._active.values():
            active.proc.terminate()

    def _install_signals(self) -> dict[int, Any]:
        previous: dict[int, Any] = {}
        try:
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            previous[-1] = signal.set_wakeup_fd(w)
            self._wake_r = r
        except (ValueError, OSError):  # not the main thread
            return previous
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            if signal.getsignal(sig) is signal.SIG_IGN:
                continue  # nohup (or a parent) ignores it: a logout must not end the night
            previous[sig] = signal.signal(sig, self._on_signal)
        return previous

    def _restore_signals(self, previous: dict[int, Any]) -> None:
        for sig, handler in previous.items():
            if sig == -1:
                signal.set_wakeup_fd(handler)
            else:
                signal.signal(sig, handler)
        if self._wake_r is not None:
            os.close(self._wake_r)
            self._wake_r = None

    def _summary(self) -> None:
        by_status = Counter(self._outcomes.values())
        counts = ", ".join(f"{n} {s}" for s, n in sorted(by_status.items())) or "no jobs run"
        if self.preemptions:
            counts += f"; {len(self.preemptions)} backfill preemption(s)"
        left = len(self.db.jobs(CLAIMABLE))
        text = f"runner {self.runner_id} done: {counts}; {left} job(s) waiting"
        if self.gaps:
            text += (f"; job-to-job gap median {statistics.median(self.gaps) * 1000:.0f} ms, "
                     f"max {max(self.gaps) * 1000:.0f} ms over {len(self.gaps)}")  # fmt: skip
        self.say(text)
        if self.notify:
            from nanolab.notify import send

            fields = {
                "queue": str(self.db.path), "summary": counts, "waiting": left,
                "reason": "stopped" if self._signals else "drained",
                **{s: by_status[s] for s in ("done", "failed", "stopped", "preempted")},
            }  # fmt: skip
            send(
                self.notify, fields, f"nanolab queue {fields['reason']}", f"{text} ({self.db.path})"
            )


def job_log_path(job: Job, db_path: Path) -> Path:
    """Where a job's console output goes: ``queue.log`` in its own run directory (every
    attempt appended, each under a header line), beside the run's other files; where that
    folder cannot be made, ``nanolab_queue_logs/<id>-<name>.log`` beside the database."""
    from nanolab.runlog import QUEUE_LOG_NAME

    run_dir = job.run_path
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        return run_dir / QUEUE_LOG_NAME
    except OSError:
        return spare_log_path(job, db_path)


def spare_log_path(job: Job, db_path: Path) -> Path:
    """``nanolab_queue_logs/<id>-<name>.log`` beside the database: a job's console log where its
    run directory cannot hold one (made, if need be)."""
    folder = db_path.resolve().parent / "nanolab_queue_logs"
    folder.mkdir(exist_ok=True)
    return folder / f"{job.id:04d}-{job.name}.log"


def open_job_log(job: Job, path: Path, db_path: Path) -> tuple[IO[bytes], Path, str | None]:
    """The job's console log at ``path`` opened to append and to read (its error line is read
    through this handle when the job exits, which still finds the file after the run directory
    was moved or deleted meanwhile), the path it is at, and the line to say when that is not
    ``path``. Only a file of its own is written (:func:`~nanolab.runlog.open_own_file`): a
    ``queue.log`` that is a link (to another run's ``metrics.jsonl``, say), or one in a run
    directory that is itself a link (:func:`open_in_own_folder`), is left as it is and the
    output goes to :func:`spare_log_path`. An ``OSError`` naming the file when that one is a
    link too, or neither can be opened."""
    from nanolab.runlog import LinkedFileError, open_own_file

    flags = os.O_RDWR | os.O_APPEND | os.O_CREAT
    moved = None
    try:
        fd = open_in_own_folder(path, flags)
    except LinkedFileError as err:
        spare = spare_log_path(job, db_path)
        if spare == path:  # already the spare one: no other place to go
            raise OSError(errno.ELOOP, f"it {err}", str(path)) from None
        moved = (
            f"job {job.id} {job.name}: its log {path} {err}, left as it is (a job writes only a "
            f"log of its own); its output goes to {spare}"
        )
        path = spare
        try:
            fd = open_own_file(path, flags)
        except LinkedFileError as again:
            raise OSError(errno.ELOOP, f"it {again}", str(path)) from None
    return open(fd, "a+b"), path, moved  # closed when the job exits


def open_in_own_folder(path: Path, flags: int) -> int:
    """:func:`~nanolab.runlog.open_own_file` of ``path``, its folder opened without following
    a link as well: a run directory that is itself a symbolic link (to another run's folder,
    say) would take the job's log into the folder it points to. Raises
    :class:`~nanolab.runlog.LinkedFileError` for a link in either place, with nothing written."""
    from nanolab.runlog import LinkedFileError, open_own_file

    no_follow = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        folder = os.open(path.parent, no_follow)
    except OSError as err:
        if err.errno not in (errno.ELOOP, errno.ENOTDIR) or not path.parent.is_symlink():
            raise
        target = os.readlink(path.parent)
        raise LinkedFileError(
            f"is in a run directory that is a link ({path.parent} -> {target})"
        ) from None
    try:
        return open_own_file(path.name, flags, dir_fd=folder)
    finally:
        os.close(folder)


#: What a ``queue run --notify`` command can fill in.
QUEUE_FIELDS = ("queue", "summary", "waiting", "reason", "done", "failed", "stopped", "preempted")


@dataclass
class Plan:
    """Which claimable jobs to start now, on which units; which wait for the deadline; which can
    never run here."""

    start: list[tuple[Job, list[int], float | None]] = field(default_factory=list)
    deferred: list[tuple[Job, float | None]] = field(default_factory=list)
    impossible: list[tuple[Job, int]] = field(default_factory=list)


def order_jobs(jobs: list[tuple[Job, float | None]], order: str) -> list[tuple[Job, float | None]]:
    """``fifo``: as added. ``longest-first``: by remaining estimate, unknown ones last."""
    if order == "longest-first":
        return sorted(jobs, key=lambda js: (js[1] is None, -(js[1] or 0.0), js[0].id))
    return sorted(jobs, key=lambda js: js[0].id)


def plan_starts(
    jobs: list[tuple[Job, float | None]],
    free: list[int],
    total_units: int,
    until: float | None,
    now: float,
    gpus: bool,
) -> Plan:
    """Assign free units to jobs in order. A job needs ``devices`` GPUs (one CPU slot without
    GPUs); one that does not fit the free units now waits (later jobs may use them); one that
    would end after ``until``, or has no estimate to judge it by, is deferred
    (:func:`nanolab.queue.packing.held_by_deadline`)."""
    plan = Plan()
    free = list(free)
    for job, remaining in jobs:
        need = max(1, job.devices) if gpus else 1
        if need > total_units:
            plan.impossible.append((job, need))
            continue
        if held_by_deadline(until, now, remaining):
            plan.deferred.append((job, remaining))
            continue
        if need > len(free):
            continue
        plan.start.append((job, free[:need], remaining))
        free = free[need:]
    return plan


def run_log_size(job: Job) -> int | None:
    """The size of ``job``'s run log now (0: none yet; None: it cannot be read)."""
    from nanolab.runlog import RUN_LOG_NAME

    try:
        return os.stat(Path(job.cwd) / job.run_dir / RUN_LOG_NAME).st_size
    except FileNotFoundError:
        return 0
    except OSError:
        return None


def log_columns(job: Job, status: str) -> dict[str, Any]:
    """What is stored of a job's run log as its attempt ends, so that ``queue ls`` need not
    read the log back (:data:`nanolab.queue.db.LOG_COLUMNS`): its size now and, for a done
    job, its steady step time (read once here, from the log's end:
    :func:`~nanolab.queue.predict.ended_step_seconds`; 0 when none could be measured)."""
    from nanolab.queue.predict import ended_step_seconds

    columns: dict[str, Any] = {"log_end": run_log_size(job)}
    if status == "done":
        columns["steady_s"] = ended_step_seconds(job) or 0.0
    return columns


def outcome(
    job: Job, code: int, since: float, stopping: bool = False, log: IO[bytes] | None = None
) -> tuple[str, str | None]:
    """(status, detail) of a job attempt from its exit code and its run log's ``end`` record,
    else its console log's error line (``log``: the runner's open handle on it, else
    ``job.log``'s path)."""
    from nanolab.runlog import RUN_LOG_NAME, last_record

    end = last_record(
        job.run_path / RUN_LOG_NAME,
        "end",
        where=lambda r: float(r.get("time") or 0) >= since - 1.0,
    )
    reason = (end or {}).get("reason")
    # The end record comes after the final checkpoint: a run that wrote one finished, even if
    # a signal (the runner stopping) reached it during its teardown.
    finished = code == 0 or (code < 0 and reason is not None)
    if finished and reason in (None, "completed"):
        return "done", None
    if finished and reason in ("budget", "plateau"):
        return "stopped", str(reason)
    if code == EXIT_PREEMPTED or reason == "preempted":
        step = (end or {}).get("step")
        return "preempted", "interrupted" + (f" at step {step}" if step is not None else "")
    if code == EXIT_DIVERGED or reason == "diverged":
        step = (end or {}).get("diverged_step", (end or {}).get("step"))
        cause = " (fp16 loss scale collapsed)" if (end or {}).get("skipped_steps") else ""
        return "failed", "diverged" + (f" at step {step}" if step is not None else "") + cause
    if code == EXIT_DISK_FULL:
        return "failed", out_of_room_detail((end or {}).get("error"), log or job.log)
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else code
        if stopping:
            return "preempted", f"stopped with the runner ({name})"
        return "failed", how_it_ended(code)
    error = (end or {}).get("error")
    if error:
        return "failed", _last_line(str(error))
    return "failed", error_from_log(log or job.log) or f"exited {code} without an error line"


#: The verb's prefix on a console error line (``nanolab fit: error: ``), left out of a label.
_VERB_ERROR_PREFIX = re.compile(r"^nanolab [\w-]+: error: ")


def out_of_room_detail(error: Any, log: str | IO[bytes] | None) -> str:
    """The label of an attempt that exited :data:`EXIT_DISK_FULL`: "out of room" and the line
    that says which room, from its end record's error or else its console log (a run log that
    could not be appended to has no end record). Exit 74 is a full disk, a quota or a file-size
    limit (``ulimit -f``), each with its own fix, so the label names none of them itself."""
    line = _last_line(str(error)) if error else error_from_log(log)
    if not line:
        return "out of room: a full disk, a quota or a file-size limit (the job's log says which)"
    return f"out of room: {_VERB_ERROR_PREFIX.sub('', line)}"


def is_the_jobs_own(err: OSError, job: Job) -> bool:
    """Whether a failed start is the job's own fault, so starting it again fails the same way:
    its folder (the child's ``chdir``) is gone or unusable, or its arguments are too long for
    the system. Other causes (EAGAIN from a full process table, ENOMEM, the runner's Python
    gone) are the machine's and pass."""
    return err.filename == job.cwd or err.errno == errno.E2BIG


def is_out_of_memory(detail: str | None) -> bool:
    """Whether a failed attempt's error line is an allocator's out-of-memory error (PyTorch's
    ``OutOfMemoryError``: "CUDA out of memory", "HIP out of memory")."""
    text = (detail or "").lower()
    return "outofmemoryerror" in text or " out of memory" in text


#: The child program that prints the total memory of the one GPU it sees, in bytes.
GPU_MEMORY_PROGRAM = "import torch; print(torch.cuda.get_device_properties(0).total_memory)"


GPU_NAME_PROGRAM = "import torch; print(torch.cuda.get_device_name(0))"


def ask_one_gpu(device_id: str, program: str, timeout: float) -> subprocess.CompletedProcess:
    """Run ``program`` (Python code) in a child process that sees only GPU ``device_id``, so the
    runner itself never creates a CUDA context (which would take memory from the jobs); its
    output as text. Raises what :func:`subprocess.run` raises (a missing interpreter, a
    child that does not answer within ``timeout`` seconds: a hung driver)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=device_id, HIP_VISIBLE_DEVICES=device_id)
    return subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=timeout
    )


def gpu_device_name(
    device_id: str, timeout: float = 60.0, program: str = GPU_NAME_PROGRAM
) -> str | None:
    """The driver's name of GPU ``device_id`` (``NVIDIA H200``), asked in a child process that
    sees only it, as :func:`gpu_total_memory` asks (no CUDA context in the runner); None when
    it cannot be told (the job then stays untimed). ``program``: the child's code (a CPU test
    runs this function with its own)."""
    try:
        res = ask_one_gpu(device_id, program, timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    name = res.stdout.strip()
    return name if res.returncode == 0 and name and "\n" not in name else None


def gpu_total_memory(
    device_id: str, timeout: float = 120.0, program: str = GPU_MEMORY_PROGRAM
) -> int:
    """Bytes of GPU ``device_id`` as the driver reports them, asked in a child process so the
    runner itself never creates a CUDA context (which would take memory from the jobs).

    ``program``: the child's Python code, which sees only ``device_id`` (a CPU test runs this
    function with its own). A child that fails, prints no number or does not answer within
    ``timeout`` seconds (a hung driver) is one :class:`QueueError` naming the fix."""
    try:
        res = ask_one_gpu(device_id, program, timeout)
    except subprocess.TimeoutExpired:
        last = f"timed out after {timeout:g} s"
    else:
        if res.returncode == 0 and res.stdout.strip().isdigit():
            return int(res.stdout.strip())
        last = (res.stderr.strip().splitlines() or ["no output"])[-1]
    raise QueueError(
        f"--pack: GPU {device_id}'s memory could not be read ({last[:200]}); pass "
        "--device-mem SIZE (e.g. 141GiB)"
    )


#: The longest error line kept for a failed job, in characters: the line is kept whole (its end
#: is the fix, which ``queue ls`` must show); this bounds only an absurd one (a tensor printed
#: into the message), so one bad job cannot swell the database and every listing.
ERROR_LINE_MAX = 4096


#: How the runner's header line of each attempt in a job's log begins (:meth:`Runner._spawn`).
ATTEMPT_HEADER = "=== attempt "


def error_from_log(log: str | IO[bytes] | None, tail_bytes: int = 16384) -> str | None:
    """The most telling line at the end of a job's log: an ``error:`` line or the exception,
    else the last line the attempt printed; None when the last attempt printed nothing.

    Only the last attempt's lines count: the runner's header that opens it is not the job's
    error (a job that exited without a word was labelled with its own command line), and an
    earlier attempt's error is not this one's.

    ``log``: its path, or a handle open for reading on it. A run whose directory was moved (or
    deleted) while it ran took its log along: only a handle opened before still reads it."""
    if isinstance(log, str):
        if not os.path.isfile(log):
            return None
        with open(log, "rb") as f:
            return error_from_log(f, tail_bytes)
    if log is None or not stat.S_ISREG(os.fstat(log.fileno()).st_mode):
        return None  # a fifo or a device in its place: nothing to read back
    log.seek(max(0, os.fstat(log.fileno()).st_size - tail_bytes))
    lines = [ln.strip() for ln in log.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    headers = [i for i, line in enumerate(lines) if line.startswith(ATTEMPT_HEADER)]
    lines = lines[headers[-1] + 1 :] if headers else lines
    for line in reversed(lines):
        if "error:" in line.lower() or line.split(":", 1)[0].endswith(("Error", "Exception")):
            return line[:ERROR_LINE_MAX]
    return lines[-1][:ERROR_LINE_MAX] if lines else None


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:ERROR_LINE_MAX] if lines else text[:ERROR_LINE_MAX]


# -- orphans and parent-death signals ----------------------------------------------------------
_HAS_PDEATHSIG = sys.platform.startswith("linux")
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int):
    """``preexec_fn``: SIGTERM this job when the runner dies (Linux), so it checkpoints and exits
    instead of training on unsupervised while a new runner resumes it elsewhere."""

    def set_signal() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the runner died between fork and prctl
            os.kill(os.getpid(), signal.SIGTERM)

    return set_signal


def _owner_runs(owner: dict[str, Any]) -> bool:
    """Whether a gone runner's process still runs here (a hung or stopping runner), judged by
    its recorded start where it has one: a reused pid is not the runner."""
    known = runner_process(owner)
    return known if known is not None else pid_alive(int(owner["pid"]))


def _is_job_process(pid: int, name: str) -> bool:
    """Whether ``pid`` is still the ``nanolab fit`` process of job ``name`` (pids get reused)."""
    if not pid_alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().decode("utf-8", "replace").split("\0")
    except OSError:
        return True  # no /proc: trust the pid
    return f"--run.name={name}" in args
