"""Options of ``nanolab fit`` given in a shape the parser cannot read: one line naming the
setting meant and how to write it, exit 2 (parsed in this process: nothing is trained)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import tiny_overrides, write_config

from nanolab.run.parse import FitParseError, parse_fit_config


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
