"""Inputs a review found slipping through: each is now one error line, and nothing is written.

In-process and fast (no Lightning start-up per case); the same inputs run end to end as rows of
``tests/test_adversarial.py`` under ``pytest -m slow``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from conftest import tiny_overrides, write_config

from nanolab.callbacks.rundir import RunDirError, claim_run_dir
from nanolab.data.prepare import OutputInUseError, prepare_dataset
from nanolab.errors import NanolabError, RunConfigError
from nanolab.eval_tasks import EvalArgumentError, check_json_target
from nanolab.processes import pid_namespace
from nanolab.queue.jobs import JobConfigError, job_names, parse_config
from nanolab.run.parse import FitParseError, parse_fit_config
from nanolab.runlog import RunLogReadError, read_records, run_dir_holding
from nanolab.training.resolve import check_run_name


def _fake_run(root: Path, name: str) -> Path:
    """A run directory as fit leaves it: a run log, a config and a checkpoint."""
    run = root / name
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"event": "start", "step": 0}\n')
    (run / "config.yaml").write_text("trainer: {max_steps: 6}\n")
    (run / "checkpoints" / "last.ckpt").write_bytes(b"weights")
    return run


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


# -- files a command is asked to write ------------------------------------------------------
def test_run_dir_holding_finds_the_run_a_path_lies_in(tmp_path: Path) -> None:
    run = _fake_run(tmp_path / "runs", "B")
    assert run_dir_holding(run / "checkpoints" / "last.ckpt") == run
    assert run_dir_holding(run / "metrics.jsonl") == run
    assert run_dir_holding(tmp_path / "runs" / "B.json") is None
    assert run_dir_holding(tmp_path / "out.json") is None


@pytest.mark.parametrize(
    ("name", "text", "is_run"),
    [
        # a live run's log deleted under it starts again with a record naming the run
        ("metrics.jsonl", '{"event": "log_recreated", "step": 7, "run_id": "r1"}\n', True),
        ("metrics.jsonl", '{"event": "log_recreated", "step": 7, "run_id": null}\n', False),
        ("metrics.jsonl", '{"event": "train", "step": 7}\n', False),  # another tool's log
        # a launch holds the folder (its log deleted, not yet started again): one on another
        # host cannot be checked from here, one of this host runs (this very process)
        (".nanolab.lock", '{"host": "h", "pid": 12, "command": "nanolab fit"}', True),
        (".nanolab.lock", "LIVE", True),
        (".nanolab.lock", "GONE", False),  # a killed run's lock left behind holds nothing
        # a run's config.yaml copied out to launch from (docs/evaluate.md) is not a run
        ("config.yaml", "# nanolab fit: this run's merged config\ntrainer: {}\n", False),
        ("config.yaml", "trainer: {max_steps: 6}\n", False),  # a user's own config
    ],
)
def test_a_live_run_whose_log_was_deleted_is_still_a_run(
    tmp_path: Path, name: str, text: str, is_run: bool
) -> None:
    """``rm runs/live/metrics.jsonl`` while it trained: the run starts its log again with a
    ``log_recreated`` record, and ``prepare -o runs/live/data`` wrote inside the live run."""
    run = tmp_path / "runs" / "live"
    run.mkdir(parents=True)
    if text in ("LIVE", "GONE"):
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        pid = os.getpid() if text == "LIVE" else gone.pid
        holder = {"host": socket.gethostname(), "pid": pid, "pid_namespace": pid_namespace()}
        text = json.dumps(holder)
    (run / name).write_text(text)
    assert run_dir_holding(run / "data") == (run if is_run else None)
    if is_run:
        corpus = tmp_path / "in.txt"
        corpus.write_text("a small corpus of its own\n" * 40)
        with pytest.raises(NanolabError, match="is inside the run directory"):
            prepare_dataset([str(corpus)], run / "data", "chars", quiet=True)
        assert sorted(p.name for p in run.iterdir()) == [name]


def test_a_folder_holding_a_copy_of_a_runs_config_is_not_a_run(tmp_path: Path) -> None:
    """``cp runs/cap/config.yaml proj/ && cd proj && nanolab fit --config config.yaml
    --run.root runs``, as docs/evaluate.md suggests: the copy's header made ``proj`` a run, and
    fit's run directory and ``prepare -o`` below it were refused as inside it."""
    run = _fake_run(tmp_path / "runs", "cap")
    (run / "config.yaml").write_text("# nanolab fit: this run's merged config\ntrainer: {}\n")
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "config.yaml").write_bytes((run / "config.yaml").read_bytes())
    assert run_dir_holding(proj / "runs" / "again") is None
    assert claim_run_dir(proj / "runs" / "again", {"a": 1}, resuming=False).run_id
    corpus = tmp_path / "in.txt"
    corpus.write_text("a small corpus of its own\n" * 40)
    prepare_dataset([str(corpus)], proj / "data" / "sh", "chars", quiet=True)
    assert (proj / "data" / "sh" / "meta.json").is_file()


@pytest.mark.parametrize(
    ("target", "problem"),
    [
        ("runs/B/checkpoints/last.ckpt", "is inside the run directory"),
        ("runs/B/metrics.jsonl", "is inside the run directory"),
        ("runs/B/new.json", "is inside the run directory"),
        ("notes.txt", "is not an earlier `nanolab eval --json` result"),
        ("", "--json is empty"),
        ("runs", "is a folder"),
    ],
)
def test_eval_json_never_replaces_another_runs_or_a_users_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str, problem: str
) -> None:
    monkeypatch.chdir(tmp_path)
    _fake_run(tmp_path / "runs", "B")
    (tmp_path / "notes.txt").write_text("mine\n")
    before = _digest(tmp_path)
    with pytest.raises(EvalArgumentError, match=problem):
        check_json_target(target)
    assert _digest(tmp_path) == before


def test_eval_json_may_replace_its_own_earlier_output(tmp_path: Path) -> None:
    out = tmp_path / "tasks.json"
    assert check_json_target(str(out)) == out  # a new file
    out.write_text(json.dumps({"event": "tasks", "evaluated_by": "nanolab eval", "step": 6}))
    assert check_json_target(str(out)) == out
    out.write_text(json.dumps({"event": "tasks", "step": 6}))  # looks alike, not ours
    with pytest.raises(EvalArgumentError, match="not an earlier"):
        check_json_target(str(out))


@pytest.mark.parametrize(
    ("plot", "problem"),
    [
        ("{tmp}", "is not a file name"),
        ("", "is not a file name"),
        ("loss.txt", "matplotlib cannot write .txt"),
        ("loss", "a file without a suffix"),
        ("{tmp}/runs/B/loss.png", "is inside the run directory"),
    ],
)
def test_report_plot_names_a_bad_file_before_reading_runs(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    plot: str,
    problem: str,
) -> None:
    from nanolab.report import main

    monkeypatch.chdir(tmp_path)
    _fake_run(tmp_path / "runs", "B")
    before = _digest(tmp_path)
    assert main([str(tmp_path / "runs"), "--plot", plot.format(tmp=tmp_path)]) == 2
    out = capsys.readouterr()
    assert out.out == ""  # refused before the table is printed
    assert problem in out.err and len(out.err.strip().splitlines()) == 1
    assert _digest(tmp_path) == before


# -- config values that crashed a run after its checks ----------------------------------------
@pytest.mark.parametrize("group", ["checkpoint", "preemption", "run", "trainer", "notify"])
def test_a_group_set_to_null_in_yaml_is_one_line(tmp_path: Path, group: str) -> None:
    path = tmp_path / "null.yaml"
    path.write_text(f"{group}: null\n")
    with pytest.raises(FitParseError, match=rf"`{group}: null` gives the {group} group no"):
        parse_fit_config(["--config", str(path)])


def test_max_steps_null_is_refused_by_fit_estimate_and_queue_alike(
    tmp_path: Path, char_dataset: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One resolver: the null is named the same way by every entry point, with both files."""
    from nanolab.estimator.cli import main as estimate

    base = write_config(tmp_path / "base.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    null = tmp_path / "null_steps.yaml"
    null.write_text("trainer: {max_steps: null}\n")
    problem = "trainer.max_steps must be a positive number of optimizer steps"
    assert estimate(["--config", str(base), "--config", str(null), "--device", "cpu"]) == 2
    assert problem in capsys.readouterr().err
    with pytest.raises(JobConfigError) as err:
        parse_config(base, ["--config", str(null)], "q", tmp_path)
    assert str(err.value).startswith(f"{base} + {null}: {problem}"), err.value


def test_run_and_job_names_with_control_characters_are_refused() -> None:
    for name in ("a\nb", "tab\there", "bell\a"):
        with pytest.raises(RunConfigError, match="control characters"):
            check_run_name(name)
    with pytest.raises(JobConfigError, match="control characters"):
        job_names(Path("c.yaml"), "a\nb", [], None)
    with pytest.raises(JobConfigError, match="plain folder name"):
        job_names(Path("c.yaml"), "   ", [], None)
    check_run_name("ablation-é 2")  # printable, not ASCII: fine
    # each refused name is one the line names (' ' was refused quoting rules it kept)
    for name, rule in ((" ", "only blanks"), ("\t ", "control characters"), ("a\\b", "'\\'")):
        with pytest.raises(RunConfigError, match=re.escape(rule)):
            check_run_name(name)
    with pytest.raises(RunConfigError, match="300 bytes long, over the 255 a folder name"):
        check_run_name("x" * 300)  # the run directory's "File name too long", said first


# -- run directories and data folders with the wrong thing in them ----------------------------
@pytest.mark.parametrize("name", ["config.yaml", "metrics.jsonl"])
def test_a_folder_in_place_of_a_run_file_is_refused_before_the_run(
    tmp_path: Path, name: str
) -> None:
    run = _fake_run(tmp_path, "r")
    (run / name).unlink()
    (run / name).mkdir()
    before = sorted(p.name for p in run.iterdir())
    with pytest.raises(RunDirError, match=f"{name} is a folder where the run keeps a file"):
        claim_run_dir(run, {"a": 1}, resuming=True)
    assert sorted(p.name for p in run.iterdir()) == before  # no temp file, nothing moved


def test_a_config_kept_in_an_empty_run_directory_is_never_replaced(tmp_path: Path) -> None:
    """A ``config.yaml`` the user keeps where a run will go (notes, a queued job's own
    ``--config``) is refused, untouched, or with ``run.fresh`` moved to ``previous/``; the
    run's own copy (its header, or the whole dump a run wrote before the header), left by a
    launch that died before its first record, is taken over."""
    from nanolab.callbacks.loggers import write_config_yaml
    from nanolab.runs import CONFIG_HEADER

    run = tmp_path / "exp"
    run.mkdir()
    mine = "# my settings\ntrainer: {max_steps: 6}\n"
    (run / "config.yaml").write_text(mine)
    before = _digest(tmp_path)
    with pytest.raises(RunDirError, match=r"exp/config\.yaml is not a config a run wrote .*move"):
        claim_run_dir(run, {"a": 1}, resuming=False)
    assert _digest(tmp_path) == before
    claim = claim_run_dir(run, {"a": 1}, resuming=False, fresh=True)
    assert claim.archived_to is not None and (claim.archived_to / "config.yaml").read_text() == mine
    assert not (run / "config.yaml").exists()

    old = "seed_everything: 1\ntrainer: {}\nmodel: {}\ndata: {}\nrun: {}\nckpt_path: null\nweights_only: null\n"
    (run / "config.yaml").write_text(old)  # what a run wrote before the header
    assert claim_run_dir(run, {"a": 1}, resuming=False).run_id

    class Dumper:  # what LightningCLI's parser gives write_config_yaml
        def dump(self, config, **kwargs):
            return "trainer: {max_steps: 6}\n"

    write_config_yaml(Dumper(), None, run / "config.yaml")
    assert (run / "config.yaml").read_text().startswith(CONFIG_HEADER)
    assert claim_run_dir(run, {"a": 1}, resuming=False).run_id


def test_a_run_log_that_cannot_be_read_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").mkdir()
    with pytest.raises(RunLogReadError, match="cannot be read"):
        read_records(tmp_path / "metrics.jsonl")
    assert read_records(tmp_path / "absent.jsonl") == []  # not started: simply no records


def test_prepare_says_whether_the_folder_holds_a_dataset_or_other_files(
    tmp_path: Path, char_dataset: Path
) -> None:
    corpus = tmp_path / "in.txt"
    corpus.write_text("a small corpus of its own\n" * 400)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep\n")
    with pytest.raises(OutputInUseError, match="other files") as err:
        prepare_dataset([str(corpus)], tmp_path / "mine", "chars", quiet=True)
    assert not err.value.holds_dataset
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep\n"
    with pytest.raises(OutputInUseError, match="a dataset of other sources") as err:
        prepare_dataset([str(corpus)], char_dataset, "chars", quiet=True)
    assert err.value.holds_dataset


def test_a_stale_dataset_offers_a_null_source_only_where_it_works(
    tmp_path: Path, char_dataset: Path, capsys
) -> None:
    """The refusal offered ``--data.source null`` to a data class that sets ``self.source``
    itself (the init template's records renderer), where a null changes nothing, and said
    "fit never overwrites one" under ``nanolab validate``."""
    from jsonargparse import Namespace

    from nanolab.cli import main
    from nanolab.data.datamodule import TokenDataModule
    from nanolab.run.compose import data_vocab

    corpus = tmp_path / "other.txt"
    corpus.write_text("another corpus of its own\n" * 400)

    class OwnSource(TokenDataModule):  # renders its own text, as the records example does
        def __init__(self, **kwargs: object) -> None:
            super().__init__(**kwargs)
            self.source = [str(corpus)]

    given = {"dataset_dir": str(char_dataset), "source": None}
    with pytest.raises(RunConfigError) as own:
        data_vocab(OwnSource(**given), Namespace(init_args=Namespace(**given)), "validate")
    assert "--data.source null" not in str(own.value)
    assert "and validate never overwrites one: choose another --data.dataset_dir" in str(own.value)
    assert "--force" in str(own.value)
    config = write_config(
        tmp_path / "stale.yaml",
        tiny_overrides(char_dataset, tmp_path / "runs", data__source=[str(corpus)]),
    )
    assert main(["validate", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "and validate never overwrites one: use it as it is with --data.source null" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "runs").exists()


# -- statistics -------------------------------------------------------------------------------
def test_welch_on_seeds_that_agree_to_many_digits_is_quiet_and_matches_scipy() -> None:
    pytest.importorskip("scipy")
    from scipy import stats

    from nanolab.stats import welch

    a, b = [2.5000001, 2.5000002, 2.5000001], [2.5000003, 2.5000001, 2.5000004]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = welch(a, b).p_value
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert p == pytest.approx(stats.ttest_ind(a, b, equal_var=False).pvalue, rel=1e-6)
    a, b = [1.1, 0.9, 1.05, 0.97], [1.2, 1.35, 1.1]
    assert welch(a, b).p_value == pytest.approx(
        stats.ttest_ind(a, b, equal_var=False).pvalue, rel=1e-9
    )


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["fit", "CONFIG"], "; a config file goes after --config: --config CONFIG"),
        (["fit", "--config", "no-such.yaml"], "--config: {tmp}/no-such.yaml does not exist"),
    ],
    ids=["without-config", "missing-file"],
)
def test_a_config_file_given_wrong_is_one_line_with_the_fix(
    tmp_path: Path, capsys, monkeypatch, argv: list[str], says: str
) -> None:
    """``nanolab fit configs/x.yaml`` (``--config`` forgotten) and a ``--config`` path that
    does not exist: one line that says what to type, exit 2, nothing written."""
    from conftest import QUICKSTART

    from nanolab.cli import main

    monkeypatch.chdir(tmp_path)
    argv = [str(QUICKSTART) if a == "CONFIG" else a for a in argv]
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    expected = says.replace("CONFIG", str(QUICKSTART)).replace("{tmp}", str(tmp_path))
    assert err.startswith("nanolab fit: error: ") and expected in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_class_given_by_class_path_wrong_is_one_line_with_the_fix(tmp_path: Path) -> None:
    """A callback class name its module lacks is said once, with the nearest name; a key its
    class does not take says where to look (the parser said the first twice, the second as a
    bare "Option 'x' is not accepted")."""
    quickstart = str(Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml")
    with pytest.raises(FitParseError) as err:
        parse_fit_config(
            ["--config", quickstart, "--trainer.callbacks+=nanolab.callbacks.MetricsLogg"]
        )
    said = str(err.value)
    assert "Problem with given class_path" not in said and said.count("has no") == 1, said
    assert "did you mean nanolab.callbacks.MetricsLog?" in said
    data = tmp_path / "data.yaml"
    data.write_text(
        "data:\n  class_path: nanolab.data.datamodule.TokenDataModule\n"
        "  init_args:\n    micro_batch_sise: 2\n"
    )
    with pytest.raises(FitParseError) as err:
        parse_fit_config(["--config", quickstart, "--config", str(data)])
    assert str(err.value) == (
        f"config file {data}: unknown setting data.init_args.micro_batch_sise; "
        "did you mean data.init_args.micro_batch_size?"
    )


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ([""], "the checkpoint to evaluate is empty (''); give a run directory or a .ckpt file"),
        (["runs/x", "--suite", ""], "the suite is empty (''); give a YAML list of tasks"),
    ],
)
def test_eval_of_an_empty_checkpoint_or_suite_name_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    argv: list[str], says: str,
) -> None:  # fmt: skip
    """``nanolab eval ''`` looked for a run in the current folder and said ": no complete
    checkpoint in this run directory" (a blank name); ``--suite ''`` read it as a bundle."""
    from nanolab.eval_tasks import main as eval_main

    monkeypatch.chdir(tmp_path)
    assert eval_main([*argv, "--device", "cpu", "--no-log"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"nanolab eval: error: {says}") and "\n" not in err, err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("given", "line"),
    [
        (["--budget.max_tokens", "1e6"], "budget.max_tokens: 1000000.0 is read as a float"),
        (["--trainer.max_steps", "1e3"], "trainer.max_steps: 1000.0 is read as a float"),
        (["--model.gpt.n_layer", "2e0"], "model.gpt.n_layer: 2.0 is read as a float"),
        (["--config", "{file}"], "budget.max_tokens: 1000000000.0 is read as a float"),
    ],
    ids=["union-with-null", "max_steps", "class-setting", "in-a-file"],
)
def test_a_whole_float_for_a_whole_number_setting_says_to_write_it_whole(
    tmp_path: Path, given: list[str], line: str
) -> None:
    """1e9 reads as a float: fit, estimate and queue add refuse it in the same one line, with
    the number written whole, instead of the parser's report or a contradiction."""
    from conftest import QUICKSTART, nanolab_here

    (tmp_path / "b.yaml").write_text("budget: {max_tokens: 1e9}\n")
    given = [g.replace("{file}", str(tmp_path / "b.yaml")) for g in given]
    args = ["--config", str(QUICKSTART), *given]
    verbs = {
        "fit": ["fit", *args, "--print_config"],
        "queue add": [  # its configs are positional
            *("queue", "add", str(QUICKSTART), *(g for g in given if g != "--config")),
            *("--db", str(tmp_path / "q.db")),
        ],
    }
    if "budget" not in line:  # the estimate does not read the budget group
        verbs["estimate"] = ["estimate", *args, "--device", "cpu", "--vocab-size", "71"]
    whole = line.split(": ")[1].split(".")[0]
    for verb, argv in verbs.items():
        done = nanolab_here(*argv, cwd=tmp_path)
        assert done.returncode == 2, (verb, done.stdout[-300:])
        (said,) = done.stderr.strip().splitlines()
        assert said.startswith(f"nanolab {verb}: error: ") and line in said, said
        assert said.endswith(f"takes a whole number; write it whole: {whole}"), said
