"""Model and data are choices: classes from a package of one's own, named by class path, work
with fit, estimate and queue add; one that does not import is one error line naming it."""

from __future__ import annotations

import json
import re
import shlex
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from conftest import nanolab_here, tiny_overrides, write_config

from nanolab.cli import main
from nanolab.runlog import read_records

PACKAGE = "nanolab_plugin_example"

BROKEN = """
import nanolab_plugin_missing_dependency  # not installed: the import fails


class Model:
    pass
"""


OTHER = """
import lightning as L
import torch


class Bigram(L.LightningModule):
    \"\"\"A model of another family: no GPTConfig.\"\"\"

    def __init__(self, vocab_size: int = 65) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(vocab_size, vocab_size)
"""

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Your own model or data class"


def forking_section() -> str:
    text = (REPO / "docs" / "forking.md").read_text()
    start = text.index(SECTION)
    return text[start : text.index("\n## ", start + len(SECTION))]


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The page's package (``mylab``: each ``# mylab/<file>.py`` block) and a broken one, on
    sys.path as `pip install -e .` of a project would make them importable."""
    root = tmp_path / "src"
    for block in re.findall(r"```python\n(.*?)```", forking_section(), flags=re.S):
        first = block.splitlines()[0]
        assert first.startswith("# mylab/"), first
        path = root / first[2:]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(block)
    (root / "mylab" / "__init__.py").write_text("")
    broken = root / PACKAGE
    broken.mkdir()
    (broken / "__init__.py").write_text("")
    (broken / "broken.py").write_text(textwrap.dedent(BROKEN))
    (broken / "other.py").write_text(textwrap.dedent(OTHER))
    monkeypatch.syspath_prepend(str(root))
    yield root
    for name in [m for m in sys.modules if m.split(".")[0] in ("mylab", PACKAGE)]:
        del sys.modules[name]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_forking_pages_classes_work_with_fit_estimate_and_queue(
    tmp_path, char_dataset, plugin, capsys, monkeypatch
) -> None:
    """docs/forking.md, "Your own model or data class": its classes and commands as written
    (a tiny model on the prepared data given after the recipe), then what the page promises."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(REPO / "configs")
    tiny = write_config(tmp_path / "tiny.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    blocks = re.findall(r"```bash\n(.*?)```", forking_section(), flags=re.S)
    commands = [shlex.split(line) for b in blocks for line in b.splitlines() if line.strip()]
    assert [c[1] for c in commands] == ["fit", "validate", "estimate", "queue"]
    fit, validate, estimate, queue = (c[1:] for c in commands)
    at = fit.index("configs/quickstart.yaml") + 1
    fit[at:at] = ["--config", str(tiny)]
    code, _, err = run(capsys, *fit)
    assert code == 0, err[-2000:]

    run_dir = tmp_path / "runs" / "smoothed"  # its own run, not the quickstart's
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["model"]["class_path"] == "mylab.models.SmoothedGPT"
    assert saved["model"]["init_args"]["label_smoothing"] == 0.1
    assert saved["model"]["init_args"]["gpt"]["n_layer"] == 2  # the config's settings carried over
    vocab = json.loads((char_dataset / "meta.json").read_text())["vocab_size"]
    assert saved["model"]["init_args"]["gpt"]["vocab_size"] == vocab  # filled in from the data
    assert saved["data"]["class_path"] == "mylab.data.SubsetData"
    assert saved["data"]["init_args"]["block_size"] == 32  # follows model.gpt.block_size
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 6
    # The classes were the page's: the data's window plan keeps to the subset.
    from mylab.data import SubsetData

    data = SubsetData(**saved["data"]["init_args"])
    assert (
        data.window_plan(1).num_tokens
        == 200_000
        < json.loads((char_dataset / "meta.json").read_text())["train_tokens"]
    )

    # validate rebuilds the classes from config.yaml and evaluates the run's checkpoint.
    code, _, err = run(capsys, *validate)
    assert code == 0, err[-2000:]
    (record,) = read_records(run_dir / "metrics.jsonl", "val")[-1:]
    assert record["evaluated_by"] == "nanolab validate" and record["step"] == 6

    # The estimate describes the run's model, read from its class-path config.yaml.
    code, out, err = run(capsys, *estimate, "--json")
    assert code == 0, err
    params = sum(v.numel() for k, v in ckpt["state_dict"].items() if k != "model.lm_head.weight")
    assert json.loads(out)["model"]["params"] == params  # the tied head counted once
    # The queue parses it with the same parser and resolver.
    code, _, err = run(capsys, *queue)
    assert code == 0, err
    from nanolab.queue.db import QueueDB

    (job,) = QueueDB(tmp_path / "nanolab_queue.db").jobs()
    assert job.name == "smoothed-s2" and job.devices == 1 and job.max_steps == 6
    assert job.seed == 2  # another seed: the same seed again would repeat one sample


def test_a_resume_that_changes_a_fork_classs_own_setting_is_refused(
    tmp_path, char_dataset, plugin, capsys, monkeypatch
) -> None:
    """docs/resume.md, "What a resume keeps": a setting the fork's class adds has no rule nanolab
    knows, so a resume asking for another value is one line (the value it trained with, the
    branch command), exit 2, the run's files untouched; a checkpoint without the record (an
    earlier nanolab) still resumes."""
    monkeypatch.chdir(tmp_path)
    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=2)
    tiny = write_config(tmp_path / "tiny.yaml", cfg)
    classes = ["--model", "mylab.models.SmoothedGPT", "--model.label_smoothing", "0.1"]
    classes += ["--data", "mylab.data.SubsetData", "--data.max_train_tokens", "200000"]
    code, _, err = run(capsys, "fit", "--config", str(tiny), *classes)
    assert code == 0, err[-2000:]
    run_dir = tmp_path / "runs" / "tiny"
    ckpt = run_dir / "checkpoints" / "step-00000002.ckpt"
    record = torch.load(ckpt, weights_only=True)["nanolab"]["classes"]
    assert record == {
        "model": {"class_path": "mylab.models.SmoothedGPT", "settings": {"label_smoothing": 0.1}},
        "data": {"class_path": "mylab.data.SubsetData", "settings": {"max_train_tokens": 200000}},
    }
    config = run_dir / "config.yaml"
    files = {p: p.read_bytes() for p in (config, run_dir / "metrics.jsonl", ckpt)}
    again = ["fit", "--config", str(config), "--trainer.max_steps", "4"]
    for key, old, new in (
        ("data.max_train_tokens", "200000", "100000"),
        ("model.label_smoothing", "0.1", "0.5"),
    ):
        code, _, err = run(capsys, *again, f"--{key}", new)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, lines
        assert f"{key} {new} (it trained with {old})" in lines[0], lines[0]
        assert f"resume with --{key} {old}" in lines[0], lines[0]
        assert lines[0].endswith(f"--run.resume {ckpt} --{key} {new}"), lines[0]
        assert {p: p.read_bytes() for p in files} == files  # nothing of the run rewritten
    branch = shlex.split(lines[0].rpartition("branch from this checkpoint: ")[2])
    code, _, err = run(capsys, *branch[1:], "--trainer.max_steps", "3")  # the branch takes 0.5
    assert code == 0, err[-2000:]
    (branch_ckpt,) = (tmp_path / "runs").glob("tiny-*/checkpoints/step-00000003.ckpt")
    assert torch.load(branch_ckpt, weights_only=True)["nanolab"]["classes"]["model"] == {
        "class_path": "mylab.models.SmoothedGPT",
        "settings": {"label_smoothing": 0.5},
    }
    code, _, err = run(capsys, *again)  # the values it trained with: it goes on
    assert code == 0, err[-2000:]
    # A checkpoint saved before checkpoints recorded the classes is not compared.
    newest = run_dir / "checkpoints" / "step-00000004.ckpt"
    state = torch.load(newest, weights_only=True)
    del state["nanolab"]["classes"]
    torch.save(state, newest)
    code, _, err = run(capsys, *again[:-1], "6", "--model.label_smoothing", "0.5")
    assert code == 0, err[-2000:]


HOOKS = """
from typing import Callable

from nanolab.training.module import GPTLightningModule


def softcap(x):
    return x


class Sched:
    def __init__(self, k: float = 1.0) -> None:
        self.k = k


class HookGPT(GPTLightningModule):
    \"\"\"Own settings with no plain form of their own: a function and an object.\"\"\"

    def __init__(
        self, *args, logit_fn: Callable = softcap, aux: Sched = Sched(), **kwargs
    ) -> None:
        super().__init__(*args, **kwargs)
        self.logit_fn, self.aux = logit_fn, aux
"""


def test_a_fork_whose_own_settings_are_a_function_and_an_object_resumes(
    tmp_path, char_dataset, plugin, capsys, monkeypatch
) -> None:
    """A function's text holds its address, another at every launch: the checkpoint records
    a function by its import path (compared: another one is refused) and an object as the
    parser writes it, so the run resumes; an address recorded by an earlier nanolab is not
    compared."""
    (plugin / "mylab" / "hooks.py").write_text(HOOKS)
    monkeypatch.chdir(tmp_path)
    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=2)
    tiny = write_config(tmp_path / "tiny.yaml", cfg)
    code, _, err = run(capsys, "fit", "--config", str(tiny), "--model", "mylab.hooks.HookGPT")
    assert code == 0, err[-2000:]
    run_dir = tmp_path / "runs" / "tiny"
    ckpt = run_dir / "checkpoints" / "step-00000002.ckpt"
    record = torch.load(ckpt, weights_only=True)["nanolab"]["classes"]["model"]
    aux = {"class_path": "mylab.hooks.Sched", "init_args": {"k": 1.0}}  # the parser's form
    assert record["settings"] == {"logit_fn": "mylab.hooks.softcap", "aux": aux}, record
    again = ["fit", "--config", str(run_dir / "config.yaml")]
    code, _, err = run(capsys, *again, "--model.logit_fn", "torch.tanh", "--trainer.max_steps", "3")
    assert code == 2 and "model.logit_fn torch.tanh (it trained with mylab.hooks.softcap)" in err
    code, _, err = run(capsys, *again, "--trainer.max_steps", "3")
    assert code == 0, err[-2000:]
    newest = run_dir / "checkpoints" / "step-00000003.ckpt"
    state = torch.load(newest, weights_only=True)
    state["nanolab"]["classes"]["model"]["settings"]["logit_fn"] = "<function softcap at 0x7f11>"
    torch.save(state, newest)
    code, _, err = run(capsys, *again, "--trainer.max_steps", "4")
    assert code == 0, err[-2000:]


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
    code, _, err = run(capsys, "fit", "--config", str(tiny), "--data", "mylab.data.Nope")
    assert code == 2 and "module 'mylab.data' has no class 'Nope'" in err
    assert "did you mean" not in err  # nothing near: no guess
    # A typo of a class the module defines: named, not a class it imports (TokenDataModule).
    code, _, err = run(capsys, "fit", "--config", str(tiny), "--data", "mylab.data.SubsetDta")
    assert code == 2 and err.strip().endswith("did you mean mylab.data.SubsetData?"), err
    assert not (tmp_path / "runs").exists()


def test_estimate_reads_a_class_path_config(tmp_path, plugin, capsys) -> None:
    """A GPT subclass named with no settings of its own is estimated from nanolab's defaults
    and the recipe's; a model of another family is one line saying what cannot be estimated
    and why (docs/estimate.md, "A model class of your own")."""
    base = ["estimate", "--config", str(REPO / "configs" / "quickstart.yaml"), "--device", "cpu"]
    bare = write_config(tmp_path / "bare.yaml", {"model": "mylab.models.SmoothedGPT"})
    code, out, err = run(capsys, *base, "--config", str(bare), "--vocab-size", "65", "--json")
    assert code == 0, err
    code, plain_out, err = run(capsys, *base, "--vocab-size", "65", "--json")
    assert code == 0, err
    assert json.loads(out)["model"] == json.loads(plain_out)["model"]  # the same GPT
    other = write_config(tmp_path / "o.yaml", {"model": {"class_path": f"{PACKAGE}.other.Bigram"}})
    code, _, err = run(capsys, *base, "--config", str(other))
    *warnings, error = err.strip().splitlines()
    # fit's reader first says which of the quickstart's settings Bigram does not take (one
    # warning line), then the one error line.
    assert code == 2 and len(warnings) <= 1, err
    assert all(": warning: " in w and "left out of this run" in w for w in warnings), warnings
    assert f"model {PACKAGE}.other.Bigram cannot be estimated: " in error, error
    # What the line says is true of the class, and it offers no fix that would make the
    # estimator describe a GPT the class does not train.
    assert "neither subclasses GPTLightningModule nor takes a `gpt: GPTConfig`" in error
    assert "give the model class" not in error


EXPERTS = """
import torch

from nanolab.training.module import GPTLightningModule


class Experts(torch.nn.Module):
    def __init__(self, config, n_experts):
        super().__init__()
        d = config.n_embd
        self.router = torch.nn.Linear(d, n_experts, bias=False)
        self.up = torch.nn.Parameter(torch.randn(n_experts, d, 2 * d) * 0.02)
        self.down = torch.nn.Parameter(torch.randn(n_experts, 2 * d, d) * 0.02)

    def forward(self, x):
        w = torch.softmax(self.router(x), dim=-1)
        h = torch.einsum("btd,edh->bteh", x, self.up).relu()
        return (torch.einsum("bteh,ehd->bted", h, self.down) * w.unsqueeze(-1)).sum(-2)


class ExpertsGPT(GPTLightningModule):
    def __init__(self, *args, n_experts: int = 4, **kwargs) -> None:
        self.n_experts = n_experts
        super().__init__(*args, **kwargs)

    def _build_model(self):
        model = super()._build_model()
        for block in model.blocks:
            block.mlp = Experts(self.gpt_config, self.n_experts)
        return model
"""


def test_a_gpt_subclass_that_builds_another_network_is_not_estimated_as_the_gpt(
    tmp_path, char_dataset, plugin, capsys, monkeypatch
) -> None:
    """docs/estimate.md, "A model class of your own": a subclass whose ``_build_model`` puts
    experts in each block is not the GPT of its model.gpt: estimate and queue add say so with
    the class's own parameter count, never the GPT's numbers; generate and export of its
    checkpoint name the class that trained it."""
    (plugin / "mylab" / "experts.py").write_text(EXPERTS)
    monkeypatch.chdir(tmp_path)
    tiny = write_config(
        tmp_path / "tiny.yaml",
        tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=1),
    )
    code, _, err = run(
        capsys,
        "fit",
        "--config",
        str(tiny),
        "--model",
        "mylab.experts.ExpertsGPT",
        "--run.name",
        "ex",
    )
    assert code == 0, err[-2000:]
    run_dir = tmp_path / "runs" / "ex"
    (start,) = read_records(run_dir / "metrics.jsonl", "start")
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    from nanolab.model import GPT, GPTConfig

    gpt = GPT(GPTConfig(**ckpt["nanolab"]["gpt"]))  # what the estimate would describe
    gpt_params = sum(p.numel() for p in gpt.parameters())
    code, out, err = run(
        capsys, "estimate", "--config", str(run_dir / "config.yaml"), "--device", "cpu"
    )
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1, (out, lines)
    trains = start["num_params"]
    assert trains != gpt_params
    assert (
        f"model mylab.experts.ExpertsGPT trains another network than nanolab's GPT ({trains:,} "
        f"parameters, not {gpt_params:,}); it cannot be estimated" in lines[0]
    ), lines[0]
    code, out, err = run(capsys, "queue", "add", str(run_dir / "config.yaml"), "--name", "ex2")
    assert code == 0, err
    said = f"({trains:,} parameters, not {gpt_params:,})"
    assert out.count(said) == 2, out  # the time and the memory: neither is the GPT's
    for argv in (
        ["generate", "--ckpt", str(run_dir / "checkpoints" / "last.ckpt"), "--prompt", "a"],
        ["export", "--ckpt", str(run_dir / "checkpoints" / "last.ckpt"), "-o", "exported"],
    ):
        code, _, err = run(capsys, *argv)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, (argv, lines)
        assert (
            "was trained by mylab.experts.ExpertsGPT, whose network is not nanolab's GPT"
            in (lines[0])
        ), lines[0]
    assert not (tmp_path / "exported").exists()


NEAR_GPT = """
from dataclasses import dataclass

import torch

from nanolab.training.module import GPTLightningModule


@dataclass
class LossCfg:
    smoothing: float = 0.1


class DCGPT(GPTLightningModule):
    def __init__(self, *args, loss: LossCfg = LossCfg(), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.smoothing = loss.smoothing


class TempGPT(GPTLightningModule):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log_temp = torch.nn.Parameter(torch.zeros(()))


class ShyGPT(GPTLightningModule):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if torch.empty(1).is_meta:
            raise RuntimeError("no meta device here")
"""


def test_a_fork_near_the_gpt_is_estimated_as_the_gpt_with_a_note(
    tmp_path, char_dataset, plugin, capsys
) -> None:
    """A dataclass setting is given as the parser instantiates it (the GPT exactly: no note);
    one learned parameter more, or a class that cannot be built to count, is estimated as the
    GPT with a note saying so, not refused."""
    (plugin / "mylab" / "near.py").write_text(NEAR_GPT)
    tiny = write_config(tmp_path / "tiny.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    base = ["estimate", "--config", str(tiny), "--device", "cpu"]
    code, out, err = run(
        capsys, *base, "--model", "mylab.near.DCGPT", "--model.loss.smoothing", "0.2"
    )
    assert code == 0 and "mylab.near" not in out + err, (out, err)
    code, out, err = run(capsys, *base, "--model", "mylab.near.TempGPT")
    assert code == 0, err
    assert "note: model mylab.near.TempGPT has 1 parameter more than nanolab's GPT (" in out
    assert "within 1%); estimated as nanolab's GPT of model.gpt" in out, out
    code, out, err = run(capsys, *base, "--model", "mylab.near.ShyGPT")
    assert code == 0, err
    assert (
        "note: model mylab.near.ShyGPT could not be built from the config to count its "
        "parameters (RuntimeError: no meta device here); estimated as nanolab's GPT" in out
    ), out


NEAR = """
from dataclasses import dataclass

import lightning as L


@dataclass
class LossCfg:
    smoothing: float = 0.1


class LossCfgGPT(L.LightningModule):
    pass
"""


def test_did_you_mean_offers_only_a_class_the_setting_takes(tmp_path, monkeypatch) -> None:
    """A typo next to a config dataclass and a LightningModule of near names: ``model`` is offered
    the module (it was offered the dataclass, nearer by name, which the parser then refused),
    ``data`` nothing (neither is a LightningDataModule), a key without a kind the nearest."""
    from nanolab.training.plugins import PluginImportError, load_class

    (tmp_path / "nanolab_plugin_near.py").write_text(NEAR)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = "nanolab_plugin_near.LossCfgg"
    with pytest.raises(PluginImportError, match=r"did you mean nanolab_plugin_near.LossCfgGPT\?$"):
        load_class(path, "model")
    with pytest.raises(PluginImportError) as refused:
        load_class(path, "data")
    assert "did you mean" not in str(refused.value)
    with pytest.raises(PluginImportError, match=r"did you mean nanolab_plugin_near.LossCfg\?$"):
        load_class(path, "somewhere")


USER_DATA = """
import lightning as L
import torch

from nanolab.data.datamodule import TokenDataModule


class PlainData(L.LightningDataModule):
    \"\"\"Data of one's own without a vocabulary.\"\"\"

    def __init__(self, micro_batch_size: int = 4, block_size: int = 32) -> None:
        super().__init__()
        self.micro_batch_size, self.block_size = micro_batch_size, block_size

    def train_dataloader(self):
        x = torch.randint(0, 50, (16, self.block_size + 1))
        return torch.utils.data.DataLoader(list(zip(x[:, :-1], x[:, 1:])), batch_size=4)


class NotAData:
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed


class ReqData(TokenDataModule):
    def __init__(self, records: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.records = records
"""

USER_MODEL = """
import lightning as L
import torch


class PlainLM(L.LightningModule):
    \"\"\"A module that forgot its training_step.\"\"\"

    def __init__(self, vocab_size: int = 65) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab_size, vocab_size)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
"""

USER_CALLBACKS = """
import lightning as L

from nanolab.data.tokenizers import Tokenizer, load_tokenizer  # imported: never suggested


class StepPrinter(L.Callback):
    def __init__(self, every: int = 1, tag: str = "step") -> None:
        self.every, self.tag = every, tag


class NeedsArg(L.Callback):
    def __init__(self, need: int) -> None:
        self.need = need


class NotACallback:
    def __init__(self, every: int = 1) -> None:
        self.every = every


def tokenize(text: str) -> list[str]:
    return text.split()
"""

USER = "nanolab_plugin_user"


@pytest.fixture
def user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A project's package of classes of the wrong kind or shape (``nanolab_plugin_user.data``,
    ``.model``, ``.callbacks``), on sys.path as ``pip install -e .`` makes it importable."""
    root = tmp_path / "src" / USER
    root.mkdir(parents=True)
    (root / "__init__.py").write_text("")
    for name, text in (("data", USER_DATA), ("model", USER_MODEL), ("callbacks", USER_CALLBACKS)):
        (root / f"{name}.py").write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(root.parent))
    yield root
    for name in [m for m in sys.modules if m.split(".")[0] == USER]:
        del sys.modules[name]


def one_error_line(result, warned: str | None = None) -> str:
    """The one ``error:`` line of a refused command (exit 2, nothing else on stderr but the
    one warning line ``warned``, when given, before it)."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    if warned is not None:
        assert lines and lines[0] == warned, result.stderr[-3000:]
        lines = lines[1:]
    assert result.returncode == 2 and len(lines) == 1, (result.returncode, result.stderr[-3000:])
    return lines[0]


def test_a_callback_typo_suggests_only_callbacks(tmp_path, char_dataset, user) -> None:
    """``--trainer.callbacks+=`` is checked as ``trainer.callbacks`` in a file is: a typo gets
    the nearest Callback class of the module, never a class it imports or a function."""
    tiny = write_config(tmp_path / "tiny.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    base = ["fit", "--config", str(tiny)]
    for flag in ("--trainer.callbacks+={}", "--trainer.callbacks={}"):
        line = one_error_line(
            nanolab_here(*base, flag.format(f"{USER}.callbacks.Tokenize"), cwd=tmp_path)
        )
        assert f"trainer.callbacks: module '{USER}.callbacks' has no class 'Tokenize'" in line
        assert "did you mean" not in line, line  # Tokenizer, tokenize: not callbacks
    arg = ["--trainer.callbacks+", f"{USER}.callbacks.StepPrinte"]
    line = one_error_line(nanolab_here(*base, *arg, cwd=tmp_path))
    assert line.endswith(f"did you mean {USER}.callbacks.StepPrinter?"), line
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("key", "path", "says"),
    [
        (
            "data",
            f"{USER}.data.NotAData",
            f"data: {USER}.data.NotAData is not a LightningDataModule; subclass nanolab's "
            "TokenDataModule (docs/forking.md)",
        ),
        (
            "model",
            "nanolab.data.datamodule.TokenDataModule",
            "model: nanolab.data.datamodule.TokenDataModule is a LightningDataModule, not a "
            "LightningModule; subclass nanolab's GPTLightningModule (docs/forking.md)",
        ),
        (
            "trainer.callbacks",
            f"{USER}.callbacks.NotACallback",
            f"trainer.callbacks: {USER}.callbacks.NotACallback is not a Callback; subclass "
            "lightning.pytorch.Callback (docs/callbacks.md)",
        ),
    ],
    ids=["data", "model", "callback"],
)
def test_a_class_of_the_wrong_kind_is_one_line_with_the_base_to_subclass(
    tmp_path, char_dataset, user, key, path, says
) -> None:
    """On the command line and in a file alike: the class, the kind its setting takes and the
    fix, instead of the parser's "Expected a path ... Does not validate against any of the
    Union subtypes"."""
    tiny = write_config(tmp_path / "tiny.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    callbacks = key == "trainer.callbacks"
    flag = f"--{key}+={path}" if callbacks else f"--{key}={path}"
    chosen = {"class_path": path}
    other = write_config(
        tmp_path / "other.yaml",
        {"trainer": {"callbacks": [chosen]}} if callbacks else {key: chosen},
    )
    for given in ([flag], ["--config", str(other)]):
        result = nanolab_here("fit", "--config", str(tiny), *given, cwd=tmp_path)
        assert one_error_line(result) == f"nanolab fit: error: {says}"
    assert not (tmp_path / "runs").exists()


CB = f"{USER}.callbacks"


@pytest.mark.parametrize(
    ("callbacks", "flags", "says"),
    [
        (
            [{"class_path": f"{CB}.StepPrinter", "init_args": {"every": "five"}}],
            [],
            f"trainer.callbacks[0] ({CB}.StepPrinter).init_args.every: 'five' is not valid; "
            "expected int",
        ),
        (
            None,
            [f"--trainer.callbacks+={CB}.StepPrinter", "--trainer.callbacks.every", "five"],
            f"trainer.callbacks[-1] ({CB}.StepPrinter).init_args.every: 'five' is not valid; "
            "expected int",
        ),
        (
            [{"class_path": f"{CB}.NeedsArg", "init_args": {"need": 1}}, f"{CB}.StepPrinter"],
            ["--trainer.callbacks.tagg", "x"],
            f"trainer.callbacks[-1] ({CB}.StepPrinter).init_args.tagg: not a setting of "
            f"{CB}.StepPrinter; did you mean tag?",
        ),
        (
            [f"{CB}.StepPrinter", {"class_path": f"{CB}.StepPrinter", "init_args": {"tagg": 1}}],
            [],
            f"trainer.callbacks[1] ({CB}.StepPrinter).init_args.tagg: not a setting of "
            f"{CB}.StepPrinter; did you mean tag?",
        ),
        (
            [{"class_path": f"{CB}.StepPrinter"}, {"class_path": f"{CB}.NeedsArg"}],
            [],
            f"trainer.callbacks[1] ({CB}.NeedsArg).init_args.need: required by {CB}.NeedsArg "
            "and not given; set it under the callback's init_args in the config, or give "
            f"--trainer.callbacks.need VALUE after --trainer.callbacks+={CB}.NeedsArg",
        ),
        (
            [{"class_path": f"{CB}.StepPrinter", "init_args": None, "every": 3}],
            [],
            f"trainer.callbacks[0] ({CB}.StepPrinter): every is beside class_path, not under "
            "init_args (its init_args: is empty); indent the settings under init_args",
        ),
    ],
    ids=["type-yaml", "type-flag", "typo-flag", "typo-yaml", "required", "indentation"],
)
def test_a_mistake_in_a_callbacks_settings_is_one_line_naming_it(
    tmp_path, char_dataset, user, callbacks, flags, says
) -> None:
    """A callback's settings are refused as the model's and the data's are: the item, its
    class and key, the problem and the fix (the parser's report was the base class's words,
    "Option 'every' is not accepted", a key without "did you mean", or 700 characters)."""
    cfg = tiny_overrides(char_dataset, tmp_path / "runs")
    if callbacks is not None:
        cfg["trainer"]["callbacks"] = callbacks
    tiny = write_config(tmp_path / "tiny.yaml", cfg)
    line = one_error_line(nanolab_here("fit", "--config", str(tiny), *flags, cwd=tmp_path))
    assert line == f"nanolab fit: error: {says}"
    assert not (tmp_path / "runs").exists()


def test_a_required_data_argument_left_out_says_where_to_give_it(
    tmp_path, char_dataset, user
) -> None:
    """A data class's required argument is named with its key and both ways to set it."""
    tiny = write_config(tmp_path / "tiny.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    line = one_error_line(
        nanolab_here("fit", "--config", str(tiny), "--data", f"{USER}.data.ReqData", cwd=tmp_path)
    )
    assert line == (
        f"nanolab fit: error: data.init_args.records: required by {USER}.data.ReqData and not "
        "given; set it under data.init_args in the config, or give --data.records VALUE"
    )
    given = ["--data", f"{USER}.data.ReqData", "--data.records", "r.jsonl", "--print_config"]
    result = nanolab_here("fit", "--config", str(tiny), *given, cwd=tmp_path)
    assert result.returncode == 0 and "records: r.jsonl" in result.stdout, result.stderr[-2000:]


def test_a_class_lightning_cannot_run_is_one_line_before_the_run_starts(
    tmp_path, char_dataset, user
) -> None:
    """Data without a vocabulary for a GPT whose ``vocab_size`` is null, and a module without
    ``training_step``: one line naming the class and the fix, exit 2, the run folder never
    made (they were tracebacks from inside ``trainer.fit``, exit 1)."""
    tiny = write_config(tmp_path / "tiny.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    base = ["fit", "--config", str(tiny)]
    dropped = (  # the tiny config's data settings are for nanolab's TokenDataModule
        "nanolab fit: warning: data.dataset_dir, data.source, data.val_windows (given in config "
        f"file {tiny}) are left out of this run: {USER}.data.PlainData does not take them (it "
        "takes micro_batch_size, block_size)"
    )
    plain = nanolab_here(*base, "--data", f"{USER}.data.PlainData", cwd=tmp_path)
    line = one_error_line(plain, warned=dropped)
    assert line == (
        "nanolab fit: error: model.gpt.vocab_size is null "
        f"(nanolab.training.module.GPTLightningModule) and data {USER}.data.PlainData provides "
        "no vocab_size to fill it; set model.gpt.vocab_size (--model.gpt.vocab_size N), or give "
        "the data class a vocab_size property (nanolab's TokenDataModule has one; "
        "docs/forking.md)"
    )
    plain = nanolab_here(*base, "--model", f"{USER}.model.PlainLM", cwd=tmp_path)
    dropped = (
        f"nanolab fit: warning: model.gpt (given in config file {tiny}) is left out of this run: "
        f"{USER}.model.PlainLM does not take it (it takes vocab_size)"
    )
    line = one_error_line(plain, warned=dropped)
    assert line == (
        f"nanolab fit: error: model: {USER}.model.PlainLM has no training_step() method, which "
        "nanolab fit needs; define it, or subclass nanolab's GPTLightningModule (docs/forking.md)"
    )
    assert not (tmp_path / "runs").exists()
    # The fix the first line names works: the data of one's own trains with the vocabulary set.
    fixed = ["--data", f"{USER}.data.PlainData", "--model.gpt.vocab_size", "50"]
    result = nanolab_here(*base, *fixed, "--trainer.max_steps", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture
def fork_modules(tmp_path, monkeypatch):
    """A fork's package whose modules fail to import in each way a fork's can."""
    package = tmp_path / "forkpkg_imports"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "nameerror.py").write_text("import math\nx = undefined_name\n")
    (package / "needsdep.py").write_text("import forkpkg_not_installed_dependency\n")
    (package / "ownmissing.py").write_text("import forkpkg_imports.helpers_gone\n")
    (package / "syntax.py").write_text("def f(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield package
    for name in [m for m in sys.modules if m.startswith("forkpkg_imports")]:
        del sys.modules[name]


def test_an_error_inside_a_forks_module_names_its_file_and_line(fork_modules, tmp_path) -> None:
    """Mutation caught: "cannot import module ... (NameError: ...)" without where, and the
    "pip install -e ." hint for a dependency the module imports (the module is installed)."""
    from nanolab.training.plugins import PluginImportError, load_class

    def line(module: str) -> str:
        with pytest.raises(PluginImportError) as err:
            load_class(f"forkpkg_imports.{module}.X", "model")
        return str(err.value)

    assert line("nameerror") == (
        "model: importing module 'forkpkg_imports.nameerror' for forkpkg_imports.nameerror.X "
        f"failed at {fork_modules / 'nameerror.py'}:2 (NameError: name 'undefined_name' is not "
        "defined); fix the module (-v shows the traceback)"
    )
    dep = line("needsdep")
    assert f"failed at {fork_modules / 'needsdep.py'}:1 (ModuleNotFoundError" in dep
    assert dep.endswith(
        "install the package that provides 'forkpkg_not_installed_dependency' in this "
        "environment (the module imports it)"
    )
    assert "pip install -e" not in dep
    own = line("ownmissing")
    assert f"{fork_modules / 'ownmissing.py'}:1" in own and own.endswith("fix the import")
    assert f"failed at {fork_modules / 'syntax.py'}:1 (SyntaxError" in line("syntax")
    # The module itself missing is the class path's fault: installed? spelt right?
    assert "pip install -e . in your project" in line("nosuch")
    with pytest.raises(PluginImportError, match=r"pip install -e \. in your project"):
        load_class("forkpkg_not_there_at_all.models.X", "model")


def test_verbose_shows_the_traceback_of_a_forks_module(fork_modules, char_dataset, tmp_path):
    tiny = write_config(tmp_path / "tiny.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    model = "forkpkg_imports.nameerror.X"
    result = nanolab_here("-v", "fit", "--config", str(tiny), "--model", model, cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback (most recent call last)" in result.stderr
    assert f'File "{fork_modules / "nameerror.py"}", line 2' in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("nanolab fit: error: model: ")
    quiet = nanolab_here("fit", "--config", str(tiny), "--model", model, cwd=tmp_path)
    assert "Traceback" not in quiet.stderr and len(quiet.stderr.strip().splitlines()) == 1
