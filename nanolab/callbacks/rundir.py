"""Who owns a run directory: refuse to mix two runs in one, archive the old one when asked.

A run directory holds one run: its ``metrics.jsonl``, its ``checkpoints/`` and its ``config.yaml``.
Starting a second, different run in the same directory would interleave two logs and let the new
run's rotation delete the old run's checkpoints, so :func:`claim_run_dir` refuses (before anything
is written) unless the new process resumes the run from one of *its own* checkpoints, or is the
same configuration restarting from scratch after dying before its first checkpoint, or is told to
start fresh (``run.fresh: true``), in which case the old run's files are moved to
``<run_dir>/previous/<run_id>-<time>/``, never deleted.

A checkpoint of another run (``run.resume PATH`` or ``--ckpt_path``) may start a new run
directory (fine-tuning from it, under a new run id) but never continues in a directory that
holds a run. Which process may write here at all is the lock's job (:mod:`.runlock`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanolab.callbacks.events import CallbackConfigError
from nanolab.data.skips import LEDGER
from nanolab.errors import disk_full, room_left
from nanolab.runlog import (
    CHECKPOINT_DIR,
    OWNER_EVENTS,
    QUEUE_LOG_NAME,
    RUN_LOG_NAME,
    dumps,
    iter_backwards,
    iter_numbered,
    last_record,
    names_run,
    owner_of_log,
    run_dir_holding,
)
from nanolab.runs import foreign_config

#: What else in a run directory belongs to the run that wrote it, so a fresh run moves it to
#: ``previous/`` with the log and the checkpoints: the rollback ledger (the data order and
#: learning rates after its loss spikes; a new run must not inherit them).
RUN_STATE = (LEDGER,)

#: The folders ``--logger`` writes in a run directory (tensorboard, csv, wandb, mlflow). They
#: are the run's too: a fresh run moves them with the rest, or it would append its rows to the
#: old run's ``metrics.csv``. Only a claim made before this launch's logger is built moves them
#: (``nanolab fit`` builds it after its claim); a later one leaves the open folders alone.
LOGGER_DIRS = ("tensorboard", "csv", "wandb", "mlruns")

#: Config keys that may differ between two processes of the same run.
VOLATILE_KEYS = (
    ("run", "resume"),
    ("run", "fresh"),
    ("log", "fresh"),
    ("ckpt_path",),
    ("config",),
    ("__path__",),
)

CONFIG_NAME = "config.yaml"
PREVIOUS_DIR = "previous"  # archived runs (run.fresh)

#: Names a run directory keeps besides its run log: ``log.filename`` must not take one.
RESERVED_NAMES = (CONFIG_NAME, CHECKPOINT_DIR, PREVIOUS_DIR, QUEUE_LOG_NAME, LEDGER)


class RunDirError(CallbackConfigError):
    """The run directory cannot be used for this run (held by another run, or not writable)."""

    errno: int | None = None  # a full disk's: it has an exit code of its own


@dataclass(frozen=True)
class RunClaim:
    """Outcome of :func:`claim_run_dir`."""

    run_id: str | None  # None when resuming: the id comes from the checkpoint or the log
    archived_to: Path | None = None
    forked_from: str | None = None  # another run's checkpoint this new run starts from


def normalise_config(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """The config as it reads back from JSON, without the keys that vary between resumes."""
    if config is None:
        return None
    plain = json.loads(dumps(config))
    for path in VOLATILE_KEYS:
        node = plain
        for key in path[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(path[-1], None)
    return plain


def config_hash(config: dict[str, Any] | None) -> str | None:
    """A short fingerprint of :func:`normalise_config` (``None`` for an unknown config)."""
    plain = normalise_config(config)
    if plain is None:
        return None
    blob = json.dumps(plain, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _diff_keys(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for key in sorted(set(a) | set(b), key=str):
            out += _diff_keys(a.get(key), b.get(key), f"{prefix}{key}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def checkpoint_files(run_dir: Path) -> list[Path]:
    folder = run_dir / CHECKPOINT_DIR
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.name.endswith(".ckpt"))


def _check_writable(run_dir: Path) -> None:
    """Create the directory and prove a file can be created in it and in its ``checkpoints/``
    when that exists (then remove the probes): a folder the run cannot write is said now, not
    at the first save, after steps trained."""
    _probe(run_dir)
    checkpoints = run_dir / CHECKPOINT_DIR
    if checkpoints.is_dir():  # not yet there: the run creates it, as it created run_dir
        _probe(checkpoints, of_checkpoints=True)


def _probe(folder: Path, of_checkpoints: bool = False) -> None:
    """Create ``folder`` (the run directory, or its ``checkpoints/`` with ``of_checkpoints``)
    and prove a file can be created in it, else one line naming the folder that refused."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".nanolab-write-test-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        reason = err.strerror or type(err).__name__
        what = f"{folder} (the run's checkpoints)" if of_checkpoints else f"run directory {folder}"
        if disk_full(err):  # writable, but full: another folder is not the only fix
            left, fix = room_left(folder, err)
            error = RunDirError(f"{what} cannot be written ({reason}; {left}); {fix}")
            error.errno = err.errno  # the disk-full exit code
            raise error from None
        if of_checkpoints:  # the run directory itself is writable: only this folder refuses
            fix = f"make {folder} writable for this user (the run saves its checkpoints there)"
        else:
            fix = "set run.root (or trainer.default_root_dir) to a folder this user can write"
        raise RunDirError(f"{what} is not writable ({reason}); {fix}") from None


def refuse_nested_run_dir(run_dir: Path) -> None:
    """Refuse a run directory (``run.root``/``run.name``) inside another run's directory, as
    written or where its links lead: the new run would put its log, config and checkpoints among
    that run's files (``--run.root runs/orig --run.name checkpoints``), which only that run may
    write. Which folder is a run is :func:`~nanolab.runlog.run_dir_holding`'s one rule, the
    one :func:`~nanolab.runlog.refuse_inside_run` keeps for every other command."""
    given = Path(os.path.abspath(run_dir))
    real = Path(os.path.realpath(run_dir))
    if (holder := run_dir_holding(given.parent)) is not None:  # run.root, or its links
        raise RunDirError(
            f"run directory {run_dir} is inside the run directory {os.path.realpath(holder)}, "
            "whose files are that run's own; set run.root to a folder outside any run directory"
        )
    if (holder := run_dir_holding(real.parent)) is not None:  # run_dir itself is a link
        raise RunDirError(
            f"run directory {run_dir} is a link into the run directory {holder} ({real}), whose "
            "files are that run's own; choose another run.name, or remove the link"
        )


def _check_layout(run_dir: Path, log_name: str) -> None:
    """The names the run writes are free or of the kind it writes (a folder named
    ``config.yaml`` would otherwise fail the run at setup, after its checks passed)."""
    for name, folder in ((CONFIG_NAME, False), (log_name, False), (CHECKPOINT_DIR, True)):
        path = run_dir / name
        if path.exists() and path.is_dir() != folder:
            kind, want = ("a folder", "a file") if path.is_dir() else ("a file", "a folder")
            raise RunDirError(
                f"run directory {run_dir}: {name} is {kind} where the run keeps {want}; move it "
                "out of the way, or choose another run.name"
            )


def claim_run_dir(
    run_dir: str | os.PathLike[str],
    config: dict[str, Any] | None,
    resuming: bool,
    fresh: bool = False,
    log_name: str = RUN_LOG_NAME,
    checkpoint: str | os.PathLike[str] | None = None,
    checkpoint_run_id: str | None = None,
    checkpoint_run_dir: str | None = None,
    new_id: str | None = None,
    logger_dirs: tuple[str, ...] = (),
) -> RunClaim:
    """Check that this process may write into ``run_dir``; archive the old run if ``fresh``.

    ``checkpoint`` is the file a resume continues from and ``checkpoint_run_id`` the run id saved
    in it (None: unknown), ``checkpoint_run_dir`` the run directory that saved it. ``new_id`` is
    the id a new run takes (None: a random one), so an earlier claim of this launch and the run
    log agree on it; ``logger_dirs`` the logger folders no logger of this launch has opened yet,
    which go to ``previous/`` with an old run (:data:`LOGGER_DIRS`). Raises :class:`RunDirError` (nothing written) when the directory holds
    a different run, when the checkpoint belongs to another run and the directory holds one,
    when ``fresh`` and ``resuming`` contradict each other, or when it is not writable.
    """
    run_dir = Path(run_dir)
    _check_layout(run_dir, log_name)
    if fresh and resuming:
        raise RunDirError(
            "run.fresh: true starts the run over, but a checkpoint to resume from was given "
            "(run.resume or --ckpt_path); drop one of them"
        )
    log_path = run_dir / log_name
    previous, old_id = _last_start_and_owner(log_path)
    if old_id is None and not fresh:  # fresh moves a link aside with the rest
        _refuse_linked_log(log_path)
    has_log = _holds_a_record(log_path)
    checkpoints = checkpoint_files(run_dir)
    holds_run = has_log or bool(checkpoints)
    foreign = foreign_config(run_dir) if not holds_run else None
    if foreign is not None and not fresh:  # a config kept here by hand: fresh moves it aside
        raise RunDirError(foreign)

    if resuming:
        # A checkpoint here that says it was saved in another directory, and no log to say
        # whose this one is: the run moved here (it continues), or a copy of it (refused).
        elsewhere = (
            checkpoint is not None
            and not has_log
            and checkpoint_run_id is not None
            and checkpoint_run_dir is not None
            and _is_own_checkpoint(run_dir, Path(checkpoint), None, None)
            and os.path.realpath(checkpoint_run_dir) != os.path.realpath(run_dir)
        )
        not_moved = (
            _why_not_moved(run_dir, str(checkpoint_run_id), str(checkpoint_run_dir), log_name)
            if elsewhere
            else None
        )
        own = checkpoint is not None and _is_own_checkpoint(
            run_dir, Path(checkpoint), old_id, checkpoint_run_id, checkpoint_run_dir
        )
        run_of = old_id or checkpoint_run_id
        if own and has_log and run_of:
            # The log and the checkpoint name this run, but the run's own copy may be elsewhere:
            # a directory copied with its log, or a checkpoint saved by such a copy. Only a
            # directory the run moved out of (gone, or no longer holding it) may hand it on.
            origins = (checkpoint_run_dir, previous.get("run_dir") if previous else None)
            copy_of = _held_elsewhere(run_dir, run_of, origins, log_name)
            if copy_of is not None:
                origin, why = copy_of
                raise RunDirError(
                    f"{checkpoint} continues run {run_of} of {origin}, {why}: continuing it in "
                    f"{run_dir} too would make two runs of one id. Resume it where it is "
                    f"({origin}), or start a new run from this checkpoint under another "
                    f"run.name (--run.resume {checkpoint})"
                )
        if checkpoint is None or own or (elsewhere and not_moved is None):
            claim = RunClaim(run_id=None)
        elif holds_run and not checkpoints and continues_fork(run_dir, checkpoint, log_name):
            # The run started from this checkpoint and stopped before its own first save: it
            # starts from it again, as the same run.
            claim = RunClaim(run_id=old_id or new_id or new_run_id(), forked_from=str(checkpoint))
        elif holds_run and not_moved is not None:
            raise RunDirError(
                f"run directory {run_dir} {_what_log(log_path)}, and {checkpoint} was saved by run "
                f"{checkpoint_run_id} in {checkpoint_run_dir}, {not_moved}: continuing here "
                "could make two copies of one run. Resume it where it is, or start a new run "
                f"from this checkpoint under another run.name (--run.resume {checkpoint})"
            )
        elif holds_run:
            what = f"run {old_id}" if old_id else "another run's files"
            theirs = f"run {checkpoint_run_id}" if checkpoint_run_id else "another run"
            raise RunDirError(
                f"run directory {run_dir} already holds {what}, and {checkpoint} is a checkpoint "
                f"of {theirs}: resuming it here would mix two runs. Fine-tune from it under "
                "another run.name (a new run directory), or resume this run from its own "
                "checkpoints (run.resume auto)"
            )
        else:  # a new directory: this run starts from the other's weights
            claim = RunClaim(run_id=new_id or new_run_id(), forked_from=str(checkpoint))
        _check_writable(run_dir)
        return claim
    if not holds_run or fresh:
        _check_writable(run_dir)
        # Fresh, or a new run where a gone one left its state (its log and checkpoints deleted
        # by hand): that state goes with the old run, so the new one starts from nothing of it.
        leftovers = (
            holds_run
            or foreign is not None
            or (log_path.is_file() and log_path.stat().st_size > 0)  # a torn first record
            or any((run_dir / name).exists() for name in (*RUN_STATE, *logger_dirs))
        )
        archived = _archive(run_dir, old_id, log_name, logger_dirs) if leftovers else None
        return RunClaim(run_id=new_id or new_run_id(), archived_to=archived)

    what = f"run {old_id}" if old_id else "another run"
    if checkpoints:
        raise RunDirError(
            f"run directory {run_dir} already holds {what} with checkpoints "
            f"({checkpoints[-1].name}, ...); resume it (run.resume: auto), choose another "
            f"run.name, or set run.fresh: true to move it to {run_dir / 'previous'} and start over"
        )
    old_config = previous.get("config") if previous else None
    if (
        config is not None
        and old_config is not None
        and config_hash(config) == config_hash(old_config)
    ):
        # The same configuration started before and died before its first checkpoint.
        _check_writable(run_dir)
        return RunClaim(run_id=old_id or new_id or new_run_id())
    differs = _diff_keys(normalise_config(old_config), normalise_config(config))
    detail = f" (config differs at: {', '.join(differs[:4])})" if differs and old_config else ""
    raise RunDirError(
        f"run directory {run_dir} already holds {what}{detail}; choose another run.name, or set "
        f"run.fresh: true to move it to {run_dir / 'previous'} and start over"
    )


def _refuse_linked_log(log_path: Path) -> None:
    """Refuse a run log that is a link (symbolic, or a hard link: one file under two names) and
    names no run: the run writes its log only in a file of its own (the writer never follows a
    link), and "already holds another run" would send the user looking for a run that is not
    there. Said as what it is, before anything is written."""
    if log_path.is_symlink():
        what, kept = f"a link to {os.readlink(log_path)}", "the file it leads to is left as it is"
    else:
        try:
            links = os.stat(log_path, follow_symlinks=False).st_nlink
        except OSError:
            return
        if links < 2:
            return
        what, kept = f"a hard link ({links} names for one file)", "the file keeps its other names"
    raise RunDirError(
        f"{log_path} is {what} that names no run, not a run log of its own: a run writes its "
        f"log only in a file of its own, never through a link. Move it out of the way ({kept}) "
        "and rerun the same command, or choose another run.name"
    )


def _what_log(log_path: Path) -> str:
    """What a run directory whose log holds no record (:func:`_holds_a_record`) has: no log, an
    empty one, or the torn start of a first record; said as it is, since a user who sees a
    ``metrics.jsonl`` there would not believe "no run log"."""
    try:
        size = log_path.stat().st_size
    except OSError:
        return "has no run log"
    if size == 0:
        return f"has an empty run log ({log_path.name}, 0 bytes)"
    return f"has a run log without a whole record ({log_path.name}, {size:,} bytes)"


def _holds_a_record(log_path: Path) -> bool:
    """Whether the run log holds one whole line: a log that is only the torn start of its first
    record (a disk that filled as the run began) is no run yet, and the same command run again
    once there is room starts it, the torn file moved to ``previous/`` with the leftovers."""
    try:
        with open(log_path, "rb") as f:
            while chunk := f.read(1 << 20):  # up to the first newline: the start record
                if b"\n" in chunk:
                    return True
    except OSError:
        return False
    return False


def fork_origin(run_dir: Path, log_name: str = RUN_LOG_NAME) -> str | None:
    """The checkpoint the run in ``run_dir`` started from (its first ``start`` record's
    ``resumed_from``), or None for a run that started from nothing (or a log that names none).
    The first start record is near the top of the log: only the lines up to it are parsed."""
    for _, record in iter_numbered(run_dir / log_name, containing='"start"'):
        if record.get("event") == "start":
            origin = record.get("resumed_from")
            return str(origin) if origin else None
    return None


def lost_checkpoints(run_dir: Path, log_name: str = RUN_LOG_NAME) -> tuple[int, int] | None:
    """(the newest step the run log of ``run_dir`` records, the step of the newest checkpoint
    it records saving) when the run saved a checkpoint of its own, past the step it started
    from (its first ``start`` record's: 0, or the checkpoint a fine-tune or branch started
    from); None when it saved none (no log, a run that stopped before its first step, or one
    killed before its first checkpoint: starting it again loses nothing). Read from the end and
    from the top, so a long log costs short reads when it holds a checkpoint record."""
    path = run_dir / log_name
    began = 0
    for _, record in iter_numbered(path, containing='"start"'):
        if record.get("event") == "start":
            step = record.get("step")
            began = step if isinstance(step, int) else 0
            break

    def past_start(record: dict[str, Any]) -> bool:
        step = record.get("step")
        return isinstance(step, int) and not isinstance(step, bool) and step > began

    saved = last_record(path, event="checkpoint", where=past_start)
    if saved is None:
        return None
    newest = last_record(path, where=past_start)
    logged = int(newest["step"]) if newest is not None else int(saved["step"])
    return max(logged, int(saved["step"])), int(saved["step"])


def continues_fork(
    run_dir: Path, checkpoint: str | os.PathLike[str], log_name: str = RUN_LOG_NAME
) -> bool:
    """Whether the run in ``run_dir`` is the one that started from ``checkpoint`` (the same
    file, however it is spelled): the command that made it, run again after a preemption,
    continues it instead of being refused as a second run in its directory."""
    origin = fork_origin(run_dir, log_name)
    if origin is None:
        return False
    if os.path.realpath(origin) == os.path.realpath(checkpoint):
        return True
    try:
        return os.path.samefile(origin, checkpoint)
    except OSError:
        return False


def _last_start_and_owner(log_path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The log's last ``start`` record and its owner (:func:`owner_of_log`), in one read from
    the end: a resumed run's log holds one ``start`` per launch, the first on its first line,
    and only those lines and the ``log_recreated`` ones are parsed."""
    start, owner = None, None
    with contextlib.closing(iter_backwards(log_path, OWNER_EVENTS)) as newest:
        for record in newest:
            if owner is None and names_run(record):
                owner = str(record["run_id"])
            if start is None and record.get("event") == "start":
                start = record
            if start is not None and owner is not None:
                break
    return start, owner


def _is_own_checkpoint(
    run_dir: Path,
    checkpoint: Path,
    run_id: str | None,
    checkpoint_run_id: str | None,
    checkpoint_run_dir: str | None = None,
) -> bool:
    """Whether ``checkpoint`` continues the run ``run_dir`` holds (or held, when it is empty).

    The run ids decide when both are known (a copy of this run's checkpoint kept elsewhere is
    still this run's). When the log names no run (deleted, or recreated without a ``start``
    record), a checkpoint that says which run directory saved it must have been saved here: a
    copy of another run's ``last.ckpt`` would otherwise take that run's id into a second
    directory. Otherwise the location decides: ``checkpoints/`` and Lightning's SLURM
    ``hpc_ckpt_*`` files of this directory are its own; ``previous/`` holds archived runs.
    """
    if run_id is not None and checkpoint_run_id is not None:
        return run_id == checkpoint_run_id
    if checkpoint_run_dir is not None and os.path.realpath(checkpoint_run_dir) != os.path.realpath(
        run_dir
    ):
        return False
    try:
        where = checkpoint.resolve().relative_to(run_dir.resolve())
    except (ValueError, OSError):
        return False
    return where.parts[:1] == (CHECKPOINT_DIR,) or (
        len(where.parts) == 1 and where.name.startswith("hpc_ckpt_")
    )


def _still_holds(there: Path, run_id: str, log_name: str) -> str | None:
    """Why the directory ``there`` still holds run ``run_id`` (its log names the run, or it has
    checkpoints and no log to say whose), or None: gone, emptied, or another run's now."""
    owner = owner_of_log(there / log_name)
    if owner == run_id:
        return f"which still holds that run ({there / log_name} names it)"
    if owner is None and checkpoint_files(there):
        return f"which may still hold that run ({there / CHECKPOINT_DIR} has checkpoints)"
    return None


def _held_elsewhere(
    run_dir: Path, run_id: str, origins: tuple[Any, ...], log_name: str
) -> tuple[Path, str] | None:
    """(the directory, why) when one of ``origins`` (where the checkpoint was saved; where the
    log's last launch ran) is another directory that still holds run ``run_id``: then this one
    is a copy of it, or the checkpoint is a copy's. A directory moved with its log names its old
    place, which no longer holds the run (or is not on this machine): it continues as itself."""
    here = os.path.realpath(run_dir)
    for origin in origins:
        if not isinstance(origin, str) or not origin or os.path.realpath(origin) == here:
            continue
        why = _still_holds(Path(os.path.realpath(origin)), run_id, log_name)
        if why is not None:
            return Path(os.path.realpath(origin)), why
    return None


def _why_not_moved(run_dir: Path, run_id: str, origin: str, log_name: str) -> str | None:
    """Why ``run_dir``, holding checkpoints of run ``run_id`` saved in ``origin`` and no log,
    cannot be taken for that run moved here; None when it can: ``origin`` no longer holds the
    run (gone, emptied, or another run's now) and every readable checkpoint here is that run's.
    Then a resume continues the run in its new place. Only the folder that saved the
    checkpoints can tell: two copies made before the original was moved away and stripped of
    its log would each pass, as nothing records where else copies went. Reading a checkpoint's
    run id opens it the cheap way (no tensor data)."""
    from nanolab.training.resume import checkpoint_files as resumable
    from nanolab.training.resume import inspect_checkpoint

    held = _still_holds(Path(origin), run_id, log_name)
    if held is not None:
        return held
    others = sorted(
        {
            c.run_id or "unknown"
            for p in resumable(run_dir)
            if (c := inspect_checkpoint(p, training=False)).ok
        }
        - {run_id}
    )
    if others:
        return f"but {run_dir / CHECKPOINT_DIR} also holds checkpoints of run {', '.join(others)}"
    return None


def _archive(
    run_dir: Path, old_id: str | None, log_name: str, logger_dirs: tuple[str, ...] = ()
) -> Path:
    """Move the previous run's log, checkpoints, config, the rest of its state
    (:data:`RUN_STATE`) and the logger folders ``logger_dirs`` into ``previous/<id>-<time>/``."""
    target = run_dir / PREVIOUS_DIR / f"{old_id or 'run'}-{time.strftime('%Y%m%d-%H%M%S')}"
    suffix = 1
    while target.exists():
        target = target.with_name(f"{target.name.split('~')[0]}~{suffix}")
        suffix += 1
    target.mkdir(parents=True)
    for name in (log_name, CHECKPOINT_DIR, CONFIG_NAME, *RUN_STATE, *logger_dirs):
        source = run_dir / name
        if source.exists():
            os.replace(source, target / name)
    return target
