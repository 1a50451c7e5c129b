"""``nanolab init``: the starter project is complete, never overwrites, and its config selects
the project's own classes. tests/test_fork_story.py installs one and runs its README."""

from __future__ import annotations

import contextlib
import gzip
import importlib.util
import io
import os
import re
import sys
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from conftest import nanolab_here

from nanolab.cli import VERBS
from nanolab.cli import main as nanolab_main
from nanolab.data.prepare import prepare_dataset
from nanolab.scaffold import main, package_name, template_files, write_project

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
TEMPLATE_FILES = {
    "README.md",
    ".gitignore",
    "pyproject.toml",
    "configs/experiment.yaml",
    "data/README.md",
    "src/PACKAGE/__init__.py",
    "src/PACKAGE/model.py",
    "src/PACKAGE/data.py",
    "src/PACKAGE/callbacks.py",
}


def starter_files(package: str) -> set[str]:
    return {f.replace("PACKAGE", package) for f in TEMPLATE_FILES}


def _sample_text(chars: int = 60_000) -> str:
    blob = resources.files("nanolab.data").joinpath("corpus", "shakespeare.txt.gz").read_bytes()
    return gzip.decompress(blob).decode("utf-8")[:chars]


@contextlib.contextmanager
def importable(project: Path, package: str) -> Iterator[None]:
    """The project's package importable in this process, as ``pip install -e`` would make it,
    and forgotten afterwards (another test's project may use the same package name)."""
    sys.path.insert(0, str(project / "src"))
    try:
        yield
    finally:
        sys.path.remove(str(project / "src"))
        for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
            del sys.modules[name]


def _print_config(project: Path, *configs: str) -> dict[str, Any]:
    """``nanolab fit --config ... --print_config`` in this process, from the project folder."""
    out, here = io.StringIO(), Path.cwd()
    os.chdir(project)
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop:
            nanolab_main(["fit", *(a for c in configs for a in ("--config", c)), "--print_config"])
    finally:
        os.chdir(here)
    assert stop.value.code in (0, None), out.getvalue()[-2000:]
    return yaml.safe_load(out.getvalue())


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b": value}``, with a class spec's ``init_args`` level dropped."""
    if not isinstance(tree, dict):
        return {prefix.rstrip("."): tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flat(value, prefix if key == "init_args" else f"{prefix}{key}."))
    return out


# -- what init writes ----------------------------------------------------------------------
def test_init_is_a_registered_verb() -> None:
    assert VERBS["init"][0] == "nanolab.scaffold:main"


def test_init_writes_the_starter(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    project = tmp_path / "tiny-poems"
    assert main([str(project)]) == 0
    written = {p.relative_to(project).as_posix() for p in project.rglob("*") if p.is_file()}
    assert written == starter_files("tiny_poems")
    assert (project / "data" / "text").is_dir()
    for rel in written:
        assert "{{" not in (project / rel).read_text(), f"{rel} has an unfilled placeholder"
    config = yaml.safe_load((project / "configs" / "experiment.yaml").read_text())
    assert config["run"]["name"] == "tiny-poems"
    assert config["model"]["class_path"] == "tiny_poems.model.Model"
    assert config["data"]["class_path"] == "tiny_poems.data.Data"
    assert config["data"]["init_args"]["source"] == ["data/text"]
    assert 'name = "tiny_poems"' in (project / "pyproject.toml").read_text()
    out = capsys.readouterr().out
    assert "pip install -e ." in out and "nanolab fit --config configs/experiment.yaml" in out


def test_template_set_is_what_the_docs_promise() -> None:
    assert set(template_files()) == TEMPLATE_FILES


def test_package_name_is_an_identifier_that_shadows_nothing(tmp_path: Path) -> None:
    assert package_name("tiny-poems") == "tiny_poems"
    assert package_name("2024") == "project_2024"
    # `import class` is a SyntaxError: a keyword is made a name the way a leading digit is
    assert package_name("class") == "project_class" and package_name("Import") == "project_import"
    assert package_name("match") == "match"  # a soft keyword imports fine
    assert package_name("Quill.Sonnets") == "quill_sonnets"  # not my_lm: a fork may install that
    for taken in ("nanolab", "json", "torch"):
        assert main([str(tmp_path / taken)]) == 2
        assert not (tmp_path / taken).exists()


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


def test_an_empty_folder_name_is_refused_not_taken_as_the_current_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``init ''`` wrote the starter into the folder the command ran in."""
    monkeypatch.chdir(tmp_path)
    assert main([""]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("nanolab init: error: the project folder is empty") and "\n" not in err
    assert not any(tmp_path.iterdir())


# -- the starter config stays in step with nanolab's ---------------------------------------
@pytest.mark.skipif(not QUICKSTART.is_file(), reason="configs/quickstart.yaml not in this tree")
def test_starter_config_is_the_quickstart_on_your_text_with_your_classes(tmp_path: Path) -> None:
    """Resolved, the starter differs from the quickstart only where it means to: its own classes,
    its run name, the user's text through BPE, and no CPU-only settings."""
    project = tmp_path / "proj"
    write_project(project)
    with importable(project, "proj"):
        starter = _flat(_print_config(project, "configs/experiment.yaml"))
    quick = _flat(_print_config(tmp_path, str(QUICKSTART)))
    differ = {k for k in starter.keys() | quick.keys() if starter.get(k) != quick.get(k)}
    assert differ == {
        "model.class_path",
        "data.class_path",
        "run.name",
        "trainer.accelerator",  # auto: the GPU when there is one
        "model.gpt.vocab_multiple",  # 64: GPU-friendly shapes
        "data.dataset_dir",
        "data.source",
        "data.tokenizer",
        # The quickstart scores the Shakespeare cloze in the loop; a fork's text brings its own
        # tasks (docs/evaluate.md), so the starter leaves downstream at its default, off.
        "downstream.suite",
        "downstream.every_n_evals",
        "downstream.limit",
    }, differ
    assert starter["model.class_path"] == "proj.model.Model"
    assert starter["data.tokenizer"] == "bpe" and starter["data.source"] == ["data/text"]


def test_starter_config_names_only_what_it_chooses() -> None:
    """No callback group repeats its defaults (``--print_config`` shows them)."""
    text = template_files()["configs/experiment.yaml"].replace("{{package}}", "pkg")
    config = yaml.safe_load(text)
    assert set(config) == {"run", "trainer", "model", "data", "checkpoint"}
    assert config["checkpoint"] == {"every_n_steps": config["run"]["eval_every_steps"]}


# -- the example callback ------------------------------------------------------------------
def _load_starter_callbacks(project: Path) -> Any:
    path = project / "src" / project.name / "callbacks.py"
    spec = importlib.util.spec_from_file_location("starter_callbacks", path)
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


def test_a_link_inside_the_folder_does_not_carry_files_into_a_run(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"event": "start", "run_id": "x"}\n')
    project = tmp_path / "proj"
    project.mkdir()
    (project / "data").symlink_to(run)
    assert main([str(project)]) == 2
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]
    assert [p.name for p in project.iterdir()] == ["data"]  # nothing written anywhere


@pytest.mark.parametrize("name", ["foo", "a_much_longer_project_name"])
def test_a_filled_in_name_keeps_the_config_comments_in_their_column(
    tmp_path: Path, name: str
) -> None:
    """The template's comments start in one column; ``name: "{{name}}"`` filled with another
    length pushed its comment out of it (or pulled it in)."""
    write_project(tmp_path / "p", name)
    lines = (tmp_path / "p" / "configs" / "experiment.yaml").read_text().splitlines()
    run = lines.index("run:")
    name_line, *others = lines[run + 1 : run + 4]
    assert [line.index(" # ") + 1 for line in others] == [33, 33]
    assert name_line.index(" # ") + 1 == max(33, len(f'  name: "{name}"') + 2)
    assert all(not line.endswith(" ") for line in lines)


def test_a_mistyped_key_of_the_starters_classes_names_the_place_and_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The starter chooses its classes by path, and the keys nanolab checks before parsing are
    those of its own classes: a typo under ``model.init_args`` got the parser's words instead
    ("Group 'model.gpt' does not accept option 'n_layers'", no file, no fix; on the command
    line an unrecognized ``--model.gpt.n_layers=2`` that was never typed). Now the same line
    as for nanolab's own classes: where, the key as written, the nearest setting."""
    project = tmp_path / "proj"
    write_project(project)
    (project / "bad.yaml").write_text("model:\n  init_args:\n    gpt:\n      n_layers: 2\n")
    monkeypatch.chdir(project)
    cases = {
        ("--config", "bad.yaml"): "config file bad.yaml: unknown setting "
        "model.init_args.gpt.n_layers; did you mean model.init_args.gpt.n_layer?",
        ("--model.init_args.gpt.n_layers", "2"): "unknown setting "
        "--model.init_args.gpt.n_layers; did you mean --model.init_args.gpt.n_layer?",
        ("--data.init_args.micro_batch=3",): "unknown setting --data.init_args.micro_batch; "
        "did you mean --data.init_args.micro_batch_size?",
    }
    with importable(project, "proj"):
        for extra, said in cases.items():
            code = nanolab_main(["fit", "--config", "configs/experiment.yaml", *extra])
            err = capsys.readouterr().err
            assert code == 2 and err == f"nanolab fit: error: {said}\n", err


def test_init_help_says_what_the_name_becomes(tmp_path: Path, capsys) -> None:
    """``--help`` said the default name was "the folder's name, - as _", but the run name keeps
    its ``-``: only the package (and the pyproject name) become an identifier."""
    with pytest.raises(SystemExit):
        main(["--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert "- as _" not in said
    assert "its run name as it is (default: the folder's name)" in said
    assert (
        "package and pyproject name are the name as a Python identifier (my-lm: src/my_lm/" in said
    )
    write_project(tmp_path / "tiny-verse")
    config = yaml.safe_load((tmp_path / "tiny-verse/configs/experiment.yaml").read_text())
    pyproject = (tmp_path / "tiny-verse/pyproject.toml").read_text()
    assert (
        config["run"]["name"] == "tiny-verse"
        and config["model"]["class_path"] == "tiny_verse.model.Model"
    )
    assert (tmp_path / "tiny-verse/src/tiny_verse").is_dir() and 'name = "tiny_verse"' in pyproject


# -- "A dataset of windows", rendered and run ---------------------------------------------------
# Windows cut from prepared tokens are cut anew when the tokens are prepared again, and a run
# that trained on the old tokens is not resumed on the new ones (its checkpoints keep the old
# tokenizer: generate, eval and export would decode the new ids with it).

WINDOWS_PACKAGE = "window_lab"
#: A tiny model on the windows; the README's command gets these on top.
WINDOWS_QUICK = [
    "--trainer.max_steps", "2", "--run.eval_every_steps", "2", "--checkpoint.every_n_steps", "2",
    "--model.init_args.schedule.warmup_steps", "1",
    "--model.init_args.gpt.n_layer", "1", "--model.init_args.gpt.n_embd", "16",
    "--model.init_args.gpt.n_head", "2", "--model.init_args.gpt.block_size", "32",
    "--data.init_args.micro_batch_size", "2", "--data.init_args.val_windows", "2",
    "--trainer.enable_progress_bar", "false", "--downstream.suite", "null",
]  # fmt: skip


def _windows_section(project: Path) -> list[str]:
    """Apply the section's Python and YAML blocks as the README says; its fit command."""
    readme = (project / "README.md").read_text()
    body = re.split(r"^## A dataset of windows\n", readme, flags=re.M)[1].split("\n## ")[0]
    blocks = re.findall(r"```(\w+)\n(.*?)```", body, flags=re.S)
    commands = []
    for lang, text in blocks:
        target = project / text.splitlines()[0].lstrip("# ").split()[0]
        if lang == "python":
            with open(target, "a", encoding="utf-8") as f:
                f.write("\n\n" + text)
        elif lang == "yaml":
            target.write_text(text)
        else:
            commands += [line.split()[1:] for line in text.splitlines() if line.strip()]
    (fit,) = commands
    return fit


@pytest.fixture
def project(tmp_path: Path):
    root = tmp_path / "window-lab"
    write_project(root, WINDOWS_PACKAGE)
    fit = _windows_section(root)
    text = _sample_text(20_000)
    # A letter the text never holds stands in for one it holds: as many characters as before,
    # other ids for them (the tokens of an edited corpus, prepared again).
    assert "#" not in text and "z" in text
    (root / "data" / "text" / "plays.txt").write_text(text)
    prepare_dataset([str(root / "data" / "text")], root / "data" / "tokens", "chars", quiet=True)
    with importable(root, WINDOWS_PACKAGE):
        yield root, fit


def _prepare_again(root: Path) -> None:
    plays = root / "data" / "text" / "plays.txt"
    plays.write_text(plays.read_text().replace("z", "#"))
    out = root / "data" / "tokens"
    prepare_dataset([str(root / "data" / "text")], out, "chars", quiet=True, force=True)


def test_windows_are_cut_anew_from_tokens_prepared_again(project) -> None:
    root, _ = project
    from window_lab.data import Windows

    def train_windows() -> tuple[Path, np.ndarray]:
        tokens, folder = root / "data" / "tokens", root / "data" / "windows"
        data = Windows(str(folder), prompt=2, tokens=str(tokens), block_size=16)
        path = data.cut("train")
        return path, np.load(path)

    old_path, old = train_windows()
    assert train_windows()[0] == old_path  # cut once, read after
    _prepare_again(root)
    new_path, new = train_windows()
    assert new_path != old_path
    ids = np.fromfile(root / "data" / "tokens" / "train.bin", dtype=np.uint16)
    assert np.array_equal(new[0], ids[:17]) and not np.array_equal(new, old)
    assert "data/windows/" in (root / ".gitignore").read_text().splitlines()


def test_a_run_is_not_resumed_on_tokens_of_another_tokenizer(project) -> None:
    root, fit = project
    done = nanolab_here(*fit, *WINDOWS_QUICK, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    _prepare_again(root)
    longer = [*WINDOWS_QUICK, "--trainer.max_steps", "4"]
    refused = nanolab_here(*fit, *longer, cwd=root)
    assert refused.returncode == 2, refused.stderr[-2000:]
    (line,) = [line for line in refused.stderr.splitlines() if "error" in line]
    assert line.startswith("nanolab fit: error: Windows.dataset_dir data/tokens: prepared with")
    assert "not the checkpoint's tokenizer" in line
    assert "start a new run without its checkpoint" in line and "allow_changed" not in line
    assert "Traceback" not in refused.stderr
    # A new run on the new tokens trains (on windows cut from them).
    fresh = nanolab_here(*fit, *WINDOWS_QUICK, "--run.name", "windows-new", cwd=root)
    assert fresh.returncode == 0, fresh.stderr[-2000:]


def test_windows_of_earlier_tokens_are_deleted_when_new_ones_are_cut(project) -> None:
    """Each ``prepare --force`` left the windows of the old tokens beside the new ones, piling
    up. Once the new ones are written, the example deletes its own files of the same split and
    tokens folder cut before those tokens, and nothing else: not another block_size's windows of
    the new tokens, not another tokens folder's windows in the same folder, not a file of
    another name. A run still reading a deleted file (memory-mapped) reads on: Linux frees the
    file when the last mapping goes."""
    import shutil

    root, _ = project
    from window_lab.data import Windows

    tokens, folder = root / "data" / "tokens", root / "data" / "windows"
    other_tokens = root / "data" / "other-tokens"
    shutil.copytree(tokens, other_tokens)

    def cut(split: str, block_size: int = 16, of: Path = tokens) -> Path:
        return Windows(str(folder), tokens=str(of), block_size=block_size).cut(split)

    old, old_val, other = cut("train"), cut("val"), cut("train", of=other_tokens)
    running = np.load(old, mmap_mode="r")  # a fit on the old tokens, still training
    expected = np.array(running[-1])
    (folder / "notes.npy").write_bytes(b"mine")
    _prepare_again(root)
    new = cut("train")
    assert not old.exists() and old_val.is_file()  # val's own go when val is cut anew
    assert np.array_equal(running[-1], expected)  # the running fit reads on
    wider = cut("train", block_size=24)  # the new tokens, another block_size: both kept
    assert new.is_file() and wider.is_file() and other.is_file()
    assert (folder / "notes.npy").read_bytes() == b"mine"
    cut("val")
    assert not old_val.exists()
    left = sorted(p.name for p in folder.iterdir())
    assert left == sorted([new.name, wider.name, other.name, "notes.npy", cut("val").name])
