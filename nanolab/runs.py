"""Reading run folders: the one account of a run that ``report``, ``queue`` and ``scaling`` share.

A run folder holds ``metrics.jsonl`` (read through :mod:`nanolab.runlog`, which skips a
half-written last line) and LightningCLI's ``config.yaml``. :func:`summarize_run` turns it into a
:class:`RunSummary` whatever state the run is in: finished (the ``end`` record's reason), still
running (no ``end`` yet, recent records) or crashed (no ``end`` and silent for a while, e.g.
SIGKILL or a lost machine). A resumed run repeats the steps after its last checkpoint; the later
copy of a step is the one that counts. :func:`seed_free_fingerprint` is what makes runs seeds of
one experiment (the report's groups, the queue's history).
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import json
import math
import re
import statistics
import time
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanolab.downstream.tasks import suite_name_of
from nanolab.errors import NanolabError
from nanolab.processes import gone_lock_holder, lock_file_missing
from nanolab.runlog import (
    CHECKPOINT_DIR,
    CONFIG_HEADER,
    CONFIG_MARK,
    RUN_LOG_NAME,
    FollowedLog,
    event_marks,
    iter_backwards,
    iter_numbered,
    iter_records,
    started_from_another_run,
    written_in_training,
)

#: Seconds without a new record after which a run with no ``end`` record counts as crashed
#: (unless its own step time says records are naturally further apart). A run whose lock
#: names a dead process of this host counts as crashed at once.
STALE_AFTER_S = 600.0


#: Config keys that differ between seeds of one experiment (dropped before grouping).
SEED_KEYS = (
    ("seed_everything",),
    ("run", "name"),
    ("run", "root"),
    ("run", "resume"),
    ("run", "fresh"),
    ("trainer", "default_root_dir"),
    ("ckpt_path",),
    ("config",),
    ("__path__",),
)


#: Logged training steps averaged for the end point of "Δ train loss".
DELTA_WINDOW = 10


class RunsError(NanolabError):
    """A folder of runs that cannot be read (missing, not a folder)."""


class ValPoints:
    """A run's (tokens, val loss) points, held as two packed columns: 16 bytes a point, where a
    list of tuples took ~120 (a report of 50 runs x 10^5 validations held 570 MiB of them).
    Reads as the list of tuples it replaces: iterated, counted, compared with a list."""

    def __init__(self, points: Iterable[tuple[int, float]]) -> None:
        self._tokens: array[int] | list[int] = array("q")
        self._losses = array("d")
        for tokens, loss in points:
            try:
                self._tokens.append(tokens)
            except OverflowError:  # a count past 2^63 (a hand-edited log): held as it is
                self._tokens = [*self._tokens, tokens]
            self._losses.append(loss)

    def __iter__(self) -> Iterator[tuple[int, float]]:
        return zip(self._tokens, self._losses, strict=True)

    def __len__(self) -> int:
        return len(self._tokens)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ValPoints | list | tuple):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ValPoints({list(self)!r})"


@dataclass
class RunSummary:
    """One run, as the report shows it (every figure from its own log; None = not logged)."""

    run: str
    status: str  # an end reason (completed, budget, ...), "running" or "crashed"
    detail: str | None = None  # error text, or why a run counts as crashed
    steps: int | None = None
    tokens: int | None = None
    #: The tokens this run trained itself (:func:`own_tokens`: a branch's without its
    #: parent's, which its gpu_hours and cost do not count either); None: not known
    run_tokens: int | None = None
    train_loss: float | None = None
    best_val_loss: float | None = None
    best_val_step: int | None = None
    final_val_loss: float | None = None
    best_val_bpb: float | None = None  # bits per byte at the best val step (null: no byte counts)
    final_val_bpb: float | None = None
    first_val_loss: float | None = None
    start_loss: float | None = None  # training loss of the first logged step
    improvement: float | None = None  # start_loss - mean of the last DELTA_WINDOW after the first
    tokens_per_s: float | None = None
    mfu: float | None = None
    gpu_hours: float | None = None
    cost: float | None = None
    wall_s: float | None = None
    seed: int | None = None
    resumes: int = 0
    rollbacks: int = 0  # loss spikes rolled back (``spike`` records with a restored step)
    #: (tokens, val loss) of every validation, for comparisons at equal tokens (not in --json)
    val_points: ValPoints = field(default_factory=lambda: ValPoints([]), repr=False)
    started: float | None = None
    updated: float | None = None
    run_dir: str = ""
    group: str | None = field(default=None, repr=False)  # fingerprint of the seed-free config
    #: What its data holds (the start record's ``data_identity``; None: an older log)
    data_identity: str | None = field(default=None, repr=False)
    #: The newest ``tasks`` record written during training (--downstream.suite): its mean
    #: centered accuracy (CORE only when ``suite`` is core), scores per task, step and suite.
    core: float | None = None
    task_scores: dict[str, float] = field(default_factory=dict, repr=False)  # name -> score
    tasks_step: int | None = None  # the step that record scored
    suite: str | None = None
    #: The same from the newest record ``nanolab eval`` appended (kept apart: it scores a
    #: checkpoint afterwards, perhaps with another suite or precision).
    eval_core: float | None = None
    eval_task_scores: dict[str, float] = field(default_factory=dict, repr=False)
    eval_step: int | None = None
    eval_suite: str | None = None
    #: The newest val loss ``nanolab validate`` appended after training (kept apart from the
    #: training curve and its best, which ``--ckpt_path best`` reads): value, step, bpb.
    evaluated_val_loss: float | None = None
    evaluated_val_step: int | None = None
    evaluated_val_bpb: float | None = None
    accelerator: str | None = None  # the start record's (CPUAccelerator, CUDAAccelerator, ...)
    skipped_records: int = 0  # valid JSON of the wrong shape (e.g. a string step), not used
    skipped_example: str | None = None  # what was wrong with the first of them


#: Record fields the report reads, by the JSON type it needs (null is always fine). A record
#: breaking one of these is skipped and counted, so one hand-edited or foreign line cannot
#: take down the report of every run.
NUMBER_FIELDS = (
    "time", "loss", "val_loss", "tokens", "tokens_per_s", "mfu", "gpu_hours", "cost",
    "elapsed_s", "step_time_s",
)  # fmt: skip
TEXT_FIELDS = ("reason", "error")
LOSS_FIELDS = ("loss", "val_loss")


# -- finding runs ---------------------------------------------------------------------------
def check_root(root: Path) -> None:
    """A folder of runs named on the command line is one: a typo is one line, not an empty list."""
    if not root.exists():
        raise RunsError(f"{root} does not exist; pass the folder that holds your runs")
    if not root.is_dir():
        raise RunsError(f"{root} is not a folder; pass the folder that holds your runs")


def discover_runs(roots: list[Path]) -> list[tuple[str, Path]]:
    """(display name, run directory) of every run under ``roots``; a root may be a run itself.

    Archived runs (``<run>/previous/...``) are not listed: a run nested inside another is skipped.
    A run reached through two roots (``runs runs/debug``, ``runs ./runs``) is listed once, as the
    first root found it.
    """
    found: list[tuple[str, Path]] = []
    for root in roots:
        check_root(root)
        if (root / RUN_LOG_NAME).is_file():
            found.append((root.resolve().name, root))
            continue
        logs = (p for p in root.rglob(RUN_LOG_NAME) if p.is_file())
        dirs = sorted({p.parent for p in logs}, key=lambda p: len(p.parts))
        kept: set[Path] = set()  # shallowest first: a run's folders above it are already in
        for d in dirs:
            if not any(p in kept for p in d.parents):
                kept.add(d)
        found += [(d.relative_to(root).as_posix(), d) for d in sorted(kept)]
    unique: dict[Path, tuple[str, Path]] = {}
    for name, run_dir in found:
        unique.setdefault(run_dir.resolve(), (name, run_dir))  # the first root that found it
    found = list(unique.values())
    names = [n for n, _ in found]
    if len(set(names)) != len(names):  # same name under two roots: qualify with the root
        found = [(str(d), d) for _, d in found]
    return found


# -- reading one run ------------------------------------------------------------------------
def record_problem(record: dict[str, Any]) -> str | None:
    """What makes ``record`` unusable (e.g. "'step' is str '7'"), or None when it is fine."""

    def shown(value: Any) -> str:
        return f"{type(value).__name__} {json.dumps(value, default=str)[:20]}"

    if not isinstance(record.get("event"), str):
        return f"'event' is {shown(record.get('event'))}" if "event" in record else "no 'event'"
    step = record.get("step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        return f"'step' is {shown(step)}"
    wanted = [*((k, (int, float)) for k in NUMBER_FIELDS), *((k, str) for k in TEXT_FIELDS)]
    for key, types in [*wanted, ("seed", int)]:
        value = record.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
            return f"'{key}' is {shown(value)}"
    for key in LOSS_FIELDS:  # a cross-entropy is never negative: a foreign or edited line
        value = record.get(key)
        if value is not None and value < 0:
            return f"'{key}' is negative ({value:g})"
    return None


def read_run(run_dir: Path) -> tuple[list[dict[str, Any]], int, str | None]:
    """A run's usable records, how many were skipped for their shape, and the first reason."""
    records: list[dict[str, Any]] = []
    skipped, example = 0, None
    for r in iter_records(run_dir / RUN_LOG_NAME):
        problem = record_problem(r)
        if problem is None:
            records.append(r)
            continue
        skipped += 1
        if example is None:
            example = f"a {r.get('event')!s:.20} record whose {problem}"
    return records, skipped, example


def tail_records(run_dir: Path, event: str, n: int = 1) -> list[dict[str, Any]]:
    """The last ``n`` usable records of kind ``event``, oldest first, read from the end of the
    log: the newest ``n`` are parsed, not the whole log (a long run's one ``start`` record is
    on its first line; lines end where :func:`iter_records` ends them)."""
    newest = iter_backwards(
        run_dir / RUN_LOG_NAME, event, where=lambda r: record_problem(r) is None, split_cr=True
    )
    with contextlib.closing(newest):
        return list(itertools.islice(newest, n))[::-1]


def last_by_step(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per step, the latest copy (a resume redoes the steps after its checkpoint)."""
    by_step: dict[Any, dict[str, Any]] = {}
    for r in records:
        by_step.pop(r.get("step"), None)  # re-insert so the order follows the surviving timeline
        by_step[r.get("step")] = r
    return sorted(by_step.values(), key=lambda r: (r.get("step") is None, r.get("step") or 0))


def num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def planned_steps_of(start: dict[str, Any] | None, config: dict[str, Any]) -> int:
    """The end a run's last launch planned its LR cosine for, as its start record says
    (``planned_steps``: ``trainer.max_steps``, or where ``budget.max_tokens`` stops a run of
    ``max_steps`` -1; :func:`nanolab.training.optim.planned_steps`), -1 when nothing bounds it. A log written
    before the record had it: the config's ``trainer.max_steps``. ``report``'s forecast plans
    with it; ``status`` counts to :func:`expected_end_of` (this, for a log without it)."""
    if start is not None and "planned_steps" in start:
        planned = num(start.get("planned_steps"))
    else:
        planned = num((config.get("trainer") or {}).get("max_steps"))
    return int(planned) if planned and planned > 0 else -1


def own_tokens(
    tokens: float | None, run_tokens: Any, first_start: dict[str, Any] | None
) -> float | None:
    """The tokens a run trained itself, what its GPU-hours and cost were paid for: its records'
    ``run_tokens``. A branch's ``tokens`` go on from its parent's while its hours count from
    zero: its hours over them read a fine-tune of a long pretrain as 1000x cheaper per token.
    A log from before the records said so: all of ``tokens``, unless its first launch was a
    branch (:func:`~nanolab.runlog.started_from_another_run`), whose own share is not known."""
    own = num(run_tokens) if not isinstance(run_tokens, bool) else None
    if own is not None:
        return own
    if first_start is not None and started_from_another_run(first_start):
        return None
    return tokens


def _set_tokens(
    s: RunSummary,
    end: dict[str, Any] | None,
    tokens: Any,
    run_tokens: Any,
    first_start: dict[str, Any] | None,
) -> None:
    """``s.tokens`` and ``s.run_tokens`` (:func:`own_tokens`) from the end of the last launch,
    else from the newest train record's ``tokens`` and ``run_tokens``: one rule for
    :func:`summarize_run` and :func:`summarize_tail`, so a branch's own tokens are its own in
    every view (its ``tokens`` go on from its parent's)."""
    total = (end or {}).get("tokens", tokens)
    total = None if isinstance(total, bool) else num(total)
    s.tokens = int(total) if total is not None else None
    own = own_tokens(s.tokens, (end or {}).get("run_tokens", run_tokens), first_start)
    s.run_tokens = int(own) if own is not None else None


def expected_end_of(start: dict[str, Any] | None, config: dict[str, Any]) -> tuple[int, bool]:
    """(step, estimated) where a run's last launch ends, as its start record says
    (``expected_end``: the first of ``trainer.max_steps`` and its budgets' stops, an hours or
    cost limit's an estimate), -1 when nothing bounds it. A log written before the record had
    it: :func:`planned_steps_of` (a token budget's stop counted only with ``max_steps`` -1).
    What ``status`` counts progress and its ETA to."""
    if start is None or "expected_end" not in start:
        return planned_steps_of(start, config), False
    end = start.get("expected_end")
    step = num(end.get("step")) if isinstance(end, dict) else None
    if not step or step <= 0:
        return -1, False
    return int(step), bool(end.get("estimated"))


def measured_pace(records: list[dict[str, Any]]) -> float | None:
    """Wall seconds a step over consecutive train records (oldest first): the ``elapsed_s``
    between them over the steps between, so evaluations and saves count, as the time a
    budget counts does. Pairs across a resume (the step or the clock not moving on) are
    left out; None: no two records of one launch."""
    seconds = steps = 0.0
    for before, after in itertools.pairwise(records):
        t0, t1 = num(before.get("elapsed_s")), num(after.get("elapsed_s"))
        s0, s1 = num(before.get("step")), num(after.get("step"))
        if None in (t0, t1, s0, s1) or not (s1 > s0 and t1 >= t0):  # type: ignore[operator]
            continue
        seconds, steps = seconds + t1 - t0, steps + s1 - s0  # type: ignore[operator]
    return seconds / steps if steps and seconds > 0 else None


@dataclass(frozen=True)
class MeasuredCourse:
    """Where a launch that an hours, GPU-hours or cost limit bounds ends, made again from its
    log (:func:`measured_course`)."""

    end: int  # the step it ends at
    by: str  # the setting that ends it there
    seconds_left: float | None  # wall seconds its time or money limits leave after ``spent``

    @property
    def estimated(self) -> bool:
        """A time or cost limit's end: a step time turned it into steps (said ``~``)."""
        from nanolab.estimator.run_length import HOUR_LIMITS

        return self.by in HOUR_LIMITS


def measured_course(
    start: dict[str, Any] | None, last: dict[str, Any] | None, step_s: float | None
) -> MeasuredCourse | None:
    """Where a launch ends by the run-length rule fit's budget stops it by
    (:func:`nanolab.estimator.run_length.run_length`), asked with the launch's config and
    batch (its ``start`` record), what the run has spent by its newest train record ``last``
    (step, own tokens, elapsed hours, GPU-hours) and a measured ``step_s``: not the start
    record's ``expected_end``, which a time limit's start-up guess fixed for good. None: no
    such inputs, no time or cost limit, or a token limit without the tokens a step trains."""
    from nanolab.estimator.run_length import Budget, Spent, hour_limits, run_length

    config = (start or {}).get("config")
    if not isinstance(config, dict) or last is None or not step_s or step_s <= 0:
        return None
    step = last.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        return None
    budget = Budget.from_config(config.get("budget"))
    per_step = _whole((start or {}).get("global_batch_tokens"))
    world = max(1, _whole((start or {}).get("world_size")))
    tokens = own_tokens(num(last.get("tokens")), last.get("run_tokens"), None)
    spent = Spent(
        step=step,
        tokens=int(tokens or 0),
        wall_hours=(num(last.get("elapsed_s")) or 0.0) / 3600,
        gpu_hours=num(last.get("gpu_hours")) or 0.0,
    )
    left = hour_limits(budget, world, spent)
    if not left or (budget.max_tokens is not None and per_step <= 0):
        return None
    trainer = config.get("trainer") if isinstance(config.get("trainer"), dict) else {}
    bound = _whole(trainer.get("max_steps"))
    length = run_length(bound if bound > 0 else None, budget, per_step, step_s, world, spent)
    if length is None:
        return None
    seconds = max(0.0, min(hours for hours, _ in left) * 3600)
    return MeasuredCourse(length.steps, length.source, seconds)


def _whole(value: Any) -> int:
    """An integer field of a record (0 when absent or not one)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def recent_mean(records: list[dict[str, Any]], key: str, n: int = 50) -> float | None:
    values = [v for v in (num(r.get(key)) for r in records[-n:]) if v is not None]
    return statistics.fmean(values) if values else None


def recent_rates(records: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """``(tokens/s, MFU)`` over consecutive train records: their tokens over their active time.

    Each record's ``tokens_per_s`` covers the interval since the record before it, so the rate
    of several is the tokens of all the intervals over the sum of their times (each interval's
    tokens divided by its rate), not the mean of the rates: a mean of rates counts a fast
    interval as much as a slow one of the same tokens and overstates a run whose steps vary
    (on a busy machine by 3x). MFU, proportional to the rate, is weighted by time the same way.
    With one usable record its own rates are returned."""
    tokens = seconds = mfu_seconds = mfu_weight = 0.0
    for before, record in itertools.pairwise(records):
        start, end = num(before.get("tokens")), num(record.get("tokens"))
        rate, mfu = num(record.get("tokens_per_s")), num(record.get("mfu"))
        if start is None or end is None or rate is None or rate <= 0 or end <= start:
            continue
        interval = (end - start) / rate
        tokens, seconds = tokens + end - start, seconds + interval
        if mfu is not None:
            mfu_seconds, mfu_weight = mfu_seconds + mfu * interval, mfu_weight + interval
    if seconds > 0:
        return tokens / seconds, (mfu_seconds / mfu_weight if mfu_weight > 0 else None)
    last = records[-1] if records else {}
    return num(last.get("tokens_per_s")), num(last.get("mfu"))


def last_value(records: list[dict[str, Any]], key: str) -> Any:
    return next((r[key] for r in reversed(records) if r.get(key) is not None), None)


#: Top-level keys of every config a run wrote before the header: the parser's whole dump
#: (``ckpt_path`` and ``weights_only`` are the verb's own, never in a hand-written config).
_DUMPED_KEYS = frozenset({"trainer", "model", "data", "run", "ckpt_path", "weights_only"})


def foreign_config(run_dir: Path) -> str | None:
    """Why a run may not start in ``run_dir``, which holds no run: a ``config.yaml`` that no
    run wrote, which the run's own would replace (a queued job's own ``--config``, notes).
    A run's copy has the header; one written before it had the parser's whole dump. None
    when there is none, or it is a run's."""
    path = run_dir / "config.yaml"
    try:
        with path.open("rb") as f:
            first = f.readline(len(CONFIG_HEADER) + 1)
    except OSError:  # none (or unreadable: the writability check speaks for it)
        return None
    if first.startswith(CONFIG_MARK):
        return None
    try:
        import yaml

        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except Exception:  # not YAML or not text: certainly not a run's copy
        data = None
    if isinstance(data, dict) and data.keys() >= _DUMPED_KEYS:
        return None  # a run's copy from before the header (a launch killed at start-up)
    return (
        f"{path} is not a config a run wrote (the folder holds no run log), and the run writes "
        "its own there: move that file out of the run directory (e.g. to configs/) and point "
        "--config at the new place, choose another run.name, or set run.fresh: true to move it "
        "to previous/"
    )


def start_data_identity(start: dict[str, Any] | None) -> str | None:
    """A start record's ``data_identity`` (what the run's data holds), None when not logged."""
    value = (start or {}).get("data_identity")
    return value if isinstance(value, str) and value else None


def data_identity_of(start: dict[str, Any] | None, run_dir: Path) -> str | None:
    """What a run's data held: its start record's ``data_identity``, or for a log from before
    that record, the identity its newest checkpoint file stored (its DataModule's data record:
    what it trained on, not what a folder of that name holds now, which may have been prepared
    again or be another project's); None when neither says."""
    logged = start_data_identity(start)
    if logged is not None or start is None:
        return logged
    try:
        files = [p for p in (run_dir / CHECKPOINT_DIR).glob("*.ckpt") if p.is_file()]
    except OSError:
        return None
    if not files:
        return None
    from nanolab.data.checks import checkpoint_data_identity

    newest = max(files, key=lambda p: (p.stat().st_mtime, p.name))
    return checkpoint_data_identity(newest)


def config_of(records: list[dict[str, Any]], run_dir: Path) -> dict[str, Any] | None:
    """The config of a run's last start: its ``start`` record's, else ``config.yaml``'s."""
    start = next((r for r in reversed(records) if r.get("event") == "start"), None)
    config = start.get("config") if start else None
    if isinstance(config, dict):
        return config
    saved = run_dir / "config.yaml"  # LightningCLI's copy of the merged config
    if not saved.is_file():
        return None
    import yaml

    from nanolab.training.resolve import load_yaml  # configs are read one way

    try:
        loaded = load_yaml(saved.read_text(encoding="utf-8"))
    except (yaml.YAMLError, OSError, UnicodeDecodeError):
        return None
    return loaded if isinstance(loaded, dict) else None


def seed_free_fingerprint(config: dict[str, Any] | None, keep_nulls: bool = False) -> str | None:
    """The config without seed, run name and paths, as canonical JSON (None when unknown).

    A key set to null is dropped unless ``keep_nulls`` (the report's groups keep it: a null
    option is a value, ``attention_window: null`` is not ``attention_window: 8``)."""
    if config is None:
        return None
    plain = json.loads(json.dumps(config, default=str))
    for path in SEED_KEYS:
        node = plain
        for key in path[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(path[-1], None)
    plain = plain if keep_nulls else _drop_nulls(plain)
    return json.dumps(plain, sort_keys=True, separators=(",", ":"))


def _drop_nulls(value: Any) -> Any:
    """A key set to null reads like a key that is absent: a newer nanolab adding an option whose
    default is null must not split the seeds of one experiment into two groups."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def current_timeline(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The log without what a later start abandoned: a run that resumed from step R (after a
    rollback from a loss spike, or a preemption resumed from an older checkpoint) retrains the
    steps after R, so the step records logged after R before that start are dropped."""
    keep = [True] * len(records)
    for j, r in enumerate(records):
        resumed = r.get("resumed_from_step") if r.get("event") == "start" else None
        if not isinstance(resumed, int) or isinstance(resumed, bool):
            continue
        for i in range(j):
            step = records[i].get("step")
            if records[i].get("event") in STEP_EVENTS and isinstance(step, int) and step > resumed:
                keep[i] = False
    return [r for r, k in zip(records, keep, strict=True) if k]


#: Records that describe the model at their step (the ones a retrained step replaces).
STEP_EVENTS = ("train", "val", "tasks")


def summarize_run(
    name: str,
    run_dir: Path,
    now: float | None = None,
    also: Callable[[dict[str, Any]], None] | None = None,
) -> RunSummary:
    """Everything the report says about one run, from its log (and ``config.yaml`` if needed).

    The log is read as a stream, twice: first the few ``start`` records (where a resume
    rewound to), then every record once, kept only as the running figures below. Memory stays
    flat in the log's length (a 300k-step run logs over 100 MB); the only lists kept are the
    validations, one small entry each. ``also`` is handed each usable record of the timeline a
    resume leaves (every event, in log order: what :func:`iter_timeline` yields) during that
    same pass, so another reader of the run (``report --forecast``) does not read the log again
    (a 500k-record log is 7 s of parsing)."""
    now = time.time() if now is None else now
    log = run_dir / RUN_LOG_NAME
    acc = _RunStream(_Rewinds(_resume_points(log)))
    for number, record in iter_numbered(log):
        if acc.add(number, record) and also is not None:
            also(record)
    return acc.summary(name, run_dir, now)


def iter_timeline(
    run_dir: Path, events: tuple[str, ...] = STEP_EVENTS, launch: Launch | None = None
) -> Iterator[dict[str, Any]]:
    """The usable records of ``events`` on the timeline a resume leaves (what
    :func:`current_timeline` keeps of :func:`read_run`'s records), streamed: one record in
    memory at a time, however long the log. With ``launch``, the timeline as that launch left
    it: the log up to the next launch's start, without what that launch (or one before it)
    abandoned; what later launches did to the steps is not this one's history."""
    log = run_dir / RUN_LOG_NAME
    points = _resume_points(log)
    if launch is not None:
        points = [p for p in points if p[0] <= launch.line]
    rewinds = _Rewinds(points)
    for number, r in iter_numbered(log, containing=event_marks(events)):
        if launch is not None and number >= launch.next_line:
            return
        usable = r.get("event") in events and record_problem(r) is None
        if usable and not rewinds.abandoned(number, r):
            yield r


@dataclass
class Launch:
    """One launch of a run, as its log shows it (:func:`launch_that_saved`)."""

    start: dict[str, Any]  # its start record
    line: int  # the line of that record
    next_line: float  # the line of the next launch's start (math.inf: none came after)
    saved_line: int  # the line of its checkpoint record of the step asked about


def launch_that_saved(run_dir: Path, step: int) -> Launch | None:
    """The launch that wrote the checkpoint of ``step`` the run holds now: the one whose
    ``checkpoint`` record of that step is the newest (a later save of a step replaces the
    file, and a resume from an older checkpoint sets the later files aside). A run resumed
    from an older step trains that step again on another timeline: its figures are the ones
    of the launch that saved it. None when no launch logged a save of ``step`` (a log from
    before checkpoint records, a file copied in)."""
    starts: list[tuple[int, dict[str, Any]]] = []
    saved: tuple[int, int] | None = None  # (line, index of the launch)
    marks = event_marks(("start", "checkpoint"))
    for number, r in iter_numbered(run_dir / RUN_LOG_NAME, containing=marks):
        if record_problem(r) is not None:
            continue
        if r.get("event") == "start":
            starts.append((number, r))
        elif r.get("event") == "checkpoint" and r.get("step") == step and starts:
            saved = (number, len(starts) - 1)
    if saved is None:
        return None
    line, start = starts[saved[1]]
    later = starts[saved[1] + 1 :]
    return Launch(start, line, later[0][0] if later else math.inf, saved[0])


def last_trained_val(run_dir: Path) -> dict[str, Any] | None:
    """Training's newest validation on the run's timeline, read from the end of the log: not
    one a later resume from an older step abandoned (a launch stopped before it validated
    again), nor a ``nanolab validate`` appended after training."""
    floor = _Floor()
    newest = iter_backwards(run_dir / RUN_LOG_NAME, ("start", "val"), where=_usable, split_cr=True)
    with contextlib.closing(newest):
        for r in newest:
            if not floor.abandoned(r) and r.get("event") == "val" and written_in_training(r):
                return r
    return None


#: Run-log events other than ``train``: a few per validation, against one ``train`` record per
#: logged step. :func:`summarize_tail` reads these over the whole log, parsing only their lines.
SPARSE_EVENTS = ("start", "end", "val", "budget", "checkpoint", "spike", "tasks", "log_recreated")
#: The newest train records a status line reads as they are (its memory, utilisation, ETA).
NEWEST_TRAIN = 20


@dataclass
class RunTail:
    """What ``nanolab status`` shows of a run, read from the end of its log by
    :func:`summarize_tail`: the summary's fields a status line uses, the newest usable
    ``start`` record, and the newest :data:`NEWEST_TRAIN` train records (oldest first)."""

    summary: RunSummary
    start: dict[str, Any] | None
    train: list[dict[str, Any]]


def summarize_tail(
    name: str, run_dir: Path, now: float | None = None, followed: FollowedRuns | None = None
) -> RunTail:
    """The fields of :func:`summarize_run` that a status line shows (status and detail, steps,
    training loss, best and final validation, tokens/s and MFU, wall time, first and last
    record time), the same figures, without parsing the log's train records: a long run logs
    one per step (300k lines), and a screen redrawn every few seconds over hundreds of runs
    cannot parse every line of every log (40 us a record: 8 s for one 200k-step run).

    Two reads from the end of the log. The sparse records (:data:`SPARSE_EVENTS`: every start,
    end and validation) over the whole log, only their lines parsed: where each resume rewound
    to, the end of the last launch, every validation. The train records newest first, until the
    last ``RECENT + 1`` steps of the run's timeline, a training loss and an elapsed time are
    found: a few dozen lines (the whole log only for one that has none of them, an old one).
    The run's ``tokens`` and ``run_tokens`` are the end record's, else the newest train
    record's (as :func:`summarize_run` reads them). The other fields of the summary are left
    unset. ``followed`` (a screen redrawn by
    ``status --watch``) keeps each log's sparse records between calls: a redraw reads only
    what was appended since the one before."""
    now = time.time() if now is None else now
    log = run_dir / RUN_LOG_NAME
    s = RunSummary(run=name, status="crashed", run_dir=str(run_dir))
    sparse = _SparseRecords(log, None if followed is None else followed.newest_first(log))
    end, trains = (
        sparse.end,
        _NewestTrain(log, need_elapsed=(sparse.end or {}).get("elapsed_s") is None),
    )
    recent = _LastSteps(RECENT + 1)
    for r in reversed(trains.timeline):
        recent.add(_step_key(r), r)
    if trains.updated_record is not None:
        s.started, s.updated = num(trains.first_time), num(trains.updated_record.get("time"))
    _set_status(s, end, trains.updated_record is not None,
                recent_mean(recent.records(), "step_time_s", RECENT), now)  # fmt: skip
    steps = [v for v in (sparse.max_step, trains.max_step) if v is not None]
    s.steps = max(steps) if steps else None
    if end is not None and isinstance(end.get("step"), int):
        s.steps = end["step"]
    s.train_loss = num(trains.loss)
    _set_tokens(s, end, _newest_value(trains.timeline, "tokens"),
                _newest_value(trains.timeline, "run_tokens"), sparse.first_start)  # fmt: skip
    _set_val(s, [sparse.val[k] for k in sorted(sparse.val)])
    s.tokens_per_s, s.mfu = recent_rates(recent.records())
    value = (end or {}).get("elapsed_s")
    s.wall_s = num(value if value is not None else trains.elapsed)
    if s.wall_s is None and s.started is not None and s.updated is not None:
        s.wall_s = s.updated - s.started
    return RunTail(s, sparse.start, trains.newest[::-1])


def _newest_value(timeline: list[dict[str, Any]], key: str) -> Any:
    """``key`` of the record at the highest step that logged it, in train records of the
    timeline given newest first (a tie: the newer); None: none logged it."""
    best: dict[str, Any] | None = None
    for r in timeline:
        if r.get(key) is not None and (best is None or _step_key(r) > _step_key(best)):
            best = r
    return None if best is None else best[key]


class _Floor:
    """:class:`_Rewinds` read backwards: a step record is abandoned when a start after it (seen
    before it, newest first) resumed from a lower step."""

    def __init__(self) -> None:
        self.step = math.inf

    def abandoned(self, record: dict[str, Any]) -> bool:
        step = record.get("step")
        if record.get("event") == "start":
            resumed = record.get("resumed_from_step")
            if isinstance(resumed, int) and not isinstance(resumed, bool):
                self.step = min(self.step, resumed)
            return False
        return record.get("event") in STEP_EVENTS and isinstance(step, int) and step > self.step


def _usable(record: dict[str, Any]) -> bool:
    return record_problem(record) is None


#: The fields :class:`_SparseRecords` reads of a sparse record other than a start or an end
#: (which it keeps whole): what a followed log holds of each validation.
SPARSE_FIELDS = ("event", "step", "resumed_from_step", "evaluated_by", "tokens", "val_loss",
                 "val_bpb")  # fmt: skip


def _sparse_kept(record: dict[str, Any]) -> dict[str, Any]:
    if record.get("event") in ("start", "end"):
        return record
    return {k: record[k] for k in SPARSE_FIELDS if k in record}


class FollowedRuns:
    """The sparse records of each run log a screen shows, kept from one redraw to the next
    (``nanolab status --watch``): each redraw reads the bytes a log gained since the one
    before (:class:`~nanolab.runlog.FollowedLog`), and nothing of a finished run's. A 2M-record
    log cost 12.8 s per redraw read whole, 300 finished runs 18.9 s."""

    def __init__(self) -> None:
        self._logs: dict[Path, FollowedLog] = {}

    def newest_first(self, log: Path) -> list[dict[str, Any]]:
        """The usable :data:`SPARSE_EVENTS` records of ``log``, newest first (as
        :func:`~nanolab.runlog.iter_backwards` gives them), cut to what a status line reads."""
        followed = self._logs.get(log)
        if followed is None:
            followed = self._logs[log] = FollowedLog(
                log, SPARSE_EVENTS, where=_usable, split_cr=True, keep=_sparse_kept
            )
        return followed.records()[::-1]


class _SparseRecords:
    """The usable records of :data:`SPARSE_EVENTS` of a log, newest first, as
    :class:`_RunStream` keeps them: the end of the last launch (None when a start came after
    it), the newest start and the first (a branch's says so), the highest step on the timeline, the validations by step. Read from
    the end of ``log``, or given (``newest``: a followed log's)."""

    def __init__(self, log: Path, newest: Iterable[dict[str, Any]] | None = None) -> None:
        self.end: dict[str, Any] | None = None
        self.start: dict[str, Any] | None = None
        self.first_start: dict[str, Any] | None = None
        self.max_step: int | None = None
        self.val: dict[float, dict[str, Any]] = {}
        decided, floor = False, _Floor()
        reading = (
            None
            if newest is not None
            else iter_backwards(log, SPARSE_EVENTS, where=_usable, split_cr=True)
        )
        with contextlib.closing(reading) if reading is not None else contextlib.nullcontext():
            for r in reading if reading is not None else newest or ():
                event = r.get("event")
                if not decided and event in ("start", "end"):
                    decided, self.end = True, r if event == "end" else None
                if event == "start":
                    self.start, self.first_start = self.start or r, r  # newest first
                if floor.abandoned(r):
                    continue
                if isinstance(r.get("step"), int):
                    self.max_step = max(self.max_step or 0, r["step"])
                if event == "val" and not r.get("evaluated_by"):  # the newest copy of a step
                    self.val.setdefault(_step_key(r), {
                        k: r.get(k) for k in ("step", "tokens", "val_loss", "val_bpb")
                    })  # fmt: skip


class _NewestTrain:
    """A log's train records read newest first, as far as a status line needs them: the newest
    :data:`NEWEST_TRAIN` as they are, and on the run's timeline the last ``RECENT + 1`` steps,
    the newest training loss and (``need_elapsed``) elapsed time. Also the newest usable record
    (the run's last sign of life) and, when the whole log was read, the time of its first."""

    def __init__(self, log: Path, need_elapsed: bool) -> None:
        self.newest: list[dict[str, Any]] = []
        self.timeline: list[dict[str, Any]] = []  # newest first, cut to the fields read
        self.updated_record: dict[str, Any] | None = None
        self.loss: Any = None
        self.elapsed: Any = None
        self.max_step: int | None = None
        self.first_time: Any = None  # the oldest kept record's time, once the top is reached
        floor, steps, oldest_kept = _Floor(), set(), None
        records = iter_backwards(log, where=lambda r: record_problem(r) is None, split_cr=True)
        with contextlib.closing(records):
            for r in records:
                if self.updated_record is None:
                    self.updated_record = r
                if r.get("event") == "train" and len(self.newest) < NEWEST_TRAIN:
                    self.newest.append(r)
                if floor.abandoned(r):
                    continue
                oldest_kept = r
                if isinstance(r.get("step"), int):
                    self.max_step = max(self.max_step or 0, r["step"])
                if r.get("event") == "train":
                    self._train(r, steps)
                done = (len(steps) > RECENT and len(self.newest) >= NEWEST_TRAIN
                        and self.loss is not None and (self.elapsed is not None or not need_elapsed))  # fmt: skip
                if done:
                    return
        self.first_time = oldest_kept.get("time") if oldest_kept is not None else None

    def _train(self, r: dict[str, Any], steps: set[float]) -> None:
        key = _step_key(r)
        if key in steps or len(steps) <= RECENT:  # older ones would leave _LastSteps anyway
            steps.add(key)
            self.timeline.append({k: r.get(k) for k in (*TRAIN_KEPT, *TRAIN_LAST)})
        if self.loss is None:
            self.loss = r.get("loss")
        if self.elapsed is None:
            self.elapsed = r.get("elapsed_s")


class EvenSample:
    """At most ``2 * size`` items evenly spread over a stream of unknown length: every
    ``stride``-th item is kept, and when too many are, every other one is dropped and the
    stride doubles (the first item is always kept; ``last`` holds the last one seen)."""

    def __init__(self, size: int) -> None:
        self.size, self.stride, self.seen = size, 1, 0
        self.items: list[Any] = []
        self.last: Any = None

    def add(self, item: Any) -> None:
        if self.seen % self.stride == 0:
            self.items.append(item)
            if len(self.items) > 2 * self.size:
                self.items, self.stride = self.items[::2], self.stride * 2
        self.seen += 1
        self.last = item


def _resume_points(log: Path) -> list[tuple[int, int]]:
    """(line number, resumed_from_step) of each usable start that resumed from a step."""
    points = []
    for number, r in iter_numbered(log, containing='"start"'):
        resumed = r.get("resumed_from_step")
        usable = r.get("event") == "start" and record_problem(r) is None
        if usable and isinstance(resumed, int) and not isinstance(resumed, bool):
            points.append((number, resumed))
    return points


class _Rewinds:
    """Which step records a later resume abandoned (:func:`current_timeline`, as a stream):
    a step record on line i is dropped when a start after line i resumed from a lower step."""

    def __init__(self, points: list[tuple[int, int]]) -> None:
        self.lines = [n for n, _ in points]
        self.floor = [min(r for _, r in points[i:]) for i in range(len(points))]
        self.next = 0  # the first resume after the current line (lines come in order)

    def abandoned(self, number: int, record: dict[str, Any]) -> bool:
        while self.next < len(self.lines) and self.lines[self.next] <= number:
            self.next += 1
        step = record.get("step")
        return (
            self.next < len(self.lines)
            and record.get("event") in STEP_EVENTS
            and isinstance(step, int)
            and step > self.floor[self.next]
        )


def _step_key(record: dict[str, Any]) -> float:
    """A record's place in the timeline by step (no step sorts last, as in :func:`last_by_step`)."""
    step = record.get("step")
    return math.inf if step is None else float(step)


class _LastSteps:
    """The latest copy of each of the ``k`` highest steps: the end of ``last_by_step(records)``
    without the rest of it (a step once pushed out by k higher steps never comes back)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.steps: list[float] = []
        self.by_step: dict[float, dict[str, Any]] = {}

    def add(self, key: float, record: dict[str, Any]) -> None:
        if key not in self.by_step:
            if self.steps and key > self.steps[-1]:
                self.steps.append(key)  # the usual case: the next step
            elif len(self.steps) >= self.k and key < self.steps[0]:
                return
            else:
                bisect.insort(self.steps, key)
            if len(self.steps) > self.k:
                del self.by_step[self.steps.pop(0)]
        self.by_step[key] = record

    def records(self) -> list[dict[str, Any]]:
        return [self.by_step[k] for k in self.steps]


#: The train fields a summary reads (a train record is cut to these before it is kept).
TRAIN_KEPT = ("step", "loss", "tokens", "tokens_per_s", "mfu", "step_time_s")
#: The train fields read as "the last one logged" (the end record's, when it has one, first).
TRAIN_LAST = ("tokens", "run_tokens", "loss", "gpu_hours", "cost", "elapsed_s")
#: Train records (intervals between them) averaged for tokens/s, MFU and step time.
RECENT = 50


class _RunStream:
    """The running figures of one log, fed record by record; :meth:`summary` makes the
    :class:`RunSummary` that :func:`summarize_run` returns."""

    def __init__(self, rewinds: _Rewinds) -> None:
        self.rewinds = rewinds
        self.skipped, self.example = 0, None
        self.starts, self.start, self.end = 0, None, None
        self.first_start: dict[str, Any] | None = None
        self.kept, self.first_time, self.last_time = 0, None, None
        self.max_step: int | None = None
        self.rollbacks = 0
        self.recent = _LastSteps(RECENT + 1)  # RECENT intervals between records
        self.losses = _LastSteps(DELTA_WINDOW + 1)  # train records with a loss
        self.first_loss: tuple[float, float] | None = None  # (step key, loss)
        # field -> (step key, value) at the highest step that logged it: last_value(train, field)
        self.last: dict[str, tuple[float, Any]] = dict.fromkeys(TRAIN_LAST, (-math.inf, None))
        self.val: dict[float, dict[str, Any]] = {}
        self.tasks: dict[str, Any] | None = None  # the newest in training
        self.evals: dict[str, Any] | None = None  # the newest by nanolab eval
        self.evaluated_val: dict[str, Any] | None = None  # the newest by nanolab validate

    def add(self, number: int, r: dict[str, Any]) -> bool:
        """Count record ``r`` (line ``number``) in; True when it is usable and on the timeline
        a resume leaves (what :func:`iter_timeline` yields)."""
        problem = record_problem(r)
        if problem is not None:
            self.skipped += 1
            if self.example is None:
                self.example = f"a {r.get('event')!s:.20} record whose {problem}"
            return False
        event = r.get("event")
        if event == "start":
            self.starts, self.start, self.end = self.starts + 1, r, None
            self.first_start = self.first_start or r
        elif event == "end":
            self.end = r
        if self.rewinds.abandoned(number, r):
            return False
        self.kept += 1
        self.first_time = r.get("time") if self.kept == 1 else self.first_time
        self.last_time = r.get("time")
        if isinstance(r.get("step"), int):
            self.max_step = max(self.max_step or 0, r["step"])
        if event == "spike" and r.get("restored") is not None:
            self.rollbacks += 1
        elif event == "train":
            self._train(r)
        elif event == "val" and not written_in_training(r):
            # validate after training: not the in-training curve (nor its best); kept apart
            if self.evaluated_val is None or _step_key(r) >= _step_key(self.evaluated_val):
                self.evaluated_val = r
        elif event == "val":
            self.val.pop(_step_key(r), None)  # the latest copy, in timeline order
            self.val[_step_key(r)] = {
                k: r.get(k) for k in ("step", "tokens", "val_loss", "val_bpb")
            }
        elif event == "tasks" and not written_in_training(r):
            if self.evals is None or _step_key(r) >= _step_key(self.evals):
                self.evals = r
        elif event == "tasks" and (self.tasks is None or _step_key(r) >= _step_key(self.tasks)):
            self.tasks = r
        return True

    def _train(self, r: dict[str, Any]) -> None:
        key = _step_key(r)
        kept = {k: r.get(k) for k in TRAIN_KEPT}
        self.recent.add(key, kept)
        for f, (at, _) in self.last.items():
            value = r.get(f)
            if value is not None and key >= at:  # a later copy of a step replaces it
                self.last[f] = (key, value)
        loss = num(r.get("loss"))
        if loss is not None:
            self.losses.add(key, kept)
            if self.first_loss is None or key <= self.first_loss[0]:
                self.first_loss = (key, loss)

    def train_delta(self) -> tuple[float | None, float | None]:
        """:func:`train_delta` from the first loss and the last ``DELTA_WINDOW + 1``."""
        if self.first_loss is None:
            return None, None
        first = self.first_loss[1]
        losses = [float(r["loss"]) for r in self.losses.records()]
        if len(losses) < 2:
            return first, None
        # Fewer than DELTA_WINDOW + 1 losses in all: the window holds the first one; leave it out.
        tail = losses[-DELTA_WINDOW:] if len(losses) > DELTA_WINDOW else losses[1:]
        return first, first - statistics.fmean(tail)

    def summary(self, name: str, run_dir: Path, now: float) -> RunSummary:
        s = RunSummary(run=name, status="crashed", run_dir=str(run_dir))
        s.skipped_records, s.skipped_example = self.skipped, self.example
        s.resumes = max(0, self.starts - 1)
        start, end = self.start, self.end
        recent = self.recent.records()
        val = [self.val[k] for k in sorted(self.val)]
        s.rollbacks = self.rollbacks
        config = config_of([start] if start else [], run_dir)
        s.group = seed_free_fingerprint(config, keep_nulls=True)
        s.data_identity = data_identity_of(start, run_dir)
        seed = (start or {}).get("seed", (config or {}).get("seed_everything"))
        seed_value = None if isinstance(seed, bool) else num(seed)
        s.seed = int(seed_value) if seed_value is not None else None
        if self.kept:
            s.started, s.updated = num(self.first_time), num(self.last_time)
        _set_status(s, end, self.kept, recent_mean(recent, "step_time_s", RECENT), now)
        s.steps = self.max_step
        if end is not None and isinstance(end.get("step"), int):
            s.steps = end["step"]
        _set_tokens(s, end, self.last["tokens"][1], self.last["run_tokens"][1], self.first_start)
        s.train_loss = num(self.last["loss"][1])
        _set_val(s, val)
        if self.tasks is not None:
            s.core, s.tasks_step = num(self.tasks.get("tasks/core")), self.tasks.get("step")
            s.task_scores, s.suite = task_scores(self.tasks), suite_name_of(self.tasks)
        if self.evals is not None:
            s.eval_core, s.eval_step = num(self.evals.get("tasks/core")), self.evals.get("step")
            s.eval_task_scores, s.eval_suite = task_scores(self.evals), suite_name_of(self.evals)
        if self.evaluated_val is not None:
            ev = self.evaluated_val
            s.evaluated_val_loss, s.evaluated_val_bpb = (
                num(ev.get("val_loss")),
                num(ev.get("val_bpb")),
            )
            s.evaluated_val_step = ev.get("step") if isinstance(ev.get("step"), int) else None
        accelerator = (start or {}).get("accelerator")
        s.accelerator = accelerator if isinstance(accelerator, str) else None
        s.start_loss, s.improvement = self.train_delta()
        s.tokens_per_s, s.mfu = recent_rates(recent)
        for f in ("gpu_hours", "cost", "elapsed_s"):
            value = (end or {}).get(f)
            setattr(s, "wall_s" if f == "elapsed_s" else f,
                    num(value if value is not None else self.last[f][1]))  # fmt: skip
        if s.wall_s is None and s.started is not None and s.updated is not None:
            s.wall_s = s.updated - s.started
        return s


def _set_status(
    s: RunSummary, end: dict[str, Any] | None, kept: int, step_time: float | None, now: float
) -> None:
    """The run's status and detail: its end's reason, or running / crashed by its silence."""
    if end is not None:
        s.status = str(end.get("reason") or "completed")
        s.detail = end.get("error") or None
        if s.status == "diverged" and end.get("diverged_step") is not None:
            s.detail = f"at step {end['diverged_step']}"
            if end.get("skipped_steps") is not None:  # steps skipped, not NaN: say which
                s.detail = f"fp16 loss scale collapsed {s.detail}"
    elif not kept:
        try:
            size = (Path(s.run_dir) / RUN_LOG_NAME).stat().st_size if s.run_dir else 0
        except OSError:
            size = 0
        s.status = "crashed"
        s.detail = (
            f"no readable record in its log ({size:,} bytes: damaged, or not a run log)"
            if size
            else "empty log"
        )
    elif s.run_dir and lock_file_missing(Path(s.run_dir)):
        # Every live launch of this nanolab holds its lock file: this run ended. The detail
        # says only what is seen: a log copied without the lock, or one an older nanolab
        # wrote without a lock, reads the same.
        s.status = "crashed"
        s.detail = "no end record and no run lock"
    elif (gone := gone_lock_holder(Path(s.run_dir)) if s.run_dir else None) is not None:
        s.status = "crashed"  # its lock names a process of this host that no longer runs
        s.detail = f"no end record; its process (pid {gone['pid']} on {gone['host']}) is gone"
    else:
        quiet = now - (s.updated or now)
        if quiet > max(STALE_AFTER_S, 20 * (step_time or 0.0)):
            s.status = "crashed"
            s.detail = f"no end record; silent for {duration(quiet)}"
        else:
            s.status = "running"


def _set_val(s: RunSummary, val: list[dict[str, Any]]) -> None:
    """Best, first and final validation, and the (tokens, val loss) points."""
    if not val:
        return
    best = min(
        (r for r in val if num(r.get("val_loss")) is not None),
        key=lambda r: r["val_loss"],
        default=None,
    )
    s.val_points = ValPoints(
        (int(r["tokens"]), float(r["val_loss"]))
        for r in val
        if isinstance(r.get("tokens"), int) and num(r.get("val_loss")) is not None
    )
    if best is not None:
        s.best_val_loss, s.best_val_step = float(best["val_loss"]), best.get("step")
        s.first_val_loss = num(next(r["val_loss"] for r in val if num(r.get("val_loss"))))
        s.final_val_loss = num(last_value(val, "val_loss"))
        s.best_val_bpb = num(best.get("val_bpb"))
        s.final_val_bpb = num(last_value(val, "val_bpb"))


def task_scores(record: dict[str, Any]) -> dict[str, float]:
    """``{task: score}`` of a ``tasks`` record: the accuracy its centered score is computed from."""
    return {
        key.split("/")[1]: float(value)
        for key, value in record.items()
        if re.fullmatch(r"tasks/[^/]*/score", key) and num(value) is not None
    }


def train_delta(train: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """(first logged training loss, that minus the mean of the last DELTA_WINDOW ones)."""
    losses = [v for v in (num(r.get("loss")) for r in train) if v is not None]
    if len(losses) < 2:
        return (losses[0] if losses else None), None
    tail = losses[max(1, len(losses) - DELTA_WINDOW) :]
    return losses[0], losses[0] - statistics.fmean(tail)


# -- formatting -----------------------------------------------------------------------------
def hours_label(accelerators: list[str | None]) -> str:
    """What the runs' device-hours are called: ``GPU-h`` when every run trained on GPUs,
    ``CPU-h`` when every one on CPUs, else ``device-h`` (a CPU run's hours are no GPU-hours)."""
    kinds = set(accelerators)
    if kinds and kinds <= {"CUDAAccelerator"}:
        return "GPU-h"
    if kinds and kinds <= {"CPUAccelerator"}:
        return "CPU-h"
    return "device-h"


def duration(seconds: float | None) -> str:
    """``45s``, ``3m07s``, ``2h05m`` (``-`` when unknown)."""
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f}s"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def si(value: float | None, fmt: str = ".3g", billion: str = "G") -> str:
    """``value`` in k, M, ``billion`` or T (``-`` when unknown)."""
    if value is None:
        return "-"
    for unit, scale in (("T", 1e12), (billion, 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:{fmt}}{unit}"
    return f"{value:{fmt}}"


# -- the index of ended runs -------------------------------------------------------------------
#: One JSON line per ended run, in the folder that holds the runs (``run.root``).
RESULTS_LOG = "results.log"


def append_result(path: Path, fields: dict[str, Any]) -> None:
    """One JSON line appended in one ``write`` to a file opened for appending (runs ending at
    once never interleave, and nothing already there is rewritten). A torn last line (no
    newline: a writer killed mid-line) is ended first, so the new line stays a line of its own."""
    import os

    line = (json.dumps(fields, default=str) + "\n").encode()
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            if size > 0 and os.pread(fd, 1, size - 1) != b"\n":
                line = b"\n" + line
            os.write(fd, line)
        finally:
            os.close(fd)
    except OSError as err:
        print(f"nanolab: warning: cannot append to {path} ({err.strerror or err})", flush=True)


def result_fields(s: RunSummary) -> dict[str, Any]:
    """The results.log line of an ended run, from its summary (the fields a run's own end
    writes, so lines added later read the same)."""
    return {
        "run": Path(s.run_dir).name,
        "reason": s.status,
        "detail": s.detail or "",
        "step": s.steps,
        "val_loss": None if s.final_val_loss is None else round(s.final_val_loss, 4),
        "best_val_loss": None if s.best_val_loss is None else round(s.best_val_loss, 4),
        "wall": duration(s.wall_s) if s.wall_s is not None else "",
        "wall_s": s.wall_s,
        "tokens": s.tokens,
        "run_dir": s.run_dir,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(s.updated or 0)),
    }


def indexed_runs(path: Path) -> set[tuple[str, Any, Any]]:
    """(run name, step, reason) of the lines already in a results.log: names, not paths, so the
    same root reached by another path (or copied) is not indexed twice."""
    return {
        (str(r.get("run") or Path(str(r.get("run_dir", ""))).name), r.get("step"), r.get("reason"))
        for r in (iter_records(path) if path.is_file() else [])
    }
