"""``nanolab prepare``'s BPE trained in a child process, so that a signal stops it at once.

The Hugging Face trainer does nearly all of its work after it has read its sample: it counts
the words and learns the merges in native code (15 s for 10 MB of text on a 2-core CPU, minutes
for the default 256 MB sample). A Python signal handler runs only when the main thread is back
in Python, so while the trainer ran there Ctrl-C and a queue's SIGTERM did nothing until the
last merge. Here the main thread only feeds the sample to a child and waits on a pipe, which a
signal interrupts at once; the child is then killed. (A worker thread would free the main thread
too, but one still merging when the interpreter exits aborts the whole process.)

The child is a fresh interpreter started with this module's code, not a multiprocessing one: a
spawned multiprocessing child imports the caller's main script again, and a script that calls
``prepare_dataset`` without an ``if __name__ == "__main__"`` guard then prepared in the child
too, waiting for ever on the dataset's lock its parent held. The pieces go to the child's stdin
as length-prefixed UTF-8; its answer comes back on its stdout.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterable, Iterator
from typing import IO

from nanolab.data.tokenizers import (
    HFTokenizer,
    TokenizerError,
    check_bpe_vocab_size,
    chunked,
    learn_bpe,
)

#: Bytes of the length that goes before each piece; a length of 0 ends the sample.
_HEADER = 8
#: The child's code: this process's import path first (an editable install, PYTHONPATH, a
#: fork's checkout), never the folder it happens to be started in.
_CHILD = (
    "import os, sys; sys.path[:] = os.environ.pop('NANOLAB_BPE_PATH').split(os.pathsep); "
    "from nanolab.data.bpe_process import child_main; child_main()"
)


def train_bpe(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    """:meth:`HFTokenizer.train` on ``texts``, in a child process fed piece by piece."""
    from nanolab.processes import stop_signals_held

    check_bpe_vocab_size(vocab_size, "the BPE vocab_size")
    env = {**os.environ, "NANOLAB_BPE_PATH": os.pathsep.join(sys.path)}
    with stop_signals_held():  # a Ctrl-C while the child imports reaches it ignored
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(vocab_size), str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
    assert child.stdin is not None and child.stdout is not None
    finished = False
    try:
        try:
            for piece in chunked(texts):
                data = piece.encode("utf-8", "surrogatepass")
                child.stdin.write(len(data).to_bytes(_HEADER, "little") + data)
            child.stdin.write(bytes(_HEADER))
            child.stdin.close()
            answer = _read_answer(child.stdout)
        except (BrokenPipeError, ConnectionResetError):
            answer = b""
        finished = True
    finally:
        if not finished:  # an error, or a signal raised here: the merges are not waited for
            child.kill()
        child.wait()
        for pipe in (child.stdin, child.stdout):
            _close_quietly(pipe)
    outcome, _, payload = answer.partition(b"\n")
    if outcome == b"ok":
        from tokenizers import Tokenizer as RustTokenizer

        return HFTokenizer.from_learned(RustTokenizer.from_str(payload.decode()), vocab_size)
    if outcome == b"error":
        raise TokenizerError(f"training the BPE tokenizer failed: {payload.decode()}")
    raise TokenizerError(_lost_child(child.returncode))


def _close_quietly(pipe: IO[bytes]) -> None:
    """Close one of the child's pipes, whose other end may be gone.

    Closing stdin flushes what is still buffered there; after an error in the sample (an empty
    file, a bad JSON line) the child has been killed, so that flush meets a pipe without a
    reader. Its BrokenPipeError would replace the error being raised, and the user saw nothing
    but exit 141; the pipe is closed either way (the buffer's close closes its descriptor even
    when the flush fails)."""
    with contextlib.suppress(OSError):
        pipe.close()


def _read_answer(stdout: IO[bytes]) -> bytes:
    """Everything the child writes, waited for a fifth of a second at a time: a signal is
    raised here then, whichever thread the kernel gave it to."""
    chunks = []
    fd = stdout.fileno()
    while True:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if not ready:
            continue
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _lost_child(exitcode: int | None) -> str:
    """Why the child left no tokenizer, in the words a user can act on."""
    if exitcode == -signal.SIGKILL:  # what the kernel's out-of-memory killer sends
        return (
            "the BPE trainer process was killed (signal 9), most likely out of memory: a "
            "smaller sample needs less (nanolab prepare --bpe-sample-bytes, 256M by default)"
        )
    if exitcode is not None and exitcode < 0:
        return f"the BPE trainer process was ended by signal {-exitcode}; run the prepare again"
    return f"the BPE trainer process ended without a result (exit code {exitcode})"


def _pieces(source: IO[bytes]) -> Iterator[str]:
    """The sample, piece by piece, until the length 0 that ends it."""
    while True:
        size = int.from_bytes(source.read(_HEADER), "little")
        if size == 0:
            return
        yield source.read(size).decode("utf-8", "surrogatepass")


def child_main() -> None:
    """The child: learn from the pieces on stdin, answer ``ok`` and the tokenizer's JSON (or
    ``error`` and the reason) on stdout. Arguments: the vocabulary size and the parent's pid."""
    from nanolab.data.encode import become_worker

    vocab_size, parent = int(sys.argv[1]), int(sys.argv[2])
    become_worker(parent)
    try:
        answer = b"ok\n" + learn_bpe(_pieces(sys.stdin.buffer), vocab_size).to_str().encode()
    except Exception as err:  # said by the parent as one line
        answer = f"error\n{type(err).__name__}: {err}".encode()
    sys.stdout.buffer.write(answer)
    sys.stdout.buffer.flush()
