"""The queue's parts: refusing bad configs at ``add``, naming, the database under concurrent
writers, ordering and deadlines, and the ``ls/rm/retry/clear`` verbs. The runner end to end
(crash, restart, a failing job) is in test_queue_restart.py."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import hold_like_a_live_launch, tiny_overrides, write_config

from nanolab.data.datamodule import TokenDataModule
from nanolab.queue.cli import main, parse_until
from nanolab.queue.db import NewJob, QueueDB, QueueError
from nanolab.queue.runner import order_jobs, outcome, plan_starts


@pytest.fixture
def tiny(tmp_path: Path, char_dataset: Path) -> Path:
    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=8)
    del cfg["run"]["name"]
    return write_config(tmp_path / "tiny.yaml", cfg)


def queue(capsys, db: Path, *argv: str) -> tuple[int, str, str]:
    code = main([argv[0], "--db", str(db), *argv[1:]])
    out = capsys.readouterr()
    return code, out.out, out.err


def new_job(name: str, **kw) -> NewJob:
    return NewJob(
        name=name, config="c.yaml", args=[], seed=None, cwd="/", run_dir=f"/r/{name}", **kw
    )


# -- add ------------------------------------------------------------------------------------
def test_add_one_job_per_seed(tmp_path: Path, tiny: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "q.db"
    code, _, err = queue(
        capsys, db, "add", str(tiny), "--seeds", "42,43", "--set", "model.optimizer.lr=1e-3"
    )
    assert code == 0, err
    jobs = QueueDB(db).jobs()
    assert [j.name for j in jobs] == ["tiny-lr1e-3-s42", "tiny-lr1e-3-s43"]
    assert jobs[0].args == ["--model.optimizer.lr=1e-3", "--seed_everything=42"]
    assert jobs[0].run_dir == str(tmp_path / "runs" / "tiny-lr1e-3-s42")
    assert jobs[0].max_steps == 8 and jobs[0].status == "pending"
    assert jobs[0].config_key == jobs[1].config_key  # seeds of one experiment
    assert jobs[0].estimate_s is not None and jobs[0].estimate_s > 0
    # the same again: refused as a whole (names are run directories), nothing added
    code, _, err = queue(
        capsys, db, "add", str(tiny), "--seeds", "44,43", "--set", "model.optimizer.lr=1e-3"
    )
    assert code == 2 and "'tiny-lr1e-3-s43' is already queued" in err
    assert len(QueueDB(db).jobs()) == 2


def test_add_takes_max_steps_minus_1_when_a_token_budget_ends_the_run(
    tmp_path: Path, tiny: Path, capsys, monkeypatch
) -> None:
    """fit plans the cosine of ``trainer.max_steps -1`` for the steps ``budget.max_tokens``
    allows, but ``queue add`` still refused it as unbounded; a job nothing bounds still is."""
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "q.db"
    code, _, err = queue(capsys, db, "add", str(tiny), "--set", "trainer.max_steps=-1")
    assert (
        code == 2
        and "no budget.max_tokens, max_wall_hours, max_gpu_hours or max_cost bounds" in err
    ), err
    assert len(err.strip().splitlines()) == 1
    sets = ["--set", "trainer.max_steps=-1", "--set", "budget.max_tokens=1000"]
    code, _, err = queue(capsys, db, "add", str(tiny), *sets)
    assert code == 0, err
    (job,) = QueueDB(db).jobs()
    assert job.max_steps == 1000 // (4 * 32)  # tokens per step: micro-batch 4 x block 32
    assert job.estimate_s is not None and job.estimate_s > 0


def test_a_token_budgets_steps_are_the_budgets_own_rule(
    tmp_path: Path, tiny: Path, capsys, monkeypatch
) -> None:
    """The queue repeated ``CostBudget.token_steps``'s arithmetic (one rule in two places: a
    change to the budget's rule would leave the queue's steps and estimate on the old one);
    it asks the rule, with the job's tokens per step as fit's trainer holds them."""
    from nanolab.estimator import run_length

    asked: list[int] = []

    def rule(step: int, spent: int, per_step: int, every: int, limit: int) -> int:
        asked.append(per_step)
        return 5  # a rule of its own: the queue must take it as it is

    monkeypatch.setattr(run_length, "token_stop_step", rule)
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "q.db"
    sets = ["--set", "trainer.max_steps=-1", "--set", "budget.max_tokens=1000"]
    code, _, err = queue(
        capsys, db, "add", str(tiny), *sets, "--set", "run.global_batch_tokens=256"
    )
    assert code == 0, err
    (job,) = QueueDB(db).jobs()
    assert job.max_steps == 5 and set(asked) == {256}  # micro-batch 4 x block 32 x 2 accumulated


def test_a_job_is_planned_for_where_its_budget_stops_it_first(
    tmp_path: Path, tiny: Path, capsys, monkeypatch
) -> None:
    """The queue planned a job by ``trainer.max_steps`` when ``budget.max_tokens`` stops it
    sooner (gpt2-124m with 1e9 tokens: 19,073 steps, ~6 h, where fit stops at 1,907), and
    refused ``trainer.max_steps -1`` ended by hours, GPU-hours or a priced cost. It plans by
    the rule estimate and fit use: the tightest bound, hours at the job's step time."""
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "q.db"
    tokens = ["--set", "trainer.max_steps=600", "--set", "budget.max_tokens=1280"]
    code, _, err = queue(capsys, db, "add", str(tiny), *tokens, "--name", "tokens")
    assert code == 0, err
    (job,) = QueueDB(db).jobs()
    assert job.max_steps == 10  # 1280 tokens at 128 a step (micro-batch 4 x block 32)
    whole = QueueDB(db)
    code, _, err = queue(capsys, db, "add", str(tiny), "--set", "trainer.max_steps=600",
                         "--name", "whole")  # fmt: skip
    assert code == 0, err
    assert job.estimate_s < next(j for j in whole.jobs() if j.name == "whole").estimate_s

    hours = ["--set", "trainer.max_steps=-1", "--set", "budget.max_wall_hours=0.001"]
    code, _, err = queue(capsys, db, "add", str(tiny), *hours, "--name", "hours")
    assert code == 0, err
    walled = next(j for j in QueueDB(db).jobs() if j.name == "hours")
    assert walled.estimate_s is not None and walled.estimate_s <= 3.6 + 12.0 + 1e-6

    cost = ["--set", "trainer.max_steps=-1", "--set", "budget.max_cost=5"]
    code, _, err = queue(capsys, db, "add", str(tiny), *cost, "--name", "cost")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "budget.max_cost needs budget.price_per_gpu_hour (> 0)" in err, err


def test_add_takes_fits_dotted_overrides(tmp_path: Path, tiny: Path, capsys, monkeypatch) -> None:
    """``queue add`` reads ``--group.key VALUE`` (and ``=VALUE``) as fit does: each is a --set."""
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "q.db"
    code, _, err = queue(
        capsys, db, "add", str(tiny), "--model.gpt.n_layer", "3", "--trainer.max_steps=6"
    )
    assert code == 0, err
    (job,) = QueueDB(db).jobs()
    assert job.args == ["--model.gpt.n_layer=3", "--trainer.max_steps=6"]
    assert job.name == "tiny-n_layer3-max_steps6" and job.max_steps == 6
    code, _, err = queue(capsys, db, "add", str(tiny), "--model.gpt.n_layer")
    assert code == 2 and "--model.gpt.n_layer needs a value" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "trainer.max_stepz=3"], "max_stepz"),
        # a value typed on the command line is named as typed, not as the config file's
        (["--set", "model.gpt.n_head=3"], "error: --set model.gpt.n_head=3: model.gpt.n_embd (32) must be divisible by model.gpt.n_head (3)"),
        (["--set", "model.gpt.n_layer=two"], "error: --set model.gpt.n_layer=two: model.gpt.n_layer: 'two' is not valid"),
        (["--set", "trainer.max_steps=abc"], "error: --set trainer.max_steps=abc: trainer.max_steps must be"),
        (["--sweep", "model.gpt.n_layer=2,x"], "error: --sweep model.gpt.n_layer, value x: model.gpt.n_layer: 'x' is not valid"),
        (["--trainer.precision", "17"], "error: --set trainer.precision=17: trainer.precision: '17' is not valid"),
        (["--set", "run.global_batch_tokens=100"], "run.global_batch_tokens (100) must be a positive multiple"),
        (["--set", "trainer.max_steps=-1"], "trainer.max_steps is -1 and no budget.max_tokens, max_wall_hours, max_gpu_hours or max_cost bounds the run; a queued job needs an end"),
        # its rank 0 would wait in the rendezvous for machines that never come (deaf to signals)
        (["--set", "trainer.num_nodes=2"], "trainer.num_nodes is 2; the queue runs each job on this machine"),
        # said first: the batch checks would ask for a batch fit for 2 machines
        (["--set", "trainer.num_nodes=2", "--set", "run.global_batch_tokens=128"], "trainer.num_nodes is 2; the queue"),
        (["--set", "data.source=[nowhere.txt]"], "data.source: nowhere.txt does not exist"),
        (["--set", "data.dataset_dir=missing", "--set", "data.source=null"], "holds no prepared dataset"),
        (["--set", "run.name=x"], "error: --set run.name=x: set by the queue; use --name x"),
        # a setting the queue sets, named as given: no --set was written
        (["--seed_everything", "3"], "error: --seed_everything 3: set by the queue; use --seeds 3"),
        (["--run.name=x"], "error: --run.name=x: set by the queue; use --name x"),
        (["--sweep", "seed_everything=1,2"], "error: --sweep seed_everything: set by the queue; use --seeds 1,2\n"),
        (["--set", "lr"], "--set lr: write KEY=VALUE"),
        (["--set", "trainer.max_steps", "5"], "write KEY=VALUE, e.g. --set trainer.max_steps=5"),
        (["--seeds", "1,x"], "--seeds '1,x': expected integers"),
        (["--name", "a/b"], "give a plain folder name"),
        # a restart of the job (preemption, runner stopped) would start it over
        (["--set", "run.fresh=true"], "run.fresh: true: each restart of a queued job"),
        (["--set", "run.resume=never"], "--set run.resume=never: set by the queue"),
        # --run.name=null is no name: the job would train in a folder the queue does not follow
        (["--name", "NULL"], "--name 'NULL': a run name the command line reads as null"),
        # the run directory could not be made: "File name too long" was a traceback
        (["--name", "x" * 300], "...'xxxxxxxxxx': 300 bytes long, over the 255 a folder name may"),
        (["--name", "é" * 127, "--seeds", "42"], "(run name 'éé"),  # 254 bytes, and "-s42"
    ],
)  # fmt: skip
def test_bad_configs_are_refused_at_add(tmp_path, tiny, capsys, monkeypatch, args, message) -> None:
    """Each refusal is one line, and leaves nothing behind: the queue database was created
    (empty) by an add that queued nothing."""
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "q.db"
    before = sorted(tmp_path.rglob("*"))
    code, _, err = queue(capsys, db, "add", str(tiny), *args)
    assert code == 2
    assert err.startswith("nanolab queue add: error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1
    assert sorted(tmp_path.rglob("*")) == before  # no database, no other file or folder


def test_a_bad_value_in_the_config_file_is_the_file_s_even_with_a_set_of_its_key(
    tmp_path, tiny, capsys, monkeypatch
) -> None:
    """The file is named when its own value is at fault, though a ``--set`` of the same key
    (refused in the file before the ``--set`` applies) or of another is on the command line."""
    monkeypatch.chdir(tmp_path)
    bad = tmp_path / "bad.yaml"
    text = tiny.read_text()
    assert "n_layer: 2" in text
    bad.write_text(text.replace("n_layer: 2", "n_layer: x"))
    for given in ("model.gpt.n_layer=3", "model.gpt.n_head=2"):
        code, _, err = queue(capsys, tmp_path / "q.db", "add", str(bad), "--set", given)
        assert code == 2 and f"error: {bad}: model.gpt.n_layer: 'x' is not valid" in err, err


def test_a_name_is_kept_as_given_as_fit_keeps_it(tmp_path, tiny, capsys, monkeypatch) -> None:
    """``--name`` is the run's ``run.name``, as fit takes it: printable names in any script are
    not rewritten ('lr-实验' was 'lr-', and 'lr-試験' then a duplicate of it)."""
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "q.db"
    for name in ("lr-实验", "lr-試験", "café run", "1st"):
        code, out, err = queue(capsys, db, "add", str(tiny), "--name", name)
        assert code == 0 and "added job" in out, err
    assert [j.name for j in QueueDB(db).jobs()] == ["lr-实验", "lr-試験", "café run", "1st"]
    assert QueueDB(db).jobs()[2].run_dir == str(tmp_path / "runs" / "café run")


def test_a_derived_name_keeps_letters_of_any_script(tmp_path, tiny, capsys, monkeypatch) -> None:
    """A name made without ``--name`` turned every non-ASCII letter into ``_`` while ``--name``
    kept them: ``实验.yaml`` queued as ``-max_steps5``. It keeps letters, marks and digits of any
    script, as fit's ``run.name`` does; a path's ``/``, spaces and brackets still become ``_``."""
    from nanolab.queue.jobs import job_names
    from nanolab.queue.sweep import point_name

    monkeypatch.chdir(tmp_path)
    config = tmp_path / "实验.yaml"
    config.write_text(tiny.read_text())
    db = tmp_path / "q.db"
    code, out, err = queue(capsys, db, "add", str(config), "--set", "trainer.max_steps=5")
    assert code == 0, err
    assert [j.name for j in QueueDB(db).jobs()] == ["实验-max_steps5"], out
    assert job_names(Path("c.yaml"), None, [("run.tags", "प्रयोग (v2)/a")], [1]) == [
        "c-tagsप्रयोग_v2_a-s1"
    ]
    assert (
        point_name("lr", (("data.dataset_dir", "data/café\u0301"),))
        == "lr-dataset_dirdata_café\u0301"
    )


#: Names the runner's ``--run.name=<name>`` reads as null (YAML: any case of null, ``~``,
#: blanks around them, a comment, an empty anchor or tag): fit would train in a timestamped
#: folder and the job's own run directory would hold only queue.log.
NULL_NAMES = ["~", "null ", " null", "Null", "NULL", " ~ ", "#x", "&a", "!!null x"]

#: Names YAML reads as other kinds: fit's ``run.name`` keeps them as the text given.
TEXT_NAMES = ["true", "1e3", "[a]", "nUll", "None", "a #b", "{a: 1}"]


@pytest.mark.parametrize("name", NULL_NAMES)
def test_a_name_the_command_line_reads_as_null_is_refused(
    tmp_path, tiny, capsys, monkeypatch, name
) -> None:
    """Only 'null' in lower or upper case was refused: '~' or 'null ' was queued, ran "done",
    and its run went into runs/tiny-<time>, a folder the queue never followed."""
    from nanolab.run.read import fit_config

    assert fit_config(["--config", str(tiny), f"--run.name={name}"])["run"]["name"] is None
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "q.db"
    code, _, err = queue(capsys, db, "add", str(tiny), "--name", name)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(
        f"nanolab queue add: error: --name {name!r}: a run name the command line reads as null"
    ), err
    assert not db.exists()
    # With a seed the run name is '<name>-s1': '~-s1' is text, '#x-s1' is still a comment.
    seeded = f"{name}-s1"
    reads_null = fit_config(["--config", str(tiny), f"--run.name={seeded}"])["run"]["name"] is None
    code, _, err = queue(capsys, db, "add", str(tiny), "--name", name, "--seeds", "1")
    assert code == (2 if reads_null else 0), err
    assert not reads_null or f"(run name {seeded!r}): a run name the command line" in err


def test_names_yaml_reads_as_other_kinds_stay_text(tmp_path, tiny, capsys, monkeypatch) -> None:
    """A job's run directory is the one fit trains in: fit reads ``--run.name=true`` as the
    text 'true', so the queue takes it, and ``run.name`` is that text."""
    from nanolab.run.read import fit_config

    monkeypatch.chdir(tmp_path)
    db = tmp_path / "q.db"
    for name in TEXT_NAMES:
        assert fit_config(["--config", str(tiny), f"--run.name={name}"])["run"]["name"] == name
        code, _, err = queue(capsys, db, "add", str(tiny), "--name", name)
        assert code == 0, err
    assert [j.name for j in QueueDB(db).jobs()] == TEXT_NAMES


def test_a_reference_that_is_one_jobs_id_and_anothers_name_is_refused(
    tmp_path, tiny, capsys, monkeypatch
) -> None:
    """A job may be named "1": `queue rm 1` then named job id 1 too, and removed (or stopped) it
    instead of the job named 1. Such a reference is refused, naming both; an id alone works."""
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "q.db"
    for name in ("first", "1"):
        code, _, err = queue(capsys, db, "add", str(tiny), "--name", name)
        assert code == 0, err
    code, _, err = queue(capsys, db, "rm", "1")
    assert code == 2
    assert err.strip() == (
        "nanolab queue rm: error: '1' is both the id of job 1 (first) and the name of job 2; "
        "give #1 or #2 (an id, whatever the names)"
    ), err
    assert [j.name for j in QueueDB(db).jobs()] == ["first", "1"]
    code, _, err = queue(capsys, db, "rm", "#1")  # the form the refusal names works
    assert code == 0, err
    assert [j.name for j in QueueDB(db).jobs()] == ["1"]
    code, _, err = queue(capsys, db, "add", str(tiny), "--name", "2")  # id 3, named 2
    assert code == 0, err
    code, _, err = queue(capsys, db, "rm", "#2")  # job 2 is named "1": still reachable
    assert code == 0, err
    assert [j.name for j in QueueDB(db).jobs()] == ["2"]


#: Callback settings ``nanolab fit`` refuses when it builds the run's callbacks, with its line.
CALLBACK_REFUSALS = [
    ("budget.max_tokens=-5", "budget.max_tokens must be > 0 (or null for no limit), got -5"),
    ("budget.max_wall_hours=0", "budget.max_wall_hours must be > 0 (or null for no limit), got 0.0"),
    ("budget.max_cost=5", "budget.max_cost needs budget.price_per_gpu_hour (> 0) to turn GPU-hours into money"),
    ("budget.currency=XYZ", "budget.currency 'XYZ' is not a known ISO 4217 code; use e.g. USD"),
    ("budget.price_per_gpu_hour=-1", "budget.price_per_gpu_hour must be a number >= 0, got -1.0"),
    ("budget.max_gpu_hours=-1", "budget.max_gpu_hours must be > 0 (or null for no limit), got -1.0"),
    ("budget.patience=0", "budget.patience must be >= 1 or null, got 0"),
    ("budget.min_delta=-1", "budget.min_delta must be >= 0, got -1.0"),
    ('notify.targets=["echo {nosuch}"]', "notify.targets[0] names {nosuch}, which is not a field"),
    ("spike.factor=-1", "spike.factor must be a number > 1, got -1.0"),
    ("checkpoint.every_n_steps=0", "checkpoint.every_n_steps must be >= 1 or null (no step-based saves), got 0"),
    ("checkpoint.keep_last=-1", "checkpoint.keep_last must be >= 0, got -1"),
    ("downstream.limit=0", "downstream.limit must be >= 1 or null, got 0"),
    ("downstream.suite=nonexistent_suite.yaml", "suite "),
    ("downstream.suite=builtin:nosuch", "builtin:nosuch: no such built-in suite"),
]  # fmt: skip


@pytest.mark.parametrize(("setting", "message"), CALLBACK_REFUSALS, ids=lambda x: x[:28])
def test_callback_settings_fit_refuses_are_refused_at_add(
    tmp_path, tiny, capsys, monkeypatch, setting, message
) -> None:
    """Each was queued and then failed at night with exit 2: the queue checked the model, the
    data and the resume settings, never the callbacks fit builds at start-up."""
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "q.db"
    code, _, err = queue(capsys, db, "add", str(tiny), "--set", setting)
    assert code == 2, err
    # named as typed: the config file does not hold the value at fault
    assert err.startswith(f"nanolab queue add: error: --set {setting}: {message}"), err
    assert len(err.strip().splitlines()) == 1
    assert QueueDB(db).jobs() == []


def test_callback_settings_that_fit_takes_are_queued(tmp_path, tiny, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = queue(capsys, tmp_path / "q.db", "add", str(tiny), "--set", "budget.max_tokens=9000",
                         "--set", "budget.max_cost=5", "--set", "budget.price_per_gpu_hour=2",
                         "--set", 'notify.targets=["echo {run}"]', "--set", "spike.factor=3")  # fmt: skip
    assert code == 0, err


def test_a_config_that_starts_from_a_checkpoint_is_queued_as_ckpt_path(
    tmp_path, tiny, capsys, monkeypatch
) -> None:
    """``run.resume: PATH`` in a queued config started the job from scratch: the runner sets
    ``run.resume auto`` on every attempt. The path goes on as ``--ckpt_path`` (which fit keeps
    with ``run.resume auto``, and continues after a preemption); ``run.resume: never`` in the
    file is refused, as ``--set run.resume`` is."""
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "q.db"
    start = tmp_path / "parent.ckpt"
    cfg = yaml.safe_load(tiny.read_text())
    cfg["run"]["resume"] = "parent.ckpt"
    write_config(tmp_path / "ft.yaml", cfg)
    code, _, err = queue(capsys, db, "add", str(tmp_path / "ft.yaml"), "--name", "ft")
    assert code == 0, err
    (job,) = QueueDB(db).jobs()
    assert job.args == [f"--ckpt_path={start}"]
    cfg["run"]["resume"] = "never"
    write_config(tmp_path / "nv.yaml", cfg)
    code, _, err = queue(capsys, db, "add", str(tmp_path / "nv.yaml"), "--name", "nv")
    assert code == 2 and "run.resume: never: a queued job resumes from its own" in err
    # its own run's older checkpoint: every restart would go back to it
    cfg["run"]["resume"] = str(tmp_path / "runs" / "own" / "checkpoints" / "step-00000004.ckpt")
    write_config(tmp_path / "own.yaml", cfg)
    code, _, err = queue(capsys, db, "add", str(tmp_path / "own.yaml"), "--name", "own")
    assert code == 2 and "a checkpoint of the job's own run; every restart would go back" in err


@pytest.mark.parametrize(
    "argv",
    [["ls", "--stat", "done"], ["run", "--slot", "2"], ["clear", "--al"], ["ls", "--d", "x"]],
)
def test_queue_options_are_matched_whole(tmp_path: Path, capsys, monkeypatch, argv) -> None:
    """Every ``queue`` verb matches its options whole, as fit does: a prefix of one (``--stat``
    for ``--status``, ``--slot`` for ``--slots``) is one error line and exit 2, not taken as
    the option it begins (``add --seed 3`` was silently ``--seeds 3``: test_queue_add_fast).

    Mutation caught: a verb's parser taking abbreviations again."""
    monkeypatch.chdir(tmp_path)  # taken as an option it begins, each stays in here
    db = tmp_path / "q.db"
    job = NewJob(name="a", config="c.yaml", args=[], seed=None, cwd=str(tmp_path),
                 run_dir=str(tmp_path / "runs" / "a"))  # fmt: skip
    QueueDB(db).add_jobs([job])
    with pytest.raises(SystemExit) as exit_:
        main([argv[0], "--db", str(db), *argv[1:]])
    err = capsys.readouterr().err
    meant = {"--stat": "--status", "--slot": "--slots", "--al": "--all"}.get(argv[1])
    said = (
        f"unknown option {argv[1]}; did you mean {meant}?"  # the one it begins, named
        if meant
        else f"unrecognized arguments: {' '.join(argv[1:])}"
    )
    assert exit_.value.code == 2 and f"nanolab queue {argv[0]}: error: {said}" in err, err
    assert len(err.strip().splitlines()) == 1
    assert [j.status for j in QueueDB(db).jobs()] == ["pending"]


def test_missing_config_and_db_folder(tmp_path: Path, capsys) -> None:
    code, _, err = queue(capsys, tmp_path / "q.db", "add", str(tmp_path / "none.yaml"))
    assert code == 2 and "none.yaml does not exist" in err
    code, _, err = queue(capsys, tmp_path / "no" / "q.db", "ls")
    assert code == 2 and "does not exist; create it or pass --db" in err


def test_an_empty_config_path_is_said_empty(tmp_path: Path, capsys, monkeypatch) -> None:
    """``queue add ''`` said "config . is a folder" (``Path('')`` is this folder); it says the
    config path is empty, as ``fit --config ''`` does, and queues nothing."""
    monkeypatch.chdir(tmp_path)
    for argv in (("add", ""), ("add", "  ")):
        code, _, err = queue(capsys, tmp_path / "q.db", *argv)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "the config path is empty; give a YAML file" in err and "folder" not in err, err
    assert not (tmp_path / "q.db").exists()


# -- database -------------------------------------------------------------------------------
ADDER = """
import sys, time
from nanolab.queue.db import NewJob, QueueDB
db = QueueDB(sys.argv[1])
n = int(sys.argv[3])
for i in range(n):
    if i == n // 2:
        time.sleep(2.0)  # a shell that pauses: the claimers must not take the queue for done
    db.add_jobs([NewJob(name=f"{sys.argv[2]}-{i}", config="c.yaml", args=[], seed=i, cwd="/",
                        run_dir=f"/r/{sys.argv[2]}-{i}")])
"""

CLAIMER = """
import sys, time
from nanolab.queue.db import QueueDB
db = QueueDB(sys.argv[1])
total = int(sys.argv[2])
me = db.register_runner()
claimed = []
deadline = time.monotonic() + 300  # a safety net only: the loop ends on the condition below
# Done when every job the adders will add exists and none is left pending.
while len(db.jobs()) < total or db.jobs(("pending",)):
    assert time.monotonic() < deadline, "jobs were never all added and claimed"
    for job in db.jobs(("pending",)):
        if db.claim(job.id, me, None, time.time()):
            claimed.append(job.id)
            db.finish(job.id, me, "done", None, 0, 0.0)
    time.sleep(0.01)
print(" ".join(map(str, claimed)))
"""


def test_two_shells_add_while_two_runners_claim(tmp_path: Path) -> None:
    """Writers and claimers on separate connections and processes: every job is added once and
    claimed by exactly one runner (claims are one transaction).

    The claimers stop when every job exists and none is pending, not after some idle time: the
    adders pause halfway through, which a clock-based claimer (the old ``idle < 40`` x 10 ms)
    takes for the end of the queue, leaving jobs unclaimed; a loaded machine did the same.
    """
    db = tmp_path / "q.db"
    QueueDB(db)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    n = 40
    claimers = [
        subprocess.Popen(
            [sys.executable, "-c", CLAIMER, str(db), str(2 * n)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    adders = [
        subprocess.Popen([sys.executable, "-c", ADDER, str(db), shell, str(n)], env=env)
        for shell in ("a", "b")
    ]
    assert [p.wait(timeout=120) for p in adders] == [0, 0]
    outs = [p.communicate(timeout=120)[0].split() for p in claimers]
    assert [p.returncode for p in claimers] == [0, 0]
    jobs = QueueDB(db).jobs()
    assert len(jobs) == 2 * n and {j.status for j in jobs} == {"done"}
    claimed = [int(x) for out in outs for x in out]
    assert sorted(claimed) == sorted(j.id for j in jobs)  # each exactly once
    assert all(j.attempts == 1 for j in jobs)


def test_claim_is_exclusive_and_finish_needs_the_owner(tmp_path: Path) -> None:
    db = QueueDB(tmp_path / "q.db")
    (job,) = db.add_jobs([new_job("a")])
    r1, r2 = db.register_runner(), db.register_runner()
    assert db.claim(job.id, r1, "0", time.time())
    assert not db.claim(job.id, r2, "1", time.time())
    assert not db.finish(job.id, r2, "done", None, 0, 1.0)
    assert db.finish(job.id, r1, "done", None, 0, 1.0)
    assert db.get(job.id).status == "done" and db.get(job.id).gpus == "0"


# -- ordering and deadlines -----------------------------------------------------------------
def test_longest_first_and_until(tmp_path: Path) -> None:
    db = QueueDB(tmp_path / "q.db")
    short, long_, unknown, wide = db.add_jobs(
        [new_job("short", estimate_s=60), new_job("long", estimate_s=5000),
         new_job("unknown"), new_job("wide", estimate_s=10, devices=4)]
    )  # fmt: skip
    jobs = [(j, j.estimate_s) for j in (short, long_, unknown, wide)]
    assert [j.name for j, _ in order_jobs(jobs, "longest-first")] == [
        "long",
        "short",
        "wide",
        "unknown",
    ]
    assert [j.name for j, _ in order_jobs(jobs, "fifo")] == ["short", "long", "unknown", "wide"]
    now = 1000.0
    # two GPUs, an hour left: the long job waits for tomorrow, and so does the job with no
    # estimate (it could run through the deadline); the 4-GPU job can never run here
    plan = plan_starts(order_jobs(jobs, "longest-first"), [0, 1], 2, now + 3600, now, gpus=True)
    assert [(j.name, u) for j, u, _ in plan.start] == [("short", [0])]
    assert [j.name for j, _ in plan.deferred] == ["long", "unknown"]
    assert [(j.name, n) for j, n in plan.impossible] == [("wide", 4)]
    # past the deadline nothing starts; without GPUs every job takes one slot
    assert plan_starts(jobs, [0], 1, now - 1, now, gpus=False).start == []
    cpu = plan_starts(jobs, [0, 1, 2], 3, None, now, gpus=False)
    assert [j.name for j, _, _ in cpu.start] == ["short", "long", "unknown"]


def test_add_says_why_a_job_has_no_time_or_memory_estimate(tmp_path: Path) -> None:
    """``queue add`` printed a bare ``~?`` for a job it could not time (and nothing for its
    memory), so nobody knew ``--until`` would hold it back; the reason follows now."""
    from nanolab.queue.cli import added_estimates

    db = QueueDB(tmp_path / "q.db")
    timed, untimed = db.add_jobs([
        new_job("timed", estimate_s=90, mem_peak=3 * 1024**3, mem_source="estimator"),
        new_job("untimed", estimate_source="no estimate: no GPU here to look up (pass --gpu NAME)",
                mem_source="no memory estimate: model.optimizer.name 'lion': its state memory is "
                "not modelled (the estimate covers adamw, adamw8bit, muon)"),
    ])  # fmt: skip
    assert added_estimates(timed) == "~2m, peak 3.00 GiB"
    assert added_estimates(untimed) == (
        "~? (no estimate: no GPU here to look up (pass --gpu NAME)), no memory estimate: "
        "model.optimizer.name 'lion': its state memory is not modelled (the estimate covers "
        "adamw, adamw8bit, muon)"
    )


def test_gpu_names_map_to_the_estimator_table() -> None:
    from nanolab.queue.predict import estimator_gpu

    names = {
        "NVIDIA H200": "h200", "NVIDIA H100 80GB HBM3": "h100", "NVIDIA A100-SXM4-80GB": "a100-80gb",
        "NVIDIA GeForce RTX 4090": "rtx4090", "AMD Instinct MI300X": "mi300x", "NVIDIA L40S": "l40s",
        "NVIDIA L4": "l4", "Some Future Accelerator": None,
    }  # fmt: skip
    assert {n: estimator_gpu(n) for n in names} == names


def test_parse_until() -> None:
    import datetime as dt

    now = dt.datetime(2025, 6, 1, 22, 30).timestamp()
    assert parse_until("08:00", now) == dt.datetime(2025, 6, 2, 8, 0).timestamp()
    assert parse_until("23:15", now) == dt.datetime(2025, 6, 1, 23, 15).timestamp()
    assert parse_until("+8h", now) == now + 8 * 3600
    assert parse_until("+90m", now) == now + 5400
    assert parse_until("2025-06-02T07:30", now) == dt.datetime(2025, 6, 2, 7, 30).timestamp()
    with pytest.raises(QueueError, match="give a time of day"):
        parse_until("tomorrow", now)
    with pytest.raises(QueueError, match=r"--until '2020-01-01' is already past"):
        parse_until("2020-01-01", now)


def test_outcome_from_exit_code_and_end_record(tmp_path: Path) -> None:
    db = QueueDB(tmp_path / "q.db")
    (job,) = db.add_jobs(
        [NewJob(name="a", config="c", args=[], seed=None, cwd="/", run_dir=str(tmp_path / "a"))]
    )
    (tmp_path / "a").mkdir()
    log = tmp_path / "a" / "metrics.jsonl"
    t = time.time()
    assert outcome(job, 0, t) == ("done", None)  # no log at all: the exit code decides
    log.write_text(json.dumps({"event": "end", "time": t, "step": 5, "reason": "budget"}) + "\n")
    assert outcome(job, 0, t) == ("stopped", "budget")
    assert outcome(job, 0, t + 100) == ("done", None)  # an end record of an earlier attempt
    assert outcome(job, 75, t)[0] == "preempted"
    later = t + 100  # an attempt that wrote no end record: the signal decides
    assert outcome(job, -9, later) == ("failed", "killed by SIGKILL (out of memory?)")
    assert outcome(job, -15, later, stopping=True)[0] == "preempted"
    # A signal in the teardown, after the end record (which follows the final checkpoint): the
    # run finished; resuming it again would redo nothing, or start over with run.fresh.
    assert outcome(job, -15, t, stopping=True) == ("stopped", "budget")
    assert outcome(job, -9, t) == ("stopped", "budget")
    log.write_text(json.dumps({"event": "end", "time": t, "step": 5, "reason": "completed"}) + "\n")
    assert outcome(job, -15, t, stopping=True) == ("done", None)
    with log.open("a") as f:
        f.write(json.dumps({"event": "end", "time": t + 1, "step": 5, "reason": "error",
                            "error": "Traceback...\nValueError: boom"}) + "\n")  # fmt: skip
    assert outcome(job, 1, t) == ("failed", "ValueError: boom")


def test_an_exit_74_is_labelled_out_of_room_with_the_runs_own_cause(tmp_path: Path) -> None:
    """Exit 74 is a full disk, a quota or a file-size limit (EFBIG); the queue labelled each
    "disk full: ...", so a job stopped by ``ulimit -f`` read as a full disk."""
    db = QueueDB(tmp_path / "q.db")
    console = tmp_path / "a.log"
    (job,) = db.add_jobs(
        [NewJob(name="a", config="c", args=[], seed=None, cwd="/", run_dir=str(tmp_path / "a"))]
    )
    job = dataclasses.replace(job, log=str(console))
    (tmp_path / "a").mkdir()
    t = time.time()
    limit = (
        "cannot append to the run log a/metrics.jsonl (File too large: this process's file-size "
        "limit (ulimit -f: 8 kB)); the lines written so far and the checkpoints are intact"
    )
    # The run log itself was refused: no end record, the console's error line says why.
    console.write_text(f"step 3/9\nnanolab fit: error: {limit}\n")
    assert outcome(job, 74, t) == ("failed", f"out of room: {limit}")
    # A checkpoint refused: the end record's error says why.
    full = "cannot save a/checkpoints/step_6.ckpt (no space left on device: 1 kB free there)"
    log = tmp_path / "a" / "metrics.jsonl"
    log.write_text(json.dumps({"event": "end", "time": t, "reason": "error", "error": full}) + "\n")
    assert outcome(job, 74, t) == ("failed", f"out of room: {full}")
    console.write_text("")
    log.write_text("")
    status, detail = outcome(job, 74, t)
    assert status == "failed" and "disk" in detail and "file-size limit" in detail


# -- verbs ----------------------------------------------------------------------------------
def test_ls_rm_retry_clear(tmp_path: Path, capsys) -> None:
    path = tmp_path / "q.db"
    db = QueueDB(path)
    _, b, c = db.add_jobs([new_job("a"), new_job("b"), new_job("c")])
    db.set_status(b.id, "failed", detail="ValueError: boom")
    db.set_status(c.id, "done")
    code, out, _ = queue(capsys, path, "ls")
    assert code == 0 and "failed: ValueError: boom" in out and "1 pending, 1 failed, 1 done" in out
    code, out, _ = queue(capsys, path, "ls", "--json", "--status", "failed")
    assert [j["name"] for j in json.loads(out)["jobs"]] == ["b"]
    code, _, err = queue(capsys, path, "ls", "--status", "finished")
    assert code == 2 and "--status 'finished': unknown status; choose from pending, running" in err
    code, _, err = queue(capsys, path, "retry", "c")
    assert code == 2 and "is done" in err
    code, _, err = queue(capsys, path, "retry", "a")
    assert code == 2 and "is pending already" in err
    assert queue(capsys, path, "retry", "b")[0] == 0 and db.get(b.id).status == "pending"
    code, _, err = queue(capsys, path, "rm", "zzz", "99")
    assert code == 2 and "no job 'zzz', '99'" in err
    assert queue(capsys, path, "clear")[0] == 0
    assert [j.name for j in db.jobs()] == ["a", "b"]
    code, out, _ = queue(capsys, path, "rm", "a", str(b.id))
    assert code == 0 and db.jobs() == []
    # a job that never ran has no run directory to keep: said so, not "is kept"
    assert "removed job 1 a (it had not made a run directory)" in out


def test_ls_shows_a_long_error_line_whole_under_its_row(tmp_path: Path, capsys) -> None:
    """ls cut a failed job's status at 70 characters, and the fix was the part cut off: a
    longer one is printed whole on its own line under the row, the table kept narrow."""
    path = tmp_path / "q.db"
    db = QueueDB(path)
    a, b = db.add_jobs([new_job("a"), new_job("b")])
    why = ("config changed since queue add: /home/me/lab/configs/ablation-long-name.yaml "
           "(edited) (the job was checked as it was then); `nanolab queue rm` it and add it again")  # fmt: skip
    db.set_status(a.id, "failed", detail=why)
    db.set_status(b.id, "failed", detail="ValueError: boom")
    code, out, _ = queue(capsys, path, "ls")
    assert code == 0
    lines = out.splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("1 "))
    assert "failed (below)" in lines[row] and lines[row + 1] == f"    failed: {why}"
    assert "failed: ValueError: boom" in out  # a short one stays in its column
    assert max(len(line) for line in lines if line != lines[row + 1]) < 100


def test_a_config_edited_after_add_is_not_run(
    tmp_path: Path, tiny: Path, capsys, monkeypatch
) -> None:
    """The queue runs what ``queue add`` checked or nothing: a config file edited in between
    (lr 9.0) fails the job with one line naming the file, and the job is never started; the
    unedited job of the same queue runs."""
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "q.db"
    other = write_config(tmp_path / "other.yaml", __import__("yaml").safe_load(tiny.read_text()))
    overlay = write_config(tmp_path / "overlay.yaml", {"model": {"optimizer": {"lr": 1e-3}}})
    assert queue(capsys, db, "add", str(tiny), str(overlay), "--name", "edited")[0] == 0
    assert queue(capsys, db, "add", str(other), "--name", "kept")[0] == 0
    tiny.write_text(tiny.read_text() + "model:\n  optimizer:\n    lr: 9.0\n")
    _, out, err = queue(capsys, db, "run")
    jobs = {j.name: j for j in QueueDB(db).jobs()}
    assert jobs["edited"].status == "failed" and jobs["edited"].attempts <= 1
    # Only the file that changed is named, not the overlay the job also reads.
    assert f"config changed since queue add: {tiny.resolve()} (edited) (the job" in (
        jobs["edited"].detail
    )
    assert "overlay.yaml" not in jobs["edited"].detail
    assert not (tmp_path / "runs" / "edited").exists()  # never started
    assert jobs["kept"].status == "done", (out, err)
    # A job's console log is in its run directory (none beside the database).
    assert jobs["kept"].log == str(tmp_path / "runs" / "kept" / "queue.log")
    assert "=== attempt 1" in Path(jobs["kept"].log).read_text()
    assert not (tmp_path / "nanolab_queue_logs").exists()


def test_a_settings_file_given_by_set_is_checked_like_a_config(
    tmp_path: Path, tiny: Path, capsys, monkeypatch
) -> None:
    """``--set data=d.yaml`` (fit's ``--data d.yaml``) is read again at each start: an edit
    after add fails the job naming that file, as an edited config does; the path is taken
    where the job was added, not where the runner runs."""
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "q.db"
    data = yaml.safe_load(tiny.read_text())["data"]
    settings = write_config(tmp_path / "d.yaml", data)
    assert queue(capsys, db, "add", str(tiny), "--name", "inc", "--set", "data=d.yaml")[0] == 0
    settings.write_text(settings.read_text().replace("micro_batch_size: 4", "micro_batch_size: 7"))
    assert "micro_batch_size: 7" in settings.read_text()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # the runner's folder: d.yaml is not here
    queue(capsys, db, "run")
    (job,) = QueueDB(db).jobs()
    assert job.status == "failed" and job.detail is not None
    assert f"config changed since queue add: {settings} (edited)" in job.detail, job.detail
    assert not (tmp_path / "runs" / "inc").exists()


def _start_record(run_dir: Path, when: float, queue_job: str | None) -> None:
    """A run log whose first record is a run's start (what ``nanolab fit`` writes first)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"event": "start", "time": when, "run_name": run_dir.name, "queue_job": queue_job}
    (run_dir / "metrics.jsonl").write_text(json.dumps(record) + "\n")


def test_a_run_begun_in_a_jobs_folder_after_add_is_not_continued(
    tmp_path: Path, tiny: Path, capsys, monkeypatch
) -> None:
    """``nanolab fit --run.name a`` after ``queue add --name a``: the job would resume that run
    (it ended ``done`` on the hand run's steps, under its name). It fails at start with the
    add's refusal instead, and nothing is written into the folder (no queue.log)."""
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "q.db"
    assert queue(capsys, db, "add", str(tiny), "--name", "a")[0] == 0
    run = tmp_path / "runs" / "a"
    _start_record(run, time.time(), None)  # the hand run
    before = (run / "metrics.jsonl").read_bytes()
    queue(capsys, db, "run")
    (job,) = QueueDB(db).jobs()
    assert job.status == "failed" and job.detail is not None
    assert f"{run} is an existing run started by nanolab fit after this job was added" in (
        job.detail
    )
    assert f"`nanolab queue rm {job.id}` and add it again with --continue" in job.detail
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]
    assert (run / "metrics.jsonl").read_bytes() == before


def test_a_job_resumes_its_own_run_and_the_one_add_checked(tmp_path: Path) -> None:
    """Whose run a job may continue at start: its own earlier attempt (preempted, retried)
    and a run there at ``queue add`` (which ``add`` checked); not a run begun after the add
    by hand or by another queue's job of the same id."""
    from nanolab.queue.jobs import foreign_run_at_start

    db = QueueDB(tmp_path / "q.db")
    run = tmp_path / "runs" / "a"
    (job,) = db.add_jobs([NewJob(name="a", config="c.yaml", args=[], seed=None, cwd="/",
                                 run_dir=str(run))])  # fmt: skip
    assert foreign_run_at_start(job) is None  # no folder
    run.mkdir(parents=True)
    (run / "queue.log").write_text("=== attempt 1\n")  # an attempt that died at start-up
    assert foreign_run_at_start(job) is None
    _start_record(run, job.created - 5, None)  # there at add: add refused it or had --continue
    assert foreign_run_at_start(job) is None
    _start_record(run, job.created + 1, str(job.id))  # another queue's job 1, before this one
    assert db.claim(job.id, db.register_runner(), None, job.created + 2)
    job = db.get(job.id)
    assert "started by queue job 1 (not this job) after" in (foreign_run_at_start(job) or "")
    _start_record(run, job.created + 3, str(job.id))  # this job's first attempt
    assert foreign_run_at_start(job) is None
    _start_record(run, job.created + 3, None)  # by hand, after the add
    assert "started by nanolab fit after" in (foreign_run_at_start(job) or "")


@pytest.mark.parametrize(
    ("setting", "said"),
    [
        ("model.optimizer.name=muon", "model.optimizer.name is 'muon' but the checkpoint was "
         "trained with 'adamw'; resume with --model.optimizer.name adamw"),
        ("model.freeze.blocks=1", "was trained with model.freeze.blocks 0 (this run: 1): its "
         "optimizer state cannot continue another set. Resume with --model.freeze.blocks 0"),
        ("model.gpt.n_layer=3", "holds a different model (model.gpt: n_layer 2 in the "
         "checkpoint vs 3 now)"),
    ],
)  # fmt: skip
def test_add_continue_refuses_what_fits_resume_refuses(
    tmp_path: Path, tiny: Path, capsys, monkeypatch, setting: str, said: str
) -> None:
    """``queue add --continue`` of a run whose checkpoint cannot go on under the job's model
    settings is refused at add with fit's own line (exit 2, no database made), not queued to
    fail at night: one rule for both (``optimizer_state_problem``, ``check_same_model``).

    Mutation caught: the queue checking only ``model.gpt`` (muon and a frozen block queued)."""
    from conftest import nanolab_here

    monkeypatch.chdir(tmp_path)
    fit = ("fit", "--config", str(tiny), "--run.name", "a")
    assert nanolab_here(*fit, "--trainer.max_steps", "2", cwd=tmp_path).returncode == 0
    db = tmp_path / "q.db"
    code, _, err = queue(capsys, db, "add", str(tiny), "--name", "a", "--continue",
                         "--set", setting)  # fmt: skip
    (line,) = err.strip().splitlines()
    assert code == 2 and said in line and line.startswith("nanolab queue add: error: --name a"), err
    assert f"the job would continue the run in {tmp_path / 'runs' / 'a'}" in line
    assert not db.exists()
    key, value = setting.split("=")
    res = nanolab_here(*fit, f"--{key}", value, cwd=tmp_path)  # fit refuses it alike
    assert res.returncode == 2 and said.split(": ")[-1] in res.stderr, res.stderr[-2000:]
    # A setting the resume takes from the checkpoint (the learning rate) is queued.
    assert queue(capsys, db, "add", str(tiny), "--name", "a", "--continue",
                 "--set", "model.optimizer.lr=1e-3")[0] == 0  # fmt: skip


def test_add_continue_refuses_data_fits_resume_refuses(
    tmp_path: Path, tiny: Path, char_dataset: Path, capsys, monkeypatch
) -> None:
    """``queue add --continue`` of a run whose checkpoint was trained on other data than the
    job's, or under another ``data.align``, is refused at add with the line fit's DataModule
    gives at the resume (one rule: ``resume_data_problem``, ``align_change``), not queued to
    fail at night; ``data.allow_changed`` (fit's way to go on) is queued.

    Mutation caught: the queue comparing only the model and optimizer (both jobs queued)."""
    import shutil

    import numpy as np
    from conftest import nanolab_here

    monkeypatch.chdir(tmp_path)
    fit = ("fit", "--config", str(tiny), "--run.name", "a", "--trainer.max_steps", "2")
    assert nanolab_here(*fit, cwd=tmp_path).returncode == 0
    other = shutil.copytree(char_dataset, tmp_path / "other")
    rewritten = np.memmap(other / "train.bin", dtype=np.uint16, mode="r+")
    rewritten[:1000] = 1  # same size, other bytes: fit refuses to resume on it
    rewritten.flush()
    del rewritten
    db = tmp_path / "q.db"
    add = ("add", str(tiny), "--name", "a", "--continue")
    code, _, err = queue(capsys, db, *add, "--set", f"data.dataset_dir={other}")
    (line,) = err.strip().splitlines()
    assert code == 2 and line.startswith("nanolab queue add: error: --name a: the data changed")
    assert f"{other / 'train.bin'} has the same size but other bytes" in line, line
    code, _, err = queue(capsys, db, *add, "--set", "data.align=document")
    (line,) = err.strip().splitlines()
    assert code == 2, err
    assert "data.align is document, the checkpoint's run trained with stream" in line, line
    assert not db.exists()
    code, _, err = queue(capsys, db, *add, "--set", f"data.dataset_dir={other}",
                         "--set", "data.allow_changed=true")  # fmt: skip
    assert code == 0, err


def test_add_continue_does_not_compare_data_an_older_checkpoint_does_not_record(
    tmp_path: Path, char_dataset: Path
) -> None:
    """A checkpoint without the DataModule's state (older, or a DataModule's own) is resumed
    by fit on any data: ``queue add`` must not refuse it. One with the state but no
    ``align`` predates the setting: its run cut windows from the stream, as fit reads it."""
    import torch

    from nanolab.data.checks import resume_data_problem

    ckpt = tmp_path / "old.ckpt"
    data = {"dataset_dir": str(tmp_path / "elsewhere"), "align": "document"}
    torch.save({"state_dict": {}}, ckpt)
    assert resume_data_problem(ckpt, "TokenDataModule", data, tmp_path) is None
    torch.save({"TokenDataModule": {"seed": 1}}, ckpt)
    said = resume_data_problem(ckpt, "TokenDataModule", data, tmp_path)
    assert said is not None and "the checkpoint's run trained with stream" in said
    data["align"] = "stream"
    assert resume_data_problem(ckpt, "TokenDataModule", data, tmp_path) is None


@pytest.mark.slow
def test_queue_run_notify_when_drained(tmp_path: Path, tiny: Path, capsys, monkeypatch) -> None:
    """``queue run --notify`` fires once when the queue is drained, its fields filled in; an
    unknown field is refused before anything runs."""
    monkeypatch.chdir(tmp_path)
    db, told = tmp_path / "q.db", tmp_path / "told.txt"
    recorder = (
        f"{sys.executable} -c \"import sys; open(sys.argv[1], 'a').write(' '.join(sys.argv[2:]))\""
    )
    assert queue(capsys, db, "add", str(tiny), "--name", "one")[0] == 0
    code, _, err = queue(capsys, db, "run", "--notify", "echo {jobs}")
    assert code == 2 and "--notify[0] names {jobs}" in err
    code, _, err = queue(
        capsys, db, "run", "--notify", f"{recorder} {told} {{reason}} {{done}} {{failed}}"
    )
    assert code == 0, err
    assert told.read_text() == "drained 1 0"


@pytest.mark.slow  # default: test_a_config_edited_after_add_is_not_run (its kept job's log)
def test_a_jobs_console_log_is_in_its_run_directory(
    tmp_path: Path, tiny: Path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "q.db"
    assert queue(capsys, db, "add", str(tiny), "--name", "one")[0] == 0
    assert queue(capsys, db, "run")[0] == 0
    (job,) = QueueDB(db).jobs()
    assert job.log == str(tmp_path / "runs" / "one" / "queue.log")
    assert "=== attempt 1" in Path(job.log).read_text()
    assert not (tmp_path / "nanolab_queue_logs").exists()


@pytest.mark.slow  # a row of a kind the default run covers (the suite's time)
def test_a_job_whose_log_cannot_be_opened_fails_with_why_and_the_next_runs(
    tmp_path: Path, tiny: Path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "q.db"
    assert queue(capsys, db, "add", str(tiny), "--name", "blocked")[0] == 0
    assert queue(capsys, db, "add", str(tiny), "--name", "fine")[0] == 0
    (tmp_path / "runs" / "blocked" / "queue.log").mkdir(parents=True)  # a folder in its place
    code, _, err = queue(capsys, db, "run")
    assert code == 1, err  # a job it ran failed
    jobs = {j.name: j for j in QueueDB(db).jobs()}
    assert jobs["blocked"].status == "failed" and "cannot open its log" in jobs["blocked"].detail
    assert jobs["fine"].status == "done"


def test_a_job_row_edited_by_hand_is_named_and_rm_still_removes_it(tmp_path: Path, capsys):
    import sqlite3

    db = tmp_path / "q.db"
    q = QueueDB(db)
    q.add_jobs([new_job("a"), new_job("b")])
    q.close()
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE jobs SET args = '[1, 2' WHERE name = 'a'")
    code, _, err = queue(capsys, db, "ls")
    assert code == 2 and "job 1 (a) has arguments that are not a JSON list of strings" in err
    code, out, _ = queue(capsys, db, "rm", "1")
    assert code == 0 and "removed job 1 (a damaged row)" in out
    assert [j.name for j in QueueDB(db).jobs()] == ["b"]


@pytest.mark.parametrize("verb", [["rm", "1"], ["retry", "1"], ["clear"]])
def test_a_mistyped_db_is_one_line_and_leaves_no_database(tmp_path, verb, capsys) -> None:
    """``queue rm/retry/clear`` on a --db that does not exist: one line, exit 2, and no empty
    database created at the typo (README: bad input writes nothing)."""
    from nanolab.queue.cli import main

    typo = tmp_path / "nanolab_queu.db"
    assert main([*verb, "--db", str(typo)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"no queue database at {typo}" in err[0]
    assert not typo.exists()


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["ls", "--bogus"], "unrecognized arguments: --bogus"),
        (["ls", "stray"], "unrecognized arguments: stray"),
        (["rm", "1", "--al"], "unrecognized arguments: --al"),
        (["retry", "1", "--bogus"], "unrecognized arguments: --bogus"),
        (["clear", "--bogus"], "unrecognized arguments: --bogus"),
        (["run", "--gpu", "2"], "unknown option --gpu; did you mean --gpus?"),
        (["add", "c.yaml", "--name", "x", "stray"], "unrecognized arguments: stray"),
    ],
)
def test_an_argument_a_verb_lacks_points_to_that_verbs_own_help(
    tmp_path: Path, capsys, argv: list[str], said: str
) -> None:
    """``queue ls --bogus`` said "nanolab queue: error: ...; see `nanolab queue --help`", which
    lists the verbs, not ls's options: the line names the verb and its own help (true: that
    help exists), or the nearest option of its own when one is close (the line ends there)."""
    verb = argv[0]
    with pytest.raises(SystemExit) as ended:
        main([*argv, "--db", str(tmp_path / "q.db")])
    assert ended.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    pointer = "" if "did you mean" in said else f"; see `nanolab queue {verb} --help`"
    assert line == f"nanolab queue {verb}: error: {said}{pointer}"
    with pytest.raises(SystemExit) as helped:
        main([verb, "--help"])
    assert helped.value.code == 0 and f"usage: nanolab queue {verb}" in capsys.readouterr().out
    assert not (tmp_path / "q.db").exists()


def test_add_set_followed_by_an_option_says_what_set_needs(tmp_path: Path, capsys) -> None:
    """``queue add c.yaml --set --db q.db`` advised "--set --db: write KEY=VALUE, e.g. --set
    --db=q.db", a setting that does not exist."""
    code, _, err = queue(capsys, tmp_path / "q.db", "add", "c.yaml", "--set", "--seeds", "1")
    assert code == 2 and err.strip() == (
        "nanolab queue add: error: --set needs KEY=VALUE before --seeds, e.g. --set "
        "trainer.max_steps=600"
    )


def test_a_config_that_changed_since_add_is_named_with_what_became_of_it(tmp_path: Path):
    from nanolab.queue.jobs import changed_config, config_digest

    kept, edited, gone, folder = (tmp_path / f"{n}.yaml" for n in ("kept", "edited", "gone", "dir"))
    for f in (kept, edited, gone, folder):
        f.write_text("a: 1\n")
    sha = config_digest([kept, edited, gone, folder])
    edited.write_text("a: 2\n")
    gone.unlink()
    folder.unlink()
    folder.mkdir()
    args = ["--config", str(edited), "--config", str(gone), "--config", str(folder)]
    assert changed_config(kept, args, sha) == (
        f"{edited} (edited), {gone} (gone), {folder} (now a folder)"
    )


def _gone_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_job_whose_runner_died_says_so_in_ls_and_retry(tmp_path: Path, capsys) -> None:
    """The runner was killed (or ran out of memory) while its job ran: the morning's ``queue ls``
    says the runner is gone and that ``queue run`` resumes the job, and ``queue retry`` says the
    same instead of "running already". A live runner's job is plainly running."""
    path = tmp_path / "q.db"
    db = QueueDB(path)
    (job,) = db.add_jobs([new_job("night")])
    runner = db.register_runner()
    assert db.claim(job.id, runner, None, time.time())
    code, out, _ = queue(capsys, path, "ls")
    assert code == 0 and "runner is gone" not in out
    with db.transaction() as c:  # killed: no process, no heartbeat for a minute
        c.execute(
            "UPDATE runners SET pid = ?, heartbeat = ? WHERE id = ?",
            (_gone_pid(), time.time() - 60, runner),
        )
    code, out, _ = queue(capsys, path, "ls")
    assert code == 0 and "running: its runner is gone; `queue run` resumes it" in out, out
    code, out, _ = queue(capsys, path, "ls", "--json")
    assert json.loads(out)["jobs"][0]["runner_gone"] is True
    from nanolab.queue.status import main as status

    (tmp_path / "runs").mkdir()  # a folder named to status exists (a typo is refused)
    assert status([str(tmp_path / "runs"), "--db", str(path), "--json"]) == 0
    queued = json.loads(capsys.readouterr().out)["queued"]
    assert [j["status"] for j in queued] == ["runner gone: queue run resumes it"]
    code, _, err = queue(capsys, path, "retry", "night")
    assert code == 2 and "`nanolab queue run` recovers it and resumes it" in err, err
    assert QueueDB(path).jobs()[0].status == "running"  # nothing changed


def test_a_stopped_runners_silence_is_shown_in_ls_and_status(tmp_path: Path, capsys) -> None:
    """A runner stopped by SIGSTOP (Ctrl-Z) keeps its process, so it keeps its jobs, and
    nothing said why they sat still. ``queue ls`` and ``status`` now say how long it has not
    beaten once that is over three intervals (and, seen from its host, that it is stopped);
    who owns the job is not changed."""
    from nanolab.processes import pid_namespace, process_start
    from nanolab.queue.status import main as status

    path = tmp_path / "q.db"
    db = QueueDB(path)
    (job,) = db.add_jobs([new_job("night")])
    runner = db.register_runner()
    assert db.claim(job.id, runner, None, time.time())
    stand_in = subprocess.Popen(["sleep", "60"])  # the runner's process, stopped below
    try:
        with db.transaction() as c:
            c.execute("UPDATE runners SET pid = ?, pid_start = ?, pid_namespace = ? WHERE id = ?",
                      (stand_in.pid, process_start(stand_in.pid), pid_namespace(), runner))  # fmt: skip
        code, out, _ = queue(capsys, path, "ls")
        assert code == 0 and "heartbeat" not in out, out  # beating: nothing to say
        os.kill(stand_in.pid, signal.SIGSTOP)
        with db.transaction() as c:  # 12 minutes without a heartbeat
            c.execute("UPDATE runners SET heartbeat = ? WHERE id = ?", (time.time() - 720, runner))
        line = (
            f"runner pid {stand_in.pid}: no heartbeat for 12m00s (stopped by a signal: "
            f"`kill -CONT {stand_in.pid}` resumes it)"
        )
        code, out, _ = queue(capsys, path, "ls")
        assert code == 0 and out.rstrip().splitlines()[-1] == line, out
        assert "running: its runner is gone" not in out  # still its own
        code, out, _ = queue(capsys, path, "ls", "--json")
        (silent,) = json.loads(out)["silent_runners"]
        assert silent["pid"] == stand_in.pid and silent["line"] == line
        (tmp_path / "runs").mkdir()
        assert status([str(tmp_path / "runs"), "--db", str(path)]) == 0
        assert f"  {line}" in capsys.readouterr().out
        os.kill(stand_in.pid, signal.SIGCONT)  # runs again but still silent: a question only
        code, out, _ = queue(capsys, path, "ls")
        assert out.rstrip().endswith(
            f"runner pid {stand_in.pid}: no heartbeat for 12m00s (stopped?)"
        )
        job_now = QueueDB(path).jobs()[0]
        assert (job_now.status, job_now.runner_id) == ("running", runner)  # owner unchanged
    finally:
        stand_in.kill()
        stand_in.wait()


def test_a_group_of_one_config_under_unrelated_names_lists_every_name() -> None:
    """Jobs of one config added under names with nothing in common: the group is labelled by
    all of them, not by the first (``edited: 2 jobs`` listed ``late`` under ``edited``)."""
    from nanolab.queue.cli import group_header
    from nanolab.queue.db import Job

    def job(name: str, status: str) -> Job:
        fields = dict.fromkeys(Job.__dataclass_fields__)
        return Job(**{**fields, "name": name, "status": status, "seed": None})

    assert group_header([job("edited", "failed"), job("late", "done")]) == (
        "edited, late: 2 jobs: 1 failed, 1 done"
    )
    assert group_header([job("lr-a", "done"), job("lr-b", "done")]).startswith("lr: 2 jobs")


def test_a_group_header_counts_the_jobs_it_groups(tmp_path: Path, capsys) -> None:
    """One config added as ``--name a --seeds 1,2``, then as ``b`` and ``c`` with no seed: the
    header said ``a, b, c: 2 seeds (1, 2): 4 pending`` over four jobs; it says ``4 jobs``."""
    from nanolab.queue.cli import group_header
    from nanolab.queue.db import Job

    def job(name: str, seed: int | None) -> Job:
        fields = dict.fromkeys(Job.__dataclass_fields__)
        return Job(**{**fields, "name": name, "status": "pending", "seed": seed})

    mixed = [job("a-s1", 1), job("a-s2", 2), job("b", None), job("c", None)]
    assert group_header(mixed) == "a, b, c: 4 jobs: 4 pending"
    twice = [job("a-s1", 1), job("a-s2", 2), job("b-s1", 1), job("b-s2", 2)]
    assert group_header(twice) == "a, b: 4 jobs: 4 pending"
    assert group_header(mixed[:2]) == "a: 2 seeds (1, 2): 2 pending"


def test_an_empty_until_is_refused(tmp_path: Path, capsys) -> None:
    """``--until ''`` (an unset shell variable) is refused in one line; it was ignored, and the
    runner started jobs with no deadline at all."""
    code, _, err = queue(capsys, tmp_path / "q.db", "run", "--until", "")
    assert code == 2 and "--until '': give a time of day" in err, err


@pytest.mark.parametrize(("gpu", "said"), [("nope", "unknown GPU 'nope'"), ("", "--gpu is empty")])
def test_add_refuses_a_gpu_the_estimator_does_not_know(tmp_path: Path, gpu: str, said: str) -> None:
    """``--gpu`` names the device of the job's estimate: an unknown name is refused as
    ``estimate --gpu`` refuses it, before the config is read, not a silent ``~?``."""
    from conftest import nanolab_here

    proc = nanolab_here("queue", "add", "--db", "q.db", "x.yaml", "--gpu", gpu, cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and said in lines[0], proc.stderr
    assert "--gpu-mem" not in lines[0] and not (tmp_path / "q.db").exists()


def test_a_job_removed_while_its_runner_starts_it_is_stopped(
    tmp_path: Path, tiny: Path, capsys, monkeypatch
) -> None:
    """``queue rm`` between the runner's claim and its recording the job's pid had no pid to
    signal: it deleted the row and the job trained to its end, unseen. The runner now stops a
    job whose row is gone; here rm runs at exactly that moment (after the claim, before the
    process starts) and the job never trains."""
    import io

    from nanolab.queue.runner import Runner

    monkeypatch.chdir(tmp_path)
    db = tmp_path / "q.db"
    assert queue(capsys, db, "add", str(tiny), "--name", "racer")[0] == 0
    removed: list[str] = []

    class RmWhileStarting(Runner):
        def _spawn(self, job, *args, **kw) -> None:
            assert job.status == "running" and job.job_pid is None  # claimed, no process yet
            removed.append(queue(capsys, db, "rm", job.name)[1])
            super()._spawn(job, *args, **kw)

    said = io.StringIO()
    assert RmWhileStarting(QueueDB(db), out=said).run() == 0
    assert "racer: starting; its runner stops it as soon as it has started" in removed[0]
    assert "racer: removed from the queue as it started; asked it to checkpoint" in said.getvalue()
    assert "it was removed from the queue meanwhile" in said.getvalue()
    assert not (tmp_path / "runs" / "racer" / "checkpoints").exists()  # it never trained
    assert QueueDB(db).jobs() == []


def test_rm_deletes_a_row_only_as_it_saw_it(tmp_path: Path) -> None:
    """rm reads a starting job without a pid (nothing to signal), a runner then records the
    pid: rm's delete must miss, so rm reads the row again and signals the job itself; and a
    runner whose pid lands on a deleted row learns so and stops the job. Each job is asked to
    stop once: a second SIGTERM ends a run at once, without its checkpoint."""
    path = tmp_path / "q.db"
    db = QueueDB(path)
    (job,) = db.add_jobs([NewJob(name="a", config="a.yaml", args=[], seed=None, cwd=str(tmp_path),
                                 run_dir=str(tmp_path / "runs" / "a"), config_sha="x")])  # fmt: skip
    job_id = job.id
    assert db.set_status(job_id, "running")
    assert db.set_job_pid(job_id, 4242, "log")  # recorded after rm's read of "no pid"
    assert not db.remove_as_seen(job_id, None)  # so rm's delete misses
    assert db.remove_as_seen(job_id, 4242)  # and succeeds once rm saw (and signalled) the pid
    assert not db.set_job_pid(job_id, 4243, "log")  # a pid for a deleted row: not recorded


def test_a_runner_whose_claim_another_runner_won_goes_on_with_the_next_job(tmp_path: Path) -> None:
    """Two runners started together on one queue: the one whose claim lost the race quit at once
    ("no jobs run; 2 job(s) waiting"), for with nothing of its own running its loop ended. A lost
    claim now leads to another round; here the other runner's claim lands between this one's
    reading the queue and its claim, through the real database."""
    import io

    from nanolab.queue.runner import Runner

    path = tmp_path / "q.db"
    # Jobs whose config is gone since add: claimed and then not started (no process needed).
    gone = [
        NewJob(name=n, config="gone.yaml", args=[], seed=None, cwd=str(tmp_path),
               run_dir=str(tmp_path / "runs" / n), config_sha="before")
        for n in ("a", "b", "c")
    ]  # fmt: skip
    first, *rest = QueueDB(path).add_jobs(gone)
    other = QueueDB(path)
    quicker = other.register_runner()

    class Late(Runner):
        def _claim_and_spawn(self, job, *args, **kw) -> bool:
            if job.id == first.id:  # the other runner claims it first
                assert other.claim(job.id, quicker, None, time.time())
            return super()._claim_and_spawn(job, *args, **kw)

    said = io.StringIO()
    late = Late(QueueDB(path), out=said)
    assert late.run() == 1  # the jobs it ran failed (their config is gone)
    jobs = {j.id: j for j in QueueDB(path).jobs()}
    assert jobs[first.id].runner_id == quicker
    assert [jobs[j.id].runner_id for j in rest] == [late.runner_id] * 2, said.getvalue()
    assert "0 job(s) waiting" in said.getvalue()


def _read_only_verbs_said(capsys, path: Path, said: str) -> None:
    """``ls`` lists the queue; every verb that changes it is one line saying what is read-only
    (never the damaged-file advice to move a healthy queue aside), and nothing changed."""
    code, out, err = queue(capsys, path, "ls")
    assert code == 0 and "1   a" in out and "1 pending" in out, err
    assert queue(capsys, path, "ls", "--json")[0] == 0
    for verb in (["rm", "a"], ["retry", "a"], ["clear", "--all"], ["run"]):
        code, _, err = queue(capsys, path, *verb)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and said in lines[0], err
        assert "`nanolab queue ls` still reads it" in lines[0] and "move it aside" not in lines[0]
    assert [(j.name, j.status) for j in QueueDB.read_only(path).jobs()] == [("a", "pending")]


def test_a_read_only_queue_file_is_said_so_and_ls_still_reads_it(tmp_path: Path, capsys) -> None:
    """A read-only queue database was called "damaged or not SQLite ... move it aside and queue
    the jobs again", by every verb, ``ls`` included. Read-only to root too: chmod does not stop
    root, the immutable attribute does."""
    path = tmp_path / "q.db"
    db = QueueDB(path)
    db.add_jobs([new_job("a")])
    db.close()  # no descriptor open for writing is left in this process for SQLite to reuse
    path.chmod(0o444)
    immutable = os.geteuid() == 0
    if immutable and subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode:
        pytest.skip("root, and no chattr +i here to make a file read-only to root")
    try:
        _read_only_verbs_said(capsys, path, f"the queue database {path} is a read-only file")
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(path)], check=True)


def test_a_queue_on_a_read_only_file_system_is_said_so_with_its_mount(
    tmp_path: Path, capsys
) -> None:
    """``mount -o remount,ro``: SQLite cannot make the queue's -shm file ("unable to open database
    file"), which was taken for damage. The line names the read-only mount."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(folder)],
                      capture_output=True).returncode:  # fmt: skip
        pytest.skip("mounting a file system needs root")
    try:
        path = folder / "q.db"
        db = QueueDB(path)
        db.add_jobs([new_job("a")])
        db.close()
        subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
        said = f"is on a read-only file system ({folder} is mounted read-only)"
        _read_only_verbs_said(capsys, path, said)
        # No queue there at all: not "left untouched" nor "ls still reads it".
        code, _, err = queue(capsys, folder / "none.db", "ls")
        assert code == 2 and f"there is no queue database at {folder / 'none.db'}" in err, err
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def test_a_queue_on_a_read_only_bind_mount_names_that_mount(tmp_path: Path, capsys) -> None:
    """A read-only bind mount shares its device with the writable file system it shows, so
    walking up while the device stays the same named that file system's root (``/``) as the
    mount to remount read-write. The mount named is the bind's own."""
    src, bound = tmp_path / "src", tmp_path / "bound"
    src.mkdir()
    bound.mkdir()
    db = QueueDB(src / "q.db")
    db.add_jobs([new_job("a")])
    db.close()
    if subprocess.run(["mount", "--bind", str(src), str(bound)], capture_output=True).returncode:
        pytest.skip("a bind mount needs root")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(bound)], check=True)
        code, _, err = queue(capsys, bound / "q.db", "add", "x.yaml")
        assert code == 2 and f"({bound} is mounted read-only)" in err, err
    finally:
        subprocess.run(["umount", "-l", str(bound)], check=True)


def test_a_failed_jobs_long_error_line_is_kept_whole(tmp_path: Path, capsys) -> None:
    """A failed job's error line was cut at 300 characters, and its end, the fix, was what was
    cut; ``ls`` promises the line whole. Only an absurd line (past ERROR_LINE_MAX) is cut."""
    from nanolab.queue.runner import ERROR_LINE_MAX

    path = tmp_path / "q.db"
    db = QueueDB(path)
    run_dir = tmp_path / "a"
    run_dir.mkdir()
    (job,) = db.add_jobs(
        [NewJob(name="a", config="c", args=[], seed=None, cwd="/", run_dir=str(run_dir))]
    )
    fix = "; pass --data.dataset_dir with a prepared dataset (nanolab prepare) and retry"
    line = "nanolab fit: error: data.dataset_dir " + "/very/long/folder" * 25 + " is empty" + fix
    assert len(line) > 400
    log = run_dir / "queue.log"
    log.write_text(f"=== attempt 1\nloading\n{line}\n")
    job.log = str(log)
    t = time.time()
    assert outcome(job, 2, t) == ("failed", line)  # from its console log
    (run_dir / "metrics.jsonl").write_text(
        json.dumps({"event": "end", "time": t, "reason": "error", "error": f"Trace\n{line}"}) + "\n"
    )
    assert outcome(job, 1, t) == ("failed", line)  # from its run log's end record
    db.set_status(job.id, "failed", detail=outcome(job, 1, t)[1])
    assert f"    failed: {line}" in queue(capsys, path, "ls")[1]
    log.write_text("x" * (ERROR_LINE_MAX * 3) + "\n")
    assert len(outcome(job, 2, t + 100)[1]) == ERROR_LINE_MAX


def test_a_failed_job_that_printed_no_error_line_says_so(tmp_path: Path) -> None:
    """An attempt that exited without a word (a prepare's broken pipe once ended in a silent
    exit 141) was labelled with the runner's header line, its own command line; and an attempt
    is never labelled with an earlier attempt's error."""
    run_dir = tmp_path / "a"
    run_dir.mkdir()
    (job,) = QueueDB(tmp_path / "q.db").add_jobs(
        [NewJob(name="a", config="c", args=[], seed=None, cwd="/", run_dir=str(run_dir))]
    )
    log = run_dir / "queue.log"
    job.log = str(log)
    header = "=== attempt {} at Mon Dec  7 00:10:01 2026 on slot 0: nanolab fit --config c"
    log.write_text(f"\n{header.format(1)}\n")
    assert outcome(job, 141, time.time()) == ("failed", "exited 141 without an error line")
    line = "nanolab fit: error: data.source: empty document; remove it"
    log.write_text(f"\n{header.format(1)}\n{line}\n\n{header.format(2)}\n")
    assert outcome(job, 1, time.time()) == ("failed", "exited 1 without an error line")
    log.write_text(f"\n{header.format(1)}\n{line}\n")
    assert outcome(job, 2, time.time()) == ("failed", line)


def test_a_job_whose_run_directory_moved_as_it_ran_fails_with_its_own_reason(
    tmp_path: Path,
) -> None:
    """A job whose run directory was moved while it ran was shown as ``failed: exit code 2``:
    its error line was read back by path from ``queue.log``, which had moved with the folder.
    The runner reads it through the handle it gave the job; here the job (a stand-in process
    writing as ``fit`` does) moves its own folder, says why on its console and exits 2."""
    import io

    from nanolab.queue.runner import Active, Runner, job_log_path

    path = tmp_path / "q.db"
    db = QueueDB(path)
    run_dir, moved = tmp_path / "runs" / "a", tmp_path / "runs" / "moved"
    (job,) = db.add_jobs(
        [NewJob(name="a", config="c", args=[], seed=None, cwd="/", run_dir=str(run_dir))]
    )
    runner = Runner(db, out=io.StringIO())
    runner.runner_id = db.register_runner()
    assert db.claim(job.id, runner.runner_id, None, time.time())
    why = f"nanolab fit: error: {run_dir} is gone (a link or a move since this run claimed it)"
    log_path = job_log_path(job, path)
    log = open(log_path, "a+b")  # noqa: SIM115 - as the runner opens it; reap closes it
    script = f"import os; os.rename({str(run_dir)!r}, {str(moved)!r}); print({why!r}); exit(2)"
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=log, stderr=subprocess.STDOUT)
    started = time.time()
    proc.wait(timeout=60)
    db.set_job_pid(job.id, proc.pid, str(log_path))
    runner._active[job.id] = Active(db.get(job.id), proc, [0], started, log)
    runner.reap()
    assert not run_dir.exists() and why in (moved / "queue.log").read_text()
    (done,) = db.jobs()
    assert (done.status, done.detail, done.exit_code) == ("failed", why, 2)


def test_the_runners_summary_and_notify_count_jobs_not_attempts(tmp_path: Path, capsys) -> None:
    """A job that failed, was retried (``queue retry`` from another shell) and failed again was
    counted twice: "2 failed" and ``{failed}`` 2 for one job. Each job now counts once, by its
    last outcome. The job fails without a process (its config is gone since add)."""
    import io

    from nanolab.queue.runner import Runner

    path = tmp_path / "q.db"
    told = tmp_path / "told.txt"
    QueueDB(path).add_jobs(
        [NewJob(name="flaky", config="gone.yaml", args=[], seed=None, cwd=str(tmp_path),
                run_dir=str(tmp_path / "runs" / "flaky"), config_sha="before")]
    )  # fmt: skip

    class RetriedOnce(Runner):
        def _not_started(self, job, detail: str) -> None:
            super()._not_started(job, detail)
            if job.attempts == 1:
                assert queue(capsys, path, "retry", job.name)[0] == 0

    recorder = f"{sys.executable} -c \"import sys; open(sys.argv[1], 'w').write(sys.argv[2])\""
    said = io.StringIO()
    runner = RetriedOnce(QueueDB(path), out=said, notify=[f"{recorder} {told} {{failed}}"])
    assert runner.run() == 1  # a job it ran ended failed
    assert QueueDB(path).jobs()[0].attempts == 2
    assert "done: 1 failed; 0 job(s) waiting" in said.getvalue()
    assert told.read_text() == "1"


def test_queue_run_exits_1_when_a_job_it_ran_failed(tmp_path: Path, capsys) -> None:
    """``queue run`` exited 0 when the only job it ran failed, so ``queue run && notify-send
    done`` said done over a failed night. It exits 1 when a job it ran ended failed (0 when all
    are done, 75 when stopped by a signal), and ``queue run --help`` says so."""
    path = tmp_path / "q.db"
    QueueDB(path).add_jobs(
        [NewJob(name="gone", config="gone.yaml", args=[], seed=None, cwd=str(tmp_path),
                run_dir=str(tmp_path / "runs" / "gone"), config_sha="before")]
    )  # fmt: skip
    code, out, _ = queue(capsys, path, "run")
    assert code == 1, out
    assert "runner 1 done: 1 failed; 0 job(s) waiting" in out, out
    assert QueueDB(path).jobs()[0].status == "failed"
    code, out, _ = queue(capsys, path, "run")  # nothing left to run: nothing failed
    assert code == 0 and "no jobs run" in out, out
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "1 when any job it ran ended failed" in text and "75 when stopped by a signal" in text


def test_a_job_that_cannot_be_started_counts_as_failed_and_the_queue_goes_on(tmp_path) -> None:
    """A job whose process could not be started (its folder gone: the OS refused the start)
    was marked failed, but the runner neither counted it (its end line said "no jobs run",
    exit 0) nor started the next job: with nothing running it took the queue for done."""
    import io

    from nanolab.queue.runner import Runner

    path = tmp_path / "q.db"
    QueueDB(path).add_jobs(
        [NewJob(name=n, config="c.yaml", args=[], seed=None, cwd=str(tmp_path / "gone"),
                run_dir=str(tmp_path / "runs" / n)) for n in ("a", "b")]
    )  # fmt: skip
    said = io.StringIO()
    assert Runner(QueueDB(path), out=said).run() == 1, said.getvalue()
    assert [j.status for j in QueueDB(path).jobs()] == ["failed", "failed"], said.getvalue()
    assert "done: 2 failed; 0 job(s) waiting" in said.getvalue(), said.getvalue()


def test_unclaim_puts_back_only_the_claim_it_made(tmp_path: Path) -> None:
    """A refused start puts the job back as it was read, attempt not counted; a row written
    since (read stale) is left to the runner, which makes it claimable another way."""
    from dataclasses import replace

    db = QueueDB(tmp_path / "q.db")
    (job,) = db.add_jobs([NewJob(name="a", config="c.yaml", args=[], seed=None,
                                 cwd=str(tmp_path), run_dir=str(tmp_path / "runs" / "a"))])  # fmt: skip
    runner_id = db.register_runner()
    assert db.claim(job.id, runner_id, None, time.time())
    assert not db.unclaim(replace(job, attempts=5), runner_id, "no")
    assert not db.unclaim(job, runner_id + 1, "no")
    assert db.unclaim(job, runner_id, "refused")
    row = db.get(job.id)
    assert (row.status, row.attempts, row.runner_id, row.detail) == ("pending", 0, None, "refused")


def test_options_an_earlier_release_completed_run_whole(tmp_path, monkeypatch) -> None:
    """A job queued before fit matched options whole (``--set seed=7``: its fit completed it to
    seed_everything) failed at launch with "unknown option". The runner now writes such an
    option whole, says so once and keeps it so; ambiguous and unknown ones stay as stored."""
    import errno
    import io

    from nanolab.queue import runner as runner_mod
    from nanolab.queue.jobs import complete_abbreviations

    known = frozenset({"seed_everything", "ckpt_path", "data.seed", "trainer.max_steps",
                       "trainer.max_epochs", "model.gpt.n_layer"})  # fmt: skip
    args = ["--seed=7", "--ckpt=a.ckpt", "--trainer.max_=1", "--data.seed=2", "--nope=1",
            "--model.gpt.n_layer=2", "--c=x"]  # fmt: skip
    done, notes = complete_abbreviations(args, known)
    assert done == ["--seed_everything=7", "--ckpt_path=a.ckpt", *args[2:]]
    assert notes == ["--seed as --seed_everything", "--ckpt as --ckpt_path"]

    started: list[list[str]] = []

    def popen(cmd, **kwargs):
        started.append(cmd)
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", kwargs["cwd"])

    monkeypatch.setattr(runner_mod.subprocess, "Popen", popen)
    monkeypatch.setattr(runner_mod, "fit_settings", lambda: known)
    path = tmp_path / "q.db"
    QueueDB(path).add_jobs([NewJob(name="old", config="c.yaml", args=["--seed=7"], seed=None,
                                   cwd=str(tmp_path), run_dir=str(tmp_path / "runs" / "old"))])  # fmt: skip
    said = io.StringIO()
    runner_mod.Runner(QueueDB(path), out=said).run()
    assert "--seed_everything=7" in started[0] and "--seed=7" not in started[0]
    assert QueueDB(path).get(1).args == ["--seed_everything=7"]
    assert said.getvalue().count("runs --seed as --seed_everything") == 1, said.getvalue()


@pytest.mark.parametrize("pack", [False, True])
def test_a_process_the_machine_refuses_leaves_the_jobs_waiting(tmp_path, monkeypatch, pack) -> None:
    """EAGAIN from a full process table (or ENOMEM) is the machine's, not the job's: every
    pending job was marked failed within milliseconds. Now the job waits again (its attempt not
    counted), the runner tries again with backoff, then stops starting jobs in one line, exit 75
    (run it again)."""
    import errno
    import io

    from nanolab.queue import runner as runner_mod

    tries: list[float] = []

    def refused(*args, **kwargs):
        tries.append(time.monotonic())
        raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")

    monkeypatch.setattr(runner_mod.subprocess, "Popen", refused)
    path = tmp_path / "q.db"
    QueueDB(path).add_jobs(
        [NewJob(name=n, config="c.yaml", args=[], seed=None, cwd=str(tmp_path),
                run_dir=str(tmp_path / "runs" / n)) for n in ("a", "b", "c")]
    )  # fmt: skip
    said = io.StringIO()
    runner = runner_mod.Runner(
        QueueDB(path), out=said, poll_s=0.01, start_retry_s=0.05, start_patience_s=0.3, pack=pack,
        device_mem=1 << 34,
    )  # fmt: skip
    assert runner.run() == 75, said.getvalue()
    jobs = QueueDB(path).jobs()
    assert [(j.status, j.attempts) for j in jobs] == [("pending", 0)] * 3, said.getvalue()
    assert "this machine could not start a process" in (jobs[0].detail or "")
    assert len(tries) >= 3 and tries[1] - tries[0] >= 0.04, said.getvalue()  # backed off
    lines = said.getvalue().splitlines()
    assert sum("cannot start job processes on this machine" in line for line in lines) == 1
    assert "3 job(s) waiting" in lines[-1] and "failed" not in lines[-1], lines[-1]


def test_a_child_failing_before_exec_fails_its_job_and_the_runner_goes_on(tmp_path, monkeypatch):
    """``Popen`` raises ``SubprocessError`` when the child's ``preexec_fn`` fails (the parent
    death signal the runner arranges): it was uncaught, and the runner died with a traceback,
    its job left running under it. The job now fails in one line (in its log too), the next
    job starts, nothing else changes."""
    import io

    from nanolab.queue import runner as runner_mod

    real = subprocess.Popen
    started: list[str] = []

    def broken() -> None:
        raise RuntimeError("prctl failed")

    def popen(cmd, **kwargs):  # the job's command stands in as `true`; its set-up as given
        started.append(next(a for a in cmd if a.startswith("--run.name=")))
        if len(started) == 1:
            kwargs["preexec_fn"] = broken
        return real(["true"], **kwargs)

    monkeypatch.setattr(runner_mod.subprocess, "Popen", popen)
    path = tmp_path / "q.db"
    QueueDB(path).add_jobs(
        [NewJob(name=n, config="c.yaml", args=[], seed=None, cwd=str(tmp_path),
                run_dir=str(tmp_path / "runs" / n)) for n in ("a", "b")]
    )  # fmt: skip
    said = io.StringIO()
    runner_mod.Runner(QueueDB(path), out=said, poll_s=0.01).run()
    a, b = QueueDB(path).jobs()
    assert started == ["--run.name=a", "--run.name=b"], said.getvalue()
    assert a.status == "failed" and a.detail is not None
    assert a.detail.startswith("could not start: its process failed before fit could run ")
    assert "`nanolab queue retry` it" in a.detail and "\n" not in a.detail
    assert b.attempts == 1 and b.status != "running", said.getvalue()
    assert "not started: its process failed" in (tmp_path / "runs" / "a" / "queue.log").read_text()
    assert "job 1 a: failed to start: its process failed" in said.getvalue()


@pytest.mark.parametrize(
    ("masks", "expected"),
    [
        ({}, ["0", "1"]),
        ({"CUDA_VISIBLE_DEVICES": "2,3"}, ["2", "3"]),
        ({"CUDA_VISIBLE_DEVICES": "2,3", "HIP_VISIBLE_DEVICES": "2,3"}, ["2", "3"]),
        ({"ROCR_VISIBLE_DEVICES": "4,5"}, ["0", "1"]),  # HIP's ids count within ROCR's list
        ({"CUDA_VISIBLE_DEVICES": "2,3", "HIP_VISIBLE_DEVICES": "0,1"}, "disagree or nest"),
        ({"HIP_VISIBLE_DEVICES": "0,1", "ROCR_VISIBLE_DEVICES": "4,5"}, "disagree or nest"),
        # SLURM exports ROCR's on NVIDIA nodes too: nothing reads it under CUDA
        ({"CUDA_VISIBLE_DEVICES": "0,1", "ROCR_VISIBLE_DEVICES": "0,1", "cuda": ""}, ["0", "1"]),
    ],
)
def test_gpus_all_means_the_gpus_this_runner_was_given(monkeypatch, masks, expected) -> None:
    """A job's ids become its own mask, so they are the host's: under CUDA_VISIBLE_DEVICES=2,3
    ``--gpus all`` handed out 0 and 1, a colleague's GPUs on a shared box. It now means the
    mask's ids; masks that disagree or nest are refused in one line. (``torch.cuda``'s count is
    the one thing faked: this machine has no GPU.)"""
    import torch

    from nanolab.queue.cli import parse_gpus

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    masks = dict(masks)
    monkeypatch.setattr(torch.version, "hip", None if masks.pop("cuda", None) == "" else "7.2")
    for name in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in masks.items():
        monkeypatch.setenv(name, value)
    if isinstance(expected, list):
        assert parse_gpus("all") == expected
    else:
        with pytest.raises(QueueError, match=expected):
            parse_gpus("all")


#: A config the step-time tests' jobs ran (its key is the jobs' ``config_key``).
_TIMED_CONFIG = {"trainer": {"max_steps": 300}, "model": {"gpt": {"n_layer": 2}}}


def _timed_jobs(db: QueueDB, tmp_path: Path, n: int) -> list:
    """``n`` finished jobs of :data:`_TIMED_CONFIG` (run dirs r0, r1, ...; no logs yet)."""
    from nanolab.queue.jobs import config_key

    for i in range(n):
        (tmp_path / f"r{i}").mkdir()
    added = db.add_jobs([
        NewJob(name=f"j{i}", config="c.yaml", args=[], seed=i, cwd="/",
               run_dir=str(tmp_path / f"r{i}"), config_key=config_key(_TIMED_CONFIG), max_steps=300)
        for i in range(n)
    ])  # fmt: skip
    db.conn.execute(
        f"UPDATE jobs SET status = 'done', run_seconds = 600 WHERE id IN "
        f"({','.join(str(j.id) for j in added)})"
    )
    return added


def _launch(log, job_id, per_step: float, steps: range, *, elapsed: float = 0.0,
            config=None, devices=("cpu",), ended: bool = True) -> float:  # fmt: skip
    """One launch in a run log: its start, a train record per step at ``per_step`` seconds
    (``elapsed`` before it, 5 s of start-up), a validation every 50 steps, and an end."""
    start = {"event": "start", "time": time.time(), "step": steps[0] - 1,
             "queue_job": None if job_id is None else str(job_id),
             "config": _TIMED_CONFIG if config is None else config, "devices": list(devices)}  # fmt: skip
    log.write(json.dumps(start) + "\n")
    elapsed += 5.0
    for step in steps:
        elapsed += per_step
        log.write(json.dumps({"event": "train", "step": step, "elapsed_s": elapsed}) + "\n")
        if step % 50 == 0:
            log.write(json.dumps({"event": "val", "step": step, "val_loss": 1.0}) + "\n")
    if ended:
        log.write(json.dumps({"event": "end", "step": steps[-1], "elapsed_s": elapsed}) + "\n")
    return elapsed


def test_a_configs_step_time_comes_from_its_newest_finished_runs(tmp_path):
    """The runner asks for a config's step time for every waiting job at every fill; it read
    the whole log of every finished job of that config each time (a night's queue spent a
    minute between jobs after 20 had finished). It takes the newest few finished runs, and
    each log once."""
    from nanolab.queue import predict

    db = QueueDB(tmp_path / "q.db")
    jobs = _timed_jobs(db, tmp_path, predict.HISTORY_RUNS + 4)
    runs = []
    for i, job in enumerate(jobs):
        per_step = 100.0 if i < 4 else 2.0 + i  # the oldest four: far slower, and left out
        with open(Path(job.run_dir) / "metrics.jsonl", "w") as log:
            _launch(log, job.id, per_step, range(1, 301))
        runs.append((Path(job.run_dir), per_step))
    assert predict.steady_step_seconds(str(runs[5][0])) == pytest.approx(7.0)
    newest = [p for _, p in runs[-predict.HISTORY_RUNS :]]
    seconds, how = predict.history(db, jobs[0].config_key)
    assert seconds == pytest.approx(statistics.median(newest)) and "8 past runs" in how
    # Each finished log is read once: its step time is remembered (the log's bytes blanked
    # with its size and time kept would drop that run from the median if it were read again).
    log = runs[-1][0] / "metrics.jsonl"
    st = log.stat()
    log.write_bytes(b" " * st.st_size)
    os.utime(log, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert predict.history(db, jobs[0].config_key)[0] == pytest.approx(seconds)


def test_a_relative_run_dir_of_an_older_queue_is_the_jobs_own_cwds(tmp_path, monkeypatch):
    """A queue written before ``queue add`` stored absolute run directories holds them relative
    to where each job was added. The step time of its finished runs (and a job's steps done)
    were read relative to where ``queue ls`` was typed: from any other folder no log was
    found, and the estimate fell back to wall time per step. They are the job's cwd's."""
    from nanolab.queue import predict

    project = tmp_path / "project"
    project.mkdir()
    db = QueueDB(tmp_path / "q.db")
    (job,) = _timed_jobs(db, project, 1)
    db.conn.execute("UPDATE jobs SET cwd = ?, run_dir = 'r0' WHERE id = ?", (str(project), job.id))
    with open(project / "r0" / "metrics.jsonl", "w") as log:
        _launch(log, job.id, 1.5, range(1, 101))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    seconds, how = predict.history(db, job.config_key)
    assert seconds == pytest.approx(1.5) and how.startswith("measured step time"), how
    (row,) = db.jobs()
    assert row.run_path == project / "r0" and predict.steps_done(row) == 100


def test_a_measured_peak_of_an_older_queues_relative_run_dir_is_read_from_the_jobs_cwd(
    tmp_path, monkeypatch
):
    """The memory a finished job of the same config measured (what packing caps a job by)
    was read from an older queue's relative run directory joined to the runner's folder: from
    any other folder no log was found, and the job was packed by the prediction instead."""
    from nanolab.queue import predict

    project = tmp_path / "project"
    project.mkdir()
    db = QueueDB(tmp_path / "q.db")
    done, asking = _timed_jobs(db, project, 2)
    db.conn.execute("UPDATE jobs SET cwd = ?, run_dir = 'r0' WHERE id = ?", (str(project), done.id))
    with open(project / "r0" / "metrics.jsonl", "w") as log:
        _launch(log, done.id, 1.5, range(1, 3))
        log.write(json.dumps({"event": "end", "step": 2, "mem_reserved_bytes": 7 * 2**30}) + "\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    (job,) = [j for j in db.jobs() if j.id == asking.id]
    assert predict.measured_peak(db, job) == (7 * 2**30, "measured by job j0")


def test_a_step_time_counts_only_the_jobs_own_ended_launches_of_its_config(tmp_path):
    """A finished job's run log also held a launch from a shell at 50 s a step, a launch of
    another config, and a launch of its own that crashed (its steps trained again after a
    long wait): the step time spanned the log's first train record to its last, all of them
    averaged in. Only the job's own launches of its config that ended are measured, each from
    its first train record to its end; on ``--gpu``, only those on that GPU."""
    from nanolab.queue import predict

    db = QueueDB(tmp_path / "q.db")
    (job, other) = _timed_jobs(db, tmp_path, 2)
    with open(Path(job.run_dir) / "metrics.jsonl", "w") as log:
        t = _launch(log, None, 50.0, range(1, 101))  # by hand, from a shell
        t = _launch(log, job.id, 2.0, range(101, 151), elapsed=t)
        t = _launch(log, job.id, 2.0, range(151, 181), elapsed=t, ended=False)  # crashed
        t = _launch(log, job.id, 9.0, range(151, 201), elapsed=t + 3600.0,
                    config={"trainer": {"max_steps": 300}, "model": {"gpt": {"n_layer": 8}}})  # fmt: skip
        _launch(log, job.id, 2.0, range(201, 301), elapsed=t)
    assert predict.steady_step_seconds(job.run_dir) == pytest.approx(
        (50.0 * 99 + 2.0 * 49 + 9.0 * 49 + 2.0 * 99) / (99 + 49 + 49 + 99)
    )  # asked about nothing in particular: every launch that ended, each on its own
    assert predict.history(db, job.config_key, exclude=other.id)[0] == pytest.approx(2.0)

    with open(Path(other.run_dir) / "metrics.jsonl", "w") as log:
        t = _launch(log, other.id, 1.0, range(1, 151), devices=["NVIDIA H100 80GB HBM3"])
        _launch(log, other.id, 3.0, range(151, 301), elapsed=t, devices=["NVIDIA A100-SXM4-80GB"])
    assert predict.history(db, job.config_key, exclude=job.id, gpu="h100")[0] == pytest.approx(1.0)
    assert predict.history(db, job.config_key, exclude=job.id)[0] == pytest.approx(3.0)
    # on --gpu, a job whose log does not say it ran there is not its wall time either
    assert predict.history(db, job.config_key, exclude=other.id, gpu="h100") is None


def test_a_signal_during_a_fill_starts_no_job(tmp_path: Path) -> None:
    """A SIGINT that landed while the runner was filling its slots (a fill that took a minute
    over a long history) printed "no new jobs start" and then started one: the signal was
    looked at before the fill only. Each claim now looks again; the handler's count is set as
    the signal would set it."""
    import io

    from nanolab.queue.runner import Runner

    db = QueueDB(tmp_path / "q.db")
    run_dir = str(tmp_path / "runs" / "a")
    db.add_jobs([NewJob(name="a", config="c", args=[], seed=None, cwd="/", run_dir=run_dir)])
    runner = Runner(db, out=io.StringIO())
    runner.runner_id = db.register_runner()
    runner._signals = 1  # as the SIGINT handler leaves it, mid-fill
    runner.fill()
    (job,) = db.jobs()
    assert job.status == "pending" and not runner._active


def test_a_jobs_time_is_one_figure_in_the_runners_line_and_queue_ls(tmp_path, capsys) -> None:
    """One job's time was printed three ways: the runner's "done after 2m" (its process's time,
    rounded as an estimate), ``queue ls`` 86s and report 1m25s. The runner and ``queue ls``
    now give the run log's elapsed time as report and status do: 1m25s."""
    import io
    from typing import Any

    from nanolab.queue.runner import Active, Runner

    run_dir = tmp_path / "runs" / "a"
    run_dir.mkdir(parents=True)
    path = tmp_path / "q.db"
    QueueDB(path).add_jobs([NewJob(name="a", config="c.yaml", args=[], seed=None,
                                   cwd=str(tmp_path), run_dir="runs/a")])  # fmt: skip

    def log_a_run() -> None:  # what the job's fit writes while it runs
        records = [{"event": "start", "time": time.time(), "step": 0, "queue_job": "1"},
                   {"event": "end", "time": time.time(), "step": 5, "reason": "completed",
                    "elapsed_s": 85.7}]  # fmt: skip
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    class SleepJobs(Runner):
        def _spawn(self, job: Any, units: list[int], *args: Any, **kw: Any) -> None:
            started = time.time()
            proc = subprocess.Popen(["sleep", "0.1"])
            log = open(tmp_path / "a.log", "a+b")  # noqa: SIM115 - reap closes it
            assert self.db.set_job_pid(job.id, proc.pid, log.name)
            self._active[job.id] = Active(job, proc, units, started, log)
            log_a_run()

    said = io.StringIO()
    assert SleepJobs(QueueDB(path), poll_s=0.05, out=said).run() == 0, said.getvalue()
    assert "job 1 a: done after 1m25s (exit 0)" in said.getvalue(), said.getvalue()
    code, out, _ = queue(capsys, path, "ls")
    assert code == 0 and " 1m25s " in out and "86s" not in out, out


def test_an_attempt_that_logged_nothing_is_given_its_own_time(tmp_path) -> None:
    """A resumed job whose new attempt failed before it logged (its data gone) was said to have
    "failed after 1m11s", the elapsed time of the attempts before it, for a 1-second attempt:
    the run log counts only from a record this attempt wrote."""
    import io
    from typing import Any

    from nanolab.queue.runner import Active, Runner

    run_dir = tmp_path / "runs" / "a"
    run_dir.mkdir(parents=True)
    earlier = [{"event": "start", "time": time.time() - 100, "step": 0},
               {"event": "end", "time": time.time() - 29, "step": 3, "reason": "completed",
                "elapsed_s": 71.0}]  # fmt: skip
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in earlier))
    path = tmp_path / "q.db"
    QueueDB(path).add_jobs([NewJob(name="a", config="c.yaml", args=[], seed=None,
                                   cwd=str(tmp_path), run_dir="runs/a")])  # fmt: skip

    class FailingJobs(Runner):
        def _spawn(self, job: Any, units: list[int], *args: Any, **kw: Any) -> None:
            proc = subprocess.Popen(["sh", "-c", "exit 2"])
            log = open(tmp_path / "a.log", "a+b")  # noqa: SIM115 - reap closes it
            assert self.db.set_job_pid(job.id, proc.pid, log.name)
            self._active[job.id] = Active(job, proc, units, time.time(), log)

    said = io.StringIO()
    FailingJobs(QueueDB(path), poll_s=0.05, out=said).run()
    line = next(x for x in said.getvalue().splitlines() if "job 1 a: failed after" in x)
    assert "1m11s" not in line and "failed after 0s" in line, said.getvalue()


def test_a_job_refused_while_another_launch_trains_its_run_is_given_its_own_time(
    tmp_path, capsys
) -> None:
    """A job added with --continue whose process was refused at once (a shell's ``nanolab fit``
    trains the run: "run directory in use") was said to have "failed after 3m15s", and ``queue
    ls`` showed it "ran 3m24s", growing as the other launch trained: the time of a log another
    launch wrote. Only a record of one of the job's own launches (its start record's
    ``queue_job``) counts; else the attempt's own time."""
    import io
    from typing import Any

    from nanolab.queue.runner import Active, Runner

    run_dir = tmp_path / "runs" / "c"
    run_dir.mkdir(parents=True)
    path = tmp_path / "q.db"
    QueueDB(path).add_jobs([NewJob(name="c", config="c.yaml", args=[], seed=None,
                                   cwd=str(tmp_path), run_dir="runs/c")])  # fmt: skip
    log = run_dir / "metrics.jsonl"

    def other_launch_logs(elapsed: float) -> None:  # the shell's fit, training on
        records = [{"event": "start", "time": time.time() - elapsed, "step": 0, "queue_job": None},
                   {"event": "train", "time": time.time(), "step": 900, "elapsed_s": elapsed}]  # fmt: skip
        log.write_text("".join(json.dumps(r) + "\n" for r in records))

    class RefusedJobs(Runner):
        def _spawn(self, job: Any, units: list[int], *args: Any, **kw: Any) -> None:
            proc = subprocess.Popen(["sh", "-c", "exit 2"])
            handle = open(tmp_path / "c.log", "a+b")  # noqa: SIM115 - reap closes it
            assert self.db.set_job_pid(job.id, proc.pid, handle.name)
            self._active[job.id] = Active(job, proc, units, time.time(), handle)
            other_launch_logs(195.0)

    said = io.StringIO()
    RefusedJobs(QueueDB(path), poll_s=0.05, out=said).run()
    line = next(x for x in said.getvalue().splitlines() if "job 1 c: failed after" in x)
    assert "3m15s" not in line and "failed after 0s" in line, said.getvalue()
    other_launch_logs(204.0)
    code, out, _ = queue(capsys, path, "ls")
    assert code == 0 and "3m24s" not in out and " 0s " in out, out
    # The job's own launch, once it runs, is counted again: the run's time over every launch.
    own = [{"event": "start", "time": time.time(), "step": 900, "queue_job": "1"},
           {"event": "end", "time": time.time(), "step": 1000, "elapsed_s": 230.0}]  # fmt: skip
    with log.open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in own))
    code, out, _ = queue(capsys, path, "ls")
    assert code == 0 and " 3m50s " in out, out


def test_ls_left_shrinks_for_a_job_only_an_hours_budget_ends(tmp_path: Path, capsys) -> None:
    """A job ended only by ``budget.max_wall_hours`` stores no step count (it depends on the
    step time), so ``queue ls``'s "left" stayed at its whole estimate however far it ran. It
    is now the steps the budget still pays for (the run-length rule fit's budget stops by,
    with the run's own spend) at its measured step time, read from its run log."""
    run_dir = tmp_path / "runs" / "h"
    run_dir.mkdir(parents=True)
    path = tmp_path / "q.db"
    (job,) = QueueDB(path).add_jobs([NewJob(
        name="h", config="c.yaml", args=[], seed=None, cwd=str(tmp_path), run_dir="runs/h",
        max_steps=None, estimate_s=3612.0, estimate_source="flops")])  # fmt: skip
    QueueDB(path).conn.execute(
        "UPDATE jobs SET attempts = 1, status = 'preempted' WHERE id = ?", (job.id,)
    ).connection.commit()
    config = {"trainer": {"max_steps": -1}, "budget": {"max_wall_hours": 1.0}}
    start = {"event": "start", "time": time.time(), "queue_job": str(job.id), "step": 0,
             "config": config, "global_batch_tokens": 128, "world_size": 1}  # fmt: skip

    def log_to(step: int) -> None:  # 1 s a step after a 10 s start-up
        train = [{"event": "train", "step": s, "tokens": 128 * s, "elapsed_s": 10.0 + s,
                  "gpu_hours": (10.0 + s) / 3600} for s in range(1, step + 1)]  # fmt: skip
        text = "".join(json.dumps(r) + "\n" for r in [start, *train])
        (run_dir / "metrics.jsonl").write_text(text)

    def left() -> str:
        code, out, err = queue(capsys, path, "ls")
        assert code == 0, err
        row = next(line for line in out.splitlines() if line.split()[:2] == ["1", "h"])
        return row.split()[5]

    log_to(100)  # 110 s of the hour spent: 3490 steps left at 1 s, plus a start-up
    assert left() == "58m"
    log_to(1000)  # 1010 s spent: 2590 steps left
    assert left() == "43m"
    code, out, _ = queue(capsys, path, "ls", "--json")
    assert code == 0
    (row,) = json.loads(out)["jobs"]
    assert row["estimate_basis"] == "measured step time of this run"
    assert 2590 < row["remaining_s"] < 2590 + 30


def _hours_job(tmp_path: Path, status: str, estimate_s: float) -> tuple[Path, Path, object]:
    """A queue at ``tmp_path`` with one job only a budget's hours end (no step count stored),
    ``status``, one attempt made; (queue path, its run's log path, the job)."""
    run_dir = tmp_path / "runs" / "h"
    run_dir.mkdir(parents=True)
    path = tmp_path / "q.db"
    (job,) = QueueDB(path).add_jobs([NewJob(
        name="h", config="c.yaml", args=[], seed=None, cwd=str(tmp_path), run_dir="runs/h",
        max_steps=None, estimate_s=estimate_s, estimate_source="flops")])  # fmt: skip
    QueueDB(path).conn.execute(
        "UPDATE jobs SET attempts = 1, status = ? WHERE id = ?", (status, job.id)
    ).connection.commit()
    return path, run_dir / "metrics.jsonl", QueueDB(path).jobs()[0]


def _hours_launch(hours: float, step: int, elapsed: float, **by) -> dict:
    """A start record of a launch a ``budget.max_wall_hours`` ends (``by``: queue_job, time)."""
    return {"event": "start", "time": by.pop("time", 1.0), "step": step, "elapsed_s": elapsed,
            "config": {"trainer": {"max_steps": -1}, "budget": {"max_wall_hours": hours}},
            "global_batch_tokens": 128, "world_size": 1, **by}  # fmt: skip


def _hours_trains(steps: range, elapsed_at: float, time_at: float = 1.0) -> list[dict]:
    """Train records at 1 s a step, the first at ``elapsed_at`` (and wall time ``time_at``)."""
    return [{"event": "train", "time": time_at + i, "step": s, "tokens": 128 * s,
             "elapsed_s": elapsed_at + i, "gpu_hours": (elapsed_at + i) / 3600}
            for i, s in enumerate(steps)]  # fmt: skip


def test_ls_left_of_a_continued_run_is_the_continuing_jobs_budget(tmp_path: Path, capsys) -> None:
    """A run ``nanolab fit`` trained until its ``max_wall_hours: 1`` ended it, continued by a
    queue job with ``max_wall_hours: 5``: ``left`` read the budget of the log's first start
    record (the shell's launch) and said 0s after ~1.03 h, and ``queue run --until`` in 15
    minutes started the ~3.9 h job. The budget is now the job's own launch's; before the job
    has logged one, its stored estimate."""
    from nanolab.queue import predict

    path, log, job = _hours_job(tmp_path, "running", 2 * 3600.0)
    shell = [_hours_launch(1.0, 0, 0.0), *_hours_trains(range(1, 3591), 10.0),
             {"event": "end", "time": 3600.0, "step": 3590, "elapsed_s": 3600.0}]  # fmt: skip
    log.write_text("".join(json.dumps(r) + "\n" for r in shell))
    code, out, _ = queue(capsys, path, "ls", "--json")
    assert code == 0
    (row,) = json.loads(out)["jobs"]
    assert (row["remaining_s"], row["estimate_basis"]) == (2 * 3600.0, "flops")  # not its launch

    now = time.time()
    own = [_hours_launch(5.0, 3590, 3600.0, queue_job=str(job.id), time=now),
           *_hours_trains(range(3591, 3700), 3610.0, now)]  # fmt: skip
    with log.open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in own))
    code, out, _ = queue(capsys, path, "ls", "--json")
    assert code == 0
    (row,) = json.loads(out)["jobs"]
    spent = 3610.0 + 108  # the newest record's elapsed time: 1.03 h of the job's 5
    assert row["estimate_basis"] == "measured step time of this run"
    assert row["remaining_s"] == pytest.approx(5 * 3600 - spent)  # 1 s a step, running
    QueueDB(path).conn.execute("UPDATE jobs SET status = 'preempted'").connection.commit()
    (job,) = QueueDB(path).jobs()
    left, _ = predict.remaining_seconds(QueueDB(path), job)
    plan = plan_starts([(job, left)], [0], 1, now + 15 * 60, now, gpus=False)
    assert [j.name for j, *_ in plan.deferred] == ["h"] and not plan.start


def test_ls_left_reads_the_end_of_a_long_run_log(tmp_path: Path, monkeypatch) -> None:
    """``queue ls`` read every hours-only job's whole run log at each call to time its steps
    (4 jobs' 86 MB logs: 0.7 s became 4 s). The step time is now read from the log's end,
    over whole validation intervals (each validation's time in it), and the job's start
    record, the log's first line here, from its top: a small part of the file is read."""
    from nanolab.queue import predict

    _, log, job = _hours_job(tmp_path, "running", 100 * 3600.0)
    now, elapsed, records = time.time(), 10.0, [_hours_launch(100.0, 0, 0.0, queue_job=str(job.id))]
    records[0]["time"] = now
    for s in range(1, 20051):  # 1 s a step, a 50 s validation after every 100th
        elapsed += 1.0
        records.append({"event": "train", "time": now + elapsed, "step": s, "tokens": 128 * s,
                        "elapsed_s": elapsed, "loss": 3.0})  # fmt: skip
        if s % 100 == 0:
            elapsed += 50.0
            records.append({"event": "val", "time": now + elapsed, "step": s, "val_loss": 3.0})
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    read = _bytes_read_by_runlog(monkeypatch)
    done, end, step_s = predict.measured_course(job)
    assert step_s == pytest.approx(1.5)  # 100 steps and a validation: 150 s
    assert done == 20050 and end == 20050 + int((100 * 3600 - elapsed) / 1.5)
    assert read[0] < log.stat().st_size / 10, (read[0], log.stat().st_size)


def test_left_of_a_branch_counts_its_own_tokens_against_its_token_limit(tmp_path: Path) -> None:
    """A branch (``run.resume`` of another run's step-1000 checkpoint) that a token limit and
    an hours limit bound: fit's budget counts the tokens the branch trained itself
    (``run_tokens``: 12,800 of ``max_tokens`` 64,000 by step 1100), while ``tokens`` go on from
    its parent's (140,800). The queue counted ``tokens``, read the limit as spent and said the
    branch ends now (end 1100, nothing left); it ends at step 1500, 400 steps on, as
    ``status`` (:func:`nanolab.runs.measured_course`) counts it.

    Mutations caught: the queue's course counting ``tokens`` instead of ``run_tokens``."""
    from nanolab.queue import predict

    _, log, job = _hours_job(tmp_path, "running", 3600.0)
    now = time.time()
    start = _hours_launch(100.0, 1000, 0.0, queue_job=str(job.id), time=now)
    start["config"]["budget"]["max_tokens"] = 64_000
    start.update(branched=True, resumed_from_step=1000,
                 resumed_from="runs/parent/checkpoints/step-00001000.ckpt")  # fmt: skip
    trains = [{"event": "train", "time": now + i, "step": s, "tokens": 128 * s,
               "run_tokens": 128 * (s - 1000), "elapsed_s": 10.0 + i, "loss": 3.0}
              for i, s in enumerate(range(1001, 1101))]  # fmt: skip
    log.write_text("".join(json.dumps(r) + "\n" for r in [start, *trains]))
    done, end, step_s = predict.measured_course(job)
    assert (done, end, step_s) == (1100, 1500, pytest.approx(1.0))


def _bytes_read_by_runlog(monkeypatch) -> list[int]:
    """Count the bytes :mod:`nanolab.runlog` reads from run logs (one number, in a list)."""
    import nanolab.runlog as runlog

    read = [0]
    opened = runlog._open_log

    class Counting:
        def __init__(self, handle) -> None:
            self.handle = handle

        def __getattr__(self, name: str):
            return getattr(self.handle, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.handle.close()

        def __iter__(self):
            for line in self.handle:
                read[0] += len(line)
                yield line

        def read(self, *a):
            data = self.handle.read(*a)
            read[0] += len(data)
            return data

        def readline(self, *a):
            line = self.handle.readline(*a)
            read[0] += len(line)
            return line

    monkeypatch.setattr(
        runlog, "_open_log", lambda p, mode: None if (h := opened(p, mode)) is None else Counting(h)
    )
    return read


def test_ls_reads_a_bounded_part_of_long_logs_where_the_runner_recorded_them(
    tmp_path: Path, monkeypatch
) -> None:
    """``queue ls`` read a preempted hours-only job's log back to its launch's start record
    twice (its time left, and whose the newest time is), and every finished job of a pending
    job's config whole for its step time: 4 x 86 MB logs took about a second and grew with
    them. The runner now records where each launch began in its run log, the log's size as it
    ended and a done job's step time (:data:`nanolab.queue.db.LOG_COLUMNS`): ``ls`` reads a
    few lines there and the log's end, whatever the log's length; the numbers are the same."""
    from nanolab.queue import predict
    from nanolab.queue.runner import log_columns

    path, log, job = _hours_job(tmp_path, "preempted", 100 * 3600.0)
    # The jobs below are added after these records are built (seconds on a loaded machine): a
    # launch counts only when it started after its job was added, so the records lie ahead.
    now = time.time() + 600
    shell = [_hours_launch(1.0, 0, 0.0, time=now), {"event": "end", "time": now, "step": 0}]
    head = "".join(json.dumps(r) + "\n" for r in shell)
    own = [_hours_launch(100.0, 0, 0.0, queue_job=str(job.id), time=now + 1),
           *_hours_trains(range(1, 30001), 10.0, now + 2)]  # fmt: skip
    log.write_text(head + "".join(json.dumps(r) + "\n" for r in own))
    db = QueueDB(path)
    from nanolab.queue.jobs import config_key

    config = {"trainer": {"max_steps": 30000}}
    key = config_key(config)
    (done, _pending) = db.add_jobs([NewJob(
        name=n, config="c.yaml", args=[], seed=None, cwd=str(tmp_path), run_dir=str(tmp_path / "runs" / n),
        config_key=key, max_steps=30000, estimate_s=60.0) for n in ("d", "p")])  # fmt: skip
    (tmp_path / "runs" / "d").mkdir()
    done_log = tmp_path / "runs" / "d" / "metrics.jsonl"
    records = [{"event": "start", "time": now + 1, "step": 0, "queue_job": str(done.id),
                "config": config},
               *_hours_trains(range(1, 30001), 10.0, now + 2),
               {"event": "end", "time": now + 30010, "step": 30000, "elapsed_s": 30009.0}]  # fmt: skip
    done_log.write_text("".join(json.dumps(r) + "\n" for r in records))
    db.conn.execute("UPDATE jobs SET status = 'done', attempts = 1, run_seconds = 30010 "
                    "WHERE id = ?", (done.id,))  # fmt: skip

    def listing() -> tuple[tuple, ...]:
        jobs = {j.name: j for j in QueueDB(path).jobs()}
        return tuple(
            (predict.remaining_seconds(db, j), predict.run_time(j, now)) for j in jobs.values()
        )

    before = listing()  # no offsets recorded: the logs are read back (a queue made before)
    for j, start in ((job, len(head.encode())), (done, 0)):  # as the runner records them
        row = QueueDB(path).get(j.id)
        db.conn.execute("UPDATE jobs SET log_start = ?, log_end = ?, steady_s = ? WHERE id = ?",
                        (start, *(log_columns(row, row.status).get(k) for k in ("log_end", "steady_s")), j.id))  # fmt: skip
    predict._STEADY.clear()
    read = _bytes_read_by_runlog(monkeypatch)
    assert listing() == before
    assert QueueDB(path).get(done.id).steady_s == pytest.approx(1.0)
    assert read[0] < (log.stat().st_size + done_log.stat().st_size) / 5, read[0]


def test_the_runner_reads_a_done_jobs_step_time_from_its_logs_end(
    tmp_path: Path, monkeypatch
) -> None:
    """As a job ended done, the runner's loop read its whole run log for its step time
    (seconds for a 100 MB log, every other job waiting); it reads the log's end, as ``ls``
    reads a running job's, and stores the same step time."""
    from nanolab.queue.runner import log_columns

    _, log, job = _hours_job(tmp_path, "running", 3600.0)
    now = time.time()
    records = [_hours_launch(1.0, 0, 0.0, queue_job=str(job.id), time=now),
               *_hours_trains(range(1, 50001), 10.0, now + 1),
               {"event": "end", "time": now + 50001, "step": 50000, "elapsed_s": 50010.0}]  # fmt: skip
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    read = _bytes_read_by_runlog(monkeypatch)
    columns = log_columns(job, "done")
    assert columns["steady_s"] == pytest.approx(1.0, rel=1e-3)  # 1 s a step
    assert columns["log_end"] == log.stat().st_size
    assert read[0] < log.stat().st_size / 10, (read[0], log.stat().st_size)


def test_ls_and_status_read_a_jobs_log_for_its_time_left_only_where_it_is_shown(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """Working out a job's time left reads its run log. ``ls --json`` worked it out for
    finished jobs too (the table shows none for them), and ``status`` for a running job whose
    run's ETA it shows instead: now only for the jobs whose time left is shown."""
    import nanolab.queue.cli as queue_cli
    import nanolab.queue.predict as predict
    from nanolab.queue.status import main as status

    path = tmp_path / "q.db"
    db = QueueDB(path)
    db.add_jobs([NewJob(name=n, config="c.yaml", args=[], seed=None, cwd=str(tmp_path),
                        run_dir=f"runs/{n}", max_steps=100, estimate_s=60.0)
                 for n in ("done", "live", "next")])  # fmt: skip
    for name, state in (("done", "done"), ("live", "running")):
        db.conn.execute("UPDATE jobs SET status = ?, attempts = 1 WHERE name = ?", (state, name))
    db.conn.commit()
    now = time.time()
    train = [{"event": "train", "time": now - 10 + i, "step": i, "tokens": 10 * i,
              "elapsed_s": float(i), "step_time_s": 1.0} for i in range(1, 11)]  # fmt: skip
    start = {
        "event": "start",
        "time": now - 11,
        "step": 0,
        "config": {"trainer": {"max_steps": 100}},
    }
    (tmp_path / "runs" / "live").mkdir(parents=True)
    (tmp_path / "runs" / "live" / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in [start, *train])
    )
    hold_like_a_live_launch(tmp_path / "runs" / "live")  # its fit holds the run as it trains
    asked: list[str] = []

    def remaining(db, job):
        asked.append(job.name)
        return 60.0, "flops"

    monkeypatch.setattr(queue_cli, "remaining_seconds", remaining)
    monkeypatch.setattr(predict, "remaining_seconds", remaining)
    code, out, _ = queue(capsys, path, "ls", "--json")
    assert code == 0 and sorted(asked) == ["live", "next"]
    rows = {r["name"]: r for r in json.loads(out)["jobs"]}
    assert rows["done"]["remaining_s"] is None and rows["next"]["remaining_s"] == 60.0
    asked.clear()
    assert status([str(tmp_path / "runs"), "--db", str(path), "--json"]) == 0
    screen = json.loads(capsys.readouterr().out)
    assert asked == ["next"]  # the running one's ETA is its run's
    assert [r["eta_s"] for r in screen["running"]] == [pytest.approx(90.0)]


def test_add_refuses_source_data_whose_folder_holds_a_dataset_prepared_otherwise(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """A job whose ``data.dataset_dir`` holds tokens prepared from ``data.source`` before its
    text was edited was added ("added job 1"), and fit refused it at night. ``queue add`` now
    refuses it in fit's own words (told from file sizes and times), and adds it while the
    folder holds what fit would prepare there."""
    from conftest import nanolab_here

    from nanolab.data.prepare import prepare_dataset

    monkeypatch.chdir(tmp_path)
    corpus = tmp_path / "text.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    prepare_dataset([str(corpus)], tmp_path / "prep", "chars", quiet=True)
    cfg = tiny_overrides(tmp_path / "prep", tmp_path / "runs", trainer__max_steps=2)
    cfg["data"].update({"source": [str(corpus)], "val_windows": 4})
    config = write_config(tmp_path / "src.yaml", cfg)
    db = tmp_path / "q.db"
    code, _, err = queue(capsys, db, "add", str(config), "--name", "same")
    assert code == 0, err

    with open(corpus, "a") as f:
        f.write("an edit. " * 50)
    code, _, err = queue(capsys, db, "add", str(config), "--name", "edited")
    assert code == 2, err
    (line,) = err.strip().splitlines()
    fit = nanolab_here("fit", "--config", str(config), cwd=tmp_path)
    assert fit.returncode == 2
    (fits,) = [x for x in fit.stderr.splitlines() if x.startswith("nanolab fit: error: ")]
    said = fits.removeprefix("nanolab fit: error: ")
    assert "already holds a dataset prepared from other sources" in said
    assert line == f"nanolab queue add: error: {config}: {said}"
    assert [job.name for job in QueueDB(db).jobs()] == ["same"]


def test_add_takes_a_glob_source_as_fit_does(tmp_path: Path, capsys, monkeypatch) -> None:
    """``data.source: [corpus/*.txt]`` trains under fit, but ``queue add`` refused it ("does not
    exist": it looked for a file named by the pattern). A glob that matches a file is taken, one
    that matches none is refused in one line, and the prepared folder is still compared."""
    from nanolab.data.prepare import prepare_dataset

    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    for name in ("a", "b"):
        (tmp_path / "corpus" / f"{name}.txt").write_text(
            f"text {name}, the fox and the dog. " * 300
        )
    cfg = tiny_overrides(tmp_path / "prep", tmp_path / "runs", trainer__max_steps=2)
    cfg["data"].update({"source": ["corpus/*.txt"], "val_windows": 4})
    config = write_config(tmp_path / "glob.yaml", cfg)
    db = tmp_path / "q.db"
    code, _, err = queue(capsys, db, "add", str(config), "--name", "unprepared")
    assert code == 0, err
    prepare_dataset(["corpus/*.txt"], tmp_path / "prep", "chars", quiet=True)
    code, _, err = queue(capsys, db, "add", str(config), "--name", "prepared")
    assert code == 0, err
    code, _, err = queue(capsys, db, "add", str(config), "--name", "none",
                         "--set", "data.source=[nothing/*.txt]")  # fmt: skip
    assert code == 2 and "data.source: nothing/*.txt matches no file" in err, err
    assert len(err.strip().splitlines()) == 1
    assert [job.name for job in QueueDB(db).jobs()] == ["unprepared", "prepared"]


class _PlainData(TokenDataModule):
    """A project's class that prepares ``data.source`` as configured (a starter's ``Data``)."""


class _OwnSourceData(TokenDataModule):
    """A project's class that sets its own source (a records renderer)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.source = ["rendered.jsonl"]


def test_add_judges_the_prepared_folder_only_of_classes_that_prepare_the_source_setting() -> None:
    from nanolab.queue.jobs import _source_is_setting

    assert _source_is_setting("nanolab.data.datamodule.TokenDataModule")
    assert _source_is_setting(f"{__name__}._PlainData")
    assert not _source_is_setting(f"{__name__}._OwnSourceData")
    assert not _source_is_setting("no_such_module.Data")


def test_add_continue_checks_prepared_source_data_and_a_fine_tunes_checkpoint(
    tmp_path: Path, char_dataset: Path, capsys, monkeypatch
) -> None:
    """``queue add --continue`` compared a run's data with its checkpoint's only for prepared
    folders: data fit prepares from ``data.source`` and a fine-tune's ``run.resume: PATH``
    went unchecked, to be refused at night. Without preparing anything it now compares the
    folder fit would reuse (it holds the same files and settings), says in one line that data
    still to be prepared is compared only at the job's start, and refuses a start checkpoint
    that is missing or not one nanolab can read."""
    from conftest import nanolab_here

    monkeypatch.chdir(tmp_path)
    corpus = tmp_path / "corpus.txt"
    bundled = Path(__file__).parents[1] / "nanolab" / "data" / "corpus" / "shakespeare.txt.gz"
    corpus.write_bytes(gzip.decompress(bundled.read_bytes())[:200_000])
    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=2)
    cfg["data"].update({"source": [str(corpus)], "dataset_dir": str(tmp_path / "prep")})
    config = write_config(tmp_path / "src.yaml", cfg)
    assert nanolab_here("fit", "--config", str(config), cwd=tmp_path).returncode == 0
    db = tmp_path / "q.db"
    add = ("add", str(config), "--name", "tiny", "--continue")
    code, _, err = queue(capsys, db, *add)
    assert code == 0 and "not compared" not in err, err
    assert queue(capsys, db, "rm", "tiny")[0] == 0

    code, _, err = queue(capsys, db, *add, "--set", f"data.dataset_dir={tmp_path / 'fresh'}")
    assert code == 0, err
    (note,) = [line for line in err.splitlines() if "continues the existing run" in line]
    assert "its data is not compared with the checkpoint's now: fit prepares" in note, note
    assert not (tmp_path / "fresh").exists()  # nothing prepared at add
    assert queue(capsys, db, "rm", "tiny")[0] == 0

    train = tmp_path / "prep" / "train.bin"
    train.write_bytes(b"\x01\x00" * (train.stat().st_size // 2))  # same size, other bytes
    code, _, err = queue(capsys, db, *add)
    (line,) = err.strip().splitlines()
    assert code == 2 and "the data changed" in line and "same size but other bytes" in line, err

    (tmp_path / "bad.ckpt").write_bytes(b"not a checkpoint")
    for path, said in (("missing.ckpt", "run.resume: checkpoint missing.ckpt does not exist"),
                       ("bad.ckpt", "run.resume: bad.ckpt cannot be resumed from")):  # fmt: skip
        cfg["run"]["resume"] = path  # a fine-tune's start (the queue's --set cannot give it)
        write_config(config, cfg)
        code, _, err = queue(capsys, db, *add, "--set", "data.allow_changed=true")
        (line,) = err.strip().splitlines()
        assert code == 2 and said in line, err


def test_a_queue_made_before_the_log_columns_opens_and_lists(tmp_path: Path, capsys) -> None:
    """A queue database written by the nanolab before :data:`LOG_COLUMNS` (schema version 2,
    without them) is read as it is where it cannot be written (its jobs have none of them),
    and opened to write gains them in place, its jobs kept."""
    import sqlite3

    from nanolab.queue.db import LOG_COLUMNS, SCHEMA, V2_COLUMNS

    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.executescript(SCHEMA)
    for name, definition in V2_COLUMNS.items():
        if name not in {r[1] for r in conn.execute("PRAGMA table_info(jobs)")}:
            conn.execute(f"ALTER TABLE jobs ADD COLUMN {name} {definition}")
    conn.execute("INSERT INTO meta(key, value) VALUES ('schema_version', '2')")
    conn.execute("INSERT INTO jobs(name, config, args, cwd, run_dir, created, status) "
                 "VALUES ('old', 'c.yaml', '[]', ?, 'runs/old', 1.0, 'done')", (str(tmp_path),))  # fmt: skip
    conn.commit()
    conn.close()
    (job,) = QueueDB.read_only(path).jobs()
    assert (job.name, job.log_start, job.log_end, job.steady_s) == ("old", None, None, None)
    (job,) = QueueDB(path).jobs()
    assert job.name == "old" and job.steady_s is None
    columns = {r[1] for r in QueueDB(path).conn.execute("PRAGMA table_info(jobs)")}
    assert set(LOG_COLUMNS) <= columns
    code, out, _ = queue(capsys, path, "ls")
    assert code == 0 and " old " in out, out
