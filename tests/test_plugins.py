"""Model and data are choices: classes from a package of one's own, named by class path, work
with fit, estimate and queue add; one that does not import is one error line naming it."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from conftest import QUICKSTART, tiny_overrides, write_config

from nanolab.cli import main

PACKAGE = "nanolab_plugin_example"

MODELS = '''
from nanolab.training.module import GPTLightningModule

BUILT: list[str] = []


class SmoothedGPT(GPTLightningModule):
    """nanolab's GPT with one setting of its own (a fork's model class)."""

    def __init__(self, *args, label_smoothing: float = 0.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.label_smoothing = label_smoothing
        BUILT.append(f"{type(self).__name__}({label_smoothing})")
'''

DATA = f'''
from nanolab.data.datamodule import TokenDataModule
from {PACKAGE}.models import BUILT


class NotedData(TokenDataModule):
    """nanolab's token data with one setting of its own (a fork's dataset class)."""

    def __init__(self, *args, note: str = "", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        BUILT.append(f"{{type(self).__name__}}({{note}})")
'''

BROKEN = """
import nanolab_plugin_missing_dependency  # not installed: the import fails


class Model:
    pass
"""


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A package of one's own on sys.path (as `pip install -e .` of a fork would make it)."""
    root = tmp_path / "src"
    package = root / PACKAGE
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "models.py").write_text(textwrap.dedent(MODELS))
    (package / "data.py").write_text(textwrap.dedent(DATA))
    (package / "broken.py").write_text(textwrap.dedent(BROKEN))
    monkeypatch.syspath_prepend(str(root))
    yield package
    for name in [m for m in sys.modules if m.startswith(PACKAGE)]:
        del sys.modules[name]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_fit_estimate_and_queue_take_classes_of_ones_own(
    tmp_path, char_dataset, plugin, capsys, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    tiny = write_config(tmp_path / "tiny.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    # The model by class path in YAML, the data by class path on the command line; the tiny
    # config's plain `model: {gpt: ...}` / `data: {...}` settings carry over to both.
    mine = write_config(
        tmp_path / "mine.yaml",
        {
            "model": {
                "class_path": f"{PACKAGE}.models.SmoothedGPT",
                "init_args": {"label_smoothing": 0.1},
            }
        },
    )
    code, _, err = run(
        capsys, "fit", "--config", str(QUICKSTART), "--config", str(tiny), "--config", str(mine),
        "--data", f"{PACKAGE}.data.NotedData", "--data.note", "hi",
    )  # fmt: skip
    assert code == 0, err[-2000:]
    built = sys.modules[f"{PACKAGE}.models"].BUILT
    assert "SmoothedGPT(0.1)" in built and "NotedData(hi)" in built
    run_dir = tmp_path / "runs" / "tiny"
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["model"]["class_path"] == f"{PACKAGE}.models.SmoothedGPT"
    assert saved["model"]["init_args"]["gpt"]["n_layer"] == 2
    vocab = json.loads((char_dataset / "meta.json").read_text())["vocab_size"]
    assert saved["model"]["init_args"]["gpt"]["vocab_size"] == vocab  # filled in from the data
    assert saved["data"]["class_path"] == f"{PACKAGE}.data.NotedData"
    assert saved["data"]["init_args"]["block_size"] == 32  # follows model.gpt.block_size
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 6
    params = sum(v.numel() for k, v in ckpt["state_dict"].items() if k != "model.lm_head.weight")

    # The estimate describes the run's model: read from its class-path config.yaml.
    code, out, err = run(
        capsys, "estimate", "--config", str(run_dir / "config.yaml"), "--device", "cpu", "--json"
    )
    assert code == 0, err
    estimate = json.loads(out)
    assert estimate["model"]["params"] == params  # tied head: counted once
    assert estimate["micro_batch"] == 4 and estimate["gradient_accumulation"] == 1

    # The queue parses it with the same parser and resolver.
    db = tmp_path / "q.db"
    code, _, err = run(capsys, "queue", "add", "--db", str(db), str(run_dir / "config.yaml"))
    assert code == 0, err
    from nanolab.queue.db import QueueDB

    (job,) = QueueDB(db).jobs()
    assert job.devices == 1 and job.max_steps == 6


def test_a_plugin_that_does_not_import_is_one_line(tmp_path, char_dataset, plugin, capsys) -> None:
    tiny = write_config(tmp_path / "tiny.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    broken = write_config(
        tmp_path / "broken.yaml", {"model": {"class_path": f"{PACKAGE}.broken.Model"}}
    )
    missing = "No module named 'nanolab_plugin_missing_dependency'"
    for argv in (
        ["fit", "--config", str(tiny), "--model", f"{PACKAGE}.broken.Model"],
        ["fit", "--config", str(tiny), "--config", str(broken)],
        ["estimate", "--config", str(tiny), "--config", str(broken), "--device", "cpu"],
        ["queue", "add", "--db", str(tmp_path / "q.db"), str(broken)],
    ):
        code, _, err = run(capsys, *argv)
        assert code == 2, (argv, err)
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1, (argv, lines)
        assert f"{PACKAGE}.broken" in lines[0] and missing in lines[0], lines[0]
    code, _, err = run(capsys, "fit", "--config", str(tiny), "--data", f"{PACKAGE}.data.Nope")
    assert code == 2 and f"module '{PACKAGE}.data' has no class 'Nope'" in err
    assert not (tmp_path / "runs").exists()
