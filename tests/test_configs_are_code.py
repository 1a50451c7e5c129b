"""Configs are code, checkpoints and run logs are data: the commands that only read a run never
import a class its files name (docs/guarantees.md, "Configs are code").

A run's ``config.yaml``, the ``start`` record of its log and its checkpoint's hyper-parameters
are made to name a class whose module writes a marker file when it is imported; ``report``,
``queue ls``, ``generate``, ``eval`` and ``export`` of that run must leave no marker.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import yaml
from conftest import QUICKSTART, nanolab_here, tiny_overrides, write_config

MARKER_MODULE = """
import os, pathlib
pathlib.Path(os.environ["MARKER_FILE"]).write_text("imported")

class Evil:
    def __init__(self, *args, **kwargs):
        pathlib.Path(os.environ["MARKER_FILE"]).write_text("instantiated")
"""


def test_reading_a_run_never_imports_the_classes_it_names(
    tmp_path: Path, char_dataset: Path, monkeypatch
):
    cfg = write_config(tmp_path / "t.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    fit = nanolab_here("fit", "--config", str(QUICKSTART), "--config", str(cfg), cwd=tmp_path)
    assert fit.returncode == 0, fit.stderr[-2000:]  # the run's files: made in this process
    run = tmp_path / "runs" / "tiny"
    # Name the marker class everywhere a run's files name classes.
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["trainer"]["callbacks"] = [{"class_path": "markermod.Evil", "init_args": {}}]
    config["model"]["class_path"] = "markermod.Evil"
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    lines = (run / "metrics.jsonl").read_text().splitlines()
    start = json.loads(lines[0])
    start["config"]["model"] = {"class_path": "markermod.Evil"}
    (run / "metrics.jsonl").write_text("\n".join([json.dumps(start), *lines[1:]]) + "\n")
    last = run / "checkpoints" / "last.ckpt"
    ckpt = torch.load(last, weights_only=True)
    ckpt["hyper_parameters"] = {"class_path": "markermod.Evil", "callbacks": ["markermod.Evil"]}
    torch.save(ckpt, last)

    (tmp_path / "mod").mkdir()
    (tmp_path / "mod" / "markermod.py").write_text(MARKER_MODULE)
    marker = tmp_path / "marker"
    commands = [
        ("report", str(tmp_path / "runs")),
        ("queue", "ls", "--db", str(tmp_path / "q.db")),
        ("generate", "--ckpt", str(last), "--prompt", "ROMEO:", "--max-new-tokens", "5"),
        ("eval", str(run), "--limit", "5", "--no-log"),
        ("export", "--ckpt", str(last), "--format", "safetensors", "-o", str(tmp_path / "out")),
    ]
    # In this process, the marker's module importable as a user's PYTHONPATH makes it: an
    # import of it by any command writes the marker (and leaves it in sys.modules).
    monkeypatch.syspath_prepend(str(tmp_path / "mod"))
    try:
        for command in commands:
            proc = nanolab_here(*command, cwd=tmp_path, env={"MARKER_FILE": str(marker)})
            assert proc.returncode == 0, (command, proc.stderr[-2000:])
            assert not marker.exists(), f"nanolab {command[0]} imported a class the run names"
            assert "markermod" not in sys.modules, command
        # The check can fail: fit with that config does import it (configs are code).
        nanolab_here("fit", "--config", str(run / "config.yaml"), "--run.name", "other",
                     cwd=tmp_path, env={"MARKER_FILE": str(marker)})  # fmt: skip
    finally:
        sys.modules.pop("markermod", None)
    assert marker.exists()
