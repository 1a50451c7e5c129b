"""How long a queued job will take: from past runs of the same config, else from its FLOPs.

``--until 08:00`` defers jobs that cannot finish in time and ``--order longest-first`` starts the
long ones first, so both need a duration per job. In order of trust:

1. **History**: finished jobs with the same config (seeds of one experiment, same config key):
   their own steady wall seconds per step from their run logs, over the launches each job ran
   of that config that ended, on the device asked about (:class:`Counted`; evaluations
   included, start-up added once), else their whole wall time per step. ``queue add`` uses it too, and then does
   not probe the CPU at all.
2. **FLOPs**: ``flops_per_token x tokens`` over the device's throughput. On GPUs the estimator
   (:mod:`nanolab.estimator`) does this with its peak table at an assumed MFU; on CPU there is no
   datasheet peak, so this machine's FP32 matmul rate is measured (0.2 s, at ``queue add``)
   and :data:`CPU_EFFICIENCY` of it is assumed. Both count each step's fixed host work
   (:func:`nanolab.estimator.cpu.host_floor_seconds`) and add :data:`STARTUP_S` for importing
   torch/Lightning and building the model.

A resumed job needs only what is left: the estimate is scaled by the steps its run log has not
reached yet. A job only hours or a cost end stores no step count: once it has trained, what is
left is what its budget still pays for at the step time of its own launch, read from the end of
its run log (:func:`measured_course`: ``queue ls`` asks at every call, so this read does not
grow with the log).

``queue run --pack`` also needs each job's memory on its device: :func:`memory_need` asks the
memory estimator at ``queue add`` (the one place the queue calls it, so an estimator API change
is adapted here), and :func:`job_peak` prefers the peak a finished job of the same config
measured.
"""

from __future__ import annotations

import contextlib
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanolab.estimator.runtime import (  # noqa: F401  (estimator_gpu: public here too)
    STARTUP_S,
    VOCAB_GUESS,
    as_estimator_config,
    estimator_gpu,
    run_seconds,
)
from nanolab.queue.db import Job, QueueDB

if TYPE_CHECKING:
    from nanolab.estimator.gpus import GPU
from nanolab.queue.jobs import ParsedConfig

#: Steps a job only an hour or cost limit ends is timed over, for its step time.
PROBE_STEPS = 1000


def flops_estimate(parsed: ParsedConfig, gpu: str | None = None) -> tuple[float | None, str | None]:
    """(seconds, how it was estimated) for a parsed job config; (None, why not) if impossible.
    A job a budget's hours or cost may stop sooner is timed for the steps it allows at the
    estimated step time (:meth:`ParsedConfig.steps_at`), as ``nanolab estimate`` does."""
    timed = parsed.max_steps or PROBE_STEPS
    seconds, how = run_seconds(
        parsed.config,
        devices=parsed.devices,
        tokens_per_step=parsed.tokens_per_step,
        max_steps=timed,
        gpu=gpu,
        remembered_cpu=True,
    )
    if seconds is None:
        return seconds, how
    per_step = (seconds - STARTUP_S) / timed
    return STARTUP_S + per_step * parsed.steps_at(per_step), how


#: How many of a config's newest finished jobs its step time is taken from: enough for a
#: median, and a bound on the logs read (a night's queue asks for it for every waiting job).
HISTORY_RUNS = 8

#: Each finished run log's steady step time, by (path, size, mtime) and what it was asked
#: for: a finished log does not change, and the runner asks again at every fill.
_STEADY: dict[tuple[Any, ...], float | None] = {}


@dataclass(frozen=True)
class Counted:
    """Which launches of a finished job's run log its step time is measured over: the ones
    that trained the prediction's work where the prediction is for. A run log also holds
    launches that did not (a ``nanolab fit`` from a shell, a run continued under another
    config, a launch on another machine's GPU) and launches that crashed (their time, start-up
    and lost steps, is no step time); taken as one span, from the log's first train record to
    its last, those were all averaged in.

    Attributes:
        config_key: The launch's start record's config has this key (:func:`config_key`:
            the same model, data and batch). None: any config.
        job_id, created: The launch was started by this queue job (the start record's
            ``queue_job``) after it was added, as :func:`launched_by` reads a launch. None:
            any.
        gpu: The device the prediction is for (``queue add --gpu``): the launch ran on it
            (:func:`nanolab.estimator.history.ran_on`, the estimator's own rule for a past
            run). None: the devices the run's newest counted launch ran on (one run's
            launches on two machines are not mixed).
    """

    config_key: str | None = None
    job_id: int | None = None
    created: float | None = None
    gpu: GPU | None = None

    def counts(self, start: dict[str, Any]) -> bool:
        """Whether the launch of this start record is one to measure (devices aside)."""
        if self.job_id is not None and not _started_by(start, self.job_id, self.created or 0.0):
            return False
        if self.config_key is None:
            return True
        from nanolab.queue.jobs import config_key

        config = start.get("config")
        return isinstance(config, dict) and config_key(config) == self.config_key


def _started_by(start: dict[str, Any], job_id: int, created: float) -> bool:
    """Whether the launch of ``start`` is one of job ``job_id``'s: the start record names the
    job (its ``queue_job``, set by the runner) and began after the job was added (another
    queue's job of the same id, earlier, is not this one)."""
    began = start.get("time")
    return (
        str(start.get("queue_job")) == str(job_id)
        and isinstance(began, int | float)
        and began >= created
    )


def _timed(r: dict[str, Any]) -> bool:
    step, elapsed = r.get("step"), r.get("elapsed_s")
    return (
        isinstance(step, int)
        and not isinstance(step, bool)
        and isinstance(elapsed, (int, float))
        and not isinstance(elapsed, bool)
    )


def steady_step_seconds(run_dir: str, counted: Counted | None = None) -> float | None:
    """A finished run's own steady wall seconds per step over the launches ``counted`` keeps
    (all that ended, without it): each launch's steps from its first logged train record to
    its end record over the elapsed time between them (start-up and the first, compiling step
    left out; the validations in between counted, as a job will run them too), summed over
    the launches. A launch with no end record crashed: its steps are trained again by the next
    one, and its time is left out. None: no such launch.

    One read of the log, parsing only its start and end records and the first train record
    after each counted start; remembered per log file and question."""
    from nanolab.runlog import RUN_LOG_NAME, event_marks, iter_numbered

    counted = counted or Counted()
    path = os.path.join(run_dir, RUN_LOG_NAME)
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (path, st.st_size, st.st_mtime_ns, counted)
    if key in _STEADY:
        return _STEADY[key]
    bounds = event_marks(("start", "end"))
    train = event_marks("train")
    first: dict[str, Any] | None = None  # the current counted launch's first timed train
    launch: dict[str, Any] | None = None  # its start record, until its first train and end
    waiting = False  # a counted launch has logged no timed train record yet

    def wanted(line: str) -> bool:
        return any(m in line for m in bounds) or (waiting and any(m in line for m in train))

    spans: list[tuple[tuple[Any, ...], float, int]] = []  # (devices, seconds, steps)
    for _, r in iter_numbered(path, containing=wanted):
        event = r.get("event")
        if event == "start":
            launch = r if counted.counts(r) else None
            first, waiting = None, launch is not None
        elif event == "train" and waiting and _timed(r) and r["step"] > 0:
            first, waiting = r, False
        elif event == "end" and launch is not None and first is not None and _timed(r):
            steps = r["step"] - first["step"]
            seconds = float(r["elapsed_s"]) - float(first["elapsed_s"])
            if steps > 0 and seconds > 0:
                spans.append((_devices(launch), seconds, steps))
            launch, first, waiting = None, None, False
    value = None
    if spans:
        device = counted.gpu
        if device is None:
            keep = spans[-1][0]
            spans = [s for s in spans if s[0] == keep]
        else:
            from nanolab.estimator.history import ran_on

            spans = [s for s in spans if ran_on(list(s[0]), device)]
        if spans:
            value = sum(s[1] for s in spans) / sum(s[2] for s in spans)
    _STEADY[key] = value
    return value


def _devices(start: dict[str, Any]) -> tuple[Any, ...]:
    """The device names a launch's start record lists (empty: not logged)."""
    names = start.get("devices")
    return tuple(str(n) for n in names) if isinstance(names, list) else ()


def history(
    db: QueueDB, key: str | None, exclude: int | None = None, gpu: str | None = None
) -> tuple[float, str] | None:
    """(seconds per step, how) from the newest finished jobs of the same config
    (:data:`HISTORY_RUNS`): the median of their own steady step times when their logs have
    them (over their own launches of this config, on ``gpu`` when given: :class:`Counted`),
    else their mean wall seconds per step; None without such a job (then a FLOP count over a
    probed or tabled rate is all there is). With ``gpu`` the jobs' wall times, which do not say
    where they ran, are not used."""
    if key is None:
        return None
    device = None
    if gpu is not None:
        from nanolab.estimator.gpus import get_gpu

        try:
            device = get_gpu(gpu)
        except Exception:  # `queue add --gpu` refused it already: nothing is known to run there
            return None
    rows = db.conn.execute(
        "SELECT * FROM jobs WHERE config_key = ? AND "
        "status = 'done' AND run_seconds > 0 AND max_steps > 0 AND id != ? "
        "ORDER BY id DESC LIMIT ?",
        (key, -1 if exclude is None else exclude, HISTORY_RUNS),
    ).fetchall()
    steady = [v for v in (_steady(r, key, device) for r in rows) if v is not None]
    if steady:
        n = len(steady)
        return statistics.median(
            steady
        ), f"measured step time of {n} past run{'s' * (n > 1)} of this config"
    if rows and gpu is None:
        return statistics.fmean(
            r["run_seconds"] / r["max_steps"] for r in rows
        ), "past runs of this config"
    return None


def _steady(row: Any, key: str, device: GPU | None) -> float | None:
    """A done job's steady step time: the one stored as it ended (``steady_s``, 0: none) where
    it answers the question (no device asked), else read from its run log."""
    stored = dict(row).get("steady_s")
    if device is None and stored is not None:
        return float(stored) or None
    run_dir = os.path.join(row["cwd"], row["run_dir"])  # a relative one is the job's cwd's
    return steady_step_seconds(run_dir, Counted(key, row["id"], row["created"], device))


def history_seconds_per_step(db: QueueDB, job: Job) -> float | None:
    """Seconds per step of finished jobs with the same config (None: no history)."""
    found = history(db, job.config_key, job.id)
    return found[0] if found else None


def job_estimate(
    db: QueueDB | None, parsed: ParsedConfig, gpu: str | None = None
) -> tuple[float | None, str | None]:
    """(seconds, how) for a job being added: its config's own measured step time when the
    queue has run it before (no probe then), else :func:`flops_estimate`. ``db`` None: no
    queue database yet, so no history."""
    from nanolab.queue.jobs import config_key

    found = history(db, config_key(parsed.config), gpu=gpu) if db is not None else None
    if found is not None:
        per_step, how = found
        return STARTUP_S + per_step * parsed.steps_at(per_step), how
    return flops_estimate(parsed, gpu)


def steps_done(job: Job) -> int:
    """Optimizer steps the job's run log has reached (0 for a job that never ran)."""
    from nanolab.runlog import RUN_LOG_NAME, last_record

    rec = last_record(job.run_path / RUN_LOG_NAME, where=lambda r: "step" in r)
    step = (rec or {}).get("step")
    return int(step) if isinstance(step, int) else 0


#: Records read back from a run log's end, at most, for the step time of a job's launch: what
#: ``queue ls`` and ``status`` pay per job whatever the log's length (a night's log is
#: hundreds of thousands of records, and the running one is read again at every call).
TAIL_RECORDS = 2000

#: Train records a step-time window with validations in it spans, at least, before it may end
#: at one: long enough to average over, and no longer than needed.
TAIL_MIN_STEPS = 100


@dataclass(frozen=True)
class Tail:
    """What the end of a run log says of the newest launch with a measurable step time.

    Attributes:
        step_s: Steady seconds a step (start-up and the first, compiling step left out; the
            validations in between counted). None: no launch among the records read logged
            two timed steps.
        newest: The log's newest timed train record: the run's spend so far.
        starts_passed: Start records between the window and the log's end: 0, the window is
            the log's newest launch.
        launch: The window's launch's start record, when it was among the records read.
        own: The job's newest start record among the records read.
        before_job: A record read was written before the job was added: no record above it
            is the job's (a log is written in time order), its start record included.
    """

    step_s: float | None
    newest: dict[str, Any] | None
    starts_passed: int
    launch: dict[str, Any] | None
    own: dict[str, Any] | None
    before_job: bool = False


def read_tail(log: Path, job: Job) -> Tail:
    """The step time of the newest launch of ``log`` that logged two timed train records,
    read backwards from the end over at most :data:`TAIL_RECORDS` records (so its cost does
    not grow with the log). A launch of another's (a ``nanolab fit`` from a shell) is passed
    over for the one before it.

    Where training validated, the window runs from the first train record after one
    validation to the first after the newest, :data:`TAIL_MIN_STEPS` records at least: whole
    evaluation intervals, each with its validation's time, as the job will spend it. Else it
    runs from the launch's first train record (or the oldest the bound reaches) to its newest.
    """
    from nanolab.runlog import iter_backwards, written_in_training

    newest: dict[str, Any] | None = None
    top: dict[str, Any] | None = None  # the launch's newest timed train record
    last: dict[str, Any] | None = None  # the window's newest: the first after a validation
    first: dict[str, Any] | None = None  # the window's oldest, so far
    held = vals = passed = 0
    own: dict[str, Any] | None = None
    oldest = float("inf")  # the oldest record's time among those read

    def pace() -> float | None:
        for older, newer in ((first, last), (first, top)):
            if older is not None and newer is not None:
                steps = newer["step"] - older["step"]
                seconds = float(newer["elapsed_s"]) - float(older["elapsed_s"])
                if steps > 0 and seconds > 0:
                    return seconds / steps
        return None

    with contextlib.closing(iter_backwards(log, ("start", "train", "val"))) as records:
        for read, r in enumerate(records, 1):
            event = r.get("event")
            written = r.get("time")
            if isinstance(written, int | float) and not isinstance(written, bool):
                oldest = min(oldest, written)
            if event == "start":
                mine = _started_by(r, job.id, job.created)
                own = own or (r if mine else None)
                if mine and (step_s := pace()) is not None:
                    return Tail(step_s, newest, passed, r, own)
                top = last = first = None
                held = vals = 0
                passed += 1
            elif event == "train" and _timed(r) and r["step"] > 0:
                newest, top, last, first = newest or r, top or r, last or r, r
                held += 1
            elif event == "val" and top is not None and written_in_training(r):
                if not vals:  # the window ends where the newest whole interval does
                    last, held = first, 1
                elif held >= TAIL_MIN_STEPS:
                    break
                vals += 1
            if read >= TAIL_RECORDS:
                break
    return Tail(pace(), newest, passed, None, own, oldest < job.created)


def ended_step_seconds(job: Job) -> float | None:
    """A job's steady seconds a step as its attempt ends, which the runner stores
    (``steady_s``): that of its newest launch that logged two timed steps, read from the end
    of its run log as :func:`read_tail` reads it, so its cost does not grow with the log (the
    runner's loop waits on it; a night's log is 100 MB). None: no step time of the job's own
    among the records read."""
    from nanolab.runlog import RUN_LOG_NAME

    log = Path(job.cwd) / job.run_dir / RUN_LOG_NAME
    tail = read_tail(log, job)
    if tail.step_s is None or not _measured_is_own(log, job, tail):
        return None
    return tail.step_s


def _nth_start(log: Path, nth: int) -> dict[str, Any] | None:
    """The log's ``nth`` newest start record (0: the newest), read backwards at the speed of
    reading the file: only lines holding a start are parsed (:func:`~nanolab.runlog.iter_backwards`)."""
    from nanolab.runlog import iter_backwards

    with contextlib.closing(iter_backwards(log, "start")) as starts:
        for i, start in enumerate(starts):
            if i == nth:
                return start
    return None


#: Bytes read forward from where a job's launch began (``log_start``) for its start record:
#: the first record a launch writes, a few kB with its config.
LAUNCH_HEAD_BYTES = 256 << 10


def _launch_at_start(log: Path, job: Job) -> dict[str, Any] | None:
    """The start record of the job's newest launch, read where the runner recorded its run log
    ended before the launch (``log_start``), a few lines, however long the launch's records
    run after it; None where it is not there (no offset recorded, the log rewritten since, or
    another launch's record): then the log is read back for it."""
    from nanolab.runlog import _parse

    if job.log_start is None:
        return None
    try:
        with open(log, "rb") as f:
            f.seek(job.log_start)
            head = f.read(LAUNCH_HEAD_BYTES)
    except OSError:
        return None
    if job.log_start and not head.lstrip(b"\r\n").startswith(b"{"):  # mid-line: rewritten
        return None
    for line in head.split(b"\n")[:-1]:
        record = _parse(line.decode("utf-8", errors="replace"))
        if record is not None and record.get("event") == "start":
            return record if _started_by(record, job.id, job.created) else None
    return None


def _newest_launch(log: Path, job: Job) -> dict[str, Any] | None:
    """The start record of the job's newest launch when that launch is the log's newest
    (nothing was appended since it ended, or it is running: the run is its own while it holds
    the run's lock), read without reading the launch's records; else None."""
    try:
        size = log.stat().st_size
    except OSError:
        return None
    if job.status != "running" and (job.log_end is None or size != job.log_end):
        return None
    return _launch_at_start(log, job)


def _job_start(log: Path, job: Job, tail: Tail) -> dict[str, Any] | None:
    """A start record of one of the job's launches: its config and batch are the job's (every
    launch of a job runs the config checked at ``queue add``: the runner refuses an edited
    one). The one the tail read, else the log's first record when the job began the run (one
    line read), else the job's newest, found backwards at the speed of reading the file, back
    to the first record older than the job (none: the job has logged no launch yet)."""
    from nanolab.runlog import iter_records

    if tail.own is not None:
        return tail.own
    if (start := _launch_at_start(log, job)) is not None:
        return start
    with contextlib.closing(iter_records(log)) as records:
        top = next(records, None)
    if top is not None and top.get("event") == "start" and _started_by(top, job.id, job.created):
        return top
    if tail.before_job:
        return None
    from nanolab.runlog import iter_backwards

    with contextlib.closing(iter_backwards(log, "start")) as starts:
        for start in starts:
            if _started_by(start, job.id, job.created):
                return start
            began = start.get("time")
            if isinstance(began, int | float) and began < job.created:
                return None  # the starts above it are older still
    return None


def _measured_is_own(log: Path, job: Job, tail: Tail) -> bool:
    """Whether the launch ``tail`` measured is one of the job's. Its start record, when read;
    else a running job's newest launch is its own (a run holds one launch at a time), and
    otherwise the start records above the window are read back to it."""
    if tail.launch is not None:
        return _started_by(tail.launch, job.id, job.created)
    if tail.starts_passed == 0 and job.status == "running":
        return True
    if tail.starts_passed == 0 and _newest_launch(log, job) is not None:
        return True  # the window's launch is the log's newest, and that is the job's
    launch = _nth_start(log, tail.starts_passed)
    return launch is not None and _started_by(launch, job.id, job.created)


def measured_course(job: Job) -> tuple[int, int, float] | None:
    """(step reached, step the run ends at, measured seconds a step) of a job that only a
    budget's hours, GPU-hours or cost ends (no step count was stored at ``queue add``: it
    depends on the step time), from its run log: :func:`nanolab.runs.measured_course`, the
    rule ``status`` counts a run to, asked with the job's own config and batch (a start
    record of its own launches), the run's spend (its newest train record: a branch's own
    tokens, ``run_tokens``, as fit's budget counts them) and the step time of the job's
    newest launch that logged two timed steps. None: not such a job, no launch of its own
    logged yet (a run another launch began and the job continues), or no step time of its
    own among the records read.

    Its cost does not grow with the log: :func:`read_tail` parses at most
    :data:`TAIL_RECORDS` records from the end, and a start record beyond them is found by
    reading, not parsing, the lines above."""
    from nanolab.runlog import RUN_LOG_NAME
    from nanolab.runs import measured_course as course_of

    if job.max_steps or not job.attempts:
        return None
    log = Path(job.cwd) / job.run_dir / RUN_LOG_NAME
    tail = read_tail(log, job)
    last, step_s = tail.newest, tail.step_s
    if last is None or step_s is None:
        return None
    start = _job_start(log, job, tail)
    if start is None or not _measured_is_own(log, job, tail):
        return None
    course = course_of(start, last, step_s)
    if course is None:
        return None
    return int(last["step"]), course.end, step_s


def remaining_seconds(db: QueueDB, job: Job) -> tuple[float | None, str]:
    """Time the job still needs: history if any, else its stored estimate; scaled by progress.
    A job only hours or cost end has no stored step count: once it has trained, its time left
    is the steps the budget still pays for at its measured step time (:func:`measured_course`)."""
    course = measured_course(job)
    if course is not None:
        done, end, step_s = course
        startup = 0.0 if job.status == "running" else STARTUP_S  # a restart pays it again
        return startup + max(0, end - done) * step_s, "measured step time of this run"
    found = history(db, job.config_key, job.id)
    total = None
    source = job.estimate_source or "unknown"
    if found is not None and job.max_steps:
        per_step, source = found
        startup = STARTUP_S if source.startswith("measured") else 0.0  # wall/step includes it
        total = startup + per_step * job.max_steps
    elif job.estimate_s is not None:
        total = job.estimate_s
    if total is None:
        return None, source
    if job.max_steps and job.attempts:
        left = max(0.0, 1.0 - steps_done(job) / job.max_steps)
        total = STARTUP_S + (total - STARTUP_S) * left
    return total, source


def logged_time(job: Job, since: float | None = None) -> float | None:
    """The elapsed time the job's run log last recorded, over every attempt: the time
    ``report`` and ``status`` give the run. None when it has logged none, or when its newest
    time was written by a launch that is not one of this job's (:func:`launched_by`): a
    ``nanolab fit`` in a shell training the run while the job's own process was refused at
    once (the run directory in use) wrote a time that is not the job's, and it grows as that
    launch trains on. ``since``: a wall time; a last record older than it is None too (an
    attempt that failed before it logged would otherwise be given the time of the attempts
    before it)."""
    from nanolab.runlog import RUN_LOG_NAME, last_record

    log = Path(job.cwd) / job.run_dir / RUN_LOG_NAME
    if not log.is_file():
        return None
    record = last_record(log, where=lambda r: isinstance(r.get("elapsed_s"), int | float))
    if record is None:
        return None
    written = record.get("time")
    if not isinstance(written, int | float) or (since is not None and written < since):
        return None
    if not launched_by(job, log, written):
        return None
    return float(record["elapsed_s"])


def launched_by(job: Job, log: Path, at: float) -> bool:
    """Whether the launch that wrote the record of time ``at`` in the run log ``log`` is one of
    ``job``'s: the newest ``start`` record at or before ``at`` names the job (its
    ``queue_job``, set by the runner) and began after the job was added (another queue's job of
    the same id, earlier, is not this one). Reads back only to that start record."""
    from nanolab.runlog import iter_backwards

    newest = _newest_launch(log, job)
    began = (newest or {}).get("time")
    if isinstance(began, int | float) and began <= at:
        return True  # the log's newest launch is the job's, and it began before ``at``
    with contextlib.closing(iter_backwards(log, "start")) as starts:
        for start in starts:
            began = start.get("time")
            if isinstance(began, int | float) and began <= at:
                return _started_by(start, job.id, job.created)
    return False


def run_time(job: Job, now: float) -> float:
    """A job's time, one account with ``report`` and ``status``: its run log's elapsed time
    over every attempt, as its own launches logged it (the queue's own counter for a job
    that never logged, or whose run another launch is training)."""
    logged = logged_time(job)
    if logged is not None:
        return logged
    running = job.status == "running" and job.last_started
    return job.run_seconds + (now - job.last_started if running else 0)


def describe(seconds: float | None) -> str:
    """An estimate, as rough as it is (``~36s``, ``~4m``, ``~2.5h``); an elapsed time is
    :func:`nanolab.runs.duration`'s (``1m25s``), the same in every tool."""
    if seconds is None:
        return "?"
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 5400:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


# -- memory, for packing jobs onto one device ---------------------------------------------------


def memory_need(parsed: ParsedConfig, gpu: str | None = None) -> tuple[int | None, str]:
    """(predicted peak allocated bytes per device, how) for a job; (None, why not) if unknown.

    The estimator's peak is ``torch.cuda.max_memory_allocated`` of a training step, without its
    framework overhead and fragmentation lines: the packer adds its own (see
    :mod:`nanolab.queue.packing`). A ``micro_batch_size: auto`` job has no fixed peak (it sizes
    itself to the whole device), so it runs alone.
    """
    cfg = as_estimator_config(parsed.config, parsed.devices, for_memory=True)
    # run.micro_batch_size: null means data.micro_batch_size, an int overrides it, auto sizes
    # the micro-batch to the whole device at start-up.
    from nanolab.training.resolve import micro_batch_choice, sections

    micro = micro_batch_choice(cfg.get("run") or {}, sections(cfg)[3])
    if micro == "auto":
        return None, "run.micro_batch_size auto fills the device"
    backend = _memory_backend(cfg, gpu)
    try:
        from nanolab.estimator.estimate import setup_for
        from nanolab.estimator.memory import estimate_memory
        from nanolab.estimator.own_class import OtherNetworkError

        try:
            setup = setup_for(cfg, micro_batch_size=micro)
        except OtherNetworkError:
            raise  # the class's network: no guessed vocabulary changes that
        except Exception:  # unprepared data: the vocabulary is read from it at run time
            setup = setup_for(cfg, micro_batch_size=micro, vocab_size=VOCAB_GUESS)
        est = estimate_memory(setup, backend=backend, fragmentation=0.0)
    except Exception as err:  # the estimator cannot model this config: why (its first clause)
        return None, f"no memory estimate: {str(err).splitlines()[0].partition('; ')[0][:120]}"
    return est.peak_allocated, f"estimator ({backend}, {setup.precision}, micro-batch " + (
        f"{setup.micro_batch_size}, peak at {est.peak_phase})"
    )


def _memory_backend(cfg: dict, gpu: str | None) -> str:
    """``cpu`` for a CPU job, else the vendor's backend of ``gpu`` (CUDA when unknown)."""
    if str(cfg["trainer"].get("accelerator", "auto")) == "cpu":
        return "cpu"
    try:
        from nanolab.estimator.gpus import get_gpu

        return "rocm" if gpu and get_gpu(gpu).vendor == "amd" else "cuda"
    except Exception:
        return "cuda"


def process_overhead(backend: str) -> int:
    """Bytes one more process takes on a device outside its allocator: the estimator's
    framework line (context, kernels on GPUs; the process itself on a CPU)."""
    from nanolab.estimator.memory import CONTEXT_BYTES

    return int(CONTEXT_BYTES.get(backend, CONTEXT_BYTES["cuda"]))


def measured_peak(db: QueueDB, job: Job) -> tuple[int, str] | None:
    """The largest ``mem_reserved_bytes`` finished jobs of the same config recorded (GPU runs
    only; the allocator cap limits reserved memory, so this is the figure to cap by)."""
    if job.config_key is None:
        return None
    from nanolab.runlog import RUN_LOG_NAME, last_record

    rows = db.conn.execute(
        "SELECT name, cwd, run_dir FROM jobs WHERE config_key = ? AND status = 'done' "
        "AND id != ? ORDER BY id",
        (job.config_key, job.id),
    ).fetchall()
    best: tuple[int, str] | None = None
    for r in rows[-8:]:  # the newest few are enough, and reading logs costs
        # From the job's own folder (an older queue's run_dir is relative to it), as Job.run_path.
        rec = last_record(
            Path(r["cwd"]) / r["run_dir"] / RUN_LOG_NAME,
            where=lambda x: isinstance(x.get("mem_reserved_bytes"), int),
        )
        if rec and (best is None or rec["mem_reserved_bytes"] > best[0]):
            best = (int(rec["mem_reserved_bytes"]), f"measured by job {r['name']}")
    return best


def job_peak(db: QueueDB, job: Job) -> tuple[int | None, str | None]:
    """Peak bytes to pack ``job`` by: a finished same-config job's measurement, else the
    prediction stored at ``queue add`` (None: unknown, the job runs alone)."""
    return measured_peak(db, job) or (job.mem_peak, job.mem_source)
