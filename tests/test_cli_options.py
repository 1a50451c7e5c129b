"""Options of ``nanolab fit`` given in a shape the parser cannot read: one line naming the
setting meant and how to write it, exit 2 (parsed in this process: nothing is trained)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import tiny_overrides, write_config

from nanolab.errors import RunConfigError
from nanolab.run.parse import FitParseError, parse_fit_config, verb_keys


def refusal(args: list[str]) -> str:
    """The one error line ``fit ARGS`` is refused with."""
    with pytest.raises(FitParseError) as refused:
        parse_fit_config(args)
    line = str(refused.value)
    assert "\n" not in line and "Traceback" not in line
    return line


# -- an option is matched whole, never by a prefix ---------------------------------------------
def test_a_prefix_of_several_options_is_an_unknown_option_with_the_setting_meant() -> None:
    """``--mode plain`` was "ambiguous option: --mode could match --model.help, --model"."""
    assert refusal(["--mode", "plain"]) == (
        "unknown option --mode; did you mean --progress.mode? (settings take their group)"
    )


def test_a_prefix_of_one_option_is_not_completed_silently() -> None:
    """``--seed 3`` set seed_everything without a word (argparse completed the prefix)."""
    assert refusal(["--seed", "3"]).startswith("unknown option --seed; did you mean ")
    assert parse_fit_config(["--seed_everything", "3"])["seed_everything"] == 3


def test_fit_refuses_a_prefix_in_one_line_with_exit_2(
    char_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from nanolab.cli import main

    base = write_config(tmp_path / "base.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    assert main(["fit", "--config", str(base), "--mode", "plain"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "nanolab fit: error: unknown option --mode; did you mean --progress.mode? "
        "(settings take their group)"
    )
    assert not (tmp_path / "runs").exists()


# -- an option that is none names the nearest the parser has -----------------------------------
@pytest.mark.parametrize("verb", ["fit", "validate", "test"])
@pytest.mark.parametrize(
    ("given", "line"),
    [
        (["--ckpt_pth", "x"], "unknown option --ckpt_pth; did you mean --ckpt_path?"),
        (["--print_confg"], "unknown option --print_confg; did you mean --print_config?"),
        (["--modl", "x"], "unknown option --modl; did you mean --model?"),
        (["--bogus", "8"], "unknown option --bogus; `nanolab {verb} --help` lists its options, "
         "and its settings take their group (--trainer.precision 32-true, "
         "--data.micro_batch_size 8)"),
    ],
)  # fmt: skip
def test_an_unknown_option_names_the_nearest_real_one(
    verb: str, given: list[str], line: str
) -> None:
    """``fit --ckpt_pth x`` (and validate/test) said only "unrecognized arguments: --ckpt_pth
    x", naming no option, while ``queue add`` named the close one: one line, the nearest
    options (difflib), or where they are listed; every setting the line names is the verb's."""
    from nanolab.run.parse import parse_command

    with pytest.raises(RunConfigError) as refused:
        parse_command([verb, *given])
    assert str(refused.value) == line.format(verb=verb)
    if "--help" in line:
        for setting in ("--trainer.precision", "--data.micro_batch_size"):
            assert setting[2:] in verb_keys(verb)


def test_fit_names_the_nearest_option_in_one_line_with_exit_2(
    char_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from nanolab.cli import main

    base = write_config(tmp_path / "base.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    assert main(["fit", "--config", str(base), "--ckpt_pth", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "nanolab fit: error: unknown option --ckpt_pth; did you mean --ckpt_path?"
    assert not (tmp_path / "runs").exists()


# -- an option without its group names every setting of that name --------------------------------
@pytest.mark.parametrize(
    ("name", "meant"),
    [
        ("micro_batch_size", ["--run.micro_batch_size", "--data.micro_batch_size"]),
        ("patience", ["--spike.patience", "--budget.patience", "--divergence.patience"]),
        ("block_size", ["--data.block_size", "--model.gpt.block_size"]),
        ("fresh", ["--run.fresh"]),  # log.fresh follows run.fresh: no option of its own
        ("seed", ["--data.seed", "--seed_everything"]),
        ("val_windows", ["--data.val_windows"]),
        ("n_head", ["--model.gpt.n_head"]),
        ("max_steps", ["--trainer.max_steps"]),
    ],
)
def test_an_option_without_its_group_names_every_setting_of_that_name(
    name: str, meant: list[str]
) -> None:
    """``--micro_batch_size 8`` was hinted as ``--run.micro_batch_size`` only, though
    ``--data.micro_batch_size`` is one too; each option named is one the parser takes."""
    from nanolab.run import schema

    line = refusal([f"--{name}", "8"])
    assert line.startswith(f"unknown option --{name}; did you mean ")
    assert line.endswith("? (settings take their group)")
    named = [w.strip(",?") for w in line.split("did you mean ")[1].split() if w.startswith("--")]
    assert sorted(named) == sorted(meant)
    settings = schema.load("fit").settings  # remembered by the parse above
    for option in named:  # each, given its default, is taken as it is written
        default = settings[option[2:]]["default"] if option[2:] in settings else 1337
        value = {None: "null", True: "true", False: "false"}.get(default, str(default))
        parse_fit_config([option, value])


# -- a group given one value names the setting it is for ----------------------------------------
GROUP = "is a group of settings, not a value"


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--progress", "plain"], f"--progress {GROUP}; did you mean --progress.mode plain?"),
        (["--progress=mode=plain"], f"--progress {GROUP}; did you mean --progress.mode plain?"),
        (
            ["--checkpoint", "5"],
            f"--checkpoint {GROUP}; did you mean --checkpoint.every_n_steps 5, "
            "--checkpoint.keep_best 5 or --checkpoint.keep_last 5?",
        ),
        (["--spike", "false"], f"--spike {GROUP}; did you mean --spike.enabled false?"),
        (
            ["--model.optimizer", "adam"],
            f"--model.optimizer {GROUP}; did you mean --model.optimizer.name adam?",
        ),
        (
            ["--trainer", "5"],
            f"--trainer {GROUP}; a setting of it is --trainer.KEY VALUE "
            "(nanolab fit --help-all lists them)",
        ),
        (
            ["--model", "GPT"],
            "--model takes a class path (module.Class; the default: "
            "nanolab.training.module.GPTLightningModule) or a mapping of its settings, not "
            "'GPT'; a setting of it is --model.KEY VALUE (nanolab fit --help-all lists them)",
        ),
    ],
)
def test_a_group_given_one_value_names_the_setting_it_is_for(args: list[str], line: str) -> None:
    """``--progress plain`` was the parser's 'Parser key "progress": Unable to load config
    'plain' - Parser key "progress": Unable to load config "plain"', naming no setting."""
    assert refusal(args) == line


def test_a_group_still_takes_its_settings_at_once(tmp_path: Path) -> None:
    """What a group does take is read as before: a mapping, or a file of its settings."""
    assert parse_fit_config(["--progress", "{mode: plain}"])["progress"]["mode"] == "plain"
    settings = write_config(tmp_path / "progress.yaml", {"mode": "bar"})
    assert parse_fit_config(["--progress", str(settings)])["progress"]["mode"] == "bar"


def test_fit_refuses_a_group_given_one_value_in_one_line_with_exit_2(
    char_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from nanolab.cli import main

    base = write_config(tmp_path / "base.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    assert main(["fit", "--config", str(base), "--checkpoint", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("nanolab fit: error: --checkpoint is a group of settings")
    assert "\n" not in err and not (tmp_path / "runs").exists()


def test_a_value_of_the_wrong_shape_says_what_is_expected_once() -> None:
    """jsonargparse's "Expected a tuple with 2 elements" was quoted after our own "expected":
    "expected Expected a tuple with 2 elements"."""
    from nanolab.run.parse import type_problem

    text = 'Parser key "model.optimizer.betas": Expected a tuple with 2 elements. Got value: [0.9]'
    assert type_problem(text) == (
        "model.optimizer.betas: '[0.9]' is not valid; expected a tuple with 2 elements"
    )
    text = "Parser key \"run.eval_every_steps\": Expected a <class 'int'>. Got value: x"
    assert type_problem(text) == "run.eval_every_steps: 'x' is not valid; expected int"
