"""A file system that refuses a write (read-only, full) is one error line in every verb, never
a traceback, and leaves nothing half-written: on real mounts (a read-only tmpfs and a 16 KiB
one), which needs root; elsewhere the module is skipped."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import QUICKSTART, nanolab_here, tiny_overrides, write_config

from nanolab.runlog import read_records


def _mount(target: Path, options: str) -> bool:
    target.mkdir(parents=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)], capture_output=True
    )
    return done.returncode == 0


@pytest.fixture
def mounts(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(read-only folder, 16 KiB folder)."""
    ro, full = tmp_path / "ro", tmp_path / "full"
    if not _mount(ro, "ro,size=1m"):
        pytest.skip("mounting a tmpfs needs root")
    try:
        assert _mount(full, "size=16k")
        yield ro, full
    finally:
        for folder in (ro, full):
            subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def _one_error_line(res, *needles: str, code: int = 2) -> None:
    assert res.returncode == code, res.stderr[-2000:]
    errors = [line for line in res.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    for needle in needles:
        assert needle in errors[0], errors[0]


def test_writes_the_file_system_refuses_are_one_line(tmp_path, char_dataset, mounts):
    ro, full = mounts
    runs = tmp_path / "runs"
    cfg = write_config(tmp_path / "tiny.yaml", tiny_overrides(char_dataset, runs))
    res = nanolab_here("fit", "--config", str(QUICKSTART), "--config", str(cfg), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    run = runs / "tiny"
    log_before = (run / "metrics.jsonl").read_bytes()

    res = nanolab_here("prepare", "bundled:shakespeare", "-o", str(ro / "ds"), cwd=tmp_path)
    _one_error_line(res, "nanolab prepare: error: cannot write", "Read-only file system")
    res = nanolab_here(
        "fit", "--config", str(QUICKSTART), "--data.dataset_dir", str(ro / "ds"),
        "--run.root", str(tmp_path / "other"), cwd=tmp_path,
    )  # fmt: skip
    _one_error_line(res, "nanolab fit: error: cannot write", "writable file system")
    assert not (tmp_path / "other").exists()
    res = nanolab_here("report", str(runs), "--plot", str(ro / "loss.png"), cwd=tmp_path)
    _one_error_line(res, "nanolab report: error: cannot write", "loss")
    res = nanolab_here("eval", str(run), "--json", str(ro / "e.json"), "--limit", "2", cwd=tmp_path)
    _one_error_line(res, "--json", "cannot write in")
    assert (run / "metrics.jsonl").read_bytes() == log_before  # refused before any record
    res = nanolab_here("export", "--ckpt", str(run), "-o", str(full / "ex"), cwd=tmp_path)
    _one_error_line(res, "No space left on device", code=74)  # a full disk's, as fit's
    assert list(full.iterdir()) == []  # no half export, no staging folder
    assert [r["event"] for r in read_records(run / "metrics.jsonl")][-1] == "end"


def test_an_exported_safetensors_file_follows_the_umask(tmp_path, char_dataset):
    """safetensors creates its file 0600: a serving process of another user could not read
    the weights that every other export file (0644 under umask 022) lets it read."""
    import os

    runs = tmp_path / "runs"
    cfg = write_config(tmp_path / "tiny.yaml", tiny_overrides(char_dataset, runs))
    assert (
        nanolab_here(
            "fit", "--config", str(QUICKSTART), "--config", str(cfg), cwd=tmp_path
        ).returncode
        == 0
    )
    before = os.umask(0o022)
    try:
        res = nanolab_here(
            "export", "--ckpt", str(runs / "tiny"), "--format", "safetensors", "-o",
            str(tmp_path / "ex"), cwd=tmp_path,
        )  # fmt: skip
    finally:
        os.umask(before)
    assert res.returncode == 0, res.stderr[-2000:]
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "ex").iterdir()}
    assert modes["model.safetensors"] == modes["nanolab.json"] == 0o644, modes
    json.loads((tmp_path / "ex" / "nanolab.json").read_text())


def test_a_full_disk_at_config_yaml_names_the_file_and_leaves_no_tmp(tmp_path, char_dataset):
    """A resume that finds no room for ``config.yaml`` says which file and how much is free
    (like the run log's and the checkpoints' lines), exits 74, and leaves the run as it was:
    no ``.tmp`` beside the old ``config.yaml``."""
    import os
    import shutil

    small = tmp_path / "small"
    if not _mount(small, "size=2m"):
        pytest.skip("mounting a tmpfs needs root")
    try:
        cfg = write_config(tmp_path / "tiny.yaml", tiny_overrides(char_dataset, small))
        base = ("fit", "--config", str(QUICKSTART), "--config", str(cfg), "--run.resume", "auto")
        assert nanolab_here(*base, cwd=tmp_path).returncode == 0
        run = small / "tiny"
        before = sorted(os.listdir(run)), (run / "config.yaml").read_bytes()
        left = shutil.disk_usage(small).free - 4096
        (small / "filler").write_bytes(b"\0" * left)
        res = nanolab_here(*base, "--trainer.max_steps", "12", cwd=tmp_path)
        assert res.returncode == 74, res.stderr[-2000:]
        errors = [line for line in res.stderr.splitlines() if "error:" in line]
        assert len(errors) == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
        assert f"cannot write {run / 'config.yaml'} (No space left on device; " in errors[0]
        assert "free there); free space there" in errors[0], errors[0]
        assert (sorted(os.listdir(run)), (run / "config.yaml").read_bytes()) == before
    finally:
        subprocess.run(["umount", "-l", str(small)], capture_output=True)


def test_init_on_a_full_disk_names_the_file_and_the_room_there_was(tmp_path):
    """``nanolab init`` on a 28 kB tmpfs said "cannot write a file (No space left on device)":
    a small file's text is written as it is closed, where the error named no file. And the
    room it reported was measured after its files were removed (29 kB free on a full disk)."""
    small = tmp_path / "small"
    if not _mount(small, "size=28k"):
        pytest.skip("mounting a tmpfs needs root")
    try:
        res = nanolab_here("init", "proj", cwd=small)
        _one_error_line(res, "cannot write proj/", "(No space left on device; ",
                        "no file was left in proj", code=74)  # fmt: skip
        free = re.search(r"; (\d+) kB free there\)", res.stderr)
        assert free and int(free.group(1)) < 8, res.stderr  # not the room its removal made
        assert not [p for p in (small / "proj").rglob("*") if p.is_file()]
    finally:
        subprocess.run(["umount", "-l", str(small)], capture_output=True)


def test_config_yaml_is_written_through_no_planted_temp_name_and_a_failed_write_names_it(
    tmp_path, monkeypatch
):
    """The run's ``config.yaml`` goes through a new file of its own: a hard link planted at the
    old fixed temporary name (``config.yaml.tmp``: another tool's, or an older crash's) into
    another file leaves that file untouched. A failed write (a full disk at the fsync) removes
    its temporary file and raises the error naming ``config.yaml``, for the one error line."""
    import errno

    from jsonargparse import ArgumentParser

    from nanolab.callbacks.loggers import write_config_yaml
    from nanolab.errors import storage_message

    parser = ArgumentParser()
    parser.add_argument("--seed_everything", type=int, default=7)
    config = parser.parse_args([])
    other = tmp_path / "other-run-metrics.jsonl"
    other.write_text("precious\n")
    target = tmp_path / "config.yaml"
    os.link(other, tmp_path / "config.yaml.tmp")
    write_config_yaml(parser, config, target)
    assert other.read_text() == "precious\n"
    assert "seed_everything: 7" in target.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["config.yaml", "config.yaml.tmp", other.name]
    )

    before = target.read_bytes()

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as info:
        write_config_yaml(parser, parser.parse_args(["--seed_everything", "8"]), target)
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["config.yaml", "config.yaml.tmp", other.name]
    )
    assert target.read_bytes() == before and other.read_text() == "precious\n"
    assert storage_message(info.value).startswith(f"cannot write {target} (No space left")


def test_no_file_entries_left_is_said_so_not_as_a_lack_of_bytes(tmp_path, char_dataset):
    """A file system out of inodes with megabytes free: "No space left on device" from the
    kernel, but freeing bytes would not help, so the lines say the entries ran out and the fix
    is deleting files (a checkpoint's line and the one every other write gets)."""
    import errno

    import torch

    from nanolab.callbacks.checkpoint_io import CheckpointWriteError, atomic_torch_save
    from nanolab.callbacks.rundir import RunDirError, claim_run_dir
    from nanolab.errors import storage_message

    ino = tmp_path / "ino"
    if not _mount(ino, "size=20m,nr_inodes=7"):
        pytest.skip("mounting a tmpfs needs root")
    try:
        cfg = write_config(tmp_path / "tiny.yaml", tiny_overrides(char_dataset, ino))
        res = nanolab_here("fit", "--config", str(QUICKSTART), "--config", str(cfg), cwd=tmp_path)
        assert res.returncode == 74, res.stderr[-2000:]
        errors = [line for line in res.stderr.splitlines() if "error:" in line]
        assert len(errors) == 1 and "no file entries (inodes) left" in errors[0], errors
        assert "free space" not in errors[0] and "delete files" in errors[0], errors[0]

        while True:  # use up what is left, then a checkpoint save meets the same
            try:
                (ino / f"f{len(list(ino.iterdir()))}").touch()
            except OSError:
                break
        with pytest.raises(CheckpointWriteError) as info:
            atomic_torch_save({"w": torch.zeros(4)}, ino / "step-00000001.ckpt")
        assert info.value.errno == errno.ENOSPC
        assert str(info.value).startswith("no file entries (inodes) left on the file system")
        assert "MB of space free)" in str(info.value) and "free file entries" in str(info.value)
        line = storage_message(OSError(errno.ENOSPC, "No space left on device", str(ino / "x")))
        assert "no file entries (inodes) left there: 0 of 7, " in line, line
        with pytest.raises(RunDirError) as refused:  # a new run directory cannot be made
            claim_run_dir(ino / "new", None, resuming=False)
        assert refused.value.errno == errno.ENOSPC and "delete files" in str(refused.value)
        assert "no file entries (inodes) left there" in str(refused.value)
    finally:
        subprocess.run(["umount", "-l", str(ino)], capture_output=True)


def test_no_file_entries_left_at_the_run_lock_or_the_queue_is_said_so(
    tmp_path: Path, char_dataset: Path
) -> None:
    """Out of file entries where fit takes the run directory's lock: it said "the disk is full
    (3 MB free); free space" and exited 2; a queue database there was called damaged
    (SQLite's "unable to open database file" for its -wal file) with the advice to move it
    aside. Both now name the missing file entries; fit exits 74, as every full disk."""
    import errno

    from nanolab.queue.db import QueueDB, QueueError

    ino = tmp_path / "ino"
    if not _mount(ino, "size=3m,nr_inodes=8"):
        pytest.skip("mounting a tmpfs needs root")
    try:
        (ino / "runs").mkdir()
        QueueDB(ino / "q.db").close()
        n = 0
        while True:  # every entry taken
            try:
                (ino / f"f{n}").touch()
            except OSError:
                break
            n += 1
        cfg = write_config(tmp_path / "tiny.yaml", tiny_overrides(char_dataset, ino / "runs"))
        res = nanolab_here("fit", "--config", str(QUICKSTART), "--config", str(cfg), cwd=tmp_path)
        assert res.returncode == 74, res.stderr[-2000:]
        errors = [line for line in res.stderr.splitlines() if "error:" in line]
        assert len(errors) == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
        assert "no file entries (inodes) left there" in errors[0] and "delete files" in errors[0]
        with pytest.raises(QueueError) as refused:
            QueueDB(ino / "q.db")
        line = str(refused.value)
        assert "no file entries (inodes) left" in line and "move it aside" not in line, line
        assert refused.value.errno == errno.ENOSPC  # the verb exits 74, as fit does
    finally:
        subprocess.run(["umount", "-l", str(ino)], capture_output=True)


APPEND_PAST_A_LIMIT = """
import resource, sys
from nanolab.runlog import RunLogWriter, RunLogWriteError
resource.setrlimit(resource.RLIMIT_FSIZE, (8192, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
writer = RunLogWriter(sys.argv[1], run_id="r")
try:
    for step in range(10_000):
        writer.write({"event": "train", "step": step, "loss": 1.0})
except RunLogWriteError as err:
    print(err.errno, err)
"""


def test_a_run_log_past_ulimit_f_names_the_limit_not_free_space(tmp_path: Path) -> None:
    """A run log refused by a file-size limit (EFBIG) said "File too large; 45717 MB free
    there ... free space": freeing space would not help. It names the limit and its fix."""
    import errno
    import sys

    log = tmp_path / "metrics.jsonl"
    out = subprocess.run([sys.executable, "-c", APPEND_PAST_A_LIMIT, str(log)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    code, line = out.stdout.strip().split(" ", 1)
    assert int(code) == errno.EFBIG
    assert line == (
        f"cannot append to the run log {log} (File too large: this process's file-size limit "
        "(ulimit -f: 8 kB)); the lines written so far and the checkpoints are intact: raise the "
        "limit (ulimit -f unlimited, or ask for it in the job's settings), then rerun the same "
        "command to resume"
    ), line
    assert "free" not in line


EVALUATION_PAST_A_LIMIT = """
import resource, sys
from pathlib import Path
from nanolab.runlog import RunLogWriteError
from nanolab.training.evaluate import append_record
run_dir = Path(sys.argv[1])
(run_dir / "metrics.jsonl").write_text('{"event": "train", "step": 1}\\n' * 400)
resource.setrlimit(resource.RLIMIT_FSIZE, (8192, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    append_record(run_dir, {"event": "val", "step": 1, "val/loss": 2.0})
except RunLogWriteError as err:
    print(err)
"""


def test_an_evaluation_s_record_past_ulimit_f_says_a_rerun_evaluates_again(
    tmp_path: Path,
) -> None:
    """``nanolab validate`` under a file-size limit said "then rerun the same command to
    resume": validate resumes nothing. Its line says what a rerun does for it."""
    import sys

    out = subprocess.run([sys.executable, "-c", EVALUATION_PAST_A_LIMIT, str(tmp_path)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    line = out.stdout.strip()
    assert line.startswith(f"cannot append to the run log {tmp_path / 'metrics.jsonl'} ("), line
    assert line.endswith("then rerun the same command to evaluate again and append its record"), (
        line
    )
    assert "resume" not in line, line


TORN_BY_A_LIMIT = """
import errno, json, os, resource, sys
from nanolab.runlog import RunLogWriter, RunLogWriteError
path, soft, hard = sys.argv[1], *resource.getrlimit(resource.RLIMIT_FSIZE)
writer = RunLogWriter(path, run_id="r")
writer.write({"event": "start", "step": 0})
resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path) + 100, hard))
try:  # a record longer than a write buffer, cut short by the limit
    writer.write({"event": "train", "step": 1, "note": "x" * 20_000})
except RunLogWriteError as err:
    assert err.errno == errno.EFBIG, err
resumed = RunLogWriter(path, run_id="r")  # a resume under the same limit
try:
    resumed.write({"event": "start", "step": 1})
except RunLogWriteError as err:
    print("resume:", err.errno == errno.EFBIG)
resumed.close()
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # room again (space freed, limit raised)
writer.write({"event": "end", "step": 1})  # the same process's next record
writer.close()
writer = RunLogWriter(path, run_id="r")  # a resume, once there is room
writer.write({"event": "start", "step": 1})
writer.close()
"""


def test_a_record_after_one_torn_by_a_size_limit_starts_a_line_of_its_own(
    tmp_path: Path,
) -> None:
    """A write refused part-way by ``ulimit -f`` (EFBIG) left a torn line, and the writer's
    buffer dropped the rest of the record: the next record of the same process (the ``end``
    record) was glued onto the torn bytes and unreadable. Every append now starts on a fresh
    line; a resume under the same limit is the limit's one error, not "set run.root to a
    writable folder"."""
    import sys

    log = tmp_path / "metrics.jsonl"
    out = subprocess.run([sys.executable, "-c", TORN_BY_A_LIMIT, str(log)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["resume: True"], out.stdout
    lines = log.read_bytes().split(b"\n")
    assert lines[1].startswith(b'{"event":"train"') and not lines[1].endswith(b"}")  # torn
    assert [(r["event"], r["step"]) for r in read_records(log)] == [
        ("start", 0),
        ("end", 1),
        ("start", 1),
    ]
    assert len(lines) == 5 and lines[-1] == b""  # no blank line added: one newline per tear


def test_a_queue_database_past_ulimit_f_is_said_so_never_damaged(tmp_path: Path) -> None:
    """Under a file-size limit below what SQLite must write (its 32 KiB ``-shm``), the queue
    called a healthy database "damaged or not SQLite (disk I/O error)" and advised moving it
    aside and queueing the jobs again. A verb that writes (``clear``) names the limit and its
    fix, says the database was left untouched, and exits 74 as every verb stopped for room
    does; ``ls`` needs no write and lists the queue."""
    import resource
    import sqlite3
    import sys

    from nanolab.queue.db import NewJob, QueueDB

    db_path = tmp_path / "q.db"
    db = QueueDB(db_path)
    db.add_jobs([NewJob(name="a1", config="c.yaml", args=[], seed=None, cwd=str(tmp_path),
                        run_dir=str(tmp_path / "runs" / "a1"))])  # fmt: skip
    db.close()
    before = db_path.read_bytes()

    def four_kb() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))  # fmt: skip

    def queue(verb: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "nanolab", "queue", verb, "--db", str(db_path)],
                              capture_output=True, text=True, timeout=120, preexec_fn=four_kb)  # fmt: skip

    listed = queue("ls")
    assert listed.returncode == 0 and " a1 " in listed.stdout, listed.stderr[-2000:]
    res = queue("clear")
    assert res.returncode == 74, res.stderr[-2000:]
    errors = [line for line in res.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert "this process's file-size limit (ulimit -f: 4 kB)" in errors[0], errors[0]
    assert "ulimit -f unlimited" in errors[0] and "left untouched" in errors[0], errors[0]
    assert "damaged" not in errors[0] and "move it aside" not in errors[0], errors[0]
    assert db_path.read_bytes() == before
    conn = sqlite3.connect(db_path)
    assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    assert [r[0] for r in conn.execute("SELECT name FROM jobs")] == ["a1"]
    conn.close()
