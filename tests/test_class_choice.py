"""A model or data class chosen by class path keeps its own ``__init__`` defaults: only the
settings given (config files, the command line) carry over from the class chosen before, and a
given setting the chosen class does not take is named in one warning line. A typo after the
choice is named where it was typed, not in a file given for the class before."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest

from nanolab.estimator.setup import setup_from_config
from nanolab.run import class_choice
from nanolab.run.parse import FitParseError, parse_fit_config
from nanolab.training.resolve import compose, plain_config

REPO = Path(__file__).resolve().parents[1]
QUICK = str(REPO / "configs" / "quickstart.yaml")

FORK = """
import lightning as L
import torch

from nanolab.data.datamodule import TokenDataModule
from nanolab.model.config import GPTConfig
from nanolab.training.module import GPTLightningModule


class SmallGPT(GPTLightningModule):
    \"\"\"A GPT whose own defaults are a small model that compiles.\"\"\"

    def __init__(
        self,
        gpt: GPTConfig = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64),
        compile: bool = True,
        **kwargs,
    ) -> None:
        super().__init__(gpt=gpt, compile=compile, **kwargs)


class Data8(TokenDataModule):
    \"\"\"nanolab's data with a micro-batch and seed of its own.\"\"\"

    def __init__(self, *args, micro_batch_size: int = 8, seed: int = 7, **kwargs) -> None:
        super().__init__(*args, micro_batch_size=micro_batch_size, seed=seed, **kwargs)


class Bigram(L.LightningModule):
    \"\"\"A model of another family: no gpt, optimizer, schedule or compile.\"\"\"

    def __init__(self, vocab_size: int = 71, lr: float = 1e-2) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(vocab_size, vocab_size)
"""


@pytest.fixture
def fork(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    package = tmp_path / "src" / "forkclasses"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "own.py").write_text(textwrap.dedent(FORK))
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("forkclasses")]:
        del sys.modules[name]


def write(path: Path, text: str) -> str:
    path.write_text(textwrap.dedent(text))
    return str(path)


def fit_config(*args: str) -> dict:
    return plain_config(parse_fit_config(list(args)))


def test_a_class_chosen_in_yaml_keeps_its_own_defaults(fork: Path) -> None:
    config = write(
        fork / "small.yaml",
        """
        trainer: {accelerator: cpu, max_steps: 2}
        model: {class_path: forkclasses.own.SmallGPT}
        data: {class_path: forkclasses.own.Data8}
        """,
    )
    cfg = fit_config("--config", config)
    gpt = cfg["model"]["init_args"]["gpt"]
    assert (gpt["n_layer"], gpt["n_head"], gpt["n_embd"], gpt["block_size"]) == (2, 2, 64, 64)
    assert cfg["model"]["init_args"]["compile"] is True  # not nanolab's false
    data = cfg["data"]["init_args"]
    assert (data["micro_batch_size"], data["seed"]) == (8, 7)  # not nanolab's 32 and 1337
    assert data["dataset_dir"] == "data/shakespeare_char"  # the base's own, through **kwargs


def test_a_class_chosen_on_the_command_line_keeps_its_own_defaults_and_the_given_settings(
    fork: Path,
) -> None:
    """The quickstart's model and data settings were given: they carry over; the rest is the
    chosen class's own (``micro_batch_size`` given by the quickstart, ``seed`` not)."""
    cfg = fit_config(
        "--config", QUICK, "--model", "forkclasses.own.SmallGPT", "--model.gpt.dropout", "0.1",
        "--data", "forkclasses.own.Data8",
    )  # fmt: skip
    gpt = cfg["model"]["init_args"]["gpt"]
    assert (gpt["n_layer"], gpt["n_embd"], gpt["block_size"], gpt["dropout"]) == (4, 128, 128, 0.1)
    assert cfg["model"]["init_args"]["compile"] is False  # the quickstart gives it
    assert cfg["model"]["init_args"]["optimizer"]["lr"] == 3e-3
    assert (cfg["data"]["init_args"]["micro_batch_size"], cfg["data"]["init_args"]["seed"]) == (32, 7)  # fmt: skip


def test_estimate_reads_the_chosen_classes_defaults_as_fit_does(fork: Path) -> None:
    config = write(
        fork / "small.yaml",
        """
        trainer: {accelerator: cpu, devices: 1, max_steps: 2}
        model: {class_path: forkclasses.own.SmallGPT}
        data: {class_path: forkclasses.own.Data8}
        """,
    )
    setup = setup_from_config(compose(["--config", config]), vocab_size=64)
    fits = setup_from_config(fit_config("--config", config), vocab_size=64)
    assert (setup.gpt.n_layer, setup.gpt.n_embd, setup.gpt.block_size) == (2, 64, 64)
    assert setup.micro_batch_size == fits.micro_batch_size == 8
    assert setup.gpt == fits.gpt


def test_given_settings_the_chosen_class_does_not_take_are_named_in_one_warning(
    fork: Path, capsys: pytest.CaptureFixture
) -> None:
    capsys.readouterr()
    cfg = fit_config("--config", QUICK, "--model", "forkclasses.own.Bigram")
    assert cfg["model"]["init_args"] == {"vocab_size": 71, "lr": 0.01}
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1, warnings
    assert warnings[0] == (
        f"nanolab fit: warning: model.gpt, model.optimizer, model.schedule, model.compile "
        f"(given in config file {QUICK}) are left out of this run: forkclasses.own.Bigram does "
        "not take them (it takes vocab_size, lr)"
    )


def test_a_class_that_takes_every_given_setting_warns_nothing(
    fork: Path, capsys: pytest.CaptureFixture
) -> None:
    capsys.readouterr()
    fit_config("--config", QUICK, "--model", "forkclasses.own.SmallGPT")
    assert "left out of this run" not in capsys.readouterr().err


def test_a_typo_after_the_class_choice_is_named_where_it_was_typed(fork: Path) -> None:
    """Not the quickstart's ``model.gpt`` (given for the class chosen before, left out)."""
    with pytest.raises(FitParseError) as err:
        fit_config("--config", QUICK, "--model", "forkclasses.own.Bigram", "--model.lrr", "8")
    assert str(err.value) == "unknown setting --model.lrr; did you mean --model.lr?"


def test_a_typo_in_the_file_that_chooses_the_class_is_named_in_that_file(fork: Path) -> None:
    config = write(
        fork / "bigram.yaml",
        """
        model:
          class_path: forkclasses.own.Bigram
          init_args: {lrr: 0.1}
        """,
    )
    with pytest.raises(FitParseError) as err:
        fit_config("--config", QUICK, "--config", config)
    assert str(err.value) == (
        f"config file {config}: unknown setting model.init_args.lrr; did you mean "
        "model.init_args.lr?"
    )


def test_given_settings_are_read_from_files_flags_and_mapping_values(fork: Path) -> None:
    config = write(
        fork / "x.yaml",
        """
        model:
          class_path: forkclasses.own.SmallGPT
          init_args: {gpt: {n_layer: 3}, compile: false}
          schedule: {warmup_steps: 5}
        data: forkclasses.own.Data8
        """,
    )
    args = [
        "--config", config, "--model.init_args.optimizer.lr=1e-3", "--model.gpt.n_head", "1",
        "--model", '{"init_args": {"gpt": {"vocab_size": null}}}', "--model.help", "x",
    ]  # fmt: skip
    given = class_choice.given_settings(args, "model")
    assert list(given) == [
        "schedule.warmup_steps", "gpt.n_layer", "compile", "optimizer.lr", "gpt.n_head",
        "gpt.vocab_size",
    ]  # fmt: skip
    assert given["gpt.n_layer"] == f"config file {config}"
    assert given["gpt.n_head"] == "--model.gpt.n_head"
    assert class_choice.given_settings(args, "data") == {}


#: The doc's fork (docs/forking.md) on the quickstart, as its commands give it.
DOC_FORK = [
    ["--config", QUICK, "--model", "mylab.models.SmoothedGPT", "--model.gpt.attention_variant", "softcap"],
    ["--config", QUICK, "--model", "mylab.models.SmoothedGPT", "--model.label_smoothing", "0.1", "--data", "mylab.data.SubsetData", "--data.max_train_tokens", "200000"],
]  # fmt: skip
SHIPPED = [["--config", str(p)] for p in sorted((REPO / "configs").glob("*.yaml"))]
OVERLAYS = [
    ["--config", QUICK, "--config", str(p)]
    for group in ("strategy", "precision", "debug")
    for p in sorted((REPO / "configs" / group).glob("*.yaml"))
]


@pytest.fixture
def doc_fork(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/forking.md's ``mylab`` package (each ``# mylab/<file>.py`` block)."""
    text = (REPO / "docs" / "forking.md").read_text()
    for block in re.findall(r"```python\n(# mylab/\w+\.py\n.*?)```", text, flags=re.S):
        path = tmp_path / block.splitlines()[0][2:]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(block)
    (tmp_path / "mylab" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in [m for m in sys.modules if m.split(".")[0] == "mylab"]:
        del sys.modules[name]


@pytest.mark.parametrize("args", SHIPPED + OVERLAYS + DOC_FORK, ids=lambda a: " ".join(Path(x).name for x in a[1::2])[:60])  # fmt: skip
def test_shipped_configs_and_the_docs_compositions_read_as_before(
    args: list[str], doc_fork: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The config with the class-choice step is the parser's own config without it: nanolab's
    classes, and the doc's subclasses whose defaults are nanolab's, read exactly as before."""
    from nanolab.run import parse

    settled = parse_fit_config(args)
    monkeypatch.setattr(parse, "settle_chosen_classes", lambda cfg, given: {})
    assert parse_fit_config(args) == settled
