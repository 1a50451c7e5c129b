"""Hostile input to the tools around training (queue, report, generate, checkpoint writes).

Each row of :data:`ROWS` is one bad input, run through the real CLI in a subprocess with real
files. Every row must end in exit code 2 (or 0 where the tool should carry on, as ``report``
does past a malformed record), with exactly one ``error:`` line naming the field or file and
the fix, no traceback, and every file that existed before byte-for-byte unchanged with no new
ones beside it. The next bad input is one more row.

A full disk during a checkpoint is driven separately (it needs a disk that fills up): through a
writer with a byte quota, always, and through a real tmpfs where this machine lets us mount one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import QUICKSTART, run_nanolab, tiny_overrides, write_config

from nanolab.queue.db import SCHEMA_VERSION, NewJob, QueueDB


# -- a real run to point the tools at --------------------------------------------------------
@dataclass
class Trained:
    """A finished 6-step run of the tiny model, made once by ``nanolab fit``."""

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
    res = run_nanolab("fit", "--config", str(QUICKSTART), "--config", str(cfg), cwd=base)
    assert res.returncode == 0, res.stderr[-3000:]
    return Trained(base / "runs", base / "runs" / "tiny", cfg)


# -- rows ------------------------------------------------------------------------------------
@dataclass
class Row:
    """One bad input: ``make`` writes its files into a fresh folder and returns the argv."""

    id: str
    make: Callable[[Path, Trained], list[str]]
    expect: tuple[str, ...]  # fragments of the one error line (or of stdout when code is 0)
    code: int = 2
    needs_no_gpu: bool = False


def _ckpt_copy(tmp: Path, t: Trained, name: str = "model.ckpt") -> Path:
    return Path(shutil.copy(t.last, tmp / name))


def _nan_weights(tmp: Path, t: Trained) -> list[str]:
    ckpt = torch.load(t.last, map_location="cpu", weights_only=True)
    ckpt["state_dict"]["model.lm_head.weight"].fill_(float("nan"))
    torch.save(ckpt, tmp / "diverged.ckpt")
    return ["generate", "--ckpt", str(tmp / "diverged.ckpt")]


def _truncated_ckpt(tmp: Path, t: Trained) -> list[str]:
    data = t.last.read_bytes()
    (tmp / "torn.ckpt").write_bytes(data[: len(data) // 2])
    return ["generate", "--ckpt", str(tmp / "torn.ckpt")]


def _edited_ckpt(edit: Callable[[dict], object]) -> Callable[[Path, Trained], list[str]]:
    """A copy of the real checkpoint changed by ``edit`` (which may return a whole new object)."""

    def make(tmp: Path, t: Trained) -> list[str]:
        ckpt = torch.load(t.last, map_location="cpu", weights_only=True)
        out = edit(ckpt)
        torch.save(ckpt if out is None else out, tmp / "edited.ckpt")
        return ["generate", "--ckpt", str(tmp / "edited.ckpt")]

    return make


class Payload:
    """Pickles to a call of ``os.system``: a checkpoint that would run code if unpickled."""

    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def _generate(*opts: str) -> Callable[[Path, Trained], list[str]]:
    return lambda tmp, t: ["generate", "--ckpt", str(_ckpt_copy(tmp, t)), *opts]


def _queue_db(tmp: Path) -> Path:
    """A real queue with one pending job, its WAL folded into the main file."""
    db = QueueDB(tmp / "real.db")
    db.add_jobs([NewJob(name="j", config="c.yaml", args=[], seed=1, cwd="/", run_dir="/r/j")])
    db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    for side in ("real.db-wal", "real.db-shm"):
        (tmp / side).unlink(missing_ok=True)
    return tmp / "real.db"


def _db_file(content: Callable[[Path], bytes]) -> Callable[[Path, Trained], list[str]]:
    """``queue add`` (the verb that writes) against a --db file holding ``content``."""

    def make(tmp: Path, t: Trained) -> list[str]:
        data = content(tmp)
        for p in tmp.iterdir():
            p.unlink()
        (tmp / "queue.db").write_bytes(data)
        return ["queue", "add", str(t.config), "--db", str(tmp / "queue.db")]

    return make


def _other_schema(tmp: Path) -> bytes:
    conn = sqlite3.connect(tmp / "other.db")
    conn.execute("CREATE TABLE jobs (id INTEGER PRIMARY KEY, title TEXT)")
    conn.execute("INSERT INTO jobs VALUES (1, 'my own data')")
    conn.commit()
    conn.close()
    return (tmp / "other.db").read_bytes()


def _newer_schema(tmp: Path) -> bytes:
    db = _queue_db(tmp)
    conn = sqlite3.connect(db)
    conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (SCHEMA_VERSION + 1,))
    conn.commit()
    conn.close()
    return db.read_bytes()


def _report_with(line: str) -> Callable[[Path, Trained], list[str]]:
    """Two copies of the real run, one with ``line`` appended to its log; report over both."""

    def make(tmp: Path, t: Trained) -> list[str]:
        shutil.copytree(t.run_dir, tmp / "runs" / "good", ignore=shutil.ignore_patterns("*.ckpt"))
        bad = shutil.copytree(
            t.run_dir, tmp / "runs" / "bad", ignore=shutil.ignore_patterns("*.ckpt")
        )
        with open(bad / "metrics.jsonl", "a") as f:
            f.write(line + "\n")
        return ["report", str(tmp / "runs")]

    return make


ROWS = [
    # generate: options
    Row("generate-temperature-nan", _generate("--temperature", "nan"), ("--temperature", "finite")),
    Row("generate-top-k-0", _generate("--top-k", "0"), ("--top-k must be >= 1", "got 0")),
    Row("generate-top-k-negative", _generate("--top-k", "-3"), ("--top-k must be >= 1", "got -3")),
    Row(
        "generate-device-cuda-without-gpu",
        _generate("--device", "cuda"),
        ("--device cuda", "not usable here", "use --device cpu"),
        needs_no_gpu=True,
    ),
    Row("generate-device-bogus", _generate("--device", "bogus"), ("--device 'bogus'", "cpu, cuda")),
    # generate: checkpoints
    Row(
        "generate-nan-weights", _nan_weights, ("diverged.ckpt", "non-finite", "earlier checkpoint")
    ),
    Row("generate-truncated-ckpt", _truncated_ckpt, ("torn.ckpt", "not a checkpoint", "truncated")),
    Row(
        "generate-ckpt-is-a-config",
        lambda tmp, t: ["generate", "--ckpt", str(shutil.copy(t.config, tmp / "c.yaml"))],
        ("c.yaml", "not a checkpoint", "nanolab fit"),
    ),
    Row(
        "generate-ckpt-empty-file",
        lambda tmp, t: ["generate", "--ckpt", str((tmp / "e.ckpt").touch() or tmp / "e.ckpt")],
        ("e.ckpt", "not a checkpoint", "empty"),
    ),
    Row(
        "generate-ckpt-pickle-payload",
        _edited_ckpt(lambda c: {**c, "extra": Payload()}),
        ("edited.ckpt", "Python objects besides tensors", "never code"),
    ),
    Row(
        "generate-ckpt-other-shape",
        _edited_ckpt(lambda c: c["nanolab"]["gpt"].update(n_layer=3)),
        ("edited.ckpt", "do not fit its model config", "missing", "blocks.2"),
    ),
    Row(
        "generate-ckpt-invalid-model-config",
        _edited_ckpt(lambda c: c["nanolab"]["gpt"].update(n_head=3)),
        ("edited.ckpt", "model config is not valid", "n_head"),
    ),
    Row(
        "generate-ckpt-not-a-dict",
        _edited_ckpt(lambda c: [1, 2, 3]),
        ("edited.ckpt", "holds no state_dict"),
    ),
    Row("generate-seed-overflow", _generate("--seed", str(2**70)), ("--seed", "64 bits")),
    Row("generate-max-new-tokens-0", _generate("--max-new-tokens", "0"), ("--max-new-tokens",)),
    Row(
        "generate-ckpt-folder-without-checkpoints",
        lambda tmp, t: ["generate", "--ckpt", str(tmp)],
        ("is a folder without checkpoints/last.ckpt", "pass a .ckpt file"),
    ),
    # queue: --db that is not a queue database; `add` is the verb that would write into it
    Row(
        "queue-db-is-a-yaml-file",
        _db_file(lambda tmp: b"trainer:\n  max_steps: 100\n"),
        ("queue.db", "not SQLite", "left untouched", "--db"),
    ),
    Row(
        "queue-db-garbage-bytes",
        _db_file(lambda tmp: bytes(range(256)) * 64),
        ("queue.db", "not SQLite", "left untouched"),
    ),
    Row(
        "queue-db-truncated",
        _db_file(lambda tmp: (d := _queue_db(tmp).read_bytes())[: len(d) // 2]),
        ("queue.db", "damaged", "left untouched", "mv "),
    ),
    Row(
        "queue-db-header-only",
        _db_file(lambda tmp: _queue_db(tmp).read_bytes()[:60]),
        ("queue.db", "damaged", "left untouched"),
    ),
    Row(
        "queue-db-other-schema",
        _db_file(_other_schema),
        ("queue.db", "not a nanolab queue", "tables: jobs", "left untouched"),
    ),
    Row(
        "queue-db-newer-schema",
        _db_file(_newer_schema),
        ("queue.db", "schema version", "upgrade nanolab"),
    ),
    Row(
        "queue-db-is-a-folder",
        lambda tmp, t: ["queue", "ls", "--db", str(tmp)],
        ("is a folder", "--db", "nanolab_queue.db"),
    ),
    Row(
        "queue-db-is-dev-null",
        lambda tmp, t: ["queue", "add", str(t.config), "--db", os.devnull],
        ("/dev/null is not a regular file", "--db"),
    ),
    Row(
        "queue-run-gpus-without-gpu",
        lambda tmp, t: ["queue", "run", "--gpus", "0", "--db", str(_queue_db(tmp))],
        ("--gpus 0", "no GPU is visible", "leave --gpus out"),
        needs_no_gpu=True,
    ),
    # report: records of the wrong shape are skipped and counted; the report goes on
    Row(
        "report-string-step",
        _report_with('{"event": "train", "step": "7", "time": 1.0, "loss": 2.0}'),
        ("bad: skipped 1 record", "'step' is str", "good "),
        code=0,
    ),
    Row(
        "report-list-step",
        _report_with('{"event": "val", "step": [1], "val_loss": 2.0}'),
        ("bad: skipped 1 record", "'step' is list"),
        code=0,
    ),
    Row(
        "report-string-loss",
        _report_with('{"event": "train", "step": 9, "loss": "low"}'),
        ("bad: skipped 1 record", "'loss' is str"),
        code=0,
    ),
    Row(
        "report-no-event",
        _report_with('{"step": 3, "loss": 1.0}'),
        ("bad: skipped 1 record", "no 'event'"),
        code=0,
    ),
    Row(
        "report-negative-step",
        _report_with('{"event": "train", "step": -1, "loss": 1.0}'),
        ("bad: skipped 1 record", "'step' is int -1"),
        code=0,
    ),
    Row(
        "report-text-time",
        _report_with('{"event": "train", "step": 2, "time": "yesterday"}'),
        ("bad: skipped 1 record", "'time' is str"),
        code=0,
    ),
    Row(
        "report-nan-seed",
        _report_with('{"event": "start", "step": 0, "seed": NaN}'),
        ("bad: skipped 1 record", "'seed' is float NaN"),
        code=0,
    ),
    Row(
        "report-numeric-error-text",
        _report_with('{"event": "end", "step": 6, "reason": "error", "error": 42}'),
        ("bad: skipped 1 record", "'error' is int"),
        code=0,
    ),
]


def snapshot(*folders: Path) -> dict[str, str]:
    """Every file under ``folders`` -> sha256 of its bytes."""
    out = {}
    for folder in folders:
        for p in sorted(folder.rglob("*")):
            if p.is_file():
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_input(row: Row, tmp_path: Path, trained: Trained) -> None:
    if row.needs_no_gpu and torch.cuda.is_available():
        pytest.skip("needs a machine without a GPU")
    argv = row.make(tmp_path, trained)
    before = snapshot(tmp_path, trained.run_dir)
    res = run_nanolab(*argv, cwd=tmp_path, timeout=120)
    assert "Traceback" not in res.stderr, res.stderr
    assert res.returncode == row.code, (res.returncode, res.stdout[-500:], res.stderr[-2000:])
    if row.code == 2:
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1, res.stderr
        text = lines[0]
        assert text.startswith(f"nanolab {argv[0]}") and ": error: " in text, text
    else:
        text = res.stdout
        assert "error" not in res.stderr.lower(), res.stderr
    for fragment in row.expect:
        assert fragment in text, (fragment, text)
    assert snapshot(tmp_path, trained.run_dir) == before  # nothing changed, nothing added


# -- the rest of the generate and queue items -------------------------------------------------
def test_generate_from_a_run_directory_uses_its_last_checkpoint(trained: Trained) -> None:
    direct = run_nanolab(
        "generate", "--ckpt", str(trained.last), "--max-new-tokens", "12", cwd=trained.root
    )
    via_dir = run_nanolab(
        "generate", "--ckpt", str(trained.run_dir), "--max-new-tokens", "12", cwd=trained.root
    )
    assert direct.returncode == 0 and via_dir.returncode == 0, via_dir.stderr
    assert via_dir.stdout == direct.stdout and len(direct.stdout.strip()) >= 5  # same sample
    assert f"using {trained.last}" in via_dir.stderr


def test_a_zero_byte_db_file_is_an_empty_queue(tmp_path: Path, trained: Trained) -> None:
    """An empty file holds nothing to lose: SQLite treats it as a new database, and so do we."""
    db = tmp_path / "q.db"
    db.touch()
    res = run_nanolab("queue", "ls", "--db", str(db), cwd=tmp_path)
    assert res.returncode == 0 and "no jobs" in res.stdout, res.stderr
    assert [j.name for j in QueueDB(db).jobs()] == []


def test_report_json_counts_the_skipped_records(tmp_path: Path, trained: Trained) -> None:
    argv = _report_with('{"event": "train", "step": "7", "loss": 2.0}')(tmp_path, trained)
    res = run_nanolab(*argv, "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    runs = {r["run"]: r for r in json.loads(res.stdout)["runs"]}
    assert runs["bad"]["skipped_records"] == 1 and runs["good"]["skipped_records"] == 0
    # The good lines of the bad run still count: same figures as its clean twin.
    for key in ("steps", "train_loss", "best_val_loss", "tokens", "status"):
        assert runs["bad"][key] == runs["good"][key], key


# -- a full disk during a checkpoint ---------------------------------------------------------
#: Run ``nanolab`` with checkpoint writes going to a "disk" that has ``NANOLAB_TEST_ROOM``
#: bytes left after the first checkpoint. Only the file object torch writes to is replaced:
#: torch's own zip writer meets the ENOSPC and raises what it raises on a real full disk.
FULL_DISK = """
import builtins, errno, os, shutil, sys
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

def open_on_full_disk(path, mode="r", *args, **kwargs):
    f = builtins.open(path, mode, *args, **kwargs)
    if "w" in mode:
        state["opened"] += 1
        if state["opened"] >= 2:
            state["used"] = 0
            return FullDisk(f)
    return f

io_module.open = open_on_full_disk
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
    assert res.returncode == 2, res.stderr[-3000:]
    errors = [ln for ln in res.stderr.splitlines() if ": error: " in ln]
    assert len(errors) == 1, res.stderr[-3000:]
    line = errors[0]
    target = run_dir / "checkpoints" / "step-00000004.ckpt"
    assert line.startswith(f"nanolab fit: error: no space left on device writing {target} ("), line
    assert " free, checkpoint needs " in line and "previous checkpoints are intact" in line, line
    assert "checkpoint.keep_last" in line and "inline_container" not in line, line
    # The earlier checkpoint survives, complete; no torn or temporary file is left.
    folder = run_dir / "checkpoints"
    assert {p.name for p in folder.iterdir()} == {"step-00000002.ckpt", "last.ckpt"}
    ckpt = torch.load(folder / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 2


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
    # "needs" is the checkpoint's tensor bytes: within 10% of the file the first save wrote.
    needs_mb = float(line.split("checkpoint needs ")[1].split(" MB")[0])
    size = (tmp_path / "runs" / "full" / "checkpoints" / "last.ckpt").stat().st_size
    assert abs(needs_mb * 1e6 - size) < 0.1 * size, (needs_mb, size)


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
        subprocess.run(["umount", str(mnt)], check=False)


def test_full_disk_on_a_real_filesystem(small_tmpfs: Path, trained: Trained) -> None:
    res = run_nanolab(*fit_argv(trained.config, small_tmpfs), cwd=small_tmpfs.parent)
    assert_disk_full_reported(res, small_tmpfs / "full")
    # The kernel's own ENOSPC, met by torch's real writer: the disk really had no room.
    assert shutil.disk_usage(small_tmpfs).free < trained.last.stat().st_size
