"""The fork story, end to end, as a researcher would live it.

``nanolab init`` writes a project; the project's own README is then followed as written: its
Python blocks are added to the files they name (an attention variant in ``model.py``, a dataset
class in ``data.py``), its YAML blocks become the config files they name, and its commands run,
``pip install -e .`` first, in a virtual environment of the project's own. Then every verb works
on the project's classes: ``fit``; ``estimate``, whose parameter count follows the new attention;
a run killed with SIGKILL and resumed with ``run.resume: auto``, whose weights end bit-identical
to a run never stopped; ``queue add``; ``report``.

Everything the story writes is inside the temporary folder: nanolab itself is only imported. No
``PYTHONPATH``: the project's package is found because it is installed. The venv sees this
interpreter's packages (nanolab, torch, setuptools) and pip installs into it only, with
``--no-deps --no-build-isolation --no-index``: nothing is downloaded and the test's environment
is not touched.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shlex
import signal
import site
import subprocess
import sys
import sysconfig
import time
from importlib import resources
from pathlib import Path

import pytest
import torch

from nanolab.model import GPT, GPTConfig
from nanolab.runlog import read_records
from nanolab.scaffold import write_project

pytestmark = pytest.mark.slow

NAME = "tiny-poems"
PACKAGE = "tiny_poems"
#: Small and short: every fit in the story gets these on top of the README's command.
QUICK = [
    "--trainer.max_steps", "8", "--run.eval_every_steps", "4", "--checkpoint.every_n_steps", "4",
    "--model.init_args.gpt.n_layer", "2", "--model.init_args.gpt.n_embd", "32",
    "--model.init_args.gpt.n_head", "2", "--model.init_args.gpt.block_size", "32",
    "--data.init_args.micro_batch_size", "4", "--data.init_args.val_windows", "4",
]  # fmt: skip
#: The interrupted run: long enough that SIGKILL lands well before its end.
LONG = {"--trainer.max_steps": "150", "--checkpoint.every_n_steps": "10"}


def _shakespeare(chars: int) -> str:
    blob = resources.files("nanolab.data").joinpath("corpus", "shakespeare.txt.gz").read_bytes()
    return gzip.decompress(blob).decode("utf-8")[:chars]


def _records(text: str) -> str:
    """Question/answer records from consecutive lines, as the README's example has them."""
    lines = [line for line in text.splitlines() if line.strip()]
    pairs = zip(lines[::2], lines[1::2], strict=False)
    return "".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in pairs)


def _venv(where: Path) -> Path:
    """A venv for the project that also sees this interpreter's packages; its python."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(where)],
        check=True,
    )
    python = where / ("Scripts" if os.name == "nt" else "bin") / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    # This interpreter's site directories (a venv's are not "system" ones), .pth files included
    # (nanolab may itself be an editable install).
    ours = dict.fromkeys([sysconfig.get_paths()["purelib"], *site.getsitepackages()])
    lines = "".join(f"import site; site.addsitedir({d!r})\n" for d in ours)
    (Path(purelib) / "_test_env_packages.pth").write_text(lines)
    return python


class Story:
    """Runs the README's commands in the project with the project's python."""

    def __init__(self, project: Path, python: Path) -> None:
        self.project = project
        self.python = python
        self.env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")

    def argv(self, command: list[str]) -> list[str]:
        if command[:3] == ["pip", "install", "-e"]:
            flags = ["--no-deps", "--no-build-isolation", "--no-index", "-q"]
            return [str(self.python), "-m", "pip", "install", *flags, *command[2:]]
        assert command[0] == "nanolab", command
        return [str(self.python), "-m", "nanolab", *command[1:]]

    def run(self, command: list[str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            self.argv(command), cwd=self.project, env=self.env,
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        assert proc.returncode == 0, f"{shlex.join(command)}\n{proc.stderr[-3000:]}"
        return proc

    def start(self, command: list[str]) -> subprocess.Popen:
        return subprocess.Popen(
            self.argv(command), cwd=self.project, env=self.env,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip


def _with(command: list[str], settings: dict[str, str]) -> list[str]:
    """``command`` with ``--key value`` settings replaced or added."""
    out = list(command)
    for key, value in settings.items():
        if key in out:
            out[out.index(key) + 1] = value
        else:
            out += [key, value]
    return out


def _sections(readme: str) -> dict[str, list[tuple[str, str]]]:
    """``## heading`` -> its fenced blocks, (language, text), in order."""
    out = {}
    for part in re.split(r"^## ", readme, flags=re.M)[1:]:
        heading, _, body = part.partition("\n")
        out[heading.strip()] = re.findall(r"```(\w+)\n(.*?)```", body, flags=re.S)
    return out


def _commands(blocks: list[tuple[str, str]]) -> list[list[str]]:
    lines = [line for lang, text in blocks if lang == "bash" for line in text.splitlines()]
    return [shlex.split(line) for line in lines if line.strip()]


def _apply_files(project: Path, blocks: list[tuple[str, str]]) -> list[str]:
    """Do what the section's Python and YAML blocks say: add code to the file a block names in
    its first line, or write the config it names. Returns the files touched."""
    touched = []
    for lang, text in blocks:
        if lang not in ("python", "yaml"):
            continue
        first = text.splitlines()[0]
        target = project / first.lstrip("# ").split()[0]
        assert project in target.resolve().parents, target
        if lang == "python":
            assert "(add at the end)" in first and target.is_file(), first
            with open(target, "a", encoding="utf-8") as f:
                f.write("\n\n" + text)
        else:
            assert not target.exists(), f"{target} would be replaced"
            target.write_text(text)
        touched.append(target.relative_to(project).as_posix())
    return touched


def _wait_for_a_checkpoint(log: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 600
    while not (log.is_file() and read_records(log, "checkpoint")):
        assert proc.poll() is None, proc.stderr.read()[-2000:] if proc.stderr else proc.returncode
        assert time.monotonic() < deadline, "no checkpoint within 10 minutes"
        time.sleep(0.01)


def _weights(run: Path) -> dict[str, torch.Tensor]:
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    return ckpt["state_dict"]


def test_the_fork_story(tmp_path: Path) -> None:
    project = tmp_path / NAME
    write_project(project)
    text = _shakespeare(60_000)
    (project / "data" / "text" / "plays.txt").write_text(text)
    (project / "data" / "records.jsonl").write_text(_records(text))
    story = Story(project, _venv(tmp_path / "venv"))
    sections = _sections((project / "README.md").read_text())
    assert list(sections) == [
        "Set up", "Train", "Change the attention", "Add a dataset", "A dataset of windows",
        "Interrupt, queue, compare",
    ]  # fmt: skip

    # -- Set up: the project installs, and is then importable from anywhere ----------------
    (install,) = _commands(sections["Set up"])
    story.run(install)
    where = subprocess.run(
        [story.python, "-c", f"import {PACKAGE}.model as m; print(m.__file__)"],
        cwd=tmp_path, env=story.env, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert Path(where) == project / "src" / PACKAGE / "model.py"

    # -- Train: prepare the text, fit on it, sample ----------------------------------------
    prepare, fit, generate = _commands(sections["Train"])
    story.run(prepare)
    # The project's callback, by class path from the installed package.
    sample = [f"--trainer.callbacks+={PACKAGE}.callbacks.SampleText"]
    sample += ["--trainer.callbacks.max_new_tokens", "8"]
    done = story.run(fit + QUICK + sample)
    assert "prepared" not in done.stderr, "fit reused what prepare made"
    assert "--- sample at step 4 ---" in done.stdout + done.stderr
    first = read_records(project / "runs" / NAME / "metrics.jsonl", "start")[0]
    assert first["config"]["model"]["class_path"] == f"{PACKAGE}.model.Model"
    assert first["config"]["data"]["class_path"] == f"{PACKAGE}.data.Data"
    story.run([*generate, "--max-new-tokens", "8"])

    # -- Change the attention: a registered variant, counted by the estimator --------------
    blocks = sections["Change the attention"]
    assert _apply_files(project, blocks) == [f"src/{PACKAGE}/model.py", "configs/mqa.yaml"]
    estimate, fit_mqa = _commands(blocks)
    est = json.loads(story.run([*estimate, "--json"]).stdout)
    vocab = json.loads((project / "data" / "tokens" / "meta.json").read_text())["vocab_size"]
    gpt = est["model"]["gpt"]
    assert gpt["attention_variant"] == "multi_query"
    plain = GPT(GPTConfig(**{**gpt, "vocab_size": vocab, "attention_variant": "causal"}))
    C, D, L = gpt["n_embd"], gpt["n_embd"] // gpt["n_head"], gpt["n_layer"]
    # The key and value projections shrink from C to D columns each, in every block.
    assert est["model"]["params"] == plain.num_params() - L * 2 * (C - D) * C
    story.run(fit_mqa + QUICK)
    start = read_records(project / "runs" / "mqa" / "metrics.jsonl", "start")[0]
    ran = start["config"]["model"]["init_args"]["gpt"]
    small = GPTConfig(**{**ran, "attention_variant": "causal"})
    C, D, L = small.n_embd, small.head_dim, small.n_layer
    assert start["num_params"] == GPT(small).num_params() - L * 2 * (C - D) * C

    # -- Add a dataset: a class of the project's, selected by class path -------------------
    blocks = sections["Add a dataset"]
    assert _apply_files(project, blocks) == [f"src/{PACKAGE}/data.py", "configs/records.yaml"]
    (fit_records,) = _commands(blocks)
    story.run(fit_records + QUICK)
    (text,) = (project / "data" / "tokens-records.text").glob("records-*.jsonl")
    rendered = text.read_text()
    docs = [json.loads(line)["text"] for line in rendered.splitlines()]
    assert docs[0].startswith("Q: ") and "\nA: " in docs[0]
    meta = json.loads((project / "data" / "tokens-records" / "meta.json").read_text())
    assert sum(meta["documents"].values()) == len(docs)  # one document per record
    assert (project / "data" / "tokens-records" / "meta.json").is_file()
    # Another template on the same tokens is refused, and rewrites nothing the run's resume
    # checks: the run extends afterwards (it was refused as "changed" once).
    other = _with(fit_records + QUICK, {"--run.name": "records2"})
    other += ["--data.init_args.template", "Question - {question}"]
    refused = subprocess.run(story.argv(other), cwd=project, env=story.env, capture_output=True,
                             text=True, timeout=600)  # fmt: skip
    assert refused.returncode == 2 and "already holds a dataset" in refused.stderr, refused.stderr
    assert text.read_text() == rendered
    story.run(_with(fit_records + QUICK, {"--trainer.max_steps": "10"}))

    # -- A dataset of windows: the window protocol, trained, stopped and resumed ---------------
    blocks = sections["A dataset of windows"]
    assert _apply_files(project, blocks) == [f"src/{PACKAGE}/data.py", "configs/windows.yaml"]
    (fit_windows,) = _commands(blocks)
    long_windows = _with(fit_windows + QUICK, LONG)
    proc = story.start(long_windows)
    windows_run = project / "runs" / "windows"
    _wait_for_a_checkpoint(windows_run / "metrics.jsonl", proc)
    proc.send_signal(signal.SIGTERM)  # a scheduler's preemption: checkpoint, exit 75
    assert proc.wait(timeout=120) == 75
    story.run(long_windows)  # the same command again resumes it
    resumed = read_records(windows_run / "metrics.jsonl", "start")[-1]
    assert resumed["resumed_from_step"] and 0 < resumed["resumed_from_step"] < 150
    assert resumed["config"]["data"]["class_path"] == f"{PACKAGE}.data.Windows"
    assert read_records(windows_run / "metrics.jsonl", "end")[-1]["step"] == 150
    # Its checkpoint keeps the tokens' tokenizer (the class names dataset_dir): it samples.
    story.run(["nanolab", "generate", "--ckpt", "runs/windows", "--prompt", "The",
               "--max-new-tokens", "4"])  # fmt: skip
    val = read_records(windows_run / "metrics.jsonl", "val")[-1]
    assert val["val_bpb"] is not None and val["val_loss"] > 0
    assert len(list((project / "data" / "windows").glob("train-*.npy"))) == 1

    # -- Interrupt: SIGKILL, resume, and the same weights as a run never stopped -----------
    commands = _commands(sections["Interrupt, queue, compare"])
    fit_both, queue_add, report = commands
    long = _with(fit_both + QUICK, LONG)
    straight = _with(long, {"--run.name": "straight"})
    story.run(straight)
    run = project / "runs" / fit_both[fit_both.index("--run.name") + 1]
    proc = story.start(long)
    _wait_for_a_checkpoint(run / "metrics.jsonl", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not read_records(run / "metrics.jsonl", "end"), "killed before it finished"
    story.run(long)  # the same command again
    resumed = read_records(run / "metrics.jsonl", "start")[-1]
    assert resumed["resumed_from_step"] and 0 < resumed["resumed_from_step"] < 150
    assert read_records(run / "metrics.jsonl", "end")[-1]["step"] == 150
    a, b = _weights(project / "runs" / "straight"), _weights(run)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ from a straight run"

    # -- Queue and report ---------------------------------------------------------------------
    story.run([*queue_add, "--set", "trainer.max_steps=8"])
    listed = story.run(["nanolab", "queue", "ls"]).stdout
    assert len(re.findall(r"-s[12] +pending\b", listed)) == 2, listed  # one job per seed
    table = story.run(report).stdout
    for name in (NAME, "mqa", "records", "windows", run.name, "straight"):
        assert name in table, f"{name} missing from the report:\n{table}"
