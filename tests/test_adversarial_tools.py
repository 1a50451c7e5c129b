"""The tool items of issue 11 that need more than one row of tests/test_adversarial.py.

The one-row cases (bad generate options and checkpoints, a --db that is not a queue, queue run
--gpus without a GPU, report lines of the wrong shape) are rows of ``CASES`` there. Here: what a
row cannot check: that ``generate --ckpt RUN_DIR`` samples exactly what ``--ckpt
RUN_DIR/checkpoints/last.ckpt`` does, that a zero-byte --db is an empty queue, that ``report``
counts each malformed record and still reports the rest, and a full disk during a checkpoint,
through a writer with a byte quota (always) and a real tmpfs (where this machine may mount one).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import QUICKSTART, nanolab_here, run_nanolab, tiny_overrides, write_config

from nanolab.queue.db import QueueDB


# -- a real run to point the tools at --------------------------------------------------------
@dataclass
class Trained:
    """A finished 6-step run of the tiny model, made once by ``nanolab fit`` (in-process)."""

    root: Path  # runs/
    run_dir: Path  # runs/tiny
    config: Path

    @property
    def last(self) -> Path:
        return self.run_dir / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, char_dataset: Path) -> Trained:
    base = tmp_path_factory.mktemp("trained")
    cfg = write_config(base / "tiny.yaml", tiny_overrides(char_dataset, base / "runs"))
    res = nanolab_here("fit", "--config", str(QUICKSTART), "--config", str(cfg), cwd=base)
    assert res.returncode == 0, res.stderr[-3000:]
    return Trained(base / "runs", base / "runs" / "tiny", cfg)


# -- the rest of the generate and queue items -------------------------------------------------
def test_generate_from_a_run_directory_uses_its_newest_checkpoint(trained: Trained) -> None:
    """The run directory is its newest complete checkpoint: the step file last.ckpt links to
    (named by its step, as validate and eval name it), the same sample."""
    direct = nanolab_here(
        "generate", "--ckpt", str(trained.last), "--max-new-tokens", "12", cwd=trained.root
    )
    via_dir = nanolab_here(
        "generate", "--ckpt", str(trained.run_dir), "--max-new-tokens", "12", cwd=trained.root
    )
    assert direct.returncode == 0 and via_dir.returncode == 0, via_dir.stderr
    assert via_dir.stdout == direct.stdout and len(direct.stdout.strip()) >= 5  # same sample
    newest = trained.run_dir / "checkpoints" / "step-00000006.ckpt"
    assert newest.samefile(trained.last) and f"using {newest}" in via_dir.stderr


def test_a_zero_byte_db_file_is_an_empty_queue(tmp_path: Path, trained: Trained) -> None:
    """An empty file holds nothing to lose: SQLite treats it as a new database, and so do we."""
    db = tmp_path / "q.db"
    db.touch()
    res = run_nanolab("queue", "ls", "--db", str(db), cwd=tmp_path)
    assert res.returncode == 0 and "no jobs" in res.stdout, res.stderr
    assert [j.name for j in QueueDB(db).jobs()] == []


#: A log line of the wrong shape -> what the report's note says about it.
MALFORMED = {
    "string-step": ('{"event": "train", "step": "7", "loss": 2.0}', "'step' is str \"7\""),
    "list-step": ('{"event": "val", "step": [1], "val_loss": 2.0}', "'step' is list [1]"),
    "negative-step": ('{"event": "train", "step": -1, "loss": 1.0}', "'step' is int -1"),
    "string-loss": ('{"event": "train", "step": 9, "loss": "low"}', "'loss' is str"),
    "string-time": ('{"event": "train", "step": 2, "time": "yesterday"}', "'time' is str"),
    "no-event": ('{"step": 3, "loss": 1.0}', "no 'event'"),
    "nan-seed": ('{"event": "start", "step": 0, "seed": NaN}', "'seed' is float NaN"),
    "numeric-error": ('{"event": "end", "step": 6, "error": 42}', "'error' is int 42"),
    "negative-val": ('{"event": "val", "step": 9, "val_loss": -5.0}', "'val_loss' is negative"),
}


def test_report_skips_and_counts_records_of_the_wrong_shape(
    tmp_path: Path, trained: Trained
) -> None:
    runs = tmp_path / "runs"
    skip = shutil.ignore_patterns("*.ckpt")
    shutil.copytree(trained.run_dir, runs / "good", ignore=skip)
    for name, (line, _) in MALFORMED.items():
        shutil.copytree(trained.run_dir, runs / name, ignore=skip)
        with open(runs / name / "metrics.jsonl", "a") as f:
            f.write(line + "\n")
    table = run_nanolab("report", str(runs), cwd=tmp_path)
    assert table.returncode == 0 and not table.stderr.strip(), table.stderr
    notes = [ln for ln in table.stdout.splitlines() if ln.startswith("note: ")]
    assert len(notes) == len(MALFORMED), table.stdout
    for name, (_, shown) in MALFORMED.items():
        (note,) = [n for n in notes if n.startswith(f"note: {name}: ")]
        assert "skipped 1 record(s) of the wrong shape" in note and shown in note, note
        assert str(runs / name / "metrics.jsonl") in note, note

    res = run_nanolab("report", str(runs), "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    by_run = {r["run"]: r for r in json.loads(res.stdout)["runs"]}
    assert by_run["good"]["skipped_records"] == 0
    for name in MALFORMED:  # the good lines still count: the same figures as the clean twin
        assert by_run[name]["skipped_records"] == 1, name
        for key in ("steps", "train_loss", "best_val_loss", "tokens", "status", "seed"):
            assert by_run[name][key] == by_run["good"][key], (name, key)


# -- a full disk during a checkpoint ---------------------------------------------------------
#: Run ``nanolab`` with checkpoint writes going to a "disk" that has ``NANOLAB_TEST_ROOM``
#: bytes left after the first checkpoint. Only the file object torch writes to is replaced:
#: torch's own zip writer meets the ENOSPC and raises what it raises on a real full disk.
FULL_DISK = """
import errno, os, shutil, sys
import nanolab.callbacks.checkpoint_io as io_module

ROOM = int(os.environ["NANOLAB_TEST_ROOM"])
state = {"opened": 0, "used": 0}

class FullDisk:
    def __init__(self, f):
        self.f = f
    def write(self, data):
        n = memoryview(data).nbytes
        if state["used"] + n > ROOM:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        state["used"] += n
        return self.f.write(data)
    def __getattr__(self, name):
        return getattr(self.f, name)
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

real_open_new = io_module._open_new

def open_on_full_disk(path, folder):
    # Every checkpoint file is opened here (through the run's claimed folder descriptor).
    f = real_open_new(path, folder)
    state["opened"] += 1
    if state["opened"] >= 2:
        state["used"] = 0
        return FullDisk(f)
    return f

io_module._open_new = open_on_full_disk
real_usage = shutil.disk_usage
shutil.disk_usage = lambda p: real_usage(p)._replace(free=ROOM)
from nanolab.cli import main
sys.exit(main(sys.argv[1:]))
"""


def fit_argv(config: Path, root: Path) -> list[str]:
    return [
        "fit", "--config", str(QUICKSTART), "--config", str(config), "--run.root", str(root),
        "--run.name", "full", "--checkpoint.every_n_steps", "2", "--run.eval_every_steps", "100",
    ]  # fmt: skip


def assert_disk_full_reported(res: subprocess.CompletedProcess, run_dir: Path) -> None:
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    assert res.returncode == 74, res.stderr[-3000:]  # EXIT_DISK_FULL
    errors = [ln for ln in res.stderr.splitlines() if ": error: " in ln]
    assert len(errors) == 1, res.stderr[-3000:]
    line = errors[0]
    target = run_dir / "checkpoints" / "step-00000004.ckpt"
    assert line.startswith(f"nanolab fit: error: no space left on device writing {target} ("), line
    assert " free, checkpoint needs " in line and "previous checkpoints are intact" in line, line
    # One step file here, the newest: no setting makes room, and the line does not pretend one.
    assert line.endswith(
        "free space, then rerun the same command (the newest checkpoint is always kept)"
    ), line
    assert "inline_container" not in line, line
    # The earlier checkpoint survives, complete; no torn or temporary file is left.
    folder = run_dir / "checkpoints"
    assert {p.name for p in folder.iterdir()} == {"step-00000002.ckpt", "last.ckpt"}
    ckpt = torch.load(folder / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 2


@pytest.mark.slow  # 30-100 s on 2 cores; `pytest -m slow`
def test_full_disk_during_a_checkpoint(tmp_path: Path, trained: Trained) -> None:
    room = 90_000  # torch's writer fails mid-file: the RuntimeError users saw before
    env = {"NANOLAB_TEST_ROOM": str(room)}
    argv = fit_argv(trained.config, tmp_path / "runs")
    res = subprocess.run(
        [sys.executable, "-c", FULL_DISK, *argv],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert_disk_full_reported(res, tmp_path / "runs" / "full")
    line = next(ln for ln in res.stderr.splitlines() if ": error: " in ln)
    assert "(90 kB free" in line, line
    # "needs" is the size of the checkpoint the first save wrote (the tensors alone fell short).
    needs_mb = float(line.split("checkpoint needs about ")[1].split(" MB")[0])
    size = (tmp_path / "runs" / "full" / "checkpoints" / "last.ckpt").stat().st_size
    assert abs(needs_mb * 1e6 - size) <= 0.005e6, (needs_mb, size)


@pytest.fixture
def small_tmpfs(tmp_path: Path, trained: Trained):
    """A real filesystem with room for one checkpoint and a half (root and mount rights only)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    size = int(1.5 * trained.last.stat().st_size) + 64 * 1024
    mnt = tmp_path / "disk"
    mnt.mkdir()
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True
    )
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.slow
def test_full_disk_on_a_real_filesystem(small_tmpfs: Path, trained: Trained) -> None:
    res = run_nanolab(*fit_argv(trained.config, small_tmpfs), cwd=small_tmpfs.parent)
    assert_disk_full_reported(res, small_tmpfs / "full")
    # The kernel's own ENOSPC, met by torch's real writer: the disk really had no room.
    assert shutil.disk_usage(small_tmpfs).free < trained.last.stat().st_size


def test_a_healthy_queue_on_a_full_disk_is_not_called_damaged(tmp_path: Path, capsys) -> None:
    """A full disk made SQLite fail on opening ('disk I/O error': no room for the journal), and
    the queue called its healthy database damaged and advised moving it aside and queueing the
    jobs again, which throws away every job's history. It now says the disk is full and to free
    space; the database is unchanged and opens once there is room."""
    import hashlib

    from nanolab.queue.cli import main as queue_main
    from nanolab.queue.db import QueueDB, QueueError

    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                         capture_output=True)  # fmt: skip
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.decode().strip()}")
    try:
        db_path = mnt / "q.db"
        QueueDB(db_path).close()
        digest = hashlib.sha256(db_path.read_bytes()).hexdigest()
        with open(mnt / "filler", "wb") as f, contextlib.suppress(OSError):
            while True:  # every free block taken
                f.write(b"\0" * 65536)
                f.flush()
        with pytest.raises(QueueError) as refused:
            QueueDB(db_path)
        line = str(refused.value)
        assert "is full" in line and "free space there" in line and "move it aside" not in line
        assert refused.value.errno is not None  # 74, as every full disk (it exited 2)
        assert queue_main(["ls", "--db", str(db_path)]) == 74
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is full" in err[0], err
        (mnt / "filler").unlink()
        assert hashlib.sha256(db_path.read_bytes()).hexdigest() == digest
        QueueDB(db_path).close()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
