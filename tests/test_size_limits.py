"""A write refused by a file-size limit (EFBIG: ``ulimit -f``, as a batch system may set it) is
one line in every verb naming the limit and its fix (raise it: free space would not help), never
a traceback, and leaves nothing half-written; the run log's and the checkpoints' own lines are
tested in tests/test_storage_errors.py and tests/test_checkpoint_write_errors.py."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

from nanolab import errors

RAISE_IT = "raise the limit (ulimit -f unlimited, or ask for it in the job's settings)"


def under_limit(blocks: int, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``nanolab ARGS`` under ``ulimit -f BLOCKS`` (1024-byte blocks), as a job script runs it."""
    command = " ".join([f"ulimit -f {blocks};", sys.executable, "-m", "nanolab", *args])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        ["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def one_line(res: subprocess.CompletedProcess[str]) -> str:
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    return lines[0]


def test_prepare_past_a_file_size_limit_names_the_limit_and_leaves_no_dataset(tmp_path):
    """prepare said "File too large; choose another output folder": another folder under the
    same limit fails the same way. It exits 74 as fit and report do (it exited 2)."""
    res = under_limit(50, "prepare", "bundled:shakespeare", "--out", "d", cwd=tmp_path)
    line = one_line(res)
    assert res.returncode == errors.EXIT_DISK_FULL
    assert line == (
        "nanolab prepare: error: cannot write d (File too large: this process's file-size limit "
        f"(ulimit -f: {errors.size_text(50 * 1024)})); {RAISE_IT}"
    ), line
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no dataset, no staging folder


def test_report_plot_past_a_file_size_limit_is_one_line_and_exit_74(tmp_path):
    """report --plot under a file-size limit was PIL's traceback."""
    run = tmp_path / "runs" / "a"
    run.mkdir(parents=True)
    records = [{"event": "start", "time": 1.0, "step": 0, "run_id": "r1", "run_name": "a"}]
    for s in range(1, 21):
        records.append({"event": "train", "time": 1.0 + s, "step": s, "tokens": 128 * s,
                        "loss": 4.0 - 0.1 * s})  # fmt: skip
        if s % 5 == 0:
            records.append({"event": "val", "time": 1.5 + s, "step": s, "val_loss": 4 - s / 10})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    res = under_limit(5, "report", "runs", "--plot", "loss.png", cwd=tmp_path)
    line = one_line(res)
    assert res.returncode == errors.EXIT_DISK_FULL
    assert line.startswith("nanolab report: error: cannot write loss.png (File too large: ")
    assert line.endswith(RAISE_IT) and "free" not in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]  # no image, whole or half


def test_storage_message_names_the_file_systems_limit_when_the_process_has_none(monkeypatch):
    err = OSError(errno.EFBIG, "File too large", "/mnt/usb/out.bin")
    assert errors.storage_refused(err) and errors.out_of_room(err)
    monkeypatch.setattr(errors, "file_size_limit", lambda: None)
    assert errors.storage_message(err) == (
        "cannot write /mnt/usb/out.bin (File too large: the file system's maximum file size); "
        "put it on a file system that holds files that large (not FAT32)"
    )


def _file_size_limit(nbytes: int):
    """A ``preexec_fn`` that sets the child's file-size limit (RLIMIT_FSIZE, as ``ulimit -f``)."""

    def limit() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, resource.RLIM_INFINITY))

    return limit


def test_every_verb_exits_74_past_a_file_size_limit(tmp_path):
    """A write refused for room exits 74 (EX_IOERR) in every verb, in one line: fit and report
    did, prepare, export, init and the queue exited 2, the code of bad input, so a job script
    could not tell "make room and rerun" from "fix the command"."""
    from dataclasses import asdict

    import torch

    from nanolab.model import GPT, GPTConfig

    config = GPTConfig(vocab_size=65, n_layer=1, n_head=2, n_embd=32, block_size=8)
    ckpt = {
        "state_dict": {f"model.{k}": v for k, v in GPT(config).state_dict().items()},
        "nanolab": {"gpt": asdict(config), "tokenizer": None},
    }
    torch.save(ckpt, tmp_path / "w.ckpt")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    verbs = {
        "prepare": ["prepare", "bundled:shakespeare", "-o", "d"],
        "export": ["export", "--ckpt", "w.ckpt", "--format", "safetensors", "-o", "ex"],
    }
    for verb, argv in verbs.items():
        res = subprocess.run(
            [sys.executable, "-m", "nanolab", *argv], cwd=tmp_path, env=env, capture_output=True,
            text=True, timeout=300, preexec_fn=_file_size_limit(4096),
        )  # fmt: skip
        line = one_line(res)
        assert res.returncode == errors.EXIT_DISK_FULL, (verb, line)
        assert line.startswith(f"nanolab {verb}: error: cannot write "), line
        assert "File too large: this process's file-size limit (ulimit -f: 4 kB)" in line, line
        assert line.endswith((RAISE_IT, f"{RAISE_IT}; nothing was written there")), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.ckpt"]  # nothing half-written


def test_a_refused_write_s_error_exits_74_only_when_it_is_for_room() -> None:
    """The one exit-code rule every verb's error line goes through: an error carrying a full
    disk's, a quota's or a file-size limit's errno is 74, any other (a read-only folder) 2."""
    for code, expected in ((errno.ENOSPC, 74), (errno.EDQUOT, 74), (errno.EFBIG, 74),
                           (errno.EROFS, 2), (errno.EACCES, 2)):  # fmt: skip
        error = errors.with_errno_of(errors.NanolabError("cannot write x"), OSError(code, "x"))
        assert errors.exit_code(error) == expected, code
    assert errors.exit_code(errors.NanolabError("bad input")) == errors.EXIT_USAGE


def test_init_past_a_file_size_limit_leaves_no_half_written_file(tmp_path):
    """init under a file-size limit left the file it was writing cut short (README.md, 2 kB of
    it), so the rerun was refused ("README.md already exists"); it exited 2 and named no
    limit. Now the line names the file and the limit, exit 74, no file is left, and the same
    command once the limit is raised writes the project."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "nanolab", "init", "proj"]
    res = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300, preexec_fn=_file_size_limit(2048))  # fmt: skip
    line = one_line(res)
    assert res.returncode == errors.EXIT_DISK_FULL, line
    assert line.startswith("nanolab init: error: cannot write proj/"), line
    assert "(File too large: this process's file-size limit (ulimit -f: 2 kB))" in line, line
    assert line.endswith(f"{RAISE_IT}; no file was left in proj"), line
    assert not [p for p in (tmp_path / "proj").rglob("*") if p.is_file()]
    again = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    assert (tmp_path / "proj" / "README.md").stat().st_size > 2048


def test_init_names_a_small_file_whose_write_fails_as_it_is_closed(tmp_path):
    """A small file's text waits in the write buffer and is written when the file is closed:
    there a full disk (a 28 kB tmpfs) or a size limit stopped init with "cannot write a file",
    naming none. The line names the file now."""
    script = (
        "import sys; from nanolab import scaffold; "
        "scaffold.template_files = lambda: {'configs/small.yaml': 'x' * 3000}; "
        "sys.exit(scaffold.main(['proj']))"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300,
                         preexec_fn=_file_size_limit(2048))  # fmt: skip
    line = one_line(res)
    assert res.returncode == errors.EXIT_DISK_FULL, line
    assert line.startswith("nanolab init: error: cannot write proj/configs/small.yaml ("), line
    assert not [p for p in (tmp_path / "proj").rglob("*") if p.is_file()]


def test_queue_ls_under_a_file_size_limit_lists_read_only(tmp_path):
    """``queue ls`` under ``ulimit -f 0`` exited 74 ("cannot be written past this process's
    file-size limit"), and left empty -wal/-shm files: it opened the database to write (its
    journal set-up) to list it. A listing never needs to write: it reads the queue read-only
    and leaves nothing beside it."""
    from nanolab.queue.db import NewJob, QueueDB

    db = QueueDB(tmp_path / "q.db")
    db.add_jobs([NewJob(name="a", config="c.yaml", args=[], seed=None, cwd=str(tmp_path),
                        run_dir=str(tmp_path / "runs" / "a"))])  # fmt: skip
    db.close()
    res = under_limit(0, "queue", "ls", "--db", "q.db", cwd=tmp_path)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    assert " a " in res.stdout and "1 pending" in res.stdout, res.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.db"]  # no -wal, no -shm


def _queue_under_limit(nbytes: int, *argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``nanolab queue ARGV`` in a process whose file-size limit is ``nbytes``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "nanolab", "queue", *argv], cwd=cwd, env=env, capture_output=True,
        text=True, timeout=300, preexec_fn=_file_size_limit(nbytes),
    )  # fmt: skip


def test_a_queue_write_refused_by_a_file_size_limit_leaves_the_queue_as_it_was(tmp_path):
    """A writing verb under ``ulimit -f`` left an empty -wal and a 4 kB -shm beside the queue
    (its open built SQLite's index until the limit stopped it), and `queue ls` under the same
    limit then exited 74 too: reading a WAL queue rebuilds that index. Each write is refused
    in one line naming the limit, exit 74, nothing beside the database, and the queue lists
    as it was, under the limit and without it."""
    from nanolab.queue.db import NewJob, QueueDB

    (tmp_path / "c.yaml").write_text("trainer: {max_steps: 2}\n")
    db = QueueDB(tmp_path / "q.db")
    db.add_jobs([NewJob(name="a", config="c.yaml", args=[], seed=None, cwd=str(tmp_path),
                        run_dir=str(tmp_path / "runs" / "a"))])  # fmt: skip
    db.close()
    before = (tmp_path / "q.db").read_bytes()
    writes = (["rm", "a"], ["retry", "a"], ["clear", "--all"], ["add", "c.yaml", "--name", "b"])
    for argv in writes:
        res = _queue_under_limit(4096, *argv, "--db", "q.db", cwd=tmp_path)
        line = one_line(res)
        assert res.returncode == errors.EXIT_DISK_FULL, (argv, line)
        assert "file-size limit (ulimit -f: 4 kB)" in line and RAISE_IT in line, line
        assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml", "q.db"], argv
        assert (tmp_path / "q.db").read_bytes() == before, argv  # no half job
        for limit in (4096, None):
            listed = (
                _queue_under_limit(limit, "ls", "--db", "q.db", cwd=tmp_path)
                if limit
                else subprocess.run([sys.executable, "-m", "nanolab", "queue", "ls", "--db", "q.db"],
                                    cwd=tmp_path, capture_output=True, text=True, timeout=300)
            )  # fmt: skip
            assert listed.returncode == 0, (argv, limit, listed.stderr)
            assert " a " in listed.stdout and "1 pending" in listed.stdout, listed.stdout


def test_queue_ls_under_a_file_size_limit_reads_past_an_empty_journal_left_beside_it(tmp_path):
    """An empty -wal and a part-built -shm left by a write an older version let fail: ``queue
    ls`` under the limit could not rebuild the -shm and exited 74. An empty -wal holds no
    change, so the database file alone is read; the next write that fails for room, with no
    process using them, removes them as SQLite's last connection would."""
    from nanolab.queue.db import NewJob, QueueDB

    db = QueueDB(tmp_path / "q.db")
    db.add_jobs([NewJob(name="a", config="c.yaml", args=[], seed=None, cwd=str(tmp_path),
                        run_dir=str(tmp_path / "runs" / "a"))])  # fmt: skip
    db.close()
    (tmp_path / "q.db-wal").write_bytes(b"")
    (tmp_path / "q.db-shm").write_bytes(bytes(4096))
    res = _queue_under_limit(4096, "ls", "--db", "q.db", cwd=tmp_path)
    assert res.returncode == 0 and " a " in res.stdout, res.stderr
    res = _queue_under_limit(4096, "rm", "a", "--db", "q.db", cwd=tmp_path)
    assert res.returncode == errors.EXIT_DISK_FULL, res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.db"]


def test_the_journal_of_a_queue_another_process_has_open_is_never_removed(tmp_path):
    """The cleanup after a refused write removes an empty -wal and its -shm only when no
    connection uses them (SQLite's own rule for its last connection): a runner with the queue
    open keeps them, whether it is another process or this one."""
    from nanolab.queue.db import QueueDB, drop_unused_journal

    QueueDB(tmp_path / "q.db").close()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from nanolab.queue.db import QueueDB; "
         "db = QueueDB(sys.argv[1]); db.jobs(); print('open', flush=True); sys.stdin.read()",
         str(tmp_path / "q.db")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "open"
        assert (tmp_path / "q.db-wal").exists()
        assert not drop_unused_journal(tmp_path / "q.db")
        assert (tmp_path / "q.db-wal").exists() and (tmp_path / "q.db-shm").exists()
    finally:
        holder.communicate("", timeout=60)
    here = QueueDB(tmp_path / "q.db")
    assert not drop_unused_journal(tmp_path / "q.db")
    here.close()
