"""The ``nanolab`` command.

``fit``, ``validate`` and ``test`` are Lightning's own subcommands (LightningCLI, configured with
YAML files that compose: ``--config a.yaml --config b.yaml``). Every other verb is a small module
with a ``main(argv) -> int`` function, registered in :data:`VERBS`; a fork adds its own verb by
adding one line there.
"""

from __future__ import annotations

import difflib
import errno
import importlib
import os
import select
import sys
from collections.abc import Sequence

#: Verb -> ("module:function", one-line help). Lightning's verbs are handled by LightningCLI.
VERBS: dict[str, tuple[str, str]] = {
    "prepare": ("nanolab.data.prepare:main", "tokenize text files into train.bin/val.bin"),
    "generate": ("nanolab.generate:main", "sample text from a checkpoint"),
    "eval": (
        "nanolab.eval_tasks:main",
        "in-context task accuracies of a checkpoint (CORE: a DCLM bundle)",
    ),
    "lm-eval": ("nanolab.downstream.harness:main", "lm-evaluation-harness on a checkpoint"),
    "export": (
        "nanolab.export:main",
        "write a checkpoint as a Hugging Face folder or as safetensors (--format)",
    ),
    "estimate": ("nanolab.estimator.cli:main", "predict memory, time and cost before a run"),
    "report": ("nanolab.report.cli:main", "summarise runs from their metrics.jsonl logs"),
    "status": (
        "nanolab.queue.status:main",
        "what is running, queued and finished (reads files only)",
    ),
    "queue": ("nanolab.queue.cli:main", "queue experiments and run them one per GPU"),
    "bench": ("nanolab.bench:main", "nanolab vs a plain PyTorch loop, side by side"),
    "init": ("nanolab.scaffold:main", "write a starter project folder for a fork"),
}

#: Verbs that need no working directory when every path they read is given in full: they
#: import no torch (which ends in a native fatal error without one) and check the paths they
#: were given themselves (:func:`nanolab.helpfmt.relative_path_without_working_directory`).
READ_ONLY_GIVEN_PATHS = ("status", "report")

LIGHTNING_VERBS: dict[str, str] = {
    "fit": "train a model (LightningCLI; --config X.yaml, --print_config)",
    "validate": "evaluate on the validation set",
    "test": "evaluate on the test split (the validation windows)",
}


def _usage() -> str:
    lines = [
        "usage: nanolab [-q | -v] <verb> [options]   (nanolab <verb> --help for each)",
        "",
        "  -q, --quiet    only warnings and errors besides the command's output",
        "  -v, --verbose  also debug detail (or NANOLAB_VERBOSITY=quiet|normal|verbose)",
        "",
        "verbs:",
    ]
    for verb, text in LIGHTNING_VERBS.items():
        lines.append(f"  {verb:<10} {text}")
    for verb, (_, text) in VERBS.items():
        lines.append(f"  {verb:<10} {text}")
    return "\n".join(lines)


#: Whether the verb's own code has been entered: a Ctrl-C before that (its modules still
#: importing, seconds for torch) was a traceback of the import; nothing had run.
_VERB_ENTERED: list[bool] = []


def main(argv: Sequence[str] | None = None) -> int:
    _VERB_ENTERED.clear()  # this call's verb (tests call main more than once in a process)
    try:
        return _run(argv)
    except KeyboardInterrupt:
        if _VERB_ENTERED:  # the verb's own Ctrl-C, which it leaves to Python: as before
            raise
        args = list(sys.argv[1:] if argv is None else argv)
        verb = next((a for a in args if not a.startswith("-")), "")
        print(f"nanolab {verb}: interrupted; nothing was written".replace(" :", ":"),
              file=sys.stderr)  # fmt: skip
        return 130
    except BrokenPipeError:
        # `nanolab estimate --list-gpus --json | head`: the reader has gone, which is not an
        # error of ours. Point stdout at /dev/null so the flush at exit does not raise again,
        # and end as a process killed by SIGPIPE would (128 + 13), without a traceback.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


def stdout_reader_gone() -> bool:
    """Whether this process's stdout is a pipe (or socket) whose reader has gone: what a
    BrokenPipeError means when ``nanolab ... | head`` stops reading, and only then.

    A flush that fails says so (what the reader left unread is still buffered); with nothing
    buffered, the kernel flags a pipe without a reader as an error to poll (Linux: POLLERR).
    """
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        return True
    except (OSError, ValueError):
        pass  # closed or unusable some other way: not a reader that left
    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
    except (AttributeError, OSError, ValueError):  # a stream without a descriptor, no poll
        return False
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def _pipe_error(args: Sequence[str], err: BrokenPipeError) -> int:
    """A pipe other than stdout broke inside the verb ``args[0]``: one line naming where (exit
    1, as an uncaught error), the traceback with ``-v``. It is no fault of the input or of
    stdout's reader, and never the silent exit 141 of a reader that left."""
    import traceback

    from nanolab.messages import debug

    prog = f"nanolab {args[0]}" if args else "nanolab"
    where = traceback.extract_tb(err.__traceback__)[-1] if err.__traceback__ else None
    at = f" at {os.path.basename(where.filename)}:{where.lineno} in {where.name}" if where else ""
    debug(prog, "".join(traceback.format_exception(err)).rstrip())
    print(
        f"{prog}: error: a pipe to another process closed early ({err}){at}; this is a bug "
        "of nanolab's (or of the fork's code there): please report it with the command "
        "(-v shows the traceback)",
        file=sys.stderr,
    )
    return 1


def _run(argv: Sequence[str] | None) -> int:
    from nanolab.messages import flag_verbosity, split_verbosity

    verbosity, args = split_verbosity(list(sys.argv[1:] if argv is None else argv))
    with flag_verbosity(verbosity):
        try:
            return _dispatch(args)
        except BrokenPipeError as err:
            if err.errno == errno.EPIPE and stdout_reader_gone():
                raise  # the reader of stdout has gone: main ends as SIGPIPE would
            # Another pipe broke (one to a child process): an error like any other, which
            # ending as SIGPIPE would hide (no message, exit 141, the queue quoting whatever
            # line came before).
            return _pipe_error(args, err)


def _dispatch(args: list[str]) -> int:
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        from nanolab import __version__

        print(f"nanolab {__version__}")
        return 0
    verb = args[0]
    from nanolab.helpfmt import working_directory_gone

    if (
        (verb in VERBS or verb in LIGHTNING_VERBS)
        and verb not in READ_ONLY_GIVEN_PATHS
        and (gone := working_directory_gone())
    ):
        from nanolab.errors import NanolabError, report

        return report(f"nanolab {verb}", NanolabError(gone))
    if verb in VERBS or verb in LIGHTNING_VERBS:
        from nanolab.allocator import prefer_expandable_segments

        prefer_expandable_segments()  # before any verb touches a GPU
    if verb in VERBS:
        module_name, func_name = VERBS[verb][0].split(":")
        func = getattr(importlib.import_module(module_name), func_name)
        _VERB_ENTERED.append(True)
        return int(func(args[1:]) or 0)
    if verb in LIGHTNING_VERBS:
        from nanolab.errors import NanolabError, report
        from nanolab.run.keys import preflight
        from nanolab.training import early_signals

        try:  # before Lightning's import: a typo or an alias bomb is refused in a second
            preflight(verb, args[1:])
        except NanolabError as err:
            return report(f"nanolab {verb}", err)
        from nanolab.run import short_help

        if short_help.wants_short_help(args) and (page := short_help.remembered_page(verb)):
            print(page)  # as an earlier --help of this code wrote it, without Lightning
            return 0
        if verb != "fit":
            from nanolab.run.cli import run_lightning_cli

            _VERB_ENTERED.append(True)
            with early_signals.ranks_end_with_launch(verb) as launch:  # its ranks die with it
                launch.exit_code = run_lightning_cli(args)
                return launch.exit_code
        _VERB_ENTERED.append(True)  # fit's start-up signals are early_signals' from here
        # Before the heavy imports: a SIGTERM during start-up ends in exit 75, not 143; the
        # handlers are this run's only, and put back when it ends.
        with early_signals.held_during_startup() as launch:
            from nanolab.run.cli import run_lightning_cli

            launch.exit_code = run_lightning_cli(args)
            return launch.exit_code
    known = [*VERBS, *LIGHTNING_VERBS]
    near = VERB_ALIASES.get(verb) or next(
        iter(difflib.get_close_matches(verb, known, 1, 0.6)), None
    )
    hint = f"; did you mean `nanolab {near}`?" if near else ""
    print(f"nanolab: unknown verb {verb!r}{hint}\n\n{_usage()}", file=sys.stderr)
    return 2


#: Verbs of other tools a newcomer types, and nanolab's for them.
VERB_ALIASES = {"train": "fit", "evaluate": "validate", "sample": "generate"}


if __name__ == "__main__":
    sys.exit(main())
