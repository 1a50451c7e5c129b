"""SIGTERM to ``nanolab prepare`` (a scheduler's stop, ``kill``): Ctrl-C's way out, one line,
exit 143, the half-written folder removed and the dataset it was replacing left as it was.

It used to take the default action: exit 143 with no line at all, only the resource tracker's
warning of leaked semaphores, and the leftovers (``.NAME.tmp-*``, the lock) cleared only by the
next run.
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

from nanolab.data.prepare import default_workers, prepare_dataset

ANSWER = "nanolab prepare: terminated; nothing was written"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """~24 MB of varied words: a few seconds of tokenizing, long enough to be signalled in."""
    path = tmp_path_factory.mktemp("corpus") / "big.txt"
    rng = random.Random(0)
    words = ["".join(rng.choices("abcdefghij", k=rng.randint(2, 9))) for _ in range(2000)]
    lines = [" ".join(rng.choices(words, k=12)) + ".\n" for _ in range(2000)]
    block = "".join(lines)
    with open(path, "w") as f:
        for _ in range((24 << 20) // len(block) + 1):
            f.write(block)
    return path


def terminate(corpus: Path, out: Path, extra: list[str], group: bool) -> tuple[int, str]:
    """Prepare ``corpus`` over the dataset in ``out`` (``--force``) and SIGTERM it (its whole
    process group when ``group``, as a scheduler does) once it is writing its temporary
    folder; (exit code, stderr)."""
    cmd = [sys.executable, "-m", "nanolab", "prepare", str(corpus), "-o", str(out), "--force"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(
        [*cmd, "-q", *extra],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not list(out.parent.glob(f".{out.name}.tmp-*")) and proc.poll() is None:
            assert time.monotonic() < deadline, "prepare never started writing"
            time.sleep(0.02)
        assert proc.poll() is None, "prepare finished before it could be signalled"
        time.sleep(0.1)
        if group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    except (subprocess.TimeoutExpired, AssertionError):
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        raise
    return proc.returncode, err


def check_sigterm(tmp_path: Path, corpus: Path, extra: list[str], group: bool) -> None:
    out = tmp_path / "ds"
    (tmp_path / "old.txt").write_text("an old dataset, to be kept\n" * 50)
    prepare_dataset([str(tmp_path / "old.txt")], out, "bytes", quiet=True)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code, err = terminate(corpus, out, extra, group)
    assert code == 128 + signal.SIGTERM, (code, err[-3000:])
    assert err.strip().splitlines() == [ANSWER], err[-3000:]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ds.")]


def test_sigterm_while_tokenizing_is_one_line_exit_143_and_nothing_left(tmp_path, corpus):
    # BPE encodes at a few MB/s on one core: seconds of writing to be signalled in
    bpe = ["--tokenizer", "bpe", "--bpe-vocab-size", "300", "--bpe-sample-bytes", "1M"]
    check_sigterm(tmp_path, corpus, ["--workers", "1", *bpe], group=False)


@pytest.mark.slow  # a pool of workers to start and stop: ~10 s on 2 cores
@pytest.mark.skipif(default_workers() < 2, reason="needs 2 usable cores for the worker pool")
def test_sigterm_to_the_process_group_stops_the_workers_the_same_way(tmp_path, corpus):
    check_sigterm(tmp_path, corpus, ["--workers", "2", "--tokenizer", "chars"], group=True)
