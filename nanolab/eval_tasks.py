"""``nanolab eval``: in-context task accuracies of a checkpoint (docs/evaluate.md).

``nanolab eval RUN_DIR_OR_CKPT --suite SUITE`` scores a checkpoint on a suite of local task
files (``builtin:shakespeare``, a YAML list of tasks, or a DCLM evaluation bundle's folder for
CORE) with the checkpoint's own tokenizer, and prints each task's accuracy, normalized accuracy
and centered score with its standard error, and the suite's mean centered score (called CORE
only when the suite is CORE). Given a run directory it
evaluates the run's newest complete checkpoint and appends a ``tasks`` record to the run's
``metrics.jsonl`` (holding the run directory's lock; with a fit running there, it prints
instead), which is what ``nanolab report`` and the loggers read. The numbers are exactly those
the in-loop callback (``--downstream.suite``) logs for the same checkpoint.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nanolab.errors import NanolabError, one_line_errors, storage_message, with_errno_of
from nanolab.messages import say, warn_line


class EvalArgumentError(NanolabError):
    """An option of ``nanolab eval`` that cannot work."""


def checkpoint_and_run(target: str) -> tuple[Path, Path | None, int | None, str | None]:
    """The checkpoint to evaluate, the run directory it belongs to (None for a loose file),
    its step (None: read it from the checkpoint) and, for a run directory, the run it scores
    (:func:`nanolab.callbacks.evaluation_log.scored_run`: its record goes to that run's log
    only). A run directory's newest checkpoint is held open from the pick
    (:func:`nanolab.model.checkpoint.hold`): loading it reads the file picked, even when a
    live run's rotation deletes its name meanwhile."""
    from nanolab.callbacks.evaluation_log import log_owner, scored_run
    from nanolab.model.checkpoint import CheckpointError, sharded_folder_error
    from nanolab.training.resume import find_resume_checkpoint

    if not target:  # Path("") is the current folder, named "" in every message after
        raise CheckpointError(
            "the checkpoint to evaluate is empty (''); give a run directory or a .ckpt file"
        )
    path = Path(target)
    sharded = sharded_folder_error(path)
    if sharded is not None:
        raise sharded
    if path.is_dir():
        run_dir = path.parent if path.name == "checkpoints" else path
        owner = log_owner(run_dir)  # before the pick: a run that replaces this one changes it
        choice = find_resume_checkpoint(run_dir, hold=True)
        warning = choice.warning()
        if warning:
            warn_line(warning.replace("resuming from", "evaluating"))
        if choice.chosen is None:
            raise CheckpointError(
                f"{target}: no complete checkpoint in this run directory; train it first or "
                "give a .ckpt file"
            )
        chosen = choice.chosen
        return chosen.path, run_dir, chosen.step, scored_run(chosen.run_id, owner)
    if not path.is_file():
        raise CheckpointError(f"{target} does not exist; give a run directory or a .ckpt file")
    parent = path.parent
    run_dir = parent.parent if parent.name == "checkpoints" else None
    return path, run_dir, None, None


def run_settings(run_dir: Path | None) -> tuple[int | None, str | None]:
    """The run's training micro-batch and precision (its ``config.yaml``): the defaults for
    rows per batch and for the precision the model is scored in, so that ``eval`` computes
    what the in-loop callback computed."""
    if run_dir is None or not (run_dir / "config.yaml").is_file():
        return None, None
    from nanolab.training.resolve import load_yaml

    try:
        config = load_yaml((run_dir / "config.yaml").read_text(encoding="utf-8")) or {}
        data = config.get("data") or {}
        precision = (config.get("trainer") or {}).get("precision")
    except Exception:  # an unreadable config only loses the defaults
        return None, None
    value = (data.get("init_args") or data).get("micro_batch_size")
    micro = int(value) if isinstance(value, int) and value > 0 else None
    return micro, str(precision) if precision is not None else None


def precision_context(precision: str | None, device: Any) -> Any:
    """Autocast for a ``*-mixed`` precision (what Lightning's plugin does in the loop); fp32
    otherwise. ``*-true`` precisions are applied to the weights by the caller."""
    import contextlib

    import torch

    if precision in ("bf16-mixed", "16-mixed"):
        dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float16
        return torch.autocast(device.type, dtype=dtype)
    return contextlib.nullcontext()


def check_json_target(text: str) -> Path:
    """``--json``: a new file, or one an earlier ``eval --json`` wrote, in an existing folder
    and inside no run directory (a run's files are its own: eval adds only its record to the
    evaluated run's log)."""
    from nanolab.runlog import refuse_inside_run

    out = Path(text)
    if not text.strip():
        raise EvalArgumentError("--json is empty; give a file name, e.g. --json results.json")
    if out.is_dir():
        raise EvalArgumentError(f"--json {text} is a folder; give a file name")
    if not out.parent.is_dir():
        raise EvalArgumentError(
            f"--json {text}: folder {out.parent} does not exist; create it first"
        )
    refuse_inside_run(text, "--json", EvalArgumentError)  # the tasks record goes in the log
    if not os.access(out.parent, os.W_OK):  # before the scoring and the run log's record
        raise EvalArgumentError(
            f"--json {text}: this user cannot write in {out.parent} (read-only or no "
            "permission); give a file in a folder you can write"
        )
    if out.exists() and not _eval_output(out):
        raise EvalArgumentError(
            f"--json {text} already exists and is not an earlier `nanolab eval --json` "
            "result; give a new file name (eval replaces only its own output)"
        )
    return out


def write_json_result(out: Path, record: dict[str, Any]) -> None:
    """``--json``: the record replaces ``out`` whole, through a temporary file of this call's
    own (:func:`nanolab.atomic.write_whole`: nothing planted beside ``out`` is written through,
    two shells cannot share a half-written copy). A refused write is one line naming ``--json``
    (exit 74 for a full disk or a size limit, 2 otherwise), the run's log left as it was."""
    from nanolab.atomic import write_whole

    try:
        write_whole(out, json.dumps(record, indent=1) + "\n")
    except OSError as err:
        raise with_errno_of(
            EvalArgumentError(f"--json {out}: {storage_message(err)}"), err
        ) from None


def _eval_output(path: Path) -> bool:
    """Whether ``path`` holds one JSON ``tasks`` record as ``eval --json`` writes it."""
    try:
        if path.stat().st_size > 1 << 20:
            return False
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(record, dict) and record.get("evaluated_by") == "nanolab eval"


def result_table(result: Any) -> str:
    """One line per task (its accuracies, the score its centered value uses, ± one standard
    error) and the suite's mean centered score (CORE only when the suite is CORE)."""
    from nanolab.tables import table

    rows = []
    for t in result.tasks:
        err = t.stderr() / (1 - t.baseline)
        rows.append(
            [t.name, t.kind, str(t.n), f"{t.acc:.3f}", f"{t.acc_norm:.3f}",
             f"{t.score:.3f} {t.metric}", f"{t.centered:+.3f}", f"{err:.3f}"]
        )  # fmt: skip
    rows.append([f"{result.label} (mean of tasks)", *[""] * 5, f"{result.core:+.3f}", ""])
    headers = ["task", "kind", "n", "acc", "acc_norm", "score", "centered", "± s.e."]
    return "\n".join(table(rows, headers, right={2, 3, 4, 6, 7}))


@one_line_errors("nanolab eval")
def main(argv: Sequence[str] | None = None) -> int:
    import torch

    from nanolab.helpfmt import DefaultsHelpFormatter, OneLineParser

    parser = OneLineParser(
        prog="nanolab eval",
        description="In-context task accuracies of a checkpoint (docs/evaluate.md).",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("target", help="a run directory (its newest checkpoint) or a .ckpt file")
    parser.add_argument(
        "--suite",
        default="builtin:shakespeare",
        help="builtin:<name>, a YAML list of tasks, or a DCLM evaluation bundle folder (CORE)",
    )
    parser.add_argument("--limit", type=int, default=None, help="at most N examples per task")
    parser.add_argument(
        "--rows",
        type=int,
        default=None,
        help="sequences per forward pass (default: the run's training micro-batch, else 8)",
    )
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda, ..."
    )
    parser.add_argument(
        "--precision",
        default=None,
        choices=["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"],
        help="what the model is scored in (default: the run's trainer.precision, else 32-true)",
    )
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument(
        "--no-log",
        action="store_true",
        help="do not append a record to the run's metrics.jsonl (a .ckpt file given: never)",
    )
    from nanolab.model.registry import add_import_option

    add_import_option(parser)
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        raise EvalArgumentError("--limit must be >= 1 (or left out for every example)")
    if args.rows is not None and args.rows < 1:
        raise EvalArgumentError("--rows must be >= 1")
    from nanolab.downstream.scoring import evaluate_suite
    from nanolab.downstream.tasks import load_suite
    from nanolab.model.checkpoint import (
        load_checkpoint,
        model_from_checkpoint,
        tokenizer_from_checkpoint,
    )
    from nanolab.model.device import check_device
    from nanolab.model.registry import import_modules

    suite = load_suite(args.suite, args.limit)  # bad task files fail before the model loads
    device = check_device(args.device)
    path, run_dir, step, run_id = checkpoint_and_run(args.target)
    # A run directory given: its record goes into its log. A checkpoint file given: printed
    # only (as validate/test do), though its run's settings are still the defaults.
    log_dir = None if Path(args.target).is_file() or args.no_log else run_dir
    out = check_json_target(args.json) if args.json is not None else None
    import_modules(args.imports)
    ckpt = load_checkpoint(path)
    model = model_from_checkpoint(ckpt, path).to(device)
    tokenizer = tokenizer_from_checkpoint(ckpt, path)
    if step is None:  # a hand-edited checkpoint's non-number step reads as unknown (0)
        saved = ckpt.get("global_step")
        step = saved if isinstance(saved, int) and not isinstance(saved, bool) else 0
    micro, precision = run_settings(run_dir)
    precision = args.precision or precision or "32-true"
    if precision in ("bf16-true", "16-true"):
        model = model.to(torch.bfloat16 if precision.startswith("bf16") else torch.float16)
    rows = args.rows or micro or 8
    print(
        f"nanolab eval: {path} (step {step}), suite {args.suite}, {rows} rows per batch, "
        f"precision {precision}",
        file=sys.stderr,
    )
    with precision_context(precision, device):
        result = evaluate_suite(
            model,
            tokenizer,
            suite,
            block_size=model.config.block_size,
            rows=rows,
            vocab_size=model.config.vocab_size,
            device=device,
        )
    print(result_table(result))
    say("nanolab eval", f"{result.seconds:.1f}s for {sum(t.n for t in result.tasks)} examples")
    record = {
        "event": "tasks",
        "time": time.time(),
        "step": step,
        "evaluated_by": "nanolab eval",
        "checkpoint": str(path),
        "suite": str(args.suite),
        **result.record(),
    }
    if out is not None:  # first: a file that cannot be written leaves the run's log as it was
        write_json_result(out, record)
    if log_dir is not None:
        append_to_run(log_dir, record, run_id)
    return 0


def append_to_run(run_dir: Path, record: dict[str, Any], run_id: str | None) -> None:
    """Append the record to the log of run ``run_id`` in ``run_dir``, holding the directory (a
    fit there, or another run there since: not logged, :mod:`nanolab.callbacks.evaluation_log`)."""
    from nanolab.callbacks.evaluation_log import append_evaluation

    path = append_evaluation(run_dir, record, run_id, "nanolab eval")
    if path is not None:
        say("nanolab eval", f"tasks record (step {record['step']}) appended to {path}")
