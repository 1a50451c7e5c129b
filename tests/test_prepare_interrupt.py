"""Ctrl-C during a ``nanolab prepare`` of worker processes: one line, exit 130, promptly, and
the dataset it was replacing left as it was.

A terminal's Ctrl-C sends SIGINT to the whole process group, the workers included: they ignore
it and the parent ends them. It used to kill them mid-block (a traceback each), and the pool's
clean-up then failed on a future the parent had cancelled, so the interpreter waited at exit,
for ever, on a thread feeding blocks to workers that were gone.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanolab.data.prepare import PARALLEL_MIN_BYTES, default_workers, prepare_dataset

pytestmark = pytest.mark.skipif(
    default_workers() < 2, reason="needs 2 usable cores: the worker pool is what is tested"
)

ANSWER = "nanolab prepare: interrupted; nothing was written"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """~40 MB of text of varied words: over the pool's threshold, and long enough to tokenize
    that a signal at 2.2 s still lands in it on a quiet machine (at ~10 MB a prepare could end
    before the 1.5 s signal: exit 0, the signal never sent)."""
    path = tmp_path_factory.mktemp("corpus") / "big.txt"
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(3000)]
    lines = [" ".join(rng.choices(words, k=12)) + ".\n" for _ in range(2000)]
    with open(path, "w") as f:
        size = 0
        while size < PARALLEL_MIN_BYTES + (32 << 20):
            chunk = "".join(rng.sample(lines, len(lines)))
            f.write(chunk)
            size += len(chunk)
    return path


def interrupt(corpus: Path, out: Path, delays: list[float]) -> tuple[int, str, float]:
    """Run prepare over the dataset in ``out`` (``--force``), SIGINT its process group after
    each delay; (exit code, stderr, seconds from the last signal to the exit)."""
    cmd = [
        sys.executable,
        "-m",
        "nanolab",
        "prepare",
        str(corpus),
        "-o",
        str(out),
        "--force",
        "--tokenizer",
        "bpe",
        "--bpe-vocab-size",
        "300",
        "--bpe-sample-bytes",
        "1M",
        "-q",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    sent = time.monotonic()
    try:
        for delay in delays:
            time.sleep(delay)
            sent = time.monotonic()
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"prepare did not exit within 30 s of SIGINT: {err[-3000:]}")
    return proc.returncode, err, time.monotonic() - sent


@pytest.mark.parametrize(
    "delays",
    [
        # Slow like the rest. Its rare failures: exit 0 from a suite started with SIGINT
        # ignored (conftest); a hang from a worker ended while writing its result (fixed, see
        # the test below); and once since, in a whole default run, the line printed and no exit
        # within 30 s, a cause not found yet.
        pytest.param([1.5], id="tokenizing", marks=pytest.mark.slow),
        pytest.param([0.3], id="starting", marks=pytest.mark.slow),
        pytest.param([0.7], id="sampling", marks=pytest.mark.slow),
        pytest.param([1.1], id="training", marks=pytest.mark.slow),
        pytest.param([2.2], id="later", marks=pytest.mark.slow),
        pytest.param([0.9, 0.05], id="twice", marks=pytest.mark.slow),
        pytest.param([1.6, 0.02, 0.02], id="three-times", marks=pytest.mark.slow),
    ],
)
def test_ctrl_c_to_the_process_group_exits_130_at_once_in_one_line(tmp_path, corpus, delays):
    out = tmp_path / "ds"
    (tmp_path / "old.txt").write_text("an old dataset, to be kept\n" * 50)
    prepare_dataset([str(tmp_path / "old.txt")], out, "bytes", quiet=True)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code, err, after = interrupt(corpus, out, delays)
    assert code == 130, (code, err[-3000:])
    assert err.strip().splitlines() == [ANSWER], err[-3000:]
    assert after < 5, f"exit {after:.1f} s after SIGINT"
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ds.")]


TORN_RESULT_WORKER = '''
import os, struct, sys, time

def torn(marker):
    """Start a 1 MiB result on the pool's result pipe, write 10 bytes of it, and wait: a
    worker that the parent ends here has left its result torn."""
    result_queue = sys._getframe(1).f_locals["result_queue"]
    os.write(result_queue._writer.fileno(), struct.pack("!i", 1 << 20) + b"x" * 10)
    open(marker, "w").close()
    time.sleep(600)
'''

TORN_RESULT_MAIN = """
import multiprocessing, os, sys, time
from concurrent.futures import ProcessPoolExecutor
from nanolab.data.prepare import _stop
import torn_worker

pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
pool.submit(torn_worker.torn, sys.argv[1])
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
time.sleep(0.5)  # the pool's manager thread is now reading the torn result
manager = pool._executor_manager_thread
started = time.monotonic()
_stop(pool)
alive = manager.is_alive()
print(f"{time.monotonic() - started:.2f} {alive}", flush=True)
"""


def test_a_worker_ended_while_writing_its_result_does_not_hang_the_stop(tmp_path):
    """The rare Ctrl-C hang: a worker ended mid-result left the pool's manager thread reading
    for ever (this process held the result pipe's write end open), so the stop waited 30 s and
    the interpreter then waited at exit for ever. Driven on purpose: a worker writes 10 bytes
    of a 1 MiB result and waits to be ended."""
    (tmp_path / "torn_worker.py").write_text(TORN_RESULT_WORKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    proc = subprocess.Popen(
        [sys.executable, "-c", TORN_RESULT_MAIN, str(tmp_path / "started")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the process did not exit after the stop: {out!r} {err[-2000:]}")
    assert proc.returncode == 0, err[-2000:]
    took, alive = out.split()
    assert float(took) < 5, f"the stop took {took} s"
    assert alive == "False", "the pool's manager thread was still reading"


BUSY_WORKERS_MAIN = """
import multiprocessing, os, sys, time
from concurrent.futures import ProcessPoolExecutor
from nanolab.data.encode import become_worker
from nanolab.data.prepare import _stop

pool = ProcessPoolExecutor(
    2,
    mp_context=multiprocessing.get_context("spawn"),
    initializer=become_worker,
    initargs=(os.getpid(),),
)
pool.submit(int).result()  # the workers have started, and ignore SIGINT and SIGTERM
for _ in range(2):
    pool.submit(time.sleep, 600)  # a block each that takes long to encode (BPE: seconds)
for _ in range(3):
    pool.submit(len, b"x" * (4 << 20))  # queued blocks: the feeder thread blocks on the pipe
time.sleep(1.0)
processes = list(pool._processes.values())
started = time.monotonic()
_stop(pool)
took = time.monotonic() - started
time.sleep(0.2)
print(f"{took:.2f} {sum(p.is_alive() for p in processes)}", flush=True)
"""


def test_the_stop_ends_busy_workers_that_ignore_sigterm_at_once(tmp_path):
    """Ctrl-C or SIGTERM to a 2-worker BPE prepare took 22-41 s to exit: the workers ignore
    SIGTERM (the parent decides), so the pool's terminate() left each going on through the
    blocks it had, seconds each, while the stop waited 30 s for the pool's manager thread.
    Driven on purpose: both workers are busy for 10 minutes and blocks of 4 MiB are queued."""
    proc = subprocess.Popen(
        [sys.executable, "-c", BUSY_WORKERS_MAIN],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the process did not exit after the stop: {out!r} {err[-2000:]}")
    assert proc.returncode == 0, err[-2000:]
    took, alive = out.split()
    assert float(took) < 5, f"the stop took {took} s"
    assert alive == "0", f"{alive} workers still running"
    assert not err.strip(), err[-2000:]


UNRECORDED_WORKER_MAIN = """
import os, signal, sys, threading, time
import multiprocessing.util as util
from nanolab.data.prepare import main

# A thread that does not block SIGINT, as torch's in a `fit` preparing its data.source: the
# kernel gives it a Ctrl-C that the main thread holds back.
threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
arrived, wakeup = os.pipe()
os.set_blocking(wakeup, False)
signal.set_wakeup_fd(wakeup)
workers = 0
spawn = util.spawnv_passfds

def spawnv_passfds(path, args, passfds):
    global workers
    pid = spawn(path, args, passfds)
    if any(b"spawn_main" in os.fsencode(arg) for arg in args):
        workers += 1
        if workers == 2:  # the pool's second worker runs; its start data is not sent yet
            os.kill(os.getpid(), getattr(signal, sys.argv[3]))
            os.read(arrived, 1)  # the other thread has taken it
    return pid

util.spawnv_passfds = spawnv_passfds
sys.exit(main([sys.argv[1], "-o", sys.argv[2], "--tokenizer", "bytes", "--workers", "2", "-q"]))
"""


@pytest.mark.parametrize(
    ("signame", "code", "answer"),
    [
        ("SIGINT", 130, ANSWER),
        ("SIGTERM", 143, "nanolab prepare: terminated; nothing was written"),
    ],
)
def test_a_signal_another_thread_takes_while_a_worker_starts_does_not_hang(
    tmp_path, signame, code, answer
):
    """A Ctrl-C held back in the main thread while the pool starts a worker reaches another
    thread that does not block SIGINT (torch's in `fit`; the tokenizers library's, when the
    BPE trained in this process, in a shell without TOKENIZERS_PARALLELISM), and the main
    thread raised KeyboardInterrupt inside the pool's submit all the same. The worker it had
    started was never recorded, so never ended: it waited for the rest of its start data with
    the pool's task pipe open, the pool's feeder and manager threads waited on it, and the
    stop its 30 s (a looped Ctrl-C in such a shell: 4 of 62 prepares). Driven on purpose: the
    SIGINT arrives, through another thread, right after the second worker is started."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some words of a document to encode.\n" * 90_000)  # ~3 MB: 3 blocks
    out = tmp_path / "ds"
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-c", UNRECORDED_WORKER_MAIN, str(corpus), str(out), signame],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=45)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"prepare did not exit after the Ctrl-C: {err[-2000:]}")
    took = time.monotonic() - started
    assert proc.returncode == code, (proc.returncode, err[-2000:])
    assert err.strip().splitlines() == [answer], err[-2000:]
    assert took < 15, f"exit {took:.1f} s after the start"
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ds.")]


MASK_CHILD = """
import signal

def report(conn):
    held = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    conn.send(signal.SIGINT in held and signal.SIGTERM in held)
"""

FIRST_PROCESS_MAIN = """
import multiprocessing
import mask_child
from nanolab.processes import stop_signals_held

context = multiprocessing.get_context("spawn")
ours, theirs = context.Pipe()
child = context.Process(target=mask_child.report, args=(theirs,))
with stop_signals_held():
    child.start()  # this process's first: multiprocessing's resource tracker starts with it
print(ours.recv(), flush=True)
child.join()
"""


def test_the_first_process_started_with_stop_signals_held_starts_with_it_held(tmp_path):
    """prepare's BPE trainer is the first process a BPE prepare starts. Starting it also
    started multiprocessing's resource tracker, which unblocks SIGINT in the starting thread
    on its way: the trainer started with SIGINT open, and a Ctrl-C while it imported printed
    its traceback (every Ctrl-C row of this file, under load)."""
    (tmp_path / "mask_child.py").write_text(MASK_CHILD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    out = subprocess.run(
        [sys.executable, "-c", FIRST_PROCESS_MAIN],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True"], "the child started with SIGINT open"


INTERRUPTED_WHILE_IMPORTING = """
import importlib, os, signal, sys
import nanolab.cli as cli

real_import = importlib.import_module

def import_module(name, *args):
    if name == "nanolab.data.prepare":
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the verb's modules import
    return real_import(name, *args)

try:  # an earlier call in this process that entered its verb counts for itself only
    cli.main(["estimate", "--help"])
except SystemExit:
    pass
cli.importlib.import_module = import_module
sys.exit(cli.main(["prepare", sys.argv[1], "-o", sys.argv[2]]))
"""


def test_a_ctrl_c_while_the_verb_still_imports_is_one_line_and_exit_130(tmp_path):
    """Before the verb's own handling begins (its modules importing: numpy, torch) a Ctrl-C was
    a traceback of the import and exit -2; nothing had run, and one line says so."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("words\n" * 100)
    proc = subprocess.run(
        [sys.executable, "-c", INTERRUPTED_WHILE_IMPORTING, str(corpus), str(tmp_path / "ds")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [ANSWER], proc.stderr[-2000:]
    assert not (tmp_path / "ds").exists()


BOTH_SIGNALS_HELD = """
import os, signal, sys
from nanolab.processes import stop_signals_held

def on_term(signum, frame):
    print("terminated", flush=True)
    sys.exit(143)

signal.signal(signal.SIGTERM, on_term)
try:
    with stop_signals_held():
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
except KeyboardInterrupt:
    print("interrupted only", flush=True)
"""


def test_a_sigterm_after_a_ctrl_c_while_held_is_delivered_too(tmp_path):
    """Both stop signals noted while held: the Ctrl-C's KeyboardInterrupt does not swallow the
    SIGTERM after it, whose handler ends the process (exit 143 here, as prepare's does)."""
    out = subprocess.run(
        [sys.executable, "-c", BOTH_SIGNALS_HELD],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        timeout=120,
    )
    assert out.stdout.split() == ["terminated"], out.stdout + out.stderr[-2000:]
    assert out.returncode == 143
