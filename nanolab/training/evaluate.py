"""``nanolab validate`` / ``nanolab test``: which checkpoint they evaluate, and the record they log.

A Lightning user types ``nanolab test --config runs/x/config.yaml`` and expects the *trained*
model's loss. Lightning itself evaluates whatever weights the model was built with when no
checkpoint is found, which silently reports an untrained model's loss. So here:

* ``--ckpt_path`` unset or ``last`` = the run directory's newest complete checkpoint (the same
  choice ``run.resume auto`` makes), ``best`` = the checkpoint whose step had the lowest
  validation loss in the run log, ``PATH`` = that file, ``none`` = no checkpoint, on purpose.
* No checkpoint found and none asked for is an error: evaluating an untrained model must be
  asked for with ``--ckpt_path none``. (A ``model.init_from`` model is not untrained: it is
  evaluated as loaded, which is how docs/hf.md measures GPT-2 before fine-tuning.)
* The result of evaluating the run's own checkpoint by name (unset, ``last``, ``best``) is
  appended to the run's ``metrics.jsonl`` as a ``val`` or ``test`` record at the checkpoint's
  step, under the run-directory lock so it never interleaves with a live ``fit``. A checkpoint
  given by path, or no checkpoint, is printed only: its step is not on the run's timeline.
* A live run deletes old step files as it saves new ones. The file picked is held open from
  the pick on (:func:`nanolab.model.checkpoint.hold`), and every later read (the checks, the
  restore) goes through that descriptor: what is scored is the file picked, and the record
  names its step, even when its name is gone by then.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanolab.errors import NanolabError
from nanolab.runlog import (
    RERUN_EVALUATES,
    RUN_LOG_NAME,
    RunLogWriter,
    iter_records,
    written_in_training,
)

#: ``--ckpt_path`` values that pick a checkpoint of the run directory by name.
BY_NAME = ("last", "best")
#: ``--ckpt_path`` values that mean "no checkpoint: evaluate the model as built".
NO_CHECKPOINT = ("none", "None")


class EvaluateError(NanolabError):
    """No checkpoint can be evaluated as asked; the message says what to pass instead."""


@dataclass
class EvalTarget:
    """What an evaluation runs on: a checkpoint file (or none) and whether its result is logged."""

    path: Path | None
    step: int | None = None
    log_to_run: bool = False  # the run's own checkpoint picked by name: append a record
    run_id: str | None = None  # the run that saved it: its record goes only to that run's log


def eval_target(given: Any, run_dir: Path, verb: str, has_init_from: bool) -> EvalTarget:
    """Turn ``--ckpt_path`` (or its absence) into the checkpoint to evaluate."""
    from nanolab.training.resume import find_resume_checkpoint

    text = None if given is None else str(given)
    if text in NO_CHECKPOINT:
        return EvalTarget(None)
    if text is not None and text not in BY_NAME:
        if text in ("hpc", "registry") or text.startswith("registry:"):
            raise EvaluateError(
                f"--ckpt_path {text}: give last, best, a checkpoint file, or none (the model "
                "as built, untrained)"
            )
        return EvalTarget(_held_if_there(Path(text)))
    if text == "best":
        return _best(run_dir, verb)
    choice = find_resume_checkpoint(run_dir, hold=True)
    warning = choice.warning()
    if warning:
        from nanolab.messages import warn_line

        warn_line(warning.replace("resuming from", "evaluating"))
    if choice.chosen is None and choice.skipped:  # there are checkpoints, none readable
        names = "; ".join(f"{c.path.name} ({c.error})" for c in choice.skipped)
        raise EvaluateError(
            f"run directory {run_dir} holds no readable checkpoint to {verb}: {names}; give "
            "another checkpoint file with --ckpt_path PATH, or pass --ckpt_path none to "
            "evaluate the untrained model"
        )
    if choice.chosen is None:
        if text is None and has_init_from:
            return EvalTarget(None)  # the pretrained weights model.init_from loaded
        raise EvaluateError(
            f"run directory {run_dir} holds no checkpoint to {verb}: train it first (nanolab "
            "fit with the same config), name the run with --run.name, give a checkpoint file "
            "with --ckpt_path PATH, or pass --ckpt_path none to evaluate the untrained model"
        )
    chosen = choice.chosen
    return EvalTarget(chosen.path, chosen.step, log_to_run=True, run_id=chosen.run_id)


def _held_if_there(path: Path) -> Path:
    """A checkpoint file given by path, held open like a picked one; a missing or other path
    is left to the checks that name what is wrong with it."""
    from nanolab.model.checkpoint import hold

    with contextlib.suppress(OSError):
        hold(path)
    return path


def _best(run_dir: Path, verb: str) -> EvalTarget:
    """The checkpoint, among those still on disk, whose step had the lowest logged val loss
    (held open: :func:`eval_target`)."""
    from nanolab.model.checkpoint import release
    from nanolab.training.resume import Candidate, checkpoint_files, inspect_checkpoint

    val_by_step: dict[int, float] = {}
    for r in iter_records(run_dir / RUN_LOG_NAME, "val"):
        loss, step = r.get("val_loss"), r.get("step")
        if written_in_training(r) and isinstance(step, int) and _finite(loss):
            val_by_step[step] = float(loss)  # the latest copy of a step wins (resumes redo steps)
    best: Candidate | None = None
    best_key: tuple[float, int, bool] | None = None
    for path in checkpoint_files(run_dir):
        cand = drop = inspect_checkpoint(path, training=False, keep_open=True)
        if cand.ok and cand.step in val_by_step:
            # Ties (last.ckpt copied rather than linked): the file named with its step.
            key = (val_by_step[cand.step], cand.step, cand.path.name == "last.ckpt")
            if best_key is None or key < best_key:
                best, best_key, drop = cand, key, best
        if drop is not None:
            release(drop.path)  # only the best one stays open
    if best is None:
        raise EvaluateError(
            f"--ckpt_path best: run directory {run_dir} has no checkpoint saved at a step with "
            f"a validation loss in {RUN_LOG_NAME}; use --ckpt_path last, or save checkpoints at "
            "validation steps (checkpoint.save_on_best true)"
        )
    return EvalTarget(best.path, best.step, log_to_run=True, run_id=best.run_id)


def load_for_evaluation(path: str | Path) -> dict[str, Any]:
    """The checkpoint file ``path`` as ``validate``/``test`` restore it: every key it holds.

    Loaded with ``weights_only=True`` onto the CPU and memory-mapped (a file torch saved in its
    zip format, which every checkpoint nanolab writes is): a tensor's bytes are read only when
    something reads it, so the restore holds the weights once, not the whole checkpoint (three
    times the weights with AdamW) beside them, and a checkpoint saved on a GPU does not put its
    optimizer state back on the device. The optimizer's and schedulers' states stay in the
    dict: a fork's callback or module hook may read them in ``on_load_checkpoint`` (an Adam step
    count, say), and mapped they cost no memory until it does."""
    import zipfile

    import torch

    return torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def eval_record(
    verb: str, stage: str, metrics: dict[str, float | None], target: EvalTarget
) -> dict[str, Any]:
    """The run-log record of one evaluation: the fit's ``val`` fields, named for ``stage``."""
    loss = metrics.get(f"{stage}/loss")
    record: dict[str, Any] = {
        "event": stage,
        "time": time.time(),
        "step": target.step,
        "evaluated_by": f"nanolab {verb}",
        "checkpoint": str(target.path) if target.path is not None else None,
        f"{stage}_loss": loss,
        f"{stage}_ppl": math.exp(loss) if _finite(loss) and loss < 700 else None,  # type: ignore[operator]
        f"{stage}_bpb": metrics.get(f"{stage}/bpb"),
    }
    for key, value in metrics.items():
        record.setdefault(key, value)
    return record


def evaluation_lines(
    verb: str, metrics: dict[str, float | None], target: EvalTarget, on_val_windows: bool
) -> list[str]:
    """What ``validate``/``test`` print, in nanolab's plain lines (not Lightning's box table):
    what was evaluated, on which windows, then one ``name  value`` line per metric (the
    stage's loss first). ``test`` on a data module without a test split of its own evaluates
    the validation windows, and says so."""
    stage = "val" if verb == "validate" else "test"
    what = (
        "the model as built (no checkpoint)"
        if target.path is None
        else f"{target.path}" + (f" (step {target.step})" if target.step is not None else "")
    )
    where = "the validation windows"
    if stage == "test":
        where = (
            "the validation windows (the data has no test split of its own)"
            if on_val_windows
            else "the data module's test split"
        )
    names = sorted(k for k in metrics if k.startswith(f"{stage}/"))
    names.sort(key=lambda k: k != f"{stage}/loss")
    width = max((len(k) for k in names), default=0)
    lines = [f"nanolab {verb}: {what}, on {where}"]
    lines += [f"  {k:<{width}}  {_shown(metrics[k])}" for k in names]
    return lines


def _shown(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def append_record(run_dir: Path, record: dict[str, Any]) -> Path:
    """Append one evaluation's record to the run log (the caller holds the run-directory lock);
    a failed append's line says a rerun evaluates again (it resumes nothing)."""
    writer = RunLogWriter(run_dir / RUN_LOG_NAME, rerun=RERUN_EVALUATES)
    try:
        writer.write(record)
    finally:
        writer.close()
    return writer.path
