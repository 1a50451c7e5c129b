"""``model.compile: true`` (the GPU recipes' setting) compiles training once and validation once;
in-loop task evaluation runs eagerly and adds no graph. Counted with torch's own dynamo
counters, on CPU (torch compiles there too)."""

from __future__ import annotations

import pytest
import torch
from conftest import QUICKSTART, tiny_overrides, write_config

from nanolab.cli import main
from nanolab.runlog import read_records


@pytest.mark.slow  # two cold CPU compiles, ~1-2 min on 2 cores
def test_validation_compiles_once_and_task_evaluation_adds_no_graph(char_dataset, tmp_path):
    """Mutation caught: scoring the suite through the compiled module (a graph per prompt
    shape: 23 recompiles in the issue's run)."""
    from torch._dynamo.utils import counters

    cfg = tiny_overrides(
        char_dataset, tmp_path / "runs", trainer__max_steps=4, run__eval_every_steps=2,
        model__compile=True, model__gpt__dropout=0.0,
    )  # fmt: skip
    cfg["downstream"] = {"suite": "builtin:shakespeare", "limit": 8}
    path = write_config(tmp_path / "c.yaml", cfg)
    torch._dynamo.reset()
    counters.clear()
    assert main(["fit", "--config", str(QUICKSTART), "--config", str(path)]) == 0
    tasks = read_records(tmp_path / "runs" / "tiny" / "metrics.jsonl", "tasks")
    assert tasks  # the suite was scored in the loop (after the last validation)
    graphs = counters["stats"]["unique_graphs"]
    # One graph for training, one for validation (eval mode): none per scored prompt.
    assert graphs <= 2, dict(counters["stats"])
