"""Which checkpoint a run continues from: the newest one that is complete, never a torn one.

A run killed at an arbitrary moment (SIGKILL, a lost spot instance, a node failure) can leave
behind a half-written checkpoint: a ``.tmp`` file when the writer is atomic, or a truncated file
when something else wrote it (a copy interrupted by a full disk, a third-party callback). Picking
"``last.ckpt`` if it exists" would then crash the resumed run, or worse, the run would start over.
So ``run.resume auto`` looks at every checkpoint the run directory holds, opens each one the
cheap way (``torch.load(weights_only=True, mmap=True)`` reads the zip directory and the pickled
metadata, not the tensor bytes), keeps those that load and carry what a training resume needs,
and continues from the one with the most optimizer steps. Anything newer that failed to load is
reported in one warning line, so a skipped checkpoint is never silent.

Under SLURM with Lightning's auto-requeue, Lightning saves ``hpc_ckpt_<n>.ckpt`` in the run
directory when the requeue signal arrives; those are candidates too, so a requeued job continues
from the newest state whichever mechanism saved it.
"""

from __future__ import annotations

import os
import re
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanolab.errors import NanolabError
from nanolab.messages import warn_line

#: What a checkpoint must hold to restart training (not just to load weights).
REQUIRED_KEYS = ("state_dict", "optimizer_states", "lr_schedulers", "loops", "global_step")

#: GPT settings that do not change parameter shapes; a resume may change them.
RUNTIME_GPT_FIELDS = frozenset({"dropout", "gradient_checkpointing", "attention"})

#: GPT settings whose ``null`` means "read it from the data" (``nanolab fit`` fills them in
#: after this check may run, e.g. the queue's at ``add``): null there is no change. Any other
#: null is a value (``attention_window: null`` is the whole context) and must match.
FROM_DATA_GPT_FIELDS = frozenset({"vocab_size", "eot_id"})

_STEP_IN_NAME = re.compile(r"step[=_-]?(\d+)")


class ResumeError(NanolabError):
    """``run.resume`` names a checkpoint that cannot be resumed from."""


class DifferentModelError(ResumeError):
    """The checkpoint's architecture or weight shapes are not this model's. ``checkpoint`` is
    its path: the caller may find the data changed too and name that instead (a vocabulary
    taken from other data is a consequence, not the change)."""

    checkpoint: Path | None = None


@dataclass
class Candidate:
    """One checkpoint file (or sharded checkpoint folder) and what opening it told us."""

    path: Path
    step: int | None = None  # optimizer steps done, from the checkpoint itself
    error: str | None = None  # why it cannot be resumed from; None = usable
    nanolab: dict[str, Any] | None = None  # the module's plain-data section, when present
    run_id: str | None = None  # the run that saved it (the run log callback's state), if known
    run_dir: str | None = None  # the run directory it was saved in (same state), if known
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # state_dict tensor shapes
    gone: bool = False  # deleted between the listing and the opening (rotated, not damaged)
    #: The newer checkpoints ``run.resume auto`` passed over (unreadable) to pick this one: a fit
    #: sets them aside before its saves could overwrite them (they may be all that is left).
    skipped_newer: list[Path] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def name_step(self) -> int | None:
        """The step written in the file name (``step-00000250.ckpt``, ``epoch=0-step=250.ckpt``)."""
        m = _STEP_IN_NAME.search(self.path.name)
        return int(m.group(1)) if m else None


@dataclass
class ResumeChoice:
    """The checkpoint ``auto`` picked, and the newer ones it had to skip."""

    chosen: Candidate | None
    skipped: list[Candidate] = field(default_factory=list)

    def warning(self) -> str | None:
        """One line naming every skipped checkpoint and what was used instead (None: nothing
        skipped, or nothing chosen: every checkpoint unreadable is an error, not a warning).
        It says "skipped" only: a fit moves the skipped files of its checkpoint folder aside
        once the resume has restored, and says so then in a line of its own; a launch refused
        before that has moved nothing."""
        if not self.skipped or self.chosen is None:
            return None
        parts = "; ".join(f"{c.path.name} ({c.error})" for c in self.skipped)
        target = f"resuming from {self.chosen.path.name} (step {self.chosen.step})"
        return f"nanolab: warning: skipped incomplete or corrupt checkpoint(s): {parts}; {target}"


def _is_partial(path: Path) -> bool:
    """Temporary files of an atomic writer (``x.ckpt.tmp``, ``.x.ckpt.tmp-123``) are never candidates."""
    return ".tmp" in path.name or path.name.startswith(".")


def inspect_checkpoint(
    path: str | Path, training: bool = True, keep_open: bool = False
) -> Candidate:
    """Open ``path`` without reading tensor data and say whether it can be used.

    ``training``: whether training resumes from it (it must then hold the optimizer and loop
    state); otherwise (validate, test) the weights are enough. The file is opened once and every
    read goes through that descriptor, so a rotation deleting it meanwhile changes nothing; one
    already deleted is ``gone``. ``keep_open``: leave it held for later reads
    (:func:`nanolab.model.checkpoint.hold`; the caller releases it).
    """
    path = Path(path)
    cand = Candidate(path)
    if path.is_dir():
        # Sharded checkpoints (FSDP, DeepSpeed) are folders; opening them needs the strategy.
        # They count when they hold a complete sharded checkpoint whose pickles are plain data
        # (torch and DeepSpeed unpickle them unrestricted) and are named with their step; any
        # other folder (a torn save, a folder of .ckpt files) is not one.
        from nanolab.model.checkpoint import sharded_folder_problem, sharded_kind

        try:
            empty = not any(path.iterdir())
        except FileNotFoundError:  # deleted since the listing (rotated)
            cand.error, cand.gone = "deleted while it was read (rotated)", True
            return cand
        if empty:
            cand.error = "empty checkpoint folder"
        elif sharded_kind(path) is None:
            cand.error = "a folder without a DeepSpeed or FSDP sharded checkpoint's files"
        elif cand.name_step is None:
            cand.error = "sharded checkpoint folder without a step in its name"
        else:
            try:
                cand.error = sharded_folder_problem(path)
            except FileNotFoundError:  # deleted while it was read (rotated)
                cand.error, cand.gone = "deleted while it was read (rotated)", True
            cand.step = None if cand.error else cand.name_step
            if cand.error is None and sharded_kind(path) == "fsdp":
                cand.nanolab = _fsdp_section(path)
        return cand
    from nanolab.model.checkpoint import hold, is_held, release

    was_held = is_held(path)
    try:
        source = hold(path)
    except FileNotFoundError:
        cand.error, cand.gone = "deleted while it was read (rotated)", True
        return cand
    except OSError:
        source = path  # unreadable: the reads below say why
    try:
        return _inspect_file(cand, source, training)
    finally:
        if not (keep_open or was_held):
            release(path)


def _inspect_file(cand: Candidate, source: Path, training: bool) -> Candidate:
    """:func:`inspect_checkpoint` of a file, read at ``source`` (its held descriptor)."""
    if not zipfile.is_zipfile(source):
        # torch.save writes a zip whose directory is at the very end: a file cut short by a
        # kill, a full disk or an interrupted copy has none.
        cand.error = "truncated or not a checkpoint" if _size(source) else "empty file"
        return cand
    try:
        import torch

        from nanolab.model.checkpoint import compressed_problem, damaged_record

        compressed = compressed_problem(source)  # never inflated: not torch.save's file
        if compressed is not None:
            cand.error = compressed
            return cand
        damaged = damaged_record(source)  # the memory-mapped load below does not look
        if damaged is not None:
            cand.error = f"damaged: its record {damaged} is not where its directory says"
            return cand
        ckpt = torch.load(source, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # any failure means "not resumable": say why, in one line
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        if "Weights only load failed" in str(err):
            # torch refused to unpickle something other than tensors and plain data.
            from nanolab.model.plain_state import refused_global, refused_text

            refused = refused_global(err)
            first = (
                refused_text(refused)
                if refused is not None
                else "it holds pickled Python objects, not only tensors; refused to load it"
            )
        else:
            first = first[:120]
        cand.error = first if _size(source) else "empty file"
        return cand
    if not isinstance(ckpt, dict):
        cand.error = "not a Lightning checkpoint"
        return cand
    missing = [k for k in (REQUIRED_KEYS if training else ("state_dict",)) if k not in ckpt]
    if missing:
        cand.error = f"missing {', '.join(missing)}" + (" (weights only?)" if training else "")
        return cand
    if not isinstance(ckpt["state_dict"], dict):
        cand.error = "its state_dict is not a mapping of tensors"
        return cand
    step = ckpt.get("global_step")
    cand.step = int(step) if isinstance(step, int) else None
    section = ckpt.get("nanolab")
    from nanolab.data.tokenizers import spec_problem

    spec = section.get("tokenizer") if isinstance(section, dict) else None
    if spec is not None and (problem := spec_problem(spec)) is not None:
        cand.error = f"its stored tokenizer is not valid (nanolab.tokenizer: {problem})"
        return cand
    # A copy: the section's tensors (the RNG streams) are views of the memory-mapped file, and
    # keeping one alive keeps the whole file mapped, so a rotation deleting it frees no space.
    cand.nanolab = _detached(section) if isinstance(section, dict) else None
    cand.run_id, cand.run_dir = run_of_checkpoint(ckpt)
    cand.shapes = {
        str(k): tuple(v.shape) for k, v in ckpt["state_dict"].items() if hasattr(v, "shape")
    }
    return cand


def _fsdp_section(path: Path) -> dict[str, Any] | None:
    """The ``nanolab`` section of an FSDP sharded folder, read from its ``meta.pt`` (the state
    Lightning saves beside the shards, found plain data by ``sharded_folder_problem``): the
    optimizer, freeze and model records the resume checks compare before the strategy loads the
    shards, which it does before the module sees the section. None: unreadable (a rotation
    deleting it meanwhile) or no section. A DeepSpeed folder keeps it with its model states,
    not read here."""
    import torch

    try:
        meta = torch.load(path / "meta.pt", map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # gone or damaged since it was checked: the load itself says why
        return None
    section = meta.get("nanolab") if isinstance(meta, dict) else None
    return _detached(section) if isinstance(section, dict) else None


def _detached(value: Any) -> Any:
    """``value`` with every tensor in it copied into memory of its own (containers rebuilt),
    so nothing it holds refers to the file it was memory-mapped from."""
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v) for v in value)
    clone = getattr(value, "clone", None)
    return clone() if callable(clone) and hasattr(value, "untyped_storage") else value


def run_of_checkpoint(ckpt: dict[str, Any]) -> tuple[str | None, str | None]:
    """(run id, run directory) the run log callback stored in the checkpoint's callback states
    (``None`` for what it does not say)."""
    callbacks = ckpt.get("callbacks")
    if not isinstance(callbacks, dict):
        return None, None
    for key, state in callbacks.items():
        if str(key).startswith("MetricsLog") and isinstance(state, dict) and state.get("run_id"):
            where = state.get("run_dir")
            return str(state["run_id"]), str(where) if isinstance(where, str) and where else None
    return None, None


def checkpoint_files(run_dir: str | Path) -> list[Path]:
    """Every checkpoint the run directory holds: ``checkpoints/*`` and Lightning's ``hpc_ckpt_*``."""
    run_dir = Path(run_dir)
    found: list[Path] = []
    ckpt_dir = run_dir / "checkpoints"
    if ckpt_dir.is_dir():
        found += [p for p in ckpt_dir.iterdir() if p.suffix == ".ckpt" and not _is_partial(p)]
    if run_dir.is_dir():
        found += [p for p in run_dir.glob("hpc_ckpt_*.ckpt") if not _is_partial(p)]
    # last.ckpt is usually a hard link (or symlink) to a step file: open each file once, by the
    # name that carries its step.
    unique: dict[Any, Path] = {}
    for p in sorted(found, key=lambda p: (p.name == "last.ckpt", p.name)):
        try:
            st = p.stat()
            key: Any = (st.st_dev, st.st_ino)
        except OSError:
            key = os.path.realpath(p)
        unique.setdefault(key, p)
    return sorted(unique.values())


def find_resume_checkpoint(
    run_dir: str | Path, hold: bool = False, verify: bool = False
) -> ResumeChoice:
    """The newest complete checkpoint in ``run_dir`` (most optimizer steps; ties: a step file).

    A file deleted between the listing and its opening was rotated away by a live run, not
    damaged: it is left out silently, and when it was newer than every file that could be
    read, the run has saved a newer one since: the folder is listed again (a few times at
    most). Files are opened newest name first, so the one most likely chosen is opened right
    after the listing, not after inspecting the others has given rotation time to delete it.

    ``hold``: keep the chosen file open (:func:`nanolab.model.checkpoint.hold`), so that
    reading it later gets the file chosen even when rotation deletes its name first (validate,
    test, eval and lm-eval read a live run's checkpoints; ``fit`` holds its run directory).
    ``verify``: also read the chosen file's bytes against their CRC-32s
    (:func:`nanolab.model.checkpoint.corrupt_record`), and pick the next newest while they
    fail: the cheap opening reads no tensor bytes, and a resume would train on damaged ones.
    """
    from nanolab.model.checkpoint import release

    damaged: dict[Path, str] = {}
    while True:
        cands, chosen = _newest(run_dir, hold, damaged)
        if not verify or chosen is None or chosen.path.is_dir():
            break
        bad = crc_problem(chosen.path)
        if bad is None:
            break
        damaged[chosen.path] = bad
        if hold:
            release(chosen.path)
    # Report the broken ones that could have been newer than the choice: a step in the name
    # above the chosen step, or no step in the name but written after it.
    skipped = []
    for c in sorted(cands, key=lambda c: c.path):
        if c.ok:
            continue
        if chosen is None:
            skipped.append(c)
        elif c.name_step is not None:
            if c.name_step > (chosen.step or 0):
                skipped.append(c)
        elif _mtime(c.path) >= _mtime(chosen.path):
            skipped.append(c)
    return ResumeChoice(chosen, skipped)


def crc_problem(path: Path) -> str | None:
    """Why the one-file checkpoint ``path`` (or the file held for it) is damaged by its bytes:
    a record failing its CRC-32 (:func:`nanolab.model.checkpoint.corrupt_record`); None: none."""
    from nanolab.model.checkpoint import corrupt_record, read_path

    bad = corrupt_record(read_path(path))
    return None if bad is None else f"damaged: its record {bad} fails its CRC-32 check"


def _newest(
    run_dir: str | Path, hold: bool, damaged: dict[Path, str]
) -> tuple[list[Candidate], Candidate | None]:
    """:func:`find_resume_checkpoint`'s listing and opening: every candidate, and the newest
    usable one (those in ``damaged`` are not, for the reason it gives)."""
    from nanolab.model.checkpoint import release

    for listing in range(_LISTINGS):
        cands, chosen, listed, newer_gone = [], None, checkpoint_files(run_dir), False
        for path in sorted(listed, key=lambda p: Candidate(p).name_step or -1, reverse=True):
            cand = drop = inspect_checkpoint(path, keep_open=hold)
            if cand.gone:
                newer_gone = newer_gone or chosen is None
                continue
            if cand.path in damaged:
                cand.error = damaged[cand.path]
            cands.append(cand)
            if cand.ok and (chosen is None or _newness(cand) > _newness(chosen)):
                chosen, drop = cand, chosen
            if hold and drop is not None:
                release(drop.path)  # only the chosen one stays open
        if not newer_gone or listing == _LISTINGS - 1:
            break
        if hold and chosen is not None:
            release(chosen.path)  # a newer one was saved meanwhile: list again
    return cands, chosen


#: How many times a run's checkpoint folder is listed when its newest files were deleted before
#: they could be opened (a run rotating faster than it is read); then the newest one read wins.
_LISTINGS = 5


def _newness(cand: Candidate) -> tuple[Any, ...]:
    """Which checkpoint is newest: most steps, then a step file over ``last.ckpt``, then mtime."""
    return (cand.step, cand.path.name != "last.ckpt", _mtime(cand.path))


#: What to do about a checkpoint of another model that ``run.resume: auto`` found in the run.
FIX_AUTO = (
    "set model.gpt to match it, give this run another run.name, or start it over "
    "(run.fresh: true moves the old run to previous/)"
)
#: ... that was named (``run.resume PATH``, ``--ckpt_path``).
FIX_NAMED = "set model.gpt to match it, or pass a checkpoint of this model"


def check_same_model(
    cand: Candidate,
    gpt_config: dict[str, Any] | None,
    flag: str = "run.resume",
    fix: str = FIX_NAMED,
) -> None:
    """Refuse to resume a checkpoint of another architecture (a clear line, not a shape
    traceback); ``fix`` is what works where it was asked for (:data:`FIX_AUTO`, ...)."""
    saved = (cand.nanolab or {}).get("gpt")
    if not saved or not gpt_config:
        return
    from nanolab.model.config import with_defaults

    saved = with_defaults(saved)  # a field the checkpoint predates: what it meant then
    diffs = [
        f"{k} {_yaml(saved[k])} in the checkpoint vs {_yaml(gpt_config[k])} now"
        for k in sorted(set(saved) & set(gpt_config))
        if k not in RUNTIME_GPT_FIELDS
        and not (k in FROM_DATA_GPT_FIELDS and gpt_config[k] is None)
        and saved[k] != gpt_config[k]
    ]
    if diffs:
        err = DifferentModelError(
            f"{flag}: {cand.path} holds a different model (model.gpt: {'; '.join(diffs)}); {fix}"
        )
        err.checkpoint = cand.path
        raise err


def optimizer_state_problem(
    saved: Mapping[str, Any] | None,
    optimizer_name: str | None,
    freeze: Mapping[str, Any] | None,
    checkpoint: str | Path,
) -> str | None:
    """Why a checkpoint's optimizer state cannot continue under this launch's
    ``model.optimizer.name`` and ``model.freeze``, read from the checkpoint's own record
    (``saved``: its ``nanolab`` section); None when it can, or the record does not say.

    The one rule ``nanolab fit`` refuses a resume by (before anything is written, and again when
    the module restores the state) and ``queue add`` refuses a job that would continue a run by:
    torch cannot load another optimizer's state, nor one for another set of trainable
    parameters, and no other setting makes it fit. ``None`` for a setting: not known (a model
    class of one's own), not compared. A checkpoint without a ``freeze`` record predates it:
    :func:`nanolab.run.compose.refuse_other_optimizer_state` tells by the size of its optimizer state.
    No section at all (``saved`` None: a sharded folder, read only when the strategy loads it)
    says nothing: not compared here; the module's ``on_load_checkpoint`` asks again with the
    section it restores. A section without an ``optimizer`` record predates it: AdamW.
    """
    if not isinstance(saved, Mapping):
        return None
    section = saved
    record = section.get("freeze")
    if isinstance(record, Mapping) and freeze is not None:
        changed = [k for k, v in freeze.items() if k in record and record[k] != v]
        if changed:
            diffs = "; ".join(
                f"model.freeze.{k} {flag_value(record[k])} (this run: {flag_value(freeze[k])})"
                for k in changed
            )
            fix = " ".join(f"--model.freeze.{k} {flag_value(record[k])}" for k in changed)
            return (
                f"{checkpoint} was trained with {diffs}: its optimizer state cannot continue "
                f"another set. Resume with {fix}, or start a new run from its weights (nanolab "
                f"export --ckpt {checkpoint} --format safetensors -o DIR, then --model.init_from "
                "DIR with the new model.freeze)"
            )
    was = (section.get("optimizer") or {}).get("name", "adamw")  # before the record: AdamW
    if optimizer_name is not None and was != optimizer_name:
        return (
            f"model.optimizer.name is {optimizer_name!r} but the checkpoint was trained with "
            f"{was!r}; resume with --model.optimizer.name {was}, or start a new run"
        )
    return None


def flag_value(value: Any) -> str:
    """A setting's value as the command line writes it (true and null, not True and None)."""
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


def check_same_shapes(
    cand: Candidate, expected: dict[str, tuple[int, ...]], flag: str = "--ckpt_path"
) -> None:
    """Refuse weights whose names or shapes differ from the model's (before Lightning loads them).

    For checkpoints without nanolab's section (saved by another program), this is what turns
    Lightning's size-mismatch traceback into one line.
    """
    if not cand.shapes or not expected:
        return
    missing = sorted(set(expected) - set(cand.shapes))
    extra = sorted(set(cand.shapes) - set(expected))
    differ = [k for k in sorted(set(expected) & set(cand.shapes)) if expected[k] != cand.shapes[k]]
    if not (missing or extra or differ):
        return
    parts = []
    if differ:
        k = differ[0]
        parts.append(f"{k} is {list(cand.shapes[k])} there, {list(expected[k])} in this model")
    if missing:
        parts.append(f"{len(missing)} weight(s) missing, e.g. {missing[0]}")
    if extra:
        parts.append(f"{len(extra)} unexpected weight(s), e.g. {extra[0]}")
    err = DifferentModelError(
        f"{flag}: {cand.path} holds a different model ({'; '.join(parts)}); "
        "set model.gpt to the architecture it was trained with"
    )
    err.checkpoint = cand.path
    raise err


def resolve_resume(
    resume: str, run_dir: str | Path, gpt_config: dict[str, Any] | None = None
) -> str | None:
    """The ``ckpt_path`` for ``Trainer.fit`` given ``run.resume`` (``auto``, ``never`` or a path).

    ``auto`` returns None when the run directory holds no complete checkpoint (a fresh run).
    A given path must exist and be resumable; otherwise :class:`ResumeError` says which and why.
    """
    cand = resume_candidate(resume, run_dir, gpt_config)
    return str(cand.path) if cand is not None else None


def resume_candidate(
    resume: str,
    run_dir: str | Path,
    gpt_config: dict[str, Any] | None = None,
    flag: str = "run.resume",
    training: bool = True,
) -> Candidate | None:
    """Like :func:`resolve_resume`, with what opening the checkpoint told (step, run id, shapes).

    ``flag`` names the setting in messages (``run.resume`` or ``--ckpt_path``); ``training``
    False checks a checkpoint for validate/test (weights only are enough). The chosen
    candidate lists the newer files ``auto`` skipped in ``skipped_newer`` (a fit sets them
    aside).
    """
    if resume == "never":
        return None
    if resume == "auto":
        choice = find_resume_checkpoint(run_dir, verify=True)
        if choice.chosen is None and choice.skipped:
            raise ResumeError(unreadable_message(choice.skipped, Path(run_dir), flag))
        line = choice.warning()
        if line and _is_rank_zero():
            warn_line(line)
        if choice.chosen is None:
            return None
        check_same_model(choice.chosen, gpt_config, flag, FIX_AUTO)
        choice.chosen.skipped_newer = [c.path for c in choice.skipped]
        return choice.chosen
    from nanolab.model.checkpoint import is_held

    path = Path(resume)
    if not (path.exists() or is_held(path)):  # held: picked and open, whatever its name now
        raise ResumeError(
            f"{flag}: checkpoint {resume} does not exist; pass an existing .ckpt"
            + (", auto or never" if flag == "run.resume" else "")
        )
    if path.is_dir():
        path = _checkpoint_in_folder(path, flag, training)
    cand = inspect_checkpoint(path, training=training)
    if cand.ok and not path.is_dir():
        cand.error = crc_problem(path)  # the one read of its bytes before the load
    if not cand.ok:
        raise ResumeError(
            f"{flag}: {resume} cannot be {'resumed from' if training else 'loaded'} "
            f"({cand.error}); pass another checkpoint"
            + (", or auto to pick the newest complete one" if flag == "run.resume" else "")
        )
    check_same_model(cand, gpt_config, flag)
    return cand


def _checkpoint_in_folder(folder: Path, flag: str, training: bool) -> Path:
    """A named folder: itself when it is a sharded checkpoint; for an evaluation, the file
    generate, eval and export read in it (a run directory's ``checkpoints/last.ckpt``); else
    one line naming it a folder and what to pass."""
    from nanolab.model.checkpoint import CheckpointError, sharded_kind

    if sharded_kind(folder) is not None:
        return folder  # inspect_checkpoint checks its files before anything loads them
    try:
        found = resolve_checkpoint(folder, flag)
    except CheckpointError as err:
        raise ResumeError(str(err)) from None
    if training:
        # A run records the file it started from, and the same command run again after a
        # preemption continues it only by naming that file: name it, do not pick it.
        raise ResumeError(
            f"{flag} {folder} is a folder, not a checkpoint; pass the checkpoint in it, "
            f"{flag} {found} (to continue that run itself, rerun it with its own run.name "
            "and run.resume auto)"
        )
    return found


def unreadable_message(broken: list[Candidate], run_dir: Path, flag: str) -> str:
    """Every checkpoint of the run is unreadable: one line naming each and what works (the
    run directory holds them, so it cannot simply start over in place)."""
    names = "; ".join(f"{c.path.name} ({c.error})" for c in broken)
    return (
        f"{flag}: every checkpoint in {run_dir} is unreadable: {names}; there is nothing to "
        f"resume from. Start the run over with run.fresh: true (moves its files to "
        f"{run_dir / 'previous'}, nothing is deleted), or start a new run under another "
        "run.name"
    )


def _mtime(path: Path) -> float:
    from nanolab.model.checkpoint import read_path

    try:
        return read_path(path).stat().st_mtime  # a held file: its own, whatever its name
    except OSError:  # removed meanwhile (rotation): sorts as oldest
        return 0.0


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _is_rank_zero() -> bool:
    """Before the Trainer exists, the launcher's environment says which process this is."""
    return all(os.environ.get(k, "0") == "0" for k in ("RANK", "LOCAL_RANK", "SLURM_PROCID"))


def realign_progress(checkpoint: dict[str, Any], accumulate: int) -> bool:
    """Count the restored micro-batches as ``global_step x accumulate``, this launch's layout.

    Lightning counts micro-batches per process, so a run saved on 2 devices (accumulation 1)
    after S steps has counted S; resumed on 1 device with accumulation 2 its next optimizer
    step must come after two micro-batches, not one. Every save is at an optimizer-step
    boundary, so the count is a plain function of the steps; on the same layout this changes
    nothing. Where the data order goes on is the checkpoint's own record, carried into this
    layout's micro-batches (:mod:`nanolab.data.order`), not this count. Returns whether it
    changed the counts.
    """
    loops = (checkpoint.get("loops") or {}).get("fit_loop") or {}
    progress = loops.get("epoch_loop.batch_progress")
    if not isinstance(progress, dict):
        return False
    want = int(checkpoint.get("global_step", 0)) * max(1, accumulate)
    total = progress.get("total")
    if not isinstance(total, dict) or total.get("processed") == want:
        return False
    for part in ("total", "current"):  # one endless epoch: the current counts are the total
        counts = progress.get(part)
        if isinstance(counts, dict):
            for key in ("ready", "started", "processed", "completed"):
                if key in counts:
                    counts[key] = want
    return True


def describe_layout_change(saved: Any, now: Any) -> str | None:
    """One line when a run resumes on another devices x accumulation x micro-batch layout."""
    if not isinstance(saved, dict) or not isinstance(now, dict) or saved == now:
        return None

    def text(layout: dict[str, Any]) -> str:
        w, a, m = (
            int(layout.get(k) or 0) for k in ("world_size", "accumulate", "micro_batch_size")
        )
        return f"{w} device(s) x {a} accumulation x micro-batch {m} = {w * a * m} windows per step"

    line = f"resuming a run saved on {text(saved)} on {text(now)}"
    before = saved["world_size"] * saved["accumulate"] * saved["micro_batch_size"]
    after = now["world_size"] * now["accumulate"] * now["micro_batch_size"]
    if before == after:
        return line + ": the same global batch, and the same data order"
    return (
        line + f": the global batch changes ({before} -> {after} windows per step), and the "
        "data order goes on at the first window the run has not trained; set "
        "run.global_batch_tokens to the run's tokens per step to keep the batch"
    )


def describe_precision_change(saved: Any, now: str, step: Any) -> str | None:
    """One line when a run resumes under another ``trainer.precision`` than it was saved with
    (None: the same, or a checkpoint that predates the record). The weights and optimizer
    state carry over either way, so nothing is refused; but config.yaml then names the new
    precision for a run whose earlier steps trained in the old one, so the change is said."""
    if not isinstance(saved, str) or saved == now:
        return None
    return (
        f"resuming a run saved at trainer.precision {saved} under {now}: its steps up to "
        f"{step} trained in {saved}, the rest train in {now}, and config.yaml says {now}; to "
        f"keep one precision, resume with --trainer.precision {saved}"
    )


def check_deepspeed_world_size(path: str | Path, world_size: int) -> None:
    """Refuse, before anything is written, to resume a DeepSpeed checkpoint folder on another
    number of data-parallel ranks: its ZeRO optimizer state is one shard per rank it was saved
    on, and DeepSpeed loads it only on that many (a plain file or a DCP folder reshards)."""
    folder = Path(path)
    if not folder.is_dir():
        return
    shards = {p.name for p in folder.rglob("*_optim_states.pt")}
    saved = len({name.split("_rank_")[1].split("_")[0] for name in shards if "_rank_" in name})
    if saved and saved != world_size:
        raise ResumeError(
            f"{folder} is a DeepSpeed checkpoint saved on {saved} data-parallel ranks and this "
            f"launch has {world_size}; DeepSpeed loads its optimizer shards only on {saved}: "
            f"resume with {saved} devices (--trainer.devices), or start a new run from its "
            "weights: convert it to one file (docs/scaling.md), `nanolab export --format "
            "safetensors` it and give that folder as --model.init_from"
        )


def check_checkpoint_format(path: str | Path, strategy_kind: str) -> None:
    """Refuse, before anything is written, a checkpoint the launch's strategy cannot read: a
    DeepSpeed folder under another strategy, a torch distributed-checkpoint folder (FSDP2's
    sharded save) under another than FSDP, or a one-file checkpoint under DeepSpeed (which
    reads only its own folders). Each failed later, after config.yaml was rewritten, in a
    traceback on every rank."""
    from nanolab.model.checkpoint import sharded_kind

    where = Path(path)
    if where.is_dir():
        kind = sharded_kind(where)
        if kind == "deepspeed" and strategy_kind != "deepspeed":
            raise ResumeError(
                f"{where} is a DeepSpeed checkpoint folder, which only DeepSpeed reads: resume "
                "with the strategy it was saved with (--config configs/strategy/"
                "deepspeed_stageN.yaml), or convert it to one file with Lightning's "
                "convert_zero_checkpoint_to_fp32_state_dict (docs/scaling.md)"
            )
        if kind == "fsdp" and strategy_kind not in ("fsdp1", "fsdp2"):
            raise ResumeError(
                f"{where} is a sharded FSDP checkpoint folder, which only FSDP reads: resume "
                "with --config configs/strategy/fsdp.yaml"
            )
    elif strategy_kind == "deepspeed":
        raise ResumeError(
            f"{where} is a one-file checkpoint, which DeepSpeed cannot resume (it reads only "
            "its own checkpoint folders): resume it with the strategy it was saved with (DDP, "
            "FSDP2 or one device)"
        )


def check_sharded_optimizer_layout(path: str | Path, strategy_kind: str, world_size: int) -> None:
    """Refuse, before anything is written, a checkpoint whose optimizer state FSDP2 on several
    devices cannot load: one saved without FSDP2 keeps its state by parameter index, which
    FSDP2 cannot shard (a tensor-size error at the first restore otherwise). FSDP2's own
    consolidated checkpoint (state by parameter name) loads on any count, one device included."""
    if strategy_kind != "fsdp2" or world_size <= 1 or Path(path).is_dir():
        return
    import torch

    ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if ((ckpt.get("nanolab") or {}).get("layout") or {}).get("fsdp2"):
        return  # FSDP2 wrote it; Lightning maps its state back onto the shards by name
    states = ckpt.get("optimizer_states") or []
    keys = list((states[0] or {}).get("state", {})) if states else []
    if keys and all(isinstance(k, int) for k in keys):
        raise ResumeError(
            f"{path} was saved without FSDP2 (its optimizer state is by parameter index), and "
            f"FSDP2 on {world_size} devices cannot shard that state: continue it with the "
            "strategy it was saved with (ddp, or one device), where any device count works"
        )


def _yaml(value: Any) -> str:
    """A setting as the config spells it: ``null``, ``true``, ``'gelu'``, ``8``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value)


def resolve_checkpoint(path: str | Path, flag: str = "--ckpt") -> Path:
    """``path`` itself, or for a run directory (or its ``checkpoints/``) its newest complete
    checkpoint, held open (:func:`nanolab.model.checkpoint.hold`); ``flag`` names the setting in messages (``--ckpt``,
    ``--ckpt_path``, ``run.resume``).

    A run directory is read by the one rule a resume, validate and eval use
    (:func:`find_resume_checkpoint`: most optimizer steps, a step file
    over ``last.ckpt`` on a tie), never "its ``last.ckpt``": a run with
    ``checkpoint.save_last false``, or resumed with it from an older checkpoint, keeps an older
    ``last.ckpt`` beside its newer step files, and export or generate would read a model that
    training had moved past, silently."""
    from nanolab.model.checkpoint import CheckpointError, sharded_folder_error

    path = Path(path)
    sharded = sharded_folder_error(path)
    if sharded is not None:
        raise sharded
    if not path.is_dir():
        if not path.exists():
            raise CheckpointError(f"{flag} {path} does not exist; pass a .ckpt file or a run dir")
        return path
    chosen, broken = newest_in_run(path, flag)
    if chosen is not None:
        return chosen
    # None complete: a last.ckpt there is read for the reason it cannot be (a folder holding a
    # copied last.ckpt, not a run, is read as that file), a sharded one is named so.
    for candidate in (path / "checkpoints" / "last.ckpt", path / "last.ckpt"):
        if candidate.is_file():
            return candidate
        sharded = sharded_folder_error(candidate)
        if sharded is not None:
            raise sharded
    if broken:
        raise CheckpointError(
            f"{flag} {path}: none of its checkpoints can be read ({'; '.join(broken)}); pass "
            "a .ckpt file"
        )
    raise CheckpointError(
        f"{flag} {path} is a folder without a complete checkpoint (checkpoints/*.ckpt); "
        "pass a .ckpt file"
    )


def newest_in_run(folder: Path, flag: str = "--ckpt") -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint of the run directory ``folder`` (or of the run whose
    ``checkpoints/`` it is), held open, or None, with the checkpoints that cannot be read
    (``"name (why)"``) when there is none. A sharded one is refused with its line (this process
    reads one file); newer ones that cannot be read are named in a warning, as a resume names
    them."""
    from nanolab.model.checkpoint import sharded_folder_error

    run_dir = folder.parent if folder.name == "checkpoints" else folder
    choice = find_resume_checkpoint(run_dir, hold=True)
    if choice.chosen is None:
        return None, [f"{c.path.name} ({c.error})" for c in choice.skipped]
    sharded = sharded_folder_error(choice.chosen.path)
    if sharded is not None:
        raise sharded
    warning = choice.warning()
    if warning:
        warn_line(warning.replace("resuming from", f"{flag} uses"))
    return choice.chosen.path, []
