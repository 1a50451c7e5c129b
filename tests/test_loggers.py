"""``--logger``: trackers get the run log's records at its steps, in the run directory.

docs/loggers.md. CSV needs no extra package; TensorBoard is checked when installed.
"""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest
from conftest import nanolab_here, run_nanolab, tiny_overrides, write_config

from nanolab.runlog import read_records


def fit(work: Path, *args: str, here: bool = False):
    """``nanolab fit`` of the tiny run in a process of its own (``here``: in this one)."""
    res = (nanolab_here if here else run_nanolab)("fit", "--config", "tiny.yaml", *args, cwd=work)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


@pytest.fixture
def work(tmp_path, char_dataset) -> Path:
    write_config(tmp_path / "tiny.yaml", tiny_overrides(char_dataset, Path("runs")))
    return tmp_path


def fit_records(run: Path, event: str) -> dict[int, dict]:
    return {r["step"]: r for r in read_records(run / "metrics.jsonl", event)}


def test_csv_logger_shares_the_run_logs_steps_and_survives_a_resume(work):
    run = work / "runs" / "tiny"
    fit(work, "--logger", "csv", here=True)
    first_rows = (run / "csv" / "metrics.csv").read_text().splitlines()[1:]
    fit(work, "--logger", "csv", "--trainer.max_steps", "9", here=True)  # continues the run
    rows = list(csv.DictReader((run / "csv" / "metrics.csv").open()))
    train = {int(r["step"]): r for r in rows if r["train/loss"]}
    val = {int(r["step"]): r for r in rows if r["val/loss"]}
    jsonl_train, jsonl_val = fit_records(run, "train"), fit_records(run, "val")
    assert sorted(train) == sorted(jsonl_train) == list(range(1, 10))
    assert sorted(val) == sorted(jsonl_val) == [3, 6, 9]
    for step, record in jsonl_train.items():  # lr and grad_norm reach the logger too
        for key in ("loss", "lr", "grad_norm", "tokens"):
            assert float(train[step][f"train/{key}"]) == pytest.approx(record[key], rel=1e-6)
    for step, record in jsonl_train.items():  # throughput: the record's, under its own name
        for key in ("tokens_per_s", "samples_per_s", "step_time_s", "elapsed_s"):
            assert float(train[step][f"train/{key}"]) == pytest.approx(record[key], rel=1e-6)
    assert not [name for name in rows[0] if name.startswith("perf/")]
    for step, record in jsonl_val.items():
        assert float(val[step]["val/loss"]) == pytest.approx(record["val_loss"], rel=1e-6)
    # The first launch's rows are still there (Lightning's writer would have deleted them).
    assert len(rows) == 12 and len(first_rows) == 8
    assert (run / "config.yaml").is_file()
    assert not (run / "lightning_logs").exists() and not (work / "lightning_logs").exists()


def test_throughput_log_to_loggers_false_keeps_throughput_out_of_the_logger_only(work):
    """``throughput.log_to_loggers`` did nothing: the meter sent ``perf/*`` through a logger
    call the run log drops, and the train records carried the numbers to the logger anyway."""
    run = work / "runs" / "tiny"
    args = ("--logger", "csv", "--trainer.max_steps", "3", "--throughput.log_to_loggers", "false")
    fit(work, *args, here=True)
    header = next(csv.reader((run / "csv" / "metrics.csv").open()))
    assert "train/loss" in header and "train/elapsed_s" in header
    assert not {"train/tokens_per_s", "train/step_time_s", "train/samples_per_s"} & set(header)
    assert all(r["tokens_per_s"] > 0 for r in fit_records(run, "train").values())


def test_a_fresh_start_moves_the_logger_folder_and_takes_a_new_logger_run(work, monkeypatch):
    """``run.fresh`` appended the new run's rows to the old run's ``csv/metrics.csv`` (steps 1..9
    then 1..3 in one file) and kept W&B's id (made of the run directory): now the folder goes
    to ``previous/`` with the old run, and the logger is given the run log's id, the same on a
    resume and a new one after a fresh start (W&B's id is made of it)."""
    from nanolab.callbacks import loggers

    given: list[str] = []
    make = loggers.make_logger

    def recording(name, run_dir, run_name, run_id):
        given.append(run_id)
        return make(name, run_dir, run_name, run_id)

    monkeypatch.setattr(loggers, "make_logger", recording)
    run = work / "runs" / "tiny"
    fit(work, "--logger", "csv", "--trainer.max_steps", "3", here=True)
    fit(work, "--logger", "csv", here=True)  # a resume: the same logger run
    old_rows = (run / "csv" / "metrics.csv").read_text()
    fit(work, "--logger", "csv", "--trainer.max_steps", "3", "--run.fresh", "true", here=True)
    (archived,) = (run / "previous").iterdir()
    assert (archived / "csv" / "metrics.csv").read_text() == old_rows
    steps = [int(r["step"]) for r in csv.DictReader((run / "csv" / "metrics.csv").open())]
    assert steps == [1, 2, 3, 3]  # three train rows and a val row: the new run's only
    old_id = read_records(archived / "metrics.jsonl", "start")[0]["run_id"]
    (new_start,) = read_records(run / "metrics.jsonl", "start")
    assert given == [old_id, old_id, new_start["run_id"]] and new_start["run_id"] != old_id
    assert loggers.wandb_run_id("tiny", old_id) != loggers.wandb_run_id("tiny", given[-1])


def test_a_run_begun_under_the_old_wandb_id_resumes_in_its_wandb_run(tmp_path, monkeypatch):
    """W&B's id was ``<run name>-<digest of the run directory's path>`` before it was made of
    the run id: a run begun then and resumed now started a second W&B run. Its ``wandb/``
    folder (laid out by hand as W&B writes it: ``run-<stamp>-<id>``) names the id to keep; a
    run without one, or whose folder has the new id too, gets the new id. (wandb itself is not
    installed: the id chosen is checked at the logger's constructor.)"""
    import hashlib
    import os

    from nanolab.callbacks import loggers

    run, run_id = tmp_path / "runs" / "tiny", "0123456789ab"
    new = f"tiny-{run_id}"
    assert loggers.wandb_run_id("tiny", run_id, run) == new  # no wandb folder
    old = f"tiny-{hashlib.sha1(os.path.realpath(run).encode()).hexdigest()[:8]}"
    (run / "wandb" / f"run-20260101_120000-{old}" / "files").mkdir(parents=True)
    (run / "wandb" / "offline-run-20251231_090000-tiny-0000abcd").mkdir()  # an older one
    (run / "wandb" / "run-20260101_130000-other-1a2b3c4d").mkdir()  # another run's name
    (run / "wandb" / "debug.log").write_text("")
    assert loggers.wandb_run_id("tiny", run_id, run) == old
    assert loggers.wandb_run_id("tiny", run_id) == new  # no directory: nothing to look in

    made: dict = {}

    class Recording:  # stands in for Lightning's WandbLogger, which needs wandb
        def __init__(self, **kwargs) -> None:
            made.update(kwargs)

    import lightning.pytorch.loggers as lightning_loggers

    monkeypatch.setattr(loggers, "check_available", lambda name: None)
    monkeypatch.setattr(lightning_loggers, "WandbLogger", Recording)
    loggers.make_logger("wandb", run, "tiny", run_id)
    assert made["id"] == old and made["resume"] == "allow"
    (run / "wandb" / f"run-20260102_080000-{new}").mkdir()  # resumed once under the new id
    assert loggers.wandb_run_id("tiny", run_id, run) == new


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard absent")
def test_tensorboard_logger_steps_match_the_run_log(work):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = work / "runs" / "tiny"
    fit(work, "--logger", "tensorboard")
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    for tag, event in (("train/loss", "train"), ("train/lr", "train"), ("val/loss", "val")):
        assert [s.step for s in events.Scalars(tag)] == sorted(fit_records(run, event))
    assert (run / "config.yaml").is_file() and not (run / "lightning_logs").exists()


@pytest.mark.slow  # 30-100 s on 2 cores; `pytest -m slow`
@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb installed")
def test_a_missing_logger_package_is_one_line_with_the_pip_command(work):
    res = run_nanolab("fit", "--config", "tiny.yaml", "--logger", "wandb", cwd=work)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    last = [ln for ln in res.stderr.splitlines() if ln.strip()][-1]
    assert last == (
        "nanolab fit: error: --logger wandb needs the wandb package, which is not installed: "
        "pip install 'nanolab[wandb]'"
    )
    assert not (work / "runs").exists()


@pytest.mark.parametrize(
    ("given", "fix"),
    [
        ("csv", "write --logger csv (logger: csv in a config file)"),
        ("TensorBoard", "write --logger tensorboard"),
        ("neptune", "write --logger NAME with one of nanolab's loggers (tensorboard, wandb, "),
    ],
)
def test_a_bare_name_given_to_trainer_logger_is_one_line_naming_the_option(work, given, fix):
    """``--trainer.logger csv`` got the parser's report (a path expected, the Union's subtypes);
    the short names are ``--logger``'s, and the line says so."""
    res = nanolab_here("fit", "--config", "tiny.yaml", "--trainer.logger", given, cwd=work)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    (line,) = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert line.startswith(
        f"nanolab fit: error: trainer.logger: {given!r} is not a Lightning logger class; {fix}"
    ), line
    assert "docs/loggers.md" in line and "Union" not in line, line
    assert not (work / "runs").exists()


def test_task_records_reach_the_loggers_at_their_step() -> None:
    """A ``tasks`` record (the downstream callback's) goes to every logger at its step, under
    its own names; records of other kinds (``budget``) do not."""
    from types import SimpleNamespace

    from nanolab.callbacks.loggers import forward_record

    got: list[tuple[dict, int]] = []
    logger = SimpleNamespace(log_metrics=lambda metrics, step: got.append((metrics, step)))
    trainer = SimpleNamespace(loggers=[logger])
    forward_record(trainer, {"event": "tasks", "step": 300, "suite": "builtin:shakespeare",
                             "tasks/cloze/score": 0.36, "tasks/core": 0.15})  # fmt: skip
    forward_record(trainer, {"event": "budget", "step": 300, "spent": 1.0})
    assert got == [({"tasks/cloze/score": 0.36, "tasks/core": 0.15}, 300)]
