"""``nanolab init``: the starter project is complete, never overwrites, and really trains."""

from __future__ import annotations

import gzip
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from importlib import resources
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml

from nanolab.cli import VERBS
from nanolab.scaffold import main, template_files, write_project

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
STARTER_FILES = {
    "README.md",
    ".gitignore",
    "callbacks.py",
    "configs/experiment.yaml",
    "data/README.md",
}


def _sample_text(chars: int = 60_000) -> str:
    blob = resources.files("nanolab.data").joinpath("corpus", "shakespeare.txt.gz").read_bytes()
    return gzip.decompress(blob).decode("utf-8")[:chars]


def _nanolab(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    # PYTHONPATH=. as the starter README says, so `callbacks.SampleText` imports.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([".", os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "nanolab", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _flat_keys(tree: Any, prefix: str = "") -> set[str]:
    if not isinstance(tree, dict):
        return {prefix}
    keys: set[str] = set()
    for key, value in tree.items():
        keys |= _flat_keys(value, f"{prefix}{key}.")
    return {k.rstrip(".") for k in keys}


# -- what init writes ----------------------------------------------------------------------
def test_init_is_a_registered_verb() -> None:
    assert VERBS["init"][0] == "nanolab.scaffold:main"


def test_init_writes_the_starter(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    project = tmp_path / "tiny-poems"
    assert main([str(project)]) == 0
    written = {p.relative_to(project).as_posix() for p in project.rglob("*") if p.is_file()}
    assert written == STARTER_FILES
    assert (project / "data" / "text").is_dir()
    for rel in STARTER_FILES:
        assert "{{" not in (project / rel).read_text(), f"{rel} has an unfilled placeholder"
    config = yaml.safe_load((project / "configs" / "experiment.yaml").read_text())
    assert config["run"]["name"] == "tiny-poems"
    assert config["data"]["source"] == ["data/text"]
    assert "nanolab fit --config configs/experiment.yaml" in capsys.readouterr().out


def test_template_set_is_what_the_docs_promise() -> None:
    assert set(template_files()) == STARTER_FILES


def test_name_comes_from_the_folder_or_the_flag(tmp_path: Path) -> None:
    write_project(tmp_path / "my poems!", None)
    config = yaml.safe_load((tmp_path / "my poems!" / "configs" / "experiment.yaml").read_text())
    assert config["run"]["name"] == "my-poems"
    # A name YAML would read as a number or boolean stays a string: the template quotes it.
    write_project(tmp_path / "b", "2024")
    config = yaml.safe_load((tmp_path / "b" / "configs" / "experiment.yaml").read_text())
    assert config["run"]["name"] == "2024"


def test_bad_name_is_one_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "p"), "--name", "../escape"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("nanolab init: error: --name") and "\n" not in err
    assert not (tmp_path / "p").exists()


# -- never overwrite -----------------------------------------------------------------------
def test_refuses_to_overwrite_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    project = tmp_path / "mine"
    (project / "configs").mkdir(parents=True)
    (project / "configs" / "experiment.yaml").write_text("my own config\n")
    assert main([str(project)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, "one line"
    assert "experiment.yaml already exists" in err and "nothing was written" in err
    assert (project / "configs" / "experiment.yaml").read_text() == "my own config\n"
    left = {p.relative_to(project).as_posix() for p in project.rglob("*")}
    assert left == {"configs", "configs/experiment.yaml"}, "checked everything before writing"


def test_existing_folder_without_clashes_is_fine(tmp_path: Path) -> None:
    (tmp_path / "data" / "text").mkdir(parents=True)
    (tmp_path / "data" / "text" / "mine.txt").write_text("already here\n")
    assert main([str(tmp_path)]) == 0
    assert (tmp_path / "data" / "text" / "mine.txt").read_text() == "already here\n"


def test_a_file_in_the_way_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "not-a-folder"
    target.write_text("x")
    assert main([str(target)]) == 2
    assert "is not a folder" in capsys.readouterr().err
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "configs").write_text("a file where a folder goes")
    assert main([str(tmp_path / "p")]) == 2
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["configs"]


# -- the starter config stays in step with nanolab's ---------------------------------------
@pytest.mark.skipif(not QUICKSTART.is_file(), reason="configs/quickstart.yaml not in this tree")
def test_starter_config_has_the_quickstarts_keys() -> None:
    starter = _flat_keys(yaml.safe_load(template_files()["configs/experiment.yaml"]))
    quick = _flat_keys(yaml.safe_load(QUICKSTART.read_text()))
    # The starter adds only what BPE on your own text needs.
    assert starter - quick <= {"data.bpe_vocab_size"}, starter - quick
    assert quick - starter == set(), f"the quickstart gained keys: {quick - starter}"


def test_starter_config_parses(tmp_path: Path) -> None:
    write_project(tmp_path / "proj")
    proc = _nanolab(
        ["fit", "--config", "configs/experiment.yaml", "--print_config"], cwd=tmp_path / "proj"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = yaml.safe_load(proc.stdout)
    assert printed["run"]["name"] == "proj"
    assert printed["data"]["tokenizer"] == "bpe"


def _readme_commands(readme: str) -> list[list[str]]:
    blocks = re.findall(r"```\n(.*?)```", readme, flags=re.S)
    lines = [line for block in blocks for line in block.splitlines()]
    return [shlex.split(line) for line in lines if line.startswith("nanolab ")]


@pytest.mark.slow
def test_readme_commands_train_the_starter(tmp_path: Path) -> None:
    """The starter README's own commands, run as written, prepare the text and train."""
    project = tmp_path / "proj"
    write_project(project)
    (project / "data" / "text" / "plays.txt").write_text(_sample_text())
    commands = _readme_commands((project / "README.md").read_text())
    prepare, fit = commands[0], commands[1]
    assert prepare[:2] == ["nanolab", "prepare"] and fit[:2] == ["nanolab", "fit"]

    proc = _nanolab(prepare[1:], cwd=project)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (project / "data" / "tokens" / "meta.json").is_file()

    # Small and short, with the example callback switched on.
    quick = ["--trainer.max_steps", "2", "--run.eval_every_steps", "2"]
    quick += ["--data.micro_batch_size", "4", "--data.val_windows", "4"]
    quick += [
        "--trainer.callbacks+=callbacks.SampleText",
        "--trainer.callbacks.max_new_tokens",
        "8",
    ]
    proc = _nanolab([*fit[1:], *quick], cwd=project)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (project / "runs" / "proj" / "checkpoints" / "last.ckpt").is_file()
    assert "--- sample at step 2 ---" in proc.stdout + proc.stderr
    # The config's data.source matched what prepare made: fit reused it, it did not re-tokenize.
    assert "prepared data/tokens" not in proc.stderr


# -- the example callback ------------------------------------------------------------------
def _load_starter_callbacks(project: Path) -> Any:
    spec = importlib.util.spec_from_file_location("starter_callbacks", project / "callbacks.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sample_callback_leaves_the_training_rng_alone(tmp_path: Path) -> None:
    from nanolab.data.prepare import prepare_dataset
    from nanolab.model import GPT, GPTConfig

    project = tmp_path / "proj"
    write_project(project)
    text = project / "data" / "text" / "t.txt"
    text.write_text(_sample_text(5_000))
    meta = prepare_dataset([str(text)], project / "data" / "tokens", "chars", quiet=True)
    callbacks = _load_starter_callbacks(project)

    model = GPT(
        GPTConfig(vocab_size=meta["vocab_size"], block_size=16, n_layer=1, n_head=2, n_embd=16)
    )
    model.train()
    trainer = SimpleNamespace(
        datamodule=SimpleNamespace(dataset_dir=project / "data" / "tokens"),
        sanity_checking=False,
        global_step=7,
    )
    pl_module = SimpleNamespace(model=model, device=torch.device("cpu"))
    cb = callbacks.SampleText(prompt="To be", max_new_tokens=5)
    cb.setup(trainer, pl_module, "fit")

    torch.manual_seed(123)
    before = torch.get_rng_state()
    cb.on_validation_end(trainer, pl_module)
    assert torch.equal(torch.get_rng_state(), before), "sampling consumed the global RNG"
    assert model.training, "the model is back in training mode"
