"""``nanolab status``: running, stalled, ended and queued on one screen, from files only."""

from __future__ import annotations

import hashlib
import itertools
import json
import time
from pathlib import Path

import pytest
from conftest import hold_like_a_live_launch

from nanolab.queue.db import NewJob, QueueDB
from nanolab.queue.status import main


def write_log(run: Path, records: list[dict]) -> None:
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if not any(r.get("event") == "end" for r in records):
        hold_like_a_live_launch(run)  # its launch still holds the run (or was killed)


def training(name: str, last_time: float, steps: int, end: dict | None = None) -> list[dict]:
    """A run of ``max_steps`` 100 at 0.5 s a step whose last line was written at ``last_time``."""
    start = {"event": "start", "time": last_time - steps, "step": 0, "run_name": name,
             "config": {"trainer": {"max_steps": 100}}}  # fmt: skip
    train = [
        {"event": "train", "time": last_time - (steps - i) * 0.5, "step": i, "loss": 3.0 - i / 100,
         "tokens": 1000 * i, "tokens_per_s": 2000.0, "step_time_s": 0.5,
         "mem_allocated_bytes": 3 * 2**30, "gpu_util": 87.0}
        for i in range(1, steps + 1)
    ]  # fmt: skip
    val = [{"event": "val", "time": last_time, "step": steps, "tokens": 1000 * steps,
            "val_loss": 2.5}]  # fmt: skip
    return [start, *train, *val, *([end] if end else [])]


def test_one_screen_of_runs_and_queue(tmp_path: Path, capsys) -> None:
    now = time.time()
    runs = tmp_path / "runs"
    write_log(runs / "live", training("live", now - 2, 40))
    write_log(runs / "hung", training("hung", now - 300, 10))  # 5 min silent, 0.5 s steps
    done = {"event": "end", "time": now - 100, "step": 100, "reason": "completed",
            "elapsed_s": 61.0}  # fmt: skip
    write_log(runs / "old", training("old", now - 100, 100, done))
    db = tmp_path / "q.db"
    queue = QueueDB(db)
    queue.add_jobs([
        NewJob(name=n, config="c.yaml", args=[], seed=None, cwd=str(tmp_path),
               run_dir=str(runs / n), estimate_s=s, max_steps=100)
        for n, s in (("next", 600.0), ("after", 300.0))
    ])  # fmt: skip
    queue.conn.close()
    before = hashlib.sha256(db.read_bytes()).hexdigest()

    assert main([str(runs), "--db", str(db), "--json"]) == 0
    screen = json.loads(capsys.readouterr().out)
    live, hung = sorted(screen["running"], key=lambda r: r["run"])[::-1]
    assert (live["run"], live["step"], live["max_steps"]) == ("live", 40, 100)
    assert live["eta_s"] == 30.0 and not live["stalled"]  # 60 steps x 0.5 s
    assert hung["run"] == "hung" and hung["stalled"]
    (old,) = screen["ended"]
    assert old["status"] == "completed" and old["best_val_loss"] == 2.5 and old["wall_s"] == 61.0
    nxt, after = screen["queued"]
    assert (nxt["name"], nxt["start_in_s"], nxt["end_in_s"]) == ("next", 0.0, 600.0)
    assert (after["start_in_s"], after["end_in_s"]) == (600.0, 900.0)
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before  # read only
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.db", "runs"]  # no -shm/-wal left
    runner = QueueDB(db)  # a live writer: read through its WAL, which holds the new job
    runner.add_jobs([NewJob(name="late", config="c.yaml", args=[], seed=None, cwd=str(tmp_path),
                            run_dir=str(runs / "late"), estimate_s=60.0, max_steps=100)])  # fmt: skip
    assert main([str(runs), "--db", str(db), "--json"]) == 0
    assert [j["name"] for j in json.loads(capsys.readouterr().out)["queued"]][-1] == "late"
    runner.conn.close()

    assert main([str(runs), "--db", str(db)]) == 0
    text = capsys.readouterr().out
    assert "live" in text and "40/100 (40%)" in text and "3.0G" in text and "87%" in text
    assert "STALLED" in text and "in 10m00s" in text


def test_a_run_planned_by_its_token_budget_has_progress_and_an_eta(tmp_path: Path, capsys):
    """``trainer.max_steps: -1`` with ``budget.max_tokens``: the step it trains to is its start
    record's ``planned_steps`` (as report's forecast reads it); the config's -1 showed no ETA."""
    now = time.time()
    runs = tmp_path / "runs"
    budget = {"trainer": {"max_steps": -1}, "budget": {"max_tokens": 100_000}}
    records = training("budget", now - 2, 40)
    records[0] = {**records[0], "config": budget, "planned_steps": 100}
    write_log(runs / "budget", records)
    unbounded = training("open", now - 2, 40)  # nothing bounds it: no ETA, said as such
    unbounded[0] = {**unbounded[0], "config": {"trainer": {"max_steps": -1}}, "planned_steps": None}
    write_log(runs / "open", unbounded)
    assert main([str(runs), "--json"]) == 0
    lines = {r["run"]: r for r in json.loads(capsys.readouterr().out)["running"]}
    assert (lines["budget"]["max_steps"], lines["budget"]["eta_s"]) == (100, 30.0)
    assert (lines["open"]["max_steps"], lines["open"]["eta_s"]) == (None, None)
    assert main([str(runs)]) == 0
    assert "40/100 (40%)" in capsys.readouterr().out


def test_a_run_a_budget_stops_before_max_steps_counts_to_where_it_stops(tmp_path, capsys):
    """``trainer.max_steps`` 3000 and a budget that stops the run at step 100: status counted
    to 3000 (``40/3000 (1%)``, an ETA for 2,960 steps) from ``planned_steps``, the LR plan's
    end. It counts to the start record's ``expected_end``; a time limit's end is an estimate,
    shown ``~``; a log from before the field keeps ``planned_steps``."""
    now = time.time()
    runs = tmp_path / "runs"
    config = {"trainer": {"max_steps": 3000}, "budget": {"max_tokens": 100_000}}
    for name, end in (
        ("tokens", {"step": 100, "by": "budget.max_tokens", "estimated": False}),
        ("hours", {"step": 100, "by": "budget.max_wall_hours", "estimated": True}),
    ):
        records = training(name, now - 2, 40)
        records[0] = {**records[0], "config": config, "planned_steps": 3000, "expected_end": end}
        write_log(runs / name, records)
    old = training("old", now - 2, 40)
    old[0] = {**old[0], "config": config, "planned_steps": 3000}
    write_log(runs / "old", old)
    assert main([str(runs), "--json"]) == 0
    lines = {r["run"]: r for r in json.loads(capsys.readouterr().out)["running"]}
    assert (lines["tokens"]["max_steps"], lines["tokens"]["eta_s"]) == (100, 30.0)
    assert (lines["hours"]["max_steps"], lines["hours"]["end_estimated"]) == (100, True)
    assert lines["old"]["max_steps"] == 3000
    assert main([str(runs)]) == 0
    text = capsys.readouterr().out
    assert "40/100 (40%)" in text and "40/~100 (40%)" in text and "40/3000 (1%)" in text


def test_a_time_budget_runs_end_and_eta_follow_its_measured_pace(tmp_path, capsys):
    """A run of ``budget.max_wall_hours`` 0.008 (28.8 s): status counted to the start record's
    plan-time guess (step ~8198) for good: 16 s in it said ``1279/~8198 (16%) ... ETA 1m12s``,
    and the run stopped 12 s later at step 2681. It re-estimates by the budget's rule from what
    the run has spent and its measured pace; the ETA never passes the limit's deadline."""
    now = time.time()
    config = {"trainer": {"max_steps": 100_000}, "budget": {"max_wall_hours": 0.008}}
    start = {"event": "start", "time": now - 20, "step": 0, "run_name": "wall", "config": config,
             "planned_steps": 100_000, "global_batch_tokens": 128, "world_size": 1,
             "expected_end": {"step": 8198, "by": "budget.max_wall_hours", "estimated": True}}  # fmt: skip
    train = [
        {"event": "train", "time": now - (1279 - i) * 0.0125, "step": i, "loss": 3.0,
         "tokens": 128 * i, "run_tokens": 128 * i, "tokens_per_s": 10_000.0,
         "step_time_s": 0.004, "elapsed_s": round(4 + i * 0.0125, 4)}
        for i in range(1220, 1280)
    ]  # fmt: skip
    write_log(tmp_path / "runs" / "wall", [start, *train])
    assert main([str(tmp_path / "runs"), "--json"]) == 0
    line = json.loads(capsys.readouterr().out)["running"][0]
    left = 28.8 - (4 + 1279 * 0.0125)  # seconds of the limit the run has left
    assert line["end_estimated"] and abs(line["max_steps"] - (1279 + left / 0.0125)) <= 2, line
    assert 0 < line["eta_s"] <= left, line
    assert main([str(tmp_path / "runs")]) == 0
    assert f"1279/~{line['max_steps']} " in capsys.readouterr().out


def test_nothing_to_show_is_one_line(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main([]) == 2  # no runs/ and no queue
    err = capsys.readouterr().err
    # Run from another folder, it names the folders it looked in and how to point it elsewhere.
    assert err.count("\n") == 1 and f"no runs under {tmp_path / 'runs'} (no metrics.jsonl)" in err
    assert f"no queue database {tmp_path / 'nanolab_queue.db'}; " in err, err
    assert "nanolab status PROJECT/runs --db PROJECT/nanolab_queue.db" in err, err
    assert main(["--watch", "0"]) == 2


def test_a_named_folder_that_does_not_exist_is_one_line_beside_a_queue(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """``status NOPE`` with a queue database there showed an empty screen, exit 0, as if NOPE
    held no runs; a folder named on the command line that does not exist is said, as report
    says it. Without one, the default runs/ may be missing: the queue is shown; so may the
    folder the queued jobs will make their runs in."""
    monkeypatch.chdir(tmp_path)
    later = tmp_path / "later" / "a"
    QueueDB(tmp_path / "nanolab_queue.db").add_jobs(
        [NewJob(name="a", config="c.yaml", args=[], seed=None, cwd="/", run_dir=str(later))]
    )
    for argv in (["NOPE"], ["NOPE", "--json"]):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and err == (
            "nanolab status: error: NOPE does not exist; pass the folder that holds your runs\n"
        )
    assert main([]) == 0 and "queued (1" in capsys.readouterr().out
    assert main(["later"]) == 0 and "queued (1" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("named", "run_dir"),
    [("runs/pend", "runs/pend"), ("out/deep/pend", "out/deep/pend"), ("out", "out/deep/pend")],
)
def test_a_waiting_jobs_own_run_dir_may_be_named_before_it_exists(
    tmp_path: Path, capsys, monkeypatch, named: str, run_dir: str
) -> None:
    """``status runs/pend``, the run directory of a job still pending, was "does not exist;
    pass the folder that holds your runs", exit 2: only the folders holding the jobs' run
    directories were taken. The job's own, and every folder above it, show the queue."""
    monkeypatch.chdir(tmp_path)
    QueueDB(tmp_path / "nanolab_queue.db").add_jobs(
        [
            NewJob(
                name="pend",
                config="c.yaml",
                args=[],
                seed=None,
                cwd="/",
                run_dir=str(tmp_path / run_dir),
            )
        ]
    )
    assert not (tmp_path / named).exists()
    assert main([named]) == 0, capsys.readouterr().err
    assert "queued (1" in capsys.readouterr().out
    assert main([f"{named}x"]) == 2  # a typo is still said
    assert "does not exist" in capsys.readouterr().err


def test_a_queue_job_starting_before_its_run_logs_is_shown_as_starting(tmp_path: Path, capsys):
    """The runner marks a job running before its fit has logged a start (imports, preparing
    its data on first use); status lists it as ``starting`` instead of nowhere, and under
    running once its run logs."""
    now = time.time()
    runs, db = tmp_path / "runs", tmp_path / "q.db"
    queue = QueueDB(db)
    queue.add_jobs([NewJob(name="warming", config="c.yaml", args=[], seed=None,
                           cwd=str(tmp_path), run_dir=str(runs / "warming"), estimate_s=60.0,
                           max_steps=100)])  # fmt: skip
    (job,) = queue.jobs()
    assert queue.claim(job.id, queue.register_runner(), None, now)  # a live runner: this process
    queue.conn.close()
    runs.mkdir()
    assert main([str(runs), "--db", str(db), "--json"]) == 0
    screen = json.loads(capsys.readouterr().out)
    assert screen["running"] == [] and [(j["name"], j["status"]) for j in screen["queued"]] == [
        ("warming", "starting")
    ]
    write_log(runs / "warming", training("warming", now - 2, 5))
    assert main([str(runs), "--db", str(db), "--json"]) == 0
    screen = json.loads(capsys.readouterr().out)
    assert [r["run"] for r in screen["running"]] == ["warming"] and screen["queued"] == []


def test_a_preempted_job_waiting_to_resume_is_listed_once_under_queued(
    tmp_path: Path, capsys
) -> None:
    """A run preempted at step 30 whose job waits to resume was listed under queued and under
    ended; it is one run, shown once where its job's status says what comes next."""
    now = time.time()
    runs, db = tmp_path / "runs", tmp_path / "q.db"
    stop = {"event": "end", "time": now - 50, "step": 30, "reason": "preempted", "elapsed_s": 86.0}
    write_log(runs / "resumes", training("resumes", now - 50, 30, stop))
    write_log(runs / "done", training("done", now - 100, 100, {**stop, "reason": "completed"}))
    queue = QueueDB(db)
    (job,) = queue.add_jobs([NewJob(name="resumes", config="c.yaml", args=[], seed=None,
                                    cwd=str(tmp_path), run_dir="runs/resumes", estimate_s=60.0,
                                    max_steps=100)])  # fmt: skip
    assert queue.set_status(job.id, "preempted")
    queue.conn.close()
    assert main([str(runs), "--db", str(db), "--json"]) == 0
    screen = json.loads(capsys.readouterr().out)
    assert [(j["run"], j["status"], j["ran_s"]) for j in screen["queued"]] == [
        ("resumes", "preempted", 86.0)
    ]
    assert [r["run"] for r in screen["ended"]] == ["done"]
    assert main([str(runs), "--db", str(db)]) == 0
    assert "ended (1)" in capsys.readouterr().out


def test_an_ended_runs_long_error_line_is_shown_whole() -> None:
    """An ended run's last line was cut at 50 characters in its row, hiding the fix of an error
    line ("budget.max_wall_hours must be > 0 (or null"). A longer one is now printed whole
    under the table; a short one stays in the row."""
    from nanolab.queue.status import RunLine, Screen, render

    fix = "nanolab fit: error: budget.max_wall_hours must be > 0 (or null for no limit), got 0"
    screen = Screen(
        time=0.0,
        ended=[
            RunLine(run="long", status="failed", step=3, detail=f"traceback...\n{fix}"),
            RunLine(run="short", status="stopped", step=9, detail="budget: tokens"),
        ],
    )
    text = render(screen, [])
    assert f"  long: {fix}" in text.splitlines()
    assert "failed (below)" in text and "stopped: budget: tokens" in text


def test_a_db_that_is_a_folder_or_a_fifo_is_named_as_such(tmp_path: Path, capsys) -> None:
    """``--db adir`` and ``--db fifo`` were "no such queue database file": they exist, and the
    line now says what they are, in the words ``queue add --db`` uses."""
    import os

    (tmp_path / "adir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    assert main([str(tmp_path), "--db", str(tmp_path / "adir")]) == 2
    assert main([str(tmp_path), "--db", str(tmp_path / "fifo")]) == 2
    assert main([str(tmp_path), "--db", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"nanolab status: error: the queue database {tmp_path}/adir is a folder; pass --db with "
        f"a file path, e.g. --db {tmp_path}/adir/nanolab_queue.db",
        f"nanolab status: error: the queue database {tmp_path}/fifo is not a regular file; pass "
        "--db with a file path, e.g. --db nanolab_queue.db",
        f"nanolab status: error: --db {tmp_path}/nope: no such queue database file",
    ]


def test_a_db_that_is_not_a_queue_is_named_as_queue_ls_names_it(tmp_path: Path, capsys) -> None:
    """``--db config.yaml`` and ``--db`` another program's SQLite file were "cannot be read ...
    move it aside and queue the jobs again": advice for a damaged queue, about a file that is no
    queue. The line is now the one ``queue ls`` prints, and the files are left as they were."""
    import sqlite3

    from nanolab.queue.cli import main as queue_main

    (tmp_path / "y.db").write_text("run:\n  name: x\n")
    other = sqlite3.connect(tmp_path / "other.db")
    other.execute("CREATE TABLE foo (x)")
    other.commit()
    other.close()
    for name in ("y.db", "other.db"):
        before = (tmp_path / name).read_bytes()
        assert main([str(tmp_path), "--db", str(tmp_path / name)]) == 2
        said = capsys.readouterr().err.strip().splitlines()
        assert queue_main(["ls", "--db", str(tmp_path / name)]) == 2
        listed = capsys.readouterr().err.strip().splitlines()
        assert len(said) == 1 and "move it aside" not in said[0], said
        assert said[0].removeprefix("nanolab status: ") == listed[0].removeprefix(
            "nanolab queue ls: "
        )
        assert (tmp_path / name).read_bytes() == before
    assert "not a queue database (not SQLite" in said[0] or "its tables: foo" in said[0]


def test_a_zero_byte_db_is_an_empty_queue_and_stays_zero_bytes(tmp_path: Path, capsys) -> None:
    """A zero-byte file is what SQLite makes for a new database (a ``touch``, a first create
    cut short): it was "cannot be read (no such table: jobs) ... move it aside". It is read as
    an empty queue, and the reader does not write the schema into it."""
    db = tmp_path / "q.db"
    db.touch()
    assert main([str(tmp_path), "--db", str(db), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["running"], shown["queued"], shown["ended"]) == ([], [], [])
    assert db.stat().st_size == 0 and sorted(p.name for p in tmp_path.iterdir()) == ["q.db"]
    assert QueueDB.read_only(db).jobs() == []
    QueueDB(db).add_jobs([NewJob("a", "x.yaml", [], None, str(tmp_path), "runs/a")])  # filled
    assert [j.name for j in QueueDB.read_only(db).jobs()] == ["a"]


def _queue_with_a_broken_table(tmp_path: Path, table: str) -> Path:
    """A queue of one job whose ``table``'s first page is unreadable (its page type byte
    overwritten): SQLite's quick_check fails on it; reads of the other tables do not."""
    import sqlite3

    db = tmp_path / "q.db"
    queue = QueueDB(db)
    queue.add_jobs([NewJob("a", "c.yaml", [], None, str(tmp_path), "runs/a")])
    queue.close()
    with sqlite3.connect(db) as conn:
        root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (table,))
        (page,) = root.fetchone()
        size = conn.execute("PRAGMA page_size").fetchone()[0]
    conn.close()
    with open(db, "r+b") as f:
        f.seek((page - 1) * size)
        f.write(b"\xff")
    return db


def test_a_reader_does_not_run_quick_check_at_every_call(tmp_path: Path, capsys) -> None:
    """``status`` (and ``--watch`` at each redraw) and ``queue ls`` ran SQLite's quick_check,
    which reads the whole file (~10 ms at 2,000 jobs on a busy machine, more with a long
    events table), at every call. The readers read what they show; the verbs that write
    still check the whole file before they write."""
    from nanolab.queue.cli import main as queue_main
    from nanolab.queue.db import QueueError

    db = _queue_with_a_broken_table(tmp_path, "sqlite_sequence")  # which no reader reads
    before = db.read_bytes()
    assert main([str(tmp_path), "--db", str(db), "--json"]) == 0
    assert [j["name"] for j in json.loads(capsys.readouterr().out)["queued"]] == ["a"]
    assert queue_main(["ls", "--db", str(db)]) == 0
    assert " a " in capsys.readouterr().out
    with pytest.raises(QueueError, match=r"is damaged .*malformed.*move it aside"):
        QueueDB(db)  # a writing verb
    assert queue_main(["rm", "a", "--db", str(db)]) == 2
    assert "is damaged or not SQLite (database disk image is malformed)" in capsys.readouterr().err
    assert db.read_bytes() == before


def test_a_listing_writes_nothing_into_a_damaged_queue_in_another_journal_mode(
    tmp_path: Path, capsys
) -> None:
    """``queue ls`` skipped the quick_check as a reader, then switched a queue that was not in
    WAL mode (copied with a tool that set ``journal_mode=delete``) to WAL and wrote its schema
    transaction before the damage was found, and then said "it was left untouched". Where the
    opening would write, it verifies first: the file is unchanged, and the line is true."""
    import sqlite3

    from nanolab.queue.cli import main as queue_main

    db = _queue_with_a_broken_table(tmp_path, "sqlite_sequence")
    with sqlite3.connect(db) as conn:  # not in WAL mode: opening it read-write switches it
        conn.execute("PRAGMA journal_mode=delete")
    conn.close()
    before = db.read_bytes()
    assert queue_main(["ls", "--db", str(db)]) == 2
    err = capsys.readouterr().err
    assert "is damaged" in err and "it was left untouched" in err, err
    assert db.read_bytes() == before


def test_damage_a_reader_meets_after_opening_is_one_line(tmp_path: Path, capsys) -> None:
    """Damage on a page ``status`` reads once the queue is open (the runners' table) is one
    line and exit 2, as at the opening, not a traceback."""
    db = _queue_with_a_broken_table(tmp_path, "runners")
    assert main([str(tmp_path), "--db", str(db)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("nanolab status: error: the queue database "), err
    assert "cannot be read (database disk image is malformed)" in err[0], err


@pytest.mark.parametrize(
    "launch", ["by hand, held here", "by hand, held elsewhere", "job's, held here"]
)
def test_a_live_run_is_not_crashed_by_a_queue_job_that_did_not_train_it(
    tmp_path: Path, capsys, launch: str
) -> None:
    """A queue job for a run directory a launch by hand was training failed at launch (the
    run directory was in use): ``status --db`` called the live run "crashed" (its queue job
    failed). The job's end counts only for the launch it started (the log's newest start names
    it) and only where no process of this host holds the run."""
    import socket

    from nanolab.processes import RUN_LOCK_NAME

    now = time.time()
    run = tmp_path / "runs" / "busy"
    db = tmp_path / "q.db"
    queue = QueueDB(db)
    queue.add_jobs([NewJob(name="busy", config="c.yaml", args=[], seed=None,
                           cwd=str(tmp_path), run_dir=str(run), max_steps=100)])  # fmt: skip
    queue.conn.execute("UPDATE jobs SET created = ?", (now - 60,))
    (job,) = queue.jobs()
    records = training("busy", now - 2, 10)
    if launch.startswith("job's"):
        records[0]["queue_job"] = str(job.id)
    write_log(run, records)  # its launch holds the run here
    if launch.endswith("elsewhere"):
        holder = {"host": socket.gethostname() + "-other", "pid": 1, "started": "now"}
        (run / RUN_LOCK_NAME).write_text(json.dumps(holder))
    runner = queue.register_runner()
    assert queue.claim(job.id, runner, None, now)
    assert queue.finish(job.id, runner, "failed", "the run directory is in use", 2, 0.5)
    queue.close()

    assert main([str(tmp_path / "runs"), "--db", str(db), "--json"]) == 0
    screen = json.loads(capsys.readouterr().out)
    assert [(r["run"], r["status"]) for r in screen["running"]] == [("busy", "running")]
    assert screen["ended"] == []


def test_damage_in_the_finished_jobs_a_running_run_is_looked_up_in_is_one_line(
    tmp_path: Path, capsys
) -> None:
    """With a run that reads as running, ``status --db`` reads every job of the queue (is its
    job finished?) outside the handling the waiting jobs' read has: damage met on a page of
    the jobs table was a traceback. It is one line and exit 2, as everywhere else."""
    import sqlite3

    write_log(tmp_path / "runs" / "live", training("live", time.time() - 2, 5))
    db = tmp_path / "q.db"
    queue = QueueDB(db)
    queue.add_jobs([NewJob(f"j{i}", "c.yaml", [], None, str(tmp_path), f"runs/j{i}")
                    for i in range(300)])  # fmt: skip
    queue.conn.execute("UPDATE jobs SET status = 'done', ended = 1.0")
    queue.close()
    with sqlite3.connect(db) as conn:  # the jobs table's last leaf: opening reads its first
        query = "SELECT max(pageno) FROM dbstat WHERE name = 'jobs' AND pagetype = 'leaf'"
        (page,) = conn.execute(query).fetchone()
        size = conn.execute("PRAGMA page_size").fetchone()[0]
    conn.close()
    with open(db, "r+b") as f:
        f.seek((page - 1) * size)
        f.write(b"\xff" * 16)
    assert main([str(tmp_path / "runs"), "--db", str(db)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("nanolab status: error: the queue database "), err
    assert "cannot be read (database disk image is malformed)" in err[0], err


def test_a_runs_line_parses_its_log_once_and_its_newest_records_from_the_end(
    tmp_path: Path, monkeypatch
) -> None:
    """Each screen parsed every run's log three times (the summary, the last 20 train records,
    the start record): a 250k-line run cost 8 s per redraw of --watch. The summary is the one
    pass; the newest train records and the start are read from the end of the log."""
    import nanolab.runlog as runlog
    from nanolab.queue.status import run_line

    run = tmp_path / "long"
    run.mkdir()
    n = 30_000
    with open(run / "metrics.jsonl", "w") as f:
        start = {"event": "start", "time": 1.0, "step": 0, "run_id": "a",
                 "config": {"trainer": {"max_steps": 100_000}}}  # fmt: skip
        f.write(json.dumps(start) + "\n")
        for step in range(1, n + 1):
            f.write(json.dumps({"event": "train", "time": 1.0 + step, "step": step, "loss": 2.0,
                                "step_time_s": 0.5, "gpu_util": 0.9}) + "\n")  # fmt: skip
    hold_like_a_live_launch(run)
    parsed = []
    real = runlog._parse
    monkeypatch.setattr(runlog, "_parse", lambda line: parsed.append(1) or real(line))
    line = run_line("long", run, now=n + 2.0)
    assert (line.step, line.max_steps, line.gpu_util) == (n, 100_000, 0.9)
    assert line.eta_s == (100_000 - n) * 0.5
    assert len(parsed) < n + 100, len(parsed)  # one pass (it was three)


def status_fields(run: Path, now: float, followed=None) -> dict:
    """What a status line reads of a run, from the end of its log (``followed``: read on from
    the call before, as ``--watch`` does), as plain data."""
    from nanolab.runs import summarize_tail

    tail = summarize_tail(run.name, run, now, followed)
    s = tail.summary
    return {"status": s.status, "detail": s.detail, "steps": s.steps, "loss": s.train_loss,
            "best": s.best_val_loss, "final": s.final_val_loss, "tokens_per_s": s.tokens_per_s,
            "wall": s.wall_s, "updated": s.updated, "start": tail.start, "train": tail.train,
            "tokens": s.tokens, "run_tokens": s.run_tokens}  # fmt: skip


def full_read_fields(run: Path, now: float) -> dict:
    """The same, from the whole log: the summary ``report`` prints and the newest records."""
    from nanolab.runs import summarize_run, tail_records

    s = summarize_run(run.name, run, now)
    return {"status": s.status, "detail": s.detail, "steps": s.steps, "loss": s.train_loss,
            "best": s.best_val_loss, "final": s.final_val_loss, "tokens_per_s": s.tokens_per_s,
            "wall": s.wall_s, "updated": s.updated,
            "start": next(iter(tail_records(run, "start")), None),
            "train": tail_records(run, "train", 20), "tokens": s.tokens,
            "run_tokens": s.run_tokens}  # fmt: skip


def test_a_runs_line_reads_the_end_of_its_log_not_every_record(tmp_path: Path, monkeypatch):
    """``status`` parsed every line of every run's log at each redraw (40 us a record: 8 s for
    a 200k-step run, 18 s for 300 runs of 2k). Its line comes from the end of the log now: the
    newest train records, and over the whole log only the few lines of the other events (the
    starts a resume rewound to, every validation, the end); the figures are the full read's."""
    import nanolab.runlog as runlog
    from nanolab.queue.status import run_line

    run = tmp_path / "long"
    n, resumed = 30_000, 20_000
    records = [{"event": "start", "time": 1.0, "step": 0, "resumed_from_step": None,
                "config": {"trainer": {"max_steps": 100_000}}}]  # fmt: skip
    for step in range(1, n + 1):
        if step == resumed + 51:  # preempted; its last checkpoint was at `resumed`
            records.append({"event": "start", "time": 1.0 + step, "step": resumed,
                            "resumed_from_step": resumed, "planned_steps": 100_000})  # fmt: skip
        at = step if step < resumed + 51 else step - 50  # the steps redone after the resume
        records.append({"event": "train", "time": 1.0 + step, "step": at, "loss": 9.0 - at / 1e4,
                        "tokens": 100 * at, "tokens_per_s": 200.0 + at % 7, "step_time_s": 0.5,
                        "elapsed_s": 0.5 * step, "gpu_util": 90.0})  # fmt: skip
        if at % 1000 == 0:
            val = 5.0 + abs(at - 12_000) / 1e4  # best at step 12000
            records.append({"event": "val", "time": 1.0 + step, "step": at, "tokens": 100 * at,
                            "val_loss": val})  # fmt: skip
    write_log(run, records)
    now = n + 10.0
    expected = full_read_fields(run, now)
    parsed = []
    real = runlog._parse
    monkeypatch.setattr(runlog, "_parse", lambda line: parsed.append(1) or real(line))
    line = run_line("long", run, now)
    assert len(parsed) < 200, len(parsed)  # it was every line, twice
    assert status_fields(run, now) == expected
    assert (line.status, line.step, line.max_steps) == ("running", n - 50, 100_000)
    assert (line.best_val_loss, line.val_loss) == (5.0, 5.0 + 17_000 / 1e4)
    assert line.eta_s == (100_000 - (n - 50)) * 0.5 and line.gpu_util == 90.0


@pytest.mark.parametrize("logged", [True, False])
def test_a_branchs_status_summary_has_its_own_tokens_as_the_reports(
    tmp_path: Path, logged: bool
) -> None:
    """A branch of another run's step-1000 checkpoint, preempted and resumed from its own: its
    ``tokens`` go on from its parent's, ``run_tokens`` are those it trained itself (what its
    GPU-hours paid for). The status summary left ``run_tokens`` (and ``tokens``) unset where
    the report's summary had them; a log from before ``run_tokens`` was logged says neither
    (its first launch was a branch: its own share is not known), not all of ``tokens``.

    Mutations caught: the tail summary without tokens; its branch test on the newest start."""
    run = tmp_path / "branch"
    parent = "runs/parent/checkpoints/step-00001000.ckpt"
    records: list[dict] = [{"event": "start", "time": 1.0, "step": 1000, "run_dir": str(run),
                            "resumed_from_step": 1000, "resumed_from": parent,
                            "config": {"trainer": {"max_steps": 2000}}}]  # fmt: skip
    for step in range(1001, 1201):
        if step == 1101:
            records.append({"event": "start", "time": float(step), "step": 1100,
                            "run_dir": str(run), "resumed_from_step": 1100,
                            "resumed_from": str(run / "checkpoints" / "step-00001100.ckpt"),
                            "config": {"trainer": {"max_steps": 2000}}})  # fmt: skip
        own = {"run_tokens": 10 * (step - 1000)} if logged else {}
        records.append({"event": "train", "time": float(step), "step": step, "loss": 3.0,
                        "tokens": 10 * step, "elapsed_s": float(step - 1000), **own})  # fmt: skip
    write_log(run, records)
    now = 1300.0
    fields = status_fields(run, now)
    assert fields == full_read_fields(run, now)
    assert (fields["tokens"], fields["run_tokens"]) == (12_000, 2_000 if logged else None)


@pytest.mark.slow  # 25 s on 2 cores: seven tiny fits
def test_a_runs_line_is_the_full_reads_at_every_point_of_real_runs(tmp_path, char_dataset):
    """Read from the end of the log, a run's status line says what the whole log says, at
    every line of real runs' logs (as running, and as crashed when the log has gone silent):
    completed and validated afterwards, preempted and resumed twice, branched from another
    run's checkpoint,
    diverged, and planned by its token budget (``max_steps`` -1)."""
    from conftest import nanolab_here, tiny_overrides, write_config

    from nanolab.runs import FollowedRuns

    runs = tmp_path / "runs"

    def fit(name: str, *args: str, signal_at: int | None = None, **extra: object) -> None:
        cfg = tiny_overrides(
            char_dataset, runs, **{"run__name": name, "trainer__max_steps": 12, **extra}
        )
        cfg["checkpoint"] = {"every_n_steps": 3}
        if signal_at is not None:
            cfg["trainer"]["callbacks"] = [{"class_path": "cli_probes.SignalAt",
                                            "init_args": {"step": signal_at, "signal": "SIGUSR1"}}]  # fmt: skip
        config = write_config(tmp_path / f"{name}.yaml", cfg)
        done = nanolab_here("fit", "--config", str(config), *args, cwd=tmp_path)
        assert done.returncode in (0, 3, 75), done.stderr[-2000:]

    fit("done")
    nanolab_here("validate", "--config", str(tmp_path / "done.yaml"), "--ckpt_path", "best",
                 cwd=tmp_path)  # fmt: skip
    fit("resumed", signal_at=4)
    fit("resumed", signal_at=8)
    fit("resumed")
    first = sorted((runs / "done" / "checkpoints").glob("step-*.ckpt"))[0]
    fit("branch", "--ckpt_path", str(first), model__optimizer={"lr": 0.3}, trainer__max_steps=15)
    fit("diverged", model__optimizer={"lr": 1.0e4}, model__schedule={"warmup_steps": 0})
    fit("tokens", trainer__max_steps=-1, budget={"max_tokens": 8 * 4 * 32})
    names = sorted(p.name for p in runs.iterdir() if p.is_dir())
    assert names == ["branch", "diverged", "done", "resumed", "tokens"]
    copy = tmp_path / "copy"
    for name in names:
        lines = (runs / name / "metrics.jsonl").read_text().splitlines(keepends=True)
        assert len(lines) > 5
        run = copy / name
        run.mkdir(parents=True)
        hold_like_a_live_launch(run)  # a log cut short reads as running until silent
        followed = FollowedRuns()  # --watch: each redraw reads what the log gained
        for cut in range(len(lines) + 1):
            (run / "metrics.jsonl").write_text("".join(lines[:cut]))
            last = json.loads(lines[cut - 1])["time"] if cut else 0.0
            for now in (last + 1.0, last + 1e5):  # running; crashed
                assert status_fields(run, now) == full_read_fields(run, now), (name, cut, now)
                assert status_fields(run, now, followed) == full_read_fields(run, now), name


def test_a_watched_screen_reads_what_each_log_gained_and_is_a_fresh_read(
    tmp_path: Path, monkeypatch
):
    """``status --watch`` read every log whole at each redraw (a 2M-record log: 12.8 s a
    screen; 300 finished runs: 18.9 s). Followed from one redraw to the next, a log is read on
    from where the last redraw stopped, and each line says what a fresh read says: at every
    line of a log that resumes and validates, mid-line (a record half written), after a damaged
    line and a carriage return, and when the log is replaced by a shorter one.

    Mutations caught: the unfinished last line kept as read (its record lost once finished);
    a replaced log read on from the old offset; every redraw reading the whole log again.
    """
    import nanolab.runlog as runlog
    from nanolab.runs import FollowedRuns

    run = tmp_path / "runs" / "long"
    records = [{"event": "start", "time": 1.0, "step": 0, "resumed_from_step": None,
                "config": {"trainer": {"max_steps": 1000}}}]  # fmt: skip
    for step in range(1, 301):
        if step == 201:  # preempted; its last checkpoint was at 150
            records.append({"event": "start", "time": 1.0 + step, "step": 150,
                            "resumed_from_step": 150, "planned_steps": 1000})  # fmt: skip
        at = step if step < 201 else step - 50
        records.append({"event": "train", "time": 1.0 + step, "step": at, "loss": 9.0 - at / 1e3,
                        "tokens": 100 * at, "tokens_per_s": 200.0 + at % 7, "step_time_s": 0.5,
                        "elapsed_s": 0.5 * step})  # fmt: skip
        if at % 20 == 0:
            records.append({"event": "val", "time": 1.0 + step, "step": at, "tokens": 100 * at,
                            "val_loss": 5.0 + abs(at - 120) / 1e3})  # fmt: skip
    lines = [json.dumps(r) + "\n" for r in records]
    lines[40] = lines[40][:30] + "\n"  # a damaged line
    lines[90] = lines[90].rstrip("\n") + "\r" + lines[91]  # two records on one line, CR between
    del lines[91]
    lines.append(json.dumps({"event": "end", "time": 400.0, "step": 250, "reason": "completed",
                             "elapsed_s": 150.0}) + "\n")  # fmt: skip
    text = "".join(lines).encode()
    cuts = sorted({*itertools.accumulate(len(ln.encode()) for ln in lines),
                   *range(0, len(text), 97)})  # fmt: skip
    run.mkdir(parents=True)
    followed, written = FollowedRuns(), 0
    for cut in cuts:
        with open(run / "metrics.jsonl", "ab") as f:
            f.write(text[written:cut])
        written = cut
        for now in (402.0, 1e6):  # running (or just ended); silent long since
            assert status_fields(run, now, followed) == status_fields(run, now), cut
    parsed: list[int] = []
    real = runlog._parse
    monkeypatch.setattr(runlog, "_parse", lambda line: parsed.append(1) or real(line))
    status_fields(run, 402.0, followed)
    assert len(parsed) < 60, len(parsed)  # the newest train records only: nothing read again
    parsed.clear()
    status_fields(run, 402.0)
    assert len(parsed) > 60  # a fresh read parses every sparse line
    (run / "metrics.jsonl").unlink()  # replaced by a shorter log (another file)
    (run / "metrics.jsonl").write_bytes(b"".join(ln.encode() for ln in lines[:50]))
    assert status_fields(run, 402.0, followed) == status_fields(run, 402.0)


def test_a_run_whose_log_lost_its_end_record_is_not_running(tmp_path: Path, capsys) -> None:
    """A crash of the machine cut the end record, leaving NUL bytes (some filesystems): the
    run read as running (STALLED, an ETA) for 10 minutes, though no process held it; and a
    queue job whose database says done still read as running."""
    import socket

    from nanolab.cli import main as nanolab_main
    from nanolab.processes import RUN_LOCK_NAME

    now = time.time()
    runs = tmp_path / "runs"
    write_log(runs / "cut", training("cut", now - 2, 10))
    (runs / "cut" / RUN_LOCK_NAME).unlink()  # its launch exited: it gave the lock back
    with open(runs / "cut" / "metrics.jsonl", "ab") as f:
        f.write(b'{"event": "end", "time": ' + b"\0" * 64)
    no_end = "no end record and no run lock"  # what is seen, not more
    assert main([str(runs), "--json"]) == 0
    screen = json.loads(capsys.readouterr().out)
    assert screen["running"] == []
    assert [(r["run"], r["status"], r["detail"]) for r in screen["ended"]] == [
        ("cut", "crashed", no_end)
    ]
    assert nanolab_main(["report", str(runs), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["runs"]
    assert (row["status"], row["detail"]) == ("crashed", no_end)

    # A lock this host cannot judge (a holder of another host name): the queue job says the
    # fit ended after the log's last line.
    queued = runs / "queued"
    db = tmp_path / "q.db"
    queue = QueueDB(db)
    queue.add_jobs([NewJob(name="queued", config="c.yaml", args=[], seed=None,
                           cwd=str(tmp_path), run_dir=str(queued), max_steps=100)])  # fmt: skip
    queue.conn.execute("UPDATE jobs SET created = ?", (now - 60,))
    (job,) = queue.jobs()
    records = training("queued", now - 2, 10)
    records[0]["queue_job"] = str(job.id)  # the runner's launch
    write_log(queued, records)
    holder = {"host": socket.gethostname() + "-other", "pid": 1, "started": "now"}
    (queued / RUN_LOCK_NAME).write_text(json.dumps(holder))
    runner = queue.register_runner()
    assert queue.claim(job.id, runner, None, now - 20)
    assert queue.finish(job.id, runner, "done", None, 0, 20.0)
    queue.conn.close()

    def shown(*db_args: str) -> dict[str, tuple[str, str | None]]:
        assert main([str(runs), "--json", *db_args]) == 0
        screen = json.loads(capsys.readouterr().out)
        return {r["run"]: (r["status"], r["detail"]) for r in screen["running"] + screen["ended"]}

    assert shown()["queued"] == ("running", None)  # no queue to ask: its silence decides
    said = shown("--db", str(db))
    assert said["queued"] == ("crashed", f"no end record; its queue job #{job.id} is done")
    # Resumed by hand after the job ended: that launch writes on, and it is running.
    with open(queued / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"event": "train", "time": time.time() + 5, "step": 11, "loss": 2.9,
                            "tokens": 11_000, "step_time_s": 0.5}) + "\n")  # fmt: skip
    assert shown("--db", str(db))["queued"] == ("running", None)
