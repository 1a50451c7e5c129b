"""docs/configs.md: configs compose as the page says.

Each GPT-2 size overlay, given after the base, changes exactly the keys it names (the rest is the
base's), and the page's own commands run as written.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from nanolab.cli import main

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
BASE = CONFIGS / "gpt2-124m.yaml"
OVERLAYS = ("gpt2-350m.yaml", "gpt2-774m.yaml")


def _nanolab(args: list[str], cwd: Path) -> tuple[int, str]:
    """Run a verb in this process (a new process would spend most of its time importing torch):
    its exit code and what it printed."""
    out = io.StringIO()
    here = Path.cwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out):
            try:
                code = main(args)
            except SystemExit as stop:  # --print_config exits once it has printed
                code = stop.code if isinstance(stop.code, int) else 1
    finally:
        os.chdir(here)
    return code, out.getvalue()


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b.c": value}``; a class spec's ``init_args`` level is dropped, so ``model.gpt.x``
    names the same setting whether the parser prints the model as a class spec or not."""
    if not isinstance(tree, dict):
        return {prefix.rstrip("."): tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if key == "class_path":
            continue
        out.update(_flat(value, prefix if key == "init_args" else f"{prefix}{key}."))
    return out


def _printed(tmp_path: Path, *configs: Path) -> dict[str, Any]:
    args = ["fit", *(a for c in configs for a in ("--config", str(c))), "--print_config"]
    code, out = _nanolab(args, tmp_path)
    assert code == 0, out[-2000:]
    return _flat(yaml.safe_load(out))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_an_overlay_changes_exactly_its_own_keys(tmp_path: Path, overlay: str) -> None:
    base = _printed(tmp_path, BASE)
    composed = _printed(tmp_path, BASE, CONFIGS / overlay)
    own = _flat(yaml.safe_load((CONFIGS / overlay).read_text()))
    changed = {k for k in composed if composed[k] != base.get(k)}
    assert changed == {k for k in own if own[k] != base.get(k)}
    assert all(composed[k] == v for k, v in own.items()), "the overlay's values won"
    assert len(own) <= 10, "an overlay names only what differs"


def _page_commands(page: Path) -> list[list[str]]:
    blocks = re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S)
    lines = [line for block in blocks for line in block.splitlines()]
    return [shlex.split(line) for line in lines if line.startswith("nanolab ")]


def test_the_pages_commands_run_as_written(tmp_path: Path) -> None:
    commands = _page_commands(REPO / "docs" / "configs.md")
    assert {c[1] for c in commands} == {"fit", "estimate"}, commands
    (tmp_path / "configs").symlink_to(CONFIGS)
    for command in commands:
        code, out = _nanolab(command[1:], tmp_path)
        assert code == 0, f"{shlex.join(command)}: {out[-2000:]}"
        if "--print_config" in command:  # the base's context with the overlay's size
            printed = _flat(yaml.safe_load(out))
            assert printed["model.gpt.n_layer"] == 24 and printed["model.gpt.block_size"] == 1024
        else:  # the estimate describes the composed model
            assert "24 layers x 1024 wide" in out and "context 1024" in out, out[:500]


def test_a_flag_before_a_file_that_sets_it_loses_and_is_named(tmp_path: Path, capsys) -> None:
    """Order is the rule (a later --config wins over an earlier flag), so the flag it overrode
    is named with its value and the file, by fit and estimate alike; a flag after the file wins
    and is not named."""
    before = ["--model.gpt.n_layer", "3", "--config", str(BASE), "--trainer.max_steps=7"]
    capsys.readouterr()
    code, out = _nanolab(["fit", *before, "--print_config"], tmp_path)
    assert code == 0, out[-2000:]
    printed = _flat(yaml.safe_load(out))
    assert printed["model.gpt.n_layer"] == 12 and printed["trainer.max_steps"] == 7
    (warning,) = capsys.readouterr().err.strip().splitlines()
    assert warning.startswith(
        f"nanolab fit: warning: --model.gpt.n_layer 3 is overridden by config file {BASE}"
    ), warning
    code, out = _nanolab(["estimate", *before, "--gpu", "h100"], tmp_path)
    assert code == 0 and "12 layers x 768 wide" in out
    assert capsys.readouterr().err.strip() == warning.replace("nanolab fit:", "nanolab estimate:")
    after = ["--config", str(BASE), "--model.gpt.n_layer", "3", "--print_config"]
    code, out = _nanolab(["fit", *after], tmp_path)
    assert code == 0 and _flat(yaml.safe_load(out))["model.gpt.n_layer"] == 3
    assert capsys.readouterr().err.strip() == ""
    # The file sets the flag's own value: nothing was overridden, nothing is said.
    same = ["--model.gpt.n_layer", "12", "--config", str(BASE)]
    code, out = _nanolab(["fit", *same, "--print_config"], tmp_path)
    assert code == 0 and capsys.readouterr().err.strip() == ""
    code, out = _nanolab(["estimate", *same, "--gpu", "h100"], tmp_path)
    assert code == 0 and capsys.readouterr().err.strip() == ""
