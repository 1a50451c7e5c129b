"""``nanolab prepare`` trains its BPE in a child process: the same tokenizer as in-process,
Ctrl-C heard at once while the trainer merges, and a child that died named in one line.

The trainer does almost all of its work in native code after it has read its sample; in the
main thread that kept Python's signal handler from running, so Ctrl-C waited for the last merge
(minutes for the default 256 MB sample).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from nanolab.data.bpe_process import train_bpe
from nanolab.data.tokenizers import HFTokenizer, TokenizerError

#: Random words, many of them distinct: the trainer's count and merges take several seconds of
#: one core after the text is read (18 s for 300k words and 20k ids on a loaded 2-core machine).
SLOW_MERGES = """
import random
rng = random.Random(0)
TEXT = " ".join(
    "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(3, 10)))
    for _ in range(200_000)
)
VOCAB = 16_000
"""


def _run(script: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RAYON_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )


def test_the_child_learns_the_same_tokenizer_as_this_process():
    text = "the quick brown fox jumps over the lazy dog; " * 400 + "a rarer line of words\n" * 50
    apart = train_bpe(iter([text]), 400)
    here = HFTokenizer.train([text], 400)
    assert apart._tok.to_str() == here._tok.to_str()
    assert (apart.eot_id, apart.vocab_size) == (here.eot_id, here.vocab_size)
    assert apart.decode(list(apart.encode_batch([text])[0])) == text


def test_ctrl_c_while_the_trainer_merges_is_heard_at_once():
    """SIGINT half a second after the sample is read: the trainer is merging for seconds yet,
    and the KeyboardInterrupt must come within 3 s, with no child left behind."""
    result = _run(
        SLOW_MERGES
        + """
import multiprocessing, os, signal, threading, time
from nanolab.data.bpe_process import train_bpe
sent = {}
def sample():
    yield TEXT
    def interrupt():
        sent["at"] = time.perf_counter()
        os.kill(os.getpid(), signal.SIGINT)
    threading.Timer(0.5, interrupt).start()
try:
    train_bpe(sample(), VOCAB)
    print("FINISHED")
except KeyboardInterrupt:
    print(f"INTERRUPTED {time.perf_counter() - sent['at']:.2f}")
    print("CHILDREN", len(multiprocessing.active_children()))
"""
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split()
    assert lines[0] == "INTERRUPTED", result.stdout  # not FINISHED: the merges were not awaited
    assert float(lines[1]) < 3.0, result.stdout
    assert lines[2:] == ["CHILDREN", "0"], result.stdout


def test_a_trainer_killed_mid_merge_is_one_line_naming_memory():
    """The kernel's out-of-memory killer sends SIGKILL: the prepare says so and what to lower,
    instead of waiting on a pipe nobody writes to."""
    result = _run(
        SLOW_MERGES
        + """
import multiprocessing, os, signal, time
from nanolab.data.bpe_process import train_bpe
from nanolab.data.tokenizers import TokenizerError
def sample():
    yield TEXT
    time.sleep(0.5)
    for child in multiprocessing.active_children():
        os.kill(child.pid, signal.SIGKILL)
try:
    train_bpe(sample(), VOCAB)
    print("FINISHED")
except TokenizerError as err:
    print("ERROR", err)
"""
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ERROR the BPE trainer process was killed (signal 9)"), (
        result.stdout + result.stderr
    )
    assert "--bpe-sample-bytes" in result.stdout


def test_a_vocabulary_out_of_range_is_refused_before_a_child_starts():
    with pytest.raises(TokenizerError, match="vocab_size must be >= "):
        train_bpe(iter(["text"]), 10)
