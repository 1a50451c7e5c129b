"""Checkpoint files that are either complete or absent: atomic, fsynced writes, optionally async.

A checkpoint is written to a new file of its own in the same directory (``.<name>.<random>.tmp``,
created by the write, so a link that stood at some fixed name is never written through), flushed
and fsynced, renamed over the final name with ``os.replace`` (atomic on POSIX filesystems) and the
directory is fsynced so the rename survives a power cut. A crash, a kill or a full disk mid-write
leaves at most a ``.tmp`` file that nothing picks up as a checkpoint; the previous checkpoint is
untouched.

:class:`AtomicCheckpointIO` is installed as the strategy's ``checkpoint_io``, so *every* save
through ``trainer.save_checkpoint`` (the rotation callback, a preemption handler, user code) gets
this guarantee. :class:`AsyncAtomicCheckpointIO` wraps it in Lightning's ``AsyncCheckpointIO``:
the training thread only takes a CPU snapshot of the state (the stall), a background thread
writes it, and :meth:`AsyncAtomicCheckpointIO.then` queues follow-up work (pointing ``last.ckpt``
at the new file, deleting old ones) behind the write, so nothing is deleted before its successor
is complete on disk.

Loading is Lightning's, but for ``validate``/``test`` (:func:`evaluation_loads`): their
:class:`EvaluationCheckpointIO` maps the file on the CPU and leaves the optimizer state unread.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection

from nanolab.atomic import create_temp, temp_name
from nanolab.callbacks.files import fsync_dir, remove
from nanolab.claimed import ClaimedDir
from nanolab.errors import file_size_limit, inodes_left, size_text
from nanolab.model.plain_state import UnloadableStateError, unloadable_value


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the message says why and whether older ones are kept."""

    def __str__(self) -> str:  # the message alone, without OSError's "[Errno 28] " prefix
        return str(self.strerror)


def _saved_before(path: Path, itself: bool = False) -> bool:
    """Whether the folder of checkpoint ``path`` holds an earlier step checkpoint (``itself``:
    ``path`` counts too, a write that never began having left it as it was)."""
    try:
        names = os.listdir(path.parent)
    except OSError:
        return False
    return any(step_of(n) is not None and (itself or n != path.name) for n in names)


def _kept(path: Path) -> str:
    """What a failed write of checkpoint ``path`` left of the run's checkpoints, in words: the
    earlier ones are intact, or none was saved yet (a line promising "previous checkpoints" to a
    run that has none sends the user looking for them)."""
    earlier = _saved_before(path)
    kept = "the previous checkpoints are intact" if earlier else "no checkpoint was saved yet"
    return f"{kept} (no partial file was left under the final name)"


@dataclass(frozen=True)
class CheckpointSize:
    """How large the checkpoint that failed to write is, for its error line.

    Measured where a file says it (``at_least`` False): the newest checkpoint in its folder (the
    same model and optimizer, so the same size give or take a few kB of counters), or the file a
    link copies. Else only bounded from below (``at_least``): its tensors, or the bytes the failed
    write had put down, whichever is more. The tensors alone leave out the pickle, the zip
    records and the saved RNG states, so "about" that figure would understate it.
    """

    nbytes: int
    at_least: bool = False

    def __str__(self) -> str:
        return f"{'at least' if self.at_least else 'about'} {size_text(self.nbytes)}"


def newest_checkpoint_size(folder: Path) -> int | None:
    """Bytes of the newest complete ``.ckpt`` file in ``folder`` (None: there is none)."""
    try:
        files = [e for e in os.scandir(folder) if e.name.endswith(".ckpt")]
        sizes = [e.stat() for e in files if e.is_file(follow_symlinks=False)]
    except OSError:
        return None
    return max(sizes, key=lambda st: st.st_mtime_ns).st_size if sizes else None


def checkpoint_size(obj: Any, folder: Path, written: int = 0) -> CheckpointSize:
    """The size of checkpoint ``obj`` that failed to write into ``folder`` after ``written``
    bytes (:class:`CheckpointSize`)."""
    floor = max(tensor_bytes(obj), written)
    newest = newest_checkpoint_size(folder)
    if newest is not None and newest >= floor:  # smaller: not a checkpoint of this state
        return CheckpointSize(newest)
    return CheckpointSize(floor, at_least=True)


def _too_large(path: Path, needed: CheckpointSize | None) -> str:
    """The line for a write refused with EFBIG: a file-size limit below the checkpoint's size,
    this process's (``ulimit -f``, as a batch system may set it) or the file system's own
    (FAT32: 4 GiB), named with both sizes where they are known. A size known only from below
    and not past the limit is left out: the write failing says the file is larger."""
    limit = file_size_limit()
    size = f" ({needed})" if needed else ""
    if limit is not None:
        if needed is not None and needed.nbytes <= limit:
            cause = (
                f"the checkpoint is larger than this process's file-size limit (ulimit -f: "
                f"{size_text(limit)})"
            )
        else:
            cause = (
                f"this process's file-size limit (ulimit -f: {size_text(limit)}) is below the "
                f"checkpoint's size{size}"
            )
        fix = "raise the limit (ulimit -f unlimited, or ask for it in the job's settings)"
    else:
        cause = f"the file system's maximum file size is below the checkpoint's size{size}"
        fix = "put run.root on a file system that holds files that large (not FAT32)"
    return f"could not write checkpoint {path}: file too large: {cause}; {_kept(path)}; {fix}"


def _explain(
    err: OSError,
    path: Path,
    needed: CheckpointSize | None = None,
    retention: Retention | None = None,
) -> str:
    if err.errno == errno.EFBIG:
        return _too_large(path, needed)
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = size_text(shutil.disk_usage(path.parent).free)
        except OSError:
            free = "unknown space"
        needs = f", checkpoint needs {needed}" if needed else ""
        what = "no space left on device" if err.errno == errno.ENOSPC else "disk quota exceeded"
        room = "free space"
        if err.errno == errno.ENOSPC and (entries := inodes_left(path.parent)) is not None:
            what = "no file entries (inodes) left on the file system"  # the bytes are not short
            free, needs = f"{entries[0]} of {entries[1]} entries free, {free} of space", ""
            room = "free file entries (delete files you no longer need there: each takes one)"
        return f"{what} writing {path} ({free} free{needs}); {_kept(path)}; " + _room_fix(
            path.parent, room, retention
        )
    if err.errno == errno.EROFS:  # the folder that refused the write, not the run directory
        cause = f"{path.parent} is on a read-only file system"
        fix = "remount it read-write or choose another run.root"
    elif err.errno in (errno.EACCES, errno.EPERM):
        cause = "permission denied"
        fix = f"make {path.parent} writable for this user or choose another run.root"
    else:
        cause = err.strerror or str(err)
        fix = "check the filesystem"
    return f"could not write checkpoint {path}: {cause}; {_kept(path)}; {fix}"


#: A rotated checkpoint's file name: ``step-`` and the optimizer step, 8 digits or more.
STEP_FILE = re.compile(r"^step-(\d{8,})\.ckpt$")


def step_of(path: str | Path) -> int | None:
    """The step of a ``step-XXXXXXXX.ckpt`` file name, or ``None`` for any other name."""
    match = STEP_FILE.match(Path(path).name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class Retention:
    """What the run's rotation keeps (``checkpoint.keep_last``/``keep_best``/``max_disk_gb``,
    and the spike guard's one older checkpoint to roll back to): the full-disk line suggests
    only a setting that would keep fewer files than these, never the run's own."""

    keep_last: int
    keep_best: int
    max_disk_gb: float | None = None
    #: The rotation also keeps the newest checkpoint at least this many steps older than the
    #: newest (0: none), for the spike guard (``spike.enabled``) to roll back to, and the one
    #: that ages into that role (:func:`kept_for_rollback`).
    keep_one_older_than: int = 0


def kept_for_rollback(steps: Iterable[int], newest: int, window: int) -> list[int]:
    """The step files among ``steps`` that rotation keeps for the spike guard, oldest first:
    the newest at least ``window`` steps older than ``newest`` (what a rollback restores), and
    the oldest newer than that, which ages into that role.

    Keeping only the first left none at all with frequent saves and a small ``keep_last``
    (``every_n_steps 1, keep_last 2``): no file was old enough yet, and ``keep_last`` deleted
    every one that would have become old enough, so a spike ended the run as diverged. The
    second file is kept until it is old enough, then the next one takes its place: from the
    first save on one always ages into the role. At most these two files, and the one restored
    is at most about ``2 x window`` steps older than the newest."""
    bound = newest - window
    steps = list(steps)
    kept = []
    if older := [s for s in steps if s <= bound]:
        kept.append(max(older))
    if ageing := [s for s in steps if bound < s <= newest]:
        kept.append(min(ageing))
    return kept


def branch_step(steps: Iterable[int], bad_from: int | None) -> int | None:
    """The step among ``steps`` that a branch at a lower learning rate starts from, for a run
    whose non-finite steps began at ``bad_from``: the newest whose next step was still finite,
    i.e. before ``bad_from - 1`` (the weights of the step before the first non-finite one are
    finite, but its very next forward is not, at any rate). ``bad_from`` None: the newest step.
    None when there is none. The divergence stop's exit line names it, and rotation keeps it
    while a run of non-finite steps is open (a save then may be the state that diverges)."""
    usable = [s for s in steps if bad_from is None or s < bad_from - 1]
    return max(usable) if usable else None


def _room_fix(folder: Path, room: str = "free space", retention: Retention | None = None) -> str:
    """What makes room for the next checkpoint: ``room`` (free space, or file entries), or keep
    fewer of the step files here (a rerun applies lower ``keep_last``/``keep_best``/
    ``max_disk_gb`` to them before its first save, never to the newest). With the run's
    ``retention``, only a setting that changes what it keeps is named, and the spike guard's
    older file when it is what keeps the second one."""
    try:
        steps = sorted(
            (s, (folder / n).stat().st_size)
            for n in os.listdir(folder)
            if (s := step_of(n)) is not None
        )
    except OSError:
        steps = []
    if len(steps) < 2:
        return f"{room}, then rerun the same command (the newest checkpoint is always kept)"
    total = sum(size for _, size in steps)
    fewer = len(steps) - 1
    changes = []
    if retention is None or retention.keep_last > fewer or retention.keep_best > 0:
        changes.append(f"--checkpoint.keep_last {fewer} --checkpoint.keep_best 0")
    if (spike_kept := _kept_to_roll_back_to([s for s, _ in steps], retention)) is not None:
        changes.append(f"--spike.enabled false ({spike_kept})")
    if retention is None or retention.max_disk_gb is None or retention.max_disk_gb * 1e9 >= total:
        changes.append(f"--checkpoint.max_disk_gb below {total / 1e9:.3g}")
    if not changes:
        return f"{room}, then rerun the same command"
    return (
        f"{room}, or rerun keeping fewer of the {len(steps)} step checkpoints here "
        f"({size_text(total)}): {', or '.join(changes)}, deletes the oldest before the first "
        "save (never the newest)"
    )


def _kept_to_roll_back_to(steps: list[int], retention: Retention | None) -> str | None:
    """What rotation keeps of sorted ``steps`` only for the spike guard (beyond ``keep_last``:
    :func:`kept_for_rollback`), in words; None when there is none (a lower ``keep_last`` would
    delete them, or the guard keeps none)."""
    if retention is None or not retention.keep_one_older_than:
        return None
    window = retention.keep_one_older_than
    newest = steps[-1]
    kept_last = steps[-max(retention.keep_last, 1) :]
    extra = [s for s in kept_for_rollback(steps, newest, window) if s not in kept_last]
    older = [s for s in extra if s <= newest - window]
    if not extra:
        return None
    if len(extra) == 2:
        return (
            f"the spike guard keeps steps {extra[0]} and {extra[1]}, the newest checkpoint at "
            f"least {window} steps older and the next one, which ages into that role, to roll "
            "back to"
        )
    if older:
        return (
            f"the spike guard keeps step {extra[0]}, the newest checkpoint at least {window} "
            "steps older, to roll back to"
        )
    return (
        f"the spike guard keeps step {extra[0]}, the oldest of the last {window} steps, to roll "
        f"back to once it is {window} steps old"
    )


def tensor_bytes(obj: Any) -> int:
    """Bytes of the distinct tensor storages in ``obj``: about what its ``torch.save`` writes.

    Used only after a failed write, to say how much room the checkpoint needs.
    """
    sizes: dict[tuple[str, int], int] = {}

    def add(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        sizes[(str(t.device), storage.data_ptr())] = storage.nbytes()
        return t

    apply_to_collection(obj, torch.Tensor, add)
    return sum(sizes.values())


def _write_failure(err: BaseException, path: Path, needed: CheckpointSize) -> OSError | None:
    """The ``OSError`` a failed checkpoint write amounts to, or None if it was not the disk.

    That is ``err`` itself or one in its cause/context chain: torch's zip writer reports a failed
    ``write`` (a full disk) as ``RuntimeError: [enforce fail at inline_container.cc...] unexpected
    pos``, raised while the ``OSError`` is handled. A torch writer error with no ``OSError``
    attached still means a full disk when the free space left is smaller than the checkpoint.
    """
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError):
            return current
        current = current.__cause__ or current.__context__
    if isinstance(err, RuntimeError) and "inline_container" in str(err):
        try:
            full = shutil.disk_usage(path.parent).free < needed.nbytes
        except OSError:
            full = False
        if full:
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return None


def atomic_torch_save(
    obj: Any,
    path: str | os.PathLike[str],
    folder: ClaimedDir | None = None,
    retention: Retention | None = None,
) -> None:
    """``torch.save`` to ``path`` atomically (tmp + fsync + rename + dir fsync).

    ``retention``: what the run's rotation keeps, for the full-disk line's advice.

    With ``folder`` (the run's claimed checkpoint folder, holding ``path``), the file is created
    and renamed through the folder's descriptor, after checking the path still leads there: a
    link swapped in for the folder mid-run cannot redirect the write into another run's files.
    """
    path = Path(path)
    if folder is not None and not folder.holds(path):
        folder = None
    if folder is None:
        path.parent.mkdir(parents=True, exist_ok=True)
    else:
        folder.check(path.name)
    tmp: Path | None = None
    try:
        fd, tmp = create_temp(path, None if folder is None else folder.fd)
        with open(fd, "wb") as f:  # a descriptor: the file create_temp made
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        _replace(tmp, path, folder)
    except BaseException as err:
        written = 0
        if tmp is not None:
            written = _size_quietly(tmp, folder)  # how far the failed write got
            _remove_quietly(tmp, folder)
        if not isinstance(err, (OSError, RuntimeError)):
            raise
        needed = checkpoint_size(obj, path.parent, written)
        cause = _write_failure(err, path, needed)
        if cause is None:
            raise
        message = _explain(cause, path, needed, retention)
        raise CheckpointWriteError(cause.errno or errno.EIO, message) from err
    _fsync_folder(path.parent, folder)


def _replace(tmp: Path, path: Path, folder: ClaimedDir | None) -> None:
    if folder is None:
        os.replace(tmp, path)
    else:
        os.replace(tmp.name, path.name, src_dir_fd=folder.fd, dst_dir_fd=folder.fd)


def _fsync_folder(directory: Path, folder: ClaimedDir | None) -> None:
    if folder is None or folder.fd is None:
        fsync_dir(directory)
    else:
        with contextlib.suppress(OSError):
            os.fsync(folder.fd)


def atomic_link(
    source: str | os.PathLike[str],
    target: str | os.PathLike[str],
    folder: ClaimedDir | None = None,
    retention: Retention | None = None,
) -> None:
    """Make ``target`` the same file as ``source`` (hard link; copy where links are refused).

    A hard link costs no extra disk and no extra write; it is swapped in with ``os.replace`` so a
    reader sees the old or the new ``last.ckpt``, never a missing or partial one. A directory
    (sharded checkpoint) gets a relative symlink instead. With ``folder`` (the claimed folder
    holding both), every step goes through its descriptor, as in :func:`atomic_torch_save`.
    """
    source, target = Path(source), Path(target)
    if folder is not None and not (folder.holds(source) and folder.holds(target)):
        folder = None
    if folder is not None:
        folder.check(target.name)
    tmp = temp_name(target)  # link and symlink make the name themselves, or fail: never through
    try:
        if source.is_dir():
            os.symlink(os.path.relpath(source, target.parent), tmp)
        elif folder is not None:
            os.link(source.name, tmp.name, src_dir_fd=folder.fd, dst_dir_fd=folder.fd,
                     follow_symlinks=False)  # fmt: skip
        else:
            try:
                os.link(source, tmp)
            except OSError:
                fd, tmp = create_temp(target)
                with open(source, "rb") as src, open(fd, "wb") as dst:
                    shutil.copyfileobj(src, dst, 16 << 20)
                    dst.flush()
                    os.fsync(dst.fileno())
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        _replace(tmp, target, folder)
    except OSError as err:
        _remove_quietly(tmp, folder)
        needed = None
        with contextlib.suppress(OSError):
            needed = CheckpointSize(source.stat().st_size) if source.is_file() else None
        message = _explain(err, target, needed, retention)
        raise CheckpointWriteError(err.errno or errno.EIO, message) from err
    _fsync_folder(target.parent, folder)


def _size_quietly(path: Path, folder: ClaimedDir | None = None) -> int:
    """Bytes of ``path`` (in ``folder`` by descriptor); 0 when it cannot be read."""
    with contextlib.suppress(OSError):
        if folder is None:
            return os.stat(path, follow_symlinks=False).st_size
        return os.stat(path.name, dir_fd=folder.fd, follow_symlinks=False).st_size
    return 0


def _remove_quietly(path: Path, folder: ClaimedDir | None = None) -> None:
    """Clean up a ``.tmp`` on a failure path, where the first error is the one to report."""
    with contextlib.suppress(OSError):
        if folder is None:
            remove(path)
        else:
            os.unlink(path.name, dir_fd=folder.fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose saves are atomic and durable (see the module docstring).

    ``folder``: the run's claimed checkpoint folder, set by the rotation callback once the run
    has claimed it; saves into it go through its descriptor. ``retention``: what its rotation
    keeps, set with it, for a full disk's advice.
    """

    folder: ClaimedDir | None = None
    retention: Retention | None = None

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO.save_checkpoint does not take storage_options")
        refuse_unloadable(checkpoint, path)
        self.write(checkpoint, path)

    def write(self, checkpoint: dict[str, Any], path: Any) -> None:
        """Write ``checkpoint`` to ``path`` atomically, already checked (:func:`refuse_unloadable`)."""
        atomic_torch_save(checkpoint, path, self.folder, self.retention)

    def then(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` now (writes are synchronous)."""
        fn()

    def wait(self) -> None:
        """Nothing is ever pending."""


def refuse_unloadable(checkpoint: dict[str, Any], path: Any) -> None:
    """Stop the run, before anything is written, when ``checkpoint`` holds a value no
    ``weights_only`` load reads back (a fork callback's numpy float): every reader of the file,
    the run's own resume included, would refuse the whole of it, and the rotation would then
    delete the readable checkpoints it replaces (:mod:`nanolab.model.plain_state`)."""
    problem = unloadable_value(checkpoint)
    if problem is not None:
        path = Path(path)
        kept = (
            "its checkpoints are intact" if _saved_before(path, itself=True) else "it has none yet"
        )
        raise UnloadableStateError(f"{problem}. The run stopped before writing {path.name}; {kept}")


def cpu_snapshot(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A point-in-time CPU copy of every tensor (training may change the originals right after).

    Tensors that are the same view of the same storage (a tied embedding and output head appear
    twice in a state dict) are copied once and stay shared, so the file is no larger than a
    synchronous ``torch.save`` of the original would be.
    """
    copies: dict[tuple[Any, ...], torch.Tensor] = {}

    def copy(t: torch.Tensor) -> torch.Tensor:
        key = (
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            tuple(t.shape),
            tuple(t.stride()),
            t.dtype,
            t.device,
        )
        if key not in copies:
            copies[key] = t.detach().to("cpu", copy=True)
        return copies[key]

    return apply_to_collection(checkpoint, torch.Tensor, copy)


class AsyncAtomicCheckpointIO(AsyncCheckpointIO):
    """Lightning's ``AsyncCheckpointIO`` around :class:`AtomicCheckpointIO`, plus ordering.

    Differences from the base class: the snapshot goes to CPU memory (a device-side clone would
    double the model's and optimizer's device memory during the save), and :meth:`then` runs
    follow-up work on the same single writer thread, after every save queued before it, and
    only if none of them failed.

    The base class has no public hook for either, so this subclass uses its two private
    attributes: ``_executor`` (the writer thread, created lazily) and ``_error`` (the first
    failed write, re-raised by the next save and by ``teardown``).
    """

    def __init__(self, checkpoint_io: AtomicCheckpointIO | None = None) -> None:
        super().__init__(checkpoint_io or AtomicCheckpointIO())
        self._futures: list[Future[Any]] = []

    def _submit(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanolab-ckpt")

        def run() -> Any:
            if self._error is not None:
                return None  # an earlier write failed: do not publish or delete anything
            try:
                return fn(*args)
            except BaseException as err:
                self._error = err
                raise

        future = self._executor.submit(run)
        self._futures = [f for f in self._futures if not f.done()] + [future]

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if self._error is not None:
            raise self._error
        if storage_options is not None:
            raise TypeError("AsyncAtomicCheckpointIO.save_checkpoint does not take storage_options")
        refuse_unloadable(checkpoint, path)  # here, in the training thread: the run stops on it
        snapshot = cpu_snapshot(checkpoint)
        assert isinstance(self.checkpoint_io, AtomicCheckpointIO)
        self._submit(self.checkpoint_io.write, snapshot, path)

    def then(self, fn: Callable[[], Any]) -> None:
        self._submit(fn)

    def wait(self) -> None:
        """Block until every queued write and follow-up has finished; re-raise a failure."""
        for future in list(self._futures):
            with contextlib.suppress(BaseException):  # a failure is kept in self._error
                future.result()
        self._futures = []
        if self._error is not None:
            raise self._error

    def teardown(self) -> None:
        try:
            self.wait()
        finally:
            super().teardown()


class EvaluationCheckpointIO(AtomicCheckpointIO):
    """The checkpoint IO of a ``validate``/``test``: its load is
    :func:`~nanolab.training.evaluate.load_for_evaluation` (the weights memory-mapped on the CPU,
    no optimizer state), where Lightning's reads the whole file into memory, onto the device
    each tensor was saved from. Lightning's restore is otherwise unchanged: the module, the
    data and the callbacks get their states as before, so the evaluation scores the same."""

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        from nanolab.training.evaluate import load_for_evaluation

        return load_for_evaluation(path)


def loads_through_checkpoint_io(strategy: Any) -> bool:
    """Whether ``strategy`` reads a checkpoint file with its ``checkpoint_io`` (one device,
    DDP). DeepSpeed, FSDP and ModelParallel read theirs in their own way (shards, only what
    the stage needs) and are left to it."""
    from lightning.pytorch.strategies import Strategy

    return type(strategy).load_checkpoint is Strategy.load_checkpoint


@contextlib.contextmanager
def evaluation_loads(strategy: Any, ckpt_path: str | None) -> Iterator[None]:
    """Within it, ``strategy`` restores the checkpoint file ``ckpt_path`` for an evaluation
    through :class:`EvaluationCheckpointIO`; its own checkpoint IO is back afterwards. A
    sharded folder (or anything but a local file), a strategy that loads on its own and a
    checkpoint IO of one's own (a plugin that reads another storage) keep their load."""
    current = strategy.checkpoint_io
    lean = (
        ckpt_path is not None
        and Path(ckpt_path).is_file()
        and loads_through_checkpoint_io(strategy)
        and type(current) in (TorchCheckpointIO, AtomicCheckpointIO, AsyncAtomicCheckpointIO)
    )
    if not lean:
        yield
        return
    strategy.checkpoint_io = EvaluationCheckpointIO()
    try:
        yield
    finally:
        strategy.checkpoint_io = current
