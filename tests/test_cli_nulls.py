"""``null`` on the command line for a setting of the model or data class."""

from __future__ import annotations

import yaml
from conftest import QUICKSTART

from nanolab.cli import main
from nanolab.run.parse import nulls_as_class_settings


def test_nested_nulls_become_init_args_dicts() -> None:
    argv = ["fit", "--model.gpt.vocab_size", "null", "--model.init_args.schedule.decay_steps=~"]
    assert nulls_as_class_settings(argv) == [
        "fit",
        "--model",
        '{"init_args": {"gpt": {"vocab_size": null}}}',
        "--model",
        '{"init_args": {"schedule": {"decay_steps": null}}}',
    ]
    same = ["fit", "--model.gpt.n_layer", "3", "--data.source", "nullable.txt"]
    assert nulls_as_class_settings(same) == same


def test_fit_takes_null_for_optional_class_settings(capsys) -> None:
    try:
        code = main(
            [
            "fit", "--config", str(QUICKSTART), "--run.name", "nulls",
            "--model.gpt.n_layer", "3",
            "--model.gpt.vocab_size", "null",
            "--model.schedule.decay_steps", "null",
            "--model.gpt.dropout", "0.1",
            "--data.source", "null",
            "--print_config",
            ]
        )  # fmt: skip
    except SystemExit as done:  # --print_config exits after printing
        code = done.code
    out = capsys.readouterr().out
    assert code in (0, None), out
    cfg = yaml.safe_load(out)
    init = cfg["model"]["init_args"]
    assert init["gpt"]["vocab_size"] is None and init["schedule"]["decay_steps"] is None
    # settings given before and after the null are kept
    assert init["gpt"]["n_layer"] == 3 and init["gpt"]["dropout"] == 0.1
    assert cfg["data"]["init_args"]["source"] is None


SEED_REFUSAL = (
    "seed_everything: null is not a seed; give a number from 0 to 4294967295, true for a random "
    "seed (drawn at launch and recorded in config.yaml), or false for none"
)


def test_a_null_seed_is_refused_alike_in_a_file_and_on_the_command_line(tmp_path) -> None:
    """Lightning reads a file's ``seed_everything: null`` as seed 0 for every such run, and the
    command line's parser refused the same null while offering it; both now name the choices."""
    from conftest import nanolab_here

    null_file = tmp_path / "seed.yaml"
    null_file.write_text("seed_everything: null\n")
    fit = ["--run.root", str(tmp_path / "runs")]  # refused at launch, before anything is made
    for verb, extra in (("fit", fit), ("estimate", ["--device", "cpu", "--vocab-size", "71"])):
        for given in (["--seed_everything", "null"], ["--config", str(null_file)]):
            args = ["--config", str(QUICKSTART), *given, *extra]
            done = nanolab_here(verb, *args, cwd=tmp_path)
            assert done.returncode == 2, (verb, given, done.stdout[-500:])
            assert done.stderr.strip() == f"nanolab {verb}: error: {SEED_REFUSAL}", done.stderr


def test_a_union_without_null_does_not_offer_it() -> None:
    from nanolab.run.parse import union_problem

    report = (
        'Parser key "trainer.x": Does not validate against any of the Union subtypes Subtypes: '
        "[<class 'bool'>, <class 'int'>] Errors: - Expected a <class 'bool'> - Expected a "
        "<class 'int'> Given value type: <class 'str'> Given value: y"
    )
    assert union_problem(report) == "trainer.x: 'y' is not valid; expected bool or int"
