"""``nanolab prepare``'s BPE trained in a child process, so that a signal stops it at once.

The Hugging Face trainer does nearly all of its work after it has read its sample: it counts
the words and learns the merges in native code (15 s for 10 MB of text on a 2-core CPU, minutes
for the default 256 MB sample). A Python signal handler runs only when the main thread is back
in Python, so while the trainer ran there Ctrl-C and a queue's SIGTERM did nothing until the
last merge. Here the main thread only feeds the sample to a child and waits on a pipe, which a
signal interrupts at once; the child is then killed. (A worker thread would free the main thread
too, but one still merging when the interpreter exits aborts the whole process.)
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterable
from multiprocessing.connection import Connection

from nanolab.data.encode import become_worker
from nanolab.data.tokenizers import (
    HFTokenizer,
    TokenizerError,
    check_bpe_vocab_size,
    chunked,
    learn_bpe,
)


def train_bpe(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    """:meth:`HFTokenizer.train` on ``texts``, in a child process fed piece by piece."""
    from nanolab.processes import stop_signals_held

    check_bpe_vocab_size(vocab_size, "the BPE vocab_size")
    context = multiprocessing.get_context("spawn")  # prepare also runs inside a torch `fit`
    ours, theirs = context.Pipe()
    child = context.Process(
        target=_child_main,
        args=(theirs, vocab_size, os.getpid()),
        name="nanolab-bpe-trainer",
        daemon=True,
    )
    with stop_signals_held():  # a Ctrl-C while the child imports reaches it ignored (become_worker)
        child.start()
    theirs.close()  # the child's end: its death then reads here as end-of-file
    finished = False
    try:
        try:
            for piece in chunked(texts):
                ours.send(piece)
            ours.send(None)
            while not ours.poll(0.2):  # a signal is raised here, whichever thread caught it
                pass
            outcome, payload = ours.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            child.join(timeout=5)
            raise TokenizerError(_lost_child(child.exitcode)) from None
        finished = True
    finally:
        if not finished:  # an error, or a signal raised here: the merges are not waited for
            child.kill()
        child.join()
        ours.close()
    if outcome != "ok":
        raise TokenizerError(f"training the BPE tokenizer failed: {payload}")
    from tokenizers import Tokenizer as RustTokenizer

    return HFTokenizer.from_learned(RustTokenizer.from_str(payload), vocab_size)


def _lost_child(exitcode: int | None) -> str:
    """Why the child left no tokenizer, in the words a user can act on."""
    if exitcode == -9:  # what the kernel's out-of-memory killer sends
        return (
            "the BPE trainer process was killed (signal 9), most likely out of memory; "
            "prepare with a smaller --bpe-sample-bytes (the text it learns from)"
        )
    if exitcode is not None and exitcode < 0:
        return f"the BPE trainer process was ended by signal {-exitcode}; run the prepare again"
    return f"the BPE trainer process ended without a result (exit code {exitcode})"


def _child_main(conn: Connection, vocab_size: int, parent: int) -> None:
    """The child: learn from the pieces until ``None``, answer ``("ok", tokenizer JSON)``."""
    become_worker(parent)
    try:
        tok = learn_bpe(iter(conn.recv, None), vocab_size)
        conn.send(("ok", tok.to_str()))
    except Exception as err:  # reported by the parent as one line
        conn.send(("error", f"{type(err).__name__}: {err}"))
    finally:
        conn.close()
