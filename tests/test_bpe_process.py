"""``nanolab prepare`` trains its BPE in a child process: the same tokenizer as in-process,
Ctrl-C heard at once while the trainer merges, and a child that died named in one line.

The trainer does almost all of its work in native code after it has read its sample; in the
main thread that kept Python's signal handler from running, so Ctrl-C waited for the last merge
(minutes for the default 256 MB sample).
"""

from __future__ import annotations

import os
import signal
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

import subprocess
started = []  # the trainer processes train_bpe starts


class Recorded(subprocess.Popen):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        started.append(self)


subprocess.Popen = Recorded
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
import os, signal, subprocess, threading, time
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
    print("CHILDREN", len(started), "ENDED", [child.returncode for child in started])
"""
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split()
    assert lines[0] == "INTERRUPTED", result.stdout  # not FINISHED: the merges were not awaited
    assert float(lines[1]) < 3.0, result.stdout
    assert lines[2:] == ["CHILDREN", "1", "ENDED", f"[{-signal.SIGKILL}]"], result.stdout


def test_a_trainer_killed_mid_merge_is_one_line_naming_memory():
    """The kernel's out-of-memory killer sends SIGKILL: the prepare says so and what to lower,
    instead of waiting on a pipe nobody writes to."""
    result = _run(
        SLOW_MERGES
        + """
import os, signal, subprocess, time
from nanolab.data.bpe_process import train_bpe
from nanolab.data.tokenizers import TokenizerError
def sample():
    yield TEXT
    time.sleep(0.5)
    for child in started:
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
    assert "most likely out of memory" in result.stdout
    assert "(nanolab prepare --bpe-sample-bytes, 256M by default)" in result.stdout


def test_a_vocabulary_out_of_range_is_refused_before_a_child_starts():
    with pytest.raises(TokenizerError, match="vocab_size must be >= "):
        train_bpe(iter(["text"]), 10)


UNGUARDED_SCRIPT = """
from nanolab.data.prepare import prepare_dataset
prepare_dataset(["corpus.txt"], "ds", "bpe", bpe_vocab_size=300, quiet=True)
print("PREPARED")
"""


def test_a_script_without_a_main_guard_prepares_bpe(tmp_path):
    """The trainer is a fresh interpreter, not a multiprocessing child: one of those imports the
    caller's main script again, and a script calling prepare_dataset without an
    ``if __name__ == "__main__"`` guard prepared in it too, waiting on the lock its parent held."""
    (tmp_path / "corpus.txt").write_text(
        "a few words of text to learn from, again and again\n" * 300
    )
    (tmp_path / "script.py").write_text(UNGUARDED_SCRIPT)
    result = subprocess.run(
        [sys.executable, "script.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["PREPARED"]
    assert (tmp_path / "ds" / "tokenizer.json").is_file()


SIGNALS_IN_THE_CHILD = """
import signal, subprocess, sys
import nanolab.data.bpe_process as bpe
seen = []
real_main = bpe.child_main
class Recorded(subprocess.Popen):
    def __init__(self, args, **kwargs):
        # The child reports its mask and handlers as it starts, before its own set-up runs.
        probe = (
            "import signal, sys; held = signal.pthread_sigmask(signal.SIG_BLOCK, []); "
            "print('HELD', signal.SIGINT in held, signal.SIGTERM in held, file=sys.stderr); "
        )
        args = [args[0], "-c", probe + args[2], *args[3:]]
        super().__init__(args, **kwargs)
subprocess.Popen = Recorded
bpe.train_bpe(iter(["some words to learn from " * 50]), 300)
print("TRAINED")
"""


def test_the_trainer_starts_with_the_stop_signals_held_and_then_ignores_them(tmp_path):
    """A Ctrl-C or a job-wide SIGTERM while the child imports is the parent's to handle: the
    child starts with both held, then ignores them (a child ended by SIGTERM made `fit`, which
    was being preempted, fail with "the BPE trainer process was ended by signal 15")."""
    result = subprocess.run(
        [sys.executable, "-c", SIGNALS_IN_THE_CHILD], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "HELD True True" in result.stderr, result.stderr[-2000:]
    assert result.stdout.split() == ["TRAINED"]


def test_an_error_in_the_sample_is_raised_as_itself():
    """A bad document found while the child is fed (an empty file, a bad JSON line) kills the
    child; closing its stdin then flushed the buffered last piece into the dead pipe, and that
    BrokenPipeError replaced the document's error."""
    from nanolab.errors import NanolabError

    def sample():
        yield "a short first document, still buffered when the next one fails"
        raise NanolabError("b.txt: empty document (the file is empty)")

    with pytest.raises(NanolabError, match=r"b\.txt: empty document"):
        train_bpe(sample(), 300)


def test_prepare_bpe_says_a_bad_document_after_230_kb_of_text(tmp_path):
    """The sizes a user met: 233,612 bytes of text, then an empty file. `prepare` printed
    nothing and exited 141 (the broken pipe to the trainer read as a reader of stdout gone)."""
    import gzip
    from importlib import resources

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    bundled = resources.files("nanolab.data").joinpath("corpus", "shakespeare.txt.gz")
    with gzip.open(bundled.open("rb")) as f:
        (corpus / "a.txt").write_bytes(f.read(233_612))
    (corpus / "b.txt").write_bytes(b"")
    out = tmp_path / "out"
    args = ["prepare", str(corpus), "-o", str(out), "--tokenizer", "bpe", "--bpe-vocab-size"]
    result = _run(f"import sys\nfrom nanolab.cli import main\nsys.exit(main({[*args, '300']}))")
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert result.stderr.strip().splitlines() == [
        f"nanolab prepare: error: {corpus / 'b.txt'}: empty document (the file is empty); "
        "remove it or pass --skip-bad"
    ]
    assert not out.exists()
