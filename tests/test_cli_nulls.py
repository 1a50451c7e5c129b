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
