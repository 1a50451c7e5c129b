"""Shared fixtures: a tiny prepared dataset, tiny configs, and a way to run the real CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from nanolab.data.prepare import prepare_dataset

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "configs" / "quickstart.yaml"

torch.set_num_threads(1)

# Lightning gives its loggers a StreamHandler bound to the sys.stderr of the moment it is first
# imported. Imported here, that is the session's capture stream; imported first inside a test
# that uses capsys, it would be that test's stream, closed afterwards, and every later Lightning
# log line would print "--- Logging error ---" into the stderr that other tests read.
import lightning.pytorch  # noqa: E402, F401


@pytest.fixture(scope="session")
def char_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled corpus, character-tokenized, prepared once per test session."""
    out = tmp_path_factory.mktemp("data") / "shakespeare_char"
    prepare_dataset(["bundled:shakespeare"], out, "chars", quiet=True)
    return out


def tiny_overrides(dataset_dir: Path, runs: Path, **extra: object) -> dict:
    """A 2-layer, 32-wide model on the prepared data: a step takes a few milliseconds."""
    cfg: dict = {
        "trainer": {
            "max_steps": 6,
            "enable_progress_bar": False,
            "enable_model_summary": False,
        },
        "model": {"gpt": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32}},
        "data": {
            "dataset_dir": str(dataset_dir),
            "source": None,
            "micro_batch_size": 4,
            "val_windows": 16,
        },
        "run": {"root": str(runs), "name": "tiny", "eval_every_steps": 3},
    }
    for dotted, value in extra.items():
        node = cfg
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return cfg


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_nanolab(
    *args: str, cwd: Path, timeout: float = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run the installed CLI as a user would, one thread per process (2 cores thrash otherwise)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "nanolab", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
