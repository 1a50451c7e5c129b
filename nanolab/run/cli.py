"""``nanolab fit / validate / test``: parse (``nanolab.run.parse``), then build and run
(``nanolab.run.compose.launch``); a bad value ends in one error line and exit 2.

Exit codes (docs/guarantees.md): 0 done (also stopped by a budget), 1 crashed (one line when a
rank of the run died), 2 bad input or a run directory in use, 3 diverged, 74 disk full, quota
or file-size limit (make room, rerun to resume), 75 preempted (rerun the same command to
resume; also after a rollback from a loss spike in a multi-process run). A one-process run
that rolls back continues in the same process.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from nanolab.callbacks.checkpoint_io import CheckpointWriteError
from nanolab.errors import (
    EXIT_CRASHED,
    EXIT_DISK_FULL,
    NanolabError,
    out_of_room,
    storage_message,
    storage_refused,
)
from nanolab.messages import say
from nanolab.run.compose import launch
from nanolab.run.parse import nulls_as_class_settings, parse_command

#: What ends a run as one error line and exit 2: every error a user can fix, and a checkpoint
#: write refused for room (a full disk, a quota, a file-size limit: older checkpoints are
#: intact, the message says so; that one exits EXIT_DISK_FULL).
USER_ERRORS = (NanolabError, CheckpointWriteError)


def run_lightning_cli(argv: list[str]) -> int:
    """Run ``fit``/``validate``/``test`` with ``argv`` (``VERB ARGS``); the exit code."""
    from nanolab.callbacks.events import NothingToTrain
    from nanolab.callbacks.runlock import release_all
    from nanolab.run.quiet import quiet_lightning

    quiet_lightning()  # start-up chatter; the banner says what matters
    from nanolab.run import short_help

    if short_help.wants_short_help(argv):  # one page; Lightning's ~900 lines: --help-all
        print(short_help.page(argv[0]))
        return 0
    from_command_line = argv == sys.argv[1:]
    argv = nulls_as_class_settings(short_help.full_help_argv(argv))
    if from_command_line:
        sys.argv[1:] = argv  # LightningCLI reads them there (it warns when given both)
    from nanolab.callbacks.spike import rolled_back

    while True:
        try:
            trainer = launch(parse_command(argv, from_command_line=from_command_line))
        except NothingToTrain as done:  # the run is as it was: no banner, no summary
            print(f"nanolab {argv[0]}: {done}", file=sys.stderr)
            return 0
        except USER_ERRORS as err:
            print(f"nanolab {argv[0]}: error: {err}", file=sys.stderr)
            return EXIT_DISK_FULL if out_of_room(err) else 2
        except OSError as err:
            if not storage_refused(err):
                raise
            print(f"nanolab {argv[0]}: error: {storage_message(err)}", file=sys.stderr)
            return EXIT_DISK_FULL if out_of_room(err) else 2
        except RuntimeError as err:
            from nanolab.callbacks.lost_rank import lost_rank_of, say_lost_rank

            lost = lost_rank_of(err)  # a rank this process launched died (the launch asked)
            if lost is None:
                raise
            say_lost_rank(argv[0], lost)
            return EXIT_CRASHED
        finally:
            release_all()
        if not rolled_back(trainer):
            break
        from nanolab.callbacks.preemption import EXIT_PREEMPTED, signalled

        # Every rank would have to start over together; a signal at the rolled-back step asked
        # the run to stop (continuing would ignore it): rerun.
        if trainer.world_size > 1 or signalled(trainer):
            if trainer.is_global_zero:
                print(
                    f"nanolab {argv[0]}: rolled back ({rollback_detail(trainer)}); rerun the "
                    "same command to continue from there",
                    file=sys.stderr,
                )
            return EXIT_PREEMPTED
        say(f"nanolab {argv[0]}", f"{rollback_detail(trainer)}; continuing")
        # The same command again, resuming this run (whatever --ckpt_path first started it).
        argv = [*argv, "--run.resume", "auto", "--ckpt_path", "last"]
        if from_command_line:
            sys.argv[1:] = argv
    if argv[0] == "fit" and trainer.is_global_zero:
        try:
            print(end_block(trainer), flush=True)
        except Exception as err:  # a summary must never change how the run ended
            print(f"nanolab fit: (no end summary: {type(err).__name__}: {err})", flush=True)
    from nanolab.callbacks.divergence import EXIT_DIVERGED, diverged
    from nanolab.callbacks.events import stop_reason

    reason, detail = stop_reason(trainer)
    stopped = diverged(trainer)
    if stopped is None and reason != "diverged":
        return 0
    if trainer.is_global_zero:  # a non-finite loss (divergence.*) or a finite spike (spike.*)
        from nanolab.callbacks.checkpoint import newest_saved

        last = newest_saved(trainer)
        kept = f"newest checkpoint: {last}" if last is not None else "no checkpoint saved"
        what = stopped.describe() if stopped is not None else detail or "diverged"
        if stopped is not None:
            hint = stopped.hint(trainer)
        else:  # the spike guard gave up on finite spikes: from its newest checkpoint
            from nanolab.callbacks.divergence import divergence_fix
            from nanolab.callbacks.spike import stopping_spike_began

            hint = divergence_fix(trainer, None, spike_began=stopping_spike_began(trainer))
        print(
            f"nanolab {argv[0]}: diverged: {what}; stopped at step "
            f"{trainer.global_step} ({kept})" + (f"; {hint}" if hint else ""),
            file=sys.stderr,
        )
    return EXIT_DIVERGED


def end_block(trainer: object) -> str:
    """How the fit ended, in a few lines under its last progress line: the reason, the
    validation (and task) numbers, the checkpoint, time and goodput, and what to run next."""
    from nanolab.callbacks.checkpoint import newest_saved
    from nanolab.runlog import RUN_LOG_NAME, last_record, written_in_training
    from nanolab.runs import duration

    run_dir = Path(trainer.default_root_dir)  # type: ignore[attr-defined]
    log = run_dir / RUN_LOG_NAME
    # Each lookup names its event: only lines that can hold one are parsed (a run without
    # tasks records read its whole log, parsing every line: 32 s at 1M lines).
    end = last_record(log, "end") or {}
    # The run's own numbers: a later `nanolab validate` or `eval` appends records of its own
    # (other data, suite or example count) that would read as the run's.
    val = last_record(log, "val", where=written_in_training) or {}
    tasks = last_record(log, "tasks", where=written_in_training) or {}
    reason = end.get("reason", "ended")
    lines = [f"nanolab fit: {run_dir} {reason} at step {end.get('step', '?')}"
             + (f" ({end['detail']})" if end.get("detail") else "")]  # fmt: skip
    if val:
        best, loss, bpb = end.get("best_val_loss"), val.get("val_loss"), val.get("val_bpb")

        def number(x: object) -> str:
            return f"{x:.4f}" if isinstance(x, int | float) else "nan"

        lines.append(
            f"  val loss {number(loss)} at step {val.get('step')}"
            + (f" (best {number(best)})" if isinstance(best, int | float) else "")
            + (f", bpb {number(bpb)}" if isinstance(bpb, int | float) else "")
        )
    scores = [f"{k.split('/')[1]} {v:.3f}" for k, v in tasks.items()
              if k.startswith("tasks/") and k.endswith("/score") and isinstance(v, int | float)]  # fmt: skip
    if scores:
        lines.append(f"  tasks at step {tasks.get('step')}: " + ", ".join(scores))
    wall = end.get("elapsed_s")
    goodput = end.get("goodput")
    lines.append(
        f"  {duration(wall) if isinstance(wall, int | float) else '-'} of wall time"
        + (f", goodput {goodput:.2f}" if isinstance(goodput, int | float) else "")
    )
    last = newest_saved(trainer)
    report = f"nanolab report {shlex.quote(str(run_dir.parent))}"
    if ended_diverged(trainer):  # not the diverged state: the branch from before it
        if last is not None:
            lines.append(f"  checkpoint {last}")
        branch = diverged_branch(trainer)
        fix = branch[1] if branch is not None else "a new run with a lower model.optimizer.lr"
        lines.append(f"  next: {fix}   |   {report}")
    elif last is not None:
        lines.append(f"  checkpoint {last}")
        if not builds_gpt(trainer):  # generate rebuilds nanolab's GPT: it cannot sample this
            lines.append(f"  next: {report}")
            return "\n".join(lines)
        sample = (
            f"nanolab generate --ckpt {shlex.quote(str(last))}{import_flags(trainer)} "
            "--prompt '...'"
            if not last.is_dir()  # a sharded folder: generate says how to make it one file
            else "convert the sharded checkpoint to one file for generate (docs/scaling.md)"
        )
        lines.append(f"  next: {sample}   |   {report}")
    return "\n".join(lines)


def builds_gpt(trainer: object) -> bool:
    """Whether the run's module is nanolab's GPT module (or a subclass), whose checkpoints carry
    the GPT config generate and export rebuild the model from; a fork's plain LightningModule
    (no ``model.gpt``) carries none."""
    return getattr(getattr(trainer, "lightning_module", None), "gpt_config", None) is not None


def ended_diverged(trainer: object) -> bool:
    """Whether the fit stopped as diverged: the divergence stop's verdict (a non-finite loss
    or gradient norm, a collapsed fp16 loss scale) or the spike guard's (finite spikes it gave
    up on)."""
    from nanolab.callbacks.divergence import diverged
    from nanolab.callbacks.events import stop_reason

    return diverged(trainer) is not None or stop_reason(trainer)[0] == "diverged"  # type: ignore[arg-type]


def diverged_branch(trainer: object) -> tuple[Path | None, str] | None:
    """The branch the exit line of a diverged fit names, ``(checkpoint, command)`` (the
    checkpoint None: from step 0): from the newest checkpoint a finite step followed, or from
    before the skipped steps or the loss spike. None when the run's learning rate is unknown."""
    from nanolab.callbacks.divergence import branch_plan, diverged

    stopped = diverged(trainer)  # type: ignore[arg-type]
    if stopped is not None:
        return stopped.branch(trainer)  # type: ignore[arg-type]
    from nanolab.callbacks.spike import stopping_spike_began

    return branch_plan(trainer, None, spike_began=stopping_spike_began(trainer))  # type: ignore[arg-type]


def import_flags(trainer: object) -> str:
    """`` --import MODULE`` for each module that registered a part of the run's model (an
    attention variant of a project's own, say) that generate would not import by itself
    (:func:`nanolab.model.registry.imports_needed`: not named by a ``nanolab.plugins`` entry
    point); "" when there is none."""
    from nanolab.model.registry import imports_needed, part_modules

    gpt = getattr(getattr(trainer, "lightning_module", None), "gpt_config", None)
    if gpt is None:
        return ""
    return "".join(
        f" --import {shlex.quote(m)}" for m in imports_needed(part_modules(gpt).values())
    )


def rollback_detail(trainer: object) -> str:
    """The rollback's own sentence (from the stop reason's detail)."""
    from nanolab.callbacks.events import stop_reason

    return stop_reason(trainer)[1] or "rolled back"  # type: ignore[arg-type]
