"""``nanolab status``: one screen for a run root and its queue, from another shell.

What is running (step of max, loss, val, tokens/s, device memory and utilisation, the ETA from
its measured step time, how long since its last log line; a run silent for much longer than its
steps take is flagged *stalled*), what is queued (when it would start and end if the queue runs
one job at a time in its order), and what ended (its end reason and best validation loss).

It only reads: each run's ``metrics.jsonl``, from its end (the newest train records, and only
the lines of the sparse events over the whole log: :func:`nanolab.runs.summarize_tail`, the
figures ``report`` prints, without parsing a record per step), and the queue database opened
read-only (SQLite ``mode=ro``: it never locks a run or blocks the runner). A job's time is one
account everywhere: the run log's elapsed time over every attempt, the same figure ``report``
prints (the queue's own counter only for a job that never logged). ``--json`` prints the same
as data; ``--watch N`` redraws every N seconds until Ctrl-C, reading of each log only what it
gained since the redraw before. Plain text, no colours: it reads the same over SSH, in
``watch``, or piped into a file.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from nanolab.errors import NanolabError, one_line_errors
from nanolab.helpfmt import OneLineParser, given_path, relative_path_without_working_directory
from nanolab.runlog import RUN_LOG_NAME
from nanolab.runs import (
    FollowedRuns,
    check_root,
    discover_runs,
    duration,
    expected_end_of,
    measured_course,
    measured_pace,
    num,
    recent_mean,
    summarize_tail,
)
from nanolab.tables import table

#: A running run is *stalled* when its last log line is older than this many step times (and
#: at least STALL_MIN_S): a hung collective, a dead data loader, a full disk in a retry loop.
STALL_FACTOR = 20
STALL_MIN_S = 120.0


class StatusError(NanolabError):
    """A folder or queue that cannot be read; the message names it."""


@dataclass
class RunLine:
    """One run as the screen shows it."""

    run: str
    status: str
    step: int | None = None
    max_steps: int | None = None  # the step its launch ends at (not only trainer.max_steps)
    end_estimated: bool = False  # max_steps is a time or cost limit's estimate: shown ~
    train_loss: float | None = None
    val_loss: float | None = None
    best_val_loss: float | None = None
    tokens_per_s: float | None = None
    mem_bytes: int | None = None
    gpu_util: float | None = None
    eta_s: float | None = None
    since_s: float | None = None  # seconds since the last log line
    stalled: bool = False
    wall_s: float | None = None
    detail: str | None = None
    run_dir: str = ""


@dataclass
class JobLine:
    """One queued job: when it would start and end if run one at a time in queue order."""

    id: int
    name: str
    status: str
    needs_s: float | None
    start_in_s: float | None
    end_in_s: float | None
    ran_s: float | None = None
    tries: int = 0
    run: str = ""  # its run directory's name
    run_dir: str = ""  # its run directory, absolute


@dataclass
class Screen:
    time: float
    running: list[RunLine] = field(default_factory=list)
    queued: list[JobLine] = field(default_factory=list)
    ended: list[RunLine] = field(default_factory=list)
    queue: str | None = None
    #: A line for each runner that keeps its jobs but has not beaten for a while (SIGSTOP?).
    silent_runners: list[str] = field(default_factory=list)


def run_line(name: str, run_dir: Path, now: float, followed: FollowedRuns | None = None) -> RunLine:
    """The screen's line of one run, from the end of its log (every redraw, every run: a
    whole log is never parsed, see :func:`summarize_tail`; ``followed``: read on from the
    redraw before)."""
    tail = summarize_tail(name, run_dir, now, followed)
    s, train, start = tail.summary, tail.train, tail.start or {}
    last = train[-1] if train else {}
    config = start.get("config") if isinstance(start.get("config"), dict) else {}
    # Where the launch ends: the first of trainer.max_steps and its budgets' stops (its start
    # record's expected_end; a time limit's is an estimate, shown ~), so a budget-bound run
    # counts to where it stops.
    max_steps, estimated = expected_end_of(start or None, config)
    line = RunLine(
        run=name,
        status=s.status,
        step=s.steps,
        max_steps=max_steps if max_steps > 0 else None,
        end_estimated=estimated,
        train_loss=s.train_loss,
        val_loss=s.final_val_loss,
        best_val_loss=s.best_val_loss,
        tokens_per_s=s.tokens_per_s,
        mem_bytes=int(v) if (v := num(last.get("mem_allocated_bytes"))) is not None else None,
        gpu_util=num(last.get("gpu_util")),
        since_s=None if s.updated is None else max(0.0, now - s.updated),
        wall_s=s.wall_s,
        detail=s.detail,
        run_dir=str(run_dir),
    )
    step_time = recent_mean(train, "step_time_s", n=20)
    deadline = None  # wall seconds a time or cost limit leaves, from now
    if estimated and s.status == "running":
        # The start record's end of a time or cost limit is the plan's guess at start-up: made
        # again from what the run has spent and its measured pace (the budget's own rule,
        # as the progress line makes it again), so the count and ETA follow the run.
        pace = measured_pace(train[-21:])
        course = measured_course(start or None, last or None, pace)
        if course is not None and pace is not None:
            line.max_steps, step_time = course.end, pace
            line.end_estimated = course.estimated
            if course.seconds_left is not None:
                deadline = max(0.0, course.seconds_left - (line.since_s or 0.0))
    if s.status == "running" and line.step is not None and line.max_steps and step_time:
        line.eta_s = max(0, line.max_steps - line.step) * step_time
        if deadline is not None:
            line.eta_s = min(line.eta_s, deadline)  # the limit stops it then, whatever the pace
    if s.status == "running" and line.since_s is not None:
        limit = max(STALL_MIN_S, STALL_FACTOR * (step_time or 0.0))
        line.stalled = line.since_s > limit
    return line


def job_roots(db_path: Path) -> set[Path]:
    """The folders the queue's waiting and running jobs will make: each job's run directory
    and the folders above it (``runs/`` before its first job starts, ``runs/pend`` of a job
    still pending), which ``status`` may be given before they exist."""
    with _waiting_jobs(db_path) as (_, jobs):
        run_dirs = [(Path(j.cwd) / j.run_dir).resolve() for j in jobs]
        return {folder for d in run_dirs for folder in (d, *d.parents)}


@contextlib.contextmanager
def _waiting_jobs(db_path: Path) -> Iterator[tuple[Any, list[Any]]]:
    """The queue at ``db_path``, read-only, with its running, pending and preempted jobs."""
    from nanolab.queue.db import UNFINISHED

    with _read_queue(db_path, UNFINISHED) as (db, jobs):
        yield db, jobs


@contextlib.contextmanager
def _read_queue(
    db_path: Path, statuses: tuple[str, ...] | None = None
) -> Iterator[tuple[Any, list[Any]]]:
    """The queue at ``db_path``, read-only, with its jobs of ``statuses`` (None: all). A read
    that fails once it is open (damage met on a page, a lock held past the wait) is one line,
    in the words of the verbs that write."""
    import sqlite3

    from nanolab.queue.db import QueueDB, QueueError, busy_db, unusable_db

    try:
        db = QueueDB.read_only(db_path)
    except QueueError as err:
        raise StatusError(str(err)) from None
    try:
        yield db, db.jobs(statuses)
    except sqlite3.DatabaseError as err:
        line = busy_db(db_path, err, 5.0) or unusable_db(db_path, f"cannot be read ({err})")
        raise StatusError(line) from None
    finally:
        db.conn.close()


def ended_jobs(db_path: Path) -> dict[Path, Any]:
    """The queue's finished jobs (done, stopped, failed) by run directory, read-only: for each
    run directory only its newest job, when that one is finished (a run queued again to go on
    is the newer job's)."""
    from nanolab.queue.db import FINISHED

    with _read_queue(db_path) as (_, jobs):
        newest = {(Path(j.cwd) / j.run_dir).resolve(): j for j in jobs}  # ordered by id
    return {run_dir: job for run_dir, job in newest.items() if job.status in FINISHED}


def end_by_queue(line: RunLine, job: Any, now: float) -> bool:
    """Mark a run that reads as running ended when its queue job has ended since its last log
    line (its fit exited: the log lost its end record). Only where that job is the one
    training it: the log's newest launch is the job's (its start record names the job), and
    no process of this host holds the run's lock (a job that failed at launch, refused as the
    run was in use, did not write the log a live launch writes on). A holder of another host
    cannot be judged from here: there, the job's end decides. A line written after the job
    ended is another launch's (the run resumed by hand): that one decides."""
    from nanolab.queue.predict import launched_by

    updated = None if line.since_s is None else now - line.since_s
    if job.ended is None or (updated is not None and updated > job.ended):
        return False
    run_dir = Path(line.run_dir)
    if _held_here(run_dir) or not launched_by(job, run_dir / RUN_LOG_NAME, updated or now):
        return False
    line.status, line.detail = "crashed", f"no end record; its queue job #{job.id} is {job.status}"
    line.eta_s, line.stalled = None, False
    return True


def _held_here(run_dir: Path) -> bool:
    """Whether a process of this host may still hold ``run_dir``'s lock."""
    import socket

    from nanolab.processes import live_lock_holder

    holder = live_lock_holder(run_dir)
    return holder is not None and holder.get("host") == socket.gethostname()


def queue_state(
    db_path: Path, now: float, walls: dict[str, float | None], etas: dict[str, float | None]
) -> tuple[list[JobLine], list[str]]:
    """Pending, preempted and running jobs of the queue at ``db_path``, read-only, and a line
    for each runner alive but silent (its heartbeat older than a few intervals: stopped by
    SIGSTOP?). A running job's time left is its run's ETA (its measured step time) where the
    log has one; the queue's prediction (:func:`~nanolab.queue.predict.remaining_seconds`,
    which reads the run log again) is worked out only for the others."""
    from nanolab.queue.db import orphaned, silent_runners
    from nanolab.queue.predict import remaining_seconds

    with _waiting_jobs(db_path) as (db, jobs):
        out: list[JobLine] = []
        clock = 0.0  # one job at a time, in queue order: the running ones first
        for job in sorted(jobs, key=lambda j: (j.status != "running", j.id)):
            name = Path(job.run_dir).name
            eta = etas.get(name) if job.status == "running" else None
            left = eta if eta is not None else remaining_seconds(db, job)[0]  # reads its log
            ran = walls.get(name)
            if ran is None:
                ran = job.run_seconds + (
                    now - job.last_started if job.status == "running" and job.last_started else 0
                )
            start = 0.0 if job.status == "running" else clock
            end = None if left is None else start + left
            # A job whose runner is gone waits for the next `queue run` to resume it.
            status = "runner gone: queue run resumes it" if orphaned(db, job) else job.status
            run_dir = str((Path(job.cwd) / job.run_dir).resolve())
            out.append(JobLine(job.id, job.name, status, left, start, end, ran, job.attempts,
                               name, run_dir))  # fmt: skip
            clock = end if end is not None else clock
        return out, [r["line"] for r in silent_runners(db, now)]


def collect(
    roots: list[Path],
    db_path: Path | None,
    now: float | None = None,
    followed: FollowedRuns | None = None,
) -> Screen:
    """The screen: every run under ``roots`` and the queue at ``db_path``. ``followed`` keeps
    the logs read between the redraws of ``--watch``, which then read only what was appended."""
    now = time.time() if now is None else now
    screen = Screen(time=now, queue=str(db_path) if db_path is not None else None)
    found = discover_runs([r for r in roots if r.exists()])  # a queued job's root comes later
    for name, run_dir in found:
        line = run_line(name, run_dir, now, followed)
        (screen.running if line.status == "running" else screen.ended).append(line)
    if db_path is not None and screen.running:
        finished = ended_jobs(db_path)
        for line in list(screen.running):
            job = finished.get(Path(line.run_dir).resolve())
            if job is not None and end_by_queue(line, job, now):
                screen.running.remove(line)
                screen.ended.append(line)
    if db_path is not None:
        walls = {Path(line.run_dir).name: line.wall_s for line in screen.running + screen.ended}
        etas = {Path(line.run_dir).name: line.eta_s for line in screen.running}
        # A running job shows under running once its run has logged its start; before that
        # (imports, preparing its data: seconds to hours) it is listed here as starting.
        logged = {Path(line.run_dir).name for line in screen.running}
        jobs, screen.silent_runners = queue_state(db_path, now, walls, etas)
        screen.queued = [
            j if j.status != "running" else replace(j, status="starting")
            for j in jobs
            if j.status != "running" or j.run not in logged
        ]
        # A run whose job waits (preempted, to resume; starting again) is listed once: under
        # queued, where its job's status says what comes next, not under ended as well.
        waiting = {j.run_dir for j in screen.queued}
        screen.ended = [r for r in screen.ended if str(Path(r.run_dir).resolve()) not in waiting]
    screen.ended.sort(key=lambda r: r.run)
    return screen


# -- the screen --------------------------------------------------------------------------------
def _f(value: float | None, fmt: str = ".4f") -> str:
    return "-" if value is None else f"{value:{fmt}}"


def _si(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    return ["  " + line for line in table(rows, headers, rule=False)]


def render(screen: Screen, roots: list[Path]) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(screen.time))
    where = ", ".join(str(r) for r in roots) + (f" + queue {screen.queue}" if screen.queue else "")
    out = [f"nanolab status  {where}  {stamp}"]
    out.append(f"\nrunning ({len(screen.running)})")
    if screen.running:
        rows = []
        for r in screen.running:
            progress = "-" if r.step is None else str(r.step)
            if r.max_steps:
                about = "~" if r.end_estimated else ""
                progress += f"/{about}{r.max_steps} ({(r.step or 0) / r.max_steps:.0%})"
            mem = "-" if r.mem_bytes is None else f"{r.mem_bytes / 2**30:.1f}G"
            util = "-" if r.gpu_util is None else f"{r.gpu_util:.0f}%"
            since = duration(r.since_s) + " ago" + ("  STALLED" if r.stalled else "")
            rows.append([r.run, progress, _f(r.train_loss), _f(r.val_loss), _si(r.tokens_per_s),
                         mem, util, duration(r.eta_s), since])  # fmt: skip
        out += _table(
            ["run", "step", "loss", "val", "tok/s", "mem", "util", "ETA", "last line"], rows
        )
    if screen.queue is not None:
        out.append(f"\nqueued ({len(screen.queued)}; start/end if run one at a time in order)")
        if screen.queued:
            rows = [
                [str(j.id), j.name, j.status, duration(j.needs_s),
                 "in " + duration(j.start_in_s), "in " + duration(j.end_in_s),
                 duration(j.ran_s) if j.ran_s else "-"]
                for j in screen.queued
            ]  # fmt: skip
            out += _table(["id", "job", "status", "needs", "starts", "ends", "ran"], rows)
        out += [f"  {line}" for line in screen.silent_runners]
    out.append(f"\nended ({len(screen.ended)})")
    if screen.ended:
        rows, whole = [], []
        for r in screen.ended:
            last = r.detail.splitlines()[-1] if r.detail and r.detail.strip() else ""
            end = r.status
            if last and len(last) > DETAIL_WIDTH:  # the whole line below the table: its fix
                end += " (below)"
                whole.append(f"  {r.run}: {last}")
            elif last:
                end += f": {last}"
            rows.append([r.run, end, "-" if r.step is None else str(r.step),
                         _f(r.best_val_loss), _f(r.val_loss), duration(r.wall_s)])  # fmt: skip
        out += _table(["run", "end", "steps", "best val", "final val", "wall"], rows)
        out += whole
    return "\n".join(out)


#: Characters of an ended run's last line shown in its row; a longer one (an error line and
#: its fix) is printed whole under the table.
DETAIL_WIDTH = 50


def default_db(given: Path | None) -> Path | None:
    """``--db``, else ``$NANOLAB_QUEUE_DB`` or ``nanolab_queue.db`` when that file exists."""
    from nanolab.queue.db import DEFAULT_DB, default_db_path

    if given is not None:
        if given.exists() and not given.is_file():  # in the words `queue add --db` uses
            what = "a folder" if given.is_dir() else "not a regular file"
            hint = given / DEFAULT_DB if given.is_dir() else DEFAULT_DB
            raise StatusError(
                f"the queue database {given} is {what}; pass --db with a file path, "
                f"e.g. --db {hint}"
            )
        if not given.is_file():
            raise StatusError(f"--db {given}: no such queue database file")
        return given
    path = default_db_path()
    return path if path.is_file() else None


def nothing_here(roots: list[Path]) -> str:
    """The line of a ``status`` with no runs and no queue where it looked: the absolute folders
    (run from another folder, ``runs`` is another folder's) and how to point it elsewhere."""
    from nanolab.queue.db import default_db_path

    folders = ", ".join(str(r.absolute()) for r in roots)
    db = default_db_path().absolute()
    return (
        f"no runs under {folders} (no {RUN_LOG_NAME}) and no queue database {db}; run it from "
        "the folder you ran `nanolab fit` or `queue add` in, or name them: nanolab status "
        "PROJECT/runs --db PROJECT/nanolab_queue.db (or set $NANOLAB_QUEUE_DB)"
    )


@one_line_errors("nanolab status")
def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(
        prog="nanolab status",
        description="What is running, queued and finished under a run root and its queue "
        "(reads files only).",
    )
    parser.add_argument("roots", nargs="*", type=given_path, metavar="RUNS_DIR",
                        help="folders holding runs (default: runs)")  # fmt: skip
    parser.add_argument("--db", type=Path, help="the queue database (default: nanolab_queue.db "
                        "or $NANOLAB_QUEUE_DB, when it exists)")  # fmt: skip
    parser.add_argument("--watch", type=float, metavar="SECONDS",
                        help="redraw every SECONDS until Ctrl-C")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the screen as JSON")
    args = parser.parse_args(argv)
    given = [*(args.roots or [Path("runs")]), *([args.db] if args.db is not None else [])]
    if (gone := relative_path_without_working_directory(given)) is not None:
        raise StatusError(gone)
    db = default_db(args.db)
    missing = [r for r in args.roots if not r.exists()]
    waiting = job_roots(db) if missing and db is not None else set()
    # A folder named here must exist (a typo is said, even beside a queue) unless queued jobs
    # will make their runs there; the default runs/ may be missing.
    for root in args.roots:
        if root.exists() or root.resolve() not in waiting:
            check_root(root)
    roots = args.roots or [Path("runs")]
    if args.watch is not None and not 0.5 <= args.watch <= 86400:
        raise StatusError(f"--watch {args.watch}: give a number of seconds from 0.5 to 86400")
    if not any(r.exists() for r in roots) and db is None:
        raise StatusError(nothing_here(roots))
    followed = FollowedRuns() if args.watch is not None else None
    while True:
        screen = collect(roots, db, followed=followed)
        text = json.dumps(asdict(screen), indent=2) if args.json else render(screen, roots)
        if args.watch is not None and sys.stdout.isatty():
            print("\x1b[2J\x1b[H", end="")  # clear the terminal and go home
        print(text, flush=True)
        if args.watch is None:
            return 0
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0
        if not sys.stdout.isatty():
            print(os.linesep + "-" * 40)
