"""``nanolab queue``: add experiments before bed, run them one per GPU, look at them in the morning.

    nanolab queue add configs/quickstart.yaml --seeds 1,2,3 --set trainer.max_steps=600
    nanolab queue add a.yaml b.yaml --sweep model.optimizer.lr=1e-3,3e-3 --seeds 1,2
    nanolab queue ls
    nanolab queue run --gpus 0,1 --until 08:00 --order longest-first
    nanolab queue run --gpus 0 --pack          # several jobs per GPU, by predicted memory
    nanolab report runs/

The database is ``./nanolab_queue.db`` (``--db PATH`` or ``$NANOLAB_QUEUE_DB`` to change it);
each job's console output goes to ``queue.log`` in its run directory.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import signal
import sqlite3
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from errno import ENOSPC
from pathlib import Path
from typing import Any

from nanolab import messages
from nanolab.errors import NanolabError, one_line_errors, report, with_errno_of
from nanolab.helpfmt import OneLineParser
from nanolab.queue.db import (
    FINISHED,
    RUNNER_STALE_S,
    STATUSES,
    UNFINISHED,
    DamagedJobError,
    Job,
    QueueDB,
    QueueError,
    ReadOnlyDBError,
    busy_db,
    default_db_path,
    no_room,
    orphaned,
    read_only_db,
    silent_runners,
    size_limit_in_the_way,
    unusable_db,
)
from nanolab.queue.packing import gib
from nanolab.queue.predict import describe, remaining_seconds, run_time
from nanolab.queue.runner import ORDERS, Runner, _is_job_process
from nanolab.runs import duration
from nanolab.tables import table
from nanolab.training.resolve import is_fit_option


def parse_until(text: str, now: float | None = None) -> float:
    """``08:00`` (next occurrence), ``+8h``/``+90m``, or an ISO date-time -> unix time."""
    now = time.time() if now is None else now
    text = text.strip()
    m = re.fullmatch(r"\+(\d+(?:\.\d+)?)\s*([hms])", text)
    if m:
        return now + float(m.group(1)) * {"h": 3600, "m": 60, "s": 1}[m.group(2)]
    m = re.fullmatch(r"(\d{1,2}):(\d{2})", text)
    if m and int(m.group(1)) < 24 and int(m.group(2)) < 60:
        base = dt.datetime.fromtimestamp(now)
        target = base.replace(hour=int(m.group(1)), minute=int(m.group(2)), second=0, microsecond=0)
        if target.timestamp() <= now:
            target += dt.timedelta(days=1)
        return target.timestamp()
    try:
        when = dt.datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise QueueError(
            f"--until {text!r}: give a time of day (08:00), a duration (+8h, +90m) or a "
            "date-time (2025-06-01T08:00)"
        ) from None
    if when <= now:  # a deadline already past would start nothing, silently
        raise QueueError(
            f"--until {text!r} is already past ({time.ctime(now)} now); give a later date-time, "
            "a time of day (08:00: the next one) or a duration (+8h)"
        )
    return when


def parse_gpus(text: str | None) -> list[str] | None:
    if text is None:
        return None
    if text.strip().lower() == "all":
        import torch

        n = torch.cuda.device_count()
        if n == 0:
            raise QueueError("--gpus all: no GPU is visible; leave --gpus out to run on CPU")
        masked = visible_mask()
        # A job's ids become its own mask, so they are the host's ids: under a mask, "all" is
        # the mask's devices (GPUs 2,3 of a shared box), never 0..n-1 (a colleague's).
        return masked if masked is not None else [str(i) for i in range(n)]
    ids = [g.strip() for g in text.split(",") if g.strip()]
    if not ids or len(set(ids)) != len(ids):
        raise QueueError(f"--gpus {text!r}: give distinct device ids, e.g. --gpus 0,1,2,3")
    check_gpus_visible(ids, text)
    return ids


def visible_mask() -> list[str] | None:
    """The host ids of this process's visibility mask (``CUDA_VISIBLE_DEVICES``, or ROCm's
    ``HIP_VISIBLE_DEVICES``), the mask a job's ids replace; None when neither is set. Two
    different masks, or either under ROCm's ``ROCR_VISIBLE_DEVICES`` on a ROCm build (HIP's
    ids then index ROCR's list), cannot be read as one list: refused in one line rather than guessed. ROCR's
    alone is left in place for the jobs, so their ids count within it."""
    import torch

    names = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")
    masks = {k: os.environ[k].strip() for k in names if os.environ.get(k, "").strip()}
    distinct = {tuple(g.strip() for g in v.split(",") if g.strip()) for v in masks.values()}
    # ROCR's mask nests HIP's only under ROCm (SLURM exports every vendor's variable, ROCR's
    # on NVIDIA nodes too, where nothing reads it).
    nested = (
        bool(masks)
        and bool(os.environ.get("ROCR_VISIBLE_DEVICES", "").strip())
        and bool(getattr(torch.version, "hip", None))
    )
    if len(distinct) > 1 or nested:
        if nested:
            masks["ROCR_VISIBLE_DEVICES"] = os.environ["ROCR_VISIBLE_DEVICES"]
        shown = ", ".join(f"{k}={v!r}" for k, v in masks.items())
        raise QueueError(
            f"--gpus all: the device masks disagree or nest ({shown}); name the GPUs, e.g. "
            "--gpus 2,3, or set one mask"
        )
    return list(distinct.pop()) if distinct else None


def check_gpus_visible(ids: list[str], text: str) -> None:
    """Refuse GPU ids this machine cannot have: without the check, every job would silently
    train on the CPU while the queue lists it on "GPU 0"."""
    import torch

    n = torch.cuda.device_count()
    names = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")
    masks = {k: os.environ[k] for k in names if k in os.environ}
    mask = "".join(f", {k}={v!r}" for k, v in masks.items())
    if n == 0:
        build = "a CPU-only torch" if not torch.backends.cuda.is_built() else "no device found"
        raise QueueError(
            f"--gpus {text}: no GPU is visible here ({build}{mask}); leave --gpus out to run the "
            "jobs on CPU (--slots N for several at once)"
        )
    # With a visibility mask set, ids name physical devices (the jobs get them as their mask),
    # so only an unmasked machine can be checked by index.
    too_high = [g for g in ids if g.isdigit() and int(g) >= n]
    if too_high and not masks:
        raise QueueError(
            f"--gpus {text}: this machine has {n} GPU(s), ids 0-{n - 1}; {', '.join(too_high)} "
            "do not exist"
        )


# -- verbs ----------------------------------------------------------------------------------
def cmd_add(args: argparse.Namespace) -> int:
    from nanolab.queue.jobs import build_jobs, parse_sets
    from nanolab.queue.predict import job_estimate, memory_need
    from nanolab.queue.sweep import grid, parse_sweeps

    if any(not c.strip() for c in args.config):  # Path('') is '.': "config . is a folder"
        raise QueueError(
            "the config path is empty; give a YAML file, e.g. nanolab queue add my.yaml"
        )
    configs = [Path(c) for c in args.config]
    if args.gpu is not None:  # estimate's own lookup: an unknown name, not a silent "~?"
        from nanolab.estimator.gpus import get_gpu

        if not args.gpu.strip():
            raise QueueError("--gpu is empty; name a device (nanolab estimate --list-gpus)")
        try:
            get_gpu(args.gpu)
        except ValueError as err:
            raise QueueError(str(err).replace("; or give --gpu-mem)", ")")) from None  # estimate's
    sweeps = parse_sweeps(args.sweep, [k for k, _ in parse_sets(args.set)])
    where = Path(args.db) if args.db is not None else default_db_path()
    QueueDB.check_path(where)
    # A new database is created only once every job is accepted: a refused add leaves none.
    db = QueueDB(where) if where.exists() else None
    jobs, notes = [], []
    for point in grid(sweeps):  # one point (no sweep) or the product of every --sweep
        name = sweep_job_name(args.name, configs, point, parse_sets(args.set))
        jobs += build_jobs(
            configs[0],
            [*args.set, *(f"{k}={v}" for k, v in point)],
            args.seeds,
            name,
            Path.cwd(),
            estimate=lambda parsed: job_estimate(db, parsed, args.gpu),
            memory=lambda parsed: memory_need(parsed, args.gpu),
            backfill=args.backfill,
            extra_configs=tuple(configs[1:]),
            continue_runs=args.continue_runs,
            notes=notes,
            swept=frozenset(k for k, _ in point),
        )
    names = [j.name for j in jobs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise QueueError(
            f"two jobs would share the name {dupes[0]!r}; give --sweep values that differ after "
            "being made into a name, or --name"
        )
    added = (db if db is not None else QueueDB(where)).add_jobs(jobs)
    for note in notes:
        messages.note("nanolab queue", note)
    for job in added:
        print(f"added job {job.id} {job.name}{' as backfill' if job.backfill else ''} "
              f"({added_estimates(job)}; run dir {job.run_dir})")  # fmt: skip
    return 0


def added_estimates(job: Job) -> str:
    """A job's time and peak memory as ``queue add`` prints them: ``~12m, peak 3.1 GiB``; with
    the reason where there is none (``~? (no estimate: ...)``, ``no memory estimate: ...``):
    an untimed job is held back by ``queue run --until``, an unmeasured one runs alone with
    ``--pack``."""
    out = f"~{describe(job.estimate_s)}"
    if job.estimate_s is None and job.estimate_source:
        out += f" ({job.estimate_source})"
    if job.mem_peak:
        out += f", peak {gib(job.mem_peak)}"
    elif (job.mem_source or "").startswith("no memory estimate"):
        out += f", {job.mem_source}"
    return out


def sweep_job_name(
    name: str | None,
    configs: list[Path],
    point: tuple[tuple[str, str], ...],
    sets: list[tuple[str, str]],
) -> str | None:
    """The run name of one sweep point (``-s<seed>`` is added later), or None for the default.

    A sweep point is named by the config(s) (or ``--name``) and the swept values only
    (``quickstart-lr1e-3-n_layer4``): the fixed ``--set`` overrides are the same for every point
    and are in each job's config, and a name built from them grows past what ``queue ls`` can
    show. Several configs without a sweep keep the overrides in the name, as one config does.
    """
    from nanolab.queue.jobs import job_names
    from nanolab.queue.sweep import point_name

    stems = "+".join(c.stem for c in configs)  # quickstart+overfit
    if point:
        return point_name(name if name is not None else stems, point)
    if name is None and len(configs) > 1:
        base = job_names(configs[0], None, sets, None)[0]
        return stems + base[len(configs[0].stem) :]
    return name


def _job_dict(job: Job, db: QueueDB, jobs: list[Job]) -> dict:
    """A job as ``ls --json`` gives it. Its time left only while it has one (pending,
    preempted, running): working it out reads the run log, and a finished job's is none."""
    remaining, source = (
        remaining_seconds(db, job) if job.status in UNFINISHED else (None, job.estimate_source)
    )
    d = dict(vars(job))
    d["remaining_s"], d["estimate_basis"] = remaining, source
    d["shares_with"] = [j.id for j in sharing(job, jobs)]
    d["runner_gone"] = orphaned(db, job)
    return d


def sharing(job: Job, jobs: list[Job]) -> list[Job]:
    """The other running jobs on the device ``job`` shares (same runner and device)."""
    if job.status != "running" or not job.packed_on:
        return []
    return [
        j
        for j in jobs
        if j.id != job.id
        and j.status == "running"
        and j.runner_id == job.runner_id
        and j.packed_on == job.packed_on
    ]


def _device_column(job: Job, jobs: list[Job]) -> str:
    """``gpus`` of ``ls``: the ids, and for a packed job its device, cap and neighbours."""
    where = job.gpus or "-"
    if job.status == "running" and job.packed_on:
        others = ",".join(str(j.id) for j in sharing(job, jobs))
        cap = f" cap {gib(job.mem_cap)}" if job.mem_cap and job.gpus else ""
        where = f"{job.packed_on}{cap}" + (f" with {others}" if others else " (packed)")
    if job.backfill:
        where += " [backfill]"
    return where


#: The widest status ``ls`` puts in its table. A longer one (a failed job's error line, which
#: ends with the fix) is printed whole on its own indented line under the job's row: cut to
#: the column, the fix was the part cut off.
STATUS_WIDTH = 70


def listing_db(given: str | None) -> QueueDB:
    """The queue database as ``ls`` reads it: a listing never needs to write. Opened read-only
    at once where this process's file-size limit (``ulimit -f``) is in the way of a write (a
    read-write open sets the journal up and may be refused: EFBIG), and when the file or its
    folder cannot be written (a read-only file or file system)."""
    where = Path(given) if given is not None else default_db_path()
    if where.is_file() and size_limit_in_the_way(where) is not None:
        return QueueDB.read_only(where)
    try:
        return QueueDB(where, reading=True)
    except ReadOnlyDBError:
        return QueueDB.read_only(where)


def cmd_ls(args: argparse.Namespace) -> int:
    for s in args.status or []:
        if s not in STATUSES:
            raise QueueError(f"--status {s!r}: unknown status; choose from {', '.join(STATUSES)}")
    db = listing_db(args.db)
    jobs = db.jobs(args.status or None)
    running = jobs if not args.status else db.jobs(("running",))
    gaps = db.event_values("gap")
    silent = silent_runners(db)  # alive, its jobs its own, but not beating: said, not changed
    if args.json:
        rows = [_job_dict(j, db, running) for j in jobs]
        print(json.dumps({"jobs": rows, "gaps_s": gaps, "silent_runners": silent}, indent=2))
        return 0
    if not jobs:
        print(
            f"no jobs{' with status ' + ', '.join(args.status) if args.status else ''} in {db.path}"
        )
        for runner in silent:
            print(runner["line"])
        return 0
    now = time.time()
    groups = group_jobs(jobs)
    jobs = [j for members in groups for j in members]
    rows = []
    whole: dict[int, str] = {}  # job id -> a status too wide for the table, shown under it
    for j in jobs:
        status = j.status + (f": {j.detail}" if j.detail else "")
        if orphaned(db, j):
            status = "running: its runner is gone; `queue run` resumes it"
        if len(status) > STATUS_WIDTH or "\n" in status:
            whole[j.id] = " ".join(status.split())
            status = f"{j.status} (below)"
        ran = run_time(j, now)
        left = remaining_seconds(db, j)[0] if j.status in UNFINISHED else None
        run_dir = os.path.relpath(j.run_dir) if j.run_dir.startswith(os.getcwd()) else j.run_dir
        rows.append([str(j.id), j.name, status, str(j.attempts), _device_column(j, running),
                     describe(left) if left is not None else "-", duration(ran) if ran else "-", run_dir])  # fmt: skip
    headers = ["id", "name", "status", "tries", "gpus", "left", "ran", "run dir"]
    lines = table(rows, headers, rule=True)
    print("\n".join(lines[:2]))
    by_id = {j.id: line for j, line in zip(jobs, lines[2:], strict=True)}
    for members in groups:
        if len(members) > 1:
            print(group_header(members))
        for j in members:
            print(by_id[j.id])
            if j.id in whole:
                print(f"    {whole[j.id]}")
    summary = ", ".join(f"{n} {s}" for s, n in Counter(j.status for j in jobs).items())
    if gaps:
        summary += (f"; job-to-job gap median {statistics.median(gaps) * 1000:.0f} ms "
                    f"(max {max(gaps) * 1000:.0f} ms, n={len(gaps)})")  # fmt: skip
    print(f"\n{summary}")
    for runner in silent:
        print(runner["line"])
    return 0


def group_jobs(jobs: list[Job]) -> list[list[Job]]:
    """Jobs of one experiment (the same config but for the seed: the same ``config_key``)
    together, groups in the order of their first job."""
    groups: dict[object, list[Job]] = {}
    for j in jobs:
        groups.setdefault(j.config_key or ("job", j.id), []).append(j)
    return list(groups.values())


def group_header(members: list[Job]) -> str:
    """``quickstart-lr1e-3: 3 seeds (1, 2, 3): 2 done, 1 running``; ``a, b: 3 jobs: ...`` where
    the members are not one seed each (``--seeds 1,2`` under one name and an unseeded job under
    another): the counts after the colon always add up to what the label says."""
    names = [re.sub(r"-s-?\d+$", "", j.name) for j in members]
    label = names[0]
    if len(set(names)) > 1:  # one config under several names: the common part, or every name
        common = os.path.commonprefix(names).rstrip("-_")  # noqa: RUF071
        label = common or ", ".join(dict.fromkeys(names))
    seeds = [j.seed for j in members if j.seed is not None]
    counts = Counter(j.status for j in members)
    # "N seeds" only where the seeds are the jobs, one each: with an unseeded job or a seed
    # added twice under another name in the group, the seed list would miscount what follows it.
    one_seed_each = len(seeds) == len(members) and len(set(seeds)) == len(seeds)
    what = (
        f"{len(seeds)} seeds ({', '.join(map(str, seeds))})"
        if one_seed_each
        else f"{len(members)} jobs"
    )
    return f"{label}: {what}: " + ", ".join(f"{n} {s}" for s, n in counts.items())


def existing_db(path: str | None) -> QueueDB:
    """The queue database a command that changes jobs works on: it must exist already (a
    mistyped ``--db`` is one line and exit 2, and no empty database is left behind)."""
    where = Path(path) if path is not None else default_db_path()
    if not where.exists():
        raise QueueError(
            f"no queue database at {where}: nothing was queued there (check --db; "
            "`nanolab queue add` creates it)"
        )
    return QueueDB(where)


def cmd_rm(args: argparse.Namespace) -> int:
    db = existing_db(args.db)
    refs = list(args.jobs)
    while True:
        try:
            jobs = db.resolve(refs)
            break
        except DamagedJobError as err:  # the one command that must work on a damaged row
            named = [r for r in refs if r in (str(err.job_id), f"#{err.job_id}")]
            if not named:
                raise
            db.remove([int(err.job_id)])
            refs.remove(named[0])
            print(f"removed job {err.job_id} (a damaged row)")
            if not refs:
                return 0
    for job in jobs:
        # The row goes only as it was seen: a runner that records the pid meanwhile makes the
        # delete miss, and the job is read again (then signalled here). A row deleted before its
        # pid was recorded is stopped by its runner, which finds the row gone (set_job_pid).
        while True:
            signalled = job.status == "running" and job.job_pid
            if signalled and _is_job_process(job.job_pid, job.name):
                os.kill(job.job_pid, signal.SIGTERM)  # checkpoints at its step boundary, exits 75
                print(f"job {job.id} {job.name}: running (pid {job.job_pid}); asked it to "
                      "checkpoint and stop")  # fmt: skip
            elif job.status == "running" and not job.job_pid:
                print(f"job {job.id} {job.name}: starting; its runner stops it as soon as it "
                      "has started")  # fmt: skip
            if db.remove_as_seen(job.id, job.job_pid):
                break
            again = [j for j in db.jobs() if j.id == job.id]
            if not again:  # gone already (another rm)
                break
            job = again[0]
    for job in jobs:
        kept = (
            f"its run directory {job.run_dir} is kept"
            if job.run_path.exists()
            else "it had not made a run directory"
        )
        print(f"removed job {job.id} {job.name} ({kept})")
    return 0


def cmd_retry(args: argparse.Namespace) -> int:
    db = existing_db(args.db)
    jobs = db.resolve(args.jobs)
    for job in jobs:
        if orphaned(db, job):
            raise QueueError(
                f"job {job.id} {job.name} was running under a runner that is gone (killed or "
                "lost); `nanolab queue run` recovers it and resumes it from its checkpoint"
            )
        if job.status in ("pending", "running"):
            raise QueueError(f"job {job.id} {job.name} is {job.status} already")
        if job.status == "done":
            raise QueueError(
                f"job {job.id} {job.name} is done; to train it again add it with another --name"
            )
    for job in jobs:
        db.set_status(job.id, "pending", expect=(job.status,), detail=None, exit_code=None)
        print(
            f"job {job.id} {job.name}: pending again (resumes from its run directory's checkpoint)"
        )
    return 0


def cmd_clear(args: argparse.Namespace) -> int:
    db = existing_db(args.db)
    statuses = tuple(s for s in STATUSES if s != "running") if args.all else FINISHED
    jobs = db.jobs(statuses)
    db.remove([j.id for j in jobs])
    print(f"removed {len(jobs)} job(s) ({', '.join(statuses)}); run directories are kept")
    return 0


#: More CPU jobs at once than any machine runs well (each is a process with its own threads).
MAX_SLOTS = 1024


def cmd_run(args: argparse.Namespace) -> int:
    if not 1 <= args.slots <= MAX_SLOTS:
        raise QueueError(
            f"--slots must be between 1 and {MAX_SLOTS} (jobs at once on this machine's CPUs), "
            f"got {args.slots}"
        )
    gpus = parse_gpus(args.gpus)
    from nanolab.notify import NotifyConfigError, check_targets
    from nanolab.queue.runner import QUEUE_FIELDS

    try:
        check_targets(args.notify, QUEUE_FIELDS, "--notify")
    except NotifyConfigError as err:
        raise QueueError(str(err)) from None
    until = parse_until(args.until) if args.until is not None else None
    device_mem = None
    if args.device_mem is not None:
        if not args.pack:
            raise QueueError("--device-mem is for --pack (the memory jobs are packed into)")
        device_mem = parse_size(args.device_mem, "--device-mem")
    if not 0.0 <= args.pack_margin <= 1.0:
        raise QueueError(
            f"--pack-margin must be between 0 and 1 (e.g. 0.1), got {args.pack_margin}"
        )
    if args.pack and args.slots != 1:
        raise QueueError("--slots is for one job per slot; --pack decides how many jobs share")
    db = QueueDB(args.db)
    live = db.live_runners(stale_s=RUNNER_STALE_S)
    if live:
        pids = ", ".join(f"pid {r['pid']} on {r['host']}" for r in live)
        print(f"nanolab queue run: note: another runner is active ({pids}); jobs are claimed "
              "atomically, so both share the queue", file=sys.stderr)  # fmt: skip
    runner = Runner(
        db, gpus=gpus, slots=args.slots, until=until, order=args.order, wait=args.wait,
        pack=args.pack, device_mem=device_mem, pack_margin=args.pack_margin,
        compile_cache=not args.no_compile_cache, notify=list(args.notify),
    )  # fmt: skip
    return runner.run()


def parse_size(text: str, option: str) -> int:
    """``141GiB``, ``80GB``, ``512MiB`` or bytes -> bytes (the estimator's memory strings)."""
    from nanolab.estimator.gpus import parse_memory

    try:
        n = parse_memory(text)
    except ValueError as err:
        raise QueueError(f"{option} {text!r}: {err}") from None
    if n <= 0:
        raise QueueError(f"{option} {text!r}: must be more than 0 bytes, e.g. {option} 80GiB")
    return n


# -- parser ---------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The ``queue`` verbs' parser. Options are matched whole, as fit matches its own
    (``allow_abbrev=False``): ``add --seed 3`` is not quietly ``--seeds 3`` but fit's setting
    without its group, named with what it may mean, and a later option that begins as an
    abbreviation does (``--gpu`` beside ``--gpus``) never changes what a script meant."""
    common = OneLineParser(add_help=False, allow_abbrev=False)
    common.add_argument("--db", default=None, metavar="PATH",
                        help="queue database (default ./nanolab_queue.db or $NANOLAB_QUEUE_DB)")  # fmt: skip
    p = OneLineParser(
        prog="nanolab queue",
        description="Add experiments before bed, run them one per GPU, look at them in the morning.",
        allow_abbrev=False,
    )
    verbs = p.add_subparsers(dest="verb", required=True, metavar="VERB")

    def verb(name: str, **kwargs: Any) -> argparse.ArgumentParser:
        return verbs.add_parser(name, parents=[common], allow_abbrev=False, **kwargs)

    a = verb("add", help="queue a config (one job per seed and sweep point)")
    a.add_argument(
        "config",
        nargs="+",
        metavar="CONFIG",
        help="nanolab fit YAML config(s); several compose as --config a --config b (later wins)",
    )
    a.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value (repeatable), e.g. --set trainer.max_steps=600; "
                   "fit's own form --trainer.max_steps 600 works too")  # fmt: skip
    a.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="KEY=V1,V2,...",
        help="one job per value (repeatable: the grid of all of them, times --seeds), named "
        "after its values, e.g. --sweep model.optimizer.lr=1e-3,3e-3",
    )
    a.add_argument("--seeds", metavar="S1,S2,...", help="one job per seed (seed_everything)")
    a.add_argument(
        "--name", help="run name (default: config name + overrides); -s<seed> is appended per seed"
    )
    a.add_argument(
        "--gpu",
        metavar="NAME",
        help="GPU model for the duration estimate (e.g. h100) when none is visible here",
    )
    a.add_argument(
        "--backfill",
        action="store_true",
        help="low priority: run only on devices that would idle; checkpoint and give way (exit "
        "75, resumed later) when another job needs the device or --until comes",
    )
    a.add_argument(
        "--continue",
        dest="continue_runs",
        action="store_true",
        help="let a job continue a run already in its run directory that the queue did not "
        "start (by default that is refused at add time)",
    )
    a.set_defaults(func=cmd_add)

    ls = verb("ls", help="list jobs and their status")
    ls.add_argument(
        "--status", action="append", metavar="STATUS", help=f"only these ({', '.join(STATUSES)})"
    )
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(func=cmd_ls)

    for name, func, text in (
        ("rm", cmd_rm, "remove jobs (a running one checkpoints and stops)"),
        ("retry", cmd_retry, "put failed/stopped/preempted jobs back (they resume)"),
    ):
        by_job = verb(name, help=text)
        by_job.add_argument("jobs", nargs="+", metavar="JOB", help="job id, name, or #id")
        by_job.set_defaults(func=func)

    cl = verb("clear", help="remove done, stopped and failed jobs")
    cl.add_argument("--all", action="store_true", help="also pending and preempted jobs")
    cl.set_defaults(func=cmd_clear)

    r = verb(
        "run",
        help="run the queue, one job per GPU",
        description="Run the queued jobs, one per GPU (or CPU slot), until none is left. Exit "
        "status: 0 when every job it ran is done (or stopped by its budget or plateau rule), "
        "1 when any job it ran ended failed (`queue ls` says why), 75 when stopped by a signal "
        "(its jobs checkpointed; run it again to resume them), 2 for bad input.",
    )
    r.add_argument(
        "--gpus",
        metavar="IDS",
        help="device ids for one job each, e.g. 0,1,2,3, or 'all'; omit to run on CPU",
    )
    r.add_argument("--slots", type=int, default=1, help="jobs at once without --gpus (default 1)")
    r.add_argument(
        "--notify",
        action="append",
        default=[],
        metavar="TARGET",
        help="when the runner ends (queue drained or stopped): a command with {queue}, "
        "{summary}, {reason}, {done}, {failed}, ... filled in, run without a shell, or an "
        "apprise URL (repeatable; docs/report.md)",
    )
    r.add_argument(
        "--until",
        metavar="TIME",
        help="08:00, +8h or 2025-06-01T08:00: don't start jobs that would end later",
    )
    r.add_argument(
        "--order",
        choices=ORDERS,
        default="fifo",
        help="fifo (default) or longest-first (by estimated duration)",
    )
    r.add_argument(
        "--wait",
        action="store_true",
        help="keep waiting for new jobs when the queue is empty (until --until or Ctrl-C)",
    )
    r.add_argument(
        "--pack",
        action="store_true",
        help="start several jobs per device as their predicted memory allows (docs/queue.md)",
    )
    r.add_argument(
        "--device-mem",
        metavar="SIZE",
        help="memory of each device for --pack, e.g. 141GiB (default: what the device reports; "
        "on CPU the physical RAM)",
    )
    r.add_argument(
        "--pack-margin",
        type=float,
        default=0.10,
        metavar="SHARE",
        help="added to each packed job's predicted peak for its allocator cap (default 0.10)",
    )
    r.add_argument(
        "--no-compile-cache",
        action="store_true",
        help="don't share torch.compile caches between jobs (nanolab_queue_cache/ by the db)",
    )
    r.set_defaults(func=cmd_run)
    return p


def verb_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Each ``queue`` verb's own parser: its errors name its own help (``see `nanolab queue
    ls --help```), which lists that verb's options."""
    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(verbs.choices)


def other_verbs_options(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each option of a ``queue`` verb other than ``add`` -> that verb (``--gpus`` -> ``run``),
    so an option given to the wrong verb is named with the right one."""
    found: dict[str, str] = {}
    for verb in verb_parsers(parser):
        for option in verb_options(parser, verb):
            if verb != "add" and option not in ("--help", "--db"):
                found.setdefault(option, verb)
    return found


def verb_options(parser: argparse.ArgumentParser, verb: str) -> list[str]:
    """The long options of ``nanolab queue VERB`` (``--continue``, ``--seeds``, ...)."""
    sub = verb_parsers(parser)[verb]
    return [o for action in sub._actions for o in action.option_strings if o.startswith("--")]


def unrecognized_line(unknown: list[str], options: list[str]) -> str:
    """What a verb other than ``add`` says of the arguments it does not have (``unknown``, as
    its parser left them over): the nearest of its own ``options`` to the first option given
    (:func:`nanolab.helpfmt.near_options`, fit's rule: ``run --gpu 2``: ``--gpus``), else the
    arguments as they are."""
    from nanolab.helpfmt import either, near_options

    name = next((t.split("=", 1)[0] for t in unknown if t.startswith("--")), None)
    near = near_options(name[2:], [o[2:] for o in options]) if name else []
    if name and near:
        return f"unknown option {name}; did you mean {either(f'--{n}' for n in near)}?"
    return f"unrecognized arguments: {' '.join(unknown)}"


def dotted_as_sets(argv: list[str]) -> list[str]:
    """``queue add`` takes ``fit``'s dotted overrides as they are (``--model.gpt.n_layer 2``,
    ``--run.eval_every_steps=50``): each becomes the ``--set KEY=VALUE`` it means. One the
    queue sets itself (``--seed_everything 3``, ``--run.name x``) is refused as it was given."""
    from nanolab.queue.jobs import RESERVED_KEYS, reserved_line

    if argv[:1] != ["add"]:
        return argv
    out = ["add"]
    tokens = argv[1:]
    i = 0
    while i < len(tokens):
        token = tokens[i]
        name = token[2:].split("=", 1)[0]
        if token == "--set" and i + 1 < len(tokens) and tokens[i + 1].startswith("-"):
            raise QueueError(  # not a KEY: the next option (--set --db q.db)
                f"--set needs KEY=VALUE before {tokens[i + 1]}, e.g. --set trainer.max_steps=600"
            )
        if token == "--set" and i + 1 < len(tokens) and "=" not in tokens[i + 1]:
            key = tokens[i + 1]  # --set KEY VALUE: argparse would call VALUE unrecognized
            value = (
                tokens[i + 2]
                if i + 2 < len(tokens) and not tokens[i + 2].startswith("-")
                else "VALUE"
            )
            raise QueueError(f"--set {key}: write KEY=VALUE, e.g. --set {key}={value}")
        if not is_fit_option(token) or name == "config":
            out.append(token)
            i += 1
        elif name in RESERVED_KEYS:  # named as given: the user wrote no --set
            value = token.partition("=")[2] if "=" in token else None
            if value is None and i + 1 < len(tokens) and not tokens[i + 1].startswith("-"):
                value = tokens[i + 1]
            given = token if "=" in token or value is None else f"{token} {value}"
            raise QueueError(reserved_line(given, name, value))
        elif "=" in token:
            out += ["--set", token[2:]]
            i += 1
        elif i + 1 < len(tokens):
            out += ["--set", f"{name}={tokens[i + 1]}"]
            i += 2
        else:
            raise QueueError(f"{token} needs a value, e.g. {token} VALUE")
    return out


def queue_prog(argv: Sequence[str] | None = None) -> str:
    """``nanolab queue <verb>`` as the user typed it (the verb comes first: ``--db`` and the
    other options are each verb's own), for the one-line errors of :func:`main`."""
    raw = list(sys.argv[1:] if argv is None else argv)
    return f"nanolab queue {raw[0]}" if raw and not raw[0].startswith("-") else "nanolab queue"


@one_line_errors(queue_prog)  # a write refused for room or rights (stdout too): one line, as others
def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    try:
        raw = dotted_as_sets(raw)
    except QueueError as err:
        return report("nanolab queue add", err)
    parser = build_parser()
    args, unknown = parser.parse_known_args(raw)
    if unknown:
        from nanolab.queue.jobs import unknown_option_line

        options = verb_options(parser, args.verb)
        if args.verb == "add":
            line = unknown_option_line(unknown, other_verbs_options(parser), options)
            if line is not None:
                return report("nanolab queue add", QueueError(line))
        # The verb's own parser: the line names the verb and its own --help, not the queue's.
        verb_parsers(parser)[args.verb].error(unrecognized_line(unknown, options))
    try:
        return int(args.func(args))
    except KeyboardInterrupt:  # a Ctrl-C before the runner's own handling (SQLite's lock wait)
        print(f"nanolab queue {args.verb}: interrupted", file=sys.stderr)
        return 130
    except NanolabError as err:
        return report(f"nanolab queue {args.verb}", err)
    except sqlite3.DatabaseError as err:  # damage, a full disk or a lock met past the opening
        path = Path(args.db) if args.db else default_db_path()
        line = busy_db(path, err) or read_only_db(path, err)
        if line is None and (room := no_room(path, err)) is not None:  # exit 74, as every full disk
            return report(f"nanolab queue {args.verb}", with_errno_of(QueueError(room), ENOSPC))
        line = line or unusable_db(path, f"failed: {err}")
        print(f"nanolab queue {args.verb}: error: {line}", file=sys.stderr)
        return 2
