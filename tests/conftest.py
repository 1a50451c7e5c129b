"""Shared fixtures: a tiny prepared dataset, tiny configs, and a way to run the real CLI."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import yaml

from nanolab.data.prepare import prepare_dataset

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "configs" / "quickstart.yaml"

torch.set_num_threads(1)

# A suite started in the background by a script (`pytest &`, or a CI step run that way) inherits
# SIGINT ignored, and every nanolab command a test starts would then keep ignoring it (an ignored
# signal stays ignored: nohup's contract, which nanolab keeps). The tests that send SIGINT mean a
# terminal's Ctrl-C, so the suite takes the default back and its children start with it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The estimator remembers model facts on disk between launches (nanolab/estimator/facts_cache.py);
# the suite's CLI runs get a cache of their own, not the user's ~/.cache, removed when the
# session ends (one given in the environment is the caller's, and kept).
_ESTIMATOR_CACHE: str | None = None
if "NANOLAB_ESTIMATOR_CACHE" not in os.environ:
    _ESTIMATOR_CACHE = tempfile.mkdtemp(prefix="nanolab-estimator-cache-")
    os.environ["NANOLAB_ESTIMATOR_CACHE"] = _ESTIMATOR_CACHE


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _ESTIMATOR_CACHE is not None:
        shutil.rmtree(_ESTIMATOR_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run fastest on one thread, and a shared CI box does not thrash; a test that
    changes the thread count cannot leak it into the next one."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _console_handlers() -> list:
    """The plain console handler of every logger (Lightning's, lm-eval's, the root's)."""
    import logging

    loggers = [logging.root]
    loggers += [
        v for v in logging.root.manager.loggerDict.values() if isinstance(v, logging.Logger)
    ]
    return [h for lg in loggers for h in lg.handlers if type(h) is logging.StreamHandler]


@pytest.fixture(autouse=True)
def _lightning_logs_to_this_tests_stderr() -> None:
    """Point the loggers' console handlers at the current ``sys.stderr`` before each test.

    Lightning (and lm-eval) give their loggers a StreamHandler bound to whatever ``sys.stderr``
    was when it was first imported: in a test run, some earlier test's capture stream, closed
    since. Every later log line would then print "--- Logging error ---" into the stderr that
    tests read for one-line errors.
    """
    for handler in _console_handlers():
        # Not setStream: it flushes the old stream first, which may be closed by now.
        handler.stream = sys.stderr


@pytest.fixture(autouse=True)
def _verbosity_per_test():
    """A test that runs a verb with ``-q`` in this process (``nanolab_here("-q", ...)``) sets
    the ``nanolab`` logger to quiet for the process: a later test reading a ``say`` line on
    stderr found none. Each test ends with the verbosity the environment asks for (Lightning's
    quieted loggers restored too), as a new process would have it."""
    from nanolab import messages

    yield
    if messages.LOGGER.handlers:  # configured by this test or an earlier one
        messages.configure()


@pytest.fixture
def lm_eval_local_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """lm-eval in this process without the two things of its own no test reads: the index of
    its ~14,000 built-in task YAMLs, built before every run (the tests' tasks are local files,
    ``--include_path``), and the environment report ``simple_evaluate`` adds to its results
    (``pip list``, ``conda list``, ``nvcc``...). Each is 5-10 s on 2 cores."""
    from lm_eval import evaluator, tasks

    class LocalTasks(tasks.TaskManager):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **{**kwargs, "include_defaults": False})

    monkeypatch.setattr(tasks, "TaskManager", LocalTasks)
    monkeypatch.setattr(evaluator, "add_env_info", lambda storage: None)


@pytest.fixture(scope="session")
def char_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled corpus, character-tokenized, prepared once per test session."""
    out = tmp_path_factory.mktemp("data") / "shakespeare_char"
    prepare_dataset(["bundled:shakespeare"], out, "chars", quiet=True)
    return out


def tiny_overrides(dataset_dir: Path, runs: Path, **extra: object) -> dict:
    """A 2-layer, 32-wide model on the prepared data: a step takes a few milliseconds."""
    cfg: dict = {
        "trainer": {
            "max_steps": 6,
            "enable_progress_bar": False,
            "enable_model_summary": False,
        },
        "model": {"gpt": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32}},
        "data": {
            "dataset_dir": str(dataset_dir),
            "source": None,
            "micro_batch_size": 4,
            "val_windows": 16,
        },
        "run": {"root": str(runs), "name": "tiny", "eval_every_steps": 3},
        # The quickstart scores its cloze in the loop; a test asks for it when it tests it.
        "downstream": {"suite": None},
    }
    for dotted, value in extra.items():
        node = cfg
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return cfg


def hold_like_a_live_launch(run_dir: Path) -> None:
    """The run lock file a launch writes while it trains, naming this (live) test process: a
    log written by hand without an end record is then a run still training, as ``status`` and
    ``report`` read it (without the file, no process holds the run: it ended)."""
    import json
    import socket

    from nanolab.processes import RUN_LOCK_NAME, pid_namespace

    holder = {"host": socket.gethostname(), "pid": os.getpid(), "pid_namespace": pid_namespace()}
    (run_dir / RUN_LOCK_NAME).write_text(json.dumps({**holder, "started": "now"}))


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_nanolab(
    *args: str, cwd: Path, timeout: float = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run the installed CLI as a user would, one thread per process (2 cores thrash otherwise)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "nanolab", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def nanolab_here(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """``nanolab ARGS`` through the CLI's entry point in this process, output captured, as
    :func:`run_nanolab` returns it: for a test's setup (a run it then reads or resumes in a real
    process) or a check that is not about the process. A tiny fit takes under a second here; a
    process pays ~8 s of imports on 2 cores. The working directory and the environment are put
    back afterwards, and the loggers' console handlers point at this test's stderr."""
    import contextlib
    import io

    from nanolab.cli import main

    out, err = io.StringIO(), io.StringIO()
    outer_stderr, cwd_before, env_before = sys.stderr, os.getcwd(), dict(os.environ)

    try:
        os.environ.update(env or {})
        os.chdir(cwd)
        for handler in _console_handlers():
            handler.stream = err
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exit_:
                if isinstance(exit_.code, str):
                    print(exit_.code, file=sys.stderr)
                code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    finally:
        os.chdir(cwd_before)
        os.environ.clear()
        os.environ.update(env_before)
        for handler in _console_handlers():  # those a first import made too
            handler.stream = outer_stderr
    return subprocess.CompletedProcess(["nanolab", *args], code, out.getvalue(), err.getvalue())
