"""fp16 mixed precision through ``nanolab fit``: the path a GPU's ``16-mixed`` run takes, on a CPU.

Lightning turns ``trainer.precision: 16-mixed`` into bf16 on a CPU, so ``fit`` itself would never
take fp16's path here. A config can give the plugin a GPU run gets instead::

    trainer:
      precision: null
      plugins:
        - class_path: lightning.pytorch.plugins.precision.MixedPrecision
          init_args: {precision: 16-mixed, device: cpu}

fp16 autocast, fp16 gradients and a real ``torch.amp.GradScaler``: through ``fit`` this takes
what tests/test_fused_amp.py and tests/test_divergence_fp16.py run on a plain Trainer, with
nanolab's callbacks around it: the fused-AMP step closure (fused AdamW, nanolab's clip at the
quickstart's 1.0), the divergence stop's loss-scale path, the run log's unscaled gradient norm,
and the scaler's state saved in every checkpoint and restored by a resume.

Each run is a branch (``--run.name branch --run.resume <step 3 of the other>``) of an
uninterrupted one, in this process (``nanolab_here``): the branch's steps must equal the
uninterrupted run's exactly.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import QUICKSTART, nanolab_here, tiny_overrides, write_config

from nanolab.runlog import read_records

STEPS, MIDDLE = 6, 3
FP16_PLUGIN = "lightning.pytorch.plugins.precision.MixedPrecision"
#: A loss scale no fp16 gradient survives: every step overflows, from 1e30 down to 1e30 / 2**6.
HUGE_SCALE = 1e30


def _config(tmp_path: Path, data: Path, fused: bool, init_scale: float | None = None) -> Path:
    cfg = tiny_overrides(
        data, tmp_path / "runs", run__name="full", run__eval_every_steps=MIDDLE,
        trainer__max_steps=STEPS, trainer__precision=None, model__gpt__dropout=0.0,
        model__optimizer={"fused": fused}, model__schedule={"warmup_steps": 2},
        checkpoint__every_n_steps=MIDDLE, checkpoint__keep_last=STEPS,
    )  # fmt: skip
    plugin: dict = {"precision": "16-mixed", "device": "cpu"}
    if init_scale is not None:
        plugin["scaler"] = {
            "class_path": "torch.amp.GradScaler",
            "init_args": {"device": "cpu", "init_scale": init_scale},
        }
    cfg["trainer"]["plugins"] = [{"class_path": FP16_PLUGIN, "init_args": plugin}]
    return write_config(tmp_path / f"fp16-{'fused' if fused else 'foreach'}.yaml", cfg)


def _fit_and_branch(tmp_path: Path, config: Path) -> tuple[Path, Path]:
    """The uninterrupted run ``full`` and ``branch``, resumed from its step-3 checkpoint."""
    base = ("fit", "--config", str(QUICKSTART), "--config", str(config))
    res = nanolab_here(*base, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    full = tmp_path / "runs" / "full"
    middle = full / "checkpoints" / f"step-{MIDDLE:08d}.ckpt"
    res = nanolab_here(*base, "--run.name", "branch", "--run.resume", str(middle), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    return full, tmp_path / "runs" / "branch"


def _train(run: Path) -> dict[int, tuple[float, float | None]]:
    """step -> (loss, gradient norm) of the run log's train records."""
    recs = read_records(run / "metrics.jsonl", "train")
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in recs}


def _checkpoint(run: Path, step: int) -> dict:
    return torch.load(run / "checkpoints" / f"step-{step:08d}.ckpt", weights_only=True)


def _assert_same_tensors(a: object, b: object, where: str) -> None:
    """Nested dicts/lists of tensors and numbers, equal to the bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            _assert_same_tensors(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same_tensors(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def test_fp16_fit_resumes_from_a_mid_checkpoint_exactly_fused_or_not(tmp_path, char_dataset):
    """``fit`` under fp16, fused AdamW and the per-tensor one, each clipped at 1.0: 6 steps,
    and a branch from step 3 whose steps 4-6 (loss, gradient norm), weights, optimizer state and
    GradScaler state equal the uninterrupted run's. The scaler's growth tracker reads 6 in both
    (3 restored + 3), not 3. The logged gradient norm is the true one (under 100), not times the
    scale 65536, and the two optimizers train to the same weights (atol 1e-5, rtol 1e-4).

    Mutations caught: the fused step closure not unscaling before the hooks (the logged norm is
    x65536); the scaler's state not restored on resume (the growth tracker reads 3); the
    precision plugin's fp16 replaced by bf16 (no ``MixedPrecision`` scaler state saved)."""
    finals = {}
    for fused in (False, True):
        work = tmp_path / ("fused" if fused else "foreach")
        work.mkdir()
        full, branch = _fit_and_branch(work, _config(work, char_dataset, fused))
        (start,) = read_records(full / "metrics.jsonl", "start")
        assert start["precision"] == "16-mixed"
        uninterrupted, resumed = _train(full), _train(branch)
        assert sorted(uninterrupted) == list(range(1, STEPS + 1))
        assert resumed == {s: uninterrupted[s] for s in range(MIDDLE + 1, STEPS + 1)}
        assert all(math.isfinite(loss) for loss, _ in uninterrupted.values())
        assert all(norm is not None and 0 < norm < 100 for _, norm in uninterrupted.values())
        a, b = _checkpoint(full, STEPS), _checkpoint(branch, STEPS)
        assert [bool(g["fused"]) for g in a["optimizer_states"][0]["param_groups"]] == [fused] * 2
        for key in ("state_dict", "optimizer_states", "MixedPrecision"):
            _assert_same_tensors(a[key], b[key], key)
        assert a["MixedPrecision"]["scale"] == 2.0**16  # no overflow at the default scale
        assert a["MixedPrecision"]["_growth_tracker"] == STEPS
        finals[fused] = a["state_dict"]
    for key, weights in finals[True].items():
        assert torch.allclose(weights, finals[False][key], atol=1e-5, rtol=1e-4), key


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_an_overflowing_fp16_scale_skips_steps_through_fit_and_resumes_with_them(
    tmp_path, char_dataset, fused
):
    """``init_scale: 1e30``: every fp16 gradient overflows, so the GradScaler skips all 6 steps
    and halves its scale each time (1e30 / 2**6 is still far above the divergence stop's floor
    of 1: a calibrating scaler, not a collapse, and the run completes). Each train record has a
    finite loss and a null gradient norm; no optimizer step was taken (the weights at steps 3
    and 6 are equal, AdamW's step count is 0); the divergence stop's skipped-step streak in the
    checkpoints counts 3, then 6, from step 1. The branch from step 3 carries the scaler's
    scale and that streak on: its step-6 checkpoint equals the uninterrupted run's.

    Mutations caught: the scaler's state not restored (the branch's scale is 1e30 / 2**3); the
    divergence stop's streak not restored (it counts 3 from step 4); the fused step closure
    losing GradScaler's inf check (the weights move, or become NaN)."""
    full, branch = _fit_and_branch(tmp_path, _config(tmp_path, char_dataset, fused, HUGE_SCALE))
    uninterrupted = _train(full)
    assert sorted(uninterrupted) == list(range(1, STEPS + 1))
    assert all(math.isfinite(loss) and norm is None for loss, norm in uninterrupted.values())
    assert _train(branch) == {s: uninterrupted[s] for s in range(MIDDLE + 1, STEPS + 1)}
    middle, end = _checkpoint(full, MIDDLE), _checkpoint(full, STEPS)
    _assert_same_tensors(middle["state_dict"], end["state_dict"], "state_dict")
    for ckpt in (middle, end):  # fused AdamW keeps a state per parameter, at step 0
        assert all(float(s["step"]) == 0 for s in ckpt["optimizer_states"][0]["state"].values())
    for ckpt, step in ((middle, MIDDLE), (end, STEPS)):
        assert ckpt["MixedPrecision"]["scale"] == pytest.approx(HUGE_SCALE / 2**step)
        assert ckpt["callbacks"]["DivergenceStop"]["skipped"] == [step, 1]
    resumed = _checkpoint(branch, STEPS)
    for key in ("state_dict", "optimizer_states", "MixedPrecision"):
        _assert_same_tensors(end[key], resumed[key], key)
    assert resumed["callbacks"]["DivergenceStop"]["skipped"] == [STEPS, 1]
    (ending,) = read_records(full / "metrics.jsonl", "end")
    assert ending["reason"] == "completed"
