"""The shipped GPU recipes, verbatim except size, accelerator, data and step count, on CPU.

Each row composes ``configs/gpt2-124m.yaml`` with the overlays a GPU user would give (a size,
a precision, a strategy), then ``configs/debug/cpu_check.yaml``, the shrink a user gives for the
same check: what CUDA switches on forced (fused AdamW), the model 1 layer x 32 wide on the
bundled characters; it trains 2 steps, then resumes
to 4 (the recipes' ``run.resume: auto``) and checks the run log: finite losses at every step,
the second launch resumed from step 2, and the run ended ``completed``. The fp16 row gives its
precision as the plugin (Lightning trains ``16-mixed`` as bf16 on a CPU) and checks the loss
scaler went through the checkpoint and the resume. The default row, the one
CI runs, keeps the recipe's ``model.compile: true``; so do the compile row and the FSDP row
(``configure_model`` shards the model with FSDP2, then compiles it: nanolab's own order, each
block's gather inside the compiled graph). The other slow rows turn it off, the one setting
besides size, accelerator and data a row changes: a cold CPU compile in each of two processes
costs more than the rest of a row (the compiled FSDP row: minutes a launch here), and DDP and
DeepSpeed wrap the LightningModule around the compiled model with no code of nanolab's between
them. Every file under configs/
is trained by a row here or by another test file, or is listed with why none trains it.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import QUICKSTART, nanolab_here, run_nanolab

from nanolab.runlog import read_records

CONFIGS = QUICKSTART.parent
# The shrink a user gives for the same check (docs/configs.md): 1 layer x 32 wide, CUDA's fused
# AdamW, compile off (the rows that keep it turn it back on), 2 micro-batches a step.
SHRINK = ["--config", str(CONFIGS / "debug" / "cpu_check.yaml"), "--run.resume", "auto"]

# On a CPU Lightning swaps ``precision: 16-mixed`` for bf16 (no loss scaling). The fp16 row gives
# the precision as the plugin a GPU run builds from it, on the CPU: fp16 autocast and a GradScaler
# (Lightning refuses a precision and a precision plugin together: the plugin replaces it).
FP16_ON_CPU = [
    "--trainer.precision", "null", "--trainer.plugins", json.dumps([{
        "class_path": "lightning.pytorch.plugins.MixedPrecision",
        "init_args": {"precision": "16-mixed", "device": "cpu"},
    }]),
]  # fmt: skip

# The base recipe (bf16-mixed) in the default suite; 350M also runs in the GPU check's dry run.
ROWS = {"124m": []}
SLOW_ROWS = {
    "124m+774m": (["gpt2-774m.yaml"], []),
    "124m+fp16": (["precision/fp16.yaml"], FP16_ON_CPU),
    "124m+350m": (["gpt2-350m.yaml"], []),
    "124m+fp32": (["precision/fp32.yaml"], []),
    "124m+ddp": (["strategy/ddp.yaml"], ["--trainer.devices", "2"]),
    "124m+fsdp": (["strategy/fsdp.yaml"], ["--trainer.devices", "2", "--model.compile", "true"]),
    "124m+deepspeed1": (["strategy/deepspeed_stage1.yaml"], ["--trainer.devices", "2"]),
    "124m+deepspeed2": (["strategy/deepspeed_stage2.yaml"], ["--trainer.devices", "2"]),
    "124m+deepspeed3": (["strategy/deepspeed_stage3.yaml"], ["--trainer.devices", "2"]),
    "124m+compile": ([], ["--model.compile", "true"]),
}


def _fit(tmp_path, char_dataset, overlays: list[str], extra: list[str], steps: int, here=False):
    """``nanolab fit`` of the recipe in a process of its own (``here``: in this one)."""
    files = ["gpt2-124m.yaml", *overlays]
    args = [a for f in files for a in ("--config", str(CONFIGS / f))]
    res = (nanolab_here if here else run_nanolab)(
        "fit", *args, *SHRINK, *extra, "--data.dataset_dir", str(char_dataset),
        "--data.source", "null", "--run.root", str(tmp_path / "runs"), "--run.name", "recipe",
        "--trainer.max_steps", str(steps), "--run.eval_every_steps", "2", cwd=tmp_path,
        **({} if here else {"timeout": 900}),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]


def _check_trained_and_resumed(tmp_path) -> None:
    log = tmp_path / "runs" / "recipe" / "metrics.jsonl"
    train = read_records(log, "train")
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert all(r["loss"] is not None and math.isfinite(r["loss"]) for r in train)
    starts = read_records(log, "start")
    assert [s["resumed_from_step"] for s in starts] == [None, 2]
    assert read_records(log, "end")[-1]["reason"] == "completed"


def _check_fp16_scaled_and_resumed(tmp_path) -> None:
    """Both launches trained fp16 (not Lightning's CPU bf16 swap), and the GradScaler's state
    went into the checkpoint and came back on resume: its count of good steps is 4, not 2."""
    run = tmp_path / "runs" / "recipe"
    starts = read_records(run / "metrics.jsonl", "start")
    assert [s["precision"] for s in starts] == ["16-mixed", "16-mixed"]
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 4
    scaler = ckpt["MixedPrecision"]
    assert scaler["scale"] > 0 and scaler["_growth_tracker"] == 4, scaler


# Rows with a check of their own, after the common one.
ROW_CHECKS = {"124m+fp16": _check_fp16_scaled_and_resumed}


@pytest.mark.parametrize("row", list(ROWS))
def test_a_gpu_recipe_trains_and_resumes_on_cpu(tmp_path, char_dataset, row):
    """Mutation caught: any recipe setting that cannot run with CUDA's fused AdamW and the
    recipes' clipping under its precision (the crash of the first GPU run). The first 2 steps
    train in this process; the resume is a process of its own, as a user's is."""
    as_shipped = ["--model.compile", "true"]  # the recipe's own setting, as CI must run it
    _fit(tmp_path, char_dataset, ROWS[row], as_shipped, 2, here=True)
    _fit(tmp_path, char_dataset, ROWS[row], as_shipped, 4)
    _check_trained_and_resumed(tmp_path)


@pytest.mark.slow  # two processes, DeepSpeed's CPU op build, a cold compile: minutes each
@pytest.mark.parametrize("row", list(SLOW_ROWS))
def test_a_gpu_recipe_with_a_strategy_or_compile_trains_and_resumes_on_cpu(
    tmp_path, char_dataset, row
):
    if "deepspeed" in row:
        pytest.importorskip("deepspeed")
    overlays, extra = SLOW_ROWS[row]
    _fit(tmp_path, char_dataset, overlays, extra, 2)
    _fit(tmp_path, char_dataset, overlays, extra, 4)
    _check_trained_and_resumed(tmp_path)
    ROW_CHECKS.get(row, lambda _: None)(tmp_path)


#: Shipped configs another test file trains (through ``fit``), and which: it names the file.
TRAINED_ELSEWHERE = {
    "quickstart.yaml": "tests/conftest.py",  # QUICKSTART: the fit tests' base config
    "finetune-gpt2.yaml": "tests/test_hf.py",
    "debug/fast_dev_run.yaml": "tests/test_debug_configs.py",
    "debug/overfit.yaml": "tests/test_debug_configs.py",
    "debug/profile.yaml": "tests/test_debug_configs.py",
    "strategy/deepspeed_stage3_offload.yaml": "tests/test_training.py",
}
#: Shipped configs no test trains, and why.
NOT_TRAINED = {
    "precision/bf16.yaml": "bf16-mixed, the base recipe's own precision: every row trains it",
    "strategy/multinode.yaml": "several machines: print_config only (tests/test_docker.py); "
    "its refusal on one machine in tests/test_trainer_refusals.py",
}


def test_every_shipped_config_is_trained_by_a_test_or_says_why_not():
    """Mutation caught: a config added under configs/ that no test trains (a recipe overlay with
    no row here, a preset no other test file launches), an entry naming a file that is gone,
    or another test file said to train a config it does not name."""
    shipped = {str(p.relative_to(CONFIGS)) for p in CONFIGS.rglob("*.yaml")}
    rows = {**{k: (v, []) for k, v in ROWS.items()}, **SLOW_ROWS}
    here = {"gpt2-124m.yaml", "debug/cpu_check.yaml"}  # the base and the shrink of every row
    here |= {overlay for overlays, _ in rows.values() for overlay in overlays}
    accounted = here | set(TRAINED_ELSEWHERE) | set(NOT_TRAINED)
    assert shipped - accounted == set(), "add a row, or say which test trains it or why none"
    assert accounted - shipped == set(), "a listed config is no longer shipped"
    for config, test in TRAINED_ELSEWHERE.items():
        stem = config.rsplit("/", 1)[-1].removesuffix(".yaml")
        assert f'"{stem}' in (CONFIGS.parent / test).read_text(), (config, test)
