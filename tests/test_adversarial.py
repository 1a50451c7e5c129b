"""Hostile inputs against the real CLI, in one place: every bad input is one row of ``CASES``.

Each row runs ``python -m nanolab ...`` in a fresh working directory and checks the contract from
docs/guarantees.md: the expected exit code, the expected text on the last stderr line (one line,
no traceback), and that no file which existed before the command was changed or removed (nothing
lost). Adding the next bad input is adding a row; a row's ``setup`` builds the files it needs.

Sequences that need more than one process or a signal (two launches of one run, a fresh start
while the run is live, SIGTERM during start-up, divergence, the clock under an exec'ing shell)
are the test functions after the table.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import resource
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from conftest import nanolab_here, run_nanolab, tiny_overrides, write_config

from nanolab.queue.db import QueueDB
from nanolab.queue.runner import EXIT_JOB_FAILED
from nanolab.runlog import read_records

#: Exit code of a run stopped by the divergence check (docs/guarantees.md).
EXIT_DIVERGED = 3
EXIT_USAGE = 2
EXIT_PREEMPTED = 75


# -- the workspace every row runs in ------------------------------------------------------------
class RunCache:
    """Finished tiny runs, each trained once per module when a row first asks for it."""

    LAYERS: ClassVar[dict[str, int]] = {"base": 2, "shape3": 3}

    def __init__(self, root: Path, data: Path) -> None:
        self.root, self.data = root, data

    def run(self, name: str) -> Path:
        run_dir = self.root / name
        if not (run_dir / "checkpoints" / "last.ckpt").exists():
            cfg = tiny_overrides(
                self.data, self.root, run__name=name, model__gpt__n_layer=self.LAYERS[name]
            )
            path = write_config(self.root / f"{name}.yaml", cfg)
            res = nanolab_here("fit", "--config", str(path), cwd=self.root)  # set-up only
            assert res.returncode == 0, res.stderr[-3000:]
        return run_dir

    def __truediv__(self, name: str) -> Path:
        """``ws.cache / "base"``: the finished run's directory (trained on first use)."""
        return self.run(name)


@dataclass
class Workspace:
    """A row's working directory and the shared, read-only material it may copy from.

    ``cfg`` is a tiny fit config (2 layers, 32 wide, 6 steps, run ``tiny`` under ``work/runs``).
    ``cache`` trains finished runs once per module, on first use: ``base`` (2 layers) and
    ``shape3`` (3 layers, another run id); :meth:`copy_run` puts one under ``work/runs``.
    """

    work: Path
    data: Path
    cfg: Path
    cache: RunCache

    @property
    def runs(self) -> Path:
        return self.work / "runs"

    def copy_run(self, name: str, as_name: str | None = None) -> Path:
        target = self.runs / (as_name or name)
        shutil.copytree(self.cache.run(name), target)
        return target

    def write(self, name: str, content: str | bytes) -> Path:
        path = self.work / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        return path

    def fields(self) -> dict[str, str]:
        """Placeholders a row's argv may use: {cfg}, {work}, {runs}, {data}."""
        return {
            "cfg": str(self.cfg),
            "work": str(self.work),
            "runs": str(self.runs),
            "data": str(self.data),
        }


@dataclass(frozen=True)
class Case:
    """One hostile input.

    Args:
        id: Test id (``<verb>-<what>``).
        argv: Arguments after ``nanolab``; ``{cfg}``, ``{work}``, ``{runs}``, ``{data}`` are
            filled in from the :class:`Workspace`.
        code: Expected exit code.
        stderr: Text the last non-empty stderr line must contain ("" for a successful run).
        setup: Builds the row's files in the workspace before the command runs.
        memory_limit_gb: Address-space limit for the command (a row that would allocate more
            than the machine has must not take the machine down on a build that lacks the check).
    """

    id: str
    argv: tuple[str, ...]
    code: int
    stderr: str
    setup: Callable[[Workspace], None] | None = None
    memory_limit_gb: float | None = None
    timeout: float = 240


# -- setups --------------------------------------------------------------------------------------
def _finished_runs(ws: Workspace) -> None:
    ws.copy_run("base")
    ws.copy_run("shape3")


def _bad_checkpoints(ws: Workspace) -> None:
    """Checkpoint files that must be refused with one line, whichever command reads them."""
    good = (ws.cache.run("base") / "checkpoints" / "last.ckpt").read_bytes()
    ws.write("zero.ckpt", b"")
    ws.write("truncated.ckpt", good[: len(good) // 3])
    # A zip checkpoint whose pickle would call os.system on an unrestricted load.
    payload = ws.work / "pickle.ckpt"
    torch.save({"state_dict": {}, "evil": _Payload(str(ws.work / "pwned"))}, payload)
    shutil.copy(ws.cache.run("shape3") / "checkpoints" / "last.ckpt", ws.work / "shape3.ckpt")
    # A header overwritten inside the archive (a bad sector): the zip directory is intact, and a
    # memory-mapped load read every later tensor from shifted bytes, finite and wrong.
    damaged = bytearray(good)
    with zipfile.ZipFile(io.BytesIO(good)) as archive:
        first = next(i for i in archive.infolist() if i.filename.endswith("/data/0"))
    damaged[first.header_offset : first.header_offset + 30] = bytes(30)
    ws.write("damaged.ckpt", bytes(damaged))


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _empty_config(ws: Workspace) -> None:
    ws.write("empty.yaml", "")


def _broken_yaml(ws: Workspace) -> None:
    ws.write("broken.yaml", "trainer: [1,\n  max_steps: 3\n")


def _nan_lr_yaml(ws: Workspace) -> None:
    ws.write("nan_lr.yaml", "model:\n  optimizer:\n    lr: .nan\n")


def _mismatched_dataset(ws: Workspace) -> None:
    """A prepared dataset of one corpus, and a config that names another source for it."""
    shutil.copytree(ws.data, ws.work / "mydata")
    ws.write("other.txt", "a different corpus entirely\n" * 200)


def _damaged_data(damage: Callable[[Path], None]) -> Callable[[Workspace], None]:
    """A copy of the prepared dataset at ``work/baddata``, broken by ``damage``."""

    def setup(ws: Workspace) -> None:
        shutil.copytree(ws.data, ws.work / "baddata")
        damage(ws.work / "baddata")

    return setup


def _edit_meta(**changes: object) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        meta = json.loads((folder / "meta.json").read_text())
        meta.update(changes)
        (folder / "meta.json").write_text(json.dumps(meta))

    return damage


def _retype_bins(folder: Path) -> None:
    """uint32 token files under a meta.json that still says uint16."""
    import numpy as np

    for split in ("train", "val"):
        ids = np.fromfile(folder / f"{split}.bin", dtype=np.uint16)
        (folder / f"{split}.bin").write_bytes(ids.astype(np.uint32).tobytes())


def _id_past_vocab(folder: Path) -> None:
    import numpy as np

    vocab = json.loads((folder / "meta.json").read_text())["vocab_size"]
    ids = np.fromfile(folder / "train.bin", dtype=np.uint16)
    ids[len(ids) // 3] = vocab + 5
    (folder / "train.bin").write_bytes(ids.tobytes())


def _empty_val(folder: Path) -> None:
    (folder / "val.bin").write_bytes(b"")
    _edit_meta(val_tokens=0, val_bytes=0)(folder)


def _data_changed_under_a_run(ws: Workspace) -> None:
    """A run trained on work/mydata, whose meta.json was then rewritten (prepared again)."""
    shutil.copytree(ws.data, ws.work / "mydata")
    argv = [a.format(**ws.fields()) for a in _CHANGED_DATA_ARGS]
    res = run_nanolab(*argv, cwd=ws.work)
    assert res.returncode == 0, res.stderr[-3000:]
    _edit_meta(sources=["something else"])(ws.work / "mydata")


_CHANGED_DATA_ARGS = (
    "fit", "--config", "{cfg}", "--run.name", "ondata", "--data.dataset_dir", "{work}/mydata",
    "--trainer.max_steps=2", "--checkpoint.every_n_steps=2",
)  # fmt: skip


def _data_rows() -> list[Case]:
    """Data files that do not match their meta.json (issue 10/11): one line, exit 2."""
    bad = (*FIT, "--data.dataset_dir", "{work}/baddata")
    damages = [
        ("meta-garbage", lambda f: (f / "meta.json").write_bytes(b"{not json"), "not valid JSON"),
        ("meta-empty-object", lambda f: (f / "meta.json").write_text("{}"), "lacks vocab_size"),
        ("meta-unknown-dtype", _edit_meta(dtype="float16"), "is not a token dtype"),
        ("bin-not-a-multiple-of-dtype",
         lambda f: (f / "train.bin").write_bytes((f / "train.bin").read_bytes()[:-1]),
         "not a whole number of uint16 tokens"),
        ("bin-uint32-labelled-uint16", _retype_bins, "written as uint32, not uint16"),
        ("val-bin-empty", _empty_val, "val.bin is empty"),
        ("token-id-past-vocab", _id_past_vocab, "but the vocabulary has"),
    ]  # fmt: skip
    rows = [
        Case(f"fit-data-{name}", bad, EXIT_USAGE, text, setup=_damaged_data(damage))
        for name, damage, text in damages
    ]
    changed = Case(
        "fit-data-changed-under-a-resumed-run", _CHANGED_DATA_ARGS, EXIT_USAGE,
        "--data.allow_changed true", setup=_data_changed_under_a_run,
    )  # fmt: skip
    return [*rows, changed]


_CKPT_KINDS = {  # file -> what the one-line error must say
    "zero.ckpt": "empty file",
    "truncated.ckpt": "truncated",
    "pickle.ckpt": "pickle",
    "shape3.ckpt": "different model",
    "missing.ckpt": "does not exist",
}


def _checkpoint_rows() -> list[Case]:
    rows = []
    for verb in ("fit", "validate", "test"):
        for name, text in _CKPT_KINDS.items():
            if name == "missing.ckpt" and verb != "fit":
                continue  # one path check for all three
            rows.append(
                Case(
                    f"{verb}-ckpt_path-{name.removesuffix('.ckpt')}",
                    (verb, "--config", "{cfg}", "--ckpt_path", "{work}/" + name),
                    EXIT_USAGE,
                    text,
                    setup=_bad_checkpoints,
                )
            )
    for name in ("zero.ckpt", "pickle.ckpt"):
        rows.append(
            Case(
                f"fit-run.resume-{name.removesuffix('.ckpt')}",
                ("fit", "--config", "{cfg}", "--run.resume", "{work}/" + name),
                EXIT_USAGE,
                _CKPT_KINDS[name],
                setup=_bad_checkpoints,
            )
        )
    return rows


# -- tools around training: generate, queue --db, queue run --gpus, report (issue 11) ---------
def _base_ckpt(ws: Workspace) -> dict:
    return torch.load(ws.cache / "base" / "checkpoints" / "last.ckpt", weights_only=True)


def _generate_files(ws: Workspace) -> None:
    """work/model.ckpt (base's last), and edited copies of it a generate row may point at."""
    shutil.copy(ws.cache / "base" / "checkpoints" / "last.ckpt", ws.work / "model.ckpt")
    ckpt = _base_ckpt(ws)
    ckpt["state_dict"]["model.lm_head.weight"].fill_(float("nan"))
    torch.save(ckpt, ws.work / "diverged.ckpt")
    ckpt = _base_ckpt(ws)
    ckpt["nanolab"]["gpt"]["n_head"] = 3  # 32 wide: not divisible
    torch.save(ckpt, ws.work / "badconfig.ckpt")
    ckpt = _base_ckpt(ws)
    ckpt["nanolab"]["gpt"]["vocab_size"] = 10**9  # a terabyte of embedding: never allocated
    torch.save(ckpt, ws.work / "inflated.ckpt")
    torch.save([1, 2, 3], ws.work / "list.ckpt")


def _queue_db(ws: Workspace, name: str = "real.db") -> Path:
    """A real queue with one pending job, its WAL folded into the main file."""
    from nanolab.queue.db import NewJob, QueueDB

    db = QueueDB(ws.work / name)
    db.add_jobs([NewJob(name="j", config="c.yaml", args=[], seed=1, cwd="/", run_dir="/r/j")])
    db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    for side in ("-wal", "-shm"):
        (ws.work / (name + side)).unlink(missing_ok=True)
    return ws.work / name


def _queue_db_with_damaged_args(ws: Workspace) -> None:
    """work/real.db whose one job's arguments were edited by hand into something not JSON."""
    import sqlite3

    path = _queue_db(ws)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("UPDATE jobs SET args = 'not json'")
        conn.commit()


def _db_with(content: Callable[[Workspace], bytes]) -> Callable[[Workspace], None]:
    """work/queue.db holding ``content``; rows run `queue add` (the verb that writes) on it."""

    def setup(ws: Workspace) -> None:
        data = content(ws)
        for side in ("real.db", "other.db"):
            (ws.work / side).unlink(missing_ok=True)
        ws.write("queue.db", data)

    return setup


def _other_schema(ws: Workspace) -> bytes:
    import sqlite3

    conn = sqlite3.connect(ws.work / "other.db")
    conn.execute("CREATE TABLE jobs (id INTEGER PRIMARY KEY, title TEXT)")
    conn.execute("INSERT INTO jobs VALUES (1, 'my own data')")
    conn.commit()
    conn.close()
    return (ws.work / "other.db").read_bytes()


def _newer_schema(ws: Workspace) -> bytes:
    import sqlite3

    from nanolab.queue.db import SCHEMA_VERSION

    conn = sqlite3.connect(_queue_db(ws))
    conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (SCHEMA_VERSION + 1,))
    conn.commit()
    conn.close()
    return (ws.work / "real.db").read_bytes()


def _run_with_line(line: str) -> Callable[[Workspace], None]:
    """runs/good and runs/bad (copies of base); bad's log ends with ``line``."""

    def setup(ws: Workspace) -> None:
        ws.copy_run("base", "good")
        with open(ws.copy_run("base", "bad") / "metrics.jsonl", "a") as f:
            f.write(line + "\n")

    return setup


def _checkpoints_replaced_by_a_file(ws: Workspace) -> None:
    """A finished run whose checkpoints folder was replaced by a plain file."""
    run = ws.copy_run("base", "tiny")
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").write_text("not a folder")


def _config_yaml_replaced_by_a_folder(ws: Workspace) -> None:
    """A finished run whose config.yaml was replaced by a folder (a resume must not start)."""
    run = ws.copy_run("base", "tiny")
    (run / "config.yaml").unlink()
    (run / "config.yaml").mkdir()
    (run / "config.yaml" / "keep.txt").write_text("kept")


def _null_group_yaml(ws: Workspace) -> None:
    ws.write("null_checkpoint.yaml", "checkpoint: null\n")
    ws.write("null_steps.yaml", "trainer:\n  max_steps: null\n")
    ws.write(
        "twice.yaml", "trainer:\n  max_steps: 7\nmodel: {}\ntrainer:\n  gradient_clip_val: 0.5\n"
    )
    ws.write("number_group.yaml", "checkpoint: 5\n")
    ws.write("list_gpt.yaml", "model:\n  gpt: [1, 2]\n")


def _users_folder(ws: Workspace) -> None:
    """A folder of the user's own files, and a text to prepare."""
    ws.write("in.txt", "some text to prepare\n" * 50)
    ws.write("userdir/notes.txt", "my notes")
    ws.write("userdir/sub/more.txt", "more of mine")


def _bad_suite(ws: Workspace) -> None:
    """A finished run, a suite whose task file has a label past its options, a non-suite."""
    ws.copy_run("base")
    ws.write("bad.jsonl", '{"context": "a", "choices": ["b", "c"], "label": 1}\n'
                          '{"context": "a", "choices": ["b", "c"], "label": 7}\n')  # fmt: skip
    ws.write("suite.yaml", "- file: bad.jsonl\n  kind: multiple_choice\n")
    ws.write("in.txt", "just some words")


# fmt: off
def _tool_rows() -> list[Case]:
    gen = ("generate", "--ckpt")
    model = (*gen, "{work}/model.ckpt")
    add = ("queue", "add", "{cfg}", "--db", "{work}/queue.db")
    untouched = "it was left untouched"
    rows = [
        Case("generate-temperature-nan", (*model, "--temperature", "nan"), EXIT_USAGE,
             "--temperature must be a finite number >= 0", setup=_generate_files),
        Case("generate-top-k-zero", (*model, "--top-k", "0"), EXIT_USAGE,
             "--top-k must be >= 1, got 0", setup=_generate_files),
        Case("generate-top-k-negative", (*model, "--top-k", "-3"), EXIT_USAGE,
             "--top-k must be >= 1, got -3", setup=_generate_files),
        Case("generate-top-p-zero", (*model, "--top-p", "0"), EXIT_USAGE,
             "--top-p must be in (0, 1], got 0.0", setup=_generate_files),
        Case("generate-top-p-nan", (*model, "--top-p", "nan"), EXIT_USAGE,
             "--top-p must be in (0, 1], got nan", setup=_generate_files),
        Case("generate-device-bogus", (*model, "--device", "bogus"), EXIT_USAGE,
             "--device 'bogus' is not a device name; use cpu, cuda", setup=_generate_files),
        Case("generate-seed-past-64-bits", (*model, "--seed", str(2**70)), EXIT_USAGE,
             "--seed must fit in 64 bits", setup=_generate_files),
        Case("generate-max-new-tokens-zero", (*model, "--max-new-tokens", "0"), EXIT_USAGE,
             "--max-new-tokens must be >= 1", setup=_generate_files),
        Case("generate-nan-weights", (*gen, "{work}/diverged.ckpt"), EXIT_USAGE,
             "diverged.ckpt has non-finite weights", setup=_generate_files),
        Case("generate-invalid-model-config", (*gen, "{work}/badconfig.ckpt"), EXIT_USAGE,
             "badconfig.ckpt: its model config is not valid", setup=_generate_files),
        Case("generate-config-larger-than-its-weights", (*gen, "{work}/inflated.ckpt"),
             EXIT_USAGE, "inflated.ckpt: the weights do not fit its model config",
             setup=_generate_files),
        Case("generate-not-a-dict", (*gen, "{work}/list.ckpt"), EXIT_USAGE,
             "list.ckpt holds no state_dict", setup=_generate_files),
        Case("generate-ckpt-folder-without-checkpoints", (*gen, "{work}"), EXIT_USAGE,
             "is a folder without a complete checkpoint (checkpoints/*.ckpt)"),
        Case("generate-ckpt-is-a-run-dir", (*gen, "{runs}/base", "--max-new-tokens", "5"), 0,
             "", setup=_finished_runs),
        # every bad checkpoint file the fit rows use, through generate too
        Case("generate-ckpt-zero", (*gen, "{work}/zero.ckpt"), EXIT_USAGE,
             "zero.ckpt is not a checkpoint", setup=_bad_checkpoints),
        Case("generate-ckpt-truncated", (*gen, "{work}/truncated.ckpt"), EXIT_USAGE,
             "truncated.ckpt is not a checkpoint (not a torch zip archive: empty, truncated",
             setup=_bad_checkpoints),
        Case("generate-ckpt-damaged", (*gen, "{work}/damaged.ckpt"), EXIT_USAGE,
             "damaged.ckpt is damaged (its record", setup=_bad_checkpoints),
        Case("export-ckpt-damaged", ("export", "--ckpt", "{work}/damaged.ckpt", "-o",
             "{work}/out"), EXIT_USAGE, "damaged.ckpt is damaged", setup=_bad_checkpoints),
        Case("generate-ckpt-pickle", (*gen, "{work}/pickle.ckpt"), EXIT_USAGE,
             "pickle.ckpt holds Python objects besides tensors", setup=_bad_checkpoints),
        Case("generate-ckpt-other-shape", (*gen, "{work}/shape3.ckpt", "--max-new-tokens", "5"),
             0, "", setup=_bad_checkpoints),  # its own config says 3 layers: it loads
        # queue --db that is not a queue database: refused before anything is written to it
        Case("queue-db-yaml-file", add, EXIT_USAGE, "queue.db is not a queue database (not SQLite",
             setup=_db_with(lambda ws: b"trainer:\n  max_steps: 100\n")),
        Case("queue-db-garbage-bytes", add, EXIT_USAGE, untouched,
             setup=_db_with(lambda ws: bytes(range(256)) * 64)),
        Case("queue-db-truncated", add, EXIT_USAGE, "queue.db is damaged",
             setup=_db_with(lambda ws: (d := _queue_db(ws).read_bytes())[: len(d) // 2])),
        Case("queue-db-header-only", add, EXIT_USAGE, "queue.db is damaged",
             setup=_db_with(lambda ws: _queue_db(ws).read_bytes()[:60])),
        Case("queue-db-other-schema", add, EXIT_USAGE,
             "queue.db is a SQLite database but not a nanolab queue (its tables: jobs)",
             setup=_db_with(_other_schema)),
        Case("queue-db-newer-schema", add, EXIT_USAGE, "newer than this nanolab understands",
             setup=_db_with(_newer_schema)),
        Case("queue-db-is-a-folder", ("queue", "ls", "--db", "{work}"), EXIT_USAGE,
             "is a folder; pass --db with a file path"),
        Case("queue-db-dev-null", ("queue", "add", "{cfg}", "--db", os.devnull), EXIT_USAGE,
             "/dev/null is not a regular file"),
        # report: a record of the wrong shape is skipped and counted, the others are reported
        *[
            Case(f"report-{name}", ("report", "{runs}"), 0, "", setup=_run_with_line(line))
            for name, line in (
                ("string-step", '{"event": "train", "step": "7", "loss": 2.0}'),
                ("list-step", '{"event": "val", "step": [1], "val_loss": 2.0}'),
                ("negative-step", '{"event": "train", "step": -1, "loss": 1.0}'),
                ("string-loss", '{"event": "train", "step": 9, "loss": "low"}'),
                ("string-time", '{"event": "train", "step": 2, "time": "yesterday"}'),
                ("no-event", '{"step": 3, "loss": 1.0}'),
                ("nan-seed", '{"event": "start", "step": 0, "seed": NaN}'),
                ("numeric-error", '{"event": "end", "step": 6, "reason": "error", "error": 42}'),
            )
        ],
    ]
    rows += [
        Case("queue-run-slots-absurd",
             ("queue", "run", "--slots", "99999999999999999999", "--db", "{work}/real.db"),
             EXIT_USAGE, "--slots must be between 1 and 1024", setup=_queue_db),
        Case("queue-ls-args-edited-by-hand", ("queue", "ls", "--db", "{work}/real.db"),
             EXIT_USAGE, "job 1 (j) has arguments that are not a JSON list of strings",
             setup=_queue_db_with_damaged_args),
        Case("prepare-into-the-root", ("prepare", "{work}/in.txt", "-o", "/"), EXIT_USAGE,
             "dataset folder / is the file system's root", setup=_users_folder),
        Case("generate-max-new-tokens-absurd", (*model, "--max-new-tokens", "1000000000"),
             EXIT_USAGE, "--max-new-tokens 1,000,000,000 is more than 100,000",
             setup=_generate_files),
        Case("prepare-force-into-a-users-folder",
             ("prepare", "{work}/in.txt", "-o", "{work}/userdir", "--force"), EXIT_USAGE,
             "holds files that are not a dataset's (notes.txt, sub/)", setup=_users_folder),
        Case("eval-label-out-of-range", ("eval", "{runs}/base", "--suite", "{work}/suite.yaml"),
             EXIT_USAGE, "bad.jsonl line 2: field 'label' is 7, out of range for 2 options",
             setup=_bad_suite),
        Case("eval-suite-not-yaml", ("eval", "{runs}/base", "--suite", "{work}/in.txt"),
             EXIT_USAGE, "give a YAML list of tasks", setup=_bad_suite),
        Case("eval-rows-zero", ("eval", "{runs}/base", "--rows", "0"), EXIT_USAGE,
             "--rows must be >= 1", setup=_finished_runs),
        Case("fit-checkpoints-folder-is-a-file", FIT, EXIT_USAGE,
             "checkpoints is not a folder", setup=_checkpoints_replaced_by_a_file),
        Case("fit-config.yaml-is-a-folder", FIT, EXIT_USAGE,
             "config.yaml is a folder where the run keeps a file",
             setup=_config_yaml_replaced_by_a_folder),
        Case("fit-group-null-in-yaml", (*FIT, "--config", "{work}/null_checkpoint.yaml"),
             EXIT_USAGE, "`checkpoint: null` gives the checkpoint group no settings",
             setup=_null_group_yaml),
        Case("fit-lightning-overfit-batches", (*FIT, "--trainer.overfit_batches", "1"),
             EXIT_USAGE, "use --config configs/debug/overfit.yaml"),
        Case("fit-seed-out-of-range", (*FIT, "--seed_everything", "-5"), EXIT_USAGE,
             "seed_everything: -5 is not a seed; give a number from 0 to 4294967295"),
        Case("queue-add-seed-out-of-range",
             ("queue", "add", "{cfg}", "--seeds", "1,99999999999", "--db", "{work}/q.db"),
             EXIT_USAGE, "99999999999 is out of range; seeds go from 0 to 4294967295"),
        Case("fit-key-twice-in-yaml", (*FIT, "--config", "{work}/twice.yaml"), EXIT_USAGE,
             "`trainer` is given twice in one mapping (lines 1 and 4)", setup=_null_group_yaml),
        Case("fit-group-not-a-mapping", (*FIT, "--config", "{work}/number_group.yaml"),
             EXIT_USAGE, "`checkpoint: 5` must be a mapping of settings", setup=_null_group_yaml),
        Case("estimate-model-gpt-not-a-mapping",
             ("estimate", "--config", "{cfg}", "--config", "{work}/list_gpt.yaml"), EXIT_USAGE,
             "`model.gpt: [1, 2]` must be a mapping of settings", setup=_null_group_yaml),
        Case("queue-add-key-twice-in-yaml",
             ("queue", "add", "{cfg}", "{work}/twice.yaml", "--db", "{work}/q.db"), EXIT_USAGE,
             "`trainer` is given twice", setup=_null_group_yaml),
        Case("fit-max_steps-null-in-yaml", (*FIT, "--config", "{work}/null_steps.yaml"),
             EXIT_USAGE, "trainer.max_steps must be a positive number", setup=_null_group_yaml),
        Case("queue-add-group-null-in-yaml",
             ("queue", "add", "{cfg}", "{work}/null_checkpoint.yaml", "--db", "{work}/q.db"),
             EXIT_USAGE,
             "null_checkpoint.yaml: `checkpoint: null`", setup=_null_group_yaml),
        Case("eval-json-into-another-runs-checkpoint",
             ("eval", "{runs}/base", "--limit", "3", "--json",
              "{runs}/shape3/checkpoints/last.ckpt"),
             EXIT_USAGE, "is inside the run directory", setup=_finished_runs),
        Case("report-plot-onto-a-folder", ("report", "{runs}", "--plot", "{work}"), EXIT_USAGE,
             "is not a file name", setup=_finished_runs),
        Case("report-logx-without-a-plot", ("report", "{runs}", "--logx"), EXIT_USAGE,
             "--x and --logx shape the plot only", setup=_finished_runs),
        Case("report-baseline-without-groups", ("report", "{runs}", "--baseline", "zzz"),
             EXIT_USAGE, "a comparison needs two", setup=_finished_runs),
        Case("estimate-gpu-empty", ("estimate", "--config", "{cfg}", "--gpu", ""), EXIT_USAGE,
             "--gpu is empty"),
        Case("fit-run-root-empty", (*FIT, "--run.root", ""), EXIT_USAGE, "run.root is empty"),
        Case("fit-config-empty", ("fit", "--config", ""), EXIT_USAGE, "--config is empty"),
    ]
    if not torch.cuda.is_available():  # a machine without a GPU
        rows += [
            Case("generate-device-cuda-without-gpu", (*model, "--device", "cuda"), EXIT_USAGE,
                 "--device cuda: not usable here", setup=_generate_files),
            Case("queue-run-gpus-without-gpu",
                 ("queue", "run", "--gpus", "0", "--db", "{work}/real.db"), EXIT_USAGE,
                 "--gpus 0: no GPU is visible here", setup=_queue_db),
        ]
    return rows
# fmt: on


FIT = ("fit", "--config", "{cfg}")

# fmt: off
CASES: list[Case] = [
    # -- run names that leave run.root (issue 11, item 4) --
    Case("fit-run.name-dotdot", (*FIT, "--run.name", "../escaped"), EXIT_USAGE, "run.name"),
    Case("fit-run.name-absolute", (*FIT, "--run.name", "{work}/abs"), EXIT_USAGE, "run.name"),
    Case("fit-run.name-empty", (*FIT, "--run.name="), EXIT_USAGE, "run.name"),
    Case("fit-run.name-slash", (*FIT, "--run.name", "a/b"), EXIT_USAGE, "run.name"),
    Case("fit-run.name-dot", (*FIT, "--run.name", "."), EXIT_USAGE, "run.name"),
    # -- foreign checkpoints into an existing run (item 1): refused, base's files untouched --
    Case(
        "fit-run.resume-foreign-into-existing-run",
        (*FIT, "--run.name", "base", "--model.gpt.n_layer=3", "--trainer.max_steps=12",
         "--run.resume", "{runs}/shape3/checkpoints/last.ckpt"),
        EXIT_USAGE, "another run", setup=_finished_runs,
    ),
    Case(
        "fit-ckpt_path-foreign-into-existing-run",
        (*FIT, "--run.name", "base", "--model.gpt.n_layer=3", "--trainer.max_steps=12",
         "--ckpt_path", "{runs}/shape3/checkpoints/last.ckpt"),
        EXIT_USAGE, "another run", setup=_finished_runs,
    ),
    Case(
        "validate-writes-nothing-into-the-run",  # it used to rewrite the run's config.yaml
        ("validate", "--config", "{cfg}", "--run.name", "base", "--model.gpt.dropout=0.1",
         "--ckpt_path", "{runs}/base/checkpoints/last.ckpt"),
        0, "", setup=_finished_runs,
    ),
    Case(  # a resume reads <run_dir>/checkpoints only: elsewhere a restart rotated them away
        "fit-checkpoint-dirpath-elsewhere", (*FIT, "--checkpoint.dirpath", "{work}/ck"),
        EXIT_USAGE, "checkpoint.dirpath",
    ),
    # -- config values (item 8) --
    Case("fit-max_steps-negative", (*FIT, "--trainer.max_steps=-5"), EXIT_USAGE, "trainer.max_steps"),
    Case("fit-max_steps-zero", (*FIT, "--trainer.max_steps=0"), EXIT_USAGE, "trainer.max_steps"),
    Case("fit-lr-nan", (*FIT, "--model.optimizer.lr=.nan"), EXIT_USAGE, "model.optimizer.lr"),
    Case(
        "fit-lr-nan-in-yaml", (*FIT, "--config", "{work}/nan_lr.yaml"), EXIT_USAGE,
        "model.optimizer.lr", setup=_nan_lr_yaml,
    ),
    Case("fit-lr-inf", (*FIT, "--model.optimizer.lr=.inf"), EXIT_USAGE, "model.optimizer.lr"),
    # Python's spellings, text to YAML: the setting's own rule, not "expected float"
    Case("fit-lr-nan-word", (*FIT, "--model.optimizer.lr=nan"), EXIT_USAGE, "model.optimizer.lr must be a finite number > 0"),
    Case("fit-lr-inf-word", (*FIT, "--model.optimizer.lr", "inf"), EXIT_USAGE, "model.optimizer.lr must be a finite number > 0"),
    Case("fit-lr-1e400", (*FIT, "--model.optimizer.lr=1e400"), EXIT_USAGE, "model.optimizer.lr"),
    Case("fit-lr-zero", (*FIT, "--model.optimizer.lr=0"), EXIT_USAGE, "model.optimizer.lr"),
    Case(
        "queue-add-lr-nan",
        ("queue", "add", "{cfg}", "--set", "model.optimizer.lr=.nan", "--db", "{work}/q.db"),
        EXIT_USAGE, "model.optimizer.lr",
    ),
    Case(
        "queue-add-lr-inf",
        ("queue", "add", "{cfg}", "--set", "model.optimizer.lr=1e400", "--db", "{work}/q.db"),
        EXIT_USAGE, "model.optimizer.lr",
    ),
    Case(
        "fit-empty-config-file", (*FIT, "--config", "{work}/empty.yaml"), EXIT_USAGE,
        "empty.yaml", setup=_empty_config,
    ),
    Case(
        "fit-yaml-syntax-error", ("fit", "--config", "{work}/broken.yaml"), EXIT_USAGE,
        "broken.yaml", setup=_broken_yaml,
    ),
    Case(
        "fit-block_size-zero", (*FIT, "--model.gpt.block_size=0"), EXIT_USAGE,
        "model.gpt.block_size",
    ),
    Case(
        "fit-model-larger-than-cpu-memory",
        (*FIT, "--trainer.accelerator=cpu", "--model.gpt.n_layer=4000",
         "--model.gpt.n_embd=1024", "--model.gpt.n_head=8"),
        EXIT_USAGE, "memory", memory_limit_gb=8,
    ),
    Case(
        "fit-dataset-mismatch-names-real-fixes",
        (*FIT, "--data.dataset_dir", "{work}/mydata", "--data.source", "[{work}/other.txt]"),
        EXIT_USAGE, "--data.source null", setup=_mismatched_dataset,
    ),
    *_data_rows(),
    *_checkpoint_rows(),
    *_tool_rows(),
]
# fmt: on


# -- running a row -----------------------------------------------------------------------------
def _digests(root: Path) -> dict[str, str]:
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            out[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _limit_memory(gb: float) -> Callable[[], None]:
    limit = int(gb * 2**30)

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return apply


def _here(ws: Workspace, *argv: str) -> subprocess.CompletedProcess:
    """``nanolab ARGV`` (placeholders filled) in this process, from ``ws.work``."""
    return nanolab_here(*(a.format(**ws.fields()) for a in argv), cwd=ws.work)


def run_case(case: Case, ws: Workspace) -> subprocess.CompletedProcess:
    """Run the row's command in ``ws.work`` (its setup has been applied)."""
    argv = [a.format(**ws.fields()) for a in case.argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "nanolab", *argv],
        cwd=ws.work,
        env=env,
        capture_output=True,
        text=True,
        timeout=case.timeout,
        preexec_fn=_limit_memory(case.memory_limit_gb) if case.memory_limit_gb else None,
    )


def last_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


@pytest.fixture(scope="module")
def cache(tmp_path_factory, char_dataset) -> RunCache:
    """Finished runs the rows copy from: ``base`` (2 layers) and ``shape3`` (3 layers)."""
    return RunCache(tmp_path_factory.mktemp("adversarial-cache"), char_dataset)


@pytest.fixture
def ws(tmp_path, char_dataset, cache) -> Workspace:
    work = tmp_path / "work"
    work.mkdir()
    cfg = write_config(work / "tiny.yaml", tiny_overrides(char_dataset, work / "runs"))
    return Workspace(work=work, data=char_dataset, cfg=cfg, cache=cache)


# Rows that stay in the default run whatever their position: the guarantees a night depends on.
DEFAULT_ROWS = {"fit-ckpt_path-foreign-into-existing-run"}

#: Verbs whose process imports Lightning (8-25 s a row on 2 cores) keep one row in the default
#: run. Each of their second rows left to ``-m slow`` has a default sibling on its code path:
#: fit-run.name-dotdot: test_resolve's ``run.name '../x'`` row (the check) and the fit row above
#: (fit's one line); validate-ckpt_path-zero: test-ckpt_path-zero (the parser checks
#: --ckpt_path for both verbs, the same way); test-ckpt_path-truncated: test-ckpt_path-zero (the
#: same branch; its wording in-process: test_resume_units' torn.ckpt); queue-add-lr-inf:
#: queue-add-lr-nan (one finiteness check of model.optimizer.lr).
ONE_ROW_VERBS = {"fit": 1, "validate": 1, "test": 1, "queue": 1}


def _params(cases: list[Case], per_verb: int = 2) -> list:
    """``per_verb`` rows of each verb (``fit``, ``generate``, ``report``, ...; one of those in
    :data:`ONE_ROW_VERBS`) run in the default suite — the :data:`DEFAULT_ROWS` first, then the
    verb's first rows; the rest are marked ``slow`` (``pytest -m slow`` runs them all). Each row
    is a process (6-30 s on 2 cores where it imports Lightning), and the default suite must stay
    well under 15 minutes there; the in-process one-line-error tests of each verb cover the
    other kinds in the default run."""
    taken: dict[str, int] = {}
    for case in cases:
        if case.id in DEFAULT_ROWS:
            verb = case.id.split("-")[0]
            taken[verb] = taken.get(verb, 0) + 1
    params = []
    for case in cases:
        verb = case.id.split("-")[0]
        limit = ONE_ROW_VERBS.get(verb, per_verb)
        default = case.id in DEFAULT_ROWS or taken.get(verb, 0) < limit
        if default and case.id not in DEFAULT_ROWS:
            taken[verb] = taken.get(verb, 0) + 1
        marks = [] if default else [pytest.mark.slow]
        params.append(pytest.param(case, id=case.id, marks=marks))
    return params


@pytest.mark.parametrize("case", _params(CASES))
def test_hostile_input(case: Case, ws: Workspace) -> None:
    if case.setup is not None:
        case.setup(ws)
    before = _digests(ws.work)
    res = run_case(case, ws)
    detail = f"exit {res.returncode}; stderr tail:\n{res.stderr[-2500:]}"
    assert res.returncode == case.code, detail
    assert "Traceback" not in res.stderr, detail
    if case.stderr:
        assert case.stderr in last_line(res.stderr), detail
    after = _digests(ws.work)
    lost = sorted(k for k, v in before.items() if after.get(k) != v)
    assert not lost, f"files changed or removed: {lost}\n{detail}"
    assert not (ws.work / "pwned").exists(), "a checkpoint's pickle ran code"


def test_case_ids_are_unique() -> None:
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))


# -- sequences: more than one process, signals, the clock ---------------------------------------
def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _launch(ws: Workspace, *args: str) -> subprocess.Popen:
    """``nanolab fit`` in the background, stderr to a file (read with :func:`_err`)."""
    err = (ws.work / f"stderr-{time.monotonic_ns()}.txt").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "nanolab", "fit", "--config", str(ws.cfg), *args],
        cwd=ws.work,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=err,
        text=True,
    )
    proc.err_path = Path(err.name)  # type: ignore[attr-defined]
    return proc


def _err(proc: subprocess.Popen) -> str:
    return proc.err_path.read_text()  # type: ignore[attr-defined]


def _wait_for(predicate: Callable[[], bool], what: str, proc: subprocess.Popen, timeout=180.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"exited ({proc.returncode}) before {what}:\n{_err(proc)}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _records(run_dir: Path, event: str | None = None) -> list[dict]:
    return read_records(run_dir / "metrics.jsonl", event)


def _live_run(ws: Workspace, name: str) -> subprocess.Popen:
    """A run that trains for minutes (saving every 5 steps), once it has logged a step."""
    proc = _launch(
        ws, "--run.name", name, "--trainer.max_steps=100000", "--checkpoint.every_n_steps=5"
    )
    run_dir = ws.runs / name
    _wait_for(lambda: any((run_dir / "checkpoints").glob("step-*.ckpt")), "a checkpoint", proc)
    return proc


def _stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=120)


@pytest.mark.slow  # a row of a kind the default run covers (the suite's time)
def test_second_launch_is_refused_naming_the_holder_and_a_dead_holder_is_taken_over(ws):
    """Item 3: one launch per run directory; exit 2 naming the holder; SIGKILL frees it."""
    run_dir = ws.runs / "dup"
    first = _live_run(ws, "dup")
    try:  # the later launches run in this process: another process than the holder's
        second = _here(ws, *FIT, "--run.name", "dup")
        line = last_line(second.stderr)
        assert second.returncode == EXIT_USAGE, second.stderr[-2000:]
        assert "Traceback" not in second.stderr
        assert f"in use by pid {first.pid} on {socket.gethostname()}" in line, line
        assert first.poll() is None  # the holder trains on, undisturbed
        assert len(_records(run_dir, "start")) == 1
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    # The holder died without cleaning up: its lock file is still there, its lock is not.
    assert (run_dir / ".nanolab.lock").exists()
    saved = max(int(p.stem.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*.ckpt"))
    third = _here(ws, *FIT, "--run.name", "dup", f"--trainer.max_steps={saved + 2}")
    assert third.returncode == 0, third.stderr[-3000:]
    starts = _records(run_dir, "start")
    assert len(starts) == 2 and starts[1]["resumed_from_step"] == saved
    assert _records(run_dir)[-1]["event"] == "end"
    assert not (run_dir / ".nanolab.lock").exists()  # released on exit


@pytest.mark.slow
def test_fresh_start_while_the_run_is_live_is_refused(ws):
    """Item 2: run.fresh would archive the live run's files under it; the lock refuses it."""
    run_dir = ws.runs / "live"
    proc = _live_run(ws, "live")
    try:
        res = run_case(Case("fresh", (*FIT, "--run.name", "live", "--run.fresh=true"), 2, ""), ws)
        assert res.returncode == EXIT_USAGE, res.stderr[-2000:]
        assert f"in use by pid {proc.pid}" in last_line(res.stderr)
        assert not (run_dir / "previous").exists()
        assert (run_dir / "metrics.jsonl").exists() and proc.poll() is None
    finally:
        code = _stop(proc)
    assert code == EXIT_PREEMPTED, _err(proc)[-2000:]
    ends = _records(run_dir, "end")
    assert [e["reason"] for e in ends] == ["preempted"]
    assert len(_records(run_dir, "start")) == 1


@pytest.mark.slow
def test_foreign_checkpoint_starts_a_new_run_with_its_own_id(ws):
    """Item 1, the allowed half: fine-tuning from another run's checkpoint in a new directory."""
    _finished_runs(ws)
    before = _digests(ws.runs)
    args = ("--run.name", "ft", "--model.gpt.n_layer=3", "--trainer.max_steps=8")
    resume = ("--ckpt_path", "{runs}/shape3/checkpoints/last.ckpt")
    res = run_case(Case("finetune", (*FIT, *args, *resume), 0, ""), ws)
    assert res.returncode == 0, res.stderr[-3000:]
    after = _digests(ws.runs)
    assert all(after.get(k) == v for k, v in before.items())  # the parent run is untouched
    parent = _records(ws.runs / "shape3", "start")[0]
    start = _records(ws.runs / "ft", "start")[0]
    assert start["run_id"] != parent["run_id"]
    assert start["resumed_from"].endswith("shape3/checkpoints/last.ckpt")
    assert _records(ws.runs / "ft", "end")[-1]["step"] == 8


@pytest.mark.slow  # 30-100 s on 2 cores; `pytest -m slow`
def test_sigterm_during_start_up_exits_75_with_an_end_record(ws):
    """Item 6: a signal right after config.yaml appears (before the handlers existed)."""
    run_dir = ws.runs / "early"
    args = ("--run.name", "early", "--trainer.max_steps=30")
    proc = _launch(ws, *args)
    _wait_for(lambda: (run_dir / "config.yaml").exists(), "config.yaml", proc)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=120)
    err = _err(proc)
    assert code == EXIT_PREEMPTED, err[-3000:]
    assert "Traceback" not in err
    records = _records(run_dir)
    assert records[-1]["event"] == "end" and records[-1]["reason"] == "preempted"
    if not [r for r in records if r["event"] == "train"]:
        assert "before the first step" in records[-1]["detail"]
        assert "before the first step" in err
    # The requeue loop of the README reruns it; the rerun trains.
    again = run_case(Case("again", (*FIT, *args), 0, ""), ws)
    assert again.returncode == 0, again.stderr[-3000:]


@pytest.mark.slow
def test_sigterm_while_loading_exits_75_before_the_first_step(ws):
    """Item 6, earlier still: during imports and parsing, long before the Trainer exists."""
    proc = _launch(ws, "--run.name", "parse")
    time.sleep(0.3)  # nanolab's entry point has run; Lightning is still importing
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=120)
    err = _err(proc)
    assert code == EXIT_PREEMPTED, err[-3000:]
    assert "before the first step" in last_line(err) and "Traceback" not in err
    assert not (ws.runs / "parse" / "checkpoints").exists()


@pytest.mark.slow
def test_clock_starts_when_nanolab_starts_not_the_exec_ing_shell(ws):
    """Item 7: ``sh -c 'sleep S && exec nanolab fit'`` must not bill the S seconds."""
    pause = 4.0
    cmd = (
        f"sleep {pause} && exec {shlex.quote(sys.executable)} -m nanolab fit "
        f"--config {shlex.quote(str(ws.cfg))} --run.name clock"
    )
    launched = time.time()
    res = subprocess.run(
        ["sh", "-c", cmd], cwd=ws.work, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    end = _records(ws.runs / "clock", "end")[-1]
    # nanolab started after the sleep, so at most (end record's time - launch - sleep) passed.
    since_nanolab_could_start = end["time"] - (launched + pause)
    assert end["elapsed_s"] <= since_nanolab_could_start + 0.25, (end, launched)
    assert end["elapsed_s"] > 0.5  # imports and start-up are still the run's time


def _diverging_config(ws: Workspace) -> Path:
    cfg = tiny_overrides(ws.data, ws.runs, trainer__max_steps=40, run__name="div")
    cfg["model"]["optimizer"] = {"lr": 1.0e4}
    cfg["model"]["schedule"] = {"warmup_steps": 0}
    cfg["checkpoint"] = {"every_n_steps": 1, "keep_last": 2}
    return write_config(ws.work / "div.yaml", cfg)


@pytest.mark.slow  # a row of a kind the default run covers (the suite's time)
def test_divergence_stops_the_run_keeps_finite_checkpoints_and_is_reported(ws):
    """Item 5: NaN loss -> stopped after K steps, exit 3, end reason diverged, report says so."""
    cfg = _diverging_config(ws)
    res = run_nanolab("fit", "--config", str(cfg), cwd=ws.work)
    run_dir = ws.runs / "div"
    assert res.returncode == EXIT_DIVERGED, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "diverged" in last_line(res.stderr)
    train = _records(run_dir, "train")
    end = _records(run_dir, "end")[-1]
    assert end["reason"] == "diverged"
    bad = [r["step"] for r in train if r["loss"] is None or r["grad_norm"] is None]
    assert bad and end["diverged_step"] == bad[0]
    # Patience 3: stopped at the third bad step in a row (one more where the flag is read late).
    assert end["step"] - end["diverged_step"] in (2, 3) and end["step"] < 40
    # A checkpoint every step, yet every one on disk is finite and last.ckpt is the newest.
    files = sorted((run_dir / "checkpoints").glob("step-*.ckpt"))
    assert files and int(files[-1].stem.split("-")[1]) < end["step"]
    for path in files:
        state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
        assert all(torch.isfinite(t).all() for t in state.values()), path.name
    assert (run_dir / "checkpoints" / "last.ckpt").samefile(files[-1])
    report = run_nanolab("report", str(ws.runs), "--json", cwd=ws.work)
    assert report.returncode == 0, report.stderr
    (row,) = [r for r in json.loads(report.stdout)["runs"] if r["run"] == "div"]
    assert row["status"] == "diverged"


@pytest.mark.slow
def test_queue_marks_a_diverged_job_failed_and_moves_on(ws):
    """Item 5: the queue reads exit 3 / reason diverged as failed, then runs the next job; the
    runner exits 1 as a job it ran failed (docs/queue.md: `queue run && notify-send done`)."""
    cfg = _diverging_config(ws)
    db = ws.work / "q.db"
    ok = ("--name", "ok", "--set", "model.optimizer.lr=1e-3", "--set", "trainer.max_steps=3")
    for args in (("--name", "div"), ok):
        res = run_nanolab("queue", "add", str(cfg), "--db", str(db), *args, cwd=ws.work)
        assert res.returncode == 0, res.stderr
    res = run_nanolab("queue", "run", "--db", str(db), cwd=ws.work, timeout=600)
    assert res.returncode == EXIT_JOB_FAILED, res.stderr[-3000:]
    jobs = {j.name: j for j in QueueDB(db).jobs()}
    assert jobs["div"].status == "failed" and jobs["div"].detail.startswith("diverged at step")
    assert jobs["ok"].status == "done"


HOLD_LOCK = """
import fcntl, json, sys, time
path = sys.argv[1]
fd = open(path, "w")
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
fd.write(json.dumps({"host": "old-node", "pid": 4242, "started": "earlier",
                     "slurm_job_id": "777", "slurm_restart_count": "0", "token": "x"}))
fd.flush()
print("held", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_slurm_requeue_takes_over_a_lock_that_still_looks_held(ws):
    """Item 3: the requeued job (same SLURM job id, next restart) takes the run directory over
    even while the old allocation's lock has not expired; any other launch is refused."""
    run_dir = ws.runs / "tiny"
    run_dir.mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(run_dir / ".nanolab.lock")],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        other = run_case(Case("other", FIT, 2, ""), ws)
        assert other.returncode == EXIT_USAGE, other.stderr[-2000:]
        assert "in use by pid 4242 on old-node" in last_line(other.stderr)
        env = {**_env(), "SLURM_JOB_ID": "777", "SLURM_RESTART_COUNT": "1"}
        requeued = subprocess.run(
            [sys.executable, "-m", "nanolab", "fit", "--config", str(ws.cfg)],
            cwd=ws.work, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert requeued.returncode == 0, requeued.stderr[-3000:]
        assert _records(run_dir, "end")[-1]["reason"] == "completed"
    finally:
        holder.kill()
        holder.wait(timeout=60)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_divergence_on_cuda_reads_the_flag_without_a_sync(ws):
    """Item 5 on a GPU: the flag travels through pinned memory one step late; same outcome."""
    cfg = _diverging_config(ws)
    res = run_nanolab("fit", "--config", str(cfg), "--trainer.accelerator=gpu", cwd=ws.work)
    assert res.returncode == EXIT_DIVERGED, res.stderr[-3000:]
    end = _records(ws.runs / "div", "end")[-1]
    assert end["reason"] == "diverged"
    assert end["step"] - end["diverged_step"] in (2, 3)


def test_run_log_deleted_mid_run_is_recreated_and_the_run_says_so(
    tmp_path: Path, char_dataset: Path
) -> None:
    """`rm runs/x/metrics.jsonl` while the run trains (a callback of the run's own config does
    it at step 3): the run ends with a log at its path holding the rest of the run, from a
    `log_recreated` record to the `end` record, and one warning."""
    (tmp_path / "deleter.py").write_text(
        "import os\nfrom lightning.pytorch import Callback\n\n"
        "class DeleteLog(Callback):\n"
        "    def on_train_batch_end(self, trainer, *args):\n"
        "        path = os.path.join(trainer.default_root_dir, 'metrics.jsonl')\n"
        "        if trainer.global_step == 3 and os.path.exists(path):\n"
        "            os.unlink(path)\n"
    )
    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=6)
    cfg["trainer"]["callbacks"] = [{"class_path": "deleter.DeleteLog"}]
    path = write_config(tmp_path / "c.yaml", cfg)
    sys.path.insert(0, str(tmp_path))  # the deleter importable from this process
    try:
        res = nanolab_here("fit", "--config", str(path), cwd=tmp_path)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("deleter", None)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stderr.count("was deleted or replaced while this run wrote it") == 1
    events = [r["event"] for r in read_records(tmp_path / "runs" / "tiny" / "metrics.jsonl")]
    assert events[0] == "log_recreated" and events[-1] == "end" and "train" in events
